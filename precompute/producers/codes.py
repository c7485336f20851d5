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

from .base import Producer, Timer, encode_each

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
    ``segments=True`` also ``audio_segments`` (the job's own codec). Items are encoded in one batch
    per encoder batch (:meth:`AudioTokenizer.encode`), a failing item rejects only its sample."""

    name = "codes"

    def __init__(self, codec: Any, field: str = "codes", segments: bool = True):
        self.codec, self.field = codec, field
        self.outputs = (field, "audio_segments") if segments else (field,)

    def rates(self) -> set[int]:
        return {int(self.codec.sample_rate)}

    def describe(self) -> dict[str, Any]:
        return self.codec.describe()

    def manifest_info(self) -> dict[str, Any]:
        c = self.codec
        return {"codec_sample_rate": int(c.sample_rate), "n_codebooks": int(c.n_codebooks),
                "codebook_size": int(c.codebook_size), "frame_rate": float(c.frame_rate)}

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        rate, q = int(self.codec.sample_rate), int(self.codec.n_codebooks)
        items = [(j, k) for j, s in enumerate(samples) for k in range(len(s.audio)) if s.audio[k][rate].size]
        codes = encode_each(self.codec.encode, [samples[j].audio[k][rate] for j, k in items], timer)
        per: list[list] = [[np.zeros((q, 0), np.int16)] * len(s.audio) for s in samples]
        failed: dict[int, Exception] = {}
        for (j, k), c in zip(items, codes):
            if isinstance(c, Exception):
                failed.setdefault(j, c)
            else:
                per[j][k] = np.asarray(c)
        out: list[dict[str, Any] | Exception] = []
        for j, s in enumerate(samples):
            if j in failed:
                out.append(failed[j])
            elif not s.audio:
                out.append({})
            else:
                d = {self.field: np.concatenate(per[j], axis=1)}
                if "audio_segments" in self.outputs:
                    d["audio_segments"] = segments_table(s, [c.shape[1] for c in per[j]])
                out.append(d)
        return out


class SegmentsProducer(Producer):
    """``audio_segments`` of a job without a codec (every item has 0 code frames)."""

    name = "segments"
    outputs = ("audio_segments",)

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        return [{"audio_segments": segments_table(s, [0] * len(s.conversation.audio))} if s.conversation.audio
                else {} for s in samples]
