"""The index as bytes (issue 48 item 3, shards.columns): what a loader's rank holds per sample.

* the store built from ``index.parquet`` holds what the Arrow index says, row for row (every field's
  offsets, shapes, presence, checksums and files; the keys; the shards; the furthest byte of each
  file), computed here independently from the index table;
* what no index may hold (bytes of a shard no entry locates, a member that would need unpickling) is
  found by the store as by the whole-table checks, also when the index is read in many small batches
  and its rows are not in tar order;
* a loader's construction allocates no Python object per sample: at two cache sizes, the interpreter's
  allocated blocks and traced bytes added by the construction do not grow with the number of samples;
* a DataLoader worker's copy of the reader carries no per-sample array (it maps the store's files).
"""
from __future__ import annotations

import gc
import pickle
import random
import shutil
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from shards import Cache, ShardWriter, merge_parts, shard_name
from shards.columns import IndexColumns, build
from shards.index import read_index, rows_to_table, write_parquet_atomic, write_root
from shards.manifest import read_manifest

MANIFEST = {"n_codebooks": 4, "codebook_size": 64, "text": {"vocab_size": 50, "pad_id": 0}}


def tiny_cache(out: Path, n: int, per_shard: int = 500, seed: int = 0) -> Path:
    """``n`` small samples: codes int16 (4, 1..3), input_ids/labels int32 (2..5,), latents on every 7th."""
    rng = np.random.default_rng(seed)
    i = 0
    for s in range(-(-n // per_shard)):
        w = ShardWriter(out, shard_name(0, s))
        for _ in range(min(per_shard, n - i)):
            ids = rng.integers(0, 50, size=2 + i % 4).astype(np.int32)
            fields = {"json": {"speaker": f"spk{i % 5}", "duration_s": 0.1, "sample_rate": 24000},
                      "codes.npy": rng.integers(0, 64, size=(4, 1 + i % 3)).astype(np.int16),
                      "input_ids.npy": ids, "labels.npy": ids.copy()}
            if i % 7 == 0:
                fields["latents.npy"] = rng.standard_normal((4, 1, 2, 2)).astype(np.float16)
            w.add(f"k{i:07d}", fields)
            i += 1
        w.commit()
    merge_parts(out, dict(MANIFEST))
    return out


@pytest.fixture(scope="module")
def sidecar_cache(demo_cache, tmp_path_factory) -> Path:
    """The demo cache (the session's, shared with the other tests) with a field added by add-field
    (sidecar tars)."""
    from precompute.add_field import add_field
    c = tmp_path_factory.mktemp("columns") / "c"
    shutil.copytree(demo_cache, c)
    add_field(c, "audio_16k", {"producer": "waveform", "sample_rate": 16000}, progress=False)
    return c


def test_the_store_holds_what_the_index_says(sidecar_cache, tmp_path):
    build(sidecar_cache / "index.parquet", tmp_path / "store")
    cols = IndexColumns(tmp_path / "store")
    table = read_index(sidecar_cache)
    rows = table.to_pylist()
    shards = sorted({r["shard"] for r in rows})
    sidecars = sorted({m["file"] for r in rows for m in r["members"] if m.get("file")})
    assert cols.n == len(rows) and cols.shards == shards and cols.files == shards + sidecars and sidecars
    assert cols.keys_at(np.arange(cols.n)) == [r["key"] for r in rows] == cols.key_array.to_pylist()
    assert cols.shard_of.tolist() == [shards.index(r["shard"]) for r in rows]
    for col in ("n_frames", "sample_rate", "has_image"):
        assert np.asarray(getattr(cols, col)).tolist() == [int(r[col]) for r in rows], col
    files = cols.files
    need = [0] * len(files)
    for r in rows:
        for m in r["members"]:
            f = files.index(m["file"]) if m.get("file") else shards.index(r["shard"])
            need[f] = max(need[f], m["offset"] + m["size"])
    assert cols.need.tolist() == need
    names = sorted({m["name"][:-4] for r in rows for m in r["members"] if m["name"].endswith(".npy")})
    assert sorted(cols.meta["fields"]) == names and "audio_16k" in names
    for name in names:
        fc = cols.field(name)
        assert cols.field_problem(name) is None, name
        for i, r in enumerate(rows):
            m = next((m for m in r["members"] if m["name"] == name + ".npy"), None)
            assert bool(fc.present[i]) == (m is not None), (name, i)
            if m is None:
                continue
            assert (int(fc.off[i]), fc.shape[i].tolist(), int(fc.xxh3[i])) == (m["offset"], m["shape"], m["xxh3"])
            side = 0 if not m.get("file") else files.index(m["file"]) + 1
            assert (0 if fc.side is None else int(fc.side[i])) == side, (name, i)
            assert fc.dtypes[0 if fc.code is None else int(fc.code[i])] == np.dtype(m["dtype"])


def _reorder_and_duplicate(cache: Path) -> None:
    """The cache's index with a key's members written twice into its tar (the copy hidden: no entry
    locates it, as an older scanner that kept one of them indexed it), and the index rows shuffled."""
    import io
    import tarfile
    from shards.scan import scan_shard
    p = sorted(cache.glob("shard-*.tar"))[1]
    with tarfile.open(p) as tf:
        members = [(ti, tf.extractfile(ti).read()) for ti in tf.getmembers()]
    first = members[0][0].name.split(".")[0]
    n = sum(ti.name.split(".")[0] == first for ti, _ in members)

    def write(hidden_key):
        copies = []
        for ti, data in members[:n]:
            c = tarfile.TarInfo(hidden_key + ti.name[len(first):])
            c.size, c.mtime, c.mode, c.uname, c.gname = ti.size, ti.mtime, ti.mode, ti.uname, ti.gname
            copies.append((c, data))
        p.chmod(0o644)
        with open(p, "wb") as fh, tarfile.open(fileobj=fh, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for ti, data in members[:n] + copies + members[n:]:
                tf.addfile(ti, io.BytesIO(data))

    hidden = first[:-1] + "x"
    write(hidden)
    rows = [r for r in scan_shard(p)[0] if r["key"] != hidden]
    write(first)
    index = [r for r in read_index(cache).to_pylist() if r["shard"] != p.name] + rows
    random.Random(0).shuffle(index)
    write_parquet_atomic(rows_to_table(index), cache / "index.parquet")
    write_root(cache, read_manifest(cache)["cache_id"])


@pytest.mark.parametrize("batch_rows", [7, 1 << 16])
def test_hidden_members_are_found_in_any_row_order_and_batch_size(tmp_path, monkeypatch, batch_rows):
    """Rows in index order, and shuffled, read 7 rows at a time or all at once: the store names the
    bytes no entry locates exactly as the whole-table check does (shards.scan.unindexed_members)."""
    from shards import columns
    from shards.scan import unindexed_members
    cache = tiny_cache(tmp_path / "c", 60, per_shard=20)
    monkeypatch.setattr(columns, "BATCH_ROWS", batch_rows)
    build(cache / "index.parquet", tmp_path / "clean")
    assert IndexColumns(tmp_path / "clean").problems == []
    _reorder_and_duplicate(cache)
    want = unindexed_members(read_index(cache))
    assert len(want) == 1 and "bytes the index does not locate" in want[0]
    build(cache / "index.parquet", tmp_path / "store")
    assert IndexColumns(tmp_path / "store").problems == [("hidden", want[0])]


def test_a_member_that_would_need_unpickling_is_found_with_the_table_checks_words(tmp_path):
    from shards import UnsafeMember
    from shards.reader import refuse_unsafe
    cache = tiny_cache(tmp_path / "c", 30, per_shard=10)
    rows = read_index(cache).to_pylist()
    for r in rows[12], rows[25]:
        r["members"].append(dict(name="extra.pkl", offset=0, size=4, dtype="bytes", shape=[]))
    table = rows_to_table(rows)
    write_parquet_atomic(table, cache / "index.parquet")
    write_root(cache, read_manifest(cache)["cache_id"])
    with pytest.raises(UnsafeMember) as e:
        refuse_unsafe(table, cache)
    build(cache / "index.parquet", tmp_path / "store")
    assert IndexColumns(tmp_path / "store").problems == [("unpickle", str(e.value))]
    assert "2 such member(s)" in str(e.value) and "k0000012" in str(e.value)


def _construction(cache: Path) -> tuple[int, int]:
    """(interpreter blocks, traced bytes) a ShardLoader's construction over ``cache`` adds and keeps."""
    from loaders import ShardLoader
    gc.collect()
    blocks = sys.getallocatedblocks()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    loader = ShardLoader(cache, 4, seed=0, fields=("codes", "input_ids", "labels"))
    gc.collect()
    added = (sys.getallocatedblocks() - blocks, tracemalloc.get_traced_memory()[0] - before)
    tracemalloc.stop()
    loader.close()
    return added


def test_a_loaders_index_holds_no_python_object_per_sample(tmp_path, monkeypatch):
    """The construction at 1,000 and at 6,000 samples: the blocks it allocates differ by less than one per
    50 samples (one object per sample, a key string, would be 5,000 blocks more), and the bytes it keeps
    grow by at most 16 per sample (the epoch plan's int64 ids, 8 per sample; the rest is mapped from the
    store's files, shared by every process)."""
    monkeypatch.setenv("SHARDCACHE_INDEX_CACHE", str(tmp_path / "stores"))
    # (two shards each: a loader holds a few objects per shard, its file names and descriptors)
    small, big = tiny_cache(tmp_path / "s", 1000, per_shard=500), tiny_cache(tmp_path / "b", 6000, per_shard=3000)
    for c in (small, big):
        Cache.open(c)  # the stores built (the first open of a node), the modules imported
    _construction(small)
    (b1, t1), (b2, t2) = _construction(small), _construction(big)
    assert b2 - b1 < 5000 / 50, (b1, b2)
    assert (t2 - t1) / 5000 <= 16, (t1, t2)


def test_a_workers_copy_of_the_reader_maps_the_store(tmp_path, monkeypatch):
    """What a DataLoader worker receives (the pickled reader of a loader) is the same small message at
    1,000 and 6,000 samples, filtered or not: the worker maps the store's files (and the kept rows' file)."""
    from loaders import ShardLoader
    monkeypatch.setenv("SHARDCACHE_INDEX_CACHE", str(tmp_path / "stores"))
    sizes = {}
    for n in (1000, 6000):
        cache = tiny_cache(tmp_path / f"c{n}", n, per_shard=n // 2)  # (two shards: a name each is sent too)
        for filters in (None, {"n_frames": (2, 3)}):
            ld = ShardLoader(cache, 4, seed=0, filters=filters)
            blob = pickle.dumps(ld._plan_dataset.sources)
            sizes[(n, filters is None)] = len(blob)
            again = pickle.loads(blob)
            assert again.sources[0].reader.keys_at(np.arange(3)) == ld.sources.sources[0].reader.keys_at(np.arange(3))
            ld.close()
    assert abs(sizes[(6000, True)] - sizes[(1000, True)]) < 200, sizes
    assert abs(sizes[(6000, False)] - sizes[(1000, False)]) < 200, sizes


def test_a_member_stored_with_two_dtypes_keeps_each_rows_dtype(tmp_path, monkeypatch):
    """One row's input_ids entry says int64 (rows 0-19 int32, read 7 rows at a time: the second dtype shows
    in the third batch): every row's dtype and size check stay its own."""
    from shards import columns
    monkeypatch.setattr(columns, "BATCH_ROWS", 7)
    cache = tiny_cache(tmp_path / "c", 20, per_shard=20)
    rows = read_index(cache).to_pylist()
    m = next(m for m in rows[16]["members"] if m["name"] == "input_ids.npy")
    m["dtype"], m["size"] = "<i8", m["size"] * 2
    write_parquet_atomic(rows_to_table(rows), cache / "index.parquet")
    build(cache / "index.parquet", tmp_path / "store")
    cols = IndexColumns(tmp_path / "store")
    fc = cols.field("input_ids")
    assert [fc.dtypes[int(c)] for c in fc.code] == [np.dtype("int64") if i == 16 else np.dtype("int32") for i in range(20)]
    assert cols.field_problem("input_ids") is None  # 8-byte items: the doubled size is its shape's
    m["size"] = m["size"] // 2
    write_parquet_atomic(rows_to_table(rows), cache / "index.parquet")
    build(cache / "index.parquet", tmp_path / "store2")
    assert "k0000016" in IndexColumns(tmp_path / "store2").field_problem("input_ids")
