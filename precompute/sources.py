"""Media files: what a path names (for reject details), and opening one safely under its root.

A media path read from a manifest is checked against the media root when the manifest is read
(:class:`precompute.conversation.MediaRoot`), but the file is opened later, by a decode worker: a
symlink swapped in between (``a.wav`` -> ``/etc/shadow``) used to escape ``--root``. So the check is
made again on what is opened: :class:`MediaPath` (what ``MediaRoot.resolve`` returns) carries the
real root folder with the path, and :func:`open_media` opens the file, then checks the opened
descriptor: a regular file (``fstat``; opened ``O_NONBLOCK``, so a FIFO is never waited on) whose
real path (``/proc/self/fd/N`` on Linux, ``F_GETPATH`` on macOS) lies inside that root. The decoders
read through that descriptor only (:mod:`precompute.audio`, :mod:`precompute.images`).
"""
from __future__ import annotations

import fcntl
import os
import stat
import sys

from shardcache.inputs import kind

#: :func:`file_problem`'s answer for a path that names nothing (a dangling symlink included)
MISSING = "file does not exist"
#: the words of every "path outside the root" reject (precompute.job counts those of the manifest's rows)
OUTSIDE_ROOT = "outside the media root"


class MediaPath(str):
    """A media path (absolute, as the manifest gives it against the root) that knows the real
    folder ``root`` it must stay inside (None: ``allow_outside_root``). It is a ``str`` everywhere
    else (recorded sources, digests, json); it travels to decode workers with the row (pickled with
    its root)."""

    __slots__ = ("root",)

    def __new__(cls, path: str, root: str | None) -> "MediaPath":
        obj = super().__new__(cls, path)
        obj.root = root
        return obj

    def __reduce__(self):
        return (MediaPath, (str(self), self.root))


class MediaRefused(Exception):
    """A media file that must not be read: ``detail`` says why; ``outside`` when it is a file outside
    the media root (a ``malformed_row``), else not a regular file (an unreadable-media reject)."""

    def __init__(self, detail: str, outside: bool = False):
        super().__init__(detail)
        self.detail, self.outside = detail, outside


def file_problem(path: str | os.PathLike) -> str | None:
    """None when ``path`` (symlinks followed) is a regular file; else why not, for a reject
    detail: :data:`MISSING`, ``"is a directory, not a file"`` (a FIFO, a socket, a device), or
    ``"cannot examine the path: <reason>"``. Nothing here opens the path (opening a FIFO blocks)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return MISSING
    except OSError as e:
        return f"cannot examine the path: {e.strerror or e}"
    k = kind(mode)
    return None if k is None else f"is {k}, not a file"


def _opened_path(fd: int, path: str) -> str | None:
    """The real path of the file open on ``fd`` (None where the system cannot say)."""
    if os.path.isdir("/proc/self/fd"):
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return None
    if sys.platform == "darwin" and hasattr(fcntl, "F_GETPATH"):
        try:
            return fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024)).rstrip(b"\0").decode()
        except OSError:
            return None
    real = os.path.realpath(path)  # elsewhere: the path's real file, if it is the one opened
    try:
        st, now = os.fstat(fd), os.stat(real)
    except OSError:
        return None
    return real if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino) else None


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def open_media(path: str | os.PathLike) -> int:
    """A read-only descriptor of media file ``path`` (close-on-exec), checked on the descriptor:
    a regular file and, for a :class:`MediaPath` with a root, inside that root. Raises
    :class:`MediaRefused` (not a file; outside the root: ``outside``), ``OSError`` from ``open``
    (``FileNotFoundError`` for a file that is gone)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        k = kind(os.fstat(fd).st_mode)
        if k is not None:
            raise MediaRefused(f"is {k}, not a file")
        root = path.root if isinstance(path, MediaPath) else None
        if root is not None:
            real = _opened_path(fd, str(path))
            if real is None or not _inside(real, root):
                raise MediaRefused(f"{str(path)!r} is {OUTSIDE_ROOT} {root}: the file opened is "
                                   f"{real or 'not the one the path named when it was checked'} (a symlink changed "
                                   "after the manifest was read?); pass --root DIR or set allow_outside_root: true "
                                   "to read it", outside=True)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return fd
    except BaseException:
        os.close(fd)
        raise


def fd_path(fd: int, path: str | os.PathLike) -> str:
    """A path that opens the very file open on ``fd`` (for readers that take only a path, such as
    audioread/ffmpeg, run in another process): ``/proc/PID/fd/N`` on Linux, else ``path``."""
    proc = f"/proc/{os.getpid()}/fd/{fd}"
    return proc if os.path.exists(proc) else str(path)


__all__ = ["MISSING", "MediaPath", "MediaRefused", "OUTSIDE_ROOT", "fd_path", "file_problem", "open_media"]
