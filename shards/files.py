"""The shard files a reader reads with ``pread``: open lazily, pinned to the files the index describes.

Why ``pread`` and not a memory map: a read past the end of a file that shrank under a mapping kills
the process with SIGBUS (in a DataLoader worker: "Bus error", naming nothing), and no check before
touching the map closes the race with a truncation during the copy. ``os.preadv`` of a truncated
file returns fewer bytes instead, which :func:`read_segments` reports (and the caller turns into
:class:`~shards.errors.ShardCorrupt` naming shard, sample and member). It also copies the bytes
straight from the page cache into the caller's buffers (the batch tensors) with no page faults on
the source.

Identity: :meth:`ShardFiles.pin` records ``(st_dev, st_ino, st_size)`` of each file when a loader
is built (in the main process, next to the index it read). A process that opens a file later (a
DataLoader worker) and :meth:`ShardFiles.check` (once per file per batch: one ``stat``) compare the
file at that path with it: a shard replaced (another inode: a cache rewritten in place), truncated or
grown (another size) or deleted while a loader reads it stops the loader with ``ShardCorrupt``
naming the file, the sample about to be read and what changed, rather than reading bytes the index
does not describe. Changed bytes in a file that kept its inode and size are the checksums' job
(:mod:`shards.checksum`). Files of a cache streamed from object storage are not pinned (the
prefetcher deletes and downloads them again): their checksums guard them.

At most :data:`MAX_OPEN` descriptors per process stay open (least recently used closed first), so
a cache of many thousand shards stays under the usual 1024-descriptor limit.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Sequence

from .errors import ShardCorrupt

#: most file descriptors a :class:`ShardFiles` keeps open in one process
MAX_OPEN = 128
#: most buffers one ``preadv`` call takes (Linux IOV_MAX is 1024)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def identity(st: os.stat_result) -> tuple[int, int, int]:
    """``(st_dev, st_ino, st_size)``: what a pinned file must keep."""
    return st.st_dev, st.st_ino, st.st_size


class ShardFiles:
    """Read-only descriptors of ``paths`` (one per file number), opened on first use in each process.

    ``await_file(path)``: called before opening a file that is not there yet (a streamed cache:
    returns once it arrived, or raises); None: a missing file is :class:`ShardCorrupt`.
    """

    def __init__(self, paths: Sequence[Path], await_file: Callable | None = None):
        self.paths = list(paths)
        self.await_file = await_file
        self.pinned: list[tuple[int, int, int] | None] = [None] * len(self.paths)
        self._fds: OrderedDict[int, tuple[int, tuple[int, int, int]]] = OrderedDict()
        self._lock = threading.Lock()  # the loader's read-ahead threads share the descriptors

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def pin(self, which: Sequence[int]) -> None:
        """Record the identity of files ``which`` now (missing files are left to the readers)."""
        for i in which:
            try:
                self.pinned[i] = identity(os.stat(self.paths[i]))
            except OSError:
                self.pinned[i] = None

    def _changed(self, i: int, was: tuple[int, int, int], now: tuple[int, int, int], where) -> ShardCorrupt:
        where = _text(where)
        what = (f"it is another file now (inode {now[1]}, was {was[1]})" if now[:2] != was[:2]
                else f"its size changed from {was[2]} to {now[2]} bytes")
        return ShardCorrupt(f"{self.paths[i]}: {where}: the shard changed since this loader read the index: {what}; "
                            "was the cache rewritten while training? restart on the new cache, or run `shardcache shards verify`")

    def fd(self, i: int, where) -> int:
        """The descriptor of file ``i`` (opened and checked against its pinned identity if needed).
        ``where``: what is being read, for messages (a str, or a callable returning one)."""
        with self._lock:
            return self._fd(i, where)

    def _fd(self, i: int, where) -> int:
        got = self._fds.get(i)
        if got is not None:
            self._fds.move_to_end(i)
            return got[0]
        path = self.paths[i]
        if self.await_file is not None and not path.exists():
            self.await_file(path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ShardCorrupt(f"{path}: {_text(where)}: the shard is listed in the index but missing; run "
                               "`shardcache shards verify`") from None
        now = identity(os.fstat(fd))
        if self.pinned[i] is not None and now != self.pinned[i]:
            os.close(fd)
            raise self._changed(i, self.pinned[i], now, where)
        self._fds[i] = (fd, now)
        if len(self._fds) > MAX_OPEN:
            os.close(self._fds.popitem(last=False)[1][0])
        return fd

    def check(self, i: int, where) -> None:
        """Raise :class:`ShardCorrupt` naming ``where`` if the file at path ``i`` is no longer the one
        pinned (or, not pinned, the one opened): replaced, resized or deleted. One ``stat``."""
        ref = self.pinned[i]
        if ref is None:
            got = self._fds.get(i)
            if got is None or self.await_file is not None:
                return  # not pinned, streamed: the checksums guard the bytes
            ref = got[1]
        try:
            now = identity(os.stat(self.paths[i]))
        except FileNotFoundError:
            raise ShardCorrupt(f"{self.paths[i]}: {_text(where)}: the shard was deleted while this loader reads it; "
                               "was the cache rewritten while training?") from None
        if now != ref:
            raise self._changed(i, ref, now, where)

    def checked_fds(self, which: Sequence[int], where: Callable[[int], str]) -> list[int]:
        """:meth:`check` then :meth:`fd` for each file number of ``which`` (a batch's files, each
        once: one ``stat`` each): their descriptors. ``where(i)``: what is read from file ``i``, for
        messages (called only to build one)."""
        out = []
        for i in which:
            self.check(i, lambda i=i: where(i))
            out.append(self.fd(i, lambda i=i: where(i)))
        return out

    def close_stale(self) -> int:
        """Close the descriptors of files deleted or replaced since they were opened (a streamed
        cache's evicted files: their disk space comes back); returns how many."""
        with self._lock:
            return self._close_stale()

    def _close_stale(self) -> int:
        n = 0
        for i, (fd, ident) in list(self._fds.items()):
            try:
                if identity(os.stat(self.paths[i]))[:2] == ident[:2]:
                    continue
            except OSError:
                pass
            os.close(fd)
            del self._fds[i]
            n += 1
        return n

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._fds.clear()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fds"] = OrderedDict()  # reopened lazily in each process
        del state["_lock"]
        return state

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _text(where) -> str:
    return where() if callable(where) else str(where)


def read_segments(fd: int, start: int, iov: list, total: int) -> int:
    """``os.preadv(fd, iov, start)`` until ``total`` bytes were read or the file ends; returns the
    bytes read (``< total`` only when the file is shorter than ``start + total``).

    ``iov``: writable buffers (memoryviews) filled in order from file offset ``start``; at most
    :data:`IOV_MAX` of them. A regular file returns fewer bytes than asked only at its end; the
    loop also covers a partial read for any other reason."""
    done = 0
    while True:
        got = os.preadv(fd, iov, start + done)
        done += got
        if got == 0 or done >= total:
            return done
        while got and got >= len(iov[0]):  # drop the buffers filled, cut the one half filled
            got -= len(iov[0])
            iov = iov[1:]
        if got:
            iov = [iov[0][got:]] + iov[1:]


__all__ = ["ShardFiles", "read_segments", "identity", "MAX_OPEN", "IOV_MAX"]
