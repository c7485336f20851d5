"""Where stage one writes: a local cache folder, or a cache in object storage through local staging.

:class:`LocalOutput` is the folder itself. :class:`RemoteOutput` (``--out s3://bucket/cache``,
any fsspec URL; credentials as in :mod:`shards.storage`) writes every chunk into a local staging
folder exactly as a local job would, then uploads it: the shard tar, its rejects part, and its
index part LAST (the index part is the commit marker, so a chunk is committed in the bucket only
once its tar is there); the local tar is deleted after the upload (staging holds at most the
chunks in flight). A job killed at any moment therefore resumes against the bucket: a rerun pulls
the bucket's ``parts/`` (small Parquet files) into staging, skips the committed chunks and redoes
the others (a tar uploaded without its index part is overwritten). Rank 0 waits for every chunk's
index part in the bucket, merges the parts in staging and uploads ``index.parquet``,
``rejects.parquet``, the dataset card ``README.md``, ``manifest.json`` and ``integrity.json`` (last).
One job writes a remote cache at a time, whatever its staging folder: rank 0 holds the lock object at the
cache's location (:meth:`RemoteOutput.writer_lock`, :class:`shards.lock.RemoteLock`).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import time
from pathlib import Path

from shards.index import PARTS_DIR, part_paths
from shards.schema import INDEX_FILE, MANIFEST_FILE, REJECTS_FILE, ROOT_FILE
from shards import fields as registry
from shards.storage import RemoteFolder, is_url, local_path
from shards.writing import session

from shards.lock import LOCK_FILE, RemoteLock

log = logging.getLogger("precompute")


class LocalOutput:
    """A local cache folder (``local``): nothing to pull, upload or publish."""

    remote = None
    lock = None

    def writer_lock(self, command: str, rank: int = 0):
        """The cache's own writer lock beyond the local folder's (:class:`shards.writing.CacheWriter` holds that
        one): none for a local cache."""
        return contextlib.nullcontext()

    def __init__(self, path: str | os.PathLike):
        self.local = local_path(path)
        self.local.mkdir(parents=True, exist_ok=True)
        self.target = str(self.local)

    def pull(self) -> None:
        pass

    def push_part(self, name: str) -> None:
        pass

    def chunk_committed(self, shard: str, has_tar: bool) -> None:
        pass

    def missing(self, stems: list[str]) -> list[str]:
        return [s for s in stems if not part_paths(self.local, s)[0].exists()]

    def publish(self) -> None:
        pass

    def drop_chunks(self, stems: list[str]) -> None:
        """Delete committed chunks ``stems`` (a rerun found them stale, :mod:`precompute.rerun`): the
        integrity root first (until the merge, readers are told to rerun), then per chunk its index
        part (the commit marker), its rejects part, its tar and the sidecars of added fields."""
        with session(self.local / ROOT_FILE) as s:  # the job's writing session: no symlink followed
            s.unlink(self.local / ROOT_FILE)
            for stem in stems:
                for p in _chunk_files(stem, [p.name for p in self.local.iterdir() if p.is_file()],
                                      [p.name for p in (self.local / PARTS_DIR).iterdir() if p.is_file()]):
                    s.unlink(self.local / p)

    def wait_for_chunks(self, names: list[str], poll_s: float = 2.0) -> None:
        """Block until every chunk in ``names`` is committed (its index part exists). No collective
        and no deadline: a slow rank delays the merge; a dead one makes torchrun restart the group."""
        stems = [n[:-4] for n in names]
        t0 = last = time.monotonic()
        while True:
            missing = self.missing(stems)
            if not missing:
                return
            if time.monotonic() - last > 60:
                last = time.monotonic()
                log.info("waiting for %d chunk(s) of other ranks (%s...) for %.0f s", len(missing), missing[0],
                         last - t0)
            time.sleep(poll_s)


class RemoteOutput(LocalOutput):
    """A cache at ``url`` written through the local folder ``staging`` (see the module docstring).

    ``staging`` defaults to ``$SHARDCACHE_STAGING`` or ``~/.cache/shardcache/staging``, then
    ``<sha1 of the URL>/rank<R>``: ranks on one node never share it.
    """

    def __init__(self, url: str, *, staging: str | os.PathLike | None = None, storage_options: dict | None = None,
                 global_rank: int = 0, retries: int = 10):
        self.remote = RemoteFolder(url, storage_options, retries=retries)
        if staging is None:
            base = os.environ.get("SHARDCACHE_STAGING") or Path.home() / ".cache" / "shardcache" / "staging"
            staging = Path(base) / hashlib.sha1(self.remote.url.encode()).hexdigest()[:16] / f"rank{global_rank}"
        super().__init__(staging)
        self.target = self.remote.url  # (after the base class, which names the local folder)

    def writer_lock(self, command: str, rank: int = 0):
        """Rank 0: the lock held at the cache's location (:class:`shards.lock.RemoteLock`; the staging folder's
        lock covers only the jobs of this machine); refused with :class:`shards.lock.CacheLocked` naming the
        writer that holds it. Other ranks write under their rank 0's."""
        if rank != 0:
            return contextlib.nullcontext()
        self.lock = RemoteLock(self.remote, command, staging=f"{socket.gethostname()}:{self.local}")
        return self.lock

    def _check_lock(self) -> None:
        if self.lock is not None:
            self.lock.check()  # (taken over by another writer: upload nothing more)

    def pull(self) -> None:
        """Bring the bucket's ``parts/`` and ``manifest.json`` into staging (resume bookkeeping and
        the fingerprint check read them there); local parts the bucket lacks are dropped."""
        parts = self.local / PARTS_DIR
        parts.mkdir(parents=True, exist_ok=True)
        there = set(self.remote.list(PARTS_DIR))
        with session(parts / LOCK_FILE) as s:  # (the job's writing session)
            for p in parts.iterdir():
                if p.is_file() and p.name not in there and p.name != LOCK_FILE:  # the lock stays local
                    s.unlink(p)  # committed locally but never uploaded: redo it
        for name in sorted(there):
            if name != LOCK_FILE and not (parts / name).exists():
                self.remote.get(f"{PARTS_DIR}/{name}", parts / name)
        if self.remote.exists(MANIFEST_FILE):
            self.remote.get(MANIFEST_FILE, self.local / MANIFEST_FILE)

    def push_part(self, name: str) -> None:
        self.remote.put(self.local / PARTS_DIR / name, f"{PARTS_DIR}/{name}")

    def chunk_committed(self, shard: str, has_tar: bool) -> None:
        """Upload a chunk committed in staging: tar, rejects part, index part (the marker) last."""
        self._check_lock()
        stem = shard[:-4]
        index_part, rejects_part = part_paths(self.local, stem)
        if has_tar:
            self.remote.put(self.local / shard, shard)
        self.remote.put(rejects_part, f"{PARTS_DIR}/{rejects_part.name}")
        self.remote.put(index_part, f"{PARTS_DIR}/{index_part.name}")
        if has_tar:
            (self.local / shard).unlink(missing_ok=True)

    def missing(self, stems: list[str]) -> list[str]:
        there = set(self.remote.list(PARTS_DIR))
        missing = []
        for s in stems:
            index_part, rejects_part = part_paths(self.local, s)
            if index_part.name not in there:
                missing.append(s)
            elif not index_part.exists():  # another rank's chunk: its parts are needed for the merge
                self.remote.get(f"{PARTS_DIR}/{rejects_part.name}", rejects_part)
                self.remote.get(f"{PARTS_DIR}/{index_part.name}", index_part)
        return missing

    def drop_chunks(self, stems: list[str]) -> None:
        """:meth:`LocalOutput.drop_chunks` in the bucket, then in staging."""
        self.remote.remove(ROOT_FILE)
        top, parts = self.remote.list(), self.remote.list(PARTS_DIR)
        for stem in stems:
            for name in _chunk_files(stem, top, parts):
                self.remote.remove(name)
        super().drop_chunks(stems)

    def publish(self) -> None:
        """Upload the merged cache files; the integrity root last (a reader sees a complete cache)."""
        self._check_lock()
        for name in (INDEX_FILE, REJECTS_FILE, "README.md", MANIFEST_FILE, ROOT_FILE):
            if (self.local / name).exists():
                self.remote.put(self.local / name, name)
        log.info("uploaded the cache to %s", self.target)


def _chunk_files(stem: str, top: list[str], parts: list[str]) -> list[str]:
    """The files of chunk ``stem`` among the cache folder's ``top`` names and ``parts/`` names,
    as paths relative to the cache, its index part (the commit marker) first."""
    index_part, rejects_part = f"{stem}.index.parquet", f"{stem}.rejects.parquet"
    out = [f"{PARTS_DIR}/{n}" for n in (index_part, rejects_part) if n in parts]
    out += [f"{PARTS_DIR}/{n}" for n in sorted(parts) if n.startswith(stem + ".") and n.endswith(".sidecar.parquet")]
    shard = f"{stem}.tar"
    out += [n for n in sorted(top) if n == shard or (registry.parse_sidecar_name(n) or ("",))[0] == shard]
    return out


def open_output(out: str | os.PathLike, *, storage_options: dict | None = None, staging=None,
                global_rank: int = 0) -> LocalOutput:
    """:class:`RemoteOutput` for a URL, else :class:`LocalOutput`."""
    if is_url(out):
        return RemoteOutput(str(out), staging=staging, storage_options=storage_options, global_rank=global_rank)
    return LocalOutput(out)


__all__ = ["LocalOutput", "RemoteOutput", "open_output"]
