"""A user's own audio tokenizer, loaded with --audio_tokenizer plugin_codec:make (tests only).

Codes are a deterministic function of the waveform (frame energy quantised into 4 codebooks);
clips longer than ``poison_s`` seconds make ``encode`` raise, to test that a bad sample inside a
batch costs only that sample.
"""
from __future__ import annotations

import math

import numpy as np


class EnergyCodec:
    sample_rate = 16000
    n_codebooks = 4
    codebook_size = 256
    hop_length = 320
    frame_rate = sample_rate / hop_length

    def __init__(self, poison_s: float = 1e9):
        self.poison_s = poison_s

    def encode(self, waveforms):
        out = []
        for w in waveforms:
            if len(w) > self.poison_s * self.sample_rate:
                raise ValueError(f"clip of {len(w)} samples is poisoned")
            frames = math.ceil(len(w) / self.hop_length)
            padded = np.zeros(frames * self.hop_length, np.float32)
            padded[:len(w)] = w
            energy = np.sqrt((padded.reshape(frames, -1) ** 2).mean(1))
            base = np.minimum((energy * 1000).astype(np.int64), 255)
            out.append(np.stack([(base + q * 17) % 256 for q in range(4)]).astype(np.int16))
        return out

    def describe(self):
        return {"class": "plugin_codec.EnergyCodec", "name": "energy", "config": {"poison_s": self.poison_s},
                "weights_sha256": "0" * 64}


def make(poison_s: float = 1e9, device: str = "cpu") -> EnergyCodec:
    return EnergyCodec(poison_s)
