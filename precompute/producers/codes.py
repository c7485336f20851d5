"""Codec tokens: ``codes`` (every audio item of a sample concatenated along frames) and
``audio_segments`` (where each item sits), or a sidecar ``codes_<codec>`` field added later.

Layout after Higgs-Audio's ``ChatMLDatasetSample`` (``audio_ids_concat`` + ``audio_ids_start``):
item ``k``'s codes are ``codes[:, code_start:code_start + code_frames]`` with ``ceil(samples /
hop)`` frames, and it stands at the ``k``-th ``<|AUDIO|>``/``<|AUDIO_OUT|>`` token of ``input_ids``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shards.schema import SEGMENT_COLUMNS

from ..effects import BYTES, SPEC
from ..encoders.base import codes_problem
from ..encoders.batching import Call
from ..encoders.capabilities import Pending, capabilities_of
from .base import JSON, Producer, Timer, encode_each, encoder_spec_problems

class CodesRefused(ValueError):
    """A clip's codes break the codec's declaration (:func:`precompute.encoders.base.codes_problem`): a row fault,
    its sample rejected ``encode_failed`` with this message (the field, the audio item and the value)."""


#: ``audio_segments`` direction column: 0 input (user/system turn), 1 output (assistant turn)
DIRECTION_CODE = {"in": 0, "out": 1}


def segments_table(sample: Any, frames: list[int]) -> np.ndarray:
    """int32 ``(n_items, 6)``: ``[item, turn, direction, code_start, code_frames, speaker]`` per audio
    item (``speaker``: index into the sample json's ``speakers``, -1 unknown)."""
    items = sample.conversation.audio
    speakers = list(dict.fromkeys(a.speaker for a in items if a.speaker))
    table = np.zeros((len(items), len(SEGMENT_COLUMNS)), dtype=np.int32)
    start = 0
    for k, (it, n) in enumerate(zip(items, frames)):
        table[k] = (k, it.turn, DIRECTION_CODE[it.direction], start, n, speakers.index(it.speaker) if it.speaker else -1)
        start += n
    return table


class CodesProducer(Producer):
    """``field`` int16 ``(n_codebooks, frames)`` from ``codec`` (an
    :class:`precompute.encoders.AudioTokenizer`) over every audio item at the codec's rate; with
    ``segments=True`` also ``audio_segments`` (the job's own codec). The items of one encoder batch
    go to the codec together (its calls: :meth:`precompute.encoders.audio.HFCodecTokenizer.plan`), a
    failing item rejects only its sample.

    A codec that batches (its declared :class:`~precompute.encoders.batching.BatchPolicy`) gives codes
    that depend on each clip's place in its call and the call's shape: they are recorded per item in
    the sample's json as ``FIELD_calls`` (``[[size, length, place] or null per audio item]``), and a
    sample that carries them (``sample.calls``, from a cached json: ``shardcache check``) is encoded
    in exactly those calls, zero slots elsewhere.

    Every clip's codes are checked against the codec's declaration before they are used
    (:func:`precompute.encoders.base.codes_problem`: integers, ``n_codebooks x`` the frames the codec's rule
    gives for the clip, codes in ``[0, codebook_size)``): a clip that breaks it rejects its sample
    (:class:`CodesRefused`, naming the field, the item and the value), built-in codec or plug-in."""

    name = "codes"
    OPTION_EFFECTS = {"producer": BYTES, "audio_tokenizer": SPEC}

    @classmethod
    def spec_problems(cls, field: str, **spec: Any) -> list[tuple[str, str]]:
        """The ``audio_tokenizer`` spec's problems (its declared options and bounds)."""
        return encoder_spec_problems("audio_tokenizer", spec)

    @classmethod
    def from_spec(cls, field: str, device: str = "cpu", audio_tokenizer: Any = None, **_: Any) -> "CodesProducer":
        """``{producer: codes, audio_tokenizer: {name, pretrained, ...}}``: the codec's codes as field ``field``."""
        from ..encoders import load_audio_tokenizer
        if not audio_tokenizer:
            raise ValueError(f"producer codes for {field!r} needs an audio_tokenizer spec ({{name, pretrained}})")
        return cls(load_audio_tokenizer(audio_tokenizer, device), field, segments=False)

    def __init__(self, codec: Any, field: str = "codes", segments: bool = True, device: str = "cpu"):
        self.codec, self.field = codec, field
        self.caps = capabilities_of(codec, device)  # declared: async submit, batch policy
        self.outputs = (field, "audio_segments") if segments else (field,)

    def rates(self) -> set[int]:
        return {int(self.codec.sample_rate)}

    def describe(self) -> dict[str, Any]:
        return self.codec.describe()

    def manifest_info(self) -> dict[str, Any]:
        c = self.codec
        return {"codec_sample_rate": int(c.sample_rate), "n_codebooks": int(c.n_codebooks),
                "codebook_size": int(c.codebook_size), "frame_rate": float(c.frame_rate)}

    @property
    def calls_key(self) -> str:
        """The json key of the recorded calls (``codes_calls``)."""
        return f"{self.field}_calls"

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        return self.submit(samples, timer).result()

    def _calls(self, clips: list, recorded: list) -> list[Call]:
        """The recorded calls (one per clip that has one), then the codec's plan for the others."""
        calls = [Call(r[0], r[1], tuple(i if p == r[2] else -1 for p in range(r[0])))
                 for i, r in enumerate(recorded) if r]
        rest = [i for i, r in enumerate(recorded) if not r]
        plan = self.codec.plan([clips[i].size for i in rest])
        return calls + [Call(c.size, c.length, tuple(rest[x] if x >= 0 else -1 for x in c.places)) for c in plan]

    def submit(self, samples: list, timer: Timer) -> Pending:
        rate, q = int(self.codec.sample_rate), int(self.codec.n_codebooks)
        items = [(j, k) for j, s in enumerate(samples) for k in range(len(s.audio)) if s.audio[k][rate].size]
        clips = [samples[j].audio[k][rate] for j, k in items]
        places: list = [None] * len(items)
        if self.caps.asynchronous:
            recorded = [(samples[j].calls.get(self.field) or [None] * (k + 1))[k] for j, k in items]
            calls = self._calls(clips, recorded)
            if self.caps.batching.batched:
                for c in calls:
                    for p, i in enumerate(c.places):
                        if i >= 0:
                            places[i] = [c.size, c.length, p]
            pending = self.codec.submit(clips, calls)
        else:  # a plug-in's synchronous encode(): clip lists, no places
            pending = Pending.done(encode_each(self.codec.encode, clips, timer))

        def finish() -> list[dict[str, Any] | Exception]:
            codes = pending.result()
            per: list[list] = [[np.zeros((q, 0), np.int16)] * len(s.audio) for s in samples]
            placed: list[list] = [[None] * len(s.audio) for s in samples]
            failed: dict[int, Exception] = {}
            for (j, k), c, at in zip(items, codes, places):
                if not isinstance(c, Exception):
                    why = codes_problem(c, self.codec, samples[j].audio[k][rate].size)
                    if why is None:
                        per[j][k], placed[j][k] = np.asarray(c).astype(np.int16, copy=False), at
                        continue
                    c = CodesRefused(f"{self.field}: audio item {k}: {why}")
                failed.setdefault(j, c)
            out: list[dict[str, Any] | Exception] = []
            for j, s in enumerate(samples):
                if j in failed:
                    out.append(failed[j])
                elif not s.audio:
                    out.append({})
                else:
                    d: dict[str, Any] = {self.field: np.concatenate(per[j], axis=1)}
                    if "audio_segments" in self.outputs:
                        d["audio_segments"] = segments_table(s, [c.shape[1] for c in per[j]])
                    if self.caps.batching.batched:
                        d[JSON] = {self.calls_key: placed[j]}
                    out.append(d)
            return out

        return Pending(finish)


class SegmentsProducer(Producer):
    """``audio_segments`` of a job without a codec (every item has 0 code frames)."""

    name = "segments"
    outputs = ("audio_segments",)
    host_only = True
    directions = frozenset()

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        return [{"audio_segments": segments_table(s, [0] * len(s.conversation.audio))} if s.conversation.audio
                else {} for s in samples]
