"""Build encoders from small config dicts (as found in the precompute YAML).

Two forms are accepted by every loader:

- built-in: ``{"name": "dac", "pretrained": "descript/dac_24khz", **options}``. ``pretrained`` is a local
  directory or a Hugging Face hub id. Options are passed to the wrapper (e.g. ``dtype``,
  ``max_batch_size``, ``bandwidth`` for EnCodec, ``num_quantizers`` for Mimi, ``normalize`` for VAEs);
  unknown options raise ``ValueError`` listing the accepted ones.
- plug-in: ``{"factory": "mypkg.mod:make", "kwargs": {...}}``. The module is imported, ``make(**kwargs)``
  called (``device=`` is added for audio/image factories that accept it and do not get it in kwargs),
  and the result must satisfy the protocol (checked by :func:`check_protocol`).

The names are the keys of the registries (``AUDIO_TOKENIZERS``, ``IMAGE_ENCODERS``,
``TEXT_TOKENIZERS``, each owned by its module); ``--help``, the config checks and docs/ derive their
lists from them.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from shardcache.plugins import load_factory

from ._common import BUILD_HINT
from .audio import AUDIO_TOKENIZERS
from .base import AudioTokenizer, ImageEncoder, TextTokenizer, check_protocol
from .image import IMAGE_ENCODERS
from .options import problems as option_problems
from .text import TEXT_TOKENIZERS

_FACTORY_KEYS = {"factory", "kwargs", "name"}
#: the precompute option of each encoder spec -> (the table of its built-in names, the default name)
SPECS = {"audio_tokenizer": (AUDIO_TOKENIZERS, "dac"), "image_encoder": (IMAGE_ENCODERS, "wan"),
         "text_tokenizer": (TEXT_TOKENIZERS, "bytes")}


def _accepts(fn, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def spec_problems(spec: Mapping, table: Mapping[str, type], default: str) -> list[tuple[str, str]]:
    """What keeps an encoder spec from loading, as ``(key suffix, message)`` (empty: none): a plug-in's
    keys, else the name against ``table``, the options against the class's declared ``OPTIONS`` and each
    value against what its ``OPTION_EFFECTS`` entry says it takes (:mod:`precompute.encoders.options`).
    The one owner of these rules: the loaders below raise the first, the config check lists them all."""
    if "factory" in spec:
        f, extra, kw = spec["factory"], sorted(set(spec) - _FACTORY_KEYS), spec.get("kwargs")
        return [(k, m) for k, m, bad in (
            (".factory", f"expected 'package.module:callable', got {f!r}", not isinstance(f, str) or ":" not in f),
            ("", f"unknown key(s) {extra} for a plug-in; use 'factory' and 'kwargs'", extra),
            (".kwargs", f"expected a mapping, got {kw!r}", kw is not None and not isinstance(kw, Mapping))) if bad]
    name = spec.get("name", default)
    if name not in table:
        return [(".name", f"expected one of {', '.join(sorted(table))} (or a plug-in: {{factory: "
                          f"'package.module:callable', kwargs: {{...}}}}), got {name!r}")]
    if unknown := sorted(set(spec) - {"name", "pretrained"} - set(table[name].OPTIONS)):
        return [("", f"unknown option(s) {unknown} for {name!r}; accepted: {sorted(table[name].OPTIONS)}")]
    if spec.get("revision") and spec.get("pretrained"):   # before any encoder loads: a folder has no revisions
        from shardcache.weights import LocalRevision, checkpoint
        try:
            checkpoint(spec["pretrained"], revision=spec["revision"])
        except LocalRevision as e:
            return [(".revision", str(e))]
    return option_problems(spec, table[name].OPTION_EFFECTS)  # each value against its declaration


def _raise_problems(spec: Mapping, table: Mapping[str, type], default: str, what: str) -> None:
    if problems := spec_problems(spec, table, default):
        raise ValueError(f"{what}{problems[0][0]}: {problems[0][1]}")


def _from_factory(cfg: Mapping, protocol: type, what: str, device: Any | None):
    _raise_problems(cfg, {}, "", what)
    fn, kwargs = load_factory(cfg["factory"]), dict(cfg.get("kwargs") or {})
    if device is not None and "device" not in kwargs and _accepts(fn, "device"):
        kwargs["device"] = device
    obj = fn(**kwargs)
    return check_protocol(obj, protocol, what=f"{what} from factory {cfg['factory']!r}")


def _builtin(cfg: Mapping, table: dict[str, type], default: str, what: str):
    _raise_problems(cfg, table, default, what)
    return table[cfg.get("name", default)], {k: v for k, v in cfg.items() if k not in ("name", "pretrained")}


def _check_cfg(cfg: Any, what: str) -> Mapping:
    if not isinstance(cfg, Mapping):
        raise TypeError(f"{what} config must be a mapping like {{'name': ..., 'pretrained': ...}}, got {type(cfg).__name__}")
    return cfg


def _load_media_encoder(cfg: Any, table: dict[str, type], default: str, protocol: type, what: str,
                        device: Any):
    """The one path of :func:`load_audio_tokenizer` and :func:`load_image_encoder`."""
    cfg = _check_cfg(cfg, what)
    if "factory" in cfg:
        return _from_factory(cfg, protocol, what, cfg.get("device", device))
    cls, options = _builtin(cfg, table, default, what)
    options.setdefault("device", device)
    return cls.from_pretrained(cfg.get("pretrained"), **options)


def load_audio_tokenizer(cfg: Mapping, device: Any = "cpu") -> AudioTokenizer:
    """Build an :class:`AudioTokenizer` from ``cfg`` on ``device`` (``cfg["device"]`` wins if given).

    Example: ``load_audio_tokenizer({"name": "dac", "pretrained": "descript/dac_24khz"})``.

    Raises:
        ValueError: unknown name (the message lists the known ones) or option.
        FileNotFoundError: missing local model directory (the message says how to build test models).
        TypeError: a plug-in's result does not satisfy the protocol.
    """
    return _load_media_encoder(cfg, *SPECS["audio_tokenizer"], AudioTokenizer, "audio tokenizer", device)


def load_image_encoder(cfg: Mapping, device: Any = "cpu") -> ImageEncoder:
    """Build an :class:`ImageEncoder` from ``cfg`` on ``device`` (``cfg["device"]`` wins if given).

    Example: ``load_image_encoder({"name": "wan", "pretrained": "/ckpt/wan2.1-vae", "normalize": True})``.
    Raises as :func:`load_audio_tokenizer`.
    """
    return _load_media_encoder(cfg, *SPECS["image_encoder"], ImageEncoder, "image encoder", device)


def load_text_tokenizer(cfg: Mapping | None = None) -> TextTokenizer:
    """Build a :class:`TextTokenizer`; ``None`` or ``{}`` gives the :class:`ByteTokenizer`.

    Example: ``load_text_tokenizer({"name": "hf", "pretrained": "meta-llama/Llama-3.2-1B"})``.
    Raises as :func:`load_audio_tokenizer`; ``hf`` without ``pretrained`` raises ``ValueError``.
    """
    cfg = _check_cfg({} if cfg is None else cfg, "text tokenizer")
    if "factory" in cfg:
        return _from_factory(cfg, TextTokenizer, "text tokenizer", None)
    cls, options = _builtin(cfg, *SPECS["text_tokenizer"], "text tokenizer")
    if cls.PRETRAINED:
        return cls.from_pretrained(cfg.get("pretrained"), **options)
    if cfg.get("pretrained") is not None:
        raise ValueError(f"text tokenizer {cfg.get('name', 'bytes')!r} takes no 'pretrained'")
    return cls(**options)


__all__ = ["SPECS", "spec_problems", "load_audio_tokenizer", "load_image_encoder", "load_text_tokenizer", "load_factory", "BUILD_HINT"]
