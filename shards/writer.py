"""Atomic shard writer: one WebDataset tar plus its index/rejects parts.

A shard is written to ``NAME.tar.tmp`` with webdataset's :class:`TarWriter` (fixed mtime, so a
rerun of the same chunk gives byte-identical tars), fsynced, scanned for its index rows, renamed
to ``NAME.tar``; then the chunk's rejects part and index part are written (index part last: it
marks the chunk done). A process killed at any moment leaves either no trace of the chunk, a
``.tmp`` file that readers never open, or a finished tar without an index part that the next run
rewrites.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from .index import fsync_dir, write_parts
from .scan import scan_shard
from .schema import JSON_MEMBER, TENSOR_DTYPES, safe_key


def npy_bytes(array: np.ndarray) -> bytes:
    """Serialise an array as ``.npy`` bytes (C order, never pickled)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


class ShardWriter:
    """Write one shard and its index part atomically.

    Args:
        out_dir: cache directory.
        name: shard file name, e.g. ``shard_name(rank, n)``.

    Use ``add(key, fields)`` for kept samples and ``reject(...)`` for rejected rows, then
    ``commit()``; a ``with`` block aborts (removes the ``.tmp``) on an exception. ``fields`` maps
    member names to values: ``"json"`` -> a JSON-able dict; ``"codes.npy"``, ``"audio.npy"``,
    ``"latents.npy"``, ``"latents_logvar.npy"``, ``"text_ids.npy"`` -> arrays with the dtypes of
    :data:`shards.schema.TENSOR_DTYPES` (``ValueError`` otherwise).
    """

    def __init__(self, out_dir: str | Path, name: str):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.stem = name[:-4] if name.endswith(".tar") else name
        self.path = self.out_dir / name
        self.tmp = self.out_dir / (name + ".tmp")
        self._file = None
        self._tar = None
        self.keys: list[str] = []
        self.rejects: list[dict] = []

    def _open(self) -> None:
        import webdataset as wds  # imported on first write: it pulls in torch, slow for the CLI
        self._file = open(self.tmp, "wb")
        self._tar = wds.TarWriter(self._file, encoder=False, mtime=0.0)

    def add(self, key: str, fields: dict[str, Any]) -> None:
        """Append one sample. Raises ``ValueError`` for an unsafe key, unknown member or wrong dtype."""
        if key != safe_key(key):
            raise ValueError(f"key {key!r} contains '.', '/' or whitespace; use shards.schema.safe_key")
        obj: dict[str, Any] = {"__key__": key}
        for name, value in fields.items():
            if name == JSON_MEMBER:
                obj[name] = json.dumps(value, sort_keys=True, ensure_ascii=False).encode()
            elif name in TENSOR_DTYPES:
                arr = np.asarray(value)
                if arr.dtype != np.dtype(TENSOR_DTYPES[name]):
                    raise ValueError(f"{key}.{name}: dtype {arr.dtype}, expected {TENSOR_DTYPES[name]}")
                obj[name] = npy_bytes(arr)
            else:
                raise ValueError(f"{key}: unknown member {name!r}; known: json, {', '.join(TENSOR_DTYPES)}")
        if self._tar is None:
            self._open()
        self._tar.write(obj)
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
            rows, sha, size = scan_shard(self.tmp, shard_name=self.name)
            os.replace(self.tmp, self.path)
            fsync_dir(self.out_dir)
            entry = dict(path=self.name, samples=len(rows), bytes=size, sha256=sha)
        write_parts(self.out_dir, self.stem, rows, self.rejects, entry, job_meta)
        return entry

    def abort(self) -> None:
        """Drop the unfinished shard (removes ``NAME.tar.tmp``)."""
        if self._tar is not None:
            try:
                self._tar.close()
                self._file.close()
            except Exception:
                pass
            self._tar = self._file = None
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
