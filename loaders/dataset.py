"""Read batches straight from the shard files: the index as memory-mapped columns, no tar parsing.

:class:`CacheSource` is one cache's checked reader (:meth:`shards.Cache.reader`: the cache opened and
checked once, the filters applied, the requested fields and the shard files checked) and what the
loader reads per row beside it. :class:`Sources` puts several caches in one id space (``id =
offset[source] + row``) and reads batches with :func:`loaders.read.read_batch` (one copy from the page
cache into the batch tensors; damaged samples stop the loader or, within ``skip_corrupt``, are left
out). :class:`PlanDataset` is the ``IterableDataset`` that DataLoader workers run: it rebuilds the
epoch's plan from a :class:`loaders.batching.PlanSpec`, reads the position ``(epoch, start_step)`` from
a small shared-memory tensor that the main process writes before every ``iter()`` (persistent workers
never see attribute changes made after they started), and yields ``(step, batch)`` for the steps
``start + worker_id + k * num_workers``.

Nothing here holds one Python object per sample: a source's per-row arrays are the store's
(:mod:`shards.columns`, mapped from the same files in every process), and a batch gathers only its
own rows.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shards import Cache, ShardCorrupt
from shards import fields as registry
from shards.kinds import BatchContext
from shards.readinto import say_executor

from .batching import PlanSpec
from .host import KEEP, HostArena
from .read import Staging, read_batch
from .settings import CHECKS
from .shm import SlotArena

log = logging.getLogger("loaders")
#: batch key under which a batch carries the messages of the samples skipped while reading it
#: (``skip_corrupt``); :class:`loaders.ShardLoader` removes it before the batch is handed out
SKIPPED = "__skipped__"


def cache_fields(table, requested: bool = False) -> tuple[str, ...]:
    """The fields some sample of an index table holds that a reader reads when none are named
    (:func:`shards.fields.held`; ``requested``: also the ones read only when named)."""
    import pyarrow.compute as pc
    return registry.held(pc.unique(table.column("members").combine_chunks().flatten().field("name")).to_pylist(),
                         requested)


class CacheSource:
    """One cache, filtered: its checked :class:`shards.ShardReader` and the per-row columns the loader reads.

    Args:
        cache: an opened :class:`shards.Cache`.
        fields: the fields that will be read (default: every field the kept rows hold, read by default:
            :func:`shards.fields.held`).
        filters: :func:`shards.filters.filter_rows`'s filters.
        verify_reads: also check each sample's sha256 as it is read (opt-in; its cost: docs/benchmarks.md).

    Attributes: ``n`` rows; ``fields``; ``shard_of`` int32 per row (shards numbered in sorted name
    order; memory-mapped); ``default_shapes`` field -> the most common shape of the fields whose kind
    pads a batch without them to one (latents: a batch without any image); ``pad_id``; ``cache_id``;
    ``reader`` (the :class:`shards.ShardReader` of the kept rows); ``remote`` (the
    :class:`shards.mirror.RemoteCache` a URL's shards stream into, else None; its readers wait for a
    shard that has not arrived and close their maps of files the prefetcher deleted after each batch).

    Every read checks each member against the checksum the index recorded when it was written
    (:mod:`shards.checksum`); the kinds' value checks (:meth:`shards.Cache.value_checks`) run with
    ``checks="values"``. Local shard files are pinned when the source is built: a shard replaced,
    resized or deleted later stops the reads (:mod:`shards.files`).

    Raises what :meth:`shards.Cache.reader` raises.
    """

    def __init__(self, cache: Cache, fields: Sequence[str] | None = None, filters: Any = None,
                 verify_reads: bool = False):
        self.cache = cache
        self.reader = cache.reader(fields, filters, verify_reads=verify_reads)
        self.fields, self.n, self.shard_of = self.reader.fields, self.reader.n, self.reader.shard_of
        self.pad_id, self.cache_id, self.cache_dir = int(cache.pad_id), cache.id, cache.dir
        self.remote = self.reader.mirror
        self.streamed = self.remote is not None
        self.default_shapes: dict[str, tuple[int, ...]] = {}
        for name in self.fields:
            f = registry.get(name)
            fa = self.reader.field(name, f.ndim)
            if f.kind.uses_default_shape:
                present = np.flatnonzero(fa.all_present())
                if len(present):  # the most common shape
                    vals, counts = np.unique(fa.shapes(present), axis=0, return_counts=True)
                    self.default_shapes[name] = tuple(int(v) for v in vals[int(np.argmax(counts))])
        say_executor(log)

    def _column(self, name: str, rows: np.ndarray | None) -> np.ndarray:
        col = getattr(self.reader.columns, name)  # (an IndexColumns scalar column: n_frames, sample_rate)
        at = self.reader.rows if rows is None else (rows if self.reader.rows is None else self.reader.rows[rows])
        return np.asarray(col if at is None else col[at], dtype=np.int64)

    def frames(self, rows: np.ndarray | None = None) -> np.ndarray:
        """int64 codes frames of ``rows`` (default every row: budget batching)."""
        return self._column("n_frames", rows)

    def sample_rates(self, rows: np.ndarray) -> np.ndarray:
        """int64 sample rate (Hz) of ``rows``."""
        return self._column("sample_rate", rows)

    def row_files(self) -> np.ndarray:
        """int32 ``(n, k)``: the files each row reads (its shard, then the sidecar of each sidecar field
        read): what a remote cache's prefetcher schedules."""
        cols = [np.asarray(self.shard_of, dtype=np.int64)]
        everything = np.arange(self.n, dtype=np.int64)
        for name in self.fields:
            fa = self.reader.field(name, registry.get(name).ndim)
            if fa.side is not None:
                cols.append(fa.files(everything, self.shard_of))
        return np.stack(cols, axis=1).astype(np.int32)

    def after_read(self) -> None:
        """Streamed caches: close the maps of files the prefetcher deleted (their disk space comes
        back once no process maps them)."""
        if self.streamed:
            self.reader.close_stale()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["remote"] = None  # workers only read local files (the reader waits for them)
        state["cache"] = None   # ... through the reader (the store's files, mapped again)
        state["shard_of"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.shard_of = self.reader.shard_of

    def close(self) -> None:
        """Close the files and maps (views handed out earlier must not be used afterwards) and give back
        the local folder of a streamed cache."""
        if self.cache is not None:
            self.cache.release(self.reader)
        else:  # (a copy in a worker: its files only)
            self.reader.close()


class Sources:
    """Several :class:`CacheSource` in one id space: ``id = offsets[i] + row`` of source ``i``.

    Settings the loader sets after construction: ``compact`` (keep the stored dtypes),
    ``transform`` (applied to each batch), ``pin`` (allocate batches in page-locked memory when read
    in the loader's own process), ``checks`` (:data:`loaders.read.CHECKS`), ``skip_corrupt``
    (damaged samples this process may leave out of their batches before it raises).
    """

    def __init__(self, sources: Sequence[CacheSource], names: Sequence[str] | None = None):
        self.sources = list(sources)
        self.names = list(names) if names is not None else [str(s.cache_dir) for s in self.sources]
        self.offsets = np.concatenate([[0], np.cumsum([s.n for s in self.sources])]).astype(np.int64)
        self.n = int(self.offsets[-1])
        self.fields = self.sources[0].fields
        self.default_shapes: dict[str, tuple[int, ...]] = {}
        for s in self.sources:  # the first source's shape wins
            for k, v in s.default_shapes.items():
                self.default_shapes.setdefault(k, v)
        self.compact = False  # int16 audio, float16 latents (widened on the device)
        self.transform = None  # applied to each collated batch (ShardLoader(transform=...))
        self.pad_id = self.sources[0].pad_id
        self.pin = False
        self.host_blocks = KEEP  # free host blocks kept for reuse (ShardLoader: what its reads keep in flight)
        self.checks = "checksums"
        self.skip_corrupt = 0
        self.skipped = 0  # damaged samples left out in this process
        self._local = threading.local()  # per reading thread (loaders.readahead): its staging buffers
        self._skip_lock = threading.Lock()
        self._arena: HostArena | None = None

    def frames(self) -> np.ndarray:
        """int64 codes frames of every id (budget batching only: read from the sources' columns)."""
        return np.concatenate([s.frames() for s in self.sources])

    def _host(self) -> HostArena:
        """The reused host blocks of batches read in this process (pinned when ``pin``)."""
        if self._arena is None or self._arena.pin != bool(self.pin) or self._arena.keep != self.host_blocks:
            self._arena = HostArena(pin=bool(self.pin), keep=self.host_blocks)
        return self._arena

    def __getstate__(self):  # to DataLoader workers: no thread state
        state = self.__dict__.copy()
        del state["_local"], state["_skip_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local, self._skip_lock = threading.local(), threading.Lock()

    def _staging(self) -> Staging:
        st = getattr(self._local, "staging", None)
        if st is None:
            st = self._local.staging = Staging()
        return st

    def read_batch(self, ids: np.ndarray, arena=None) -> dict[str, Any]:
        """The collated batch (see :mod:`loaders.collate`; read by :func:`loaders.read.read_batch`)
        of sample ``ids`` (int64, global); ``arena``: a worker's :class:`loaders.shm.SlotArena` to
        collate into. A damaged sample raises :class:`shards.ShardCorrupt` (naming shard, key and
        member), or within ``skip_corrupt`` is left out: the batch is read again without it and
        carries the messages under :data:`SKIPPED`."""
        if self.checks not in CHECKS:
            raise ValueError(f"checks={self.checks!r}: choose from {CHECKS}")
        ids = np.asarray(ids, dtype=np.int64)
        which = np.searchsorted(self.offsets, ids, side="right") - 1
        ctx = BatchContext(pad_id=int(self.pad_id), compact=bool(self.compact), default_shapes=self.default_shapes)
        skipped: list[str] = []
        while True:
            if len(self.sources) == 1:  # one cache: ids are its rows, in batch order
                groups = [(self.sources[0], np.arange(len(ids)), ids)]
            else:
                groups = [(self.sources[i], np.flatnonzero(which == i), ids[which == i] - self.offsets[i])
                          for i in np.unique(which).tolist()]
            batch, problems = read_batch(groups, len(ids), self.fields, ctx, arena=arena or self._host(),
                                         checks=self.checks, staging=self._staging())
            if not problems:
                break
            if arena is not None:
                arena.abandon()  # the slot of the incomplete batch is free again
            for _, why in problems:
                with self._skip_lock:  # reading threads share the budget
                    over = self.skipped >= self.skip_corrupt
                    self.skipped += 0 if over else 1
                if over:
                    extra = (f" ({self.skipped} damaged sample(s) skipped before, skip_corrupt={self.skip_corrupt})"
                             if self.skip_corrupt else " (skip_corrupt=N lets a run skip up to N damaged samples)")
                    raise ShardCorrupt(why + extra)
                skipped.append(why)
            keep = np.setdiff1d(np.arange(len(ids)), [p for p, _ in problems])
            if not len(keep):
                raise ShardCorrupt(f"every sample of a batch is damaged; the last: {problems[-1][1]}")
            ids, which = ids[keep], which[keep]
        for i, src in enumerate(self.sources):
            if src.streamed and (len(self.sources) == 1 or (which == i).any()):
                src.after_read()
        if len(self.sources) > 1:
            batch["source"] = [self.names[i] for i in which.tolist()]
        batch = batch if self.transform is None else self.transform(batch)
        if skipped:
            batch[SKIPPED] = skipped
        return batch

    def close(self) -> None:
        for s in self.sources:
            s.close()


class PlanDataset(IterableDataset):
    """What each DataLoader worker (or the main process when ``num_workers=0``) iterates.

    Yields ``(step, batch)`` for this rank's batches of the steps ``start + wid + k * nw`` of the
    epoch, where ``(epoch, start, generation)`` is read from ``position`` (an int64 tensor in shared
    memory) when ``iter()`` is called, and ``wid``/``nw`` are the worker id / count. With
    ``slots`` (``(flags, receiver_id)``, see :mod:`loaders.shm`) a worker collates into its reusable
    shared-memory slots and yields :class:`loaders.shm.SlotBatch` messages instead of batches.
    """

    def __init__(self, sources: Sources, spec: PlanSpec, rank: int, position: torch.Tensor,
                 slots: tuple[torch.Tensor, int] | None = None):
        self.sources, self.spec, self.rank, self.position = sources, spec, int(rank), position
        self.slots = slots
        self._arena: SlotArena | None = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_arena"] = None  # each worker process makes its own
        return state

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        epoch, start, generation = (int(v) for v in self.position.tolist())
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        arena = None
        if info is not None and self.slots is not None:
            if self._arena is None or self._arena.worker != wid:
                self._arena = SlotArena(self.slots[0], wid, self.slots[1])
            arena = self._arena
            arena.start(generation)
        plan = self.spec.plan(epoch)  # computed eagerly here, not at the first next()
        return self._run(plan, range(start + wid, plan.n_steps, nw), arena)

    def _run(self, plan, steps, arena) -> Iterator[tuple[int, Any]]:
        for s in steps:
            batch = self.sources.read_batch(plan.rank_batch(s, self.rank), arena)
            yield s, (batch if arena is None else arena.seal(batch))
