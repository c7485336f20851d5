"""The index as bytes: ``index.parquet`` read once into flat arrays, memory-mapped by every reader.

A loader over a cache of 10 million samples must not hold 10 million Python objects, nor decode the
nested ``members`` column of ``index.parquet`` in every rank and every DataLoader worker.
:func:`open_columns` reads the index once, row group by row group (bounded memory), into one file per
array in a local folder (:func:`store_dir`, keyed by the sha256 of ``index.parquet``: the one the
integrity root vouches for), and memory-maps them. Every process that opens the same index on the node
(ranks, DataLoader workers, the validation loader, a restarted job) maps the same pages: nothing is
copied per process, and a process touches only the rows it reads. Per sample the store holds (bytes):

=================  ==========================================================================================
``keys``           the key's UTF-8 bytes and an int64 offset (Arrow's large-string layout)
``shard_of``       int32: the sample's shard, numbered in sorted name order (:attr:`IndexColumns.shards`)
``n_frames``...    int32 ``n_frames``, int32 ``sample_rate``, bool ``has_image`` (what batching and
                   collation read per row)
per ``NAME.npy``   int64 offset, int64 ``(ndim,)`` shape, uint64 XXH3-64, bool present; int32 file (+1) of a
                   sidecar member, int8 dtype code where a member is stored with several dtypes
=================  ==========================================================================================

What the index says that a reader must refuse is found while it is read, once, and kept with the
arrays (:attr:`IndexColumns.problems`, :meth:`IndexColumns.field_problem`): a member that would need
unpickling, bytes of a shard that no index entry locates (a key held twice), a member whose rank,
byte size or checksum disagrees with its shape, a shard name that is not a plain file name. So the
checks cost one vectorised pass over the index (Arrow compute on each row group's columns; a member
name becomes a Python string once per distinct name, not once per member) and nothing on later opens.

Where the folder cannot be written, the store is built in a temporary folder removed when the process
ends. The store is derived data: deleting :func:`store_root` at any time is safe (it is built again);
a store no process opened for :data:`UNUSED_DAYS` days is deleted when another one is built.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .checksum import COLUMN as CHECKSUM
from .errors import ShardCorrupt
from .schema import PICKLE_EXTENSIONS, WHOLE_MEMBER_DTYPES

#: the layout of the store's files; a store of another version is built again beside it
STORE_VERSION = 1
#: environment variable of the folder the stores live in (default ``~/.cache/shardcache/index``)
STORE_ENV = "SHARDCACHE_INDEX_CACHE"
#: index rows decoded at once while a store is built (the memory bound of the build)
BATCH_ROWS = 1 << 16
#: the per-sample scalar columns a store keeps: name -> numpy dtype
SCALARS = {"n_frames": np.int32, "sample_rate": np.int32, "has_image": np.bool_}
#: the most bytes between two members a sample's index entries locate: one member header, with a pax
#: extended header for a long or non-ASCII name (header 512 + records <= 512 + header 512)
MAX_HEADER = 1536
#: more bytes allowed before a whole ``.npy`` member (formats 1-2: its entry locates the payload after
#: the ``.npy`` header)
NPY_SLACK = 4096
#: messages about bytes no entry locates that a store keeps (the first ones, in index order)
MAX_HIDDEN = 20
#: a store no process opened for this long is deleted when another one is built beside it
UNUSED_DAYS = 30
# A member name is what follows the key's first dot: "codes.npy", "pyd", "x.pkl"; match both forms.
UNSAFE_RE = "(^|\\.)(" + "|".join(re.escape(e.lstrip(".")) for e in PICKLE_EXTENSIONS) + ")$"


def store_root() -> Path:
    """``$SHARDCACHE_INDEX_CACHE`` or ``~/.cache/shardcache/index``."""
    return Path(os.environ.get(STORE_ENV) or Path.home() / ".cache" / "shardcache" / "index")


def store_dir(index_sha256: str, root: Path | None = None) -> Path:
    """The store of an ``index.parquet`` whose sha256 is ``index_sha256``."""
    return (root or store_root()) / f"v{STORE_VERSION}-{index_sha256[:32]}"


def _col(struct: pa.StructArray, name: str, type_: pa.DataType) -> pa.Array:
    """Field ``name`` of the members' structs, all null when an older index has no such field."""
    if struct.type.get_field_index(name) < 0:
        return pa.nulls(len(struct), type_)
    return struct.field(name)


def _ints(a: pa.Array, fill: int, dtype) -> np.ndarray:
    """``a`` as a numpy array of ``dtype``, nulls as ``fill``."""
    if a.null_count:
        a = pc.fill_null(a, fill)
    return a.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _codes(a: pa.Array) -> tuple[np.ndarray, list]:
    """``(int32 code per value, -1 for null; the distinct values as Python objects)`` of ``a`` (a
    dictionary array as read, or strings encoded here)."""
    enc = a if pa.types.is_dictionary(a.type) else pc.dictionary_encode(a)
    return _ints(enc.indices, -1, np.int32), enc.dictionary.to_pylist()


@dataclass
class FieldColumns:
    """One tensor member (``NAME.npy``) of every row of an index, as arrays over the store's rows.

    ``off`` int64 byte offset of the array payload in its file; ``shape`` int64 ``(n, ndim)`` (zeros
    where absent or of another rank); ``present`` bool; ``xxh3`` uint64 checksum; ``side`` int32: 0 for a
    member of the row's own shard, else 1 + its file number (a sidecar tar; None when no row has one);
    ``code`` int8 index into ``dtypes`` (None when every row has the same dtype); ``dtypes`` the distinct
    numpy dtypes. Arrays are read-only (memory-mapped).
    """

    name: str
    ndim: int
    off: np.ndarray
    shape: np.ndarray
    present: np.ndarray
    xxh3: np.ndarray
    side: np.ndarray | None
    code: np.ndarray | None
    dtypes: list


class IndexColumns:
    """The arrays of one index (see the module docstring). Build or open one with :func:`open_columns`.

    Attributes: ``n`` rows; ``shards`` (main shard names, sorted: ``shard_of`` numbers them) and
    ``files`` (``shards``, then the sidecar tars the index names, sorted); ``shard_of`` int32 ``(n,)``;
    ``n_frames``, ``sample_rate`` int32 ``(n,)``; ``has_image`` bool ``(n,)``; ``names`` (every member
    name of the index); ``need`` int64 per file (the furthest byte an entry locates in it); ``problems``
    (whole-index refusals as ``(kind, message)``: ``unpickle`` a member that would need unpickling,
    ``hidden`` bytes of a shard no entry locates, ``no_key`` a row without a key);
    ``path`` (the store's folder). Picklable: a copy sent to a DataLoader worker maps the same files.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        meta = json.loads((self.path / "meta.json").read_text())
        self.meta = meta
        self.n: int = int(meta["n"])
        self.shards: list[str] = list(meta["shards"])
        self.files: list[str] = list(meta["files"])
        self.names: list[str] = list(meta["names"])
        self.need = np.asarray(meta["need"], dtype=np.int64)
        self.problems: list[tuple[str, str]] = [tuple(p) for p in meta["problems"]]
        self._fields: dict[str, FieldColumns] = {}
        self.shard_of = self._load("shard_of")
        for name in SCALARS:
            setattr(self, name, self._load(name))
        self.key_offsets = self._load("keys.offsets")
        size = int(self.key_offsets[-1]) if self.n else 0
        self.key_data = (np.memmap(self.path / "keys.data", dtype=np.uint8, mode="r") if size
                         else np.zeros(0, np.uint8))
        self._key_array: pa.Array | None = None

    def _load(self, name: str) -> np.ndarray:
        return np.load(self.path / f"{name}.npy", mmap_mode="r", allow_pickle=False)

    def __getstate__(self):
        return {"path": str(self.path)}

    def __setstate__(self, state):
        self.__init__(Path(state["path"]))

    def __len__(self) -> int:
        return self.n

    @property
    def key_array(self) -> pa.Array:
        """The keys as an Arrow ``large_string`` array over the mapped bytes (no copy)."""
        if self._key_array is None:
            self._key_array = pa.Array.from_buffers(
                pa.large_string(), self.n, [None, pa.py_buffer(self.key_offsets), pa.py_buffer(self.key_data)])
        return self._key_array

    def key(self, row: int) -> str:
        """The key of store row ``row``."""
        lo, hi = int(self.key_offsets[row]), int(self.key_offsets[row + 1])
        return bytes(self.key_data[lo:hi]).decode("utf-8")

    def keys_at(self, rows) -> list[str]:
        """The keys of store ``rows`` (int64 array), in order."""
        rows = np.asarray(rows, dtype=np.int64)
        lo, hi = self.key_offsets[rows].tolist(), self.key_offsets[rows + 1].tolist()
        buf = memoryview(self.key_data)
        return [str(buf[x:y], "utf-8") for x, y in zip(lo, hi)]

    def has(self, name: str) -> bool:
        """Whether some row has member ``NAME.npy``."""
        return name in self.meta["fields"]

    def field(self, name: str) -> FieldColumns:
        """The arrays of member ``name + ".npy"`` (``KeyError`` when no row has it)."""
        fc = self._fields.get(name)
        if fc is None:
            info = self.meta["fields"][name]
            p = f"field.{name}"
            fc = self._fields[name] = FieldColumns(
                name, int(info["ndim"]), self._load(f"{p}.off"), self._load(f"{p}.shape"),
                self._load(f"{p}.present"), self._load(f"{p}.xxh3"),
                self._load(f"{p}.side") if info["sidecar"] else None,
                self._load(f"{p}.code") if len(info["dtypes"]) > 1 else None,
                [np.dtype(d) if _itemsize(d) else None for d in info["dtypes"]])
        return fc

    def field_problem(self, name: str, ndim: int | None = None) -> str | None:
        """Why member ``name + ".npy"`` cannot be read as arrays of rank ``ndim`` (default: the rank
        of its first row): a row of another rank, a byte size other than its shape's, a missing
        checksum; the message names the first such row's shard and key. None when it can."""
        info = self.meta["fields"][name]
        member = f"{name}.npy"
        if info["dtype_bad"] is not None:
            row, d = info["dtype_bad"]
            return f"{self.where(row)} member {member}: unknown dtype {d!r}; run `shardcache shards verify`"
        want = int(info["ndim"]) if ndim is None else int(ndim)
        other = {int(k): r for k, r in info["dims"].items() if int(k) != want}
        if other:
            k, row = min(other.items(), key=lambda kv: kv[1])
            return f"{self.where(row)} member {member} has {k} dims, expected {want}; re-run precompute"
        if info["size_bad"] is not None:
            row = info["size_bad"]
            return (f"{self.where(row)} member {member}: size {info['size_bad_bytes']} bytes does not match shape "
                    f"{info['size_bad_shape']}; run `shardcache shards verify`")
        if info["no_checksum"] is not None:
            return (f"{self.where(info['no_checksum'])} member {member} has no checksum in the index; run "
                    "`shardcache shards verify --deep`, then `shardcache shards reindex`")
        return None

    def where(self, row: int) -> str:
        """``SHARD: sample 'KEY'`` of store row ``row``."""
        return f"{self.shards[int(self.shard_of[row])]}: sample {self.key(row)!r}"


# ------------------------------------------------------------------------------------------- build

class _Array:
    """One ``.npy`` file of ``shape`` written row block by row block with ``pwrite`` (never mapped while
    written: the builder's memory holds one block). Rows never written read as zeros (a sparse file)."""

    def __init__(self, path: Path, dtype, shape: tuple[int, ...]):
        self.dtype, self.shape = np.dtype(dtype), shape
        self.row_bytes = self.dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        with open(path, "wb") as f:
            np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                     "fortran_order": False, "shape": shape})
            self.start = f.tell()
            f.truncate(self.start + self.row_bytes * shape[0])
        self.fd = os.open(path, os.O_WRONLY)

    def write(self, row: int, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, dtype=self.dtype)
        os.pwrite(self.fd, memoryview(data).cast("B"), self.start + row * self.row_bytes)

    def close(self) -> None:
        os.close(self.fd)


class _FieldWriter:
    """The arrays of one member name, filled batch by batch."""

    def __init__(self, folder: Path, name: str, n: int, ndim: int):
        p = folder / f"field.{name}"
        self.name, self.ndim, self.n, self.folder = name, ndim, n, folder
        self.off = _Array(Path(f"{p}.off.npy"), np.int64, (n,))
        self.shape = _Array(Path(f"{p}.shape.npy"), np.int64, (n, ndim))
        self.present = _Array(Path(f"{p}.present.npy"), np.bool_, (n,))
        self.xxh3 = _Array(Path(f"{p}.xxh3.npy"), np.uint64, (n,))
        self.side: _Array | None = None
        self.dtypes: list[str] = []
        self.code: _Array | None = None  # made when a second dtype shows: the rows before read as 0, the first
        self.dims: dict[int, int] = {}          # rank -> first row holding it
        self.size_bad: tuple[int, int, list] | None = None
        self.no_checksum: int | None = None
        self.dtype_bad: tuple[int, str] | None = None

    def add(self, start: int, rows: int, sel_rows: np.ndarray, off: np.ndarray, size: np.ndarray,
            shape_starts: np.ndarray, lens: np.ndarray, shape_values: np.ndarray, dtype_codes: np.ndarray,
            dtype_names: list, xxh3: np.ndarray, xxh3_null: np.ndarray | None, side: np.ndarray | None) -> None:
        """Rows ``sel_rows`` (positions in the batch that starts at store row ``start``) hold the member; its
        shape is ``shape_values[shape_starts[i]:shape_starts[i] + lens[i]]``."""
        block = lambda dt, fill=0, cols=None: np.full((rows,) if cols is None else (rows, cols), fill, dt)  # noqa: E731
        o, pres, h = block(np.int64), block(np.bool_), block(np.uint64)
        o[sel_rows], pres[sel_rows] = off, True
        for k in ([int(lens[0])] if len(lens) and lens.min() == lens.max() else np.unique(lens).tolist()):
            self.dims.setdefault(int(k), start + int(sel_rows[np.argmax(lens == k)]))
        sh = block(np.int64, 0, self.ndim)
        good = lens == self.ndim
        every = bool(good.all())  # (rows of another rank: zeros, and the field is refused: field_problem)
        good_rows = sel_rows if every else sel_rows[good]
        vals = shape_values[(shape_starts if every else shape_starts[good])[:, None] + np.arange(self.ndim)]
        sh[good_rows] = vals
        # dtypes: the batch's codes (of the row group's dictionary; -1: none) -> this field's codes
        names = list(dtype_names) + [""]
        local = np.zeros(len(names), dtype=np.int8)
        for j in (np.flatnonzero(np.bincount(dtype_codes + 1, minlength=len(names) + 1)) - 1).tolist():
            local[j] = self._dtype_code(names[j])
            if self.dtype_bad is None and _itemsize(names[j]) is None:
                self.dtype_bad = (start + int(sel_rows[int(np.argmax(dtype_codes == j))]), str(names[j]))
        codes = local[dtype_codes]
        if self.size_bad is None:  # (the first row whose bytes are not its shape's: rows of this rank only)
            items = np.asarray([_itemsize(d) or 0 for d in self.dtypes], dtype=np.int64)[codes if every else codes[good]]
            wrong = np.prod(vals, axis=1) * items != (size if every else size[good])
            if wrong.any():
                j = int(np.flatnonzero(wrong)[0])
                j = j if every else int(np.flatnonzero(good)[j])
                self.size_bad = (start + int(sel_rows[j]), int(size[j]), sh[sel_rows[j]].tolist())
        if xxh3_null is not None and xxh3_null.any() and self.no_checksum is None:
            self.no_checksum = start + int(sel_rows[int(np.flatnonzero(xxh3_null)[0])])
        h[sel_rows] = xxh3
        if len(self.dtypes) > 1:
            if self.code is None:
                self.code = _Array(self.folder / f"field.{self.name}.code.npy", np.int8, (self.n,))
            c = block(np.int8)
            c[sel_rows] = codes
            self.code.write(start, c)
        if side is not None and (side > 0).any():
            if self.side is None:
                self.side = _Array(self.folder / f"field.{self.name}.side.npy", np.int32, (self.n,))
            s = block(np.int32)
            s[sel_rows] = side
            self.side.write(start, s)
        self.off.write(start, o)
        self.present.write(start, pres)
        self.xxh3.write(start, h)
        self.shape.write(start, sh)

    def _dtype_code(self, d: Any) -> int:
        d = str(d)
        if d not in self.dtypes:
            self.dtypes.append(d)
        return self.dtypes.index(d)

    def finish(self) -> dict:
        for a in (self.off, self.shape, self.present, self.xxh3, self.side, self.code):
            if a is not None:
                a.close()
        return {"ndim": self.ndim, "dtypes": self.dtypes, "sidecar": self.side is not None,
                "dims": {str(k): r for k, r in self.dims.items()},
                "size_bad": None if self.size_bad is None else self.size_bad[0],
                "size_bad_bytes": None if self.size_bad is None else self.size_bad[1],
                "size_bad_shape": None if self.size_bad is None else self.size_bad[2],
                "no_checksum": self.no_checksum,
                "dtype_bad": None if self.dtype_bad is None else list(self.dtype_bad)}


class _Builder:
    """Reads an ``index.parquet`` batch by batch into a store folder (see :func:`open_columns`)."""

    def __init__(self, index: Path, folder: Path):
        self.index, self.folder = index, folder
        # the member names, dtypes, files and shards as the dictionaries Parquet stores them: never one
        # Python (or Arrow) string per member (a third of the decoding time)
        self.pf = pq.ParquetFile(index, read_dictionary=["shard"] + [f"members.list.element.{f}" for f in
                                                                     ("name", "dtype", "file", "member")])
        self.n = int(self.pf.metadata.num_rows)
        self.shards: dict[str, int] = {}   # name -> number in first-seen order (renumbered at the end)
        self.sidecars: dict[str, int] = {}
        self.fields: dict[str, _FieldWriter] = {}
        self.names: set[str] = set()
        self.need: dict[tuple[str, int], int] = {}   # (kind, number) -> furthest byte
        self.unsafe: tuple[int, str, int] | None = None  # (row, member name, its shard) of the first
        self.unsafe_count = 0
        self.no_key: int | None = None
        self.portions: dict[int, list] = {}   # shard -> [(first offset, last end, first name, first row)]
        self.hidden: list[tuple[int, int, str]] = []  # (shard, row, message)
        self.shard_of = _Array(folder / "shard_of.npy", np.int32, (self.n,))
        self.scalars = {k: _Array(folder / f"{k}.npy", dt, (self.n,)) for k, dt in SCALARS.items()}
        self.key_offsets = _Array(folder / "keys.offsets.npy", np.int64, (self.n + 1,))
        self.key_file = open(folder / "keys.data", "wb")
        self.key_bytes = 0

    def run(self) -> None:
        cols = [c for c in ("key", "shard", "members", *SCALARS) if c in self.pf.schema_arrow.names]
        start = 0
        self.key_offsets.write(0, np.zeros(1, np.int64))
        for batch in _ahead(self.pf.iter_batches(batch_size=BATCH_ROWS, columns=cols)):
            self._batch(start, batch)
            start += batch.num_rows
        self._finish()

    def _batch(self, start: int, batch: pa.RecordBatch) -> None:
        rows = batch.num_rows
        # keys: their bytes, appended
        keys = batch.column("key")
        if keys.null_count:
            if self.no_key is None:
                self.no_key = start + int(np.flatnonzero(keys.is_null().to_numpy(zero_copy_only=False))[0])
            keys = pc.fill_null(keys, "")
        width = np.int64 if pa.types.is_large_string(keys.type) else np.int32
        offs = np.frombuffer(keys.buffers()[1], dtype=width)[keys.offset:keys.offset + rows + 1].astype(np.int64)
        data = keys.buffers()[2]
        lo, hi = int(offs[0]), int(offs[-1])
        if hi > lo:
            self.key_file.write(memoryview(data)[lo:hi])
        self.key_offsets.write(start + 1, offs[1:] - lo + self.key_bytes)
        self.key_bytes += hi - lo
        # shards: numbered in first-seen order here
        codes, names = _codes(batch.column("shard"))
        local = np.asarray([self.shards.setdefault(str(s), len(self.shards)) for s in names] + [-1], np.int32)
        shard = local[codes]
        self.shard_of.write(start, shard)
        for k in SCALARS:
            if k in batch.schema.names:
                self.scalars[k].write(start, _ints(batch.column(k), 0, SCALARS[k]))
        if "members" in batch.schema.names:
            self._members(start, rows, batch.column("members"), shard, batch)

    def _members(self, start: int, rows: int, members: pa.ListArray, shard: np.ndarray, batch) -> None:
        flat = members.flatten()
        if not len(flat):
            return
        lists = _ints(members.offsets, 0, np.int64)
        parent = np.repeat(np.arange(rows, dtype=np.int64), np.diff(lists))
        name_code, names = _codes(_col(flat, "name", pa.string()))
        self.names.update(n for n in names if n is not None)
        # members that would need unpickling: the regex over the distinct names only
        bad_names = [j for j, n in enumerate(names) if n is not None
                     and pc.match_substring_regex(pa.array([n.lower()]), UNSAFE_RE)[0].as_py()]
        if bad_names:
            hit = np.isin(name_code, bad_names)
            self.unsafe_count += int(hit.sum())
            if self.unsafe is None:
                j = int(np.flatnonzero(hit)[0])
                self.unsafe = (start + int(parent[j]), names[name_code[j]], int(shard[parent[j]]))
        offset = _ints(_col(flat, "offset", pa.int64()), -1, np.int64)
        size = _ints(_col(flat, "size", pa.int64()), 0, np.int64)
        file_col = _col(flat, "file", pa.string())
        member_col = _col(flat, "member", pa.string())
        file_code, file_names = _codes(file_col)
        side_num = np.asarray([self.sidecars.setdefault(str(f), len(self.sidecars)) for f in file_names] + [-1],
                              np.int64)[file_code]  # -1: the row's own shard
        # the furthest byte of every file
        ends = offset + size
        main = side_num < 0
        for kind, nums, e in (("s", shard[parent[main]], ends[main]), ("c", side_num[~main], ends[~main])):
            for u, x in _max_by(nums, e):
                if x > self.need.get((kind, u), -1):
                    self.need[(kind, u)] = x
        dtype_code, dtype_names = _codes(_col(flat, "dtype", pa.string()))
        dtype_names = ["" if d is None else d for d in dtype_names]
        # whole tar members of the row's own shard: the bytes between them (hidden members)
        whole = main & (_ints(member_col.is_null(), 1, np.bool_))
        if whole.any():
            self._hidden(start, np.flatnonzero(whole), parent, shard, offset, size, dtype_code, dtype_names,
                         name_code, names)
        # the tensor members, one name at a time, from the batch's columns as numpy arrays
        shape_col = _col(flat, "shape", pa.list_(pa.int64()))
        shape_at = _ints(shape_col.offsets, 0, np.int64)
        shape_at -= shape_at[0]  # (into the flattened values; a null shape: no values)
        shape_values = _ints(shape_col.flatten(), 0, np.int64)
        sums = _col(flat, CHECKSUM, pa.uint64())
        sums_np = _ints(sums, 0, np.uint64)
        sums_null = _ints(sums.is_null(), 0, np.bool_) if sums.null_count else None
        for j, name in enumerate(names):
            if name is None or not name.endswith(".npy"):
                continue
            sel = np.flatnonzero(name_code == j)
            field = name[:-4]
            starts, lens = shape_at[sel], shape_at[sel + 1] - shape_at[sel]
            w = self.fields.get(field)
            if w is None:
                w = self.fields[field] = _FieldWriter(self.folder, field, self.n, _ndim_of(field, int(lens[0])))
            side = side_num[sel]
            w.add(start, rows, parent[sel], offset[sel], size[sel], starts, lens, shape_values, dtype_code[sel],
                  dtype_names, sums_np[sel], None if sums_null is None else sums_null[sel],
                  np.where(side >= 0, side + 1, 0).astype(np.int32) if (side >= 0).any() else None)

    def _hidden(self, start, pos, parent, shard, offset, size, dtype_code, dtype_names, name_code, names) -> None:
        """Gaps between the whole members of each shard in this batch, and the batch's portion of each."""
        sh, off, end = shard[parent[pos]], offset[pos], -(-(offset[pos] + size[pos]) // 512) * 512
        npy = np.asarray([d not in WHOLE_MEMBER_DTYPES for d in dtype_names] + [True], bool)[dtype_code[pos]]
        slack = np.where(npy, NPY_SLACK, 0)
        if len(sh) > 1 and not ((sh[1:] > sh[:-1]) | ((sh[1:] == sh[:-1]) & (off[1:] >= off[:-1]))).all():
            order = np.lexsort((off, sh))  # (rows and members in tar order, as every writer writes them: no sort)
            sh, off, end, slack, p = sh[order], off[order], end[order], slack[order], pos[order]
        else:
            p = pos
        same = sh[1:] == sh[:-1]
        gap = off[1:] - end[:-1]
        for i in np.flatnonzero(same & (gap > MAX_HEADER + slack[1:]))[:max(0, MAX_HIDDEN - len(self.hidden))].tolist():
            q = int(p[i + 1])
            self.hidden.append((int(sh[i + 1]), start + int(parent[q]), f"{int(gap[i])} bytes the index does not "
                                f"locate before member {names[name_code[q]]!r}", ))
        firsts = np.flatnonzero(np.r_[True, ~same])
        lasts = np.r_[firsts[1:] - 1, len(sh) - 1]
        for a, b in zip(firsts.tolist(), lasts.tolist()):
            q = int(p[a])
            self.portions.setdefault(int(sh[a]), []).append(
                (int(off[a]), int(end[b]), int(slack[a]), names[name_code[q]], start + int(parent[q])))

    def _finish(self) -> None:
        # shards renumbered in sorted name order
        first_seen = list(self.shards)
        ranked = sorted(first_seen)
        remap = np.asarray([ranked.index(s) for s in first_seen] or [0], np.int32)
        self.shard_of.close()
        if len(first_seen) and not np.array_equal(remap, np.arange(len(first_seen))):
            arr = np.load(self.folder / "shard_of.npy", mmap_mode="r+")
            for lo in range(0, self.n, 1 << 22):
                arr[lo:lo + (1 << 22)] = remap[arr[lo:lo + (1 << 22)]]
            arr.flush()
            del arr
        sidecars = sorted(set(self.sidecars) - set(ranked))
        files = ranked + sidecars
        side_remap = np.asarray([files.index(s) for s in self.sidecars] or [0], np.int32)
        fields = {}
        for name, w in self.fields.items():
            fields[name] = w.finish()
            if w.side is not None:  # sidecar numbers (first seen) -> file numbers, kept + 1
                arr = np.load(self.folder / f"field.{name}.side.npy", mmap_mode="r+")
                for lo in range(0, self.n, 1 << 22):
                    part = arr[lo:lo + (1 << 22)]
                    arr[lo:lo + (1 << 22)] = np.where(part > 0, side_remap[np.maximum(part - 1, 0)] + 1, 0)
                arr.flush()
                del arr
        need = np.zeros(len(files), np.int64)
        for (kind, u), x in self.need.items():
            need[remap[u] if kind == "s" else side_remap[u]] = max(x, 0)
        for a in (*self.scalars.values(), self.key_offsets):
            a.close()
        self.key_file.close()
        meta = {"version": STORE_VERSION, "n": self.n, "shards": ranked, "files": files,
                "names": sorted(self.names), "need": need.tolist(), "fields": fields,
                "problems": self._problems(remap, ranked)}
        (self.folder / "meta.json").write_text(json.dumps(meta))

    def _problems(self, remap: np.ndarray, ranked: list[str]) -> list[tuple[str, str]]:
        out = []
        view = IndexKeys(self.folder, self.n)
        if self.no_key is not None:
            out.append(("no_key", f"{self.index}: row {self.no_key} has no key; rebuild the index with "
                                  "`shardcache shards reindex`"))
        if self.unsafe is not None:
            row, name, s = self.unsafe
            key = view.key(row)
            out.append(("unpickle", f"{self.index.parent / ranked[remap[s]]}: sample {key!r} has member "
                       f"{key}.{name} that would need unpickling ({self.unsafe_count} such member(s) in the index); "
                       "shardcache never unpickles shard data. Remove the member from the shard and rebuild the "
                       "index (`shardcache shards reindex`)."))
        out += [("hidden", m) for m in self._hidden_messages(view, remap, ranked)]
        return out

    def _hidden_messages(self, view, remap, ranked) -> list[str]:
        out: list[tuple[int, str]] = []
        exact: set[int] = set()
        for s, parts in self.portions.items():
            parts.sort()
            for a, b in zip(parts, parts[1:]):
                if b[0] < a[1]:  # two batches' members of one shard interleave: check that shard exactly
                    exact.add(s)
                    break
                gap = b[0] - a[1]
                if gap > MAX_HEADER + b[2]:
                    out.append((b[4], f"{ranked[remap[s]]}: {gap} bytes the index does not locate before member "
                                      f"{b[3]!r} of sample {view.key(b[4])!r} (a key held twice, or members added "
                                      "to the tar)"))
        out += [(row, f"{ranked[remap[s]]}: {msg} of sample {view.key(row)!r} (a key held twice, or members added "
                      "to the tar)") for s, row, msg in self.hidden if s not in exact]
        for s in sorted(exact):
            name = [k for k, v in self.shards.items() if v == s][0]
            t = pq.read_table(self.index, columns=["key", "shard", "members"], filters=[("shard", "==", name)])
            from .scan import unindexed_members
            out += [(-1, m) for m in unindexed_members(t)]
        out.sort(key=lambda x: x[0])
        return [m for _, m in out[:MAX_HIDDEN]]


def _ahead(batches, depth: int = 2):
    """``batches`` decoded by a thread of their own, ``depth`` ahead of the consumer (Parquet decodes
    without the GIL: the decoding of one batch overlaps the processing of the one before)."""
    import queue
    import threading
    q: queue.Queue = queue.Queue(depth)
    done, stop = object(), threading.Event()

    def put(x) -> None:
        while not stop.is_set():
            try:
                return q.put(x, timeout=0.1)
            except queue.Full:
                continue

    def run():
        try:
            for b in batches:
                if stop.is_set():
                    return
                put(b)
            put(done)
        except BaseException as e:  # noqa: BLE001 - raised in the consumer
            put(e)

    t = threading.Thread(target=run, daemon=True, name="index-decode")
    t.start()
    try:
        while (b := q.get()) is not done:
            if isinstance(b, BaseException):
                raise b
            yield b
    finally:  # (the consumer stopped early: the thread ends too)
        stop.set()
        t.join()


def _max_by(keys: np.ndarray, values: np.ndarray) -> list[tuple[int, int]]:
    """``[(key, max of its values)]`` of small non-negative int ``keys`` (runs of equal keys, as rows of one
    shard come, are reduced first)."""
    if not len(keys):
        return []
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    run_max, run_key = np.maximum.reduceat(values, starts), keys[starts]
    far = np.full(int(run_key.max()) + 1, np.iinfo(np.int64).min, np.int64)
    np.maximum.at(far, run_key, run_max)
    have = np.flatnonzero(far > np.iinfo(np.int64).min)
    return list(zip(have.tolist(), far[have].tolist()))


def _itemsize(d: Any) -> int | None:
    """Bytes per element of dtype name ``d``; None for a name numpy does not know (or an object dtype)."""
    try:
        dt = np.dtype(d) if d else None
    except (TypeError, ValueError):
        return None
    return None if dt is None or dt.hasobject else dt.itemsize


def _ndim_of(field: str, first: int) -> int:
    """The rank a store keeps a member's shapes in: its field's declared rank, else its first row's."""
    from . import fields as registry
    f = registry.lookup(field)
    return f.ndim if f is not None else first


class IndexKeys:
    """The keys of a store being finished (before :class:`IndexColumns` can open it)."""

    def __init__(self, folder: Path, n: int):
        self.offsets = np.load(folder / "keys.offsets.npy", mmap_mode="r")
        self.data = np.memmap(folder / "keys.data", dtype=np.uint8, mode="r") if n and self.offsets[-1] else None

    def key(self, row: int) -> str:
        lo, hi = int(self.offsets[row]), int(self.offsets[row + 1])
        return bytes(self.data[lo:hi]).decode("utf-8") if self.data is not None else ""


def build(index: Path, folder: Path) -> None:
    """Read ``index`` (an ``index.parquet``) into a new store ``folder`` (which must not exist)."""
    folder.mkdir(parents=True)
    b = _Builder(Path(index), folder)
    b.run()


_TEMP: list[tempfile.TemporaryDirectory] = []


def mapped(array: np.ndarray) -> tuple[np.ndarray, str]:
    """``array`` written to a file of this process's temporary folder (removed when the process ends) and
    memory-mapped back: ``(the read-only map, its path)``. What a reader keeps per row beyond the store
    (the rows a filter kept) so that DataLoader workers map it too instead of each receiving a copy."""
    if not _TEMP or not Path(_TEMP[-1].name).exists():
        _TEMP.append(tempfile.TemporaryDirectory(prefix="shardcache-rows-"))
    fd, path = tempfile.mkstemp(suffix=".npy", dir=_TEMP[-1].name)
    with os.fdopen(fd, "wb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
    return np.load(path, mmap_mode="r", allow_pickle=False), path


def open_columns(index: str | os.PathLike, index_sha256: str, root: Path | None = None) -> IndexColumns:
    """The store of ``index`` (an ``index.parquet`` whose content has sha256 ``index_sha256``, as the
    caller verified): opened when the store folder holds it, else built there first (one process of
    the node builds it, under a lock; the others wait and open it). Where the folder cannot be written
    the store is built in a temporary folder removed when this process ends.

    Raises ``FileNotFoundError`` without ``index``, :class:`shards.ShardCorrupt` for an index Arrow
    cannot read."""
    index = Path(index)
    final = store_dir(index_sha256, root)
    if (final / "meta.json").exists():
        _used(final)
        return IndexColumns(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(final.parent / f"{final.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return _temporary(index)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process of the node may be building it
        if not (final / "meta.json").exists():
            tmp = final.parent / f".{final.name}.{os.getpid()}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                _prune(final.parent)
                _build_checked(index, tmp)
                os.replace(tmp, final) if not final.exists() else shutil.rmtree(tmp)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                if not (final / "meta.json").exists():
                    return _temporary(index)
    finally:
        os.close(lock)
    return IndexColumns(final)


def _used(store: Path) -> None:
    """Mark ``store`` as used now (its ``meta.json``'s mtime: what :func:`_prune` reads)."""
    try:
        os.utime(store / "meta.json")
    except OSError:
        pass  # (a read-only store: never pruned by this process anyway)


def _prune(root: Path) -> None:
    """Delete the stores of ``root`` no process opened for :data:`UNUSED_DAYS` days (their caches were
    rewritten or deleted: an index that changes gets a store of its own)."""
    import time
    limit = time.time() - UNUSED_DAYS * 86400
    for d in root.glob(f"v{STORE_VERSION}-*"):
        try:
            if (d / "meta.json").stat().st_mtime < limit:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue


def _build_checked(index: Path, folder: Path) -> None:
    try:
        build(index, folder)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise ShardCorrupt(f"{index}: cannot read the index ({e}); `shardcache shards reindex {index.parent}` "
                           "rebuilds it") from e


def _temporary(index: Path) -> IndexColumns:
    tmp = tempfile.TemporaryDirectory(prefix="shardcache-index-")
    _TEMP.append(tmp)  # removed at exit (TemporaryDirectory's finalizer)
    _build_checked(index, Path(tmp.name) / "store")
    return IndexColumns(Path(tmp.name) / "store")


__all__ = ["IndexColumns", "FieldColumns", "open_columns", "build", "mapped", "store_root", "store_dir", "STORE_VERSION",
           "STORE_ENV", "UNSAFE_RE", "MAX_HEADER"]
