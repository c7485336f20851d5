"""The cache a viewer shows (:class:`ViewedCache`): opened once, read page by page and sample by sample.

Opening reads what a first page needs and nothing that grows with the cache: ``manifest.json``
(:meth:`shards.manifest.CacheManifest.read_required`), the integrity root (:func:`shards.index.read_cache_id`:
``index.parquet`` and ``manifest.json`` checked against ``integrity.json``), ``rejects.parquet`` and
the index's Parquet footer (:class:`~.rows.IndexFile`: the scalar columns follow in a background
thread, ``members`` per row group). A cache of 10 million samples opens as fast as one of 100. The
encoders' identity (codec, image preset...) is :class:`shards.Cache`'s, built from the manifest
alone: its index is the viewer's own, read lazily.

A *view* (:class:`View`) is what the index page shows: the rows for which a filter condition holds
(:func:`shards.commands.query.matching_rows`, the DuckDB condition of ``shards query``, with a
deadline and stopped when its client leaves), whose text holds a search string (the side table of
:class:`~.text.TextTable`), sorted by a column; its row order is kept for the last
:data:`VIEWS_KEPT` views, so paging, histograms and a sample page's next/previous do not run it again.

A sample is read with :class:`shards.ShardReader` (every member checked against the XXH3-64 its
index entry records, as the loaders check it). A remote cache (``s3://...``, any URL the loaders
accept) is a :class:`shards.mirror.RemoteCache`: its manifest, index and rejects are downloaded once
into a local folder, and a shard the first time a sample of it is shown (the loaders' own download:
atomic, retried, names checked); the grid's text is shown for the shards already downloaded.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..cache import Cache
from ..commands._common import SCALAR_COLUMNS, UsageError
from ..commands.query import VIEWER_DEADLINE_S
from ..errors import ShardCorrupt
from ..index import REJECTS_SCHEMA, read_cache_id
from ..manifest import CacheManifest
from ..reader import ShardReader
from ..schema import INDEX_FILE, REJECTS_FILE
from ..storage import is_url
from . import background as background_threads
from .rows import IndexFile
from .text import MemberFiles, TextTable, read_members, trained_share, turn_lines, viewer_cache_dir

#: rows on one page of the index (and of the rejects)
PAGE_SIZE = 50
#: views whose row order is kept, so paging through one does not run it again
VIEWS_KEPT = 8
#: samples kept in memory after they were read (a sample page asks for its media one request each)
SAMPLES_KEPT = 8
#: seconds a filter condition may run (``shards view --query_timeout``)
QUERY_TIMEOUT_S = VIEWER_DEADLINE_S
#: the columns a view may be sorted by (the index's scalar columns)
SORTABLE = tuple(c for c in SCALAR_COLUMNS if c not in ("sha256",))
#: index rows a page in index order is read from directly (``iter_batches``: no column read, no DuckDB)
HEAD_ROWS = 4096
#: seconds the background work (index columns, side table, histograms) waits for the first page to be answered
BACKGROUND_DELAY_S = 2.0
#: caches up to this many samples get their side table of text built from the start; a larger one when
#: a search first asks for it (reading every sample's json and labels takes minutes at 10 million)
TEXT_AT_START_ROWS = 1_000_000
#: bins of the index page's histograms
HIST_BINS = 24


class TextNotReady(Exception):
    """A search was asked for before the side table of the samples' text is complete (the page says
    how far it got)."""


@dataclass(frozen=True)
class View:
    """What the index shows: ``where`` (a SQL condition over the index columns), ``q`` (a text the
    samples' text must hold, case-insensitive), ``sort`` (a column of :data:`SORTABLE`) and ``desc``.
    All empty: every sample in index order."""

    where: str = ""
    q: str = ""
    sort: str = ""
    desc: bool = False

    @classmethod
    def of(cls, query: dict[str, str]) -> "View":
        """The view of a request's query string. Raises :class:`UsageError` for an unknown sort column."""
        sort = (query.get("sort") or "").strip()
        if sort and sort not in SORTABLE:
            raise UsageError(f"sort: unknown column {sort!r}; columns: {', '.join(SORTABLE)}")
        return cls((query.get("where") or "").strip(), (query.get("q") or "").strip(), sort,
                   bool(sort) and query.get("desc") in ("1", "true", "yes"))

    @property
    def is_all(self) -> bool:
        return not (self.where or self.q or self.sort)

    def params(self) -> dict[str, Any]:
        """The query-string values that name this view (for links)."""
        return dict(where=self.where or None, q=self.q or None, sort=self.sort or None,
                    desc=1 if self.desc else None)


@dataclass
class Page:
    """One page of index rows (or rejects).

    Attributes: ``rows`` (dicts: the index's scalar columns plus ``row`` (index position),
    ``fields`` (``[(field, shape)]`` from the row's members), ``lines`` (one per turn, or None when
    the text is not at hand), ``trained_share``, ``media`` (see :meth:`ViewedCache.page`); rejects:
    key, source, reason, detail), ``start`` (position of the first row among ``total``), ``total``
    (rows matching), ``size`` (rows per page).
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
    ``(C, n_images, H, W)``...), ``meta`` (the sample's ``KEY.json``), ``position`` (its index row)."""

    key: str
    row: dict[str, Any]
    members: list[dict[str, Any]]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    position: int = 0


class ViewedCache:
    """A cache opened for viewing (see the module docstring).

    Args:
        source: the cache folder, a ``file://`` URL, or the URL of a remote cache.
        storage_options: fsspec options of a remote cache (endpoint, credentials...).
        local_dir: the local folder a remote cache's files are downloaded to (default: ``view`` beside
            the loaders' rank folders, :func:`shards.mirror.default_local_dir`).
        query_timeout_s: seconds a filter condition may run (:data:`QUERY_TIMEOUT_S`).
        text_dir: where the side table of the samples' text is kept (default
            :func:`~.text.viewer_cache_dir`; None: in memory only). Never the cache folder.
        background: read in daemon threads, once the first page is answered (:attr:`serving`), the
            index's scalar columns, the side table of text (local caches; a remote cache's would
            download every shard, so it has none) and the default view's histograms. False: each on
            first use.

    Attributes: ``source`` (as given), ``manifest``, ``id`` (the verified cache id), ``facts``
    (:class:`shards.Cache` of the manifest: codec, image preset, special tokens; its index is empty),
    ``index`` (:class:`~.rows.IndexFile`), ``files_dir`` (the local folder the shards are read from),
    ``rejects`` (the ``rejects.parquet`` table, empty without one), ``text`` (:class:`~.text.TextTable`
    or None).

    Raises ``FileNotFoundError`` for a folder without ``index.parquet``, :class:`shards.ManifestError`,
    :class:`shards.ShardCorrupt` (what :func:`shards.index.read_cache_id` refuses, an unreadable
    index), :class:`shards.UnsupportedFormat`.
    """

    def __init__(self, source: str | Path, storage_options: dict | None = None, local_dir: str | Path | None = None,
                 *, query_timeout_s: float = QUERY_TIMEOUT_S, text_dir: Path | None | str = "default",
                 background: bool = True):
        self.source = str(source)
        self.remote = None
        self.query_timeout_s = float(query_timeout_s)
        if is_url(source):
            from ..mirror import RemoteCache, default_local_dir
            url = self.source.rstrip("/")
            base = Path(local_dir) if local_dir is not None else default_local_dir(url, 0).with_name("view")
            self.remote = RemoteCache(url, local_dir=base, storage_options=storage_options)
            if self.remote.remote.exists(REJECTS_FILE):
                self.remote.remote.get(REJECTS_FILE, self.remote.local / REJECTS_FILE)
            self.files_dir = Path(self.remote.local)
        else:
            from ..storage import local_path
            self.files_dir = local_path(source)
        self.cache_dir = self.files_dir
        index_path = self.files_dir / INDEX_FILE
        if not index_path.is_file():
            raise FileNotFoundError(f"{index_path} not found: is {source} a shardcache cache "
                                    "(a directory made by `shardcache precompute`)?")
        self.manifest = CacheManifest.read_required(self.files_dir)
        self.index = IndexFile(index_path, background=False)
        try:
            self.id = read_cache_id(self.files_dir)  # index.parquet and manifest.json against integrity.json
            now = os.stat(index_path)
            if (now.st_dev, now.st_ino) != (self.index.stat.st_dev, self.index.stat.st_ino):
                raise ShardCorrupt(f"{index_path} was replaced while the viewer opened it; open it again")
        except BaseException:
            self.index.close()
            raise
        # the manifest's facts (encoders, tokens, preset); the viewer reads the index itself (:class:`.rows.IndexFile`)
        self.facts = Cache(self.source, self.files_dir, self.manifest, self.id, None)
        if self.remote is not None:
            self.remote.adopt([e["path"] for e in self.manifest.all_shard_entries() if "path" in e],
                              self.manifest.to_dict())  # keeps local shards an earlier run left whole
        self.rejects = _read_rejects(self.files_dir)
        self.files = MemberFiles(self.files_dir)
        self._lock = threading.Lock()
        self._fetch_lock = threading.Lock()  # one download at a time; pages not waiting for it
        self._views: OrderedDict[View, np.ndarray | None] = OrderedDict()
        self._hists: OrderedDict[View, tuple[bool, list]] = OrderedDict()
        self._hist_lock = threading.Lock()
        self._samples: OrderedDict[str, Sample] = OrderedDict()
        self.text: TextTable | None = None
        if self.remote is None:
            folder = viewer_cache_dir() if text_dir == "default" else (Path(text_dir) if text_dir else None)
            if folder is not None and _inside(folder, self.files_dir):
                folder = None  # never write into the cache folder: kept in memory instead
            self.text = TextTable(self.id, len(self), self._text_rows, self.files, folder)
        #: set once a first page was answered (by :class:`~.app.App`): the background work waits for it
        self.serving = threading.Event()
        self._closing = threading.Event()
        self._warm = background_threads.start(self._background, "shardcache-view-warm", self._halt) \
            if background else None

    def __len__(self) -> int:
        return self.index.num_rows

    def _background(self) -> None:
        """After the first page (or :data:`BACKGROUND_DELAY_S`): the index's scalar columns, the side
        table of text (caches up to :data:`TEXT_AT_START_ROWS` samples), the default view's histograms."""
        from .rows import background_priority
        background_priority()
        self.serving.wait(BACKGROUND_DELAY_S)
        if self._closing.is_set():
            return
        self.index.scalars_in_background()
        if self.text is not None and len(self) <= TEXT_AT_START_ROWS:
            self.text.start()
        if self._closing.is_set():
            return
        try:
            self.histograms(View())
        except Exception:  # noqa: BLE001 - a page computes them again and says what is wrong
            pass

    def _text_rows(self, start: int, stop: int) -> pa.Table:
        rows = np.arange(start, stop, dtype=np.int64)
        keys = self.index.scalars().column("key").take(pa.array(rows))
        shards = self.index.scalars().column("shard").take(pa.array(rows))
        return pa.table({"key": keys, "shard": shards, "members": self.index.members(rows)})

    # -- views ---------------------------------------------------------------------------------------
    def order(self, view: View, gone: threading.Event | None = None) -> np.ndarray | None:
        """The index rows of ``view`` in its order (int64), or None for every row in index order.

        Raises :class:`UsageError` (a condition DuckDB refuses, or one past its deadline:
        :class:`~shards.commands.query.QueryTimeout`), :class:`~shards.commands.query.QueryCancelled`
        (``gone`` was set: the client left), :class:`TextNotReady` (a search before the side table
        is complete)."""
        if view.is_all:
            return None
        with self._lock:
            if view in self._views:
                self._views.move_to_end(view)
                return self._views[view]
        rows: np.ndarray | None = None
        if view.where:
            from ..commands.query import matching_rows
            from .rows import LAZY_COLUMNS
            named = tuple(c for c in LAZY_COLUMNS if c in view.where.lower())  # read only when named
            rows = matching_rows(self.index.scalars(named), view.where, deadline_s=self.query_timeout_s,
                                 cancelled=gone).to_numpy(zero_copy_only=False).astype(np.int64)
        scalars = self.index.scalars()
        if view.q:
            table = self.text_table()
            hit = pc.match_substring(table.column("text"), view.q, ignore_case=True)
            found = np.flatnonzero(hit.to_numpy(zero_copy_only=False))
            rows = found if rows is None else np.intersect1d(rows, found, assume_unique=True)
        if view.sort:
            values = scalars.column(view.sort)
            if pa.types.is_dictionary(values.type):  # (Arrow sorts no dictionary array)
                values = values.cast(values.type.value_type)
            sub = values if rows is None else values.take(pa.array(rows))
            idx = pc.array_sort_indices(sub, order="descending" if view.desc else "ascending",
                                        null_placement="at_end").to_numpy()  # stable: ties keep index order
            rows = idx.astype(np.int64) if rows is None else rows[idx]
        with self._lock:
            self._views[view] = rows
            while len(self._views) > VIEWS_KEPT:
                self._views.popitem(last=False)
        return rows

    def text_table(self) -> pa.Table:
        """The side table of the samples' text; :class:`TextNotReady` until it is complete."""
        if self.text is None:
            raise TextNotReady("searching text needs the samples' json, which a remote cache has only for the shards "
                               "already downloaded: search is not available for a remote cache")
        if self.text.error:
            raise TextNotReady(f"the samples' text could not be read: {self.text.error}")
        if not self.text.ready:
            self.text.start()
            raise TextNotReady(f"the text of the samples is being read: {self.text.done:,} of {len(self):,} so far; "
                               "the search works once it is complete (reload)")
        return self.text.table

    def total(self, view: View, gone: threading.Event | None = None) -> int:
        rows = self.order(view, gone)
        return len(self) if rows is None else int(rows.size)

    def page(self, start: int = 0, size: int = PAGE_SIZE, view: View = View(),
             gone: threading.Event | None = None) -> Page:
        """Rows ``start .. start + size`` of ``view``. Only these rows become Python values; their
        text and trained share are read from their json and labels members. Each row's ``media``:
        ``{"audio": K or None, "image": bool}``: the item of the stored waveform a small player plays
        (the last one: the target of TTS and voice cloning) and whether the sample has an image."""
        rows = self.order(view, gone)
        total = len(self) if rows is None else int(rows.size)
        if rows is None and start + size <= HEAD_ROWS:  # the first pages: from the file's first rows
            table = self.index.head(start + size).slice(start, size)
            positions = np.arange(start, start + table.num_rows, dtype=np.int64)
        else:
            positions = (np.arange(start, min(start + size, total), dtype=np.int64) if rows is None
                         else rows[start:start + size])
            table = self.index.rows(positions)
        texts = self._texts(table, positions)
        out = []
        for pos, r, (lines, share) in zip(positions.tolist(), table.to_pylist(), texts):
            members = r.pop("members") or []
            r["row"] = pos
            r["fields"] = [(m["name"][:-4], tuple(m["shape"] or ())) for m in members if m["name"].endswith(".npy")]
            r["lines"], r["trained_share"] = lines, share
            shapes = dict(r["fields"])
            # the stored waveform's items (audio_starts: n + 1 offsets; none: one item), as /audio/ serves them
            starts = shapes.get("audio_starts")
            n_wave = (int(starts[0]) - 1 if starts and int(starts[0]) >= 2 else 1) if "audio" in shapes else 0
            r["media"] = dict(audio=n_wave - 1 if n_wave > 0 else None,
                              image=bool(r.get("has_image")) or "latents" in shapes)
            out.append(r)
        return Page(out, start, total, size)

    def _texts(self, table: pa.Table, positions: np.ndarray) -> list[tuple[list[str] | None, float | None]]:
        """``(lines, trained share)`` of each row, read from the rows' json and labels members (a
        remote cache: only those of the shards already downloaded; the others get None)."""
        got = read_members(self.files, table, only_present=self.remote is not None)
        return [(turn_lines(m) if m is not None else None, trained_share(lab)) for m, lab in got]

    def histograms(self, view: View, gone: threading.Event | None = None) -> list[dict[str, Any]]:
        """Histograms of ``duration_s``, ``n_text_tokens`` and the trained-token share over the rows of
        ``view`` (order aside): ``[{name, label, counts, edges, total, note}]`` (``counts`` None with a
        ``note`` where the values are not at hand yet)."""
        with self._hist_lock:  # one computation at a time: a page waits for the background one, then reads it
            return self._histograms(view, gone)

    def _histograms(self, view: View, gone: threading.Event | None) -> list[dict[str, Any]]:
        text_ready = self.text is not None and self.text.ready
        with self._lock:
            kept = self._hists.get(view)
            if kept is not None and (kept[0] or not text_ready):
                self._hists.move_to_end(view)
                return kept[1]
        rows = self.order(view, gone)
        scalars = self.index.scalars()
        out = []
        for col, label in (("duration_s", "duration (s)"), ("n_text_tokens", "text tokens")):
            v = scalars.column(col)
            v = (v if rows is None else v.take(pa.array(rows))).to_numpy(zero_copy_only=False).astype(np.float64)
            out.append(_histogram(col, label, v))
        if self.text is not None and self.text.ready:
            s = self.text.table.column("trained_share")
            s = s if rows is None else s.take(pa.array(rows))
            v = s.to_numpy(zero_copy_only=False)
            out.append(_histogram("trained_share", "trained-token share", v.astype(np.float64), lo=0.0, hi=1.0))
        else:
            note = ("not available for a remote cache" if self.text is None else self.text.error if self.text.error else
                    f"being read: {self.text.done:,} of {len(self):,} samples" if self.text.started is not None else
                    f"read when a search first asks for it (a cache of more than {TEXT_AT_START_ROWS:,} samples)")
            out.append(dict(name="trained_share", label="trained-token share", counts=None, edges=None, total=0,
                            note=note))
        with self._lock:  # kept per view (complete once the side table is)
            self._hists[view] = (text_ready, out)
            while len(self._hists) > VIEWS_KEPT:
                self._hists.popitem(last=False)
        return out

    def neighbours(self, key: str, view: View, gone: threading.Event | None = None) -> dict[str, Any]:
        """Where sample ``key`` stands in ``view``: ``{position (0-based) or None, total, prev, next}``
        (keys of the samples before and after it in the view's order, or None)."""
        row = self.row_of(key)
        rows = self.order(view, gone)
        total = len(self) if rows is None else int(rows.size)
        if row is None:
            return dict(position=None, total=total, prev=None, next=None)
        if rows is None:
            pos = row
        else:
            hit = np.flatnonzero(rows == row)
            if not hit.size:
                return dict(position=None, total=total, prev=None, next=None)
            pos = int(hit[0])
        keys = self.index.scalars().column("key")

        def key_at(p: int) -> str | None:
            if not 0 <= p < total:
                return None
            return keys[int(p if rows is None else rows[p])].as_py()

        return dict(position=pos, total=total, prev=key_at(pos - 1), next=key_at(pos + 1))

    # -- rejects -------------------------------------------------------------------------------------
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
        return self.index.row_of(key)

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
        table = self.index.row(row)
        if self.remote is not None:
            self._fetch(table)
        reader = ShardReader(self.files_dir, index=table, manifest=self.manifest.to_dict())
        try:
            got = reader.get(0)
            arrays = {k: np.array(v) for k, v in got.items() if isinstance(v, np.ndarray)}  # out of the map
            meta = got.get("json") if isinstance(got.get("json"), dict) else {}
        finally:
            reader.close()
        record = table.to_pylist()[0]
        members = [dict(name=m["name"], dtype=m["dtype"], shape=list(m["shape"] or ()), bytes=m["size"],
                        file=m.get("file") or record["shard"]) for m in record.pop("members") or []]
        s = Sample(key=key, row=record, members=members, arrays=arrays, meta=meta, position=row)
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

    def writer(self) -> str | None:
        """Who writes this (local) cache right now (``shards.lock.describe``), or None."""
        if self.remote is not None:
            return None
        from ..writing import writer_of
        return writer_of(self.files_dir)

    def _halt(self) -> None:
        """Make the background work return early (it checks between steps)."""
        self._closing.set()
        self.serving.set()
        if self.text is not None:
            self.text.stop()

    def close(self) -> None:
        """Stop the background work and wait for it (no read runs on a closed file), stop the side table's
        build, close the files, release a remote cache's local folder."""
        background_threads.join(self._warm, self._halt)
        if self.text is not None:
            self.text.close()
        self.files.close()
        self.index.close()
        if self.remote is not None:
            self.remote.close()


def _read_rejects(folder: Path) -> pa.Table:
    """``rejects.parquet`` (empty without one), read with ``ParquetFile`` (``pq.read_table`` imports
    ``pyarrow.dataset`` and pandas: a second at start for nothing)."""
    import pyarrow.parquet as pq
    path = folder / REJECTS_FILE
    if not path.is_file():
        return pa.Table.from_batches([], schema=REJECTS_SCHEMA)  # (empty_table() imports pandas)
    return pq.ParquetFile(path).read().select(REJECTS_SCHEMA.names).cast(REJECTS_SCHEMA)


def _inside(folder: Path, cache: Path) -> bool:
    a, b = os.path.realpath(folder), os.path.realpath(cache)
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def _histogram(name: str, label: str, values: np.ndarray, lo: float | None = None, hi: float | None = None) -> dict:
    v = values[np.isfinite(values)]
    if not v.size:
        return dict(name=name, label=label, counts=[], edges=[], total=0, note="no values")
    lo = float(v.min()) if lo is None else lo
    hi = float(v.max()) if hi is None else hi
    if hi <= lo:
        hi = lo + 1.0
    counts, edges = np.histogram(v, bins=HIST_BINS, range=(lo, hi))
    return dict(name=name, label=label, counts=counts.tolist(), edges=edges.tolist(), total=int(v.size), note=None,
                mean=float(v.mean()), median=float(np.median(v)))
