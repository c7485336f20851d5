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

    Returns an int64 ``(N,)`` permutation of ``0..N-1`` (positions in index order): the order of
    ``np.lexsort((random, shard_rank[shard_of]))`` (stable: equal keys keep index order), computed as
    one sort of a 64-bit key (:func:`_by_then`; lexsort's two merge sorts took 18 s for 10M samples on
    the bench machine, the key's sort about 1.3 s).
    """
    shard_of = np.asarray(shard_of)
    n = len(shard_of)
    if not shuffle or n == 0:
        return np.arange(n, dtype=np.int64)
    rng = rng_for(seed, epoch, tag)
    n_shards = int(shard_of.max()) + 1
    shard_rank = np.empty(n_shards, dtype=np.int64)
    shard_rank[rng.permutation(n_shards)] = np.arange(n_shards)
    order = _by_then(shard_rank, shard_of, rng.random(n))
    if window and window > 1:
        order = order[_within_windows(rng.random(n), int(window))]
    return order


#: bits of ``Generator.random``'s floats: each is ``k * 2**-53`` for an integer ``k < 2**53``
_RANDOM_BITS = 53


def _by_then(rank: np.ndarray, of: np.ndarray, r: np.ndarray) -> np.ndarray:
    """``np.lexsort((r, rank[of]))`` (``rank``: ints in ``[0, len(rank))``, ``r`` from ``Generator.random``,
    consumed): the floats' 53-bit integers below the rank's bits make one uint64 key when they fit, built
    in place (each temporary of ``N`` values costs a pass over memory) and sorted stably (so ties, if any,
    keep index order as lexsort's do); else a stable sort by ``r``, then a stable sort by the rank (a radix
    sort for uint16)."""
    n_primary = len(rank)
    bits = max(int(n_primary - 1).bit_length(), 1)
    if bits <= 64 - _RANDOM_BITS:
        key = rank.astype(np.uint64)[of]
        key <<= np.uint64(_RANDOM_BITS)
        r *= 2.0 ** _RANDOM_BITS
        key |= r.astype(np.uint64)
        return np.argsort(key, kind="stable")
    first = np.argsort(r, kind="stable")
    p = rank[of][first]
    p = p.astype(np.uint16) if n_primary <= 1 << 16 else p
    return first[np.argsort(p, kind="stable")]


def _within_windows(r: np.ndarray, window: int) -> np.ndarray:
    """``np.lexsort((r, np.arange(n) // window))``: each window of positions ordered by ``r`` (stably)."""
    n = len(r)
    full = n // window * window
    out = np.empty(n, dtype=np.int64)
    if full:
        out[:full] = (np.argsort(r[:full].reshape(-1, window), axis=1, kind="stable")
                      + np.arange(0, full, window)[:, None]).reshape(-1)
    if full < n:
        out[full:] = full + np.argsort(r[full:], kind="stable")
    return out


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
