"""A plug-in audio tokenizer whose codes break the protocol for clips longer than ``bad_s`` seconds (tests
only): ``mode`` says how (:data:`MODES`); shorter clips get :class:`plugin_codec.EnergyCodec`'s codes."""
from __future__ import annotations

import numpy as np

from plugin_codec import EnergyCodec

#: mode -> what the codes of a long clip become
MODES = {
    "nan": lambda c: np.where(np.arange(c.shape[1]) == 1, np.nan, c).astype(np.float32),  # float codes, a NaN
    "zero_frames": lambda c: c[:, :0],
    "one_frame": lambda c: c[:, :1],
    "triple_frames": lambda c: np.concatenate([c, c, c], axis=1),
    "codebooks": lambda c: c[:3],                                   # 3 of the 4 codebooks it declares
    "out_of_range": lambda c: np.where(np.arange(c.shape[1]) == 2, 256, c).astype(np.int16),  # codebook_size
}


class BadCodec(EnergyCodec):
    def __init__(self, mode: str, bad_s: float):
        super().__init__()
        self.mode, self.bad_s = mode, float(bad_s)

    def encode(self, waveforms):
        out = super().encode(waveforms)
        if self.mode == "fewer_outputs":  # one output short for any call holding a long clip
            return out[:-1] if any(len(w) > self.bad_s * self.sample_rate for w in waveforms) else out
        return [MODES[self.mode](c) if len(w) > self.bad_s * self.sample_rate else c for w, c in zip(waveforms, out)]

    def describe(self):
        return dict(super().describe(), **{"class": "plugin_bad_codec.BadCodec",
                                           "config": {"mode": self.mode, "bad_s": self.bad_s}})


def make(mode: str, bad_s: float = 2.5, device: str = "cpu") -> BadCodec:
    return BadCodec(mode, bad_s)
