"""Batches from DataLoader workers through reusable shared-memory slots (no per-batch allocation).

Why: a worker that collates each batch into a *new* shared-memory block (what ``default_collate``
and our old ``allocate`` did) pays for the block every batch: creating it, page-faulting and
zeroing every fresh page while writing, passing a file descriptor through a socket, and, in the main
process, mapping it, faulting the pages in again and unmapping them when the batch is freed (what
that cost: docs/benchmarks.md).

How: each worker keeps up to ``max_slots`` shared-memory slots (:class:`SlotArena`). It collates a
batch straight into a free slot and sends a small :class:`SlotBatch` message (the layout: name,
byte offset, shape, dtype of each tensor, plus the non-tensor entries); the slot's storage travels
only the first time the slot is used. The main process (:class:`SlotReceiver`) maps each slot
once and hands out tensors that are views of it. A slot is free again when every tensor of its
batch is gone: each tensor is :func:`torch.from_numpy` of a numpy view of one per-batch numpy view
of the slot (:func:`views`), and that per-batch view's finalizer (which runs when the last tensor,
``detach()``-ed copy or ``.numpy()`` array of the batch is freed) clears the slot's flag in a
small shared int64 table. A consumer that keeps many batches never blocks a worker: with every
slot busy the worker collates into a one-off shared block, as before.

Flags hold a *token* per use (never 0: 0 means free) whose high bits are the loader's iteration
generation. Beside them the receiver records the id of the storage it has mapped for each slot: a
worker sends a slot's storage (a file descriptor through a socket, mapped again by the receiver)
only when the receiver has not mapped it yet, so an epoch after the first sends none (a message
that carried it and was dropped unread left no record: the storage goes again). The table is read
and written through numpy views (a torch element read and write pays torch's dispatch, several per
batch). The worker only takes a slot whose flag is 0; the receiver clears a flag only if it still
holds the token it handed out. Messages dropped unread (the DataLoader discards in-flight
batches of an iteration abandoned mid-epoch) would keep their slot busy forever, so at each new
``iter()`` :meth:`SlotReceiver.reclaim` frees the slots of older generations that no live batch
holds.

With ``pin_memory``, the DataLoader's pin thread calls :meth:`SlotBatch.pin_memory`, which copies
the batch from the slot into page-locked memory (so the slot is released at once).
"""
from __future__ import annotations

import itertools
import math
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: alignment (bytes) of each tensor inside a slot
ALIGN = 64
#: generation bits: token = generation << _GEN_SHIFT | use counter
_GEN_SHIFT = 40
_COUNTER_MASK = (1 << _GEN_SHIFT) - 1
#: slots grow to the batch size x this, rounded up to 1 MiB (budget batches vary in size)
_GROWTH = 1.25
_MIB = 1 << 20

_RECEIVERS: "weakref.WeakValueDictionary[int, SlotReceiver]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


def new_flags(num_workers: int, max_slots: int) -> torch.Tensor:
    """The shared slot table: int64 ``(2, num_workers, max_slots)`` in shared memory, all 0: ``[0]``
    each slot's token (0: free), ``[1]`` the storage id the receiver has mapped for it (0: none)."""
    return torch.zeros(2, max(num_workers, 1), max(max_slots, 1), dtype=torch.int64).share_memory_()


class _Table:
    """numpy views of the shared slot table (made in each process on first use)."""

    def __init__(self, flags: torch.Tensor):
        self.flags = flags
        self._np: np.ndarray | None = None

    def _array(self) -> np.ndarray:
        if self._np is None:
            self._np = self.flags.numpy()
        return self._np

    @property
    def tokens(self) -> np.ndarray:
        """``(num_workers, max_slots)``: each slot's token (0: free)."""
        return self._array()[0]

    @property
    def mapped(self) -> np.ndarray:
        """``(num_workers, max_slots)``: the storage id the receiver has mapped for each slot (0: none)."""
        return self._array()[1]

    def __getstate__(self):
        return {"flags": self.flags, "_np": None}


def layout_bytes(layout) -> tuple[list[int], int]:
    """Byte offsets (:data:`ALIGN`-aligned) of ``(name, shape, dtype)`` entries and the total."""
    offsets, total = [], 0
    for _, shape, dtype in layout:  # math.prod: np.prod costs more a call, a dozen per batch
        offsets.append(total)
        n = math.prod(shape) * dtype.itemsize
        total += -(-n // ALIGN) * ALIGN
    return offsets, max(total, ALIGN)


def view(storage: torch.UntypedStorage, byte_offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape``/``dtype`` at ``byte_offset`` of ``storage`` (shares it)."""
    item = dtype.itemsize
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(int(d), 1)
    return torch.empty(0, dtype=dtype).set_(storage, byte_offset // item, tuple(shape), tuple(reversed(stride)))


#: torch dtype -> numpy dtype, for the batch dtypes (numpy has no bfloat16: such tensors use :func:`view`)
NP_DTYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_, torch.int16: np.int16,
             torch.int32: np.int32, torch.float16: np.float16, torch.uint16: np.uint16, torch.uint8: np.uint8,
             torch.float64: np.float64}


def lease(block: np.ndarray, nbytes: int) -> np.ndarray:
    """A new uint8 array over ``block[:nbytes]`` that every view made of it keeps alive: built on a
    memoryview, not as a numpy view (numpy points the ``base`` of a view of a view at the array
    owning the memory, so a per-batch ``block[:n]`` would be freed, and its finalizer run, while
    the batch's tensors still use the block)."""
    return np.frombuffer(memoryview(block)[:nbytes], dtype=np.uint8)


def views(block: np.ndarray, layout, offsets) -> dict[str, torch.Tensor]:
    """The tensors of ``layout`` (``(name, shape, torch dtype)``) at byte ``offsets`` of ``block``
    (a uint8 numpy array): each is ``torch.from_numpy`` of a numpy view of ``block``, so ``block``
    lives until the last of them (and of any ``.numpy()`` or view taken of them) is gone. Cheaper
    than :func:`view` per tensor (a dozen tensors per batch)."""
    out = {}
    for (name, shape, dtype), off in zip(layout, offsets):
        np_dtype = NP_DTYPES.get(dtype)
        if np_dtype is None:  # no numpy dtype: a view of the block's storage (it holds the block too)
            out[name] = view(torch.from_numpy(block).untyped_storage(), off, shape, dtype)
        else:
            out[name] = torch.from_numpy(np.ndarray(shape, np_dtype, block, off))
    return out


@dataclass
class _Slot:
    sid: int                       #: unique id of this storage (a slot grown later gets a new one)
    storage: torch.UntypedStorage

    @property
    def array(self) -> np.ndarray:
        """The slot as a uint8 numpy array (built once)."""
        a = self.__dict__.get("_array")
        if a is None:
            a = self.__dict__["_array"] = _as_array(self.storage)
        return a


def _as_array(storage: torch.UntypedStorage) -> np.ndarray:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).numpy()


@dataclass
class SlotBatch:
    """What a worker sends for a batch collated into a slot (picklable, small after the first use).

    ``layout``: ``[(name, byte_offset, shape, dtype)]`` of the tensors in the slot; ``extras``: the
    batch's other entries (keys, sample_rate, ...). ``storage`` is set when the receiver has not
    seen this slot's storage yet.
    """

    receiver: int
    worker: int
    slot: int
    sid: int
    token: int
    nbytes: int
    layout: list
    extras: dict
    storage: torch.UntypedStorage | None = None

    def unpack(self) -> dict[str, Any]:
        """The batch dict (tensors are views of the slot; it is freed when they all are)."""
        return _RECEIVERS[self.receiver].unpack(self)

    def pin_memory(self, device=None) -> dict[str, Any]:  # called by the DataLoader's pin thread
        """The batch copied into page-locked memory (the slot is released right away)."""
        batch = self.unpack()
        return {k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


class SlotArena:
    """Worker side: reusable slots of one DataLoader worker (see the module docstring).

    ``allocate(layout)`` returns the tensors of a batch as views of a free slot (or of a one-off
    shared block when every slot is busy); ``seal(batch)`` turns the collated batch into the message
    to send (a :class:`SlotBatch`, or the batch itself after a one-off allocation); ``abandon()``
    frees the slot of a batch that will not be sent.
    """

    def __init__(self, flags: torch.Tensor, worker: int, receiver: int):
        self.flags, self.worker, self.receiver = flags, int(worker), int(receiver)
        self.table = _Table(flags)
        self.max_slots = int(flags.shape[2])
        self.slots: list[_Slot | None] = [None] * self.max_slots
        self.generation = 0
        self._count = 0
        self._sids = itertools.count(1)
        self._pid = os.getpid()
        self._current: tuple[int, int, int] | None = None  # (slot, token, nbytes) of the open batch

    def start(self, generation: int) -> None:
        """A new iteration of the loader: tokens carry ``generation``."""
        self.generation = int(generation)

    def allocate(self, layout) -> dict[str, torch.Tensor]:
        offsets, total = layout_bytes(layout)
        k = self._take(total)
        if k is None:
            self._current = None
            return views(_as_array(torch.UntypedStorage._new_shared(total)), layout, offsets)
        return views(self.slots[k].array, layout, offsets)

    def _take(self, nbytes: int) -> int | None:
        row = self.table.tokens[self.worker]
        free = [k for k, v in enumerate(row.tolist()) if v == 0]  # one read of the row, not one per slot
        if not free:
            return None
        fits = [k for k in free if self.slots[k] is not None and self.slots[k].storage.nbytes() >= nbytes]
        k = fits[0] if fits else free[0]
        if not fits:  # a new slot, or a bigger one in place of a free small one
            size = -(-int(nbytes * _GROWTH) // _MIB) * _MIB
            self.slots[k] = _Slot((self._pid << 20) | next(self._sids), torch.UntypedStorage._new_shared(size))
        self._count += 1
        token = (self.generation << _GEN_SHIFT) | (self._count & _COUNTER_MASK) or 1
        row[k] = token
        self._current = (k, token, nbytes)
        return k

    def abandon(self) -> None:
        """Free the slot of the batch being collated: it will not be sent (a damaged sample was
        found; the batch is read again without it)."""
        if self._current is not None:
            k, token, _ = self._current
            row = self.table.tokens[self.worker]
            if int(row[k]) == token:
                row[k] = 0
            self._current = None

    def seal(self, batch: dict[str, Any]) -> SlotBatch | dict[str, Any]:
        if self._current is None:
            return batch
        k, token, nbytes = self._current
        self._current = None
        slot = self.slots[k]
        base = slot.storage.data_ptr()
        end = base + nbytes
        layout, extras = [], {}
        for name, v in batch.items():  # the tensors inside the slot travel as (offset, shape, dtype)
            if isinstance(v, torch.Tensor) and base <= v.data_ptr() < end and v.is_contiguous():
                layout.append((name, v.data_ptr() - base, tuple(v.shape), v.dtype))
            else:
                extras[name] = v
        mapped = int(self.table.mapped[self.worker, k]) == slot.sid  # the receiver has this storage
        return SlotBatch(self.receiver, self.worker, k, slot.sid, token, nbytes, layout, extras,
                         None if mapped else slot.storage)


class SlotReceiver:
    """Main-process side: maps each worker slot once, hands out batches as views, frees slots."""

    def __init__(self, flags: torch.Tensor):
        self.flags = flags
        self.table = _Table(flags)
        self.id = next(_ids)
        self._maps: dict[tuple[int, int], tuple[int, np.ndarray]] = {}
        self._live: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        _RECEIVERS[self.id] = self

    def unpack(self, msg: SlotBatch) -> dict[str, Any]:
        key = (msg.worker, msg.slot)
        with self._lock:
            if msg.storage is not None:
                self._maps[key] = (msg.sid, _as_array(msg.storage))
                self.table.mapped[key] = msg.sid
            sid, arr = self._maps[key]
            if sid != msg.sid:
                raise RuntimeError(f"worker {msg.worker} slot {msg.slot}: batch for storage {msg.sid} but "
                                   f"{sid} is mapped (messages out of order)")
            self._live[msg.token] = key
        held = lease(arr, msg.nbytes)  # a new numpy object per batch: its life is the batch's
        weakref.finalize(held, self._release, msg.worker, msg.slot, msg.token)
        out = dict(msg.extras)
        out.update(views(held, [(n, s, d) for n, _, s, d in msg.layout], [o for _, o, _, _ in msg.layout]))
        return out

    def _release(self, worker: int, slot: int, token: int) -> None:
        with self._lock:
            self._live.pop(token, None)
            tokens = self.table.tokens
            if int(tokens[worker, slot]) == token:
                tokens[worker, slot] = 0

    def reclaim(self, generation: int) -> int:
        """Free slots whose token is of a generation before ``generation`` and that no live batch
        holds (their messages were dropped unread); returns how many."""
        n = 0
        with self._lock:
            live = set(self._live)
            flat = self.table.tokens.reshape(-1)
            for i, tok in enumerate(flat.tolist()):
                if tok and (tok >> _GEN_SHIFT) < generation and tok not in live:
                    flat[i] = 0
                    n += 1
        return n


__all__ = ["SlotArena", "SlotReceiver", "SlotBatch", "new_flags", "layout_bytes", "view", "views", "lease",
           "NP_DTYPES", "ALIGN"]
