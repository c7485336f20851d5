"""One writer per cache: the lock a precompute job holds on its cache folder.

Global rank 0 of a job takes an exclusive ``flock`` on ``CACHE/parts/writer.lock`` before anything
is written (before the fingerprint, before the first chunk) and holds it until the job has merged
its index; the file records the holder (``host``, ``pid``, ``job``, ``since``). A second job on the
same cache finds the lock held and stops at once with :class:`CacheLocked` naming the holder
(``shardcache precompute`` exits 1; nothing was written). The other ranks of one job take no lock:
they write nothing before passing a barrier with their rank 0, so all ranks of one job are one
writer, and ranks of another job end with their rank 0 (torchrun, as the Makefile and
``scripts/slurm`` launch it, stops the group when a rank fails; under another launcher they wait at
the first barrier until it ends them).

A holder that dies (killed, node lost) releases the lock with its process (the kernel drops a
``flock`` with its last open file), so the next job takes it over and logs whose it was: no stale
lock to delete by hand. On a file system without locks (``flock`` fails with ``ENOLCK``,
``EOPNOTSUPP``...) the job warns and goes on unlocked. For a cache in object storage the lock covers
the local staging folder (jobs sharing a machine), not the bucket.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from shards.errors import ShardcacheError
from shards.schema import PARTS_DIR

log = logging.getLogger("precompute")

LOCK_FILE = "writer.lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class CacheLocked(ShardcacheError):
    """Another precompute job holds the cache's writer lock; ``holder`` is what its lock file says."""

    def __init__(self, message: str, holder: dict):
        super().__init__(message)
        self.holder = holder


def job_id() -> str:
    """What the ranks of one launch share: torchrun's run id, else the Slurm job step, else the
    rendezvous address, else this process (``host:pid``)."""
    env = os.environ
    if env.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}"
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"rendezvous:{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return f"process:{socket.gethostname()}:{os.getpid()}"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe(holder: dict) -> str:
    """``host H, pid P (job J), since T`` of a lock file's contents."""
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')} (job {holder.get('job', '?')}), since {when}"


class CacheLock:
    """The writer lock of cache folder ``cache_dir`` (a context manager; :meth:`acquire` /
    :meth:`release`). Raises :class:`CacheLocked` when another live process holds it."""

    def __init__(self, cache_dir: str | os.PathLike):
        self.path = Path(cache_dir) / PARTS_DIR / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "CacheLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = _read(self.path)
            raise CacheLocked(
                f"{self.path.parent.parent} is being written by another precompute job ({describe(holder)}; "
                f"lock file {self.path}). Two writers would encode every row twice and race on the same "
                "files: wait for that job to end (its lock goes with it, also if it dies), or write to "
                "another --cache.", holder) from None
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                os.close(fd)
                raise
            log.warning("%s: this file system has no file locks (%s); going on without the one-writer check",
                        self.path, e.strerror)
            self._fd = fd
            return self
        before = _read(self.path)
        if before.get("pid") and (before.get("pid"), before.get("host")) != (os.getpid(), socket.gethostname()):
            log.info("%s: the previous writer (%s) is gone; lock taken over", self.path, describe(before))
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays; its contents name the last holder)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def __enter__(self) -> "CacheLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
