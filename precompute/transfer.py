"""Host-to-device copies of encoder inputs: from page-locked (pinned) host memory on CUDA.

A copy from pageable memory makes the CUDA driver stage it through its own pinned buffer first and
blocks the host thread until it is done; from pinned memory it is one DMA that returns at once
(``non_blocking``), ordered before the encoder's kernels on the same stream, so the host goes on
preparing the next batch while the copy runs.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def to_device(array: np.ndarray, device: Any, dtype: Any = None):
    """``array`` as a torch tensor on ``device`` (cast to ``dtype`` there when given).

    On CUDA the host copy is pinned and the transfer non-blocking (safe: the kernels that read the
    tensor run on the same stream, after the copy); elsewhere ``torch.from_numpy`` (no copy on CPU).
    """
    import torch
    host = torch.from_numpy(np.ascontiguousarray(array))
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    x = host.to(device, non_blocking=device.type == "cuda")
    return x if dtype is None else x.to(dtype)


__all__ = ["to_device"]
