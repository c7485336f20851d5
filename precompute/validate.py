"""Check a :class:`~precompute.config.PrecomputeConfig` before any model loads, beyond what its annotations
say (types, choices and bounds: checked as it is read, :mod:`shardcache.config`): the device spelling, encoder and
producer specs against their registries, field names, rules across options; each problem as
``option: message``."""
from __future__ import annotations

import operator
from typing import Any

from shardcache.config import ConfigError, options
from shards import fields
from shards.tokens import WORLD_END, WORLD_START

from .config import PrecomputeConfig
from .encoders.options import DEVICE_PATTERN
from .encoders.registry import SPECS, spec_problems
from .identity import undeclared
from .producers import producer_problems
from .producers.image_features import image_features_problems

#: the VAE's spatial factor: ``image_size`` must be a multiple of it
IMAGE_MULTIPLE = 8


def _extra_fields(v: dict) -> list[tuple[str, str]]:
    """Each a producer spec (:func:`~.producers.producer_problems`) under a name shards.fields gives a kind
    and the job does not write itself (a plug-in's fields are declared when it loads)."""
    out = []
    for k, spec in v.items():
        plugin = isinstance(spec, dict) and "factory" in spec
        if not plugin and k in fields.BY_NAME and k not in fields.REGISTERED:
            out.append((f".{k}", f"{k!r} is written by the job itself (reserved); name a new field by its kind's "
                                 "rule (audio_<name>, codes_<name>...); image_features has its own option"))
        elif not plugin and fields.lookup(k) is None:
            out.append((f".{k}", f"{k!r} is not a field shards.fields knows (codes_<name>, audio_<name>... or "
                                 "a plug-in's declared field)"))
        else:
            out += [(f".{k}{s}", m) for s, m in producer_problems(spec, k)]
    return out


def _token(v: str) -> list[tuple[str, str]]:
    bad = not v.strip() or v != v.strip()
    return [("", f"expected a token string without surrounding whitespace, got {v!r}")] if bad else []


def _world(v: Any) -> list[tuple[str, str]]:
    if v is None or (len(v) == 2 and len(set(v)) == 2 and not any(_token(t) for t in v)):
        return []
    return [("", f"expected two different tokens [start, end] (e.g. [{WORLD_START}, {WORLD_END}]), got {list(v)!r}")]


#: per-option checks beyond type, choices and bounds (run where those passed); an encoder spec: its registry's
#: rules (:func:`~.encoders.registry.spec_problems`), null: none (no codes, no latents)
CUSTOM = {"device": lambda v: [] if v == "auto" or DEVICE_PATTERN.fullmatch(v) else [
              ("", f"expected auto, cpu, cuda, cuda:N (or mps, xpu:N...), got {v!r}")],
          "image_token": _token, "world_tokens": _world, "extra_fields": _extra_fields,
          "image_features": lambda v: [] if v is None else image_features_problems(**v),
          **{o: (lambda v, o=o: [] if v is None else spec_problems(v, *SPECS[o])) for o in SPECS}}


def check_config(cfg: PrecomputeConfig) -> list[tuple[str, str]]:
    """Every problem of ``cfg`` as ``(option, message)``, in the order of the options; empty when valid.
    Types, choices and bounds are not checked here: a config read from a file or flags was (shardcache.config)."""
    out = [(path + suffix, msg) for path in options(PrecomputeConfig) if path in CUSTOM
           for suffix, msg in CUSTOM[path](operator.attrgetter(path)(cfg))]
    bad = {k.split(".")[0] for k, _ in out}  # rules across options, where each side passed its own checks
    if cfg.min_duration > cfg.max_duration:
        out.append(("min_duration", f"{cfg.min_duration} s is greater than max_duration {cfg.max_duration} s"))
    if not bad & {"image_token", "world_tokens"} and cfg.world_tokens and cfg.image_token in cfg.world_tokens:
        out.append(("world_tokens", f"{cfg.image_token!r} is the image placeholder (image_token)"))
    if cfg.image_size % IMAGE_MULTIPLE:
        out.append(("image_size", f"expected a multiple of {IMAGE_MULTIPLE} (the VAE's spatial factor), "
                                  f"got {cfg.image_size}"))
    if not bad & {"audio_tokenizer", "image_encoder", "text_tokenizer", "image_features", "extra_fields"}:
        out += undeclared(cfg)  # a spec key no encoder or producer declares an effect for
    return out


def validate_config(cfg: PrecomputeConfig) -> PrecomputeConfig:
    """Return ``cfg`` unchanged, or raise :class:`ConfigError` listing every invalid option."""
    if problems := check_config(cfg):
        raise ConfigError(problems)
    return cfg
