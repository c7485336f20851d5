"""``index.parquet``, ``rejects.parquet`` and ``manifest.json``: schemas, parts, atomic writes, the integrity root.

Per-shard parts live in ``OUT/parts/``: ``STEM.rejects.parquet`` then ``STEM.index.parquet``
(written last: its presence marks the chunk done). The index part carries the shard's own entry
(name, samples, bytes, sha256) in its Parquet key-value metadata. :func:`shards.merge.merge_parts` turns
the parts into the cache-level files.

Member locations (the ``members`` column, one struct ``{name, offset, size, dtype, shape, file,
member}`` per tar member of a sample and per array): ``offset`` is an absolute byte offset into the
shard tar and ``size`` a byte count. For an array (``NAME.npy``, whether a tar member of its own
or packed in ``tensors.npz``, then ``member == "tensors.npz"``) they locate
the raw array payload AFTER the ``.npy`` header (the header's bytes are not counted in ``size``),
so a reader does::

    arr = np.frombuffer(buf[offset:offset + size], dtype).reshape(shape)   # never np.load

(``size == prod(shape) * dtype.itemsize``). For the ``json`` member (``dtype == "json"``), the
``tensors.npz`` member (``dtype == "npz"``) and any other member (``dtype == "bytes"``) they locate
the whole member data. A sample's ``sha256`` covers its whole tar members (see
:func:`shards.scan.sample_sha256`); :meth:`shards.reader.ShardReader.verify_rows` hashes the
entries whose ``member`` is null (for ``.npy`` members of their own it recovers the ``.npy`` header
from the offsets: tar member data starts on a 512-byte block boundary).

Every shard name an index row or ``manifest.json`` holds must be a plain file name directly inside
the cache directory: :func:`safe_shard_path` is the one place that turns such a name into a path,
and it refuses anything else (:class:`~shards.errors.UnsafePath`). :func:`shards.manifest.check_format_version`
refuses caches written by a newer format (:class:`~shards.errors.UnsupportedFormat`).

The integrity root ``integrity.json`` (:func:`write_root`, written last by every writer of the
index or manifest) records the sha256 and size of ``index.parquet`` and ``manifest.json`` and the
cache id; :func:`read_cache_id` (what loaders, the trainer and ``shards.Cache`` call) and
``shards verify`` check both files against it, so an edited index value or a flipped bit in either
file is refused (:class:`~shards.errors.ShardCorrupt`) instead of read.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from . import fields, schema
from .checksum import COLUMN as CHECKSUM
from .errors import ShardCorrupt, UnsafePath
from .manifest import read_manifest
from .schema import INDEX_FILE, MANIFEST_FILE, PARTS_DIR, REJECTS_FILE, ROOT_FILE

#: ``file``: null for a member of the row's own shard; the sidecar tar name
#: (``shard-000003.codes_mimi.tar``) for a member of a field added by ``precompute add-field``.
#: Indexes written before sidecars have no ``file``: it reads as null.
#: ``member``: for an array packed in a container member (format 3: ``tensors.npz``, see
#: :mod:`shards.npz`), that member's name; null for an entry that is a tar member itself. Indexes
#: written before packing have no ``member``: it reads as null.
#: ``xxh3``: XXH3-64 of the bytes the entry locates (:mod:`shards.checksum`), checked on every read;
#: indexes written before it have none: it reads as null (unchecked). Readers that predate it
#: ignore the field, so it needs no new format version.
MEMBER_TYPE = pa.struct([
    ("name", pa.string()), ("offset", pa.int64()), ("size", pa.int64()),
    ("dtype", pa.string()), ("shape", pa.list_(pa.int64())), ("file", pa.string()),
    ("member", pa.string()), (CHECKSUM, pa.uint64()),
])
_ARROW_TYPES = {"int32": pa.int32(), "int64": pa.int64(), "bool": pa.bool_(), "float64": pa.float64(),
                "string": pa.string()}
#: derived: fixed head/tail columns + the columns contributed by fields (shards.fields)
INDEX_SCHEMA = pa.schema(
    [("key", pa.string()), ("shard", pa.string()), ("duration_s", pa.float64()), ("sample_rate", pa.int32())]
    + [(c.name, _ARROW_TYPES[c.type]) for c in fields.INDEX_FIELD_COLUMNS]
    + [("speaker", pa.string()), ("bytes", pa.int64()), ("sha256", pa.string()),
       ("members", pa.list_(MEMBER_TYPE))])
assert tuple(INDEX_SCHEMA.names) == schema.INDEX_COLUMNS
#: a sidecar index part: the sidecar's members per key, in the key order of its main shard
SIDECAR_PART_SCHEMA = pa.schema([("key", pa.string()), ("members", pa.list_(MEMBER_TYPE))])
REJECTS_SCHEMA = pa.schema([
    ("key", pa.string()), ("source", pa.string()), ("reason", pa.string()), ("detail", pa.string()),
])
_SHARD_META = b"shardcache.shard"
_JOB_META = b"shardcache.job"


# ------------------------------------------------------------------------------ safety checks

def unsafe_name_reason(name: Any) -> str | None:
    """Why ``name`` is not a plain relative file name (None when it is one). Filesystem-free."""
    if not isinstance(name, str):
        return f"is not a string (a {type(name).__name__})"
    if not name:
        return "is empty"
    if "\0" in name:
        return "contains a NUL byte"
    if name in (".", ".."):
        return "names a directory ('.' or '..'), not a file"
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (name[:1].isalpha() and name[1:2] == ":"):
        return "is an absolute path"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return "climbs out of the cache directory with '..'"
    if len(parts) > 1:
        return "contains a path separator (only files directly inside the cache directory are read)"
    return None


def safe_shard_path(cache_dir: str | Path, name: Any, what: str = "shard") -> Path:
    """``cache_dir / name`` for a shard name taken from an index row or ``manifest.json``.

    The one gate every path built from index/manifest data goes through. ``name`` must be a plain
    relative file name (no absolute path, no ``..``, no path separator); if ``cache_dir / name`` is
    a symlink it must resolve inside ``cache_dir`` (both resolved). Raises
    :class:`~shards.errors.UnsafePath` (a :class:`~shards.errors.ShardCorrupt`) naming the cache,
    the name and why. A name that does not exist is returned as is (callers report it missing).
    """
    root = Path(cache_dir)
    why = unsafe_name_reason(name)
    fix = ("an index or manifest.json may only name files directly inside the cache directory "
           "(rebuild them from trusted shard files with `shardcache shards reindex`)")
    path = root / name if why is None else None
    if path is not None and path.is_symlink():
        target = os.path.realpath(path)
        real_root = os.path.realpath(root)
        if os.path.commonpath([target, real_root]) != real_root:
            why = f"is a symlink to {target}, outside the cache directory"
            fix = "copy the file into the cache directory instead of linking to it"
    if why is not None:
        raise UnsafePath(f"{root}: refusing {what} name {name!r}: it {why}; {fix}")
    return path


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames inside it survive a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, write) -> None:
    """Call ``write(f)`` on a new binary file ``PATH.tmp``, fsync it, then rename it onto ``path``.

    The one way a cache file other than a shard tar is written: inside the cache's writing session
    (:func:`shards.writing.session`: the writer lock held, the folder owned), the temporary file
    created with ``O_EXCL | O_NOFOLLOW`` and a symlink at either name refused
    (:class:`~shards.errors.UnsafePath`), so nothing outside the cache is ever written through it.
    """
    from .writing import session
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with session(path) as s:
        fd = s.create(tmp)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            s.replace(tmp, path)
        except BaseException:
            s.unlink(tmp)
            raise
        s.fsync_dir(path)


def write_parquet_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` via a temporary file and rename (:func:`write_atomic`)."""
    write_atomic(path, lambda f: pq.write_table(table, f))


def write_json_atomic(obj: Any, path: Path) -> None:
    """Write ``obj`` as indented JSON to ``path`` via a temporary file and rename (:func:`write_atomic`)."""
    write_atomic(path, lambda f: f.write((json.dumps(obj, indent=2, sort_keys=False) + "\n").encode()))


def rows_to_table(rows: Iterable[dict]) -> pa.Table:
    """Index rows (dicts with :data:`INDEX_SCHEMA` fields) -> a typed Arrow table."""
    return pa.Table.from_pylist(list(rows), schema=INDEX_SCHEMA)


def rejects_to_table(rows: Iterable[dict]) -> pa.Table:
    """Reject rows (key, source, reason, detail) -> a typed Arrow table."""
    return pa.Table.from_pylist(
        [{k: str(r.get(k) or "") for k in REJECTS_SCHEMA.names} for r in rows], schema=REJECTS_SCHEMA)


def part_paths(out_dir: Path, stem: str) -> tuple[Path, Path]:
    """``(index_part, rejects_part)`` paths of shard ``stem`` (name without ``.tar``)."""
    parts = Path(out_dir) / PARTS_DIR
    return parts / f"{stem}.index.parquet", parts / f"{stem}.rejects.parquet"


def write_parts(out_dir: Path, stem: str, rows: list[dict], rejects: list[dict],
                shard_entry: dict | None, job_meta: dict | None = None) -> None:
    """Write a chunk's rejects part, then its index part (the done marker), both atomically.

    ``job_meta`` (JSON-able) is stored in the index part's metadata for the job that wrote it
    (e.g. which manifest rows the chunk covered); read it back with :func:`read_part_meta`.
    """
    index_part, rejects_part = part_paths(out_dir, stem)
    write_parquet_atomic(rejects_to_table(rejects), rejects_part)
    table = rows_to_table(rows).replace_schema_metadata(
        {_SHARD_META: json.dumps(shard_entry).encode(), _JOB_META: json.dumps(job_meta).encode()})
    write_parquet_atomic(table, index_part)


def read_part_shard_entry(index_part: Path) -> dict | None:
    """The shard entry stored in an index part's metadata, or None for a chunk with no samples."""
    meta = pq.read_metadata(index_part).metadata or {}  # the footer's key-value metadata (not the schema built)
    return json.loads(meta.get(_SHARD_META, b"null"))


def read_part_meta(index_part: Path) -> dict | None:
    """The ``job_meta`` stored by :func:`write_parts` (None when absent)."""
    meta = pq.read_metadata(index_part).metadata or {}  # the footer's key-value metadata (not the schema built)
    return json.loads(meta.get(_JOB_META, b"null"))


def file_sha256(path: str | Path, chunk: int = 4 << 20) -> str:
    """sha256 (hex) of a file's bytes, read in ``chunk``-byte blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


#: what a reader of the cache reads and checks against the root on every open (:func:`read_cache_id`)
_ROOT_COVERS = (INDEX_FILE, MANIFEST_FILE)
#: what the root covers besides: checked by ``shards verify`` and ``shardcache check`` (``full=True``)
_ROOT_ALSO = (REJECTS_FILE,)
#: the files of ``parts/`` the root covers: what a re-merge or ``shards reindex`` builds the cache files from
_PART_SUFFIXES = (".index.parquet", ".rejects.parquet", ".sidecar.parquet")
_JOB_PART = "job.json"


def covered_parts(cache_dir: str | Path) -> list[str]:
    """The names of the files in ``parts/`` that the integrity root covers: every index, rejects and
    sidecar part and stage one's ``job.json`` (not the lock, not add-field's pending file, not ``.tmp``)."""
    parts = Path(cache_dir) / PARTS_DIR
    if not parts.is_dir():
        return []
    return sorted(p.name for p in parts.iterdir()
                  if (p.name.endswith(_PART_SUFFIXES) or p.name == _JOB_PART) and p.is_file())


def _entry(p: Path) -> dict[str, Any]:
    return {"sha256": file_sha256(p), "bytes": p.stat().st_size}


def write_root(cache_dir: str | Path, cid: str) -> dict[str, Any]:
    """Write ``integrity.json``: ``{"cache_id": cid, "files": {name: {"sha256", "bytes"}}, "parts":
    {name: {"sha256", "bytes"}}}`` for ``index.parquet``, ``manifest.json`` and ``rejects.parquet``
    and every part :func:`covered_parts` names, as they are now (atomically; call it after writing
    them). Returns what it wrote."""
    d = Path(cache_dir)
    files = {n: _entry(d / n) for n in _ROOT_COVERS + _ROOT_ALSO if n in _ROOT_COVERS or (d / n).exists()}
    root = {"cache_id": cid, "files": files,
            "parts": {n: _entry(d / PARTS_DIR / n) for n in covered_parts(d)}}
    write_json_atomic(root, d / ROOT_FILE)
    return root


def _fix(d: Path) -> str:
    """What to do about a cache its root does not vouch for: wait for the command writing it now, else
    run again the stage-one job (or rerun) that stopped on it (:func:`shards.unfinished.unfinished`: a rebuild
    would lose rows), else rebuild (never a command that writes while another one runs)."""
    from .unfinished import unfinished
    from .writing import writer_of
    now = writer_of(d)
    if now is not None:
        return (f"it is being written right now by {now}: read it once that command has ended (nothing else to "
                "do; do not run another command that writes it meanwhile)")
    if (why := unfinished(d)) is not None:
        return why
    return (f"rebuild the index and root from the shard tars with `shardcache shards reindex {d}` (or rerun "
            "`shardcache precompute` on the same cache)")


def _differs(p: Path, want: Any, known: dict[str, str] | None = None) -> str | None:
    """Why file ``p`` is not what root entry ``want`` records (None when it is); ``known``: file name ->
    its sha256, already computed by the caller."""
    if not p.exists():
        return f"{p} is missing"
    if not isinstance(want, dict) or not isinstance(want.get("sha256"), str):
        return f"{p}: its entry in {ROOT_FILE} is unreadable"
    size = p.stat().st_size
    got = ((known or {}).get(p.name) or file_sha256(p)) if size == want.get("bytes") else None
    if got == want["sha256"]:
        return None
    what = f"sha256 {got[:16]}..." if got else f"{size} bytes"
    rec = f"sha256 {want['sha256'][:16]}..." if got else f"{want.get('bytes')} bytes"
    return (f"{p} does not match {ROOT_FILE} ({what}, recorded {rec}): it was changed or damaged after the cache "
            "was written, and reading it could give other data")


def root_problems(cache_dir: str | Path, full: bool = False,
                  known: dict[str, str] | None = None) -> tuple[dict[str, Any] | None, list[str]]:
    """``(root, problems)``: each way ``cache_dir``'s files differ from its integrity root, as a
    message naming the file and the fix. Always ``index.parquet`` and ``manifest.json`` (and the
    manifest's ``cache_id``); with ``full`` also ``rejects.parquet`` and every covered part of
    ``parts/`` (:func:`covered_parts`): changed, missing, or present and not covered (a part written
    after the last merge: an unfinished job). ``known``: ``{file name: sha256}`` the caller computed
    already (not hashed again). Raises ``FileNotFoundError`` when there is no index."""
    d = Path(cache_dir)
    if not (d / INDEX_FILE).exists():
        raise FileNotFoundError(f"{d / INDEX_FILE} not found: is {cache_dir} a shardcache cache?")
    try:
        root = json.loads((d / ROOT_FILE).read_text())
        files, cid = root["files"], root["cache_id"]
        if not isinstance(cid, str) or not all(isinstance(files[n]["sha256"], str) for n in _ROOT_COVERS):
            raise TypeError("wrong types")
    except FileNotFoundError:
        return None, [f"{d / ROOT_FILE} is missing: nothing vouches for {INDEX_FILE} and {MANIFEST_FILE} "
                      f"(a cache written before integrity roots, a partial copy, or a rerun under way); {_fix(d)}"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, [f"{d / ROOT_FILE} is unreadable ({type(e).__name__}: {e}); {_fix(d)}"]
    probs = [why for n in _ROOT_COVERS if (why := _differs(d / n, files[n], known)) is not None]
    if not probs:
        mid = read_manifest(d).get("cache_id")
        if mid != cid:
            probs.append(f"{d / MANIFEST_FILE} records cache id {mid}, {ROOT_FILE} {cid}")
    if full:
        for n in _ROOT_ALSO:
            if n not in files:
                if (d / n).exists():
                    probs.append(f"{d / n} is not covered by {ROOT_FILE} (a root written before it covered "
                                 f"{n}): nothing vouches for it")
            elif (why := _differs(d / n, files[n])) is not None:
                probs.append(why)
        listed = root.get("parts")
        if not isinstance(listed, dict):
            if covered_parts(d):
                probs.append(f"{d / PARTS_DIR}: {ROOT_FILE} covers none of its parts (a root written before it "
                             "covered them): nothing vouches for what a re-merge would build the index from")
        else:
            on_disk = set(covered_parts(d))
            for n in sorted(on_disk | set(listed)):
                p = d / PARTS_DIR / n
                if n not in listed:
                    probs.append(f"{p} is not covered by {ROOT_FILE}: written after the cache's last merge (an "
                                 "unfinished precompute or add-field: run it again to finish), or planted")
                elif (why := _differs(p, listed[n])) is not None:
                    probs.append(why)
    return root, [f"{p}; {_fix(d)}" for p in probs]


def verify_root(cache_dir: str | Path, full: bool = False) -> dict[str, Any]:
    """Check ``index.parquet`` and ``manifest.json`` (``full``: also ``rejects.parquet`` and the parts)
    against ``integrity.json``; return the root.

    Raises :class:`~shards.errors.ShardCorrupt` with the first of :func:`root_problems` (naming the
    file and the fix: the root missing or unreadable, a file's size or sha256 other than recorded,
    ``manifest.json``'s ``cache_id`` other than the root's); ``FileNotFoundError`` when
    ``cache_dir`` has no index.
    """
    root, probs = root_problems(cache_dir, full)
    if probs:
        raise ShardCorrupt(probs[0])
    return root


def read_cache_id(cache_dir: str | Path) -> str:
    """The verified ``cache_id`` of the cache in ``cache_dir`` (a local folder): the root's, once
    :func:`verify_root` has checked ``index.parquet`` and ``manifest.json`` against it.

    Raises :class:`~shards.errors.ShardCorrupt` (naming the file and ``shards reindex``) when they
    do not match the root, ``FileNotFoundError`` when there is no index."""
    from .storage import local_path  # (storage imports this module)
    return verify_root(local_path(cache_dir))["cache_id"]  # a file:// URL is a local folder


# ------------------------------------------------------------------------------ sidecar fields

def sidecar_part_path(out_dir: Path, shard: str, field_name: str) -> Path:
    """``parts/shard-000003.codes_mimi.sidecar.parquet``: the commit marker of one sidecar tar."""
    return Path(out_dir) / PARTS_DIR / f"{shard[:-4]}.{field_name}.sidecar.parquet"


def write_sidecar_part(out_dir: Path, shard: str, field_name: str, rows: list[dict], entry: dict) -> None:
    """Write a sidecar's part (``key``, ``members`` with ``file`` set; ``entry`` = the sidecar's
    manifest entry ``{path, shard, samples, bytes, sha256}`` in the metadata), atomically."""
    p = sidecar_part_path(out_dir, shard, field_name)
    t = pa.Table.from_pylist(rows, schema=SIDECAR_PART_SCHEMA).replace_schema_metadata(
        {_SHARD_META: json.dumps(entry).encode()})
    write_parquet_atomic(t, p)


def sidecar_parts(out_dir: Path, field_name: str) -> list[Path]:
    return sorted((Path(out_dir) / PARTS_DIR).glob(f"*.{field_name}.sidecar.parquet"))


def read_sidecar_parts(out_dir: Path, field_name: str) -> tuple[pa.Table, list[dict]]:
    """``(key + members table of every sidecar part, their manifest entries)``."""
    tables, entries = [], []
    for p in sidecar_parts(out_dir, field_name):
        tables.append(pq.read_table(p, schema=SIDECAR_PART_SCHEMA))
        entry = read_part_shard_entry(p)
        if entry:
            entries.append(entry)
    t = pa.concat_tables(tables) if tables else SIDECAR_PART_SCHEMA.empty_table()
    return t, entries


def attach_sidecar(index: pa.Table, sidecar: tuple[pa.Table, list[dict]] | pa.Table) -> pa.Table:
    """``index`` with each row's ``members`` extended by the sidecar members of the same key
    (vectorised: no per-row Python). Rows without a sidecar row keep their members."""
    side = sidecar[0] if isinstance(sidecar, tuple) else sidecar
    if side.num_rows == 0 or index.num_rows == 0:
        return index
    import numpy as np
    import pyarrow.compute as pc
    pos = pc.index_in(index.column("key"), value_set=side.column("key").combine_chunks())
    pos = pos.to_numpy(zero_copy_only=False)
    have = ~np.isnan(pos.astype(float)) if pos.dtype.kind == "f" else np.ones(len(pos), bool)
    pos = np.where(have, np.nan_to_num(pos.astype(float), nan=0), 0).astype(np.int64)
    a = index.column("members").combine_chunks()
    b = side.column("members").combine_chunks().take(pa.array(pos))
    a_off = a.offsets.to_numpy().astype(np.int64)
    b_off = b.offsets.to_numpy().astype(np.int64)
    la = np.diff(a_off)
    lb = np.where(have, np.diff(b_off), 0)
    n_a = len(a.values)  # offsets are absolute into .values
    values = pa.concat_arrays([a.values, b.values])
    new_off = np.concatenate([[0], np.cumsum(la + lb)])
    take = np.empty(int(new_off[-1]), dtype=np.int64)
    row_of = np.repeat(np.arange(len(la)), la + lb)
    within = np.arange(len(take)) - new_off[:-1][row_of]
    from_a = within < la[row_of]
    take[from_a] = a_off[:-1][row_of[from_a]] + within[from_a]
    take[~from_a] = n_a + b_off[:-1][row_of[~from_a]] + (within[~from_a] - la[row_of[~from_a]])
    merged = pa.ListArray.from_arrays(pa.array(new_off.astype(np.int32)), values.take(pa.array(take)))
    merged = merged.cast(pa.list_(MEMBER_TYPE))
    return index.set_column(index.schema.get_field_index("members"), INDEX_SCHEMA.field("members"), merged)


def detach_field(index: pa.Table, field_name: str) -> pa.Table:
    """``index`` without the members of field ``field_name``: its ``FIELD.npy`` members and every
    member of its sidecar tars (a producer may write several fields into one sidecar)."""
    rows = index.column("members").to_pylist()
    member = f"{field_name}.npy"

    def mine(m: dict) -> bool:
        side = fields.parse_sidecar_name(m.get("file")) if m.get("file") else None
        return m["name"] == member or (side is not None and side[1] == field_name)

    kept = [[m for m in r or [] if not mine(m)] for r in rows]
    return index.set_column(index.schema.get_field_index("members"), INDEX_SCHEMA.field("members"),
                            pa.array(kept, pa.list_(MEMBER_TYPE)))


def read_index(out_dir: Path) -> pa.Table:
    """Read ``OUT/index.parquet``. Raises ``FileNotFoundError`` naming the path and the fix."""
    p = Path(out_dir) / INDEX_FILE
    if not p.exists():
        from .unfinished import unfinished
        if (why := unfinished(Path(out_dir))) is not None:  # a stage-one job that stopped: rerun it, not reindex
            raise FileNotFoundError(why)
        raise FileNotFoundError(f"{p} not found: is {out_dir} a shardcache cache? "
                                "(run `shardcache precompute`, or `shardcache shards reindex` to rebuild it)")
    return pq.read_table(p, schema=INDEX_SCHEMA)


def read_rejects(out_dir: Path) -> pa.Table:
    """Read ``OUT/rejects.parquet`` (an empty table when absent)."""
    p = Path(out_dir) / REJECTS_FILE
    return pq.read_table(p, schema=REJECTS_SCHEMA) if p.exists() else REJECTS_SCHEMA.empty_table()
