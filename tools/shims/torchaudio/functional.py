"""``torchaudio.functional.resample`` of the test stand-in (see the package docstring)."""
from __future__ import annotations

import math


def resample(waveform, orig_freq: int, new_freq: int, **_ignored):
    """``torchaudio.functional.resample``'s contract with soxr ("HQ"): ``waveform`` float tensor
    ``(..., time)`` at ``orig_freq`` Hz -> ``(..., ceil(time * new_freq / orig_freq))`` at
    ``new_freq`` Hz, same dtype and device (computed on the CPU)."""
    import numpy as np
    import soxr
    import torch

    if int(orig_freq) == int(new_freq):
        return waveform
    x = waveform.detach().to("cpu", torch.float32).reshape(-1, waveform.shape[-1]).numpy()
    n = math.ceil(waveform.shape[-1] * int(new_freq) / int(orig_freq))
    out = np.zeros((x.shape[0], n), dtype=np.float32)
    for i, row in enumerate(x):
        y = soxr.resample(row, int(orig_freq), int(new_freq), "HQ")[:n]
        out[i, :len(y)] = y
    return torch.from_numpy(out).reshape(*waveform.shape[:-1], n).to(waveform.device, waveform.dtype)
