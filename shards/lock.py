"""One writer per cache: the POSIX record lock every command that writes a cache takes.

The lock is ``CACHE/parts/writer.lock``, an exclusive POSIX record lock (``fcntl.lockf``,
``F_SETLK``) over the whole file; the file records the holder (``host``, ``pid``, ``job``,
``command``, ``since``). It is taken through :class:`shards.writing.CacheWriter`, the one way into
writing a cache (``precompute``, ``add-field``, ``drop-field``, ``shards reindex`` and every write
of the format's own writers), so a second writer finds it held and stops at once with
:class:`CacheLocked` naming the holder (the command line exits 2; nothing was written), or waits for
it (``wait_s``).

The lock belongs to the process that took it. A record lock is per process: a forked worker does
not inherit it (a ``flock`` belongs to the open file description, which ``fork()`` shares, so
workers that outlived a killed job kept the cache locked), and the kernel drops it when the process
dies (killed, node lost). The descriptor is close-on-exec. A record lock is also dropped when the
process closes ANY descriptor of the file, so the file is only ever read through the lock's own
descriptor while it is held (:func:`holder` is never called by the holder: it answers from
:data:`_HELD`). A clean release empties the file, so only a writer that died leaves its holder
there: the next one takes the lock over and logs whose it was. On a file system without locks
(``lockf`` fails with ``ENOLCK``, ``EOPNOTSUPP``...) the writer warns and goes on unlocked.

A cache in object storage is written through a local staging folder (whose lock is the one above), and its
own lock is held **at the cache's location** (:class:`RemoteLock`): the object ``URL/parts/writer.lock``,
created only if absent (fsspec's ``pipe_file(mode="create")``: S3's conditional ``PUT`` with
``If-None-Match: *``), holding the holder as the local lock file does plus a ``heartbeat`` the holder
rewrites every :data:`HEARTBEAT_S` seconds. A second writer, on any machine and with any staging
folder, finds the object and is refused with :class:`CacheLocked` naming the holder; the holder deletes
the object when it ends. A holder that died (its object left behind) is taken over when its heartbeat is
older than :data:`STALE_S` seconds, or at once when it ran on this host and its pid is gone (a rerun
right after a kill); each takeover is logged. A holder that finds its object replaced (it stalled for
longer than :data:`STALE_S` and was taken over) stops at its next upload.

The lock file is never followed through a symlink: ``parts/`` is opened with ``O_NOFOLLOW`` and the
lock file with ``O_NOFOLLOW`` under it, and a lock file that is not a plain file with one link (a
planted symlink or hard link to a file elsewhere, which ``ftruncate`` would empty) is refused by
name with :class:`~shards.errors.UnsafePath`.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import struct
import time
from pathlib import Path

from .errors import UnsafePath, WriteRefused
from .schema import PARTS_DIR

log = logging.getLogger("precompute")

LOCK_FILE = "writer.lock"
#: real paths of the lock files this process holds (record locks never conflict within a process)
_HELD: dict[str, dict] = {}
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_POLL_S = 0.25


class CacheLocked(WriteRefused):
    """Another process (or another job of this one) holds the cache's writer lock; ``holder`` is
    what its lock file says. The command line exits 2 for it."""

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


def _read_fd(fd: int) -> dict:
    """The lock file's holder, read through an open descriptor of it."""
    size = os.fstat(fd).st_size
    return _parse(os.pread(fd, min(size, 1 << 16), 0)) if size else {}


def describe(holder: dict) -> str:
    """``COMMAND on host H, pid P (job J), since T`` of a lock file's contents."""
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
    what = f"{holder['command']} on " if holder.get("command") else ""
    return (f"{what}host {holder.get('host', '?')}, pid {holder.get('pid', '?')} (job {holder.get('job', '?')}), "
            f"since {when}")


def _open_dir(path: str | os.PathLike, *, dir_fd: int | None = None, create: bool = False) -> int:
    """A descriptor of folder ``path`` (relative to ``dir_fd`` when given), opened without following a
    symlink when ``dir_fd`` is given (the cache folder itself may be a link the user made; what is
    inside it may not). ``create``: make it first."""
    if create:
        try:
            os.mkdir(path, 0o755, dir_fd=dir_fd)
        except FileExistsError:
            pass
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if dir_fd is not None else 0)
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError as e:
        if dir_fd is not None and e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(f"{path!s} inside the cache is a symlink or not a folder: refusing to write through "
                             "it (shardcache creates its own parts/ folder; remove this one)") from None
        raise


def _check_plain(fd: int, path: Path) -> None:
    """Refuse (:class:`UnsafePath`) a lock file that is not a plain file with one link."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} hard links"
        raise UnsafePath(f"{path} is {what}: refusing to use it as the cache's lock file (it would empty the file "
                         "it shares its data with); remove it")


def _flock_struct() -> bytes:
    """A ``struct flock`` asking F_GETLK about a write lock of the whole file (Linux layout)."""
    return struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)


def holder(cache_dir: str | os.PathLike) -> dict | None:
    """Who holds the writer lock of ``cache_dir`` now (what its lock file says, ``pid`` at least),
    or None when nobody does (or this cannot be known: no lock file, no ``F_GETLK``). Takes no lock
    and writes nothing: a reader (``shards verify``, the loader's messages) asks it before it
    recommends a command that writes."""
    path = Path(cache_dir) / PARTS_DIR / LOCK_FILE
    try:
        real = os.path.realpath(path)
    except OSError:
        return None
    if real in _HELD:
        return dict(_HELD[real])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            got = fcntl.fcntl(fd, fcntl.F_GETLK, _flock_struct())
        except OSError:
            return None
        l_type, _, _, _, l_pid = struct.unpack("hhqqi4x", got)
        if l_type == fcntl.F_UNLCK:
            return None
        info = _read_fd(fd)  # (this process holds no lock on it: closing the descriptor drops nothing)
        info.setdefault("pid", l_pid)
        return info
    finally:
        os.close(fd)


class CacheLock:
    """The writer lock of cache folder ``cache_dir`` (a context manager; :meth:`acquire` /
    :meth:`release`). ``command`` is recorded with the holder (what a refused writer is told).

    Raises :class:`CacheLocked` when another live process holds it (after ``wait_s`` seconds of
    polling, 0: at once) or this process holds it already, :class:`~shards.errors.UnsafePath` when
    ``parts/`` or the lock file is a symlink or the lock file is not a plain one-link file.
    """

    def __init__(self, cache_dir: str | os.PathLike, command: str = "precompute", wait_s: float = 0.0):
        self.cache_dir = Path(cache_dir)
        self.path = self.cache_dir / PARTS_DIR / LOCK_FILE
        self.command, self.wait_s = command, float(wait_s)
        self._fd: int | None = None
        self._real: str | None = None

    def _open(self) -> int:
        root = _open_dir(self.cache_dir, create=False)
        try:
            parts = _open_dir(PARTS_DIR, dir_fd=root, create=True)
        finally:
            os.close(root)
        try:
            try:
                fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644, dir_fd=parts)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UnsafePath(f"{self.path} is a symlink: refusing to follow it (it would truncate the file it "
                                     "points to); remove it") from None
                raise
        finally:
            os.close(parts)
        try:
            _check_plain(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _refused(self, other: dict) -> CacheLocked:
        return CacheLocked(
            f"{self.cache_dir} is being written by another shardcache command ({describe(other)}; lock file "
            f"{self.path}): one writer per cache, two would race on the same files. Wait for it to end (its lock "
            f"goes with it, also if it dies), then run this {self.command} again.", other)

    def acquire(self) -> "CacheLock":
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        real = os.path.realpath(self.path)
        if real in _HELD:
            raise CacheLocked(f"{self.cache_dir} is already being written by this process ({describe(_HELD[real])}; "
                              f"lock file {self.path}): one writer per cache", dict(_HELD[real]))
        deadline = time.monotonic() + self.wait_s
        while True:
            fd = self._open()
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: held by another process
                os.close(fd)
                other = holder(self.cache_dir) or {}
                if time.monotonic() >= deadline:
                    raise self._refused(other) from None
                time.sleep(_POLL_S)
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
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "command": self.command,
              "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd, self._real = fd, real
        _HELD[real] = me
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
            if self._real is not None:
                _HELD.pop(self._real, None)
                self._real = None

    def __enter__(self) -> "CacheLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ---- the lock of a cache in object storage ---------------------------------------------------------------------

#: seconds between two heartbeats of a remote lock's holder
HEARTBEAT_S = 60.0
#: a remote lock whose heartbeat is older than this (seconds) belongs to a writer that is gone
STALE_S = 600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process)
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class RemoteLock:
    """The writer lock of a cache in object storage (see the module docstring), on ``folder`` (a
    :class:`shards.storage.RemoteFolder`); ``command`` is recorded with the holder. A context manager
    (:meth:`acquire` / :meth:`release`); :meth:`check` raises :class:`CacheLocked` once another writer took
    it over.

    Raises :class:`CacheLocked` when another writer holds it (after ``wait_s`` seconds of polling; 0: at once).
    On a store that cannot create an object only if it is absent, it warns and goes on unlocked."""

    NAME = f"{PARTS_DIR}/{LOCK_FILE}"

    def __init__(self, folder, command: str = "precompute", wait_s: float = 0.0, staging: str | None = None):
        self.folder, self.command, self.wait_s, self.staging = folder, command, float(wait_s), staging
        self.url = f"{folder.url}/{self.NAME}"
        self._path = f"{folder.root}/{self.NAME}"
        self._me: dict | None = None
        self._stop = None
        self._thread = None
        self.lost: dict | None = None

    # -- the object -----------------------------------------------------------------------------------------
    def _read(self) -> dict | None:
        """What the lock object says (None: there is none)."""
        def once():
            try:
                return self.folder.fs.cat_file(self._path)
            except FileNotFoundError:
                return None
        raw = self._retry(once)
        return None if raw is None else _parse(raw)

    def _retry(self, fn):
        from .storage import retry
        return retry(fn, self.url, self.folder.retries, self.folder.backoff)

    def _create(self, data: dict) -> bool:
        """Create the object holding ``data`` if it is absent; False when it exists."""
        body = (json.dumps(data) + "\n").encode()

        def once():
            try:
                self.folder.fs.pipe_file(self._path, body, mode="create")
                return True
            except FileExistsError:
                return False
        return self._retry(once)

    def _stale(self, other: dict) -> str | None:
        """Why the holder ``other`` is gone (its lock may be taken over), or None."""
        if other.get("host") == socket.gethostname() and isinstance(other.get("pid"), int) \
                and not _pid_alive(other["pid"]):
            return f"pid {other['pid']} is gone from this host"
        beat = other.get("heartbeat", other.get("since"))
        if isinstance(beat, (int, float)) and time.time() - beat > STALE_S:
            return f"no heartbeat for {time.time() - beat:.0f} s (more than {STALE_S:.0f})"
        if not other:
            return "the lock object holds no holder"
        return None

    def _refused(self, other: dict) -> CacheLocked:
        return CacheLocked(
            f"{self.folder.url} is being written by another shardcache command ({describe(other)}"
            + (f", staging folder {other['staging']}" if other.get("staging") else "") + "; lock object "
            f"{self.url}, held at the cache's location whatever the staging folder): one writer per cache, two would "
            f"overwrite each other's chunks. Wait for it to end, then run this {self.command} again (a writer that "
            f"died is taken over {STALE_S:.0f} s after its last heartbeat, at once from its own host).", other)

    # -- the session ----------------------------------------------------------------------------------------
    def acquire(self) -> "RemoteLock":
        import threading
        deadline = time.monotonic() + self.wait_s
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "command": self.command,
              "since": time.time(), "token": os.urandom(8).hex(), "staging": self.staging}
        while True:
            me["heartbeat"] = time.time()
            try:
                if self._create(me):
                    break
            except (NotImplementedError, TypeError) as e:  # no conditional create on this store
                log.warning("%s: this store cannot create an object only if it is absent (%s); going on without "
                            "the one-writer check", self.url, e)
                return self
            other = self._read()
            if other is None:
                continue  # (released just now)
            why = self._stale(other)
            if why is not None:
                if self._read() == other:  # (unchanged: nobody took it over meanwhile)
                    log.info("%s: the previous writer (%s) is gone (%s); lock taken over", self.url, describe(other), why)
                    self.folder.remove(self.NAME)
                continue
            if time.monotonic() >= deadline:
                raise self._refused(other)
            time.sleep(_POLL_S)
        self._me = me
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="remote-lock-heartbeat")
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self._beat_once():
                return

    def _beat_once(self) -> bool:
        """Rewrite the heartbeat, if the object is still this job's; False (and :attr:`lost` set) once it is not."""
        try:
            now = self._read()
            if now is None or now.get("token") != self._me["token"]:
                self.lost = now or {}
                log.error("%s: this job's lock was taken over by %s", self.url, describe(now or {}))
                return False
            self._me["heartbeat"] = time.time()
            self.folder.put_bytes((json.dumps(self._me) + "\n").encode(), self.NAME)
        except OSError as e:  # the store is unreachable for now: the next beat tries again
            log.warning("%s: heartbeat failed (%s)", self.url, e)
        return True

    def check(self) -> None:
        """Raise :class:`CacheLocked` when another writer took this lock over (this job stalled past
        :data:`STALE_S`): nothing more may be uploaded."""
        if self.lost is not None:
            raise CacheLocked(f"{self.folder.url}: this job's writer lock was taken over by {describe(self.lost)} "
                              f"(no heartbeat from this job for more than {STALE_S:.0f} s): stopping before it "
                              "overwrites that writer's files", self.lost)

    def release(self) -> None:
        """Stop the heartbeat and delete the lock object, if it is still this job's."""
        if self._me is None:
            return
        self._stop.set()
        self._thread.join(timeout=30)
        try:
            now = self._read()
            if now is not None and now.get("token") == self._me["token"]:
                self.folder.remove(self.NAME)
        except OSError as e:
            log.warning("%s: could not delete the lock object (%s): the next writer takes it over after %.0f s",
                        self.url, e, STALE_S)
        self._me = None

    def __enter__(self) -> "RemoteLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
