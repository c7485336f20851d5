"""Check a :class:`~precompute.config.PrecomputeConfig` before any work (no model is loaded).

Types come from the dataclass annotations (``int``, ``float``, ``bool``, ``str``, ``X | None``,
``dict[K, V]``, ``Any``), so a field the config gains is type-checked without touching this
module; on top of that come the range rules and enumerations declared below, and rules across
fields (``min_duration <= max_duration``). Every problem is reported as ``option: message``::

    sample_rate: expected a positive integer, got 'abc'
    image_resize: expected one of center_crop, pad, bucket, got 'foo'

``python -m precompute`` prints each as ``error: ...`` and exits with status 2.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Union

from .config import PrecomputeConfig

# -- rules beyond the annotations -------------------------------------------------------------------
POSITIVE_INT = ("sample_rate", "image_size", "samples_per_shard", "batch_size", "max_image_pixels",
                "min_image_side")
NON_NEGATIVE_INT = ("precision_samples",)
POSITIVE_FLOAT = ("max_duration",)
NON_NEGATIVE_FLOAT = ("min_duration", "silence_rms")
#: enumerations; :func:`choices` takes them from the modules that use them when importable
CHOICES: dict[str, tuple] = {
    "image_resize": ("center_crop", "pad", "bucket"),  # precompute.images.RESIZE_MODES
    "encoder_dtype": ("float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half"),
    "chat_template": ("auto", "llama3", "tokenizer"),  # precompute.chat.TEMPLATES
    "manifest_format": ("jsonl", "chatml", "llava", "csv", "parquet"),  # precompute.manifests.FORMATS
}
_SOURCES = {"image_resize": ("precompute.images", "RESIZE_MODES"), "chat_template": ("precompute.chat", "TEMPLATES"),
            "manifest_format": ("precompute.manifests", "FORMATS"),
            "encoder_dtype": ("precompute.encoders._common", "_DTYPES")}


def choices(name: str) -> tuple:
    """Accepted values of an enumerated option (from its module; :data:`CHOICES` as the fallback)."""
    import importlib

    mod, attr = _SOURCES.get(name, (None, None))
    try:
        return tuple(getattr(importlib.import_module(mod), attr)) if mod else CHOICES[name]
    except (ImportError, AttributeError):
        return CHOICES[name]


#: the VAE's spatial factor: ``image_size`` must be a multiple of it
IMAGE_MULTIPLE = 8
DEVICE_RE = re.compile(r"^(auto|cpu|mps|meta|(cuda|xpu|npu|hpu)(:\d+)?)$")
TOLERANCE_KEYS = {"latents_rel_err": (0.0, None), "codes_agreement": (0.0, 1.0)}
WAVEFORM_DIRECTIONS = ("in", "out", "all")
#: fields whose value is an encoder spec, and the registry table of their built-in names
ENCODER_SPECS = {"audio_tokenizer": "AUDIO_TOKENIZERS", "image_encoder": "IMAGE_ENCODERS",
                 "text_tokenizer": "TEXT_TOKENIZERS"}
DEFAULT_NAMES = {"audio_tokenizer": "dac", "image_encoder": "wan", "text_tokenizer": "bytes"}  # registry defaults


class ConfigError(ValueError):
    """One or more invalid options; ``problems`` is ``[(option, message)]``."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("; ".join(f"{k}: {m}" for k, m in problems))

    def lines(self) -> list[str]:
        return [f"{k}: {m}" for k, m in self.problems]


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _hint(v: Any) -> str:
    """For text that Python reads as a number but YAML does not (``1e-4``: YAML 1.1 wants ``1.0e-4``)."""
    if isinstance(v, str):
        try:
            float(v)
        except ValueError:
            return ""
        return f" (YAML reads {v} as text; write it with a dot, e.g. {float(v)!r})"
    return ""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any value"
    if origin in (Union, types.UnionType):
        parts = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin is dict or tp is dict:
        return "a mapping"
    if origin is list or tp is list:
        return "a list"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _matches(v: Any, tp: Any) -> tuple[str, str] | None:
    """None when ``v`` fits the annotation ``tp``, else ``(where, message)``; ``where`` is "" or the
    ``.key`` / ``[i]`` inside ``v`` that does not fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return None
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        if any(a is not type(None) and _matches(v, a) is None for a in args):
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:  # X | None: say what is wrong inside X
            bad = _matches(v, inner[0])
            if bad is not None and bad[0]:
                return bad
        return "", f"expected {_describe(tp)}, got {_show(v)}"
    if origin is dict or tp is dict:
        if not isinstance(v, Mapping):
            return "", f"expected a mapping, got {_show(v)}"
        for k, item in v.items() if args else ():
            if (bad := _matches(k, args[0])) is not None:
                return "", f"key {_show(k)}: {bad[1]}"
            if (bad := _matches(item, args[1])) is not None:
                return f".{k}{bad[0]}", bad[1]
        return None
    if origin is list or tp is list:
        if not isinstance(v, list):
            return "", f"expected a list, got {_show(v)}"
        for i, item in enumerate(v):
            if args and (bad := _matches(item, args[0])) is not None:
                return f"[{i}]{bad[0]}", bad[1]
        return None
    ok = {bool: lambda: isinstance(v, bool), int: lambda: _is_int(v), float: lambda: _is_number(v),
          str: lambda: isinstance(v, str)}.get(tp, lambda: not isinstance(tp, type) or isinstance(v, tp))
    if ok():
        return None
    return "", f"expected {_describe(tp) if tp in (bool, int, float, str) else tp.__name__}, got {_show(v)}"


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
        from .encoders import registry
        table = getattr(registry, ENCODER_SPECS[field])
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


def check_config(cfg: PrecomputeConfig) -> list[tuple[str, str]]:
    """Every problem of ``cfg`` as ``(option, message)``; empty when it is valid."""
    out: list[tuple[str, str]] = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        name, v = f.name, getattr(cfg, f.name)
        if name in POSITIVE_INT:
            if not _is_int(v) or v <= 0:
                out.append((name, f"expected a positive integer, got {_show(v)}"))
            continue
        if name in NON_NEGATIVE_INT:
            if not _is_int(v) or v < 0:
                out.append((name, f"expected an integer >= 0, got {_show(v)}"))
            continue
        optional = type(None) in typing.get_args(hints.get(name))
        if name in POSITIVE_FLOAT or name in NON_NEGATIVE_FLOAT:
            if v is None and optional:
                continue
            positive = name in POSITIVE_FLOAT
            if not _is_number(v) or (v <= 0 if positive else v < 0):
                what = "a positive number" if positive else "a number >= 0"
                out.append((name, f"expected {what}{' or null' if optional else ''}, got {_show(v)}{_hint(v)}"))
            continue
        if name == "num_workers":
            if not ((_is_int(v) and v >= 0) or v == "auto"):
                out.append((name, f"expected an integer >= 0 or 'auto', got {_show(v)}"))
            continue
        if name in CHOICES:
            if v is None and optional:
                continue
            known = choices(name)
            if not isinstance(v, str) or v not in known:
                out.append((name, f"expected one of {', '.join(known)}"
                                  f"{' or null' if optional else ''}, got {_show(v)}"))
            continue
        if name == "device":
            if not isinstance(v, str) or not DEVICE_RE.match(v):
                out.append((name, f"expected auto, cpu, cuda, cuda:N (or mps, xpu:N...), got {_show(v)}"))
            continue
        if name in hints and (bad := _matches(v, hints[name])) is not None:
            out.append((name + bad[0], bad[1]))
            continue
        if name in ENCODER_SPECS:
            _encoder_spec(name, v, out)
        elif name == "precision_tolerance":
            for k, x in v.items():
                if k not in TOLERANCE_KEYS:
                    out.append((f"{name}.{k}", f"unknown key; known: {', '.join(TOLERANCE_KEYS)}"))
                    continue
                lo, hi = TOLERANCE_KEYS[k]
                if not _is_number(x) or x < lo or (hi is not None and x > hi):
                    rng = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
                    out.append((f"{name}.{k}", f"expected a number {rng}, got {_show(x)}"))
        elif name == "extra_waveforms":
            for k, spec in v.items():
                where = f"{name}.{k}"
                if k == "audio" or not k.isidentifier():
                    out.append((where, "expected a field name (an identifier other than 'audio')"))
                extra = sorted(set(spec) - {"sample_rate", "direction"})
                if extra:
                    out.append((where, f"unknown key(s) {extra}; known: sample_rate, direction"))
                sr = spec.get("sample_rate", 1)
                if not _is_int(sr) or sr <= 0:
                    out.append((f"{where}.sample_rate", f"expected a positive integer, got {_show(sr)}"))
                d = spec.get("direction", WAVEFORM_DIRECTIONS[-1])
                if d not in WAVEFORM_DIRECTIONS:
                    out.append((f"{where}.direction", f"expected one of {', '.join(WAVEFORM_DIRECTIONS)}, "
                                                      f"got {_show(d)}"))
    # rules across fields (only where each side is itself valid)
    bad = {k for k, _ in out}
    if not bad & {"min_duration", "max_duration"} and cfg.max_duration is not None \
            and cfg.min_duration > cfg.max_duration:
        out.append(("min_duration", f"{cfg.min_duration} s is greater than max_duration {cfg.max_duration} s"))
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
