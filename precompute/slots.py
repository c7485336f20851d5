"""Decoded rows from the decode workers to the main process through reusable shared-memory slots.

Pickled through the DataLoader's pipes, a decoded row's waveforms (3.2 MB of float32 for a
voice-cloning row of two 10 s clips) cost the worker a copy into the pickle and the writes, and the
main process the reads and a copy out (docs/benchmarks.md). A new shared-memory block per batch
was tried and reverted: fresh pages cost more than the pipe. Here each decode worker keeps a few
slots (:class:`loaders.shm.SlotArena`, as the loaders' workers do) and copies a batch's arrays into
a free one; the message carries the rows without their arrays (the conversation, the rendered ids,
the error) and each array's place in the slot. The main process maps each slot once
(:class:`loaders.shm.SlotReceiver`) and gives the rows numpy views of it; the slot is free again
when the last view of its batch is gone (after the batch is encoded: the stored fields are new
arrays). With every slot of a worker busy the batch goes into a one-off block, as before.

The waveforms, images on the VAE grid and images for a model's processor travel this way; token
ids and labels (small) travel in the message.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from loaders.shm import SlotBatch, SlotArena, SlotReceiver, new_flags

from .faults import rebuild
from .prepare import Prepared


def _name(r: int, what: str, k: int, rate: int | None = None) -> str:
    return f"{r}.{what}{k}" if rate is None else f"{r}.{what}{k}.{rate}"


def _arrays(rows: list[Prepared]):
    """``(name, array)`` of every array of ``rows`` that goes into a slot."""
    for r, p in enumerate(rows):
        for k, waves in enumerate(p.audio):
            for rate, w in waves.items():
                yield _name(r, "a", k, rate), w
        for k, im in enumerate(p.images):
            yield _name(r, "i", k), im
        for k, im in enumerate(p.model_images):
            yield _name(r, "m", k), im


class RowCollate:
    """``collate_fn`` of the decode DataLoader (see the module docstring). In a worker: the batch's
    arrays in a slot, a :class:`loaders.shm.SlotBatch` sent; in the main process (``num_workers`` 0):
    the rows as they are. ``flags``/``receiver``: :func:`loaders.shm.new_flags` and the id of the main
    process's :class:`loaders.shm.SlotReceiver` (:func:`receiver`)."""

    def __init__(self, flags: Any, receiver: int):
        self.flags, self.receiver = flags, receiver
        self._arena: SlotArena | None = None

    def __call__(self, rows: list[Prepared]) -> Any:
        import torch
        from torch.utils.data import get_worker_info
        info = get_worker_info()
        if info is None:
            return rows
        if self._arena is None:
            self._arena = SlotArena(self.flags, info.id, self.receiver)
            self._arena.start(1)
        named = list(_arrays(rows))
        layout = [(n, tuple(a.shape), torch.from_numpy(np.empty(0, a.dtype)).dtype) for n, a in named]
        tensors = self._arena.allocate(layout)
        for n, a in named:
            np.copyto(tensors[n].numpy(), a)
        for p in rows:  # what travels pickled: the rows without their arrays
            p.audio = [dict.fromkeys(waves) for waves in p.audio]
            p.images = [None] * len(p.images)
            p.model_images = [None] * len(p.model_images)
        return self._arena.seal({**tensors, "rows": rows})


def receiver(num_workers: int, max_slots: int) -> tuple[SlotReceiver, RowCollate]:
    """The main process's :class:`loaders.shm.SlotReceiver` (keep it while the loader runs) and the
    workers' :class:`RowCollate`: ``max_slots`` reusable slots per worker."""
    rec = SlotReceiver(new_flags(num_workers, max_slots))
    return rec, RowCollate(rec.flags, rec.id)


def unpack(batch: Any) -> list[Prepared]:
    """The rows of a decode batch (a :class:`loaders.shm.SlotBatch` from a worker: its arrays become
    numpy views of the slot; else the list as it came). Raises the infrastructure fault a decode worker met on a
    row (:attr:`precompute.prepare.Prepared.fault`: out of host memory on a row within the limits), never a reject."""
    if isinstance(batch, list):
        return _faultless(batch)
    got = batch.unpack() if isinstance(batch, SlotBatch) else batch  # (a dict: every slot was busy)
    rows = got["rows"]
    for r, p in enumerate(rows):
        p.audio = [{rate: got[_name(r, "a", k, rate)].numpy() for rate in waves} for k, waves in enumerate(p.audio)]
        p.images = [got[_name(r, "i", k)].numpy() for k in range(len(p.images))]
        p.model_images = [got[_name(r, "m", k)].numpy() for k in range(len(p.model_images))]
    return _faultless(rows)


def _faultless(rows: list[Prepared]) -> list[Prepared]:
    for p in rows:
        if p.fault is not None:
            raise rebuild(*p.fault)
    return rows


__all__ = ["RowCollate", "receiver", "unpack"]
