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


class PoolVAE:
    """A user's own image encoder (tests only): latents are a deterministic function of the pixels, the
    mean of each 8 x 8 cell per channel scaled to [-1, 1]: float32 ``(B, 3, 1, H / 8, W / 8)`` for uint8
    ``(B, H, W, 3)`` (numpy only, so the bytes do not depend on a machine's convolution kernels)."""

    spatial_factor = 8
    latent_channels = 3

    def encode(self, images):
        x = np.asarray(images, np.float32)
        b, h, w, c = x.shape
        f = self.spatial_factor
        cells = x.reshape(b, h // f, f, w // f, f, c).mean(axis=(2, 4)) / 127.5 - 1.0  # (B, H/8, W/8, 3)
        return np.ascontiguousarray(cells.transpose(0, 3, 1, 2)[:, :, None])

    def describe(self):
        return {"class": "plugin_codec.PoolVAE", "name": "pool", "config": {"spatial_factor": 8},
                "weights_sha256": "0" * 64}


def make_vae(device: str = "cpu"):
    return PoolVAE()
