"""Stage-one producers: the code that computes each group of fields (see :mod:`.base`).

A job (:func:`job_producers`) runs, in order: :class:`~.text.TextProducer` (``input_ids``,
``labels``), a :class:`~.waveforms.WaveformProducer` for ``audio``,
:class:`~.codes.CodesProducer` (``codes`` + ``audio_segments``; without a codec
:class:`~.codes.SegmentsProducer`), :class:`~.latents.LatentsProducer` (``latents``, with
``store_posterior`` ``latents_logvar``), then one producer per ``extra_fields`` entry (e.g. a
``waveform`` ``audio_16k``).

Producers are registered by name in :data:`PRODUCERS`, shared by ``precompute`` (``extra_fields``)
and ``add-field`` (``--producer``): a spec is ``{"producer": NAME, **options}`` or a plug-in
``{"factory": "package.module:callable", "kwargs": {...}}``, the callable taking ``field=`` (the
name the field gets) and ``device=`` and returning a :class:`~.base.Producer`. Built-in names:
``codes`` (options: ``audio_tokenizer`` spec), ``waveform`` (``sample_rate``, ``direction``),
``latents`` (``image_encoder`` spec, ``store_posterior``), ``image_features`` (Gemma 3's vision
tower + projector: ``name``, ``pretrained``, ``dtype``, ``image_rgb``; :mod:`.image_features`; the
precompute config's ``image_features`` section runs it).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

from shardcache.config import BYTES, SPEC, Effect
from shardcache.plugins import load_factory

from .base import JSON, ImageTokens, Producer, Timer, encode_each, submit_each
from .codes import CodesProducer, SegmentsProducer, segments_table
from .latents import LatentsProducer, latents_info
from .text import TextProducer
from .waveforms import WaveformProducer, waveform_problems


def _codes(field: str, device: str, audio_tokenizer: Mapping | None = None, **_: Any) -> Producer:
    from ..encoders import load_audio_tokenizer
    if not audio_tokenizer:
        raise ValueError(f"producer codes for {field!r} needs an audio_tokenizer spec ({{name, pretrained}})")
    return CodesProducer(load_audio_tokenizer(audio_tokenizer, device), field, segments=False)


def _waveform(field: str, device: str, sample_rate: int, direction: str = "all") -> Producer:
    return WaveformProducer(field, sample_rate, None if direction == "all" else {direction}, always=False)


def _latents(field: str, device: str, image_encoder: Mapping | None = None, store_posterior: bool = False,
             **_: Any) -> Producer:
    from ..encoders import load_image_encoder
    if not image_encoder:
        raise ValueError(f"producer latents for {field!r} needs an image_encoder spec ({{name, pretrained}})")
    return LatentsProducer(load_image_encoder(image_encoder, device), bool(store_posterior), field)


def _image_features(field: str, device: str, **options: Any) -> Producer:
    from .image_features import make_image_features  # transformers' Gemma 3 only when asked for
    return make_image_features(field=field, device=device, **options)


#: registry name -> factory(field=, device=, **options) -> Producer
PRODUCERS: dict[str, Callable[..., Producer]] = {"codes": _codes, "waveform": _waveform, "latents": _latents,
                                                 "image_features": _image_features}
#: what each key of a producer's spec does to a cache (:class:`shardcache.config.Effect`, walked by
#: :mod:`precompute.identity`): ``SPEC``, an encoder spec whose keys its class declares; ``"*"``: the other
#: keys are an encoder spec of the producer's own name (image_features: ``name``, ``pretrained``, ``dtype``)
PRODUCER_EFFECTS: dict[str, dict[str, Effect]] = {
    "codes": {"producer": BYTES, "audio_tokenizer": SPEC},
    "waveform": {"producer": BYTES, "sample_rate": BYTES, "direction": BYTES},
    "latents": {"producer": BYTES, "image_encoder": SPEC, "store_posterior": BYTES},
    "image_features": {"producer": BYTES, "image_rgb": BYTES, "*": SPEC},
}


def producer_problems(spec: Any, field: str) -> list[tuple[str, str]]:
    """What keeps ``spec`` from making ``field`` (a plug-in's keys, a producer's name and options), as ``(key
    suffix, message)``: :func:`load_producer` raises the first, the precompute config check lists them all."""
    from ..encoders.registry import SPECS, spec_problems
    if not isinstance(spec, Mapping):
        return [("", f"expected {{producer: NAME, ...}} or {{factory: module:callable, kwargs}}, got {spec!r}")]
    if "factory" in spec:
        return spec_problems(spec, {}, "")
    if spec.get("producer") not in PRODUCERS:
        return [(".producer", f"expected one of {', '.join(PRODUCERS)} (or a plug-in: factory), "
                              f"got {spec.get('producer')!r}")]
    if spec["producer"] == "image_features":
        from .image_features import image_features_problems
        return image_features_problems(field, **spec)
    if spec["producer"] == "waveform":
        return waveform_problems(field, **spec)
    option = {"codes": "audio_tokenizer", "latents": "image_encoder"}[spec["producer"]]
    inner = spec.get(option)  # the encoder's own spec: its names, options and their values (SPECS' rules)
    return [(f".{option}{k}", m) for k, m in spec_problems(inner, *SPECS[option])] if isinstance(inner, Mapping) else []


def load_producer(spec: Mapping[str, Any], field: str, device: str = "cpu") -> Producer:
    """Build the producer of ``spec`` (see the module docstring) for field ``field`` on ``device``.

    Raises ``ValueError`` (:func:`producer_problems`, a producer whose outputs do not include
    ``field`` or are not declared fields), ``ImportError``/``AttributeError`` (plug-in not found).
    """
    from shards import fields as registry
    if problems := producer_problems(spec, field):
        raise ValueError(f"producer spec of {field}{problems[0][0]}: {problems[0][1]}")
    if "factory" in spec:
        producer = load_factory(spec["factory"])(field=field, device=device, **(spec.get("kwargs") or {}))
    else:
        producer = PRODUCERS[spec["producer"]](field=field, device=device,
                                               **{k: v for k, v in spec.items() if k != "producer"})
    if not isinstance(producer, Producer):
        raise ValueError(f"producer for {field!r} is a {type(producer).__name__}, not a precompute.producers.Producer")
    undeclared = [o for o in producer.outputs if registry.lookup(o) is None]
    if field not in producer.outputs or undeclared:
        raise ValueError(f"producer {producer.name!r} writes {list(producer.outputs)}: it must write {field!r} and "
                         f"only declared fields (undeclared: {undeclared}; declare them with shards.fields.register)")
    return producer


__all__ = ["Producer", "Timer", "encode_each", "submit_each", "ImageTokens", "JSON", "PRODUCERS", "load_producer", "TextProducer", "WaveformProducer",
           "CodesProducer", "SegmentsProducer", "LatentsProducer", "segments_table", "latents_info",
           "producer_problems"]
