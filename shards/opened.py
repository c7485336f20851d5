"""A cache's files opened once: :class:`CacheFiles` (:class:`shards.Cache` is one, with the encoders'
identity beside). What a valid cache is, is decided here, for every reader of it (the loaders, ``shards
verify``, ``shardcache check``, the viewer).

:meth:`CacheFiles.open` reads, in this order and before anything else:

1. ``manifest.json`` (its format version: a newer one is :class:`~shards.errors.UnsupportedFormat`;
   its fields' types: :class:`~shards.errors.ManifestError`);
2. the integrity root: ``index.parquet`` and ``manifest.json`` hashed and compared with
   ``integrity.json`` (:func:`shards.index.root_problems`), so no byte of an index the root does not
   vouch for is read;
3. the index, once, into columns (:func:`shards.columns.open_columns`: arrays memory-mapped from a
   local store keyed by the index's sha256, shared by every process of the node);
4. what the whole index must not hold: a member that would need unpickling
   (:class:`~shards.errors.UnsafeMember`), bytes of a shard no entry locates (a key held twice:
   :class:`~shards.errors.ShardCorrupt`), a shard name that is not a plain file of the folder
   (:class:`~shards.errors.UnsafePath`).

A URL (``s3://...``, any fsspec protocol) is opened from a local mirror (:class:`shards.mirror.RemoteCache`:
its manifest, index and root downloaded once; the shards as its readers need them).

:meth:`CacheFiles.reader` returns the checked :class:`~shards.reader.ShardReader` of some fields and
rows (each field's shapes, sizes and checksums, fields added by ``add-field`` complete, fields every
sample must hold held, paired fields together, the files there and as long as the index says);
:meth:`CacheFiles.problems` lists every one of those refusals (what ``shards verify`` and ``shardcache
check`` report); :meth:`CacheFiles.value_checks` the kinds' value checks with the manifest's sizes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from . import fields as registry
from .columns import IndexColumns, open_columns
from .errors import ManifestError, ShardcacheError, ShardCorrupt, UnsafeMember, UnsafePath
from .filters import columns_of, filter_rows
from .index import INDEX_SCHEMA, file_sha256, read_index, root_problems, safe_shard_path
from .kinds import ValueCheck
from .manifest import CacheManifest
from .reader import ShardReader, value_checks_of
from .schema import INDEX_FILE, MANIFEST_FILE
from .storage import is_url, local_path

#: the error each kind of whole-index problem is raised as (:attr:`shards.columns.IndexColumns.problems`)
_RAISED_AS = {"unpickle": UnsafeMember, "hidden": ShardCorrupt, "no_key": ShardCorrupt}


class CacheFiles:
    """A cache opened once (see the module docstring). Build it with :meth:`open`.

    Attributes: ``source`` (the path or URL as given), ``dir`` (a local folder with the metadata: the
    cache itself, or the mirror of a URL's), ``manifest`` (:class:`~shards.manifest.CacheManifest`),
    ``id`` (the cache id the integrity root vouches for), ``columns`` (the index as
    :class:`~shards.columns.IndexColumns`), ``storage_options``, ``remote`` (the
    :class:`~shards.mirror.RemoteCache` of a URL, else None). ``len(cache)``: samples.
    """

    def __init__(self, source: Any, dir: Path, manifest: CacheManifest, id: str, columns: IndexColumns | None, *,
                 storage_options: dict | None = None, remote: Any = None,
                 refused: Sequence[tuple[type, str]] = ()):
        self.source, self.dir, self.manifest, self.id, self.columns = source, dir, manifest, id, columns
        self.storage_options, self.remote = storage_options, remote
        self._refused = list(refused)  # what a lenient open found (open(strict=False))
        self._index: pa.Table | None = None
        self._remote_free = remote is not None  # the first reader of a URL's cache streams into its mirror

    @classmethod
    def open(cls, where: "str | os.PathLike | CacheFiles", storage_options: dict | None = None,
             local_dir: str | os.PathLike | None = None, *, retries: int = 10, strict: bool = True) -> "CacheFiles":
        """Open a cache (see the module docstring for what is read and checked, in that order).

        Args:
            where: a cache folder, a ``file://`` URL, a remote cache's URL, or an opened cache
                (returned as it is).
            storage_options: a remote cache's fsspec options (endpoint, credentials...).
            local_dir: where a remote cache is mirrored (default
                :func:`shards.mirror.default_local_dir` of rank 0).
            retries: tries of each remote call on transient errors (exponential backoff from 0.5 s, at
                most 30 s apart: :func:`shards.storage.retry`).
            strict: raise the first problem (what every reader wants); False: keep them for
                :meth:`problems` and open what can be opened (``shards verify``, ``shardcache check``).

        Raises ``FileNotFoundError`` (no ``index.parquet``: not a cache), :class:`~shards.errors.UnsupportedFormat`
        (always), and with ``strict`` :class:`~shards.errors.ManifestError`, :class:`~shards.errors.ShardCorrupt`
        (the integrity root, an index Arrow cannot read, bytes no entry locates),
        :class:`~shards.errors.UnsafeMember`, :class:`~shards.errors.UnsafePath`.
        """
        if isinstance(where, CacheFiles):
            return where
        remote = None
        if is_url(where):
            from .mirror import RemoteCache
            remote = RemoteCache(str(where), local_dir=local_dir, storage_options=storage_options, retries=retries)
            d = remote.local
        else:
            d = local_path(where)
        try:
            return cls._open(where, d, storage_options, remote, strict)
        except BaseException:
            if remote is not None:
                remote.close()
            raise

    @classmethod
    def _open(cls, where, d: Path, storage_options, remote, strict: bool) -> "CacheFiles":
        if not (d / INDEX_FILE).is_file():
            from .unfinished import unfinished
            if (why := unfinished(d)) is not None:  # a stage-one job that stopped: rerun it, not reindex
                raise FileNotFoundError(why)
            raise FileNotFoundError(f"{d / INDEX_FILE} not found: is {where} a shardcache cache "
                                    "(a directory made by `shardcache precompute`)?")
        refused: list[tuple[type, str]] = []

        def refuse(exc: type, msg: str) -> None:
            if strict:
                raise exc(msg)
            refused.append((exc, msg))

        try:  # 1. the format (UnsupportedFormat always raises) and the fields' types
            manifest = CacheManifest.read_required(d)
        except ShardCorrupt as e:  # (a ManifestError, or a file that is no JSON)
            refuse(type(e), str(e))
            manifest = _lenient_manifest(d)
        sha = file_sha256(d / INDEX_FILE)  # 2. the root vouches for both files, before the index is read
        root, why = root_problems(d, known={INDEX_FILE: sha})
        for msg in why:
            refuse(ShardCorrupt, msg)
        cid = root["cache_id"] if root is not None and not why else str(manifest.cache_id or "?")
        try:  # 3. the index as columns
            columns = open_columns(d / INDEX_FILE, sha)
        except ShardCorrupt as e:
            refuse(ShardCorrupt, str(e))
            return cls(where, d, manifest, cid, None, storage_options=storage_options, remote=remote, refused=refused)
        for kind, msg in columns.problems:  # 4. what no index may hold
            refuse(_RAISED_AS[kind], msg if kind != "hidden" else
                   f"{d}: {msg}; check it with `shardcache shards verify --deep`")
        for name in columns.files:
            try:
                safe_shard_path(d, name)
            except UnsafePath as e:
                refuse(UnsafePath, str(e))
        return cls(where, d, manifest, cid, columns, storage_options=storage_options, remote=remote,
                   refused=refused)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.source)!r}, id={self.id}, {len(self)} samples)"

    def __len__(self) -> int:
        return self.columns.n if self.columns is not None else 0

    @property
    def index(self) -> pa.Table:
        """The whole ``index.parquet`` as an Arrow table (read on first use; the loaders never need it)."""
        if self._index is None:
            self._index = read_index(self.dir)
        return self._index

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields some sample holds (of the registry, sorted)."""
        if self.columns is None:
            return ()
        return tuple(sorted(n[:-4] for n in self.columns.names if n.endswith(".npy")
                            and registry.lookup(n[:-4]) is not None))

    def value_checks(self) -> dict[str, ValueCheck]:
        """``{field: ValueCheck}``: every field's kind's value check with the sizes this cache's manifest
        records (codes in ``[0, codebook_size)``, ids in ``[0, vocab_size)``, floats finite...)."""
        return value_checks_of(self.manifest)

    def scalars(self, columns: Sequence[str]) -> pa.Table:
        """The index's scalar ``columns`` (what filters read): ``key``, ``shard``, ``n_frames``,
        ``sample_rate`` and ``has_image`` from the columns (mapped, not read again), the others read from
        ``index.parquet`` for those columns only."""
        cols = list(dict.fromkeys(columns))
        c = self.columns
        mapped = {"key": lambda: c.key_array, "shard": lambda: pa.DictionaryArray.from_arrays(
            pa.array(np.asarray(c.shard_of)), pa.array(c.shards, pa.string())).cast(pa.string())}
        mapped |= {k: (lambda k=k: pa.array(np.asarray(getattr(c, k)), INDEX_SCHEMA.field(k).type))
                   for k in ("n_frames", "sample_rate", "has_image")}
        rest = [k for k in cols if k not in mapped]
        read = pq.read_table(self.dir / INDEX_FILE, columns=rest, schema=pa.schema([INDEX_SCHEMA.field(k) for k in rest])) \
            if rest else None
        return pa.table({k: mapped[k]() if k in mapped else read.column(k) for k in cols})

    # -- readers ----------------------------------------------------------------------------------------
    def reader(self, fields: Sequence[str] | None = None, filters: Any = None, *,
               verify_reads: bool = False) -> ShardReader:
        """The :class:`~shards.reader.ShardReader` of ``fields`` (default: every field the kept rows hold
        that is read by default, :func:`shards.fields.held`) over the rows ``filters`` keeps
        (:func:`shards.filters.filter_rows`; default all), after every check of the module docstring.

        Attributes besides the reader's: ``fields`` (the checked selection, in read order),
        ``read_files`` (the file numbers its rows read: their shards and the sidecars of the fields),
        ``mirror`` (the :class:`~shards.mirror.RemoteCache` its shards stream into, for a URL; give it
        back with :meth:`release`).

        Raises what :meth:`open` refused (an opened cache with problems is never read),
        ``ValueError`` (no sample left after the filters; a field some sample must hold is missing, a
        field added by ``add-field`` lacks sidecars, unknown fields), :class:`~shards.errors.ShardCorrupt`
        (a field's rank, sizes or checksums; a file missing or shorter than the index says).
        """
        for exc, msg in self._refused[:1]:
            raise exc(msg)
        rows = self._kept(filters)
        names = registry.selection(self._held(rows) if fields is None else fields)
        for exc, msg in self._field_problems(names, rows):
            raise exc(msg)
        mirror = None
        if self.remote is not None:  # the shards stream into the cache's mirror, or a folder of the reader's own
            mirror = self.remote if self._remote_free else self.remote.sibling()
            self._remote_free = self._remote_free and mirror is not self.remote
        try:
            reader = ShardReader.over_columns(self.dir if mirror is None else mirror.local, self.columns, rows,
                                              manifest=self.manifest.to_dict(), value_checks=self.value_checks(),
                                              verify_reads=verify_reads,
                                              await_file=None if mirror is None else mirror.waiter)
            reader.fields, reader.read_files, reader.mirror = names, self._read_files(reader, names), mirror
            if mirror is None:
                for exc, msg in self._file_problems(reader):
                    raise exc(msg)
                reader.pin_files(reader.read_files)  # replaced later: ShardCorrupt
            else:
                mirror.adopt([reader.files[i] for i in reader.read_files], self.manifest.to_dict())
        except BaseException:
            if mirror is not None:
                self._give_back(mirror)
            raise
        return reader

    def _give_back(self, mirror) -> None:
        if mirror is self.remote:
            self._remote_free = True
        else:
            mirror.close()

    def release(self, reader: ShardReader) -> None:
        """Close ``reader`` and give back the folder it streamed into."""
        reader.close()
        if reader.mirror is not None:
            self._give_back(reader.mirror)

    def problems(self) -> list[str]:
        """Every reason a reader would refuse this cache (what ``shards verify`` and ``shardcache check``
        report besides their own file checks): what :meth:`open` found, then, for each field a reader
        reads by default, its refusals, then the files missing or shorter than the index says. One
        message each, naming the file and the fix."""
        out = [msg for _, msg in self._refused]
        if self.columns is None or any(not issubclass(exc, ManifestError) for exc, _ in self._refused):
            return out  # (the root or the index refused: nothing behind it is read)
        names = registry.selection(self._held(None) or ("input_ids",))
        out += [msg for _, msg in self._field_problems(names, None, every=True)]
        reader = ShardReader.over_columns(self.dir, self.columns, None, manifest=self.manifest.to_dict())
        try:
            readable = [f for f in names if self.columns.has(f) and self.columns.field_problem(
                f, registry.get(f).ndim) is None]
            out += [msg for _, msg in self._file_problems(reader, self._read_files(reader, readable), every=True)]
        finally:
            reader.close()
        return out

    def close(self) -> None:
        """Give back a remote cache's mirror folder."""
        if self.remote is not None:
            self.remote.close()

    # -- the checks -------------------------------------------------------------------------------------
    def _kept(self, filters: Any) -> np.ndarray | None:
        """The store rows ``filters`` keeps (int64, ascending), None for every row."""
        if filters is None:
            rows = None
        else:
            table = self.scalars(columns_of(filters)) if columns_of(filters) else pa.table({})
            if not table.num_columns:  # a filter reading no column: it still sees the number of rows
                table = pa.table({"key": pa.nulls(len(self), pa.string())})
            rows = filter_rows(table, filters)
            if len(rows) == len(self):
                rows = None
        if rows is not None and not len(rows):
            raise ValueError(f"{self.dir}: no sample left after filters {filters!r} ({len(self)} in the index)")
        return rows

    def _held(self, rows: np.ndarray | None) -> tuple[str, ...]:
        """The fields read by default that some kept row holds (:func:`shards.fields.held`)."""
        names = [n for n in self.columns.names if n.endswith(".npy")]
        if rows is not None:
            names = [n for n in names if self.columns.has(n[:-4]) and self.columns.field(n[:-4]).present[rows].any()]
        return registry.held(names)

    def _field_problems(self, names: Sequence[str], rows: np.ndarray | None,
                        every: bool = False) -> Iterator[tuple[type, str]]:
        """Why fields ``names`` cannot be read over the kept ``rows``: the first reason (all of them with
        ``every``)."""
        cols, man = self.columns, self.manifest
        for name in names:
            f = registry.get(name)
            lacking = man.fields[name].extra.get("incomplete") if name in man.fields else None
            if lacking:  # a rerun re-encoded or added shards after `add-field`: their sidecars are not made yet
                yield ValueError, (f"{self.dir}: field {name!r} (added by add-field) has no sidecar for "
                                   f"{len(lacking)} shard(s) ({', '.join(lacking[:3])}...); run the same "
                                   f"`shardcache add-field` again to add them, or read the cache without {name!r}")
                if not every:
                    return
            why = cols.field_problem(name, f.ndim) if cols.has(name) else None
            if why is not None:
                yield ShardCorrupt, f"{self.dir}/{why}"
                if not every:
                    return
                continue
            present = self._present(name, rows)
            if f.paired_with is not None:
                missing = np.flatnonzero(self._present(f.paired_with, rows) & ~present)
                if len(missing):
                    yield ValueError, (f"{self.dir}: {len(missing)} samples with {f.paired_with} have no {f.suffix} "
                                       f"(e.g. {self._keys(rows, missing[:5])}); was the cache made with "
                                       f"store_posterior: true? else drop {name!r} from fields")
                    if not every:
                        return
            if (f.every_sample and not present.all()) or (not f.kind.uses_default_shape and not present.any()):
                missing = np.flatnonzero(~present)
                yield ValueError, (f"{self.dir}: {len(missing)} samples have no {f.suffix} (e.g. "
                                   f"{self._keys(rows, missing[:5])}); drop {name!r} from fields or filter them out")
                if not every:
                    return

    def _present(self, name: str, rows: np.ndarray | None) -> np.ndarray:
        if not self.columns.has(name):
            return np.zeros(len(self) if rows is None else len(rows), bool)
        p = self.columns.field(name).present
        return np.asarray(p if rows is None else p[rows], dtype=bool)

    def _keys(self, rows: np.ndarray | None, at: np.ndarray) -> list[str]:
        return self.columns.keys_at(at if rows is None else rows[at])

    def _read_files(self, reader: ShardReader, names: Sequence[str]) -> list[int]:
        """The file numbers ``reader``'s rows read for ``names``: their shards and the fields' sidecars."""
        used = np.bincount(np.asarray(reader.shard_of), minlength=len(reader.shard_names)) > 0
        out = set(np.flatnonzero(used).tolist())
        for name in names:
            fc = self.columns.field(name) if self.columns.has(name) else None
            if fc is not None and fc.side is not None:
                side = np.asarray(fc.side if reader.rows is None else fc.side[reader.rows])
                out |= {int(s) - 1 for s in np.unique(side).tolist() if s > 0}
        return sorted(out)

    def _file_problems(self, reader: ShardReader, files: Sequence[int] | None = None,
                       every: bool = False) -> Iterator[tuple[type, str]]:
        """Files of ``reader`` missing or shorter than the index says."""
        for i in reader.read_files if files is None else files:
            try:
                reader.check_files([i])
            except ShardCorrupt as e:
                yield ShardCorrupt, str(e)
                if not every:
                    return


def _lenient_manifest(d: Path) -> CacheManifest:
    """The manifest as far as it reads (empty when it does not), for :meth:`CacheFiles.open` ``strict=False``."""
    from .manifest import read_manifest
    try:
        return CacheManifest.from_dict(read_manifest(d))
    except (ShardcacheError, ValueError, TypeError, OSError):
        return CacheManifest.from_dict({})


__all__ = ["CacheFiles", "MANIFEST_FILE"]
