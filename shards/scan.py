"""Read a shard tar once and derive its index rows: member byte offsets, shapes, dtypes, sha256.

This is the single source of truth for index rows: the writer calls it on every shard it
finishes, and ``shards reindex`` / ``shards verify`` call it on existing tars.

Index entries per sample: one per tar member (``json``; ``tensors.npz``, dtype ``"npz"``;
``NAME.npy`` for an array stored as a member of its own: latents, sidecar fields), plus, for a packed ``tensors.npz`` member, one
entry per array it holds (``NAME.npy`` with the array payload's offset/size/dtype/shape and
``member="tensors.npz"``; see :mod:`shards.npz`). So an array is always found by ``NAME.npy``,
whether it is a member of its own or packed. Every entry carries the XXH3-64 checksum of the
bytes it locates (:mod:`shards.checksum`): what every read checks.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import tarfile
from pathlib import Path
from typing import Any


from .checksum import COLUMN as CHECKSUM, checksum
from .errors import ShardCorrupt, UnsafeMember
from . import fields, npz
from .schema import JSON_MEMBER, PICKLE_EXTENSIONS


_TWICE_FIX = ("two samples were written under one key, and a reader would keep only one of them: "
              "rerun `shardcache precompute` into a new --cache")

#: ``.npy`` header parser (kept under its old name for callers of this module)
npy_payload = npz.npy_header


def sample_sha256(members: dict[str, bytes]) -> str:
    """sha256 of one sample: over ``name \\0 bytes`` of each member in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(members):
        h.update(name.encode())
        h.update(b"\0")
        h.update(members[name])
    return h.hexdigest()


def _row(key: str, shard: str, members: dict[str, bytes], where: dict[str, tuple[int, int]]) -> dict:
    meta: dict[str, Any] = {}
    entries = []
    shapes: dict[str, tuple[int, ...]] = {}
    for name in sorted(members):
        data = members[name]
        offset, size = where[name]
        if name == JSON_MEMBER:
            try:
                meta = json.loads(data)
            except ValueError as e:
                raise ShardCorrupt(f"{shard}: sample {key!r} has invalid JSON: {e}") from e
            entries.append(dict(name=name, offset=offset, size=size, dtype="json", shape=[],
                                **{CHECKSUM: checksum(data)}))
        elif name.endswith(".npy"):
            try:
                hlen, dtype, shape = npy_payload(data)
            except ValueError as e:
                raise ShardCorrupt(f"{shard}: sample {key!r} member {name}: {e}") from e
            shapes[name] = shape
            entries.append(dict(name=name, offset=offset + hlen, size=size - hlen, dtype=dtype,
                                shape=list(shape), **{CHECKSUM: checksum(memoryview(data)[hlen:])}))
        elif name == npz.MEMBER:  # the packed arrays: one entry for the member, one per array
            try:
                inner = npz.entries(data)
            except ValueError as e:
                raise ShardCorrupt(f"{shard}: sample {key!r} member {name}: {e}") from e
            entries.append(dict(name=name, offset=offset, size=size, dtype="npz", shape=[],
                                **{CHECKSUM: checksum(data)}))
            for array, off, n, dtype, shape in inner:
                shapes[array + ".npy"] = shape
                entries.append(dict(name=array + ".npy", offset=offset + off, size=n, dtype=dtype, shape=list(shape),
                                    member=name, **{CHECKSUM: checksum(memoryview(data)[off:off + n])}))
        else:
            entries.append(dict(name=name, offset=offset, size=size, dtype="bytes", shape=[],
                                **{CHECKSUM: checksum(data)}))
    return dict(
        key=key,
        shard=shard,
        duration_s=float(meta.get("duration_s", 0.0)),
        sample_rate=int(meta.get("sample_rate", 0)),
        **fields.index_column_values(shapes),  # num_samples, n_frames, ... (shards.fields)
        speaker=str(meta.get("speaker") or ""),
        bytes=sum(len(v) for v in members.values()),
        sha256=sample_sha256(members),
        members=entries,
    )


def scan_shard(path: str | Path, shard_name: str | None = None) -> tuple[list[dict], str, int]:
    """Scan a shard tar and return ``(rows, shard_sha256, shard_bytes)``.

    ``rows`` are index rows (see :data:`shards.schema.INDEX_COLUMNS`) in tar order. Offsets are
    absolute byte offsets into the tar file. Raises :class:`ShardCorrupt` for a truncated or
    unreadable tar, a member without a key, or a key held twice (its members not contiguous, or
    one member name twice: webdataset raises "duplicate file name" for both), and
    :class:`UnsafeMember` for a member that would need unpickling. Nothing is unpickled.
    """
    path = Path(path)
    shard = shard_name or path.name
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ShardCorrupt(f"{path}: empty file")
        raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # no copy of the whole tar in RAM
    rows: list[dict] = []
    members: dict[str, bytes] = {}
    where: dict[str, tuple[int, int]] = {}
    current: str | None = None
    seen: set[str] = set()
    try:
        with open(path, "rb") as fh, tarfile.open(fileobj=fh, mode="r:") as tf:
            for info in tf:
                if not info.isfile():
                    continue
                key, dot, ext = info.name.rpartition("/")[2].partition(".")
                if not dot or not key:
                    raise ShardCorrupt(f"{path}: member {info.name!r} has no KEY.ext name")
                if ("." + ext.lower()).endswith(PICKLE_EXTENSIONS):
                    raise UnsafeMember(
                        f"{path}: sample {key!r} has member {info.name!r} that would need "
                        "unpickling; shardcache never unpickles shard data")
                if key != current:
                    if current is not None:
                        rows.append(_row(current, shard, members, where))
                    if key in seen:  # (webdataset raises "duplicate file name" for such a tar)
                        raise ShardCorrupt(f"{path}: holds sample key {key!r} twice (its members are not "
                                           f"contiguous); {_TWICE_FIX}")
                    seen.add(key)
                    current, members, where = key, {}, {}
                elif ext in members:  # the same member name again: a second sample under one key
                    raise ShardCorrupt(f"{path}: holds sample key {key!r} twice (member {info.name!r} "
                                       f"appears twice); {_TWICE_FIX}")
                end = info.offset_data + info.size
                if end > len(raw):
                    raise ShardCorrupt(f"{path}: truncated inside member {info.name!r}")
                members[ext] = raw[info.offset_data:end]
                where[ext] = (info.offset_data, info.size)
    except (tarfile.TarError, EOFError) as e:
        raise ShardCorrupt(f"{path}: not a readable tar ({e}); delete it and rerun precompute "
                           "or `shardcache shards reindex`") from e
    if current is not None:
        rows.append(_row(current, shard, members, where))
    return rows, hashlib.sha256(raw).hexdigest(), len(raw)  # mmap closes when garbage collected


def unindexed_members(index) -> list[str]:
    """Where a shard holds tar members its index does not locate: ``["SHARD: N bytes before
    member M of sample K", ...]`` (empty for a cache written by :class:`shards.writer.ShardWriter`).

    Reads only ``index`` (a table with ``key``, ``shard`` and ``members``): within each shard the
    whole tar members the index locates (``member`` and ``file`` null) must follow one another with
    no more than a header (:data:`shards.columns.MAX_HEADER` bytes) between them. A gap is a member nobody
    reads: a second sample under a key already there (what a scanner that kept one of them wrote into the
    index), or anything else written into the tar after the fact. A reader that refuses such an
    index refuses a tar holding a key twice without reading the tar. Vectorised: only the members named
    in a message become Python strings. (:meth:`shards.Cache.open` finds the same while it reads the
    index into columns: :mod:`shards.columns`.)
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from .columns import MAX_HEADER, NPY_SLACK
    from .schema import WHOLE_MEMBER_DTYPES

    if index.num_rows == 0:
        return []
    members = index.column("members").combine_chunks()
    flat = members.flatten()
    row = np.repeat(np.arange(len(members)), np.diff(members.offsets.to_numpy()))
    whole = np.flatnonzero(pc.and_(pc.is_null(flat.field("member")), pc.is_null(flat.field("file")))
                           .to_numpy(zero_copy_only=False))
    shard = index.column("shard").combine_chunks().dictionary_encode().indices.to_numpy()[row[whole]]
    offset = flat.field("offset").to_numpy(zero_copy_only=False)[whole]
    size = flat.field("size").to_numpy(zero_copy_only=False)[whole]
    order = np.lexsort((offset, shard))
    shard, offset, size, rows, pos = shard[order], offset[order], size[order], row[whole][order], whole[order]
    # a whole .npy member's entry (formats 1-2) locates its payload after the .npy header: allow for it
    npy = ~pc.is_in(flat.field("dtype").take(pa.array(pos)), value_set=pa.array(list(WHOLE_MEMBER_DTYPES))) \
        .to_numpy(zero_copy_only=False).astype(bool)
    slack = np.where(npy, NPY_SLACK, 0)
    end = -(-(offset + size) // 512) * 512
    same = shard[1:] == shard[:-1]
    gap = offset[1:] - end[:-1]
    bad = np.nonzero(same & (gap > MAX_HEADER + slack[1:]))[0][:20]
    if not len(bad):
        return []
    names = flat.field("name").take(pa.array(pos[bad + 1])).to_pylist()
    at = pa.array(rows[bad + 1])
    keys, shards = index.column("key").take(at).to_pylist(), index.column("shard").take(at).to_pylist()
    return [f"{s}: {int(gap[i])} bytes the index does not locate before member {n!r} of sample {k!r} (a key held "
            f"twice, or members added to the tar)" for i, n, k, s in zip(bad.tolist(), names, keys, shards)]
