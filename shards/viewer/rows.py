"""A cache's ``index.parquet`` as the viewer reads it: lazily, so opening costs the same at 1,000 and
at 10 million samples.

:class:`IndexFile` opens the file once (the descriptor is kept: a rerun that renames a new index into
place does not change what a running viewer reads) and takes its row count from the Parquet footer.
Nothing else is read at start:

* the first rows (a first page) are decoded with ``iter_batches``, in milliseconds;
* the scalar columns (:data:`shards.commands._common.SCALAR_COLUMNS`: what filters, sorting, key
  lookups and histograms need) are read once, in a background thread started when the file is
  opened (about 4 s for 10 million rows on the development machine); whoever needs them first waits;
* the ``members`` column (where each array sits) is read per Parquet row group, for the rows a page
  or a sample shows, and the last :data:`GROUPS_KEPT` row groups are kept.

No row becomes a Python object but those of the page being drawn.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..commands._common import SCALAR_COLUMNS
from ..errors import ShardCorrupt
from ..index import INDEX_SCHEMA

#: row groups whose ``members`` column is kept in memory (10M-sample caches: ~100-300 MB each)
GROUPS_KEPT = 4
SCALAR_SCHEMA = pa.schema([INDEX_SCHEMA.field(c) for c in SCALAR_COLUMNS])
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
        background: start reading the scalar columns in a thread now (False: on first use).

    Attributes: ``path``, ``num_rows`` (from the footer), ``group_starts`` int64 ``(groups + 1,)``
    (first row of each row group, then ``num_rows``), ``stat`` (the ``os.stat_result`` of the open
    file: the integrity check compares it with the file it verified).

    Raises ``FileNotFoundError`` for a missing file and :class:`shards.ShardCorrupt` for one Parquet
    cannot read (naming the file and ``shards reindex``).
    """

    def __init__(self, path: str | os.PathLike, background: bool = True):
        self.path = Path(path)
        # two descriptors of one file: pages read row groups while the scalar columns are read
        self._file, self._file2 = open(self.path, "rb"), open(self.path, "rb")
        try:
            self.stat = os.fstat(self._file.fileno())
            second = os.fstat(self._file2.fileno())
            if (second.st_dev, second.st_ino) != (self.stat.st_dev, self.stat.st_ino):
                raise OSError("the file was replaced while it was opened")
            self._pf, self._pf2 = pq.ParquetFile(self._file), pq.ParquetFile(self._file2)
            md = self._pf.metadata
        except (pa.ArrowInvalid, OSError) as e:
            self.close()
            raise ShardCorrupt(f"{self.path}: cannot read the index ({e}); `shardcache shards reindex "
                               f"{self.path.parent}` rebuilds it") from e
        self.num_rows = int(md.num_rows)
        self.group_starts = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)],
                                      dtype=np.int64)
        self._io = threading.Lock()        # one read of the file at a time
        self._groups: OrderedDict[int, pa.ChunkedArray] = OrderedDict()
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
                self._loader = threading.Thread(target=self._load, name="shardcache-view-index", daemon=True)
                self._loader.start()

    def _load(self) -> None:
        background_priority()
        try:  # in this thread alone: Arrow's thread pool stays free for the pages
            t = self._pf2.read(columns=list(SCALAR_COLUMNS), use_threads=False)
            self._scalars = t.cast(SCALAR_SCHEMA).combine_chunks()
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

    def scalars(self) -> pa.Table:
        """The scalar columns of every row (one chunk each); waits for the background read."""
        self._begin()
        self._ready.wait()
        if self._error is not None:
            raise ShardCorrupt(f"{self.path}: cannot read the index ({self._error}); `shardcache shards reindex "
                               f"{self.path.parent}` rebuilds it") from self._error
        return self._scalars

    # -- rows ----------------------------------------------------------------------------------------
    def head(self, n: int) -> pa.Table:
        """The first ``n`` rows, every column (what a first page needs before the scalars are read)."""
        with self._io:
            batches, got = [], 0
            for b in self._pf.iter_batches(batch_size=max(1, min(n, 4096))):
                batches.append(b)
                got += b.num_rows
                if got >= n:
                    break
        t = pa.Table.from_batches(batches) if batches else pa.Table.from_batches([], schema=INDEX_SCHEMA)
        return t.slice(0, n).cast(INDEX_SCHEMA)

    def members(self, rows: np.ndarray) -> pa.Array:
        """The ``members`` of index ``rows`` (int64 positions, any order), in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return pa.array([], MEMBERS.type)
        groups = np.searchsorted(self.group_starts, rows, side="right") - 1
        order = np.argsort(groups, kind="stable")
        pieces = []
        for g in np.unique(groups).tolist():
            local = rows[order][groups[order] == g] - self.group_starts[g]
            pieces.append(self._group(g).take(pa.array(local)).combine_chunks())
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        return pa.concat_arrays(pieces).take(pa.array(inverse))

    def _group(self, g: int) -> pa.ChunkedArray:
        with self._io:
            if g in self._groups:
                self._groups.move_to_end(g)
                return self._groups[g]
            col = self._pf.read_row_group(g, columns=["members"]).column("members").cast(MEMBERS.type)
            self._groups[g] = col
            while len(self._groups) > GROUPS_KEPT:
                self._groups.popitem(last=False)
            return col

    def rows(self, rows: np.ndarray) -> pa.Table:
        """Index ``rows`` (int64 positions, in that order) with every column: what
        :class:`shards.ShardReader` and a page are given."""
        rows = np.asarray(rows, dtype=np.int64)
        scalars = self.scalars().take(pa.array(rows))
        return scalars.append_column(MEMBERS, self.members(rows)).select(INDEX_SCHEMA.names).cast(INDEX_SCHEMA)

    def close(self) -> None:
        """Close the file (after the background read, if one runs: its thread must not outlive it)."""
        if self._loader is not None:
            self._loader.join()
        self._file.close()
        self._file2.close()


__all__ = ["IndexFile", "GROUPS_KEPT", "SCALAR_SCHEMA", "background_priority"]
