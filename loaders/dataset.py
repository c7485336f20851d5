"""Read batches straight from the shard files: the index as numpy arrays, no tar parsing.

:class:`CacheSource` loads one cache's ``index.parquet`` once, refuses members that would need
unpickling, applies the filters, checks the requested fields, pins the shard files, and reads
through a :class:`shards.ShardReader` (per-field byte offsets / shapes / dtypes / checksums as numpy
arrays and lazily opened files, so a worker never touches JSON). :class:`Sources` puts several
caches in one id space (``id = offset[source] + row``) and reads batches with
:func:`loaders.read.read_batch` (one copy from the page cache into the batch tensors; damaged
samples stop the loader or, within ``skip_corrupt``, are left out). :class:`PlanDataset` is the
``IterableDataset`` that DataLoader workers run: it rebuilds the epoch's plan from a
:class:`loaders.batching.PlanSpec`, reads the position ``(epoch, start_step)`` from a small
shared-memory tensor that the main process writes before every ``iter()`` (persistent workers never
see attribute changes made after they started), and yields ``(step, batch)`` for the steps
``start + worker_id + k * num_workers``.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shards import Cache, CacheManifest, ShardCorrupt, ShardReader, read_index, value_checks_from_manifest
from shards import fields as registry
from shards.index import read_cache_id
from shards.kinds import BatchContext
from shards.reader import refuse_unsafe
from shards.scan import unindexed_members
from shards.readinto import say_executor
from shards.storage import is_url, local_path

from .batching import PlanSpec
from .collate import ALL_FIELDS, FIELDS, TEXT_PAD_ID, check_fields
from .order import filter_rows
from .host import KEEP, HostArena
from .read import CHECKS, Staging, read_batch
from .remote import RemoteCache
from .shm import SlotArena

log = logging.getLogger("loaders")
#: batch key under which a batch carries the messages of the samples skipped while reading it
#: (``skip_corrupt``); :class:`loaders.ShardLoader` removes it before the batch is handed out
SKIPPED = "__skipped__"

def cache_fields(table: pa.Table, requested: bool = False) -> tuple[str, ...]:
    """The fields (of :data:`loaders.FIELDS`, extra waveforms and fields added with ``precompute
    add-field`` such as ``codes_mimi``) that some sample of the index holds: what a loader reads
    when no ``fields`` are given. ``requested``: also the fields read only when asked for
    (:data:`loaders.collate.OPTIONAL_FIELDS`: ``latents_logvar``, ``image_features``), for a model
    that declares them."""
    names = set(pc.unique(table.column("members").combine_chunks().flatten().field("name")).to_pylist())
    have = [f for f in (ALL_FIELDS if requested else FIELDS) if f + ".npy" in names]
    extra = sorted(n[:-4] for n in names if n.endswith(".npy") and n[:-4] not in registry.BY_NAME
                   and registry.lookup(n[:-4]) is not None)  # audio_16k, audio_16k_starts, codes_mimi...
    return tuple(have) + tuple(extra)


class CacheSource:
    """One cache directory, filtered: per-row numpy arrays plus a :class:`shards.ShardReader`.

    Args:
        cache_dir: directory with ``index.parquet`` and the shard tars, its URL, or a :class:`shards.Cache`.
        filters: see :func:`loaders.order.filter_rows`.
        fields: the fields that will be read (their members must exist; ``latents`` may be absent,
            ``latents_logvar`` must exist exactly where ``latents`` does).

    Attributes (one entry per kept row, index order): ``n`` rows; ``keys`` (Arrow strings);
    ``shard_of`` int32 (shards numbered in sorted name order); ``frames`` int64 codes frames;
    ``sample_rate`` int64; ``has_image`` bool; ``default_shapes`` field -> the most common shape of
    the fields whose kind pads a batch without them to one (latents: a batch without any image);
    ``reader`` the :class:`shards.ShardReader` of the kept rows (index arrays, files).

    Every read checks each member against the checksum the index recorded when it was written
    (:mod:`shards.checksum`; an entry without one is :class:`shards.ShardCorrupt`); the kind's value
    checks (codes / ids in ``[0, codebook_size)`` / ``[0, vocab_size)``, floats finite:
    :func:`shards.value_checks_from_manifest`) run with ``checks="values"``. The
    shard files are pinned when the source is built (local caches): a shard replaced, resized or
    deleted later stops the reads (:mod:`shards.files`). ``verify_reads``: also check each
    sample's sha256 as it is read (opt-in; its cost: docs/benchmarks.md).

    ``cache_dir`` may be a URL (``s3://...``, any fsspec protocol): then ``remote`` holds the
    :class:`loaders.remote.RemoteCache` keyword arguments (``rank``, ``local_dir``,
    ``storage_options``...), the index and manifest are downloaded to its local folder, shards are
    read there as a :class:`loaders.remote.Prefetcher` brings them (readers wait for a shard that
    has not arrived), and after each batch a reader closes its maps of files the prefetcher deleted.

    Raises ``FileNotFoundError`` (no index), :class:`shards.UnsupportedFormat` (newer cache format),
    :class:`shards.UnsafePath` (index names a file outside the cache), :class:`shards.UnsafeMember` (pickle member listed),
    :class:`shards.ShardCorrupt` (shard file missing or shorter than its indexed members, bad
    member shape/size), ``ValueError`` (no sample left after filters; a requested member missing,
    e.g. ``latents_logvar`` from a cache made without ``store_posterior``).
    """

    def __init__(self, cache_dir: str | os.PathLike, filters: Any = None, fields: Sequence[str] | None = None,
                 verify_reads: bool = False, remote: dict | None = None):
        opened = cache_dir if isinstance(cache_dir, Cache) else None  # opened once by the caller (shards.Cache)
        if opened is not None:
            cache_dir = opened.source
        self.url = str(cache_dir)
        self.remote: RemoteCache | None = None
        if is_url(cache_dir):
            self.remote = RemoteCache(str(cache_dir), **(remote or {}))
            cache_dir = self.remote.local
        self.streamed = self.remote is not None
        self.cache_dir = local_path(cache_dir)  # a file:// URL is a local folder
        if opened is not None and not self.streamed:  # its manifest, index and id, not read again
            man, table, self.cache_id = opened.manifest, opened.index, opened.id
        else:
            man = CacheManifest.read(self.cache_dir)  # UnsupportedFormat for a newer format_version
            table = read_index(self.cache_dir)
            self.cache_id = read_cache_id(self.cache_dir)  # index + manifest checked against integrity.json first
        manifest = man.to_dict()
        refuse_unsafe(table, self.cache_dir)  # the whole index, filtered-out rows too
        hidden = unindexed_members(table)  # e.g. a tar holding a key twice, one of them indexed
        if hidden:
            raise ShardCorrupt(f"{self.cache_dir}: {hidden[0]}; check it with `shardcache shards verify --deep`")
        self.pad_id = int(man.pad_id() if man.pad_id() is not None else TEXT_PAD_ID)
        all_shards = sorted(pc.unique(table.column("shard")).to_pylist())  # numbering kept across filters
        rows = filter_rows(table, filters)
        if len(rows) == 0:
            raise ValueError(f"{self.cache_dir}: no sample left after filters {filters!r} "
                             f"({table.num_rows} in the index)")
        t = table.take(pa.array(rows)) if len(rows) != table.num_rows else table
        self.fields = check_fields(cache_fields(t) if fields is None else fields)
        # every read checks the shard did not shrink, codes/ids are in range, latents are finite
        self.reader = ShardReader(self.cache_dir, index=t, shard_names=all_shards, manifest=manifest,
                                  value_checks=value_checks_from_manifest(manifest), verify_reads=verify_reads,
                                  await_file=self.remote.waiter if self.remote is not None else None)
        self.n, self.keys, self.shard_of = self.reader.n, self.reader.key_array, self.reader.shard_of
        self.shard_names = all_shards
        num = lambda c: t.column(c).to_numpy().astype(np.int64)  # noqa: E731
        self.frames = num("n_frames")
        self.sample_rate = num("sample_rate")
        self.has_image = t.column("has_image").to_numpy(zero_copy_only=False).astype(bool)
        self.default_shapes: dict[str, tuple[int, ...]] = {}
        for field in self.fields:
            lacking = man.fields[field].extra.get("incomplete") if field in man.fields else None
            if lacking:  # a rerun re-encoded or added shards after `add-field`: their sidecars are not made yet
                raise ValueError(f"{self.cache_dir}: field {field!r} (added by add-field) has no sidecar for "
                                 f"{len(lacking)} shard(s) ({', '.join(lacking[:3])}...); run the same "
                                 f"`shardcache add-field` again to add them, or read the cache without {field!r}")
            self._check_field(field)
        # the files each row reads: its shard, and the sidecar tar of every sidecar field read
        cols = [self.shard_of]
        for f in self.fields:
            side = self.reader.field(f, registry.get(f).ndim).file
            if side is not None:
                cols.append(side)
        self.row_files = np.stack(cols, axis=1).astype(np.int32)
        if self.remote is not None:
            self.remote.adopt([self.reader.files[i] for i in np.unique(self.row_files).tolist()], manifest)
        else:
            self.reader.check_files()
            self.reader.pin_files(np.unique(self.row_files).tolist())  # replaced later: ShardCorrupt
        say_executor(log)
        self.reader.drop_index()  # workers get numpy arrays only

    def after_read(self) -> None:
        """Streamed caches: close the maps of files the prefetcher deleted (their disk space comes
        back once no process maps them)."""
        if self.streamed:
            self.reader.close_stale()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["remote"] = None  # workers only read local files (the reader waits for them)
        return state

    def _check_field(self, name: str) -> None:
        f = registry.get(name)
        fa = self.reader.field(name, f.ndim)  # raises ShardCorrupt for a bad shape/size
        member, present = f.suffix, fa.present
        if f.paired_with is not None:
            partner = self.reader.field(f.paired_with, registry.get(f.paired_with).ndim).present
            missing = np.flatnonzero(partner & ~present)
            if len(missing):
                raise ValueError(f"{self.cache_dir}: {len(missing)} samples with {f.paired_with} have no {member} "
                                 f"(e.g. {self.keys.take(pa.array(missing[:5])).to_pylist()}); was the cache made "
                                 f"with store_posterior: true? else drop {name!r} from fields")
        if (f.every_sample and not present.all()) or (not f.kind.uses_default_shape and not present.any()):
            missing = np.flatnonzero(~present)
            raise ValueError(f"{self.cache_dir}: {len(missing)} samples have no {member} (e.g. "
                             f"{self.keys.take(pa.array(missing[:5])).to_pylist()}); drop "
                             f"{name!r} from fields or filter them out")
        if f.kind.uses_default_shape and present.any():  # the most common shape
            shapes = fa.shape[present]
            vals, counts = np.unique(shapes, axis=0, return_counts=True)
            self.default_shapes[name] = tuple(int(v) for v in vals[int(np.argmax(counts))])

    def close(self) -> None:
        """Close the files and maps (views handed out earlier must not be used afterwards) and release the
        local folder of a streamed cache."""
        self.reader.close()
        if self.remote is not None:
            self.remote.close()


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
        self.frames = np.concatenate([s.frames for s in self.sources])
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
