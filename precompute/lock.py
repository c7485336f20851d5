"""One writer per cache: the lock a precompute job holds on its cache folder.

Global rank 0 of a job takes an exclusive POSIX record lock (``fcntl.lockf``, ``F_SETLK``) on
``CACHE/parts/writer.lock`` before anything is written (before the fingerprint, before the first
chunk) and holds it until the job has merged its index; the file records the holder (``host``,
``pid``, ``job``, ``since``). A second job on the same cache finds the lock held and stops at once
with :class:`CacheLocked` naming the holder (``shardcache precompute`` exits 1; nothing was
written). The other ranks of one job take no lock: they write nothing before passing a barrier with
their rank 0, so all ranks of one job are one writer, and ranks of another job end with their rank 0
(torchrun, as the Makefile and ``scripts/slurm`` launch it, stops the group when a rank fails; under
another launcher they wait at the first barrier until it ends them).

The lock belongs to the job's process alone. A record lock is per process: a forked decode worker
does not inherit it (a ``flock`` belongs to the open file description, which ``fork()`` shares, so
workers that outlived a killed job kept the cache locked), and the kernel drops it when the process
dies (killed, node lost). The descriptor is close-on-exec. A record lock is also dropped when the
process closes ANY descriptor of the file, so the file is only ever read through the lock's own
descriptor while it is held. A clean release empties the file, so only a job that died leaves its
holder there: the next job takes the lock over and logs whose it was (no such line after a clean
run): no stale lock to delete by hand. Decode workers end with the job (:func:`die_with_parent`). On
a file system without locks (``lockf`` fails with ``ENOLCK``, ``EOPNOTSUPP``...) the job warns and
goes on unlocked. For a cache in object storage the lock covers the local staging folder (jobs
sharing a machine), not the bucket.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from shards.errors import ShardcacheError
from shards.schema import PARTS_DIR

log = logging.getLogger("precompute")

LOCK_FILE = "writer.lock"
_HELD: set[str] = set()  # lock files this process holds (record locks never conflict within a process)
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


def _parse(raw: bytes) -> dict:
    try:
        data = json.loads(raw.decode() or "{}")
    except (UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read(path: Path) -> dict:
    """The lock file's holder, read by a process that does NOT hold the lock (reading through a
    second descriptor would drop a record lock this process holds)."""
    try:
        return _parse(path.read_bytes())
    except OSError:
        return {}


def _read_fd(fd: int) -> dict:
    """The lock file's holder, read through the lock's own descriptor."""
    size = os.fstat(fd).st_size
    return _parse(os.pread(fd, size, 0)) if size else {}


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, worker_id: int | None = None) -> None:
    """Make this (forked worker) process get SIGKILL when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), and exit at once if the parent ``parent_pid`` is already gone.
    ``worker_id`` (what a DataLoader passes to its ``worker_init_fn``) is not used.

    Used as the decode workers' ``worker_init_fn``: a ``kill -9`` of the job leaves no worker behind.
    Elsewhere than Linux it only does the parent check (torch's workers also poll their parent).
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


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
        if str(self.path.resolve()) in _HELD:
            raise CacheLocked(f"{self.path.parent.parent} is already being written by this process (lock file "
                              f"{self.path}): one writer per cache", {"pid": os.getpid()})
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held by another process
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
        before = _read_fd(fd)  # (never self.path: opening it again and closing would drop the lock)
        if before.get("pid") and (before.get("pid"), before.get("host")) != (os.getpid(), socket.gethostname()):
            log.info("%s: the previous writer (%s) is gone; lock taken over", self.path, describe(before))
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        _HELD.add(str(self.path.resolve()))
        return self

    def release(self) -> None:
        """Drop the lock. The file stays, emptied: a holder named in it is one that died holding it."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)  # releases the record lock
            self._fd = None
            _HELD.discard(str(self.path.resolve()))

    def __enter__(self) -> "CacheLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
