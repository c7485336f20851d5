"""Rank 0's merge of the parts (shards.merge) reads them one at a time (issue 48 item 1): it never holds the
whole index as one table, and what it writes is the parts in order, row groups of ROW_GROUP_ROWS rows,
with the counts and the cache id computed here independently from the parts."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shards.merge as merge
from shards import ShardCorrupt, ShardWriter, merge_parts, shard_name
from shards.card import CARD_FILE, index_members, write_dataset_card
from shards.index import INDEX_SCHEMA, PARTS_DIR, part_paths, write_parts
from shards.manifest import read_manifest

MANIFEST = {"n_codebooks": 4, "codebook_size": 64, "text": {"vocab_size": 50, "pad_id": 0}}
SHARDS, PER_SHARD, ROW_GROUP = 40, 25, 64  # 1,000 rows: 15 row groups of 64 and one of 40


def written(out: Path, shards: int = SHARDS) -> Path:
    """``shards`` shards of ``PER_SHARD`` small samples (latents on every 5th), merged once."""
    rng = np.random.default_rng(0)
    for s in range(shards):
        w = ShardWriter(out, shard_name(0, s))
        for j in range(PER_SHARD):
            i = s * PER_SHARD + j
            ids = rng.integers(0, 50, size=2 + i % 4).astype(np.int32)
            fields = {"json": {"speaker": f"spk{i % 3}", "duration_s": 0.25 + i % 2, "sample_rate": 24000},
                      "codes.npy": rng.integers(0, 64, size=(4, 1 + i % 3)).astype(np.int16),
                      "input_ids.npy": ids, "labels.npy": ids.copy()}
            if i % 5 == 0:
                fields["latents.npy"] = rng.standard_normal((4, 1, 2, 2)).astype(np.float16)
            w.add(f"k{i:06d}", fields)
        w.commit()
    merge_parts(out, dict(MANIFEST))
    return out


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(merge, "ROW_GROUP_ROWS", ROW_GROUP)
    return written(tmp_path / "c")


def parts_in_order(cache: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(p, schema=INDEX_SCHEMA)
                            for p in sorted((cache / PARTS_DIR).glob("*.index.parquet")))


def test_the_merge_holds_a_row_group_not_the_index(tmp_path, monkeypatch):
    """160 parts of 25 rows, row groups of 64: what the merge holds (a row group, the parts not yet copied,
    the keys) stays a small part of the index, whose one table the merge held before."""
    monkeypatch.setattr(merge, "ROW_GROUP_ROWS", ROW_GROUP)
    cache = written(tmp_path / "c", 4 * SHARDS)
    whole = parts_in_order(cache).nbytes
    read, alive = merge._read_part, []

    def counted(*a, **k):  # Arrow's bytes in use each time the merge reads a part
        alive.append(pa.total_allocated_bytes() - base)
        return read(*a, **k)

    monkeypatch.setattr(merge, "_read_part", counted)
    base = pa.total_allocated_bytes()
    merge_parts(cache, dict(MANIFEST))
    assert len(alive) >= 8 * SHARDS  # every index and rejects part, read by the merge
    assert max(alive) < whole / 8, (max(alive), whole)  # (the whole index in one table: > whole)


@pytest.mark.parametrize("row_group, compact", [(ROW_GROUP, 32), (10_000, 3)])
def test_the_merged_index_is_the_parts_in_order(tmp_path, monkeypatch, row_group, compact):
    """Row groups of ``row_group`` rows; (10,000, 3): one row group, the parts held copied into one every 3."""
    monkeypatch.setattr(merge, "ROW_GROUP_ROWS", row_group)
    monkeypatch.setattr(merge, "COMPACT_TABLES", compact)
    cache = written(tmp_path / "c")
    parts = parts_in_order(cache)
    f = pq.ParquetFile(cache / "index.parquet")
    n = SHARDS * PER_SHARD
    assert [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)] == \
        [row_group] * (n // row_group) + [n % row_group]
    assert f.read().to_pylist() == parts.to_pylist()
    rows = parts.to_pylist()
    lines = "".join(f"{r['key']}\t{r['shard']}\t{r['sha256'] or ''}\n" for r in rows)
    m = read_manifest(cache)
    assert m["cache_id"] == hashlib.sha256(lines.encode()).hexdigest()[:16]
    assert m["counts"]["samples"] == n and m["counts"]["images"] == sum(r["has_image"] for r in rows) == n // 5
    assert m["counts"]["audio_hours"] == round(sum(r["duration_s"] for r in rows) / 3600, 6)
    assert m["counts"]["shards"] == SHARDS and [s["path"] for s in m["shards"]] == sorted({r["shard"] for r in rows})
    card = (cache / CARD_FILE).read_text()
    write_dataset_card(cache, m, index_members(parts))  # the card of the whole table at once
    assert (cache / CARD_FILE).read_text() == card


def test_a_key_in_two_parts_is_refused_and_nothing_is_written(cache):
    before = {n: (cache / n).read_bytes() for n in ("index.parquet", "manifest.json", "integrity.json")}
    first, last = shard_name(0, 0)[:-4], shard_name(0, SHARDS - 1)[:-4]
    a, b = (pq.read_table(part_paths(cache, s)[0], schema=INDEX_SCHEMA) for s in (first, last))
    meta = pq.read_metadata(part_paths(cache, last)[0]).metadata
    rows = b.to_pylist()
    rows[-1]["key"] = a.column("key")[3].as_py()  # the last shard's last row: a key of the first shard
    write_parts(cache, last, rows, [], json.loads(meta[b"shardcache.shard"]))
    with pytest.raises(ShardCorrupt, match=r"duplicate keys across shards: \['k000003'\]; nothing was written"):
        merge_parts(cache, dict(MANIFEST))
    assert {n: (cache / n).read_bytes() for n in before} == before
    assert not list(cache.glob("*.tmp"))


def test_more_rows_than_a_row_group_at_the_real_size(tmp_path):
    """70,000 index rows in 10 parts (written as the job writes its parts; no tar is read by a merge) with the
    real ROW_GROUP_ROWS: two row groups, 65,536 and 4,464 rows, the parts in order, the cache id and counts
    computed here from the rows."""
    cache, n, per = tmp_path / "big", 70_000, 7_000
    for s in range(n // per):
        shard = shard_name(0, s)
        rows = [{"key": f"k{i:06d}", "shard": shard, "duration_s": 0.5, "sample_rate": 24000, "num_samples": 12000,
                 "n_frames": 13, "n_codebooks": 8, "n_text_tokens": 7, "has_image": i % 3 == 0, "speaker": "s",
                 "bytes": 100, "sha256": f"{i:064x}", "members": [
                     {"name": "codes.npy", "offset": 512, "size": 208, "dtype": "<i2", "shape": [8, 13]}]}
                for i in range(s * per, (s + 1) * per)]
        entry = {"path": shard, "samples": per, "bytes": 100 * per, "sha256": f"{s:064x}"}
        write_parts(cache, shard[:-4], rows, [], entry)
    m = merge_parts(cache, dict(MANIFEST))
    f = pq.ParquetFile(cache / "index.parquet")
    assert merge.ROW_GROUP_ROWS == 65_536
    assert [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)] == [65_536, 4_464]
    assert f.read().column("key").to_pylist() == [f"k{i:06d}" for i in range(n)]
    lines = "".join(f"k{i:06d}\t{shard_name(0, i // per)}\t{i:064x}\n" for i in range(n))
    assert m["cache_id"] == hashlib.sha256(lines.encode()).hexdigest()[:16]
    assert (m["counts"]["samples"], m["counts"]["images"], m["counts"]["shards"]) == (n, -(-n // 3), n // per)
