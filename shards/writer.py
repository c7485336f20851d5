"""Atomic shard writer: one WebDataset tar plus its index/rejects parts.

A shard is written to ``NAME.tar.tmp`` with :mod:`tarfile` in the WebDataset layout (members
``KEY.EXT`` in sorted EXT order, as webdataset's ``TarWriter`` writes them; mode 0444, owner
``bigdata``, integer mtime 0, so a rerun of the same chunk gives byte-identical tars), fsynced,
scanned for its index rows, renamed to ``NAME.tar``; then the chunk's rejects part and index part
are written (index part last: it marks the chunk done). Every file is created inside the cache's
writing session (:mod:`shards.writing`: the writer lock held, the folder owned; the ``.tmp`` made
with ``O_EXCL | O_NOFOLLOW``, so a symlink planted at ``NAME.tar.tmp`` or ``NAME.tar`` is refused
by name instead of written through). A process killed at any moment leaves
either no trace of the chunk, a ``.tmp`` file that readers never open, or a finished tar without an
index part that the next run rewrites.

No wasted bytes: each member costs one 512-byte ustar header plus its padding to a 512-byte block
(the tar ends with tarfile's end-of-archive blocks, padded to 10 KiB). The mtime is an *int*: a
float mtime (webdataset's ``TarWriter(mtime=0.0)``) makes :mod:`tarfile` prepend a
``././@PaxHeader`` block (1 KiB) to every member. The tar is POSIX.1-2001 (pax) format, but a pax
header is written only for a member whose name cannot be stored in ustar (longer than 100 bytes,
or non-ASCII).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from . import fields as registry, npz
from .index import unsafe_name_reason, write_parts
from .npz import npy_bytes  # noqa: F401 - re-exported (callers import it from here)
from .scan import scan_shard
from .schema import JSON_MEMBER, TENSOR_DTYPES, key_problem, safe_key
from .writing import CacheWriter, session


#: ustar fields of every member (the values webdataset's TarWriter uses)
TAR_MODE, TAR_USER, TAR_GROUP, TAR_MTIME = 0o444, "bigdata", "bigdata", 0


def tar_member(name: str, size: int) -> tarfile.TarInfo:
    """The header of one shard member: fixed int mtime/owner/mode, so tars are reproducible and
    carry no pax header unless ``name`` needs one."""
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = TAR_MTIME
    ti.mode = TAR_MODE
    ti.uname, ti.gname = TAR_USER, TAR_GROUP
    return ti


class ShardWriter:
    """Write one shard and its index part atomically.

    Args:
        out_dir: cache directory.
        name: shard file name, e.g. ``shard_name(rank, n)``.

    Use ``add(key, fields)`` for kept samples and ``reject(...)`` for rejected rows, then
    ``commit()``; a ``with`` block aborts (removes the ``.tmp``) on an exception. ``fields`` maps
    member names to values: ``"json"`` -> a JSON-able dict; every tensor member of
    :data:`shards.schema.TENSOR_DTYPES` (``"codes.npy"``, ``"audio.npy"``, ``"latents.npy"``, ...)
    -> an array with the dtype listed there (``ValueError`` otherwise). ``name`` must be a plain
    file name (``ValueError`` otherwise: readers refuse any other, see
    :func:`shards.index.safe_shard_path`).

    A sample's arrays go into one ``KEY.tensors.npz`` member (:mod:`shards.npz`; all but the
    latents, see :attr:`shards.fields.Field.packed`), so a sample is two or three tar members
    (``json``, ``tensors.npz``, ``latents.npy``) whatever its number of arrays.
    """

    def __init__(self, out_dir: str | Path, name: str):
        why = unsafe_name_reason(name)
        if why is not None:
            raise ValueError(f"shard name {name!r}: it {why}; use shards.schema.shard_name")
        self.out_dir = Path(out_dir)
        self.name = name
        self.stem = name[:-4] if name.endswith(".tar") else name
        self.path = self.out_dir / name
        self.tmp = self.out_dir / (name + ".tmp")
        self._file = None
        self._tar = None
        self._session: contextlib.ExitStack | None = None
        self._writer: CacheWriter | None = None
        self.keys: list[str] = []
        self.rejects: list[dict] = []

    def _open(self) -> None:
        stack = contextlib.ExitStack()  # the cache's writing session, until commit() or abort()
        writer = stack.enter_context(session(self.tmp))
        try:
            fd = writer.create(self.tmp)
        except BaseException:
            stack.close()
            raise
        self._session, self._writer = stack, writer
        self._file = os.fdopen(fd, "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w|", format=tarfile.PAX_FORMAT)

    def add(self, key: str, fields: dict[str, Any]) -> None:
        """Append one sample. Raises ``ValueError`` for an unsafe key (:func:`shards.schema.safe_key`,
        :func:`shards.schema.key_problem`), unknown member or wrong dtype."""
        if key != safe_key(key):
            raise ValueError(f"key {key!r} contains '.', '/' or whitespace; use shards.schema.safe_key")
        why = key_problem(key)
        if why is not None:
            raise ValueError(f"key {key!r}: {why}")
        obj: dict[str, bytes] = {}
        arrays: dict[str, np.ndarray] = {}
        for name, value in fields.items():
            if name == JSON_MEMBER:
                obj[name] = json.dumps(value, sort_keys=True, ensure_ascii=False).encode()
            elif name in TENSOR_DTYPES:
                arr = np.asarray(value)
                if arr.dtype != np.dtype(TENSOR_DTYPES[name]):
                    raise ValueError(f"{key}.{name}: dtype {arr.dtype}, expected {TENSOR_DTYPES[name]}")
                arrays[name] = arr
            else:
                raise ValueError(f"{key}: unknown member {name!r}; known: json, {', '.join(TENSOR_DTYPES)}")
        pack = sorted(n for n in arrays if registry.field_of_member(n).packed)
        if pack:  # in sorted name order, like the members
            obj[npz.MEMBER] = npz.pack({n[:-4]: arrays[n] for n in pack})
        obj.update({n: npy_bytes(a) for n, a in arrays.items() if n not in pack})
        if self._tar is None:
            self._open()
        for name in sorted(obj):
            data = obj[name]
            self._tar.addfile(tar_member(f"{key}.{name}", len(data)), io.BytesIO(data))
        self.keys.append(key)

    def reject(self, key: str, source: str, reason: str, detail: str) -> None:
        """Record a rejected row (written to the chunk's rejects part on commit)."""
        self.rejects.append(dict(key=key, source=source, reason=reason, detail=detail))

    def commit(self, job_meta: dict | None = None) -> dict | None:
        """Finish the shard atomically; return its entry ``{path, samples, bytes, sha256}``.

        A chunk with no kept samples writes no tar (returns None) but still commits its parts.
        ``job_meta`` is stored with the index part (see :func:`shards.index.write_parts`).
        """
        entry = None
        rows: list[dict] = []
        if self._tar is not None:
            self._tar.close()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._tar = self._file = None
            try:
                rows, sha, size = scan_shard(self.tmp, shard_name=self.name)
                self._writer.replace(self.tmp, self.path)
                self._writer.fsync_dir(self.path)
                entry = dict(path=self.name, samples=len(rows), bytes=size, sha256=sha)
                write_parts(self.out_dir, self.stem, rows, self.rejects, entry, job_meta)
            except BaseException:
                self.abort()
                raise
            self._end()
            return entry
        write_parts(self.out_dir, self.stem, rows, self.rejects, entry, job_meta)
        return entry

    def _end(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = self._writer = None

    def abort(self) -> None:
        """Drop the unfinished shard (removes ``NAME.tar.tmp``)."""
        if self._tar is not None:
            try:
                self._tar.close()
                self._file.close()
            except Exception:
                pass
            self._tar = self._file = None
        if self._writer is not None:
            try:
                self._writer.unlink(self.tmp)
            finally:
                self._end()

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
