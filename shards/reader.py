"""Random access to cached samples: the index as numpy arrays, each shard mmapped once.

No tar header and no ``.npy`` header is parsed at read time, and nothing is ever unpickled: the
index records where each array's raw bytes sit, and :class:`ShardReader` returns ``np.frombuffer``
views of the memory-mapped tar (zero copy; the collate step does the one copy into batch tensors).
Both the ``shards`` CLI (per sample, :meth:`ShardReader.get`) and :mod:`loaders` (per batch,
:meth:`ShardReader.views`) read through this module.
"""
from __future__ import annotations

import json
import mmap
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import ShardCorrupt, UnsafeMember
from .index import read_index
from .schema import JSON_MEMBER, PICKLE_EXTENSIONS

# A member name is what follows the key's first dot: "codes.npy", "pyd", "x.pkl"; match both forms.
_UNSAFE_RE = "(^|\\.)(" + "|".join(re.escape(e.lstrip(".")) for e in PICKLE_EXTENSIONS) + ")$"


def refuse_unsafe(table: pa.Table, where: str | Path) -> None:
    """Raise :class:`UnsafeMember` (naming shard and key) if ``table`` lists a member that would
    need unpickling (an extension in :data:`shards.schema.PICKLE_EXTENSIONS`)."""
    members = table.column("members").combine_chunks()
    names = members.flatten().field("name")
    bad = pc.match_substring_regex(pc.utf8_lower(names), _UNSAFE_RE).to_numpy(zero_copy_only=False)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        row = int(pc.list_parent_indices(members).to_numpy()[j])
        key, shard = table.column("key")[row].as_py(), table.column("shard")[row].as_py()
        raise UnsafeMember(
            f"{Path(where) / shard}: sample {key!r} has member {key}.{names[j].as_py()} that would need "
            f"unpickling ({int(bad.sum())} such member(s) in the index); shardcache never unpickles "
            "shard data. Remove the member from the shard and rebuild the index (`shards reindex`).")


@dataclass
class FieldArrays:
    """One tensor member (e.g. ``codes.npy``) of every row, as numpy arrays of length ``n`` rows.

    ``off`` int64 byte offset (-1 where the row has no such member); ``shape`` int64 ``(n, ndim)``
    (zeros where absent); ``count`` int64 elements; ``present`` bool; ``code`` int8 index into
    ``dtypes`` (the distinct numpy dtypes the member is stored with).
    """
    off: np.ndarray
    shape: np.ndarray
    count: np.ndarray
    present: np.ndarray
    code: np.ndarray
    dtypes: list


class ShardReader:
    """Read samples of a cache by row number of its ``index.parquet``.

    Args:
        cache_dir: the cache directory (holds ``index.parquet`` and the shard tars).
        index: an already loaded (possibly filtered) index table; default: read it from
            ``cache_dir``.
        shard_names: number shards by position in this list (it must hold every shard of
            ``index``; shards without rows are never opened); default: sorted shard names.

    Attributes: ``index`` (the table), ``keys`` (list of str, built on first use), ``key_array``
    (Arrow strings), ``shard_names`` (sorted), ``shard_of`` int32 ``(n,)`` shard number per row.

    ``get(i)`` returns ``{"__key__": str, "json": dict, "codes": int16 (n_codebooks, frames),
    "audio": int16 (num_samples,), "text_ids": int32 (n_tokens,), "latents": float16 (C,T,H,W)}``
    (``latents`` only for image samples; ``latents_logvar`` float16 (C,T,H,W) too where the cache
    stores the posterior) as read-only numpy views. ``views(field, rows)`` gives the same arrays
    for many rows of one field (vectorised; see :meth:`field`).

    Raises :class:`UnsafeMember` at construction if the index lists a member that would need
    unpickling; :class:`ShardCorrupt` when a shard is missing or a member lies outside its shard
    file or disagrees with its indexed shape (at :meth:`get`, or up front with
    :meth:`check_files` / :meth:`field`). Maps are reopened lazily after pickling (DataLoader
    workers).
    """

    def __init__(self, cache_dir: str | Path, index: pa.Table | None = None, *,
                 shard_names: list[str] | None = None):
        self.cache_dir = Path(cache_dir)
        self.index = read_index(self.cache_dir) if index is None else index
        refuse_unsafe(self.index, self.cache_dir)
        self.n = self.index.num_rows
        self.key_array = self.index.column("key").combine_chunks()
        shards = self.index.column("shard")
        self.shard_names: list[str] = list(shard_names) if shard_names is not None \
            else sorted(pc.unique(shards).to_pylist())
        self.shard_of = pc.index_in(shards, value_set=pa.array(self.shard_names, pa.string())) \
            .to_numpy(zero_copy_only=False).astype(np.int32)
        self._fields: dict[str, FieldArrays] = {}
        self._keys: list[str] | None = None
        self._rows: list | None = None  # per-sample member lists for get(), built on first use
        self._maps: list[mmap.mmap | None] = [None] * len(self.shard_names)

    def __len__(self) -> int:
        return self.n

    @property
    def keys(self) -> list[str]:
        """Sample keys in index order (a Python list, built on first use)."""
        if self._keys is None:
            self._keys = self.key_array.to_pylist()
        return self._keys

    def _where(self, row: int) -> str:
        return f"{self.shard_names[self.shard_of[row]]}: sample {self.key_array[row].as_py()!r}"

    # -- index -> arrays ---------------------------------------------------------------------
    def drop_index(self) -> None:
        """Free the Arrow index (and keep it out of pickles sent to DataLoader workers) once every
        field that :meth:`views` will read has been built; :meth:`get` and new fields then raise
        ``RuntimeError``."""
        self.index = self._rows = None

    def _members(self) -> pa.ListArray:
        if self.index is None:
            raise RuntimeError(f"{self.cache_dir}: ShardReader.drop_index() was called; only the fields "
                               f"built before ({sorted(self._fields)}) can be read")
        return self.index.column("members")

    def _flat(self):
        members = self._members().combine_chunks()
        return members.flatten(), pc.list_parent_indices(members).to_numpy()

    def check_files(self) -> None:
        """Raise :class:`ShardCorrupt` if a shard is missing or shorter than its indexed members."""
        flat, parent = self._flat()
        end = np.zeros(self.n, dtype=np.int64)  # furthest byte any member of a row needs
        np.maximum.at(end, parent, flat.field("offset").to_numpy() + flat.field("size").to_numpy())
        need = np.zeros(len(self.shard_names), dtype=np.int64)
        np.maximum.at(need, self.shard_of, end)
        for i, name in enumerate(self.shard_names):
            if need[i] == 0:
                continue  # no row of this shard kept: never opened
            path = self.cache_dir / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise ShardCorrupt(f"{path}: listed in the index but missing; run `shards verify`") from None
            if size < need[i]:
                raise ShardCorrupt(f"{path}: {size} bytes but the index needs {need[i]} (truncated shard?); "
                                   "run `shards verify` and re-run precompute for it")

    def field(self, field: str, ndim: int | None = None) -> FieldArrays:
        """Per-row arrays of member ``field + ".npy"`` (built once). Raises :class:`ShardCorrupt` if
        a row's shape has not ``ndim`` dims (default: that of the first row) or its size in bytes
        is not ``prod(shape) * itemsize``."""
        fa = self._fields.get(field)
        if fa is not None:
            return fa
        member = field + ".npy"
        flat, parent = self._flat()
        sel = np.flatnonzero(pc.equal(flat.field("name"), member).to_numpy(zero_copy_only=False))
        rows = parent[sel]
        present = np.zeros(self.n, dtype=bool)
        present[rows] = True
        shape_lists = flat.field("shape").take(pa.array(sel))
        lens = pc.list_value_length(shape_lists).to_numpy(zero_copy_only=False)
        if ndim is None:
            ndim = int(lens[0]) if len(sel) else 0
        if len(sel) and (lens != ndim).any():
            bad = int(rows[np.flatnonzero(lens != ndim)[0]])
            raise ShardCorrupt(f"{self.cache_dir / self._where(bad)} member {member} has "
                               f"{lens[lens != ndim][0]} dims, expected {ndim}; re-run precompute")
        off = np.full(self.n, -1, dtype=np.int64)
        off[rows] = flat.field("offset").to_numpy()[sel]
        size = np.zeros(self.n, dtype=np.int64)
        size[rows] = flat.field("size").to_numpy()[sel]
        shape = np.zeros((self.n, ndim), dtype=np.int64)
        if len(sel):
            shape[rows] = shape_lists.flatten().to_numpy().reshape(len(sel), ndim)
        dstr = flat.field("dtype").take(pa.array(sel))
        uniq = pc.unique(dstr)
        dtypes = [np.dtype(d) for d in uniq.to_pylist()]
        code = np.zeros(self.n, dtype=np.int8)
        if len(uniq) > 1:
            code[rows] = pc.index_in(dstr, value_set=uniq).to_numpy(zero_copy_only=False)
        count = np.prod(shape, axis=1)
        itemsize = np.array([d.itemsize for d in dtypes] or [1])[code]
        wrong = present & (count * itemsize != size)
        if wrong.any():
            bad = int(np.flatnonzero(wrong)[0])
            raise ShardCorrupt(f"{self.cache_dir / self._where(bad)} member {member}: size {size[bad]} "
                               f"bytes does not match shape {shape[bad].tolist()}; run `shards verify`")
        fa = self._fields[field] = FieldArrays(off, shape, count, present, code, dtypes)
        return fa

    # -- reading ------------------------------------------------------------------------------
    def map(self, shard: int) -> mmap.mmap:
        """The read-only mmap of shard number ``shard`` (opened on first use, in each process)."""
        mm = self._maps[shard]
        if mm is None:
            path = self.cache_dir / self.shard_names[shard]
            try:
                with open(path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:
                raise ShardCorrupt(f"{path}: listed in the index but missing; run `shards verify`") from None
            self._maps[shard] = mm
        return mm

    def views(self, field: str, rows: np.ndarray) -> list[np.ndarray | None]:
        """Read-only zero-copy views of ``field`` (e.g. ``"codes"``) for index ``rows``; None where
        the row has no such member. Bounds are not checked here: call :meth:`check_files` first."""
        fa = self._fields.get(field) or self.field(field)
        rows = np.asarray(rows)
        offs, counts, shards, codes = (fa.off[rows].tolist(), fa.count[rows].tolist(),
                                       self.shard_of[rows].tolist(), fa.code[rows].tolist())
        shapes, dtypes = fa.shape[rows].tolist(), fa.dtypes
        out: list[np.ndarray | None] = []
        maps, mp = self._maps, self.map
        for o, c, s, d, shp in zip(offs, counts, shards, codes, shapes):
            if o < 0:
                out.append(None)
                continue
            mm = maps[s] or mp(s)
            out.append(np.frombuffer(mm, dtype=dtypes[d], count=c, offset=o).reshape(shp))
        return out

    def get(self, i: int) -> dict[str, Any]:
        """Sample at index row ``i`` as numpy views (see the class docstring)."""
        if self._rows is None:
            self._rows = self._members().to_pylist()
        mm = self.map(int(self.shard_of[i]))
        out: dict[str, Any] = {"__key__": self.keys[i]}
        for m in self._rows[i] or []:
            name, off, size = m["name"], int(m["offset"]), int(m["size"])
            if off + size > len(mm):
                raise ShardCorrupt(f"{self._where(i)} member {name} lies past the end of the file "
                                   "(truncated shard?)")
            if name == JSON_MEMBER:
                out["json"] = json.loads(mm[off:off + size])
            elif m["dtype"] not in ("json", "bytes"):
                dt, shape = np.dtype(m["dtype"]), tuple(m["shape"])
                if int(np.prod(shape)) * dt.itemsize != size:
                    raise ShardCorrupt(f"{self._where(i)} member {name}: index says shape {shape} {dt} "
                                       f"but {size} bytes")
                arr = np.frombuffer(mm, dtype=dt, count=size // dt.itemsize, offset=off)
                out[name[:-4] if name.endswith(".npy") else name] = arr.reshape(shape)
            else:
                out[name] = bytes(mm[off:off + size])
        return out

    def close(self) -> None:
        """Close every memory map (views returned earlier must not be used afterwards)."""
        for i, mm in enumerate(self._maps):
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view is still alive; the map closes when it is garbage collected
                self._maps[i] = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_maps"] = [None] * len(self.shard_names)  # reopened lazily in each DataLoader worker
        state["_rows"] = state["_keys"] = None  # rebuilt on first use
        return state
