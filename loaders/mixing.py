"""Mix several caches with weights (e.g. 70/30), deterministically from the seed.

Epoch ``e`` of a mix has ``samples_per_epoch`` samples; source ``i`` contributes exactly
``n_i`` of them (largest-remainder rounding of ``weight_i * samples_per_epoch``). Each source is
read as an endless *stream*: its pass ``p`` is :func:`loaders.order.epoch_order` of that cache with
``(seed, p, tag=i+1)``, and epoch ``e`` takes stream positions ``[e*n_i, (e+1)*n_i)``, so an
up-weighted small cache repeats (a new order per pass) and a down-weighted big one is read
further in every epoch, never twice within one pass. The sources' samples are then interleaved
with a seeded shuffle of the ``n_i`` labels. The result is one global order over the id space of
:class:`loaders.dataset.Sources`, so batching, rank/worker split, ``state_dict`` and resume work
exactly as for :class:`loaders.ShardLoader`. Batches carry ``batch["source"]``: list[str] of
source names.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from shardcache.ranks import Ranks
from shards import Cache
from shards import fields as registry

from .dataset import CacheSource, Sources
from .loader import ShardLoader, open_source
from .order import epoch_order, rng_for
from .settings import Mix, Order, Reads, Workers


def apportion(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder; sums to total)."""
    w = np.asarray(weights, dtype=np.float64)
    raw = w / w.sum() * total
    out = np.floor(raw).astype(np.int64)
    rest = int(total - out.sum())
    if rest:
        out[np.argsort(-(raw - out), kind="stable")[:rest]] += 1
    return out.tolist()


class MixedOrder:
    """Picklable ``epoch -> ids`` of a weighted mix (see the module docstring)."""

    def __init__(self, shard_ofs: Sequence[np.ndarray], offsets: np.ndarray, weights: Sequence[float],
                 samples_per_epoch: int, seed: int, *, shuffle: bool = True, window: int = 0):
        self.shard_ofs, self.offsets = list(shard_ofs), np.asarray(offsets)
        self.weights = [float(x) for x in weights]
        self.samples_per_epoch, self.seed = int(samples_per_epoch), int(seed)
        self.shuffle, self.window = shuffle, window
        self.counts = apportion(self.weights, self.samples_per_epoch)

    def _stream(self, i: int, start: int, n: int) -> np.ndarray:
        size = len(self.shard_ofs[i])
        q = np.arange(start, start + n, dtype=np.int64)
        passes, pos = q // size, q % size
        out = np.empty(n, dtype=np.int64)
        for p in np.unique(passes).tolist():
            m = passes == p
            out[m] = epoch_order(self.shard_ofs[i], self.seed, p, shuffle=self.shuffle,
                                 window=self.window, tag=i + 1)[pos[m]]
        return out + self.offsets[i]

    def __call__(self, epoch: int) -> np.ndarray:
        labels = np.repeat(np.arange(len(self.counts)), self.counts)
        rng_for(self.seed, epoch, 0).shuffle(labels)
        out = np.empty(len(labels), dtype=np.int64)
        for i, n in enumerate(self.counts):
            out[labels == i] = self._stream(i, epoch * n, n)
        return out

    def signature(self) -> dict:
        return {"num_samples": self.samples_per_epoch, "source_sizes": [len(s) for s in self.shard_ofs],
                "weights": self.weights, "shuffle": bool(self.shuffle), "shuffle_window": int(self.window or 0)}


class MixedLoader(ShardLoader):
    """A :class:`loaders.ShardLoader` over several caches mixed by weight.

    Args:
        caches: ``{name: cache}`` (a :class:`shards.Cache`, a folder or a URL, as ShardLoader's
            ``cache``), or a list of them (named by their path).
        batch_size, seed, fields, ranks, order, workers, reads, transform: as ShardLoader;
            ``Order(shuffle=False)`` keeps each cache's index order but still interleaves them by seed.
            Each remote cache streams into its own local folder; ``reads.cache_limit`` bounds them together.
        mix: :class:`loaders.Mix`: the weights (required), the samples per epoch, each cache's filters.

    Raises ``ValueError`` for mismatched names/weights, non-positive weights or an empty source.
    """

    def __init__(self, caches: Mapping[str, Any] | Sequence[Any], batch_size: int, *, mix: Mix,
                 seed: int = 0, fields: Sequence[str] | None = None, ranks: Ranks | None = None,
                 order: Order = Order(), workers: Workers = Workers(), reads: Reads = Reads(),
                 transform: Any = None):
        if not isinstance(mix, Mix):
            raise TypeError(f"mix= takes a loaders.Mix, got {type(mix).__name__}")
        if not isinstance(caches, Mapping):
            caches = {str(c.source if isinstance(c, Cache) else c): c for c in caches}
        names = list(caches)
        weights = mix.weights
        if isinstance(weights, Mapping):
            if set(weights) != set(names):
                raise ValueError(f"weights name {sorted(weights)} but caches are {names}")
            w = [float(weights[n]) for n in names]
        else:
            w = [float(x) for x in weights]
            if len(w) != len(names):
                raise ValueError(f"{len(w)} weights for {len(names)} caches")
        if not names or any(x <= 0 for x in w):
            raise ValueError(f"need at least one cache and weights > 0, got {dict(zip(names, w))}")
        w = [x / sum(w) for x in w]
        fields = None if fields is None else registry.selection(fields)
        unknown = set(mix.filters) - set(names)
        if unknown:
            raise ValueError(f"Mix.filters for unknown caches {sorted(unknown)}; caches: {names}")
        ranks = Ranks.detect() if ranks is None else ranks
        self._own_caches = []
        srcs = []
        try:
            for n in names:
                opened = open_source(caches[n], ranks)
                if opened is not caches[n]:
                    self._own_caches.append(opened)
                srcs.append(CacheSource(opened, fields, mix.filters.get(n), verify_reads=reads.verify_reads))
        except BaseException:
            for c in self._own_caches:
                c.close()
            raise
        sources = Sources(srcs, names)
        samples_per_epoch = mix.samples_per_epoch
        if samples_per_epoch is None:
            samples_per_epoch = int(min(s.n / x for s, x in zip(srcs, w)))
        plan_order = MixedOrder([s.shard_of for s in srcs], sources.offsets, w, samples_per_epoch, seed,
                                shuffle=order.shuffle, window=order.shuffle_window)
        self.weights = dict(zip(names, w))
        self.samples_per_epoch = int(samples_per_epoch)
        self._setup(sources, plan_order, batch_size, ranks=ranks, seed=seed, order=order, workers=workers,
                    reads=reads, transform=transform)
