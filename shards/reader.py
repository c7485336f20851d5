"""Random access to cached samples: the index as numpy arrays, the shards mapped or read with pread.

No tar header and no ``.npy`` header is parsed at read time, and nothing is ever unpickled: the
index records where each array's raw bytes sit (and their XXH3-64, :mod:`shards.checksum`).
:class:`ShardReader` returns ``np.frombuffer`` views of the memory-mapped tar (:meth:`~ShardReader.get`
per sample, used by the ``shards`` CLI; :meth:`~ShardReader.views` per field), or copies a batch's
members straight into the caller's buffers with ``preadv`` (:meth:`~ShardReader.read_into`, what
:mod:`loaders` use: :mod:`shards.readinto`).

Offsets: an index member's ``offset``/``size`` locate the raw array payload AFTER the ``.npy``
header (see :mod:`shards.index`), so an array is
``np.frombuffer(buf[offset:offset + size], dtype).reshape(shape)`` -- never ``np.load``.

Safety: every shard name of the index goes through :func:`shards.index.safe_shard_path` at
construction (and again when the shard is opened), ``manifest.json``'s ``format_version`` through
:func:`shards.manifest.check_format_version`. Every member read is checked against its checksum
(``checksums=True``, the default). :meth:`~ShardReader.read_into` maps nothing: a shard truncated
or replaced under it is a :class:`ShardCorrupt` naming shard, key and member, never a SIGBUS
(:mod:`shards.files`). Through the maps, a shard that shrank since it was mapped raises
:class:`ShardCorrupt` (checked once per shard per :meth:`~ShardReader.views` call; a truncation
racing the copy of the returned views can still fault). Optional ``value_checks`` refuse
out-of-range codes and non-finite latents, optional ``verify_reads`` recomputes each sample's sha256.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from . import fields, schema  # noqa: F401
from .checksum import ALGORITHM, COLUMN as CHECKSUM, checksum
from .errors import ShardCorrupt, UnsafeMember
from .files import ShardFiles
from .kinds import Finite, InRange, ValueCheck
from .manifest import CacheManifest
from .manifest import check_format_version, read_manifest
from .index import (read_index,  # noqa: F401
                    safe_shard_path)
from .schema import JSON_MEMBER, WHOLE_MEMBER_DTYPES
from .storage import local_path

_NPY_MAGIC = b"\x93NUMPY"
_TAR_BLOCK = 512
_MAX_NPY_HEADER = 65536 + 2 * _TAR_BLOCK  # npy v1 header length is a uint16

def refuse_unsafe(table: pa.Table, where: str | Path) -> None:
    """Raise :class:`UnsafeMember` (naming shard and key) if ``table`` lists a member that would
    need unpickling (an extension in :data:`shards.schema.PICKLE_EXTENSIONS`). The pattern runs over
    the distinct member names only (:data:`shards.columns.UNSAFE_RE`)."""
    from .columns import UNSAFE_RE
    members = table.column("members").combine_chunks()
    names = pc.dictionary_encode(members.flatten().field("name"))
    bad_names = pc.match_substring_regex(pc.utf8_lower(names.dictionary), UNSAFE_RE).to_numpy(zero_copy_only=False)
    if not bad_names.any():
        return
    bad = np.isin(pc.fill_null(names.indices, -1).to_numpy(zero_copy_only=False), np.flatnonzero(bad_names))
    j = int(np.flatnonzero(bad)[0])
    row = int(pc.list_parent_indices(members).to_numpy()[j])
    key, shard = table.column("key")[row].as_py(), table.column("shard")[row].as_py()
    raise UnsafeMember(
        f"{Path(where) / shard}: sample {key!r} has member {key}.{names.dictionary[names.indices[j].as_py()].as_py()} "
        f"that would need unpickling ({int(bad.sum())} such member(s) in the index); shardcache never unpickles "
        "shard data. Remove the member from the shard and rebuild the index (`shardcache shards reindex`).")


def value_checks_of(man: CacheManifest) -> dict[str, ValueCheck]:
    """The value checks a cache's manifest implies, for ``ShardReader(value_checks=...)``: each
    declared field's kind says what to check (:meth:`shards.kinds.FieldKind.value_check`), with the
    sizes the manifest records: ``{field: ValueCheck}`` (:class:`shards.kinds.ValueCheck`: codes in
    ``[0, codebook_size)``, ids in ``[0, vocab_size)``, labels ids or -100, floats finite...).
    :meth:`shards.Cache.value_checks` is this for an opened cache."""
    checks: dict[str, ValueCheck] = {}
    for f in list(fields.BY_NAME.values()) + [fields.lookup(n) for n in man.fields]:
        if f is None:
            continue
        check = f.kind.value_check(f, man)
        if check is None:
            continue
        checks[f.name] = check
    return checks


def value_checks_from_manifest(manifest: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`value_checks_of` of a ``manifest.json`` read as a dict (a folder opened without
    :class:`shards.Cache`: ``shards verify`` of shard tars)."""
    return value_checks_of(CacheManifest.from_dict(manifest or {}))


def _normalise_checks(value_checks: dict[str, Any] | None) -> dict[str, ValueCheck]:
    """``{field: ValueCheck | (lo, hi) | "finite"}`` -> ``{field: ValueCheck}`` (the two shorthands
    are :class:`~shards.kinds.InRange` and :class:`~shards.kinds.Finite`)."""
    out: dict[str, ValueCheck] = {}
    for field, spec in (value_checks or {}).items():
        if not isinstance(field, str) or field.endswith(".npy"):
            raise ValueError(f"value_checks: key {field!r} must be a field name such as 'codes'")
        if spec is None:
            continue
        if isinstance(spec, ValueCheck):
            out[field] = spec
        elif isinstance(spec, str) and spec == "finite":  # read in the storage dtype: NaN/inf can go wrong
            out[field] = Finite()
        elif (isinstance(spec, (tuple, list)) and len(spec) == 2
              and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in spec)
              and spec[0] < spec[1]):
            out[field] = InRange(int(spec[0]), int(spec[1]))
        else:
            raise ValueError(f"value_checks[{field!r}] = {spec!r}: expected a shards.kinds.ValueCheck, (lo, hi) "
                             "ints with lo < hi (values must lie in [lo, hi)) or 'finite'")
    return out


@dataclass
class FieldArrays:
    """One tensor member (e.g. ``codes.npy``) of every row of a reader, as numpy arrays.

    ``off`` int64 byte offset; ``shape`` int64 ``(m, ndim)`` (zeros where absent); ``present`` bool;
    ``xxh3`` uint64 the member's checksum (:mod:`shards.checksum`); ``side`` int32: 0 where the member
    is in the row's own shard, ``1 + file number`` where it is in a sidecar tar (None: no row has one);
    ``code`` int8 index into ``dtypes`` (the distinct numpy dtypes the member is stored with; None: one
    dtype). The arrays are over the reader's rows, or, with ``rows``, over the rows of the
    :class:`shards.columns.IndexColumns` the reader reads (``rows[r]``: the store row of reader row
    ``r``; memory-mapped, shared by every process reading the cache). Read them through the gathering
    methods, which take reader rows (an int64 array) and return small arrays: a reader materialises
    only the rows it reads.
    """
    off: np.ndarray
    shape: np.ndarray
    present: np.ndarray
    xxh3: np.ndarray
    dtypes: list
    side: np.ndarray | None = None
    code: np.ndarray | None = None
    rows: np.ndarray | None = None

    @property
    def ndim(self) -> int:
        return int(self.shape.shape[1])

    def at(self, r: np.ndarray) -> np.ndarray:
        """The array positions of reader rows ``r``."""
        return r if self.rows is None else self.rows[r]

    def offsets(self, r: np.ndarray) -> np.ndarray:
        return np.asarray(self.off[self.at(r)], dtype=np.int64)

    def shapes(self, r: np.ndarray) -> np.ndarray:
        """int64 ``(len(r), ndim)``, a copy the caller may change."""
        return np.array(self.shape[self.at(r)], dtype=np.int64)

    def presence(self, r: np.ndarray) -> np.ndarray:
        return np.asarray(self.present[self.at(r)], dtype=bool)

    def sums(self, r: np.ndarray) -> np.ndarray:
        return np.asarray(self.xxh3[self.at(r)], dtype=np.uint64)

    def codes(self, r: np.ndarray) -> np.ndarray:
        return np.zeros(len(r), np.int8) if self.code is None else np.asarray(self.code[self.at(r)], dtype=np.int8)

    def files(self, r: np.ndarray, shard_of: np.ndarray) -> np.ndarray:
        """int64 file number of reader rows ``r`` whose shards are ``shard_of`` (their own shard, or the
        sidecar tar holding the member)."""
        shard_of = np.asarray(shard_of, dtype=np.int64)
        if self.side is None:
            return shard_of
        side = np.asarray(self.side[self.at(r)], dtype=np.int64)
        return np.where(side > 0, side - 1, shard_of)

    def all_present(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``present`` of every reader row (or of ``rows``), as one bool array."""
        if rows is None:
            return np.asarray(self.present if self.rows is None else self.present[self.rows], dtype=bool)
        return self.presence(rows)


class ShardReader:
    """Read samples of a cache by row number of its ``index.parquet``.

    Args:
        cache_dir: the cache directory (holds ``index.parquet`` and the shard tars).
        index: an already loaded (possibly filtered) index table; default: read it from
            ``cache_dir``.
        shard_names: number shards by position in this list (it must hold every shard of
            ``index``; shards without rows are never opened); default: sorted shard names.
        manifest: the cache's ``manifest.json`` as a dict, if already loaded; default: read it
            from ``cache_dir``.
        value_checks: ``{field: ValueCheck | (lo, hi) | "finite"}``: :meth:`views` and :meth:`get` raise
            :class:`ShardCorrupt` (naming shard, key and the bad value) when an array of ``field``
            has a value outside ``[lo, hi)``, or (``"finite"``) a NaN/inf. E.g.
            ``{"codes": (0, codebook_size), "latents": "finite"}``;
            :func:`value_checks_from_manifest` builds it from ``manifest.json``. Default: none.
        await_file: called with a shard's local path before the shard is opened when the file is not
            there yet (a cache streamed from object storage, :mod:`shards.mirror`: it returns once
            the file has arrived, or raises); default None: a missing file is :class:`ShardCorrupt`.
        verify_reads: recompute each sample's sha256 (over its whole members, as in the index) when
            it is read: on every :meth:`get`, and in :meth:`views` once per batch (rows equal to the
            previous call's are not hashed again, so reading several fields of one batch hashes each
            sample once). Mismatch: :class:`ShardCorrupt`. Hashes every member of the sample, read
            or not.
        checksums: check every member read (:meth:`get`, :meth:`views`, :meth:`read_into`) against
            the XXH3-64 its index entry records (:mod:`shards.checksum`; every entry has one: an
            entry without one is :class:`ShardCorrupt`). Mismatch: :class:`ShardCorrupt` naming shard, key and
            member. Default True.

    Offsets: member ``offset``/``size`` in the index locate the raw array payload after the
    ``.npy`` header; arrays are ``np.frombuffer(mmap, dtype, count, offset).reshape(shape)``
    (:meth:`get`, :meth:`views`), or copied by ``preadv`` straight into a caller's buffers
    (:meth:`read_into`, what the loaders use: no mapping, so a shard truncated under the reader is
    a :class:`ShardCorrupt`, never a SIGBUS).

    Attributes: ``index`` (the table), ``keys`` (list of str, built on first use), ``key_array``
    (Arrow strings), ``shard_names`` (sorted), ``shard_of`` int32 ``(n,)`` shard number per row,
    ``manifest`` (dict), ``format_version`` (int), ``value_checks`` (normalised), ``verify_reads``.

    ``get(i)`` returns ``{"__key__": str, "json": dict, "codes": int16 (n_codebooks, frames),
    "audio": int16 (num_samples,), "input_ids": int32 (n_tokens,), "latents": float16 (C,T,H,W)}``
    (``latents`` only for image samples; ``latents_logvar`` float16 (C,T,H,W) too where the cache
    stores the posterior) as read-only numpy views. ``views(field, rows)`` gives the same arrays
    for many rows of one field (vectorised; see :meth:`field`).

    Raises at construction :class:`UnsupportedFormat` (``manifest.json`` format_version newer than
    this code or not an int), :class:`UnsafePath` (an index shard name that is not a plain file
    inside ``cache_dir``), :class:`UnsafeMember` (a member that would need unpickling);
    :class:`ShardCorrupt` when a shard is missing, shrank while being read, a member lies outside
    its shard file or disagrees with its indexed shape (at :meth:`get` / :meth:`views`, or up
    front with :meth:`check_files` / :meth:`field`), a value check fails or a sha256 differs.
    Maps are reopened lazily after pickling (DataLoader workers).
    """

    def __init__(self, cache_dir: str | Path, index: pa.Table | None = None, *,
                 shard_names: list[str] | None = None, manifest: dict[str, Any] | None = None,
                 value_checks: dict[str, Any] | None = None, verify_reads: bool = False,
                 await_file: Any = None, checksums: bool = True):
        self.cache_dir = local_path(cache_dir)  # a file:// URL is a local folder
        self.columns, self.rows, self._mapped = None, None, {}
        if manifest is None:
            manifest = read_manifest(self.cache_dir)
        self.index = read_index(self.cache_dir) if index is None else index
        refuse_unsafe(self.index, self.cache_dir)
        shards = self.index.column("shard")
        names = list(shard_names) if shard_names is not None else sorted(pc.unique(shards).to_pylist())
        if shard_names is not None:  # index names missing from shard_names are refused too
            for name in set(pc.unique(shards).to_pylist()) - set(names):
                safe_shard_path(self.cache_dir, name)
        shard_of = pc.index_in(shards, value_set=pa.array(names, pa.string())) \
            .to_numpy(zero_copy_only=False).astype(np.int32)
        # files = main shards, then the sidecar tars the members name (fields added by add-field)
        side = pc.unique(pc.drop_null(self.index.column("members").combine_chunks().flatten().field("file")))
        files = names + sorted(set(side.to_pylist()) - set(names))
        self._setup(manifest, self.index.num_rows, names, files, shard_of, value_checks, verify_reads,
                    await_file, checksums)
        self._key_array = self.index.column("key").combine_chunks()
        if self.verify_reads:
            self._build_layout()

    @classmethod
    def over_columns(cls, cache_dir: str | Path, columns, rows: np.ndarray | None, *,
                     manifest: dict[str, Any], value_checks: dict[str, Any] | None = None,
                     verify_reads: bool = False, await_file: Any = None, checksums: bool = True) -> "ShardReader":
        """A reader of the store rows ``rows`` (int64, ascending; None: every row) of ``columns`` (a
        :class:`shards.columns.IndexColumns`): what :meth:`shards.Cache.reader` returns after its
        checks. The per-row arrays stay memory-mapped from the store (shared by every process reading
        the cache); only ``shard_of`` of the rows kept by a filter is a copy (int32 per row)."""
        from .columns import mapped
        self = cls.__new__(cls)
        self.cache_dir = local_path(cache_dir)
        self.index = None
        self.columns, self.rows, self._mapped = columns, None, {}
        shard_of = columns.shard_of
        if rows is not None:  # kept rows: mapped from files too, so workers share them
            self.rows, self._mapped["rows"] = mapped(np.asarray(rows, dtype=np.int64))
            shard_of, self._mapped["shard_of"] = mapped(np.asarray(columns.shard_of[self.rows]))
        n = columns.n if self.rows is None else len(self.rows)
        self._setup(manifest, n, list(columns.shards), list(columns.files), shard_of, value_checks,
                    verify_reads, await_file, checksums)
        self._key_array = None
        return self

    def _setup(self, manifest, n, shard_names, files, shard_of, value_checks, verify_reads, await_file,
               checksums) -> None:
        self.manifest = manifest
        self.format_version = check_format_version(manifest, self.cache_dir)
        self.value_checks = _normalise_checks(value_checks)
        self.verify_reads = bool(verify_reads)
        self.checksums = bool(checksums)
        self.await_file = await_file
        self.n = int(n)
        self.shard_names: list[str] = shard_names
        self.files: list[str] = files
        self.shard_of = shard_of
        self._key_buf: memoryview | None = None  # keys_at(): the Arrow key bytes and their offsets
        self._key_offsets: np.ndarray | None = None
        self._paths = [safe_shard_path(self.cache_dir, name) for name in self.files]
        self.io = ShardFiles(self._paths, await_file)  # pread descriptors (read_into)
        self._fields: dict[str, FieldArrays] = {}
        self._keys: list[str] | None = None
        self._rows: list | None = None  # per-sample member lists for get(), built on first use
        self._maps: list[mmap.mmap | None] = [None] * len(self.files)
        self._ids: list[tuple[int, int] | None] = [None] * len(self.files)  # (st_dev, st_ino)
        self._layout: tuple | None = None  # per-sample member layout for verify_rows()
        self._last_verified: np.ndarray | None = None
        self.fields: tuple[str, ...] = ()   # a reader of shards.Cache.reader: its checked fields,
        self.read_files: list[int] = list(range(len(self.files)))  # the files its rows read,
        self.mirror = None                  # the shards.mirror.RemoteCache its shards stream into

    def __len__(self) -> int:
        return self.n

    @property
    def key_array(self) -> pa.Array:
        """The keys in row order, as Arrow strings (over a store: taken from its mapped bytes on first use)."""
        if self._key_array is None:
            a = self.columns.key_array
            self._key_array = a if self.rows is None else a.take(pa.array(self.rows))
        return self._key_array

    @key_array.setter
    def key_array(self, value: pa.Array) -> None:
        self._key_array, self._key_buf, self._key_offsets = value, None, None

    @property
    def keys(self) -> list[str]:
        """Sample keys in index order (a Python list, built on first use: one object per row)."""
        if self._keys is None:
            self._keys = self.key_array.to_pylist()
        return self._keys

    def key(self, row: int) -> str:
        """The key of row ``row``."""
        if self.columns is not None and self._key_array is None:
            return self.columns.key(int(row) if self.rows is None else int(self.rows[row]))
        return self.key_array[int(row)].as_py()

    def keys_at(self, rows) -> list[str]:
        """The keys of index ``rows`` (int64 array), in order: sliced out of the Arrow key buffer
        (a few microseconds for a batch; ``take().to_pylist()`` costs several times that)."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.columns is not None and self._key_array is None:
            return self.columns.keys_at(rows if self.rows is None else self.rows[rows])
        if self._key_buf is None:
            a = self.key_array
            if not (pa.types.is_string(a.type) or pa.types.is_large_string(a.type)) or a.null_count:
                return self.key_array.take(pa.array(rows)).to_pylist()
            bufs = a.buffers()
            width = np.int64 if pa.types.is_large_string(a.type) else np.int32
            self._key_offsets = np.frombuffer(bufs[1], dtype=width)[a.offset:a.offset + len(a) + 1].astype(np.int64)
            self._key_buf = memoryview(bufs[2]) if bufs[2] is not None else memoryview(b"")
        buf, lo, hi = self._key_buf, self._key_offsets[rows].tolist(), self._key_offsets[rows + 1].tolist()
        return [str(buf[x:y], "utf-8") for x, y in zip(lo, hi)]

    def _where(self, row: int, file: int | None = None) -> str:
        f = self.shard_of[row] if file is None else file
        return f"{self.files[f]}: sample {self.key(row)!r}"

    def _file_numbers(self, flat) -> np.ndarray:
        """File number of each flattened member: -1 for the row's own shard, else its sidecar's."""
        col = flat.field("file")
        if col.null_count == len(col):
            return np.full(len(col), -1, dtype=np.int32)
        idx = pc.index_in(col, value_set=pa.array(self.files, pa.string()))
        return pc.fill_null(idx, -1).to_numpy(zero_copy_only=False).astype(np.int32)

    # -- index -> arrays ---------------------------------------------------------------------
    def drop_index(self) -> None:
        """Free the Arrow index (and keep it out of pickles sent to DataLoader workers) once every
        field that :meth:`views` will read has been built; :meth:`get` and new fields then raise
        ``RuntimeError`` (:meth:`verify_rows` keeps working when ``verify_reads`` was set). A reader
        over a store holds no Arrow index: nothing to drop."""
        if self.columns is None:
            self.index = self._rows = None

    def _members(self) -> pa.ListArray:
        if self.index is None and self.columns is not None:  # over a store: the rows read from the index once
            table = read_index(self.cache_dir)
            self.index = table if self.rows is None else table.take(pa.array(self.rows))
        if self.index is None:
            raise RuntimeError(f"{self.cache_dir}: ShardReader.drop_index() was called; only the fields "
                               f"built before ({sorted(self._fields)}) can be read")
        return self.index.column("members")

    def _flat(self):
        members = self._members().combine_chunks()
        return members.flatten(), pc.list_parent_indices(members).to_numpy()

    def check_files(self, files=None) -> None:
        """Raise :class:`ShardCorrupt` if a file (``files``: file numbers; default every file a row
        of this reader reads) is missing or shorter than its indexed members."""
        if self.columns is not None:
            need = self.columns.need
        else:
            flat, parent = self._flat()
            fnum = self._file_numbers(flat)
            fnum = np.where(fnum < 0, self.shard_of[parent] if len(parent) else fnum, fnum)
            need = np.zeros(len(self.files), dtype=np.int64)  # furthest byte any member of a file needs
            np.maximum.at(need, fnum, flat.field("offset").to_numpy() + flat.field("size").to_numpy())
        for i in (range(len(self.files)) if files is None else files):
            if need[i] == 0:
                continue  # no row of this shard kept: never opened
            path = self._paths[i]
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise ShardCorrupt(f"{path}: listed in the index but missing; run `shardcache shards verify`") from None
            if size < need[i]:
                raise ShardCorrupt(f"{path}: {size} bytes but the index needs {need[i]} (truncated shard?); "
                                   "run `shardcache shards verify` and re-run precompute for it")

    def field(self, field: str, ndim: int | None = None) -> FieldArrays:
        """Per-row arrays of member ``field + ".npy"`` (built once). Raises :class:`ShardCorrupt` if
        a row's shape has not ``ndim`` dims (default: that of the first row) or its size in bytes
        is not ``prod(shape) * itemsize``."""
        fa = self._fields.get(field)
        if fa is not None:
            return fa
        if self.columns is not None:
            fa = self._fields[field] = self._column_field(field, ndim)
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
                               f"bytes does not match shape {shape[bad].tolist()}; run `shardcache shards verify`")
        side = None
        fn = self._file_numbers(flat)[sel]
        if (fn >= 0).any():  # a sidecar field: its rows read from their sidecar tar
            side = np.zeros(self.n, dtype=np.int32)
            side[rows[fn >= 0]] = fn[fn >= 0] + 1
        sums = flat.field(CHECKSUM).take(pa.array(sel))
        if sums.null_count:
            bad = int(rows[np.flatnonzero(sums.is_null().to_numpy(zero_copy_only=False))[0]])
            raise ShardCorrupt(f"{self.cache_dir / self._where(bad)} member {member} has no checksum in the "
                               "index; run `shardcache shards verify --deep`, then `shardcache shards reindex`")
        xxh3 = np.zeros(self.n, dtype=np.uint64)
        xxh3[rows] = sums.to_numpy(zero_copy_only=False).astype(np.uint64)
        fa = self._fields[field] = FieldArrays(off, shape, present, xxh3, dtypes, side,
                                               code if len(uniq) > 1 else None)
        return fa

    def _column_field(self, field: str, ndim: int | None) -> FieldArrays:
        """:meth:`field` over a store: its arrays, mapped (the checks were made when it was built)."""
        cols = self.columns
        if not cols.has(field):  # no row has it: every row absent
            k = ndim if ndim is not None else 0
            z = np.zeros(cols.n, np.int64)
            return FieldArrays(z, np.zeros((cols.n, k), np.int64), np.zeros(cols.n, bool), z.astype(np.uint64), [],
                               rows=self.rows)
        why = cols.field_problem(field, ndim)
        if why is not None:
            raise ShardCorrupt(f"{self.cache_dir}/{why}")
        fc = cols.field(field)
        return FieldArrays(fc.off, fc.shape, fc.present, fc.xxh3, fc.dtypes, fc.side, fc.code, self.rows)

    # -- reading ------------------------------------------------------------------------------
    def map(self, shard: int) -> mmap.mmap:
        """The read-only mmap of shard number ``shard`` (opened on first use, in each process)."""
        mm = self._maps[shard]
        if mm is None:
            name = self.files[shard]
            path = safe_shard_path(self.cache_dir, name)  # again: the file may have changed since
            if self.await_file is not None and not path.exists():
                self.await_file(path)
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    if st.st_size == 0:
                        raise ShardCorrupt(f"{path}: empty file (truncated shard?); run `shardcache shards verify`")
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:
                raise ShardCorrupt(f"{path}: listed in the index but missing; run `shardcache shards verify`") from None
            self._maps[shard] = mm
            self._ids[shard] = (st.st_dev, st.st_ino)
        return mm

    def _checked_map(self, shard: int, row: int) -> mmap.mmap:
        """The map of ``shard``, after checking that the file has not shrunk since it was mapped
        (touching a page past the new end of file would kill the process with SIGBUS)."""
        mm = self._maps[shard]
        if mm is None:
            return self.map(shard)
        try:
            st = os.stat(self._paths[shard])
        except OSError:
            return mm  # deleted or renamed away: the mapped inode lives on, its bytes stay readable
        if (st.st_dev, st.st_ino) == self._ids[shard] and st.st_size < len(mm):
            raise ShardCorrupt(f"{self._paths[shard]}: sample {self.key(row)!r}: shard "
                               f"changed size during reading (was {len(mm)}, now {st.st_size} bytes); "
                               "was it rewritten while training? run `shardcache shards verify`")
        return mm  # same size or grown, or replaced by a new file (the old one stays mapped): fine

    def views(self, field: str, rows: np.ndarray) -> list[np.ndarray | None]:
        """Read-only zero-copy views of ``field`` (e.g. ``"codes"``) for index ``rows``; None where
        the row has no such member.

        Each shard of the batch is checked once per call for having shrunk since it was mapped, and
        each member for lying inside the mapped file (:class:`ShardCorrupt` naming shard and key,
        instead of a SIGBUS). With ``value_checks`` for ``field`` the returned arrays are checked;
        with ``verify_reads`` the rows' samples are hashed (see the class docstring)."""
        fa = self._fields.get(field) or self.field(field)
        rows = np.asarray(rows, dtype=np.int64)
        row_list = rows.tolist()
        shape_arr, present = fa.shapes(rows), fa.presence(rows)
        offs = np.where(present, fa.offsets(rows), -1).tolist()
        counts = np.prod(shape_arr, axis=1).tolist() if fa.ndim else [1] * len(row_list)
        shards = fa.files(rows, self.shard_of[rows]).tolist()
        codes = fa.codes(rows).tolist()
        shapes, dtypes = shape_arr.tolist(), fa.dtypes
        items = [d.itemsize for d in dtypes]
        out: list[np.ndarray | None] = []
        maps, checked, check = self._maps, set(), self._checked_map
        for r, o, c, s, d, shp in zip(row_list, offs, counts, shards, codes, shapes):
            if o < 0:
                out.append(None)
                continue
            if s not in checked:  # one stat per shard per call
                check(s, r)
                checked.add(s)
            mm = maps[s]
            if o + c * items[d] > len(mm):
                raise ShardCorrupt(f"{self._where(r, s)} member {field}.npy lies past the end of the file "
                                   f"({len(mm)} bytes when mapped; truncated shard?); run `shardcache shards verify`")
            out.append(np.frombuffer(mm, dtype=dtypes[d], count=c, offset=o).reshape(shp))
        if self.checksums:
            for r, a, want, s in zip(row_list, out, fa.sums(rows).tolist(), shards):
                if a is not None:
                    self._check_sum(checksum(a), want, r, s, field + ".npy")
        if self.verify_reads and not (self._last_verified is not None
                                      and np.array_equal(self._last_verified, rows)):
            self.verify_rows(rows)
            self._last_verified = rows.copy()
        spec = self.value_checks.get(field)
        if spec is not None:
            self._check_values(field, spec, row_list, out)
        return out

    def _check_sum(self, got: int, want: int, row: int, file: int, member: str) -> None:
        if got != want:
            raise ShardCorrupt(f"{self._paths[file]}: sample {self.key(row)!r} member {member}: checksum "
                               f"mismatch ({ALGORITHM} of the bytes read {got:016x}, recorded in the index when the "
                               f"cache was written {want:016x}): the bytes changed since; run `shardcache shards verify --deep`")

    def read_into(self, rows: np.ndarray, plans, checksums: bool | None = None) -> list[tuple[int, str]]:
        """Copy the members of index ``rows`` straight from the shard files into batch buffers with
        ``preadv`` and check their checksums (default: :attr:`checksums`); returns ``[(position,
        message)]`` of the damaged samples. See :func:`shards.readinto.read_into`."""
        from .readinto import read_into
        return read_into(self, rows, plans, self.checksums if checksums is None else checksums)

    def pin_files(self, which=None) -> None:
        """Record the identity (device, inode, size) of files ``which`` (file numbers; default all)
        now: :meth:`read_into` then stops with :class:`ShardCorrupt` when one is replaced, resized or
        deleted (see :mod:`shards.files`)."""
        self.io.pin(range(len(self.files)) if which is None else which)

    def _check_values(self, field: str, spec: ValueCheck, rows: list[int], arrays: list) -> None:
        """Raise :class:`ShardCorrupt` naming shard and key for the first array breaking ``spec``."""
        for r, a in zip(rows, arrays):
            why = spec.problem(a)
            if why is not None:
                raise ShardCorrupt(f"{self._where(r)}: {field} {why}; the shard is damaged or was not written "
                                   "for this cache's settings; run `shardcache shards verify --deep`")

    def get(self, i: int) -> dict[str, Any]:
        """Sample at index row ``i`` as numpy views (see the class docstring)."""
        i = int(i)
        if self.columns is not None:  # over a store: this row's members only
            members = self._members()[i].as_py()
        else:
            if self._rows is None:
                self._rows = self._members().to_pylist()
            members = self._rows[i]
        main = self._checked_map(int(self.shard_of[i]), i)
        out: dict[str, Any] = {"__key__": self.key(i)}
        for m in members or []:
            name, off, size = m["name"], int(m["offset"]), int(m["size"])
            mm = main
            if m.get("file"):  # a sidecar member
                mm = self._checked_map(self.files.index(m["file"]), i)
            if off < 0 or size < 0 or off + size > len(mm):
                raise ShardCorrupt(f"{self._where(i)} member {name} lies past the end of the file "
                                   "(truncated shard?)")
            if self.checksums and m["dtype"] != "npz":  # npz: its arrays have entries of their own
                want = m.get(CHECKSUM)
                if want is None:
                    raise ShardCorrupt(f"{self._where(i)} member {name} has no checksum in the index; run "
                                       "`shardcache shards verify --deep`, then `shardcache shards reindex`")
                f = self.files.index(m["file"]) if m.get("file") else int(self.shard_of[i])
                with memoryview(mm) as v, v[off:off + size] as part:
                    self._check_sum(checksum(part), want, i, f, name)
            if name == JSON_MEMBER:
                out["json"] = json.loads(mm[off:off + size])
            elif m["dtype"] == "npz":
                continue  # its arrays have entries of their own
            elif m["dtype"] not in WHOLE_MEMBER_DTYPES:
                dt, shape = np.dtype(m["dtype"]), tuple(m["shape"])
                if int(np.prod(shape)) * dt.itemsize != size:
                    raise ShardCorrupt(f"{self._where(i)} member {name}: index says shape {shape} {dt} "
                                       f"but {size} bytes")
                arr = np.frombuffer(mm, dtype=dt, count=size // dt.itemsize, offset=off).reshape(shape)
                field = name[:-4] if name.endswith(".npy") else name
                spec = self.value_checks.get(field)
                if spec is not None:
                    self._check_values(field, spec, [i], [arr])
                out[field] = arr
            else:
                out[name] = bytes(mm[off:off + size])
        if self.verify_reads:
            self.verify_rows([i])
        return out

    # -- sha256 of whole samples --------------------------------------------------------------
    def _build_layout(self) -> None:
        """Per-row member layout (sorted by name, as in the sha256) and expected digests."""
        members = self._members().combine_chunks()
        flat, parent = members.flatten(), pc.list_parent_indices(members).to_numpy()
        # the row's sha256 covers its own shard's whole tar members (sidecars: `shardcache shards verify`;
        # arrays packed in tensors.npz are covered by that member's entry)
        own = (pc.is_null(flat.field("file")).to_numpy(zero_copy_only=False)
               & pc.is_null(flat.field("member")).to_numpy(zero_copy_only=False))
        if not own.all():
            keep = np.flatnonzero(own)
            flat, parent = flat.take(pa.array(keep)), parent[keep]
        enc = flat.field("name").dictionary_encode()
        uniq = enc.dictionary.to_pylist()
        by_name = sorted(range(len(uniq)), key=uniq.__getitem__)
        rank = np.empty(len(uniq), dtype=np.int32)
        rank[by_name] = np.arange(len(uniq), dtype=np.int32)
        code = rank[enc.indices.to_numpy(zero_copy_only=False)] if len(uniq) else np.zeros(0, np.int32)
        order = np.lexsort((code, parent))
        off = flat.field("offset").to_numpy(zero_copy_only=False)[order].astype(np.int64)
        end = off + flat.field("size").to_numpy(zero_copy_only=False)[order].astype(np.int64)
        npy = ~pc.is_in(flat.field("dtype"), value_set=pa.array(list(WHOLE_MEMBER_DTYPES))) \
            .to_numpy(zero_copy_only=False).astype(bool)
        ptr = np.zeros(self.n + 1, dtype=np.int64)
        np.add.at(ptr, parent + 1, 1)
        hexes = self.index.column("sha256").to_pylist()
        digests = np.zeros((self.n, 32), dtype=np.uint8)
        valid = np.array([isinstance(h, str) and len(h) == 64 for h in hexes], dtype=bool)
        try:
            digests[valid] = np.frombuffer(bytes.fromhex("".join(h for h, v in zip(hexes, valid) if v)),
                                           dtype=np.uint8).reshape(-1, 32)
        except ValueError:  # a digest with non-hex characters: convert one by one
            for j in np.flatnonzero(valid).tolist():
                try:
                    digests[j] = np.frombuffer(bytes.fromhex(hexes[j]), dtype=np.uint8)
                except ValueError:
                    valid[j] = False  # a malformed digest never matches
        self._layout = (np.cumsum(ptr), code[order], off, end, npy[order],
                        [uniq[j].encode() + b"\0" for j in by_name], digests, valid)

    def _member_start(self, mm: mmap.mmap, payload: int) -> int:
        """Where the ``.npy`` member whose array payload starts at ``payload`` begins: tar member
        data starts on a 512-byte block boundary, with the npy magic; -1 if not found."""
        start = payload - payload % _TAR_BLOCK
        if start == payload:
            start -= _TAR_BLOCK
        while start >= 0 and payload - start <= _MAX_NPY_HEADER:
            if mm[start:start + 6] == _NPY_MAGIC:
                return start
            start -= _TAR_BLOCK
        return -1

    def verify_rows(self, rows) -> None:
        """Recompute the sha256 of the samples at index ``rows`` from the shard bytes and compare it
        with the index (:func:`shards.scan.sample_sha256`: over ``name \\0 bytes`` of every whole
        member, npy headers included). Raises :class:`ShardCorrupt` naming shard and key."""
        if self._layout is None:
            self._build_layout()
        ptr, code, off, end, npy, names, digests, valid = self._layout
        for r in np.asarray(rows, dtype=np.int64).reshape(-1).tolist():
            s = int(self.shard_of[r])
            mm = self._checked_map(s, r)
            h = hashlib.sha256()
            view = memoryview(mm)
            try:
                for j in range(ptr[r], ptr[r + 1]):
                    a, b = int(off[j]), int(end[j])
                    if npy[j]:
                        a = self._member_start(mm, a)
                    if a < 0 or b > len(mm):
                        raise ShardCorrupt(f"{self._where(r)}: member {names[code[j]][:-1].decode()} "
                                           "cannot be located in the shard (truncated or rewritten?); "
                                           "run `shardcache shards verify --deep`")
                    h.update(names[code[j]])
                    h.update(view[a:b])
            finally:
                view.release()
            if not valid[r] or h.digest() != digests[r].tobytes():
                raise ShardCorrupt(f"{self._where(r)}: sha256 mismatch: the index says "
                                   f"{digests[r].tobytes().hex()[:16]}..., the shard holds "
                                   f"{h.hexdigest()[:16]}... (the sample's bytes changed); run "
                                   "`shardcache shards verify --deep`")

    def close_stale(self) -> int:
        """Close the memory maps of files that were deleted or replaced since they were mapped (a
        streamed cache evicts files: closing their maps gives the disk space back; a later read
        maps the file again). One ``stat`` per open map or file; returns how many were closed."""
        n = self.io.close_stale()
        for i, mm in enumerate(self._maps):
            if mm is None:
                continue
            try:
                st = os.stat(self._paths[i])
                if (st.st_dev, st.st_ino) == self._ids[i]:
                    continue
            except OSError:
                pass
            try:
                mm.close()
            except BufferError:
                continue  # a view is still alive: keep the map
            self._maps[i] = None
            n += 1
        return n

    def close(self) -> None:
        """Close every memory map (views returned earlier must not be used afterwards) and file."""
        self.io.close()
        for i, mm in enumerate(self._maps):
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view is still alive; the map closes when it is garbage collected
                self._maps[i] = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_maps"] = [None] * len(self.files)  # reopened lazily in each DataLoader worker
        state["_ids"] = [None] * len(self.files)
        state["_last_verified"] = None
        state["_rows"] = state["_keys"] = None  # rebuilt on first use
        state["_key_buf"] = state["_key_offsets"] = None  # a memoryview does not pickle
        if self.columns is not None:  # over a store: the worker maps its files (IndexColumns pickles as its path)
            state["index"] = state["_key_array"] = None
            state["_fields"] = {}
            state["shard_of"] = None
            state["rows"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.columns is not None:
            m = self._mapped
            self.rows = np.load(m["rows"], mmap_mode="r") if "rows" in m else None
            self.shard_of = np.load(m["shard_of"], mmap_mode="r") if "shard_of" in m else self.columns.shard_of
