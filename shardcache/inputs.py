"""Files a user names on the command line (``--config``, ``--manifest``...): read only when they are
regular files, never waited on.

A FIFO given as ``--config`` used to hang the command (reading a named pipe blocks until something
writes to it); a device, a socket or a folder gave errors that named neither the option nor the
file. :func:`check_input` refuses them up front, naming the option, the path and what it is, and
:func:`read_input` opens with ``O_NONBLOCK`` and checks the opened descriptor again (a path swapped
for a FIFO after the check is not waited on either). Every command that reads a config or manifest
path goes through one of them: both stages' ``--config`` (:func:`shardcache.config.parse`,
:func:`shardcache.yaml_limits.read_yaml`: also ``add-field --config`` and ``$SHARDCACHE_*_CONFIG``),
``--manifest`` of ``precompute`` and ``check`` (:func:`precompute.manifests.read_requests`).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

#: file types that are not regular files, as an error names them
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class NotAFile(ValueError):
    """A path given for a file to read names something else (a FIFO, a device, a socket, a folder);
    the message names the option, the path and what it is (``what``, ``path``, ``kind``). Commands
    exit 2 for it."""

    def __init__(self, what: str, path: Path, kind: str):
        super().__init__(f"{what} {path} is {kind}, not a file: give a regular file")
        self.what, self.path, self.kind = what, path, kind


def kind(mode: int) -> str | None:
    """What a ``st_mode`` names when it is not a regular file (``"a FIFO (named pipe)"``...), else None."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_input(path: str | os.PathLike, what: str) -> Path:
    """``path`` (symlinks followed) when it is a regular file; raises :class:`NotAFile` naming ``what``
    (the option) when it is something else, ``FileNotFoundError`` when it names nothing. Nothing is
    opened (opening a FIFO blocks)."""
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {p} does not exist") from None
    if (k := kind(mode)) is not None:
        raise NotAFile(what, p, k)
    return p


def read_input(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of the regular file ``path`` (:func:`check_input`), read through a descriptor opened
    with ``O_NONBLOCK`` and checked again with ``fstat``."""
    p = check_input(path, what)
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    with os.fdopen(fd, "rb") as f:
        if (k := kind(os.fstat(fd).st_mode)) is not None:
            raise NotAFile(what, p, k)
        return f.read()


__all__ = ["NotAFile", "check_input", "kind", "read_input"]
