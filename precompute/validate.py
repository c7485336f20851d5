"""Check a :class:`~precompute.config.PrecomputeConfig` before any work (no model is loaded).

Each option's type (its annotation) is checked when the config is read and its own rules
(``choices``, bounds: declared with the option in :mod:`precompute.config`) by
:func:`shardcache.config.check`; this module adds what one option cannot say alone: the device spelling, encoder specs (names from the registry, their
options), ``precision_tolerance`` keys, ``extra_waveforms`` entries, and rules across options
(``min_duration <= max_duration``, ``image_size`` a multiple of 8). Every problem is reported as
``option: message``::

    sample_rate: expected a number > 0 and <= 384000, got 0
    image_resize: expected one of center_crop, pad, bucket, stretch, got 'foo'

``shardcache precompute`` prints each as ``error: ...`` and exits with status 2.
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any

from shardcache import config as S
from shardcache.config import ConfigError

from .config import PrecomputeConfig

__all__ = ["ConfigError", "check_config", "validate_config", "CHOICES"]
_show = repr

#: enumerated options: the choices declared with each option (their lists live in precompute.config,
#: which the implementing modules import: one owner)
CHOICES: dict[str, tuple] = {p: f.metadata["choices"] for p, (_, f) in S.options(PrecomputeConfig).items()
                             if f.metadata.get("choices") and p != "num_workers"}


#: the VAE's spatial factor: ``image_size`` must be a multiple of it
IMAGE_MULTIPLE = 8
DEVICE_RE = re.compile(r"^(auto|cpu|mps|meta|(cuda|xpu|npu|hpu)(:\d+)?)$")
TOLERANCE_KEYS = {"latents_rel_err": (0.0, None), "codes_agreement": (0.0, 1.0)}
WAVEFORM_DIRECTIONS = ("in", "out", "all")
#: fields whose value is an encoder spec -> (module, table of their built-in names)
ENCODER_SPECS = {"audio_tokenizer": ("precompute.encoders.registry", "AUDIO_TOKENIZERS"),
                 "image_encoder": ("precompute.encoders.registry", "IMAGE_ENCODERS"),
                 "text_tokenizer": ("precompute.encoders.registry", "TEXT_TOKENIZERS"),
                 "image_features": ("precompute.producers.image_features", "VISION_ENCODERS")}
DEFAULT_NAMES = {"audio_tokenizer": "dac", "image_encoder": "wan", "text_tokenizer": "bytes",  # the tables' defaults
                 "image_features": "gemma3"}


def _encoder_spec(field: str, spec: Any, out: list[tuple[str, str]]) -> None:
    """``{name, pretrained, **options}`` (built-in) or ``{factory: "module:callable", kwargs}``."""
    if spec is None:
        return  # audio_tokenizer / image_encoder: null = no codes / no latents (type checked before)
    if not isinstance(spec, Mapping):
        return  # reported by the type check
    if "factory" in spec:
        f = spec["factory"]
        if not isinstance(f, str) or ":" not in f:
            out.append((f"{field}.factory", f"expected 'package.module:callable', got {_show(f)}"))
        extra = sorted(set(spec) - {"factory", "kwargs", "name"})
        if extra:
            out.append((field, f"unknown key(s) {extra} for a plug-in (factory, kwargs)"))
        if "kwargs" in spec and not isinstance(spec["kwargs"], Mapping):
            out.append((f"{field}.kwargs", f"expected a mapping, got {_show(spec['kwargs'])}"))
        return
    try:
        module, attr = ENCODER_SPECS[field]
        table = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):  # encoders not importable here: names are checked when loading
        return
    name = spec.get("name", DEFAULT_NAMES[field])
    if name not in table:
        out.append((f"{field}.name", f"expected one of {', '.join(sorted(table))} (or a factory), got {_show(name)}"))
        return
    accepted = set(getattr(table[name], "OPTIONS", ()) or ())
    unknown = sorted(set(spec) - {"name", "pretrained"} - accepted)
    if unknown and hasattr(table[name], "OPTIONS"):
        out.append((field, f"unknown option(s) {unknown} for {name!r}; accepted: {sorted(accepted)}"))


def _device(v: Any) -> list[tuple[str, str]]:
    if not isinstance(v, str) or not DEVICE_RE.match(v):
        return [("", f"expected auto, cpu, cuda, cuda:N (or mps, xpu:N...), got {_show(v)}")]
    return []


def _tolerance(v: Mapping) -> list[tuple[str, str]]:
    out = []
    for k, x in v.items():
        if k not in TOLERANCE_KEYS:
            out.append((f".{k}", f"unknown key; known: {', '.join(TOLERANCE_KEYS)}"))
            continue
        lo, hi = TOLERANCE_KEYS[k]
        if x < lo or (hi is not None and x > hi):
            rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
            out.append((f".{k}", f"expected a number {rng}, got {_show(x)}"))
    return out


def _waveforms(v: Mapping) -> list[tuple[str, str]]:
    """Each name must be a waveform field of the registry that no fixed field owns (``audio_16k``:
    shards.fields' ``audio_<name>`` rule; ``audio``, ``codes``, ``latents``... refused), with a
    ``sample_rate`` in the bounds of the option ``sample_rate`` and a ``direction``."""
    from shards import fields
    from shards.kinds import WAVEFORM

    out = []
    sr_meta = S.options(PrecomputeConfig)["sample_rate"][1].metadata
    for k, spec in v.items():
        where, f = f".{k}", fields.lookup(k)
        if k in fields.BY_NAME and k not in fields.REGISTERED:
            out.append((where, f"{k!r} is a field of its own (reserved); name it audio_<name>, e.g. audio_16k"))
        elif f is None or f.kind is not WAVEFORM:
            what = f"a {f.kind.name} field" if f is not None else "not a field shards.fields knows"
            out.append((where, f"{k!r} is {what}; a waveform field is named audio_<name>, e.g. audio_16k"))
        extra = sorted(set(spec) - {"sample_rate", "direction"})
        if extra:
            out.append((where, f"unknown key(s) {extra}; known: sample_rate, direction"))
        sr = spec.get("sample_rate")
        if not isinstance(sr, int) or isinstance(sr, bool) or not 0 < sr <= sr_meta["le"]:
            out.append((f"{where}.sample_rate", f"expected an integer > 0 and <= {sr_meta['le']}, got {_show(sr)}"))
        d = spec.get("direction", WAVEFORM_DIRECTIONS[-1])
        if d not in WAVEFORM_DIRECTIONS:
            out.append((f"{where}.direction", f"expected one of {', '.join(WAVEFORM_DIRECTIONS)}, got {_show(d)}"))
    return out


def _spec_check(field: str):
    def run(spec: Any) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        _encoder_spec(field, spec, out)
        return [(k[len(field):], m) for k, m in out]
    return run


def _token(v: Any) -> list[tuple[str, str]]:
    if not v.strip() or v != v.strip():
        return [("", f"expected a token string without surrounding whitespace, got {_show(v)}")]
    return []


def _world(v: Any) -> list[tuple[str, str]]:
    if v is None:
        return []
    if len(v) != 2 or len(set(v)) != 2 or any(_token(t) for t in v):
        return [("", f"expected two different tokens [start, end] (e.g. [<start_of_world>, <end_of_world>]), "
                     f"got {_show(list(v))}")]
    return []


def _image_features(v: Any) -> list[tuple[str, str]]:
    """``{name: gemma3, pretrained: DIR_OR_HUB_ID, dtype}`` (null: none): the encoder-spec check, and
    a ``pretrained`` and a ``dtype`` of the encoder dtypes (no plug-in form: a plug-in image encoder
    is a producer under ``extra_fields``)."""
    if v is None:
        return []
    if "factory" in v:
        return [("", "a plug-in image encoder is a producer: extra_fields: {NAME: {factory: ...}}")]
    out = _spec_check("image_features")(v)
    p = v.get("pretrained")
    if not isinstance(p, str) or not p.strip():
        out.append((".pretrained", f"expected a local directory or hub id (e.g. google/gemma-3-4b-it), got {_show(p)}"))
    from .config import ENCODER_DTYPES
    if "dtype" in v and v["dtype"] not in ENCODER_DTYPES:
        out.append((".dtype", f"expected one of {', '.join(ENCODER_DTYPES)}, got {_show(v['dtype'])}"))
    return out


#: per-option checks beyond type, choices and bounds (run where those passed)
CUSTOM = {"device": _device, "precision_tolerance": _tolerance, "extra_waveforms": _waveforms,
          "image_token": _token, "world_tokens": _world,
          **{f: _spec_check(f) for f in ENCODER_SPECS}, "image_features": _image_features}


def check_config(cfg: PrecomputeConfig) -> list[tuple[str, str]]:
    """Every problem of ``cfg`` as ``(option, message)``, in the order of the options; empty when valid."""
    out = S.check(cfg, CUSTOM)
    # rules across options (only where each side is itself valid)
    bad = {k.split(".")[0] for k, _ in out}
    if not bad & {"min_duration", "max_duration"} and cfg.max_duration is not None \
            and cfg.min_duration > cfg.max_duration:
        out.append(("min_duration", f"{cfg.min_duration} s is greater than max_duration {cfg.max_duration} s"))
    if not bad & {"image_token", "world_tokens"} and cfg.world_tokens and cfg.image_token in cfg.world_tokens:
        out.append(("world_tokens", f"{cfg.image_token!r} is the image placeholder (image_token)"))
    if "image_size" not in bad and cfg.image_size % IMAGE_MULTIPLE:
        out.append(("image_size", f"expected a multiple of {IMAGE_MULTIPLE} (the VAE's spatial factor), "
                                  f"got {cfg.image_size}"))
    return out


def validate_config(cfg: PrecomputeConfig) -> PrecomputeConfig:
    """Return ``cfg`` unchanged, or raise :class:`ConfigError` listing every invalid option."""
    problems = check_config(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg
