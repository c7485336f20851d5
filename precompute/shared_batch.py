"""Decoded rows from the decode processes to the main process in one shared-memory buffer per batch.

A DataLoader worker's result is pickled through a pipe to the main process, which reads and
copies every byte of it: 3.2 MB of float32 waveforms per ChatML voice-cloning row (two 10 s clips
at 24 and 16 kHz), 3.2 ms per row of the main process on the development CPU, the process that
also drives the encoders. :func:`pack` (the workers' ``collate_fn``) copies every array of a
batch of :class:`~precompute.prepare.Prepared` rows into one uint8 tensor in shared memory; the
DataLoader's queue then passes only its handle (torch's tensor sharing), and :func:`unpack` in the
main process gives the rows back with their arrays as views of that buffer (no copy). The buffer is
freed when the last view of it goes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from .prepare import Prepared

#: byte alignment of each array in the buffer
ALIGN = 64


def _map(p: Prepared, fn: Callable) -> Prepared:
    """``p`` with ``fn`` applied to each of its arrays (audio at every rate, images, source images,
    ``input_ids``, ``labels``)."""
    one = lambda a: None if a is None else fn(a)  # noqa: E731
    return replace(p, audio=[{rate: fn(a) for rate, a in item.items()} for item in p.audio],
                   images=[fn(a) for a in p.images], source_images=[fn(a) for a in p.source_images],
                   input_ids=one(p.input_ids), labels=one(p.labels))


@dataclass
class SharedBatch:
    """``buffer``: uint8 ``(bytes,)`` tensor in shared memory; ``rows``: the batch's rows with each
    array replaced by its ``(offset, dtype, shape)`` in ``buffer``."""

    buffer: torch.Tensor
    rows: list[Prepared]


def pack(batch: list[Prepared]) -> SharedBatch:
    """``collate_fn`` of the decode workers: the rows' arrays copied into one shared-memory buffer."""
    placed: list[tuple[int, np.ndarray]] = []
    size = 0

    def place(a: np.ndarray) -> tuple[int, str, tuple[int, ...]]:
        nonlocal size
        a = np.ascontiguousarray(a)
        placed.append((size, a))
        spec = (size, a.dtype.str, a.shape)
        size = math.ceil((size + a.nbytes) / ALIGN) * ALIGN
        return spec

    rows = [_map(p, place) for p in batch]
    buffer = torch.empty(max(size, 1), dtype=torch.uint8).share_memory_()
    view = buffer.numpy()
    for offset, a in placed:
        view[offset:offset + a.nbytes] = a.reshape(-1).view(np.uint8)
    return SharedBatch(buffer, rows)


def unpack(batch: SharedBatch) -> list[Prepared]:
    """The rows of :func:`pack`, each array a view of the shared buffer."""
    view = batch.buffer.numpy()

    def take(spec: tuple[int, str, tuple[int, ...]]) -> np.ndarray:
        offset, dtype, shape = spec
        n = np.dtype(dtype).itemsize * math.prod(shape)
        return view[offset:offset + n].view(dtype).reshape(shape)

    return [_map(p, take) for p in batch.rows]


__all__ = ["SharedBatch", "pack", "unpack"]
