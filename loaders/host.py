"""Reused host memory for batches read in the loader's own process (``num_workers=0``).

Why: a batch of 32 samples of ~360 KiB is ~15 MB of tensors. Allocated afresh per batch, glibc
hands part of it back to the kernel when the previous batch is freed and the next one page-faults
it in again (page faults: docs/benchmarks.md). :class:`HostArena`
keeps a few blocks and lays each batch out in one (the layout of :func:`loaders.shm.layout_bytes`,
as a worker's shared-memory slot); a block is reused once every tensor of its batch is gone (the
tensors are views of one per-batch numpy view of the block whose finalizer runs when the last of
them is freed, the mechanism of :mod:`loaders.shm`). With ``pin`` (CUDA only) each batch is one
page-locked block from torch's caching host allocator instead: the batch is read straight into
memory the GPU copies from, with no other host copy, and torch reuses the block only once the
asynchronous copies recorded on it are done (a block reused by this arena could be overwritten
while a ``non_blocking`` copy still reads it).
"""
from __future__ import annotations

import threading
import weakref
from typing import Sequence

import numpy as np
import torch

from .shm import layout_bytes, lease, view, views

#: free blocks kept for reuse at least (a consumer holds one or two batches at a time, a device
#: prefetcher one more); a loader with read-ahead threads keeps what its threads can hold in flight
KEEP = 4
_MIB = 1 << 20


class HostArena:
    """Reusable blocks for batches (see the module docstring); picklable (a copy starts empty)."""

    def __init__(self, pin: bool = False, keep: int = KEEP):
        self.pin, self.keep = bool(pin), int(keep)
        self.blocks_made = 0  #: blocks allocated so far (each a fresh, page-faulted block)
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def allocate(self, layout: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> dict[str, torch.Tensor]:
        """Uninitialised tensors ``{name: tensor}`` (``(name, shape, dtype)`` entries), views of one block."""
        offsets, total = layout_bytes(layout)
        if self.pin:
            storage = torch.empty(total, dtype=torch.uint8, pin_memory=True).untyped_storage()
            return {name: view(storage, off, tuple(int(x) for x in shape), dtype)
                    for (name, shape, dtype), off in zip(layout, offsets)}
        with self._lock:  # the smallest free block that fits (by position: arrays do not compare)
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= total]
            block = self._free.pop(fits[-1]) if fits else None
        if block is None:
            size = -(-int(total * 1.25) // _MIB) * _MIB  # budget batches vary in size
            block = np.empty(size, dtype=np.uint8)
            self.blocks_made += 1
        held = lease(block, total)  # a new numpy object per batch: its life is the batch's
        weakref.finalize(held, self._give_back, block)
        return views(held, layout, offsets)

    def abandon(self) -> None:
        """(The interface of :class:`loaders.shm.SlotArena`: a block comes back when its tensors go.)"""

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            self._free.append(block)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].nbytes))

    def __getstate__(self):
        return {"pin": self.pin, "keep": self.keep}

    def __setstate__(self, state):
        self.__init__(**state)


__all__ = ["HostArena", "KEEP"]
