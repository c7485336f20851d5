"""Waveform fields: every audio item of a sample at one rate, int16 PCM, plus item offsets.

``audio`` (all items at the job's ``sample_rate``) and each ``extra_fields`` entry of producer
``waveform`` (e.g. ``audio_16k``: the input-side items at 16 kHz for a Whisper-style encoder) are one producer each,
following Higgs-Audio's ``audio_waveforms_concat`` / ``audio_waveforms_start`` layout.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shards.kinds import WAVEFORM

from ..effects import BYTES
from .base import Producer, Timer

DIRECTIONS = ("in", "out")


def waveform_problems(field: str, sample_rate: Any = None, direction: Any = "all", producer: str = "waveform",
                      **unknown: Any) -> list[tuple[str, str]]:
    """What keeps producer ``waveform``'s options from working, as ``(key suffix, message)``: ``field``
    a waveform field (``audio_<name>``), ``sample_rate`` Hz, ``direction`` in | out | all. The one owner
    of these rules: the config check lists them before any encoder loads, the producer raises the first."""
    from shards import fields

    from ..config import MAX_SAMPLE_RATE
    out, f = [], fields.lookup(field)
    if f is not None and f.kind is not WAVEFORM:
        out.append(("", f"{field!r} is a {f.kind.name} field; a waveform field is named audio_<name>, e.g. audio_16k"))
    if not isinstance(sample_rate, int) or isinstance(sample_rate, bool) or not 0 < sample_rate <= MAX_SAMPLE_RATE:
        out.append((".sample_rate", f"expected an integer > 0 and <= {MAX_SAMPLE_RATE}, got {sample_rate!r}"))
    if direction not in (*DIRECTIONS, "all"):
        out.append((".direction", f"expected one of in, out, all, got {direction!r}"))
    if unknown:
        out.append(("", f"unknown key(s) {sorted(unknown)}; known: sample_rate, direction"))
    return out


class WaveformProducer(Producer):
    """``NAME`` int16 ``(T,)``: the selected items at ``rate`` Hz concatenated (items of the other
    direction have length 0), ``NAME_starts`` int32 ``(n_items + 1,)``: item ``k`` is
    ``NAME[starts[k]:starts[k + 1]]``.

    ``directions``: the item directions it stores (``{"in", "out"}``: all). ``always``: write the
    members for every sample with audio; else (extra waveforms) only for samples that have an item
    of one of ``directions`` (no empty member for, e.g., the 16 kHz input audio of a TTS sample).
    """

    name = "waveform"
    host_only = True
    OPTION_EFFECTS = {"producer": BYTES, "sample_rate": BYTES, "direction": BYTES}

    @classmethod
    def spec_problems(cls, field: str, **spec: Any) -> list[tuple[str, str]]:
        return waveform_problems(field, **spec)

    @classmethod
    def from_spec(cls, field: str, device: str = "cpu", sample_rate: int = 0, direction: str = "all"
                  ) -> "WaveformProducer":
        """``{producer: waveform, sample_rate, direction: in | out | all}``: the items of ``direction`` at
        ``sample_rate`` Hz, written only for samples that have one."""
        return cls(field, sample_rate, None if direction == "all" else {direction}, always=False)

    def __init__(self, field: str, rate: int, directions: set[str] | None = None, always: bool = True):
        self.field, self.rate = field, int(rate)
        self.directions = frozenset(directions or DIRECTIONS)
        self.always = bool(always)
        self.outputs = (field, f"{field}_starts")

    def rates(self) -> set[int]:
        return {self.rate}

    def describe(self) -> dict[str, Any]:
        return super().describe() | self.manifest_info()

    def manifest_info(self) -> dict[str, Any]:
        return {"sample_rate": self.rate, "directions": sorted(self.directions)}

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        out: list[dict[str, Any] | Exception] = []
        for s in samples:
            items = s.conversation.audio
            if not items or (not self.always and not any(it.direction in self.directions for it in items)):
                out.append({})
                continue
            waves = [WAVEFORM.to_storage(w[self.rate]) if it.direction in self.directions else np.zeros(0, np.int16)
                     for it, w in zip(items, s.audio)]
            starts = np.concatenate([[0], np.cumsum([len(w) for w in waves])]).astype(np.int32)
            out.append({self.field: np.concatenate(waves), f"{self.field}_starts": starts})
        return out
