"""The text of each sample, for the index grid and its search: read from the samples' ``json``
members, never from the index (which has no text column).

* :func:`turn_lines`: one line per turn of a conversation, ``role: first line of its text`` (or of
  its media: ``[audio 0]``, ``[image 0]``): what a grid row shows.
* :func:`search_text`: every text part of every turn (a single-utterance sample: its ``text``),
  joined by newlines and cut at :data:`MAX_TEXT_CHARS`: what the search looks in.
* :func:`read_members`: the ``json`` and ``labels`` members of some index rows, read with ``pread``
  at the offsets the index records, each checked against its XXH3-64 (as :class:`shards.ShardReader`
  checks every member).
* :class:`TextTable`: the side table of the whole cache (key order = index order): ``lines``,
  ``text`` and ``trained_share`` (the share of the sample's ``input_ids`` that carry a label,
  ``labels != -100``) of every sample. It is built once in a background thread (reading the json
  and labels members only: a few hundred bytes per sample) and kept as Parquet in the viewer's own
  cache folder (:func:`viewer_cache_dir`, by cache id), never in the cache folder; a later viewer of
  the same cache reads it back in milliseconds.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..checksum import COLUMN as CHECKSUM, checksum
from ..errors import ShardCorrupt
from ..index import safe_shard_path
from ..schema import JSON_MEMBER
from ..tokens import IGNORE_INDEX
from . import background as background_threads

#: characters of a sample's text the search looks in (the rest of a very long conversation is not searched)
MAX_TEXT_CHARS = 2000
#: characters of one turn's line in the grid
MAX_LINE_CHARS = 160
#: rows read per step of the side table's build (one step = one progress update)
BUILD_STEP = 2048
LABELS_MEMBER = "labels.npy"
TABLE_SCHEMA = pa.schema([("key", pa.string()), ("lines", pa.list_(pa.string())), ("text", pa.string()),
                          ("trained_share", pa.float32())])
#: bump when what the side table holds changes (older files are then rebuilt)
TABLE_VERSION = 1


def viewer_cache_dir() -> Path:
    """Where the viewer keeps what it derives from a cache: ``$SHARDCACHE_VIEWER_CACHE``, else
    ``$XDG_CACHE_HOME/shardcache/viewer`` (``~/.cache/shardcache/viewer``). Never a cache folder."""
    env = os.environ.get("SHARDCACHE_VIEWER_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardcache" / "viewer"


# --------------------------------------------------------------------------------------- one sample

def _part_text(part: Any) -> str | None:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    return None


def _turns(meta: Any) -> list[dict]:
    conv = meta.get("conversation") if isinstance(meta, dict) else None
    turns = conv.get("turns") if isinstance(conv, dict) else None
    return [t for t in turns if isinstance(t, dict)] if isinstance(turns, list) else []


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def turn_lines(meta: Any) -> list[str]:
    """One line per turn (``role: first line``; a turn of media only: ``role: [audio 0]``); a sample
    without a conversation: the first line of its ``text``; nothing: ``[]``."""
    out = []
    for t in _turns(meta):
        role = str(t.get("role") or "?")
        parts = t.get("parts") if isinstance(t.get("parts"), list) else []
        texts = [x for p in parts if (x := _part_text(p))]
        if texts:
            first = next((line for line in "\n".join(texts).splitlines() if line.strip()), "")
            out.append(f"{role}: {_clip(first.strip(), MAX_LINE_CHARS)}")
        else:
            media = [f"[{p.get('type')} {p.get('item', '')}]".replace(" ]", "]") for p in parts if isinstance(p, dict)]
            out.append(f"{role}: {' '.join(media) or '(empty)'}")
    if not out and isinstance(meta, dict) and isinstance(meta.get("text"), str) and meta["text"].strip():
        out.append(_clip(meta["text"].strip().splitlines()[0], MAX_LINE_CHARS))
    return out


def search_text(meta: Any) -> str:
    """Every text part of every turn, joined by newlines (else the sample's ``text``), at most
    :data:`MAX_TEXT_CHARS` characters."""
    texts = [x for t in _turns(meta) for p in (t.get("parts") if isinstance(t.get("parts"), list) else [])
             if (x := _part_text(p))]
    if not texts and isinstance(meta, dict) and isinstance(meta.get("text"), str):
        texts = [meta["text"]]
    return "\n".join(texts)[:MAX_TEXT_CHARS]


# ----------------------------------------------------------------------------------- members read

class MemberFiles:
    """``pread`` descriptors of a cache's shard files, opened on first use (names through
    :func:`shards.index.safe_shard_path`); ``present(name)`` says whether a file is there (a remote
    cache's shard not downloaded yet is not)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def present(self, name: str) -> bool:
        return safe_shard_path(self.folder, name).is_file()

    def read(self, name: str, offset: int, size: int) -> bytes:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = os.open(safe_shard_path(self.folder, name), os.O_RDONLY | os.O_CLOEXEC)
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise ShardCorrupt(f"{self.folder / name}: {size} bytes at {offset} lie past the end of the file "
                               "(truncated shard?); run `shardcache shards verify`")
        return data

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_members(files: MemberFiles, table: pa.Table, *, labels: bool = True,
                 only_present: bool = False) -> list[tuple[dict | None, np.ndarray | None]]:
    """``[(json, labels)]`` of each row of ``table`` (index rows: ``key``, ``shard``, ``members``):
    the ``json`` member as a dict and ``labels`` int32 ``(L,)`` (None where the sample has none, or
    ``only_present`` and its file is not here). Each member is checked against its XXH3-64.

    Raises :class:`shards.ShardCorrupt` naming shard, key and member for damaged bytes."""
    keys, shards = table.column("key").to_pylist(), table.column("shard").to_pylist()
    out: list[tuple[dict | None, np.ndarray | None]] = []
    want = {JSON_MEMBER, LABELS_MEMBER} if labels else {JSON_MEMBER}
    for key, shard, members in zip(keys, shards, table.column("members").to_pylist()):
        got: dict[str, Any] = {}
        for m in members or []:
            if m["name"] not in want:
                continue
            name = m.get("file") or shard
            if only_present and not files.present(name):
                continue
            data = files.read(name, int(m["offset"]), int(m["size"]))
            if m.get(CHECKSUM) is None or checksum(data) != m[CHECKSUM]:
                raise ShardCorrupt(f"{files.folder / name}: sample {key!r} member {m['name']}: checksum mismatch "
                                   "(the bytes changed since the index was written); run `shardcache shards verify --deep`")
            if m["name"] == JSON_MEMBER:
                try:
                    value = json.loads(data)
                except ValueError as e:
                    raise ShardCorrupt(f"{files.folder / name}: sample {key!r} member json: {e}") from None
                got["json"] = value if isinstance(value, dict) else None
            else:
                got["labels"] = np.frombuffer(data, dtype=np.dtype(m["dtype"])).reshape(-1)
        out.append((got.get("json"), got.get("labels")))
    return out


def trained_share(labels: np.ndarray | None) -> float | None:
    """The share of tokens that carry a label (``labels != -100``), None without labels."""
    if labels is None or labels.size == 0:
        return None
    return float(np.count_nonzero(labels != IGNORE_INDEX) / labels.size)


# ------------------------------------------------------------------------------------- side table

class TextTable:
    """The side table of a whole cache (see the module docstring).

    Args:
        cache_id: the cache's id (names the file: another index is another table).
        num_rows: the index's rows.
        rows_of: ``(start, stop) -> pa.Table`` of index rows ``start .. stop`` (``key``, ``shard``,
            ``members``).
        files: the shard files.
        folder: where the table is kept (None: in memory only).

    :meth:`start` builds it in a daemon thread (or reads it back from ``folder``); :attr:`table` is
    None until it is complete; :attr:`done` and :attr:`error` say how far it got.
    """

    def __init__(self, cache_id: str, num_rows: int, rows_of: Callable[[int, int], pa.Table], files: MemberFiles,
                 folder: Path | None):
        self.cache_id, self.num_rows, self.rows_of, self.files = cache_id, num_rows, rows_of, files
        self.path = folder / f"text-v{TABLE_VERSION}-{cache_id}.parquet" if folder is not None else None
        self.table: pa.Table | None = None
        self.done = 0
        self.error: str | None = None
        self.started: float | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    @property
    def ready(self) -> bool:
        return self.table is not None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self.started = time.monotonic()
                self._thread = background_threads.start(self._run, "shardcache-view-text", self.stop)

    def _run(self) -> None:
        from .rows import background_priority
        background_priority()
        try:
            if self.path is not None and self.path.is_file():
                t = pq.read_table(self.path, schema=TABLE_SCHEMA)
                if t.num_rows == self.num_rows:
                    self.done, self.table = t.num_rows, t
                    return
            self.table = self._build()
            if self.path is not None:
                self._save(self.table)
        except Exception as e:  # noqa: BLE001 - the page says what went wrong
            self.error = f"{type(e).__name__}: {e}"

    def _build(self) -> pa.Table:
        chunks = []  # one Arrow table per step: Python objects for BUILD_STEP rows at a time only
        for start in range(0, self.num_rows, BUILD_STEP):
            if self._stop.is_set():
                raise RuntimeError("stopped")
            rows = self.rows_of(start, min(self.num_rows, start + BUILD_STEP))
            got = read_members(self.files, rows)
            chunks.append(pa.table({
                "key": rows.column("key").combine_chunks(),
                "lines": pa.array([turn_lines(m) for m, _ in got], pa.list_(pa.string())),
                "text": pa.array([search_text(m) for m, _ in got], pa.string()),
                "trained_share": pa.array([trained_share(lab) for _, lab in got], pa.float32())}, schema=TABLE_SCHEMA))
            self.done = start + rows.num_rows
        return pa.concat_tables(chunks).combine_chunks() if chunks else pa.Table.from_batches([], schema=TABLE_SCHEMA)

    def _save(self, table: pa.Table) -> None:
        """Write the table atomically (a temporary file renamed into place); a folder that cannot be
        written keeps it in memory only."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            pq.write_table(table, tmp, compression="zstd")
            os.replace(tmp, self.path)
        except OSError:
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the build (or the read back) to end; whether the table is complete."""
        self.start()
        self._thread.join(timeout)
        return self.ready

    def stop(self) -> None:
        """Make the build return early (between steps of :data:`BUILD_STEP` rows)."""
        self._stop.set()

    def close(self) -> None:
        """:meth:`stop`, then wait for the build's thread to end."""
        background_threads.join(self._thread, self.stop)


__all__ = ["turn_lines", "search_text", "read_members", "trained_share", "TextTable", "MemberFiles",
           "viewer_cache_dir", "MAX_TEXT_CHARS"]
