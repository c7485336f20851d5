"""A cached sample as a producer's input: what ``shardcache add-field`` feeds a producer.

Audio comes from the sample's stored ``audio`` waveform (at the cache's ``sample_rate``), resampled
on first use to each rate a producer asks for (the same soxr resampler stage one uses), so no
source audio file is read again. Images are decoded again from the source files the sample's json
names, with the cache's recorded preprocessing (they are not stored in the cache). The conversation
keeps what producers read: its audio items (direction, turn, speaker) and images.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shards.kinds import WAVEFORM

from ..conversation import AudioItem, Conversation, ImageItem


class _Rates(dict):
    """``{rate: float32 wave}`` of one item, resampled from the stored rate on first access."""

    def __init__(self, wave: np.ndarray, sample_rate: int):
        super().__init__({int(sample_rate): wave})
        self._wave, self._sr = wave, int(sample_rate)

    def __missing__(self, rate: int) -> np.ndarray:
        from ..audio import resample
        self[rate] = y = resample(self._wave, self._sr, int(rate)) if self._wave.size else self._wave
        return y


class CachedSample:
    """One sample read back from a cache (``ShardReader.get`` dict), with the attributes of
    :mod:`precompute.producers.base`. ``sample_rate``: the cache's ``sample_rate`` (Hz);
    ``image_loader``: ``path -> uint8 (H, W, 3)`` with the cache's preprocessing (None: images are
    not available, a producer that needs them raises)."""

    def __init__(self, got: dict[str, Any], sample_rate: int, image_loader: Any = None):
        meta = got.get("json") or {}
        self.key = got["__key__"]
        self.meta = meta
        self.input_ids, self.labels = got.get("input_ids"), got.get("labels")
        conv = Conversation()
        for it in meta.get("audio_items") or []:
            conv.audio.append(AudioItem(str(it.get("source", "")), int(it.get("turn", 0)),
                                        str(it.get("direction", "out")), float(it.get("offset_s") or 0.0),
                                        it.get("duration_s"), str(it.get("speaker") or "")))
        for im in meta.get("images") or []:
            conv.images.append(ImageItem(str(im.get("source", "")), int(im.get("turn", 0))))
        self.conversation = conv
        pcm, starts = got.get("audio"), got.get("audio_starts")
        self.audio: list[_Rates] = []
        if conv.audio and pcm is not None:
            bounds = starts.tolist() if starts is not None and len(starts) == len(conv.audio) + 1 \
                else [0, len(pcm)]
            wave = WAVEFORM.from_storage(pcm)
            self.audio = [_Rates(wave[a:b], sample_rate) for a, b in zip(bounds[:-1], bounds[1:])]
        self._image_loader = image_loader
        self._images: list[np.ndarray] | None = None
        self.model_images: list[np.ndarray] = []  # a producer with an image_input makes them itself
        self.calls: dict[str, list] = {}  # add-field encodes as a job would: its codec's own calls

    @property
    def images(self) -> list[np.ndarray]:
        if self._images is None:
            if self.conversation.images and self._image_loader is None:
                raise ValueError(f"sample {self.key!r}: images are not stored in the cache and no image loader "
                                 "was given")
            self._images = [self._image_loader(im.source) for im in self.conversation.images]
        return self._images


__all__ = ["CachedSample"]
