"""What a media path names, for reject details: a regular file, or what else (issue 30)."""
from __future__ import annotations

import os
import stat

#: file types that are not regular files, as a reject detail names them
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))

#: :func:`file_problem`'s answer for a path that names nothing (a dangling symlink included)
MISSING = "file does not exist"


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
    if stat.S_ISREG(mode):
        return None
    what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"is {what}, not a file"
