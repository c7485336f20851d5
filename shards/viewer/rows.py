"""A cache's ``index.parquet`` as the viewer reads it: lazily, so opening costs the same at 1,000 and
at 10 million samples.

:class:`IndexFile` opens the file once (the descriptor is kept: a rerun that renames a new index into
place does not change what a running viewer reads) and takes its row count from the Parquet footer.
Nothing else is read at start:

* the first rows (a first page) are decoded with ``iter_batches``, in milliseconds;
* the scalar columns (:data:`shards.commands._common.SCALAR_COLUMNS`: what filters, sorting, key
  lookups and histograms need) are read once, in a background thread started when the cache is
  opened (lowered priority; 4-7 s for 10 million rows on the development machine); whoever needs
  them first waits. ``sha256`` (half of that read) only when a filter names it;
* the ``members`` column (where each array sits) is read for the rows a page or a sample shows only,
  by DuckDB's Parquet reader (``file_row_number``: it decodes only the pages those rows are in; 50
  rows of a 10-million-row index in well under a second, where pyarrow decodes their whole row
  groups, a million rows each), through the open descriptor (``/proc/self/fd/N``: the file checked,
  whatever is renamed meanwhile). Until the scalar columns are in, a key is looked up the same way
  (the key column alone, filtered where it is stored: 60 ms for 10 million keys).

No row becomes a Python object but those of the page being drawn.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..commands._common import SCALAR_COLUMNS
from ..errors import ShardCorrupt
from ..index import INDEX_SCHEMA
from . import background as background_threads

SCALAR_SCHEMA = pa.schema([INDEX_SCHEMA.field(c) for c in SCALAR_COLUMNS])
#: scalar columns read only when a filter names them (64 characters a row: half the read of the others)
LAZY_COLUMNS = ("sha256",)
#: string columns of few values, kept dictionary-encoded (as Parquet stores them): less memory, faster
DICTIONARY_COLUMNS = ("shard", "speaker")
MEMBERS = INDEX_SCHEMA.field("members")


def background_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: a thread is a task with a nice value of its own),
    so that what runs in the background (the index's columns, the side table of text) leaves the
    cores to the pages; elsewhere nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class IndexFile:
    """``index.parquet`` of one cache (see the module docstring).

    Args:
        path: the file.
        background: start reading the scalar columns in a thread now (False: on first use, or
            :meth:`scalars_in_background`).

    Attributes: ``path``, ``num_rows`` (from the footer), ``stat`` (the ``os.stat_result`` of the
    open file: the integrity check compares it with the file it verified).

    Raises ``FileNotFoundError`` for a missing file and :class:`shards.ShardCorrupt` for one Parquet
    cannot read (naming the file and ``shards reindex``).
    """

    def __init__(self, path: str | os.PathLike, background: bool = True):
        self.path = Path(path)
        # two descriptors of one file: pages read rows while the scalar columns are read
        self._file, self._file2 = open(self.path, "rb"), open(self.path, "rb")
        try:
            self.stat = os.fstat(self._file.fileno())
            second = os.fstat(self._file2.fileno())
            if (second.st_dev, second.st_ino) != (self.stat.st_dev, self.stat.st_ino):
                raise OSError("the file was replaced while it was opened")
            self._pf = pq.ParquetFile(self._file)
            self._pf2 = pq.ParquetFile(self._file2, read_dictionary=list(DICTIONARY_COLUMNS))
            self.num_rows = int(self._pf.metadata.num_rows)
        except (pa.ArrowInvalid, OSError) as e:
            self._file.close()
            self._file2.close()
            raise ShardCorrupt(f"{self.path}: cannot read the index ({e}); `shardcache shards reindex "
                               f"{self.path.parent}` rebuilds it") from e
        self._proc = f"/proc/self/fd/{self._file.fileno()}"
        self._io = threading.Lock()        # one read of the first descriptor at a time
        self._db_lock = threading.Lock()
        self._db = None                    # DuckDB, for the members and keys of some rows
        self._local = threading.local()
        self._scalars: pa.Table | None = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._loader: threading.Thread | None = None
        self._start = threading.Lock()
        if background:
            self._begin()

    # -- the scalar columns ---------------------------------------------------------------------------
    def scalars_in_background(self) -> None:
        """Start reading the scalar columns in a daemon thread (once)."""
        self._begin()

    def _begin(self) -> None:
        with self._start:
            if self._loader is None:
                self._loader = background_threads.start(self._load, "shardcache-view-index")

    def _load(self) -> None:
        background_priority()
        try:
            eager = [c for c in SCALAR_COLUMNS if c not in LAZY_COLUMNS]
            self._scalars = _typed(self._pf2.read(columns=eager))
        except BaseException as e:  # noqa: BLE001 - given to whoever waits
            self._error = e
        finally:
            self._ready.set()
        try:  # pyarrow imports pandas (where installed) at its first pa.array(): here, not in a page
            pa.array([0])
        except Exception:  # noqa: BLE001 - only a warm-up
            pass

    @property
    def ready(self) -> bool:
        """Whether the scalar columns are in memory."""
        return self._ready.is_set() and self._error is None

    def scalars(self, also: tuple[str, ...] = ()) -> pa.Table:
        """The scalar columns of every row (one chunk each; ``shard`` and ``speaker`` dictionary-encoded),
        but :data:`LAZY_COLUMNS`, which ``also`` adds (read on the first call that asks); waits for the
        background read."""
        self._begin()
        self._ready.wait()
        if self._error is not None:
            raise ShardCorrupt(f"{self.path}: cannot read the index ({self._error}); `shardcache shards reindex "
                               f"{self.path.parent}` rebuilds it") from self._error
        missing = [c for c in also if c not in self._scalars.column_names]
        if missing:
            with self._start:
                missing = [c for c in missing if c not in self._scalars.column_names]
                if missing:
                    extra = _typed(self._pf2.read(columns=missing))
                    t = self._scalars
                    for name in missing:
                        t = t.append_column(extra.schema.field(name), extra.column(name))
                    self._scalars = t
        return self._scalars

    # -- rows ----------------------------------------------------------------------------------------
    def head(self, n: int) -> pa.Table:
        """The first ``n`` rows, every column (what a first page needs before the scalars are read)."""
        with self._io:
            batches, got = [], 0
            for b in self._pf.iter_batches(batch_size=max(1, min(n, 4096)), use_threads=False):  # (the pool may be busy)
                batches.append(b)
                got += b.num_rows
                if got >= n:
                    break
        t = pa.Table.from_batches(batches) if batches else pa.Table.from_batches([], schema=INDEX_SCHEMA)
        return t.slice(0, n).cast(INDEX_SCHEMA)

    def _duckdb(self):
        """This thread's DuckDB cursor (one in-memory database, created once; it reads this file and
        is given no SQL from a request)."""
        with self._db_lock:
            if self._db is None:
                import duckdb
                self._db = duckdb.connect(":memory:")
            cursor = getattr(self._local, "cursor", None)
            if cursor is None:
                cursor = self._local.cursor = self._db.cursor()
        return cursor

    def _source(self) -> str:
        return self._proc if os.path.exists(self._proc) else str(self.path)

    def members(self, rows: np.ndarray) -> pa.Array:
        """The ``members`` of index ``rows`` (int64 positions, any order), in that order."""
        return self._read_rows(rows, ("members",)).column("members")

    def _read_rows(self, rows: np.ndarray, columns: tuple[str, ...]) -> pa.Table:
        """``columns`` of index ``rows`` (int64 positions, any order), in that order, read with DuckDB."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return pa.Table.from_batches([], schema=pa.schema([INDEX_SCHEMA.field(c) for c in columns]))
        want = np.unique(rows)
        if want.size == int(want[-1] - want[0]) + 1:  # one run: a page in index order, a build step
            where = f"file_row_number BETWEEN {int(want[0])} AND {int(want[-1])}"
        else:  # integers formatted here: no text of a request
            where = f"file_row_number IN ({', '.join(str(int(r)) for r in want.tolist())})"
        names = ", ".join(f'"{c}"' for c in columns)  # column names of the index schema, not of a request
        got = _arrow(self._duckdb().sql(f"SELECT file_row_number AS __r, {names} FROM read_parquet(?, file_row_number "
                                        f"= true) WHERE {where} ORDER BY __r", params=[self._source()]))
        found = got.column("__r").to_numpy()
        if found.size != want.size:
            missing = sorted(set(want.tolist()) - set(found.tolist()))[:5]
            raise ShardCorrupt(f"{self.path}: rows {missing} are not in the index (the file changed under the viewer?)")
        at = pa.array(np.searchsorted(found, rows))
        return pa.table({c: got.column(c).cast(INDEX_SCHEMA.field(c).type).take(at) for c in columns})

    def row_of(self, key: str) -> int | None:
        """The row of sample ``key`` (None when the index has none): from the scalar columns once they
        are in, until then with DuckDB (see the module docstring)."""
        if self.ready:
            i = pc.index(self._scalars.column("key"), pa.scalar(key, pa.string())).as_py()
            return None if i is None or i < 0 else int(i)
        got = self._duckdb().sql("SELECT min(file_row_number) FROM read_parquet(?, file_row_number = true) "
                                 "WHERE key = ?", params=[self._source(), key]).fetchall()
        return None if not got or got[0][0] is None else int(got[0][0])

    def rows(self, rows: np.ndarray) -> pa.Table:
        """Index ``rows`` (int64 positions, in that order) with every column: what
        :class:`shards.ShardReader` and a page are given."""
        rows = np.asarray(rows, dtype=np.int64)
        scalars = self.scalars()
        lazy = tuple(c for c in LAZY_COLUMNS if c not in scalars.column_names)
        t = scalars.take(pa.array(rows))
        read = self._read_rows(rows, lazy + ("members",))  # these rows' alone: no column of every row
        for c in read.column_names:
            t = t.append_column(INDEX_SCHEMA.field(c), read.column(c))
        return t.select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA)

    def row(self, row: int) -> pa.Table:
        """Index row ``row`` with every column, read with DuckDB alone (no wait for the scalar
        columns: what a sample page asked for first thing needs)."""
        if self.ready:
            return self.rows(np.array([row], dtype=np.int64))
        cols = ", ".join(f'"{c}"' for c in INDEX_SCHEMA.names)
        got = _arrow(self._duckdb().sql(f"SELECT {cols} FROM read_parquet(?, file_row_number = true) "
                                        f"WHERE file_row_number = {int(row)}", params=[self._source()]))
        return got.cast(INDEX_SCHEMA)

    def close(self) -> None:
        """Close the file (after the background read, if one runs: its thread must not outlive it)."""
        if self._loader is not None:
            self._loader.join()
        self._file.close()
        self._file2.close()


def _typed(table: pa.Table) -> pa.Table:
    """``table``'s columns in the index schema's types (dictionary-encoded strings stay so), one chunk each."""
    cols = []
    for name in table.column_names:
        col, want = table.column(name), INDEX_SCHEMA.field(name).type
        if not pa.types.is_dictionary(col.type) and col.type != want:
            col = col.cast(want)
        cols.append(col.combine_chunks())
    return pa.table(dict(zip(table.column_names, cols)))


def _arrow(relation) -> pa.Table:
    """A DuckDB relation's rows as one Arrow table (``arrow()`` gives a table, or in DuckDB 2 a reader)."""
    got = relation.arrow()
    return (got.read_all() if isinstance(got, pa.RecordBatchReader) else got).combine_chunks()


__all__ = ["IndexFile", "SCALAR_SCHEMA", "LAZY_COLUMNS", "background_priority"]
