"""The global sample order of an epoch (no tar is opened; the filters on the index: :mod:`shards.filters`).

Order of epoch ``e`` (``shuffle=True``), a pure function of ``(seed, e)`` and the index:

1. permute the shards with ``numpy.random.default_rng([seed, e, tag])``
   (shards are numbered in sorted file-name order, so the index row order does not matter);
2. permute the samples inside each shard with the same generator;
3. concatenate (all samples of the first shard, then the next...): a permutation of the ``N``
   (filtered) samples, read shard by shard for locality;
4. optionally (``window > 1``) shuffle inside consecutive windows of ``window`` positions, a
   deterministic stand-in for a shuffle buffer that also mixes across shard boundaries.

``shuffle=False`` keeps index order (shards in name order, samples in tar order).
Splitting this order into steps, ranks and workers is :mod:`loaders.batching`'s job.
"""
from __future__ import annotations

import numpy as np


def rng_for(seed: int, epoch: int, tag: int = 0) -> np.random.Generator:
    """The generator of ``(seed, epoch, tag)``: PCG64 via SeedSequence, stable across platforms."""
    if seed < 0 or epoch < 0 or tag < 0:
        raise ValueError(f"seed, epoch and tag must be >= 0 (got {seed}, {epoch}, {tag})")
    return np.random.default_rng([int(seed), int(epoch), int(tag)])


def epoch_order(shard_of: np.ndarray, seed: int, epoch: int, *, shuffle: bool = True,
                window: int = 0, tag: int = 0) -> np.ndarray:
    """Order of the samples for one epoch.

    Args:
        shard_of: int ``(N,)`` shard number (0..S-1) of each sample, in index order.
        seed, epoch, tag: seed the generator (``tag`` separates several caches of one mix).
        shuffle: False -> ``arange(N)``.
        window: > 1 -> additionally shuffle within consecutive windows of that many positions.

    Returns an int64 ``(N,)`` permutation of ``0..N-1`` (positions in index order). Vectorised:
    O(N log N), about 0.1 s per million samples.
    """
    shard_of = np.asarray(shard_of)
    n = len(shard_of)
    if not shuffle or n == 0:
        return np.arange(n, dtype=np.int64)
    rng = rng_for(seed, epoch, tag)
    n_shards = int(shard_of.max()) + 1
    shard_rank = np.empty(n_shards, dtype=np.int64)
    shard_rank[rng.permutation(n_shards)] = np.arange(n_shards)
    order = np.lexsort((rng.random(n), shard_rank[shard_of])).astype(np.int64)
    if window and window > 1:
        order = order[np.lexsort((rng.random(n), np.arange(n) // int(window)))]
    return order


class ShardOrder:
    """Picklable ``epoch -> order`` of one cache: :func:`epoch_order` with fixed arguments."""

    def __init__(self, shard_of: np.ndarray, seed: int, *, shuffle: bool = True, window: int = 0,
                 tag: int = 0):
        self.shard_of, self.seed, self.shuffle, self.window, self.tag = shard_of, int(seed), shuffle, window, tag

    def __call__(self, epoch: int) -> np.ndarray:
        return epoch_order(self.shard_of, self.seed, epoch, shuffle=self.shuffle, window=self.window,
                           tag=self.tag)

    def signature(self) -> dict:
        """What a checkpoint must agree on for this order to be reproduced."""
        return {"num_samples": int(len(self.shard_of)), "shuffle": bool(self.shuffle),
                "shuffle_window": int(self.window or 0)}
