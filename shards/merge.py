"""A cache's own files from its per-shard parts: ``index.parquet``, ``rejects.parquet``, ``manifest.json``,
the dataset card and, last, the integrity root (:func:`write_cache_files`; :func:`merge_parts` for stage one).

The index is written table by table (a part is one shard's rows), :data:`ROW_GROUP_ROWS` rows per row group,
and what the manifest records of every row is gathered as the tables pass (:class:`_IndexFacts`: the counts,
the cache id's running hash, the distinct members, the keys as Arrow strings for the duplicate check). So a
merge holds one row group and the keys, never the whole index as one table: rank 0's merge of a 1M-row
manifest held ~234 bytes a row that way (issue 48). A cache of at most :data:`ROW_GROUP_ROWS` rows is written
as one row group, byte for byte as one ``pyarrow.parquet.write_table`` of the whole index wrote it.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from . import schema
from .card import index_members, write_dataset_card
from .errors import ShardCorrupt, UnsafePath
from .index import (INDEX_SCHEMA, REJECTS_SCHEMA, SIDECAR_PART_SCHEMA, attach_sidecar, read_part_shard_entry,
                    sidecar_part_path, sidecar_parts, unsafe_name_reason, write_atomic, write_root)
from .manifest import CacheManifest, read_manifest
from .schema import INDEX_FILE, PARTS_DIR, REJECTS_FILE

#: rows per row group of a merged ``index.parquet`` / ``rejects.parquet``: what a merge buffers at once
#: (65,536 index rows are ~15 MB); readers read a row group at a time
ROW_GROUP_ROWS = 65_536
#: tables (parts) a merge holds before it copies them into one: a part read costs ~25 KB of the process's
#: memory outside Arrow's buffers while it is held (3,900 parts held at once: 107 MB for 7 MB of rows)
COMPACT_TABLES = 32


def merge_parts(out_dir: Path, manifest: "CacheManifest | dict[str, Any]") -> dict[str, Any]:
    """Concatenate every part into ``index.parquet`` / ``rejects.parquet`` and write ``manifest.json``.

    ``manifest`` holds the job's own fields (encoders, fingerprint, config...); this adds
    ``format_version``, ``created``, ``counts`` and ``shards``. Returns the manifest written. The parts
    are read one at a time (:func:`write_cache_files`).

    Fields added by ``add-field`` (the sidecar entries of the manifest already there) are kept with
    the sidecars whose parts are committed; an entry whose field lacks the sidecar of some shard (a
    chunk a rerun encoded again, or a new one) lists those shards in ``incomplete``: running the
    same ``add-field`` again adds just those.
    """
    out_dir = Path(out_dir)
    if isinstance(manifest, CacheManifest):
        manifest = {k: v for k, v in manifest.to_dict().items() if k != "format_version"}
    parts = out_dir / PARTS_DIR
    index_parts = sorted(parts.glob("*.index.parquet"))
    shards = [e for e in map(read_part_shard_entry, index_parts) if e]
    # fields added by `precompute add-field` survive a stage-one re-merge (and any rerun)
    kept = added_fields(out_dir, [s["path"] for s in shards], read_manifest(out_dir).get("fields"))
    if kept:  # with the job's own extra fields (stage one's, not sidecars)
        manifest = dict(manifest, fields={**(manifest.get("fields") or {}), **kept})
    index = (attach_added(out_dir, _read_part(p, INDEX_SCHEMA), kept) for p in index_parts)
    rejects = (_read_part(p, REJECTS_SCHEMA) for p in sorted(parts.glob("*.rejects.parquet")))
    return write_cache_files(out_dir, index, rejects, shards, manifest)


def _read_part(path: Path, schema: pa.Schema) -> pa.Table:
    """A part as ``schema`` (an older part's missing columns null: ``pq.read_table``'s rule, which builds a
    dataset per call, is taken only for such a part; its per-call state is ~12 KB a part kept by the process)."""
    t = pq.ParquetFile(path).read()
    return t.replace_schema_metadata(None) if t.schema.remove_metadata() == schema else pq.read_table(path, schema=schema)


def added_fields(out_dir: Path, shards: Iterable[str], fields: dict[str, Any] | None) -> dict[str, dict]:
    """The manifest entries of the fields added by ``add-field`` among ``fields`` (``manifest.json``'s; the
    stage-one ones are skipped), with the sidecars whose parts are committed (read from the parts' footers);
    an entry whose field lacks the sidecar of one of ``shards`` (a chunk a rerun encoded again, a new one)
    lists those in ``incomplete``: the same ``add-field`` adds just those."""
    kept, shards = {}, sorted(set(shards))
    for name, info in (fields or {}).items():
        if not isinstance(info, dict) or not info.get("sidecar", True):
            continue  # a stage-one field: the job's manifest declares it
        entries = [e for e in map(read_part_shard_entry, sidecar_parts(out_dir, name)) if e]
        info = {k: v for k, v in info.items() if k != "incomplete"} | {"shards": sorted(entries, key=lambda e: e["path"])}
        if missing := [s for s in shards if not sidecar_part_path(out_dir, s, name).exists()]:
            info["incomplete"] = missing
        kept[name] = info
    return kept


def attach_added(out_dir: Path, index: pa.Table, kept: dict[str, dict]) -> pa.Table:
    """``index`` with the members of each field of ``kept`` (:func:`added_fields`) attached from the sidecar
    parts of its shards (:func:`shards.index.attach_sidecar`)."""
    if not kept or not index.num_rows:
        return index
    shards = pc.unique(index.column("shard")).to_pylist()
    for name in kept:
        paths = [p for p in (sidecar_part_path(out_dir, s, name) for s in shards if s) if p.exists()]
        if paths:
            index = attach_sidecar(index, pa.concat_tables(pq.read_table(p, schema=SIDECAR_PART_SCHEMA)
                                                           for p in paths))
    return index


def keep_added_fields(out_dir: Path, index: pa.Table, fields: dict[str, Any] | None) -> tuple[pa.Table, dict]:
    """``(index with the added fields' members, their entries)``: :func:`added_fields` and
    :func:`attach_added` over a whole index (``shards reindex``'s; a stage-one re-merge runs them part by
    part): the one rule of both."""
    kept = added_fields(out_dir, pc.unique(index.column("shard")).drop_null().to_pylist(), fields)
    return attach_added(out_dir, index, kept), kept


def _hash_rows(h: "hashlib._Hash", index: pa.Table) -> None:
    """Feed the cache id's hash ``key\\tshard\\tsha256\\n`` of every row of ``index``, in order."""
    for batch in index.select(["key", "shard", "sha256"]).to_batches(max_chunksize=1 << 16):
        keys, shards, shas = (c.to_pylist() for c in batch.columns)
        h.update("".join(f"{k}\t{s}\t{d or ''}\n" for k, s, d in zip(keys, shards, shas)).encode())


def _id_of(h: "hashlib._Hash", added_fields: dict[str, Any] | None) -> str:
    sidecars = {name: [info.get("fingerprint"), sorted((e.get("path"), e.get("sha256")) for e in info.get("shards") or [])]
                for name, info in sorted((added_fields or {}).items())
                if isinstance(info, dict) and info.get("sidecar", True)}
    if sidecars:
        h.update(b"fields\0" + json.dumps(sidecars, sort_keys=True).encode())
    return h.hexdigest()[:16]


def cache_id(index: pa.Table, added_fields: dict[str, Any] | None = None) -> str:
    """The identity of a cache: 16 hex digits of the sha256 of every index row's ``key``, ``shard``
    and ``sha256`` (the sample's bytes), in index order, and, when fields were added after stage one
    (``added_fields``: ``manifest.json``'s ``fields``), of each sidecar field's name, fingerprint
    and sidecar tars' sha256. Two caches with the same id hold the same samples and fields in the
    same places; re-merging and ``shards reindex`` keep it; ``add-field``, ``drop-field`` and
    ``add-field --replace`` change it. Recorded in ``integrity.json`` and ``manifest.json``
    (``cache_id``), in a loader's state and in training checkpoints, so a resume on other data is
    refused."""
    h = hashlib.sha256()
    _hash_rows(h, index)
    return _id_of(h, added_fields)


class _IndexFacts:
    """What the cache's files record of its index, gathered table by table as it is written."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.rows, self.images, self.seconds = out_dir, 0, 0, 0.0
        self.id_hash = hashlib.sha256()
        self.keys: list[pa.Array] = []  # (and the newest parts' own, not copied yet)
        self.new_keys: list[pa.Array] = []
        self.members: dict[tuple, None] = {}  # distinct (member, name, dtype, ndim), first-seen order

    def add(self, t: pa.Table) -> None:
        for name in sorted(pc.unique(t.column("shard")).to_pylist(), key=str):
            _refuse_unsafe(self.out_dir, name)
        self.new_keys += t.column("key").chunks
        if len(self.new_keys) >= COMPACT_TABLES:  # (each part's own array: copied into one, as the tables are)
            self.keys, self.new_keys = self.keys + [pa.concat_arrays(self.new_keys)], []
        self.rows += t.num_rows
        self.images += int(pc.sum(t.column("has_image")).as_py() or 0)
        self.seconds = sum(t.column("duration_s").to_pylist(), self.seconds)
        _hash_rows(self.id_hash, t)
        self.members.update(dict.fromkeys(index_members(t)))

    def refuse_duplicates(self) -> None:
        """Raise :class:`ShardCorrupt` naming the first keys (sorted) that two rows share."""
        keys = pa.chunked_array(self.keys + self.new_keys, pa.string())
        if pc.count_distinct(keys).as_py() == len(keys):
            return
        counts = pc.value_counts(keys)
        dup = sorted(counts.field("values").filter(pc.greater(counts.field("counts"), 1)).to_pylist())[:5]
        raise ShardCorrupt(f"{self.out_dir}: duplicate keys across shards: {dup}; nothing was written: the shard "
                           "tars hold these keys twice (a reader would see two samples under one key). "
                           "Precompute the manifest into a new --cache")


def _refuse_unsafe(out_dir: Path, name: Any) -> None:
    if (why := unsafe_name_reason(name)) is not None:
        raise UnsafePath(f"{out_dir}: refusing to write shard name {name!r}: it {why}")


def _write_tables(path: Path, tables: Iterable[pa.Table], empty: pa.Schema, each: Callable[[pa.Table], None],
                  last: Callable[[], None] = lambda: None) -> None:
    """``tables`` written one after another to the Parquet file ``path`` (atomically: :func:`write_atomic`),
    :data:`ROW_GROUP_ROWS` rows per row group, ``each(table)`` called on each as it passes and ``last()``
    before the file is renamed into place (an error there leaves ``path`` as it was). Every
    :data:`COMPACT_TABLES` tables held are copied into one."""
    def write(f) -> None:
        writer, held, fresh, n, wrote = None, [], [], 0, False
        for t in tables:
            each(t)
            writer = writer or pq.ParquetWriter(f, t.schema)
            fresh.append(t)
            n += t.num_rows
            if len(fresh) >= COMPACT_TABLES:
                held, fresh = held + [pa.concat_tables(fresh).combine_chunks()], []
            if n >= ROW_GROUP_ROWS:
                whole, k = pa.concat_tables(held + fresh), n // ROW_GROUP_ROWS * ROW_GROUP_ROWS
                writer.write_table(whole.slice(0, k), row_group_size=ROW_GROUP_ROWS)
                held, fresh, n, wrote = [whole.slice(k)], [], n - k, True
        last()
        writer = writer or pq.ParquetWriter(f, empty)
        if n or not wrote:  # (no table at all: one empty row group, as write_table writes an empty table)
            writer.write_table(pa.concat_tables(held + fresh) if held or fresh else empty.empty_table())
        writer.close()
    write_atomic(path, write)


def write_cache_files(out_dir: Path, index: pa.Table | Iterable[pa.Table], rejects: pa.Table | Iterable[pa.Table],
                      shards: list[dict], manifest: dict[str, Any]) -> dict[str, Any]:
    """Write ``index.parquet``, ``rejects.parquet``, ``manifest.json``, the dataset card and, last, the
    integrity root ``integrity.json`` (:func:`~shards.index.write_root`), each atomically.

    ``index`` / ``rejects``: a table, or tables in order (a part each: read one at a time, see the module);
    ``shards``: the shard tars' manifest entries. Raises :class:`~shards.errors.UnsafePath` for a shard name
    that is no plain file name and :class:`~shards.errors.ShardCorrupt` for a key two rows share; either
    leaves every file of the cache as it was. Returns the manifest written."""
    out_dir = Path(out_dir)
    for s in sorted(shards, key=lambda s: str(s["path"])):
        _refuse_unsafe(out_dir, s["path"])
    facts, reasons = _IndexFacts(out_dir), {}

    def count(t: pa.Table) -> None:
        for r in t.column("reason").to_pylist():
            reasons[r] = reasons.get(r, 0) + 1

    as_tables = lambda x: [x] if isinstance(x, pa.Table) else x  # noqa: E731 - one table or several
    _write_tables(out_dir / INDEX_FILE, as_tables(index), INDEX_SCHEMA, facts.add, facts.refuse_duplicates)
    _write_tables(out_dir / REJECTS_FILE, as_tables(rejects), REJECTS_SCHEMA, count)
    manifest = CacheManifest.from_dict(manifest).to_dict()  # typed: unknown keys are kept as they are
    manifest.update(
        format_version=schema.FORMAT_VERSION,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        cache_id=_id_of(facts.id_hash, manifest.get("fields")),
        counts=dict(samples=facts.rows, rejected=sum(reasons.values()), rejects_by_reason=reasons,
                    images=facts.images, audio_hours=round(facts.seconds / 3600.0, 6), shards=len(shards),
                    bytes=int(sum(s["bytes"] for s in shards))),
        shards=sorted(shards, key=lambda s: s["path"]),
    )
    CacheManifest.from_dict(manifest).write(out_dir)
    write_dataset_card(out_dir, manifest, list(facts.members))
    write_root(out_dir, manifest["cache_id"])
    return manifest
