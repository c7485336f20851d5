"""Cut an epoch's global order into steps, and each step into one batch per rank.

Split rule (both modes): the epoch is a list of *global steps*; step ``s`` holds ``world_size``
batches, one per rank, and rank ``r`` gets batch ``r`` of it. Every rank therefore has exactly
``n_steps`` batches. The state of an epoch is one number, the *cursor*: global samples consumed
before the next step (``cursors[s]``); it does not depend on the number of workers, and in
fixed mode not on the world size either.

* :class:`FixedPlan` (``batch_size``): ``G = world_size * batch_size``. Step ``s`` takes the
  samples ``order[s*G:(s+1)*G]``; rank ``r`` takes the contiguous slice
  ``order[s*G + r*B : s*G + (r+1)*B]`` (so concatenating the ranks' batches in rank order
  gives the global sequence). The tail ``N mod G`` is dropped, or with
  ``drop_remainder=False`` the order wraps around to fill the last step. Any two world sizes
  with the same ``G`` see the same samples in the same steps, and ``cursor = s*G``.
* :class:`BudgetPlan` (``max_frames``): the order is cut into windows of ``window`` samples;
  each window is sorted by codes frames and packed greedily into batches with
  ``len(batch) * max_frames_in_batch <= max_frames`` and ``len(batch) <= batch_size``; the
  batches of each window are shuffled (seeded), then consecutive groups of ``world_size``
  batches form the steps (tail dropped, or wrapped with ``drop_remainder=False``). The batches
  do not depend on the world size, so a resume with another world size works whenever the
  cursor falls on one of its step boundaries (always when shrinking to a divisor).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .order import rng_for

_BUDGET_TAG = 7919  # separates the batch-shuffle stream from the order streams


class Plan:
    """The steps of one epoch, for every rank.

    Attributes:
        n_steps: steps (batches per rank) in the epoch.
        cursors: int64 ``(n_steps + 1,)``; ``cursors[s]`` = global samples consumed before step ``s``.
    """

    n_steps: int
    cursors: np.ndarray

    def rank_batch(self, step: int, rank: int) -> np.ndarray:
        """int64 sample ids of ``rank``'s batch at ``step``."""
        raise NotImplementedError

    def step_at(self, cursor: int) -> int:
        """The step that starts at ``cursor``. ``ValueError`` if no step boundary is there."""
        s = int(np.searchsorted(self.cursors, cursor))
        if s > self.n_steps or self.cursors[s] != cursor:
            raise ValueError(
                f"cursor {cursor} is not a step boundary of this epoch (steps start at "
                f"{self.cursors[:4].tolist()}..., {self.cursors[-1]} samples in all): the checkpoint "
                "was written with another batch size, max_frames, world size or cache/filters")
        return s

    def batches(self):
        """Yield ``(step, rank, ids)`` for every batch of the epoch (for statistics and tests)."""
        world = getattr(self, "world_size")
        for s in range(self.n_steps):
            for r in range(world):
                yield s, r, self.rank_batch(s, r)


class FixedPlan(Plan):
    """Fixed batches: see the module docstring. ``order``: int64 ``(N,)`` global order of sample ids."""

    def __init__(self, order: np.ndarray, world_size: int, batch_size: int, drop_remainder: bool = True):
        self.world_size, self.batch_size = int(world_size), int(batch_size)
        G = self.global_batch = self.world_size * self.batch_size
        n = len(order)
        self.n_steps = n // G if drop_remainder else -(-n // G)
        self.ids = np.asarray(order[: self.n_steps * G]) if drop_remainder else np.resize(order, self.n_steps * G)
        self.cursors = np.arange(self.n_steps + 1, dtype=np.int64) * G

    def rank_batch(self, step: int, rank: int) -> np.ndarray:
        start = step * self.global_batch + rank * self.batch_size
        return self.ids[start:start + self.batch_size]


def pack_sorted(lengths: list[int], max_frames: int, max_batch: int) -> list[int]:
    """Greedy packing of ascending ``lengths``: batch sizes with ``size * max_len <= max_frames``.

    A single sample longer than ``max_frames`` gets a batch of its own.
    """
    sizes: list[int] = []
    n = 0
    for f in lengths:
        if n and ((n + 1) * f > max_frames or n >= max_batch):
            sizes.append(n)
            n = 0
        n += 1
    if n:
        sizes.append(n)
    return sizes


class BudgetPlan(Plan):
    """Frame-budget batches with length buckets: see the module docstring.

    Args:
        order: int64 ``(N,)`` global order of sample ids.
        frames: int ``(num_ids,)`` codes frames of every sample id (indexed by id).
        world_size: batches per step.
        max_frames: budget on padded frames per batch (``B * F_max``).
        max_batch: at most this many samples per batch.
        window: samples per sorting window (bigger: less padding, less randomness).
        rng: shuffles the batches inside each window.
        drop_remainder: drop the last ``n_batches mod world_size`` batches, else wrap around.
    """

    def __init__(self, order: np.ndarray, frames: np.ndarray, world_size: int, max_frames: int,
                 max_batch: int, window: int, rng: np.random.Generator, drop_remainder: bool = True):
        self.world_size = int(world_size)
        order = np.asarray(order, dtype=np.int64)
        lengths = np.asarray(frames)[order]
        too_long = int((lengths > max_frames).sum())
        if too_long:
            warnings.warn(f"{too_long} samples have more than max_frames={max_frames} codes frames; "
                          "each gets a batch of its own (filter them with filters={'n_frames': (0, max)})",
                          stacklevel=3)
        chunks, sizes = [], []
        window = max(int(window), 1)
        for w0 in range(0, len(order), window):
            seg = order[w0:w0 + window]
            srt = np.argsort(lengths[w0:w0 + window], kind="stable")
            seg_sorted = seg[srt]
            bs = pack_sorted(lengths[w0:w0 + window][srt].tolist(), max_frames, max_batch)
            bounds = np.concatenate([[0], np.cumsum(bs)])
            for b in rng.permutation(len(bs)):
                chunks.append(seg_sorted[bounds[b]:bounds[b + 1]])
                sizes.append(bs[b])
        n_batches = len(sizes)
        self.n_steps = n_batches // self.world_size if drop_remainder else -(-n_batches // self.world_size)
        n_used = self.n_steps * self.world_size
        self._batch_ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        self._bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._batch_index = np.arange(n_used, dtype=np.int64) % max(n_batches, 1)
        per_batch = np.diff(self._bounds)[self._batch_index] if n_batches else np.zeros(0, np.int64)
        per_step = per_batch.reshape(self.n_steps, self.world_size).sum(1) if n_used else np.zeros(0, np.int64)
        self.cursors = np.concatenate([[0], np.cumsum(per_step)]).astype(np.int64)
        self.n_batches = n_batches

    def rank_batch(self, step: int, rank: int) -> np.ndarray:
        b = int(self._batch_index[step * self.world_size + rank])
        return self._batch_ids[self._bounds[b]:self._bounds[b + 1]]


@dataclass
class PlanSpec:
    """Everything that determines the plans (picklable: DataLoader workers rebuild plans from it).

    ``order_fn(epoch) -> int64 ids`` gives the global order; ``frames`` (budget mode only) the
    codes frames of every id. ``plan(epoch)`` caches the last two epochs.
    """

    order_fn: Callable[[int], np.ndarray]
    world_size: int
    batch_size: int
    seed: int
    drop_remainder: bool = True
    max_frames: int | None = None
    frames: np.ndarray | None = None
    bucket_window: int = 0

    def __post_init__(self):
        self._cache: dict[int, Plan] = {}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"] = {}
        return state

    def plan(self, epoch: int) -> Plan:
        p = self._cache.get(epoch)
        if p is None:
            order = self.order_fn(epoch)
            if self.max_frames is None:
                p = FixedPlan(order, self.world_size, self.batch_size, self.drop_remainder)
            else:
                p = BudgetPlan(order, self.frames, self.world_size, self.max_frames, self.batch_size,
                               self.bucket_window, rng_for(self.seed, epoch, _BUDGET_TAG),
                               self.drop_remainder)
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[epoch] = p
        return p


def padding_stats(plan: Plan, frames: np.ndarray) -> dict[str, float]:
    """Padded vs real codes frames over every batch of ``plan``.

    Returns ``{"real", "padded", "ratio"}`` with ``padded = sum(B * F_max)`` and
    ``ratio = padded / real`` (1.0 = no padding).
    """
    frames = np.asarray(frames)
    real = padded = 0
    for _, _, ids in plan.batches():
        f = frames[ids]
        if len(f):
            real += int(f.sum())
            padded += int(len(f) * f.max())
    return {"real": float(real), "padded": float(padded), "ratio": padded / real if real else float("nan")}
