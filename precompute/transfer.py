"""Host-to-device copies of encoder inputs: from page-locked (pinned) host memory on CUDA.

A copy from pageable memory makes the CUDA driver stage it through its own pinned buffer first and
blocks the host thread until it is done; from pinned memory it is one DMA that returns at once
(``non_blocking``), ordered before the encoder's kernels on the same stream, so the host goes on
preparing the next batch while the copy runs. Outputs come back the same way (:func:`to_host`): one
non-blocking copy into pinned memory per call, and one wait per encoder batch.
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


def to_host(tensor):
    """``tensor`` on the host: on CUDA a non-blocking copy into pinned memory (valid once the stream has
    reached it: wait on an event recorded after it, :class:`precompute.encoders.capabilities.Pending`),
    elsewhere the tensor itself (detached)."""
    import torch
    if tensor.device.type != "cuda":
        return tensor.detach()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


__all__ = ["to_device", "to_host"]
