"""A cache in object storage mirrored into a bounded local folder, in the order its reader reads it.

A cache at a URL (``s3://bucket/cache``, ``gs://``, ``hf://``, ``https://``...: anything ``fsspec``
opens; see :mod:`shards.storage` for credentials and retries) is opened like a local one
(:meth:`shards.Cache.open`):

* :class:`RemoteCache` downloads ``manifest.json``, ``index.parquet`` and ``integrity.json`` into a
  local folder (``local_dir``, default :func:`default_local_dir`: ``$SHARDCACHE_LOCAL_CACHE`` or
  ``~/.cache/shardcache/remote/<sha1 of the URL>/rank<R>``; a folder another live process holds is
  not shared: the next free ``...-1``, ``...-2`` is taken), and keeps shard tars there that an
  earlier run left whole (their size matches the manifest). A second reader of the same opened
  cache gets a folder of its own for its shards (:meth:`RemoteCache.sibling`).
* :class:`Prefetcher` (one thread in the main process) knows which files each step of the epoch
  needs on this rank (the order is a pure function of ``(seed, epoch)``) and downloads them in that
  order, ahead of the reader, while their bytes fit in ``cache_limit``. To make room it deletes
  the held files whose next read is furthest away, those this epoch will not read again first
  (Belady's rule), never one needed sooner than the file it fetches or by a step in flight. A file
  needed by a step already in flight (the consumer's next step plus what the DataLoader workers
  prefetch) is fetched even when that goes over the limit (logged once): a limit below a few
  shards slows the loader down but never stops it. Every download is retried with backoff.
* Readers (the main process or DataLoader workers) wait for a file that has not arrived yet
  (:class:`FileWaiter`), and after each batch close their memory maps of files the prefetcher
  deleted, so the disk space comes back.

What a reader needs of each step comes from its caller (the loader's plan: ``loaders.remote.file_uses``).
Order, equal split across ranks, exact and elastic resume are those of a local cache: only where
the bytes come from changes. Names from a remote index are checked (:func:`shards.storage.check_name`
via :func:`shards.index.safe_shard_path`) before any local path is built from them.
"""
from __future__ import annotations

import fcntl
import hashlib
import heapq
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .index import safe_shard_path
from .schema import INDEX_FILE, MANIFEST_FILE, ROOT_FILE
from .storage import RemoteFolder, check_name

log = logging.getLogger("shards")

#: default bound on the bytes of shard files kept in a rank's local folder
DEFAULT_CACHE_LIMIT = 32 << 30
#: a file written next to the shards when the fetcher gave up (readers waiting for a shard raise)
ERROR_FILE = ".fetch-error"


#: environment variable of the folder remote caches are mirrored into
LOCAL_ENV = "SHARDCACHE_LOCAL_CACHE"


def default_local_dir(url: str, rank: int = 0) -> Path:
    """``$SHARDCACHE_LOCAL_CACHE`` (default ``~/.cache/shardcache/remote``) ``/<sha1 of the url>[:16]/rank<rank>``:
    where global rank ``rank`` mirrors the cache at ``url`` unless told otherwise."""
    base = os.environ.get(LOCAL_ENV) or Path.home() / ".cache" / "shardcache" / "remote"
    return Path(base) / hashlib.sha1(str(url).rstrip("/").encode()).hexdigest()[:16] / f"rank{rank}"


def claim_folder(base: Path) -> tuple[Path, int]:
    """``base`` (or the first of ``base-1``, ``base-2``... no live process holds), locked for this
    process (an exclusive ``flock`` on ``.lock``, released when the process ends)."""
    for i in range(64):
        d = base if i == 0 else base.with_name(f"{base.name}-{i}")
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return d, fd
        except OSError:
            os.close(fd)
    raise RuntimeError(f"{base}: 64 local cache folders are in use; pass local_dir=")


class FileWaiter:
    """Blocks until a shard file has arrived in the local folder (picklable: DataLoader workers
    get a copy). Raises ``OSError`` with the fetcher's error when it gave up, ``TimeoutError``
    after ``timeout`` seconds."""

    def __init__(self, folder: str | Path, url: str, timeout: float = 1800.0):
        self.folder, self.url, self.timeout = str(folder), url, float(timeout)

    def __call__(self, path: Path) -> None:
        t0 = time.monotonic()
        err = Path(self.folder) / ERROR_FILE
        sleep = 0.001
        while not path.exists():
            if err.exists():
                raise OSError(f"{self.url}/{path.name}: download failed: {err.read_text()}")
            if time.monotonic() - t0 > self.timeout:
                raise TimeoutError(f"{self.url}/{path.name}: not in {self.folder} after {self.timeout:.0f} s "
                                   "(is the loader's prefetch thread running?)")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.05)


class RemoteCache:
    """One remote cache as one process mirrors it: a local folder with its index, manifest and root
    (:meth:`fetch_metadata`) and the shard files its reader needs.

    Args:
        url: the cache's URL.
        local_dir: the local folder (default :func:`default_local_dir` of rank 0); another live process
            holding it: the next free ``...-1``, ``...-2`` (:func:`claim_folder`).
        storage_options, retries, backoff: for :class:`shards.storage.RemoteFolder`.
        timeout: seconds a reader waits for a file before giving up.
        metadata: download ``manifest.json``, ``index.parquet`` and ``integrity.json`` now (always
            fresh: the remote cache may have grown); False for a folder of shard files only
            (:meth:`sibling`).

    Attributes: ``url``, ``local`` (Path), ``remote`` (:class:`~shards.storage.RemoteFolder`),
    ``waiter`` (:class:`FileWaiter`), ``present`` (name -> bytes of the shard files held locally).
    Raises ``FileNotFoundError`` when the URL holds no ``index.parquet``.
    """

    def __init__(self, url: str, *, local_dir: str | os.PathLike | None = None,
                 storage_options: dict | None = None, retries: int = 10, backoff: float = 0.5,
                 timeout: float = 1800.0, metadata: bool = True):
        self.url = str(url).rstrip("/")
        self.remote = RemoteFolder(self.url, storage_options, retries=retries, backoff=backoff)
        self.base = Path(local_dir) if local_dir is not None else default_local_dir(self.url)
        self.timeout = float(timeout)
        self.local, self._lock_fd = claim_folder(self.base)
        (self.local / ERROR_FILE).unlink(missing_ok=True)
        for p in self.local.glob(".*.part"):  # downloads a killed run left unfinished
            p.unlink(missing_ok=True)
        self._sizes: dict[str, int] = {}
        self.present: dict[str, int] = {}
        self.waiter = FileWaiter(self.local, self.url, timeout)
        if metadata:
            self.fetch_metadata()

    def fetch_metadata(self) -> None:
        """Download ``manifest.json``, ``index.parquet`` and ``integrity.json`` into :attr:`local`."""
        if not self.remote.exists(INDEX_FILE):
            raise FileNotFoundError(f"{self.url}/{INDEX_FILE} not found: is {self.url} a shardcache cache? "
                                    "(made by `shardcache precompute --cache URL`)")
        for name in (MANIFEST_FILE, INDEX_FILE, ROOT_FILE):
            if name == INDEX_FILE or self.remote.exists(name):
                self.remote.get(name, self.local / name)

    def sibling(self) -> "RemoteCache":
        """A folder of its own for another reader of this cache (the next free one beside
        :attr:`local`): shard files only, no metadata."""
        r = self.remote
        return RemoteCache(self.url, local_dir=self.base, storage_options=r.storage_options, retries=r.retries,
                           backoff=r.backoff, timeout=self.timeout, metadata=False)

    def adopt(self, names: Sequence[str], manifest: dict[str, Any]) -> None:
        """Record the sizes the manifest gives for ``names`` and keep the local files an earlier run
        left whole (size as recorded); delete the others."""
        for entry in manifest.get("shards") or []:
            if isinstance(entry, dict) and isinstance(entry.get("bytes"), int):
                self._sizes[str(entry.get("path"))] = int(entry["bytes"])
        for info in (manifest.get("fields") or {}).values():
            for entry in (info or {}).get("shards") or [] if isinstance(info, dict) else []:
                if isinstance(entry, dict) and isinstance(entry.get("bytes"), int):
                    self._sizes[str(entry.get("path"))] = int(entry["bytes"])
        for name in names:
            path = safe_shard_path(self.local, check_name(name))
            if path.exists():
                if self._sizes.get(name) == path.stat().st_size:
                    self.present[name] = path.stat().st_size
                else:
                    path.unlink()

    def size_of(self, name: str) -> int:
        if name not in self._sizes:
            self._sizes[name] = self.remote.size(name)
        return self._sizes[name]

    def fetch(self, name: str) -> int:
        """Download shard file ``name`` into the local folder; returns its bytes (the caller
        records it in ``present``)."""
        path = safe_shard_path(self.local, check_name(name))
        self.remote.get(name, path)
        return path.stat().st_size

    def evict(self, name: str) -> None:
        self.present.pop(name, None)
        safe_shard_path(self.local, name).unlink(missing_ok=True)

    def fail(self, error: BaseException) -> None:
        """Tell waiting readers (in any process) that the fetcher gave up."""
        (self.local / ERROR_FILE).write_text(f"{type(error).__name__}: {error}")

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class Prefetcher(threading.Thread):
    """Downloads the files of the remote sources in the order this rank's steps need them (see the
    module docstring). Driven by the loader: :meth:`start_epoch` at each ``iter()``, :meth:`advance`
    after each batch the consumer received.

    Args:
        needs: ``needs(epoch) -> {(source index, file name): sorted steps reading it}`` for this
            rank (:func:`file_uses`).
        remotes: source index -> :class:`RemoteCache`.
        cache_limit: bytes of shard files kept locally (per rank, all sources together; downloads
            under way count).
        lookahead: steps in flight beyond the consumer's (their files are fetched even over the limit).
        fetch_threads: downloads at once (object stores serve one connection at a fraction of
            their bandwidth).

    Attributes: ``error`` (the exception that stopped it, re-raised by :meth:`check`), ``stats``
    (``downloads``, ``bytes``, ``evictions``, ``peak_bytes``, ``over_limit``).
    """

    def __init__(self, needs, remotes: dict[int, RemoteCache], cache_limit: int, lookahead: int,
                 fetch_threads: int = 4):
        super().__init__(daemon=True, name="shard-prefetch")
        self.needs, self.remotes = needs, remotes
        self.cache_limit, self.lookahead = int(cache_limit), max(int(lookahead), 1)
        self.fetch_threads = max(int(fetch_threads), 1)
        self._inflight: dict[tuple[int, str], int] = {}  # downloads under way -> bytes
        self._failed: BaseException | None = None
        self._cond = threading.Condition()
        self._epoch: int | None = None
        self._uses: dict[tuple[int, str], np.ndarray] = {}  # file -> the steps of the epoch reading it
        self._heap: list = []  # (next use, file) of files not held (lazy: see _next)
        self._consumed = 0
        self._stopping = False
        self._warned = False
        self.error: BaseException | None = None
        self.stats = {"downloads": 0, "bytes": 0, "evictions": 0, "peak_bytes": self._held(), "over_limit": 0}

    # -- driven by the loader ---------------------------------------------------------------------
    def start_epoch(self, epoch: int, step: int) -> None:
        uses = self.needs(epoch)
        with self._cond:
            self._epoch = epoch
            self._uses = uses
            self._consumed = int(step)
            self._heap = []
            for f in uses:
                self._push(f)
            self._cond.notify_all()
        if not self.is_alive() and not self._stopping:
            self.start()

    def advance(self, step: int) -> None:
        """The consumer received the batch of ``step - 1``: ``step`` steps of the epoch are done."""
        with self._cond:
            self._consumed = int(step)
            self._cond.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise OSError(f"streaming shards failed: {self.error}") from self.error

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # -- the thread -------------------------------------------------------------------------------
    def _held(self) -> int:
        return sum(sum(r.present.values()) for r in self.remotes.values())

    def _next_use(self, f: tuple[int, str]) -> float:
        """The first step at or after the consumer's that reads file ``f`` (inf: none this epoch)."""
        steps = self._uses.get(f)
        if steps is None:
            return np.inf
        i = int(np.searchsorted(steps, self._consumed))
        return float(steps[i]) if i < len(steps) else np.inf

    def _push(self, f: tuple[int, str]) -> None:
        """Queue file ``f`` (not held) by its next use, if this epoch reads it again."""
        s = self._next_use(f)
        if s < np.inf:
            heapq.heappush(self._heap, (s, f))

    def _next(self) -> tuple[float, int, str] | None:
        """The missing file needed soonest, not being downloaded already. A lazy heap of the files
        not held, keyed by next use: entries of held or in-flight files are dropped, entries whose
        step the consumer has passed are re-keyed, so the choice costs O(log files), not a scan."""
        while self._heap:
            s, (src, name) = self._heap[0]
            if name in self.remotes[src].present or (src, name) in self._inflight:
                heapq.heappop(self._heap)
            elif s < self._consumed:
                heapq.heappop(self._heap)
                self._push((src, name))
            else:
                return s, src, name
        return None

    def _make_room(self, need: int, step: float) -> bool:
        """Delete held files until ``need`` more bytes fit, furthest next use first (files this
        epoch will not read again before any other), never one needed before ``step`` or by a step
        in flight. Returns whether the bytes fit."""
        held = self._held()
        if held + need <= self.cache_limit:
            return True
        protect = max(step, self._consumed + self.lookahead)
        victims = sorted(((self._next_use((src, n)), src, n) for src, r in self.remotes.items() for n in r.present),
                         reverse=True)
        for use, src, name in victims:
            if held + need <= self.cache_limit or use <= protect:
                break
            held -= self.remotes[src].present[name]
            self.remotes[src].evict(name)
            self._push((src, name))  # wanted again later this epoch, maybe
            self.stats["evictions"] += 1
        return held + need <= self.cache_limit

    def run(self) -> None:
        pool = ThreadPoolExecutor(self.fetch_threads, thread_name_prefix="shard-fetch")
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        return
                    if self._failed is not None:
                        raise self._failed
                    job = None
                    if self._epoch is not None and len(self._inflight) < self.fetch_threads:
                        job = self._next()
                    if job is not None:
                        s, src, name = job
                        size = self.remotes[src].size_of(name)
                        in_flight = s <= self._consumed + self.lookahead
                        if not self._make_room(size + sum(self._inflight.values()), s):
                            if not in_flight:
                                job = None  # wait until the consumer frees something
                            else:
                                self.stats["over_limit"] += 1
                                if not self._warned:
                                    self._warned = True
                                    log.warning("cache_limit %d bytes is below what the steps in flight need "
                                                "(%s is %d bytes); going over it", self.cache_limit, name, size)
                    if job is None:
                        self._cond.wait(0.05)
                        continue
                    self._inflight[(src, name)] = size
                pool.submit(self._fetch, src, name)
        except BaseException as e:  # noqa: BLE001 - surfaced to the consumer and to waiting readers
            self.error = e
            log.error("shard prefetch stopped: %s", e)
            for r in self.remotes.values():
                try:
                    r.fail(e)
                except OSError:
                    pass
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _fetch(self, src: int, name: str) -> None:
        """Download one file (in a pool thread); record it under the lock."""
        try:
            n = self.remotes[src].fetch(name)
        except BaseException as e:  # noqa: BLE001 - the prefetch thread re-raises it
            with self._cond:
                self._failed = e
                self._inflight.pop((src, name), None)
                self._cond.notify_all()
            return
        with self._cond:
            self._inflight.pop((src, name), None)
            self.remotes[src].present[name] = n
            self.stats["downloads"] += 1
            self.stats["bytes"] += n
            self.stats["peak_bytes"] = max(self.stats["peak_bytes"], self._held())
            self._cond.notify_all()


__all__ = ["RemoteCache", "Prefetcher", "FileWaiter", "DEFAULT_CACHE_LIMIT", "default_local_dir", "claim_folder"]
