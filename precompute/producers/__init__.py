"""Stage-one producers: the code that computes each group of fields (see :mod:`.base`).

A job (:func:`precompute.encode.job_producers`) runs, in order: :class:`~.text.TextProducer` (``input_ids``,
``labels``), a :class:`~.waveforms.WaveformProducer` for ``audio``, :class:`~.codes.CodesProducer` (``codes`` +
``audio_segments``; without a codec :class:`~.codes.SegmentsProducer`), :class:`~.latents.LatentsProducer`
(``latents``, with ``store_posterior`` ``latents_logvar``), then one producer per ``extra_fields`` entry (e.g. a
``waveform`` ``audio_16k``).

A producer a spec names is one class carrying all a spec needs of it (:data:`PRODUCERS`, the one table, shared
by ``precompute``'s ``extra_fields`` and ``add-field --producer``): its spec's keys and their effects
(``OPTION_EFFECTS``), their checks (``spec_problems``) and how it is made (``from_spec``). A spec is
``{"producer": NAME, **options}`` or a plug-in ``{"factory": "package.module:callable", "kwargs": {...}}``,
the callable taking ``field=`` (the name the field gets) and ``device=`` and returning a
:class:`~.base.Producer`. Built-in names: ``codes`` (options: ``audio_tokenizer`` spec), ``waveform``
(``sample_rate``, ``direction``), ``latents`` (``image_encoder`` spec, ``store_posterior``),
``image_features`` (Gemma 3's vision tower + projector: ``name``, ``pretrained``, ``dtype``, ``image_rgb``;
:mod:`.image_features`; the precompute config's ``image_features`` section runs it).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardcache.plugins import load_factory

from .base import JSON, ImageTokens, Producer, Timer, encode_each, submit_each
from .codes import CodesProducer, SegmentsProducer, segments_table
from .image_features import ImageFeaturesProducer
from .latents import LatentsProducer, latents_info
from .text import TextProducer
from .waveforms import WaveformProducer, waveform_problems

#: every producer a spec names, by name (``{producer: NAME, ...}``): the one table
PRODUCERS: dict[str, type[Producer]] = {c.name: c for c in (CodesProducer, WaveformProducer, LatentsProducer,
                                                            ImageFeaturesProducer)}


def producer_problems(spec: Any, field: str) -> list[tuple[str, str]]:
    """What keeps ``spec`` from making ``field`` (a plug-in's keys, a producer's name and options), as ``(key
    suffix, message)``: :func:`load_producer` raises the first, the precompute config check lists them all."""
    from ..encoders.registry import SPECS, spec_problems
    if not isinstance(spec, Mapping):
        return [("", f"expected {{producer: NAME, ...}} or {{factory: module:callable, kwargs}}, got {spec!r}")]
    if "factory" in spec:
        return spec_problems(spec, {}, "")
    cls = PRODUCERS.get(spec.get("producer"))
    if cls is None:
        return [(".producer", f"expected one of {', '.join(PRODUCERS)} (or a plug-in: factory), "
                              f"got {spec.get('producer')!r}")]
    return cls.spec_problems(field, **spec)


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
        producer = PRODUCERS[spec["producer"]].from_spec(field=field, device=device,
                                                         **{k: v for k, v in spec.items() if k != "producer"})
    if not isinstance(producer, Producer):
        raise ValueError(f"producer for {field!r} is a {type(producer).__name__}, not a precompute.producers.Producer")
    undeclared = [o for o in producer.outputs if registry.lookup(o) is None]
    if field not in producer.outputs or undeclared:
        raise ValueError(f"producer {producer.name!r} writes {list(producer.outputs)}: it must write {field!r} and "
                         f"only declared fields (undeclared: {undeclared}; declare them with shards.fields.register)")
    return producer


__all__ = ["Producer", "Timer", "encode_each", "submit_each", "ImageTokens", "JSON", "PRODUCERS", "load_producer",
           "TextProducer", "WaveformProducer", "CodesProducer", "SegmentsProducer", "LatentsProducer",
           "ImageFeaturesProducer", "segments_table", "latents_info", "producer_problems", "waveform_problems"]
