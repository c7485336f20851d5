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

from .collate import check_fields
from .dataset import CacheSource, Sources
from .loader import ShardLoader
from .order import epoch_order, rng_for
from shardcache.ranks import Ranks


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
        caches: ``{name: cache_dir}`` (or a list of dirs, named by their path).
        batch_size: as for ShardLoader.
        weights: ``{name: weight}`` or a list in ``caches`` order; normalised, must be > 0.
        samples_per_epoch: samples per epoch; default ``floor(min_i N_i / w_i)`` (the most
            before any source has to repeat a sample within an epoch).
        source_filters: ``{name: filters}`` per cache; ``filters`` applies to caches without one.
        storage_options, cache_limit: for caches given as URLs (as ShardLoader; each remote cache
            gets its own local folder, and ``cache_limit`` bounds them together).
        Every other keyword (rank, world, seed, workers, fields, max_frames...) as ShardLoader;
        ``shuffle=False`` keeps each cache's index order but still interleaves them by seed.

    Raises ``ValueError`` for mismatched names/weights, non-positive weights or an empty source.
    """

    def __init__(self, caches: Mapping[str, Any] | Sequence[Any], batch_size: int, *,
                 weights: Mapping[str, float] | Sequence[float], samples_per_epoch: int | None = None,
                 source_filters: Mapping[str, Any] | None = None, filters: Any = None,
                 fields: Sequence[str] | None = None, seed: int = 0, shuffle: bool = True,
                 shuffle_window: int = 0, storage_options: dict | None = None, cache_limit: int | None = None,
                 **kwargs):
        if not isinstance(caches, Mapping):
            caches = {str(c): c for c in caches}
        names = list(caches)
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
        fields = None if fields is None else check_fields(fields)
        source_filters = dict(source_filters or {})
        unknown = set(source_filters) - set(names)
        if unknown:
            raise ValueError(f"source_filters for unknown caches {sorted(unknown)}; caches: {names}")
        ranks = Ranks.detect(kwargs.pop("group", None), kwargs.get("global_rank"), kwargs.get("world_size"))
        kwargs["global_rank"], kwargs["world_size"] = ranks.global_rank, ranks.world_size
        remote = dict(rank=int(kwargs["global_rank"]), storage_options=storage_options)
        srcs = [CacheSource(caches[n], source_filters.get(n, filters), fields, remote=remote) for n in names]
        sources = Sources(srcs, names)
        if samples_per_epoch is None:
            samples_per_epoch = int(min(s.n / x for s, x in zip(srcs, w)))
        order = MixedOrder([s.shard_of for s in srcs], sources.offsets, w, samples_per_epoch, seed,
                           shuffle=shuffle, window=shuffle_window)
        self.weights = dict(zip(names, w))
        self.samples_per_epoch = int(samples_per_epoch)
        defaults = dict(global_rank=0, world_size=1, num_workers=0, drop_remainder=True, max_frames=None,
                        device_pin=None, prefetch_factor=2, bucket_window=None, persistent_workers=None,
                        multiprocessing_context=None, timeout=0.0, compact=False, transform=None,
                        checks="checksums", skip_corrupt=0, read_threads=2)
        unknown_kw = set(kwargs) - set(defaults)
        if unknown_kw:
            raise TypeError(f"MixedLoader got unexpected keyword arguments {sorted(unknown_kw)}")
        defaults.update(kwargs)
        self._setup(sources, order, batch_size, seed=seed, cache_limit=cache_limit, **defaults)
