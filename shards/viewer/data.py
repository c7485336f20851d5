"""The cache a viewer shows (:class:`ViewedCache`): opened once, read page by page and sample by sample.

Everything is read through the project's own readers: the manifest, the index and the cache id
through :meth:`shards.Cache.open`; a sample through :class:`shards.ShardReader` (every member
checked against the XXH3-64 its index entry records, as the loaders check it); a filter through
:func:`shards.commands.query.select` (the DuckDB condition of ``shards query``). A remote cache
(``s3://...``, any URL the loaders accept) is a :class:`loaders.remote.RemoteCache`: its manifest,
index and rejects are downloaded once into a local folder, and a shard the first time a sample of
it is shown (the loaders' own download: atomic, retried, names checked).

Opening reads no sample and turns no index row into Python objects: a page converts only its own
rows (:meth:`ViewedCache.page`), so a cache of 100,000 samples opens as fast as one of 100.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..cache import Cache
from ..commands._common import SCALAR_COLUMNS
from ..index import read_rejects
from ..reader import ShardReader
from ..schema import REJECTS_FILE
from ..storage import is_url

#: rows on one page of the index (and of the rejects)
PAGE_SIZE = 50
#: filters whose matching rows are kept, so paging through one does not run it again
FILTERS_KEPT = 8
#: samples kept in memory after they were read (a sample page asks for its media one request each)
SAMPLES_KEPT = 8


@dataclass
class Page:
    """One page of index rows (or rejects).

    Attributes: ``rows`` (dicts: the index's scalar columns plus ``fields``, ``[(field, shape)]``
    from the row's members; rejects: key, source, reason, detail), ``start`` (position of the
    first row among ``total``), ``total`` (rows matching), ``size`` (rows per page).
    """

    rows: list[dict[str, Any]]
    start: int
    total: int
    size: int

    @property
    def number(self) -> int:
        """1-based number of this page."""
        return self.start // self.size + 1

    @property
    def pages(self) -> int:
        """How many pages ``total`` rows make (at least 1)."""
        return max(1, -(-self.total // self.size))


@dataclass
class Sample:
    """One sample as stored: ``key``, ``row`` (its index row: scalar columns), ``members`` (``[{name,
    dtype, shape}]`` from the index), ``arrays`` (field -> a numpy copy of the stored array, in its
    stored dtype: ``input_ids`` int32 ``(L,)``, ``audio`` int16 ``(T,)``, ``latents`` float16
    ``(C, n_images, H, W)``...), ``meta`` (the sample's ``KEY.json``)."""

    key: str
    row: dict[str, Any]
    members: list[dict[str, Any]]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


class ViewedCache:
    """A cache opened for viewing (see the module docstring).

    Args:
        source: the cache folder, a ``file://`` URL, or the URL of a remote cache.
        storage_options: fsspec options of a remote cache (endpoint, credentials...).
        local_dir: the local folder a remote cache's files are downloaded to (default: ``view`` beside
            the loaders' rank folders, :func:`loaders.remote.default_local_dir`).

    Attributes: ``source`` (as given), ``cache`` (:class:`shards.Cache`), ``files_dir`` (the local
    folder the shards are read from), ``rejects`` (the ``rejects.parquet`` table, empty without one).

    Raises what :meth:`shards.Cache.open` raises (``FileNotFoundError`` for a folder that is not a
    cache, :class:`shards.ManifestError`, :class:`shards.ShardCorrupt`, :class:`shards.UnsupportedFormat`).
    """

    def __init__(self, source: str | Path, storage_options: dict | None = None, local_dir: str | Path | None = None):
        self.source = str(source)
        self.remote = None
        if is_url(source):
            from ..mirror import RemoteCache, default_local_dir
            url = self.source.rstrip("/")
            base = Path(local_dir) if local_dir is not None else default_local_dir(url, 0).with_name("view")
            self.remote = RemoteCache(url, local_dir=base, storage_options=storage_options)
            if self.remote.remote.exists(REJECTS_FILE):
                self.remote.remote.get(REJECTS_FILE, self.remote.local / REJECTS_FILE)
            self.cache = Cache.open(self.remote.local)
            self.remote.adopt([e["path"] for e in self.cache.manifest.all_shard_entries() if "path" in e],
                              self.cache.manifest.to_dict())  # keeps local shards an earlier run left whole
            self.files_dir = self.remote.local
        else:
            self.cache = Cache.open(source)
            self.files_dir = self.cache.dir
        self.keys = self.cache.index.column("key")
        self.rejects = read_rejects(self.files_dir)
        self._lock = threading.Lock()
        self._fetch_lock = threading.Lock()  # one download at a time; pages not waiting for it
        self._filters: OrderedDict[str, pa.Array] = OrderedDict()
        self._samples: OrderedDict[str, Sample] = OrderedDict()

    def __len__(self) -> int:
        return len(self.cache)

    # -- the index -----------------------------------------------------------------------------------
    def matching_rows(self, where: str) -> pa.Array:
        """The index rows (int64 positions, index order) for which the SQL condition ``where`` holds,
        evaluated by :func:`shards.commands.query.select` (DuckDB, no file access); kept for the
        last :data:`FILTERS_KEPT` conditions. Raises :class:`shards.commands._common.UsageError`
        with DuckDB's reason for a condition it refuses."""
        with self._lock:
            if where in self._filters:
                self._filters.move_to_end(where)
                return self._filters[where]
        from ..commands.query import select
        keys = select(self.cache.dir, where, ["key"]).column("key")
        rows = pc.index_in(keys, value_set=self.keys.combine_chunks()).cast(pa.int64())
        with self._lock:
            self._filters[where] = rows
            while len(self._filters) > FILTERS_KEPT:
                self._filters.popitem(last=False)
        return rows

    def page(self, start: int = 0, size: int = PAGE_SIZE, where: str | None = None) -> Page:
        """Index rows ``start .. start + size`` in index order (of those matching ``where``, a SQL
        condition over the index columns, when given). Only these rows become Python values."""
        where = (where or "").strip()
        if where:
            rows = self.matching_rows(where)
            total = len(rows)
            table = self.cache.index.take(rows.slice(start, size))
        else:
            total = len(self)
            table = self.cache.index.slice(start, size)
        out = []
        for r in table.select(list(SCALAR_COLUMNS) + ["members"]).to_pylist():
            members = r.pop("members") or []
            r["fields"] = [(m["name"][:-4], tuple(m["shape"] or ())) for m in members if m["name"].endswith(".npy")]
            out.append(r)
        return Page(out, start, total, size)

    def rejects_page(self, start: int = 0, size: int = PAGE_SIZE) -> Page:
        """Rows ``start .. start + size`` of ``rejects.parquet``: key, source, reason, detail."""
        return Page(self.rejects.slice(start, size).to_pylist(), start, self.rejects.num_rows, size)

    def reject_counts(self) -> list[tuple[str, int]]:
        """``[(reason, rows)]``, most frequent first."""
        if not self.rejects.num_rows:
            return []
        counts = pc.value_counts(self.rejects.column("reason").combine_chunks()).to_pylist()
        return sorted(((c["values"], c["counts"]) for c in counts), key=lambda rc: (-rc[1], str(rc[0])))

    def row_of(self, key: str) -> int | None:
        """The index row of sample ``key``, or None when the index has no such key."""
        i = pc.index(self.keys, pa.scalar(key, pa.string())).as_py()
        return None if i is None or i < 0 else int(i)

    # -- one sample ----------------------------------------------------------------------------------
    def sample(self, key: str) -> Sample | None:
        """Sample ``key`` read with :class:`shards.ShardReader` (checksums checked), or None when the
        index has no such key. The last :data:`SAMPLES_KEPT` samples are kept in memory.

        Raises :class:`shards.ShardCorrupt` naming shard, key and member for damaged bytes, and a
        remote cache's download errors (``OSError`` naming the URL)."""
        with self._lock:
            if key in self._samples:
                self._samples.move_to_end(key)
                return self._samples[key]
        row = self.row_of(key)
        if row is None:
            return None
        table = self.cache.index.slice(row, 1)
        if self.remote is not None:
            self._fetch(table)
        reader = ShardReader(self.files_dir, index=table, manifest=self.cache.manifest.to_dict())
        try:
            got = reader.get(0)
            arrays = {k: np.array(v) for k, v in got.items() if isinstance(v, np.ndarray)}  # out of the map
            meta = got.get("json") if isinstance(got.get("json"), dict) else {}
        finally:
            reader.close()
        record = table.to_pylist()[0]
        members = [dict(name=m["name"], dtype=m["dtype"], shape=list(m["shape"] or ()), bytes=m["size"],
                        file=m.get("file") or record["shard"]) for m in record.pop("members") or []]
        s = Sample(key=key, row=record, members=members, arrays=arrays, meta=meta)
        with self._lock:
            self._samples[key] = s
            while len(self._samples) > SAMPLES_KEPT:
                self._samples.popitem(last=False)
        return s

    def _fetch(self, table: pa.Table) -> None:
        """Download the shard and sidecar files of ``table``'s rows that are not in the local folder yet."""
        names = set(table.column("shard").to_pylist())
        names |= {m["file"] for ms in table.column("members").to_pylist() for m in ms or [] if m.get("file")}
        with self._fetch_lock:  # one download of a file at a time, whatever the number of requests
            for name in sorted(names):
                if name not in self.remote.present:
                    self.remote.present[name] = self.remote.fetch(name)

    def close(self) -> None:
        """Release a remote cache's local folder."""
        if self.remote is not None:
            self.remote.close()
