"""Read batches straight from the shard files: the index as numpy arrays, mmaps, no tar parsing.

:class:`CacheSource` loads one cache's ``index.parquet`` once, refuses members that would need
unpickling, applies the filters, and keeps per-field byte offsets / shapes / dtypes as numpy arrays
(so a worker never touches the Arrow table or JSON). :class:`Sources` puts several caches in one id
space (``id = offset[source] + row``). :class:`PlanDataset` is the ``IterableDataset`` that
DataLoader workers run: it rebuilds the epoch's plan from a :class:`loaders.batching.PlanSpec`,
reads the position ``(epoch, start_step)`` from a small shared-memory tensor that the main process
writes before every ``iter()`` (persistent workers never see attribute changes made after they
started), and yields ``(step, batch)`` for the steps ``start + worker_id + k * num_workers``.
"""
from __future__ import annotations

import mmap
import os
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import IterableDataset, get_worker_info

from shards import ShardCorrupt, UnsafeMember, read_index
from shards.schema import PICKLE_EXTENSIONS

from .batching import PlanSpec
from .collate import FIELDS, LATENT_FIELDS, check_fields, collate_views
from .order import filter_rows

#: tensor fields -> (member name, ndim)
_MEMBERS = {"codes": ("codes.npy", 2), "audio": ("audio.npy", 1), "text_ids": ("text_ids.npy", 1),
            "latents": ("latents.npy", 4), "latents_logvar": ("latents_logvar.npy", 4)}
# A member name is what follows the key's first dot: "codes.npy", "pyd", "x.pkl". scan_shard only
# checks ext.endswith(".pyd"), which misses a bare "KEY.pyd" member (ext "pyd"); match both here.
_UNSAFE_RE = "(^|\\.)(" + "|".join(re.escape(e.lstrip(".")) for e in PICKLE_EXTENSIONS) + ")$"


def refuse_unsafe(table: pa.Table, where: str) -> None:
    """Raise :class:`shards.UnsafeMember` (naming shard and key) if the index lists a pickle member."""
    members = table.column("members").combine_chunks()
    names = pc.utf8_lower(members.flatten().field("name"))
    bad = pc.match_substring_regex(names, _UNSAFE_RE).to_numpy(zero_copy_only=False)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        row = int(pc.list_parent_indices(members).to_numpy()[j])
        name = members.flatten().field("name")[j].as_py()
        key, shard = table.column("key")[row].as_py(), table.column("shard")[row].as_py()
        raise UnsafeMember(
            f"{Path(where) / shard}: sample {key!r} has member {key}.{name} that would need "
            f"unpickling ({int(bad.sum())} such member(s) in the index); shardcache never unpickles "
            "shard data. Remove the member from the shard and rebuild the index (`shards reindex`).")


class CacheSource:
    """One cache directory, filtered, as numpy arrays; reads member views from lazily opened mmaps.

    Args:
        cache_dir: directory with ``index.parquet`` and the shard tars.
        filters: see :func:`loaders.order.filter_rows`.
        fields: the fields that will be read (their members must exist; ``latents`` may be absent,
            ``latents_logvar`` must exist exactly where ``latents`` does).

    Attributes (one entry per kept row, index order): ``n`` rows; ``keys`` (Arrow strings);
    ``shard_of`` int32 (shards numbered in sorted name order); ``frames`` int64 codes frames;
    ``sample_rate`` int64; ``has_image`` bool; ``latent_shape`` the most common latent shape (or None;
    used for batches without any image).

    Raises ``FileNotFoundError`` (no index), :class:`shards.UnsafeMember` (pickle member listed),
    :class:`shards.ShardCorrupt` (shard file missing or shorter than its indexed members, bad
    member shape/size), ``ValueError`` (no sample left after filters; a requested member missing,
    e.g. ``latents_logvar`` from a cache made without ``store_posterior``).
    """

    def __init__(self, cache_dir: str | os.PathLike, filters: Any = None, fields: Sequence[str] = FIELDS):
        self.cache_dir = Path(cache_dir)
        self.fields = check_fields(fields)
        table = read_index(self.cache_dir)
        refuse_unsafe(table, str(self.cache_dir))
        all_shards = sorted(pc.unique(table.column("shard")).to_pylist())
        rows = filter_rows(table, filters)
        if len(rows) == 0:
            raise ValueError(f"{self.cache_dir}: no sample left after filters {filters!r} "
                             f"({table.num_rows} in the index)")
        t = table.take(pa.array(rows)) if len(rows) != table.num_rows else table
        self.n = t.num_rows
        self.keys = t.column("key").combine_chunks()
        self.shard_names = all_shards
        self.shard_of = pc.index_in(t.column("shard"), value_set=pa.array(all_shards, pa.string())) \
            .to_numpy(zero_copy_only=False).astype(np.int32)
        num = lambda c: t.column(c).to_numpy().astype(np.int64)  # noqa: E731
        self.frames = num("n_frames")
        self.sample_rate = num("sample_rate")
        self.has_image = t.column("has_image").to_numpy(zero_copy_only=False).astype(bool)
        self._member_arrays(t)
        self._check_files()
        self._maps: list[mmap.mmap | None] = [None] * len(self.shard_names)

    # -- index -> arrays ---------------------------------------------------------------------
    def _member_arrays(self, t: pa.Table) -> None:
        members = t.column("members").combine_chunks()
        flat = members.flatten()
        parent = pc.list_parent_indices(members).to_numpy()
        names = flat.field("name")
        self.off: dict[str, np.ndarray] = {}
        self.shape: dict[str, np.ndarray] = {}
        self.count: dict[str, np.ndarray] = {}
        self.dtype_of: dict[str, np.ndarray] = {}
        self.dtypes: dict[str, list[np.dtype]] = {}
        self._end = np.zeros(self.n, dtype=np.int64)  # furthest byte any member of a row needs
        ends = flat.field("offset").to_numpy() + flat.field("size").to_numpy()
        np.maximum.at(self._end, parent, ends)
        self.latent_shape = None
        for field in self.fields:
            member, ndim = _MEMBERS[field]
            sel = np.flatnonzero(pc.equal(names, member).to_numpy(zero_copy_only=False))
            rows = parent[sel]
            present = np.zeros(self.n, dtype=bool)
            present[rows] = True
            if field == "latents_logvar" and (self.has_image & ~present).any():
                missing = np.flatnonzero(self.has_image & ~present)
                raise ValueError(f"{self.cache_dir}: {len(missing)} image samples have no {member} (e.g. "
                                 f"{self.keys.take(pa.array(missing[:5])).to_pylist()}); precompute with "
                                 "store_posterior: true, or drop 'latents_logvar' from fields")
            if field not in LATENT_FIELDS and not present.all():
                missing = np.flatnonzero(~present)
                raise ValueError(f"{self.cache_dir}: {len(missing)} samples have no {member} (e.g. "
                                 f"{self.keys.take(pa.array(missing[:5])).to_pylist()}); drop "
                                 f"{field!r} from fields or filter them out")
            off = np.full(self.n, -1, dtype=np.int64)
            off[rows] = flat.field("offset").to_numpy()[sel]
            size = np.zeros(self.n, dtype=np.int64)
            size[rows] = flat.field("size").to_numpy()[sel]
            shape_lists = flat.field("shape").take(pa.array(sel))
            lens = pc.list_value_length(shape_lists).to_numpy(zero_copy_only=False)
            if len(sel) and (lens != ndim).any():
                bad = rows[np.flatnonzero(lens != ndim)[0]]
                raise ShardCorrupt(f"{self.cache_dir}: sample {self.keys[bad].as_py()!r} member {member} "
                                   f"has {lens[lens != ndim][0]} dims, expected {ndim}; re-run precompute")
            shape = np.zeros((self.n, ndim), dtype=np.int64)
            if len(sel):
                shape[rows] = shape_lists.flatten().to_numpy().reshape(len(sel), ndim)
            dstr = flat.field("dtype").take(pa.array(sel))
            uniq = pc.unique(dstr)
            dtypes = [np.dtype(d) for d in uniq.to_pylist()]
            code = np.zeros(self.n, dtype=np.int8)
            if len(uniq) > 1:
                code[rows] = pc.index_in(dstr, value_set=uniq).to_numpy(zero_copy_only=False)
            itemsize = np.array([d.itemsize for d in dtypes] or [1])[code]
            if (present & (np.prod(shape, axis=1) * itemsize != size)).any():
                bad = np.flatnonzero(present & (np.prod(shape, axis=1) * itemsize != size))[0]
                raise ShardCorrupt(f"{self.cache_dir}: sample {self.keys[int(bad)].as_py()!r} member "
                                   f"{member}: size {size[bad]} bytes does not match shape "
                                   f"{shape[bad].tolist()}; run `shards verify`")
            self.off[field], self.shape[field] = off, shape
            self.count[field] = np.prod(shape, axis=1)
            self.dtype_of[field], self.dtypes[field] = code, dtypes
            if field in LATENT_FIELDS and self.latent_shape is None and len(sel):
                img = shape[rows]
                if (img == img[0]).all():
                    self.latent_shape = tuple(int(v) for v in img[0])
                else:  # several resolutions: the most common one
                    vals, counts = np.unique(img, axis=0, return_counts=True)
                    self.latent_shape = tuple(int(v) for v in vals[int(np.argmax(counts))])

    def _check_files(self) -> None:
        need = np.zeros(len(self.shard_names), dtype=np.int64)
        np.maximum.at(need, self.shard_of, self._end)
        for i, name in enumerate(self.shard_names):
            if need[i] == 0:
                continue  # every sample of this shard was filtered out: never opened
            path = self.cache_dir / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise ShardCorrupt(f"{path}: listed in the index but missing; run `shards verify`") from None
            if size < need[i]:
                raise ShardCorrupt(f"{path}: {size} bytes but the index needs {need[i]} (truncated shard?); "
                                   "run `shards verify` and re-run precompute for it")

    # -- reading ------------------------------------------------------------------------------
    def map(self, shard: int) -> mmap.mmap:
        """The read-only mmap of shard number ``shard`` (opened on first use, in each process)."""
        mm = self._maps[shard]
        if mm is None:
            path = self.cache_dir / self.shard_names[shard]
            try:
                with open(path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:
                raise ShardCorrupt(f"{path}: listed in the index but missing; run `shards verify`") from None
            self._maps[shard] = mm
        return mm

    def views(self, field: str, rows: np.ndarray) -> list[np.ndarray | None]:
        """Numpy views (read-only, zero copy) of ``field`` for ``rows``; None where absent."""
        off, shape, code, dtypes = self.off[field], self.shape[field], self.dtype_of[field], self.dtypes[field]
        rows = np.asarray(rows)
        offs, counts, shards, codes = (off[rows].tolist(), self.count[field][rows].tolist(),
                                       self.shard_of[rows].tolist(), code[rows].tolist())
        shapes = shape[rows].tolist()
        out: list[np.ndarray | None] = []
        maps, mp = self._maps, self.map
        for o, c, s, d, shp in zip(offs, counts, shards, codes, shapes):
            if o < 0:
                out.append(None)
                continue
            mm = maps[s] or mp(s)
            out.append(np.frombuffer(mm, dtype=dtypes[d], count=c, offset=o).reshape(shp))
        return out

    def close(self) -> None:
        """Close the mmaps (views handed out earlier must not be used afterwards)."""
        for i, mm in enumerate(self._maps):
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view is alive; the map goes when it is garbage collected
                self._maps[i] = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_maps"] = [None] * len(self.shard_names)  # reopened lazily in each worker
        return state


class Sources:
    """Several :class:`CacheSource` in one id space: ``id = offsets[i] + row`` of source ``i``."""

    def __init__(self, sources: Sequence[CacheSource], names: Sequence[str] | None = None):
        self.sources = list(sources)
        self.names = list(names) if names is not None else [str(s.cache_dir) for s in self.sources]
        self.offsets = np.concatenate([[0], np.cumsum([s.n for s in self.sources])]).astype(np.int64)
        self.n = int(self.offsets[-1])
        self.fields = self.sources[0].fields
        self.frames = np.concatenate([s.frames for s in self.sources])
        shapes = [s.latent_shape for s in self.sources if s.latent_shape is not None]
        self.latent_shape = shapes[0] if shapes else None
        self.compact = False  # collate_views(compact=...): int16 audio, float16 latents

    def read_batch(self, ids: np.ndarray) -> dict[str, Any]:
        """The collated batch (see :mod:`loaders.collate`) of sample ``ids`` (int64, global)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(self.sources) == 1:
            return self._read_one(self.sources[0], ids)
        which = np.searchsorted(self.offsets, ids, side="right") - 1
        keys: list[Any] = [None] * len(ids)
        rates = np.zeros(len(ids), np.int64)
        per_field: dict[str, list] = {f: [None] * len(ids) for f in self.fields}
        for i in np.unique(which).tolist():
            pos = np.flatnonzero(which == i)
            src, rows = self.sources[i], ids[pos] - self.offsets[i]
            for p, k in zip(pos.tolist(), src.keys.take(pa.array(rows)).to_pylist()):
                keys[p] = k
            rates[pos] = src.sample_rate[rows]
            for f in self.fields:
                for p, v in zip(pos.tolist(), src.views(f, rows)):
                    per_field[f][p] = v
        batch = collate_views(keys, rates, self.fields, latent_shape=self.latent_shape, compact=self.compact,
                              **per_field)
        batch["source"] = [self.names[i] for i in which.tolist()]
        return batch

    def _read_one(self, src: CacheSource, rows: np.ndarray) -> dict[str, Any]:
        per_field = {f: src.views(f, rows) for f in self.fields}
        return collate_views(src.keys.take(pa.array(rows)).to_pylist(), src.sample_rate[rows],
                             self.fields, latent_shape=self.latent_shape, compact=self.compact, **per_field)

    def close(self) -> None:
        for s in self.sources:
            s.close()


class PlanDataset(IterableDataset):
    """What each DataLoader worker (or the main process when ``num_workers=0``) iterates.

    Yields ``(step, batch)`` for this rank's batches of the steps ``start + wid + k * nw`` of the
    epoch, where ``(epoch, start)`` is read from ``position`` (an int64 tensor ``[epoch, start_step]``
    in shared memory) when ``iter()`` is called, and ``wid``/``nw`` are the worker id / count.
    """

    def __init__(self, sources: Sources, spec: PlanSpec, rank: int, position: torch.Tensor):
        self.sources, self.spec, self.rank, self.position = sources, spec, int(rank), position

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        epoch, start = (int(v) for v in self.position.tolist())
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = self.spec.plan(epoch)  # computed eagerly here, not at the first next()
        return self._run(plan, range(start + wid, plan.n_steps, nw))

    def _run(self, plan, steps) -> Iterator[tuple[int, dict[str, Any]]]:
        for s in steps:
            yield s, self.sources.read_batch(plan.rank_batch(s, self.rank))
