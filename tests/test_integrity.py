"""A cache is never silently wrong (issue 22): every member carries the XXH3-64 of its bytes from the
moment it is written; every read checks it; a damaged sample stops the loader (or is left out,
within a budget) naming shard, key and member; a shard truncated or replaced under a running loader
is a ShardCorrupt naming shard and key, in the main process and in workers, never a signal."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import xxhash

from loaders import Order, Reads, ShardLoader, Workers, collate_fn
from shards import ShardCorrupt, ShardReader, read_index
from shards.schema import INDEX_FILE
from test_train_support import REPO, base_env, make_cache, train_args

N = 24


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """24 samples in 3 shards, the format stage one writes (input_ids, labels, codes, audio, latents)."""
    return make_cache(tmp_path_factory.mktemp("integrity") / "cache", n=N, n_shards=3)


@pytest.fixture
def cache(clean, tmp_path) -> Path:
    out = Path(shutil.copytree(clean, tmp_path / "cache"))
    for p in out.glob("shard-*.tar"):
        p.chmod(0o644)
    return out


def entry(cache: Path, key: str, member: str) -> tuple[str, dict]:
    """(shard name, index member entry) of ``key``'s ``member``."""
    row = next(r for r in read_index(cache).to_pylist() if r["key"] == key)
    return row["shard"], next(m for m in row["members"] if m["name"] == member)


def flip_low_bit(cache: Path, key: str, member: str, index: int = 0) -> str:
    """XOR 1 into element ``index`` of ``key``'s array ``member`` in place: a code stays a code in
    [0, 1024), a float16 latent stays finite, a PCM sample stays a PCM sample. Returns the shard."""
    shard, m = entry(cache, key, member)
    item = np.dtype(m["dtype"]).itemsize
    with open(cache / shard, "r+b") as f:
        f.seek(m["offset"] + index * item)
        b = bytearray(f.read(item))
        b[0] ^= 1  # little-endian: the lowest bit of the value (of a float16's mantissa)
        f.seek(m["offset"] + index * item)
        f.write(bytes(b))
    return shard


def keys_of(batches) -> list[str]:
    return [k for b in batches for k in b["keys"]]


# ----------------------------------------------------------------------------- written with the data

def test_every_member_entry_records_the_checksum_of_its_bytes(clean):
    n = 0
    for row in read_index(clean).to_pylist():
        with open(clean / row["shard"], "rb") as f:
            for m in row["members"]:
                f.seek(m["offset"])
                assert m["xxh3"] == xxhash.xxh3_64_intdigest(f.read(m["size"])), (row["key"], m["name"])
                n += 1
    assert n >= N * 5  # json, tensors.npz and its arrays, latents


# ----------------------------------------------------------------------------- damaged values

@pytest.mark.parametrize("member, workers", [("codes.npy", 0), ("latents.npy", 0), ("audio.npy", 0),
                                             ("codes.npy", 2)])
def test_a_flipped_bit_that_leaves_the_value_valid_stops_the_loader_naming_it(cache, member, workers):
    key = "s0006"  # has latents (every third sample)
    shard = flip_low_bit(cache, key, member, index=5)
    # the changed value is still valid for its kind: only a checksum can tell
    from shards.reader import value_checks_from_manifest, read_manifest
    checks = value_checks_from_manifest(read_manifest(cache))
    ShardReader(cache, value_checks=checks, checksums=False).get(int(ShardReader(cache).keys.index(key)))
    ld = ShardLoader(cache, 4, seed=1, workers=Workers(num_workers=workers))
    with pytest.raises(ShardCorrupt) as e:
        list(ld)
    ld.close()
    msg = str(e.value)
    assert f"{shard}: sample '{key}' member {member}: checksum mismatch" in msg, msg


def test_value_checks_alone_miss_it(cache):
    """What every read checked before checksums: the epoch goes by with the changed code."""
    flip_low_bit(cache, "s0003", "codes.npy")
    ld = ShardLoader(cache, 4, seed=1, reads=Reads(checks="values"))
    assert sorted(keys_of(ld)) == [f"s{i:04d}" for i in range(N)]


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_corrupt_leaves_damaged_samples_out_within_its_budget(cache, workers, caplog):
    bad = {"s0004", "s0017"}
    for k in bad:
        flip_low_bit(cache, k, "audio.npy", index=100)
    ref = ShardLoader(cache, 4, seed=2, reads=Reads(checks="none"))
    want = keys_of(ref)
    ld = ShardLoader(cache, 4, seed=2, workers=Workers(num_workers=workers), reads=Reads(skip_corrupt=2))
    with caplog.at_level(logging.WARNING, logger="loaders"):
        got = list(ld)
    ld.close()
    assert keys_of(got) == [k for k in want if k not in bad]  # the same order, less the damaged
    assert sorted(len(b["keys"]) for b in got)[:2] == [3, 3] and all("__skipped__" not in b for b in got)
    assert len(ld.skipped) == 2 and all(any(f"'{k}' member audio.npy" in s for s in ld.skipped) for k in bad)
    assert sum("skipped a damaged sample" in r.getMessage() for r in caplog.records) == 2
    reader = ShardReader(cache, checksums=False)  # a shortened batch is still the collated batch
    short = next(b for b in got if len(b["keys"]) == 3)
    ref_b = collate_fn([reader.get(reader.keys.index(k)) for k in short["keys"]])
    assert all(torch.equal(ref_b[k], short[k]) for k in ref_b if isinstance(ref_b[k], torch.Tensor))
    over = ShardLoader(cache, 4, seed=2, workers=Workers(num_workers=workers), reads=Reads(skip_corrupt=1))
    with pytest.raises(ShardCorrupt, match="skip_corrupt=1"):
        list(over)
    over.close()


# ----------------------------------------------------------------------------- files changing underneath

TRUNCATE_RUNS = """
import os, shutil, sys
import numpy as np
from shards import ShardCorrupt
from loaders import ShardLoader, Workers
clean, work, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
rng = np.random.default_rng(0)
for run in range(runs):
    cache = os.path.join(work, f"c{run}")
    shutil.copytree(clean, cache)
    shards = sorted(os.path.join(cache, p) for p in os.listdir(cache) if p.endswith(".tar"))
    loader = ShardLoader(cache, batch_size=2, seed=run,
                         workers=Workers(num_workers=2, persistent_workers=True, prefetch_factor=2))
    it = iter(loader)
    next(it)
    for p in shards:  # every shard shrinks mid-epoch, while the workers read ahead
        os.truncate(p, int(rng.integers(0, os.path.getsize(p))))
    try:
        n = sum(1 for _ in it)
        print("NOT CAUGHT", n, flush=True)
    except ShardCorrupt as e:
        print("CAUGHT", str(e).strip().splitlines()[-1], flush=True)  # a worker's: its last line
    loader.close()
    shutil.rmtree(cache)
"""


@pytest.mark.long  # make test-long; test_shards_safety's truncated-shard epochs run in make test
def test_shards_truncated_mid_epoch_under_two_workers_20_times_never_a_signal(clean, tmp_path):
    """Before: a worker died of "Bus error" in 7 of 17 such runs, naming nothing."""
    env = dict(base_env(), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", TRUNCATE_RUNS, str(clean), str(tmp_path), "20"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])  # -7: SIGBUS
    lines = r.stdout.splitlines()
    assert len(lines) == 20 and all(x.startswith("CAUGHT") for x in lines), r.stdout
    assert all(".tar: sample 's" in x for x in lines), r.stdout  # the shard and the key


def test_a_truncation_racing_the_read_is_a_short_read_naming_the_member(cache, monkeypatch):
    """The window the per-batch check cannot close: the file shrinks after it was checked."""
    from shards.files import ShardFiles
    ld = ShardLoader(cache, 4, order=Order(shuffle=False), workers=Workers(read_threads=1))  # reads on demand: the next read is after
    it = iter(ld)
    next(it)
    monkeypatch.setattr(ShardFiles, "check", lambda self, i, where: None)  # as if it shrank right after
    os.truncate(cache / "shard-r0000-000000.tar", 20000)
    with pytest.raises(ShardCorrupt, match=r"shard-r0000-000000.tar: sample 's000\d' member \w+\.npy: the member "
                                           r"starts at byte \d+ but the file is 20000 bytes now"):
        list(it)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_cache_rewritten_in_place_under_a_running_loader_stops_it(cache, tmp_path, workers):
    """Before: 7 batches of misaligned audio, then a ShardCorrupt. Every batch delivered must be the
    old cache's; then the loader stops naming the replaced shard."""
    old = Path(shutil.copytree(cache, tmp_path / "old"))
    ld = ShardLoader(cache, 2, seed=4, workers=Workers(num_workers=workers, prefetch_factor=1))
    it = iter(ld)
    got = [next(it)]
    make_cache(cache, n=N, n_shards=3, seed=99)  # precompute again into the same folder
    with pytest.raises(ShardCorrupt, match=r"shard-r0000-00000\d.tar: sample 's\d+': the shard changed since "
                                           r"this loader read the index: it is another file now"):
        for b in it:
            got.append(b)
    ld.close()
    reader = ShardReader(old)
    for b in got:
        ref = collate_fn([reader.get(reader.keys.index(k)) for k in b["keys"]])
        assert torch.equal(ref["audio"], b["audio"]) and torch.equal(ref["codes"], b["codes"])


# ----------------------------------------------------------------------------- entries without checksums

def test_an_index_entry_without_a_checksum_is_refused_naming_it(cache):
    """Every entry of a cache records its checksum: one without is damage, named, refused before
    anything is read (caches made before checksums are not read unchecked)."""
    t = read_index(cache)
    members = t.column("members").to_pylist()
    row = t.column("key").to_pylist().index("s0008")
    next(m for m in members[row] if m["name"] == "codes.npy")["xxh3"] = None
    t = t.set_column(t.schema.get_field_index("members"), t.schema.field("members"),
                     pa.array(members, t.schema.field("members").type))
    pq.write_table(t, cache / INDEX_FILE)
    from shards.index import write_root  # an index written so (not an edit): its integrity root says so
    cid = json.loads((cache / "manifest.json").read_text())["cache_id"]
    write_root(cache, cid)
    with pytest.raises(ShardCorrupt, match=r"s0008.* member codes.npy has no checksum in the index"):
        ShardLoader(cache, 4, seed=3)
    with pytest.raises(ShardCorrupt, match=r"s0008.* member codes.npy has no checksum in the index"):
        ShardReader(cache).get(row)
    stripped = t.set_column(t.schema.get_field_index("members"), "members", pa.array(
        [[{k: v for k, v in m.items() if k != "xxh3"} for m in ms] for ms in members]))
    pq.write_table(stripped, cache / INDEX_FILE)      # an index without the column at all
    write_root(cache, cid)
    with pytest.raises(ShardCorrupt, match=r"s0000.* member audio.npy has no checksum in the index"):
        ShardLoader(cache, 4, seed=3)


# ----------------------------------------------------------------------------- training

def test_training_stops_on_a_damaged_sample_naming_it(cache, tmp_path):
    """Before: `shardcache train` exited 0 having trained on the changed values. Now it stops naming
    shard, key and member; with --data.skip_corrupt 1 it leaves the sample out, logs it, and goes on."""
    shard = flip_low_bit(cache, "s0010", "codes.npy", index=3)
    run = lambda out, **kw: subprocess.run(  # noqa: E731 - one epoch: every sample is read
        [sys.executable, "-m", "shardcache", "train",
         *train_args(cache, out, steps=6, val_fraction=0, num_workers=0, **kw)],
        cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=300)
    r = run(tmp_path / "run")
    assert r.returncode != 0, r.stderr[-3000:]
    assert f"{shard}: sample 's0010' member codes.npy: checksum mismatch" in r.stderr, r.stderr[-3000:]
    ok = run(tmp_path / "run2", **{"data.skip_corrupt": 1})
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "skipped a damaged sample" in ok.stderr and "'s0010' member codes.npy" in ok.stderr, ok.stderr[-3000:]


@pytest.mark.parametrize("threads", [2, 3])
def test_read_ahead_threads_give_the_same_batches_and_stop_at_the_damaged_step(cache, threads):
    """num_workers=0 reads ahead in threads (loaders.readahead): the same batches in the same order
    as reading on demand, an exact resume, and a damaged sample raised when the consumer reaches
    its step (not when a thread read it), with state_dict counting only the batches taken."""
    def run(ld, upto=None):
        out = []
        for b in ld:
            out.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in b.items()})
            if upto is not None and len(out) == upto:
                break
        return out

    ref = run(ShardLoader(cache, 3, seed=4, workers=Workers(read_threads=1)))
    got = run(ShardLoader(cache, 3, seed=4, workers=Workers(read_threads=threads, prefetch_factor=1)))
    assert [b["keys"] for b in got] == [b["keys"] for b in ref] and len(ref) > 4
    for a, b in zip(ref, got):
        assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))
    first = ShardLoader(cache, 3, seed=4, workers=Workers(read_threads=threads))
    run(first, upto=2)  # threads have read further than the consumer took
    again = ShardLoader(cache, 3, seed=4, workers=Workers(read_threads=threads))
    again.load_state_dict(first.state_dict())
    assert [b["keys"] for b in run(again)] == [b["keys"] for b in ref[2:]]

    step = next(i for i, b in enumerate(ref) if i >= 2 and b["keys"][0] not in ref[0]["keys"])
    key = ref[step]["keys"][0]
    flip_low_bit(cache, key, "codes.npy")
    ld = ShardLoader(cache, 3, seed=4, workers=Workers(read_threads=threads))
    seen = []
    with pytest.raises(ShardCorrupt, match=f"sample '{key}' member codes.npy: checksum mismatch"):
        for b in ld:
            seen.append(b["keys"])
            assert ld.state_dict()["cursor"] == 3 * len(seen)
    assert seen == [b["keys"] for b in ref[:step]]  # every batch before the damaged one, then the error
