"""A plug-in audio tokenizer that hangs (tests only), loaded with ``--audio_tokenizer`` ``plugin_stall_codec:make``:
while the file ``hang_while`` exists, a call holding a clip longer than ``over_s`` seconds sleeps (looking at the
file every 50 ms: forever, unless the test removes it); otherwise it gives :class:`plugin_codec.EnergyCodec`'s
codes. ``describe()`` is EnergyCodec's: the two options change no code."""
from __future__ import annotations

import os
import time

from plugin_codec import EnergyCodec


class StallCodec(EnergyCodec):
    def __init__(self, hang_while: str, over_s: float):
        super().__init__()
        self.hang_while, self.over_s = str(hang_while), float(over_s)

    def encode(self, waveforms):
        if any(len(w) > self.over_s * self.sample_rate for w in waveforms):
            while os.path.exists(self.hang_while):
                time.sleep(0.05)
        return super().encode(waveforms)


def make(hang_while: str, over_s: float = 2.5, device: str = "cpu") -> StallCodec:
    return StallCodec(hang_while, over_s)
