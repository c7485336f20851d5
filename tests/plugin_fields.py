"""A plug-in field of a kind the project does not ship (tests only): log-mel features ``mel`` float16
``(n_mels, frames)`` with a frame mask, declared here in one place (a kind + a field) and computed by
one producer; nothing in loaders/, train/ or shards/commands/ knows about it.

Used as ``extra_fields: {mel: {factory: plugin_fields:make_mel, kwargs: {n_mels: 8}}}`` at stage one,
``shardcache add-field CACHE --field mel --producer plugin_fields:make_mel`` later, and
``--model plugin_fields:MelModel`` for training. Processes that only read a cache (``shards
verify``, loader workers started by spawn) learn the field from ``SHARDCACHE_PLUGINS=plugin_fields``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from shards.cache import Contract
from shards.fields import Field, register
from shards.kinds import FieldKind, ValueCheck
from train.recipes.base import Recipe

#: rate and hop of the features (Whisper's: 16 kHz, 10 ms)
RATE, HOP = 16000, 160
#: the least value ``log(1e-5 + power)`` can take, less float16's rounding there
MEL_FLOOR = math.log(1e-5) - 0.01


@dataclass(frozen=True)
class LogFloor(ValueCheck):
    """Log-mel values: finite and not below ``floor`` (the kind's own check, declared only here)."""

    floor: float

    def find(self, a):
        x = a.astype(np.float32)
        if not np.isfinite(x).all():
            return f"has {int((~np.isfinite(x)).sum())} non-finite value(s)"
        low = x[x < self.floor]
        return None if not low.size else f"value {low.flat[0]:g} below the log-mel floor {self.floor:.4g}"


class FrameFeatures(FieldKind):
    """float16 ``(n_mels, frames)``: ragged along frames, zero-padded, ``NAME_lengths`` frames and a
    ``NAME_mask`` ``(B, frames)``; ``n_mels`` fixed; the model sees float32 (widened on the device)."""

    name = "frame_features"
    model_dtype = "float32"
    lengths_axis = 1
    mask_axes = (1,)
    fixed_axes = (0,)

    def value_check(self, field, manifest):
        return LogFloor(MEL_FLOOR)


MEL = register(Field("mel", "float16", 2, FrameFeatures(), pad=0.0, lengths="mel_lengths", mask="mel_mask",
                     doc="log-mel features of every audio item at 16 kHz, concatenated along frames"))


def log_mel(wave: np.ndarray, n_mels: int) -> np.ndarray:
    """float32 ``(n_mels, ceil(len / HOP))``: ``log(1e-5 + mel power)`` of a 16 kHz waveform."""
    import librosa
    frames = -(-len(wave) // HOP)
    m = librosa.feature.melspectrogram(y=wave.astype(np.float32), sr=RATE, n_fft=400, hop_length=HOP,
                                       n_mels=n_mels, center=True)[:, :frames]
    return np.log(1e-5 + m).astype(np.float32)


def make_mel(field: str = "mel", device: str = "cpu", n_mels: int = 8):
    from precompute.producers import Producer

    class MelProducer(Producer):
        name = "mel"
        outputs = (field,)

        def rates(self):
            return {RATE}

        def describe(self):
            return {"producer": "mel", "n_mels": n_mels, "hop": HOP, "rate": RATE}

        def produce(self, samples, timer):
            out = []
            for s in samples:
                if not s.audio:
                    out.append({})
                    continue
                out.append({field: np.concatenate([log_mel(w[RATE], n_mels) for w in s.audio], axis=1)})
            return out

    return MelProducer()


class MelModel(Recipe):
    """Predicts mel frame t + 1 from frame t (masked MSE): trains on the plug-in field alone (a
    plug-in recipe: ``--model plugin_fields:MelModel``)."""

    fields = ("mel",)

    @classmethod
    def contract(cls, kwargs):
        return Contract("MelModel", fields=cls.fields)

    @classmethod
    def from_cache(cls, cache, kwargs, **_):
        return cls(**kwargs)

    def __init__(self, n_mels: int = 8, **_):
        super().__init__()
        self.proj = nn.Linear(n_mels, n_mels)
        self.seen_dtypes: set = set()

    def forward(self, batch):
        x, mask = batch["mel"], batch["mel_mask"]          # (B, n_mels, F) float32, (B, F) bool
        self.seen_dtypes.add(x.dtype)
        h = x.transpose(1, 2)                               # (B, F, n_mels)
        pred, target = self.proj(h[:, :-1]), h[:, 1:]
        ok = (mask[:, 1:] & mask[:, :-1]).unsqueeze(-1)
        err = ((pred - target) ** 2) * ok
        return err.sum() / ok.sum().clamp_min(1) / x.shape[1]


__all__ = ["FrameFeatures", "LogFloor", "MEL_FLOOR", "MEL", "make_mel", "log_mel", "MelModel", "torch"]
