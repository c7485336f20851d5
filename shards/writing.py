"""Who may write a cache folder, and how a file comes to be in it.

Every change to a cache folder happens inside a :class:`CacheWriter` session, and every file is
created, replaced and removed through the session's :meth:`~CacheWriter.create`,
:meth:`~CacheWriter.replace` and :meth:`~CacheWriter.unlink` (the format's own writers do:
:func:`shards.index.write_atomic` for the index, manifest, rejects, root, card and parts,
:class:`shards.writer.ShardWriter` for shard tars, ``add-field``'s sidecars, stage one's removal of
stale chunks). A session:

* **owns the folder**: it writes only into an empty (or new) folder or a shardcache cache: the
  marker file :data:`MARKER` (``.shardcache``) is written first, before any other file, and a
  folder that holds files but no marker (another tool's files) is refused with :class:`NotACache`
  naming some of them, before anything is written. A cache written before markers existed (its
  ``parts/`` holds ``job.json`` or index parts) is adopted: the marker is added.
* **holds the writer lock** (:mod:`shards.lock`) for as long as it lasts, so there is one writer
  per cache; a second one is refused with :class:`~shards.lock.CacheLocked` naming the holder
  (exit 2), or waits ``wait_s`` seconds for it. The other ranks of a torchrun job (``rank > 0``)
  write under their rank 0's lock: they join without taking it.
* **never follows a symlink inside the folder**: the cache folder is opened once (it may itself be
  a link the user made) and every file is reached relative to that descriptor (``openat``); a new
  file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a temporary name and renamed onto its
  name, and an existing symlink (or other non-file) at either name is refused by name with
  :class:`~shards.errors.UnsafePath`, so a planted ``shard-000000.tar.tmp`` link never overwrites the
  file it points to. ``parts/`` must be a real folder.

Commands declare that they write a cache with :func:`writes_cache` (the session spans the whole
command; :data:`WRITERS` lists every declared writer) or open ``with CacheWriter(...)`` where the
folder is computed first (stage one's staging folder). A write made outside any session (a library
user calling :class:`~shards.writer.ShardWriter` or ``merge_parts`` directly) opens one for that
write alone, so it too is refused while another process writes the cache: no write can bypass the
lock, declared or not.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import UnsafePath, WriteRefused
from .lock import LOCK_FILE, CacheLock, CacheLocked, _open_dir, describe
from .schema import PARTS_DIR

#: the file that makes a folder a shardcache cache; written before any other file
MARKER = ".shardcache"
#: every command declared with :func:`writes_cache`: name -> the function
WRITERS: dict[str, Callable] = {}

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_REGISTRY = threading.RLock()
_ACTIVE: dict[str, "CacheWriter"] = {}  # real path of the cache folder -> its session in this process


class NotACache(WriteRefused):
    """A folder that holds files shardcache did not write (no :data:`MARKER`), given as a cache to
    write; or, to a command that changes an existing cache, an empty folder. Exit status 2."""


def _legacy(root_fd: int) -> bool:
    """Whether the folder is a cache written before markers existed: its ``parts/`` (a real folder)
    holds stage one's ``job.json``, an index part or the writer lock."""
    try:
        parts = os.open(PARTS_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    except OSError:
        return False
    try:
        return any(n in ("job.json", LOCK_FILE) or n.endswith(".index.parquet") for n in os.listdir(parts))
    finally:
        os.close(parts)


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    return ("a symlink" if stat.S_ISLNK(m) else "a folder" if stat.S_ISDIR(m) else
            "a FIFO" if stat.S_ISFIFO(m) else "not a regular file")


class CacheWriter:
    """A writing session on cache folder ``cache_dir`` (a context manager; see the module docstring).

    Args:
        cache_dir: the cache folder (made when ``create``).
        command: what writes (``precompute``, ``add-field``...): recorded in the lock file, named to a
            writer that is refused.
        rank: global rank; ranks > 0 join their rank 0's session (no lock, no ownership check).
        create: the folder may be new or empty (stage one); else it must be a cache already.
        wait_s: seconds to wait for another writer's lock before giving up (0: refuse at once).

    Entering raises :class:`~shards.lock.CacheLocked` (another process, or another thread of this
    one, writes the cache), :class:`NotACache` (a folder of other files; an empty folder without
    ``create``) or :class:`~shards.errors.UnsafePath` (``.shardcache``, ``parts/`` or the lock file
    is a symlink). Entering again from the thread that holds the session joins it.
    """

    def __init__(self, cache_dir: str | os.PathLike, command: str, *, rank: int = 0, create: bool = False,
                 wait_s: float = 0.0, _auto: bool = False):
        self.root = Path(cache_dir)
        self.command, self.rank, self.new_ok, self.wait_s = command, int(rank or 0), bool(create), float(wait_s)
        self.auto = _auto
        self.real = ""
        self._root_fd: int | None = None
        self._parts_fd: int | None = None
        self._lock: CacheLock | None = None
        self._depth = 0
        self._thread: threading.Thread | None = None
        self._joined: CacheWriter | None = None

    # -- the session --------------------------------------------------------------------------------
    def __enter__(self) -> "CacheWriter":
        if self.new_ok and not self.root.exists():
            self.root.mkdir(parents=True, exist_ok=True)
        real = os.path.realpath(self.root)
        with _REGISTRY:
            active = _ACTIVE.get(real)
            if active is not None:
                if self.auto or active._thread is threading.current_thread():
                    active._depth += 1
                    self._joined = active
                    return active
                raise CacheLocked(f"{self.root} is already being written by this process ({active.command}): one "
                                  f"writer per cache; run this {self.command} when it has ended",
                                  {"pid": os.getpid(), "command": active.command})
            self._open(real)
            self._depth, self._thread = 1, threading.current_thread()
            _ACTIVE[real] = self
        return self

    def __exit__(self, *exc) -> None:
        s = self._joined or self
        with _REGISTRY:
            s._depth -= 1
            if s._depth > 0:
                self._joined = None
                return
            _ACTIVE.pop(s.real, None)
        s._close()
        self._joined = None

    def _open(self, real: str) -> None:
        self.real = real
        if not self.root.is_dir():
            raise NotACache(f"{self.root}: no such folder; not a shardcache cache")
        self._root_fd = _open_dir(self.root)
        try:
            if self.rank == 0:
                self._claim()
                self._lock = CacheLock(self.root, self.command, self.wait_s).acquire()
        except BaseException:
            self._close()
            raise

    def _close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        for fd in (self._parts_fd, self._root_fd):
            if fd is not None:
                os.close(fd)
        self._parts_fd = self._root_fd = None

    def _claim(self) -> None:
        """Make sure the folder is ours (see the module docstring); write the marker if it is not there."""
        st = self._lstat(MARKER, self._root_fd)
        if st is not None:
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePath(f"{self.root / MARKER} is {_kind(st)}: refusing to write into {self.root} "
                                 "(shardcache writes that file itself; remove it)")
            return
        names = sorted(os.listdir(self._root_fd))
        if names and not _legacy(self._root_fd):
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise NotACache(f"{self.root} holds files shardcache did not write ({shown}) and no {MARKER} marker: "
                            "refusing to write a cache into it (its files would be overwritten). Give an empty or "
                            "new folder, or a shardcache cache.")
        if not names and not self.new_ok:
            raise NotACache(f"{self.root} is empty: not a shardcache cache")
        try:
            fd = os.open(MARKER, _NEW, 0o644, dir_fd=self._root_fd)
        except FileExistsError:  # another writer made it just now
            return self._claim()
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(f"{self.root / MARKER} is a symlink: refusing to write through it") from None
            raise
        with os.fdopen(fd, "w") as f:
            from .schema import FORMAT_VERSION
            f.write(json.dumps({"shardcache": "cache", "format_version": FORMAT_VERSION,
                                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")

    # -- files inside the folder ----------------------------------------------------------------------
    @staticmethod
    def _lstat(name: str, dir_fd: int) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _where(self, path: str | os.PathLike) -> tuple[int, str]:
        """``(folder descriptor, name)`` of a file ``path`` directly in the cache folder or in ``parts/``;
        :class:`UnsafePath` for any other place."""
        path = Path(path)
        if path.parent.name == PARTS_DIR and os.path.realpath(path.parent.parent) == self.real:
            with _REGISTRY:  # (the job's writer thread and its main thread share the session)
                if self._parts_fd is None:
                    self._parts_fd = _open_dir(PARTS_DIR, dir_fd=self._root_fd, create=True)
            return self._parts_fd, path.name
        if os.path.realpath(path.parent) == self.real:
            return self._root_fd, path.name
        raise UnsafePath(f"{path} is not a file of the cache folder {self.root} or its {PARTS_DIR}/: refusing to "
                         "write it")

    def _refuse_odd(self, path: str | os.PathLike, st: os.stat_result | None) -> None:
        if st is not None and not stat.S_ISREG(st.st_mode):
            target = f" (pointing to {os.readlink(path)})" if stat.S_ISLNK(st.st_mode) else ""
            raise UnsafePath(f"{path} is {_kind(st)}{target}, not a file shardcache wrote: refusing to write "
                             "through it or over it; remove it")

    def create(self, path: str | os.PathLike, mode: int = 0o644) -> int:
        """A new file at ``path`` opened for writing (a descriptor): ``O_EXCL | O_NOFOLLOW``, so
        nothing that was there is written through. A plain file already at ``path`` (a temporary
        file of a writer that was killed) is removed first; a symlink or anything else is refused
        (:class:`UnsafePath`)."""
        dfd, name = self._where(path)
        try:
            return os.open(name, _NEW, mode, dir_fd=dfd)
        except FileExistsError:
            pass
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
        st = self._lstat(name, dfd)
        self._refuse_odd(path, st)
        if st is not None:
            os.unlink(name, dir_fd=dfd)
        return os.open(name, _NEW, mode, dir_fd=dfd)

    def replace(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        """Rename ``src`` (a file this session created) onto ``dst`` in the same folder, after refusing
        a symlink or non-file at ``dst``."""
        sfd, sname = self._where(src)
        dfd, dname = self._where(dst)
        self._refuse_odd(dst, self._lstat(dname, dfd))
        os.replace(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)

    def unlink(self, path: str | os.PathLike, missing_ok: bool = True) -> None:
        """Remove the file at ``path`` (a symlink or folder there is refused: not a file we wrote)."""
        dfd, name = self._where(path)
        st = self._lstat(name, dfd)
        if st is None:
            if missing_ok:
                return
            raise FileNotFoundError(errno.ENOENT, "no such file", str(path))
        self._refuse_odd(path, st)
        os.unlink(name, dir_fd=dfd)

    def fsync_dir(self, path: str | os.PathLike) -> None:
        """fsync the folder holding ``path`` (renames inside it survive a crash)."""
        dfd, _ = self._where(path)
        try:
            os.fsync(dfd)
        except OSError:
            pass


def _session_of(path: Path) -> CacheWriter | None:
    """The session of this process whose folder holds file ``path`` (directly or in ``parts/``)."""
    with _REGISTRY:
        if not _ACTIVE:
            return None
        for parent in (path.parent, path.parent.parent) if path.parent.name == PARTS_DIR else (path.parent,):
            s = _ACTIVE.get(os.path.realpath(parent))
            if s is not None:
                return s
    return None


def _root_of(path: Path) -> Path:
    """The cache folder of file ``path`` written outside any session: ``parts/``'s parent for a part."""
    if path.parent.name == PARTS_DIR and not (path.parent / MARKER).exists():
        return path.parent.parent
    return path.parent


@contextlib.contextmanager
def session(path: str | os.PathLike) -> Iterator[CacheWriter]:
    """The session that writes file ``path`` of a cache: this process's (joined), else one opened for
    this write alone (a library write outside a command: it takes the lock and owns the folder)."""
    path = Path(path)
    active = _session_of(path)
    root = Path(active.root) if active is not None else _root_of(path)
    with CacheWriter(root, f"a write of {path.name}", create=True, _auto=True) as s:
        yield s


def writes_cache(command: str, *, cache: str = "cache_dir", rank: str | None = None,
                 create: bool = False) -> Callable[[Callable], Callable]:
    """Declare that function ``fn`` writes a cache: it runs inside a :class:`CacheWriter` on its
    argument named ``cache`` (global rank from the argument named ``rank``), so it holds the writer
    lock from its first line to its last. The function is listed in :data:`WRITERS` under ``command``
    and carries ``fn.writes_cache == command`` and ``fn.cache_arg == cache``."""
    def deco(fn: Callable) -> Callable:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            r = bound.arguments.get(rank, 0) if rank else 0
            with CacheWriter(bound.arguments[cache], command, rank=r, create=create):
                return fn(*args, **kwargs)

        wrapper.writes_cache = command  # type: ignore[attr-defined]
        wrapper.cache_arg = cache  # type: ignore[attr-defined]
        WRITERS[command] = wrapper
        return wrapper
    return deco


def cache_holding(path: str | os.PathLike) -> Path | None:
    """The cache folder that file ``path`` would be written into (its folder, or the folder above a
    ``parts/``), or None: for commands that write a file the user names (exports), which must never
    change a cache file outside a writing session."""
    from .schema import INDEX_FILE, MANIFEST_FILE
    folder = Path(os.path.realpath(path)).parent
    for d in (folder, folder.parent) if folder.name == PARTS_DIR else (folder,):
        if (d / MARKER).exists() or ((d / INDEX_FILE).exists() and (d / MANIFEST_FILE).exists()):
            return d
    return None


def writer_of(cache_dir: str | os.PathLike) -> str | None:
    """``describe()`` of whoever writes ``cache_dir`` now (this process or another), or None: what a
    reader says instead of recommending a command that writes while one runs."""
    from .lock import holder
    h = holder(cache_dir)
    return describe(h) if h else None


__all__ = ["CacheWriter", "MARKER", "NotACache", "WRITERS", "cache_holding", "session", "writer_of", "writes_cache"]
