"""Caches in object storage (``s3://``, ``gs://``, ``hf://``, ``https://``...) through ``fsspec``.

A remote cache is the same folder as a local one (``index.parquet``, ``manifest.json``, shard tars,
``parts/``), under a URL. :class:`RemoteFolder` is the one way this project touches such a folder:
downloads go to a temporary file beside the target and are renamed into place (a reader never sees
half a file), uploads are whole objects, and every call is retried with exponential backoff on
transient errors (connection refused or reset, timeouts, 5xx: anything but "not found", "permission
denied" and a refused name), so a storage server that restarts mid-epoch costs retries, not samples.

Credentials and endpoints come the usual way for each store (``fsspec``/``s3fs``: environment
variables such as ``AWS_ACCESS_KEY_ID`` / ``AWS_ENDPOINT_URL``, ``~/.aws``, instance roles;
``gcsfs``: application default credentials; ``hf://``: ``HF_TOKEN``), or explicitly through
``storage_options`` (passed to ``fsspec.core.url_to_fs``, e.g. ``{"client_kwargs":
{"endpoint_url": "http://127.0.0.1:9000"}}`` for MinIO). The protocol's fsspec package must be
installed (``pip install shardcache[remote]`` brings ``s3fs``).

Names: whatever an index or manifest says, only plain file names directly in the folder and
``parts/NAME`` are ever joined to the URL or to a local folder (:func:`check_name`), so a hostile
remote index cannot make a reader read or write outside its own local cache folder.
"""
from __future__ import annotations

import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from .errors import UnsafePath
from .index import unsafe_name_reason
from .schema import PARTS_DIR

log = logging.getLogger("shards")
T = TypeVar("T")

#: errors that retrying cannot fix
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, UnsafePath,
             ValueError, TypeError)


def is_url(path: Any) -> bool:
    """True for ``proto://...`` paths other than ``file://`` (those are local folders)."""
    s = str(path)
    return "://" in s and not s.startswith("file://")


def local_path(path: Any) -> Path:
    """A local folder given as a path or a ``file://`` URL (``file:///abs/path`` or
    ``file://localhost/abs/path``, percent-escapes decoded: ``file:///a%20b`` is ``/a b``).
    Raises ``ValueError`` for a ``file://`` URL naming another host."""
    if isinstance(path, os.PathLike):
        return Path(path)
    s = str(path)
    if not s.startswith("file://"):
        return Path(s)
    from urllib.parse import unquote, urlsplit
    parts = urlsplit(s)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{s}: a file:// URL on another host ({parts.netloc}) is not a local folder; "
                         "mount it, or give its path")
    return Path(unquote(parts.path))


def check_name(name: str) -> str:
    """``name`` if it is a plain file name or ``parts/NAME``; else :class:`UnsafePath`."""
    parts = name.split("/") if isinstance(name, str) else [name]
    ok = len(parts) == 1 or (len(parts) == 2 and parts[0] == PARTS_DIR)
    why = unsafe_name_reason(parts[-1]) if ok else "is not a plain file name or parts/NAME"
    if why is not None:
        raise UnsafePath(f"refusing remote cache member name {name!r}: it {why}")
    return name


def retry(fn: Callable[[], T], what: str, retries: int = 10, backoff: float = 0.5,
          max_sleep: float = 30.0, on_retry: Callable[[BaseException], None] | None = None) -> T:
    """``fn()``, retried up to ``retries`` times on transient errors, sleeping ``backoff * 2**k``
    seconds (jittered, at most ``max_sleep``) in between. Raises the last error (naming ``what``)
    when every try failed, and :data:`PERMANENT` errors at once."""
    for k in range(retries + 1):
        try:
            return fn()
        except PERMANENT:
            raise
        except Exception as e:  # noqa: BLE001 - every other storage error is worth another try
            if k == retries:
                raise OSError(f"{what}: failed after {retries + 1} tries: {type(e).__name__}: {e}") from e
            if on_retry is not None:
                on_retry(e)
            sleep = min(max_sleep, backoff * 2 ** k) * (0.5 + random.random() / 2)
            log.warning("%s: %s: %s; retrying in %.1f s (%d/%d)", what, type(e).__name__, str(e)[:200],
                        sleep, k + 1, retries)
            time.sleep(sleep)
    raise AssertionError("unreachable")


class RemoteFolder:
    """A cache folder at ``url`` (see the module docstring).

    Args:
        url: e.g. ``s3://bucket/caches/tts``.
        storage_options: keyword arguments for the fsspec filesystem (credentials, endpoint...).
        retries, backoff: see :func:`retry`.

    Attributes: ``url``, ``fs`` (the fsspec filesystem), ``root`` (the path inside it),
    ``retries_done`` (transient errors retried so far).
    """

    def __init__(self, url: str, storage_options: dict | None = None, retries: int = 10,
                 backoff: float = 0.5):
        from fsspec.core import url_to_fs

        self.url = str(url).rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/")
        self.retries, self.backoff = int(retries), float(backoff)
        self.retries_done = 0

    def __getstate__(self):  # fsspec filesystems pickle by their arguments; keep ours explicit
        return {"url": self.url, "storage_options": self.storage_options, "retries": self.retries,
                "backoff": self.backoff}

    def __setstate__(self, state):
        self.__init__(**state)

    def _path(self, name: str) -> str:
        return f"{self.root}/{check_name(name)}"

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        def count(_e):
            self.retries_done += 1
            self.fs.invalidate_cache()
        return retry(fn, f"{self.url}/{what}", self.retries, self.backoff, on_retry=count)

    def exists(self, name: str) -> bool:
        return self._retry(lambda: self.fs.exists(self._path(name)), name)

    def size(self, name: str) -> int:
        return int(self._retry(lambda: self.fs.size(self._path(name)), name))

    def list(self, sub: str = "") -> list[str]:
        """Names of the files directly in the folder (``sub=""``) or in ``parts/`` (``sub="parts"``)."""
        base = f"{self.root}/{sub}".rstrip("/")

        def ls():
            try:
                return self.fs.ls(base, detail=False, refresh=True)
            except FileNotFoundError:
                return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self._retry(ls, sub or "."))

    def cat(self, name: str) -> bytes:
        return self._retry(lambda: self.fs.cat_file(self._path(name)), name)

    def get(self, name: str, dest: str | Path) -> Path:
        """Download ``name`` to the local file ``dest`` (atomically: temp file + rename)."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)

        def once():
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
            os.close(fd)
            try:
                self.fs.get_file(self._path(name), tmp)
                os.replace(tmp, dest)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        self._retry(once, name)
        return dest

    def put(self, src: str | Path, name: str) -> None:
        """Upload the local file ``src`` as ``name`` (one whole object)."""
        self._retry(lambda: self.fs.put_file(str(src), self._path(name)), name)

    def put_bytes(self, data: bytes, name: str) -> None:
        self._retry(lambda: self.fs.pipe_file(self._path(name), data), name)

    def remove(self, name: str) -> None:
        """Delete the file ``name`` (nothing when it does not exist)."""
        def rm():
            try:
                self.fs.rm_file(self._path(name))
            except FileNotFoundError:
                pass
        self._retry(rm, name)


__all__ = ["RemoteFolder", "is_url", "local_path", "check_name", "retry", "PERMANENT"]
