"""Caches in object storage: stage one uploads to s3://, ShardLoader streams from it into a bounded
local folder. Against a real S3 protocol server (moto's, on 127.0.0.1, started and stopped here)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from loaders import Order, Reads, ShardLoader, Workers  # noqa: E402
from shardcache.ranks import Ranks  # noqa: E402
from shards import Cache  # noqa: E402
from shards.errors import UnsafePath  # noqa: E402
from shards.index import read_index  # noqa: E402
from shards.manifest import read_manifest  # noqa: E402
from test_loaders import make_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3:
    """moto's S3 server in this process; ``restart()`` keeps the buckets (they live in moto's
    in-process backend), as a real store keeps its objects across an outage."""

    def __init__(self):
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, self.port = self.server.get_host_and_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.options = {"client_kwargs": {"endpoint_url": self.endpoint}, "key": "testing",
                        "secret": "testing", "skip_instance_cache": True}
        import s3fs
        self.fs = s3fs.S3FileSystem(**self.options)

    def stop(self):
        self.server.stop()

    def start_again(self):
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def upload(self, local: Path, url: str) -> str:
        bucket = url[len("s3://"):].split("/")[0]
        if not self.fs.exists(bucket):
            self.fs.mkdir(bucket)
        for p in sorted(local.rglob("*")):
            if p.is_file():
                self.fs.put_file(str(p), f"{url[len('s3://'):]}/{p.relative_to(local).as_posix()}")
        return url


@pytest.fixture(scope="module")
def s3():
    old = {k: os.environ.get(k) for k in CREDS}
    os.environ.update(CREDS)
    server = S3()
    yield server
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def local_cache(tmp_path_factory) -> Path:
    # 6 shards of 6-9 samples: a cache limit of 2 shards is well below one epoch
    return make_cache(tmp_path_factory.mktemp("remote_src"), (9, 7, 8, 6, 9, 7), image_every=2)


@pytest.fixture(scope="module")
def bucket(s3, local_cache) -> str:
    return s3.upload(local_cache, "s3://shards-bucket/cache")


def batches(loader, epoch=0) -> list[dict]:
    loader.set_epoch(epoch)
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in loader]


def same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["keys"] == y["keys"]
        for k, v in x.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, y[k]), (x["keys"], k)


def test_file_uses_lists_the_steps_reading_each_shard(local_cache):
    """The prefetch schedule, against a plain loop over the batches and their keys' shards."""
    from loaders.batching import BudgetPlan  # noqa: F401 - both plan kinds go through file_uses
    from loaders.remote import file_uses
    for order in (Order(), Order(max_frames=60)):
        ld = ShardLoader(local_cache, 3, seed=4, ranks=Ranks(1, 2), order=order)
        plan = ld._spec.plan(2)
        shard_of_key = dict(zip(read_index(local_cache).column("key").to_pylist(),
                                read_index(local_cache).column("shard").to_pylist()))
        want: dict = {}
        ld.set_epoch(2)
        for step, batch in enumerate(ld):
            for key in batch["keys"]:
                want.setdefault((0, shard_of_key[key]), set()).add(step)
        got = file_uses(plan, 1, ld.sources)
        assert {f: sorted(v.tolist()) for f, v in got.items()} == {f: sorted(v) for f, v in want.items()}


class _FakeRemote:
    def __init__(self, sizes):
        self.sizes, self.present, self.evicted = sizes, {}, []

    def size_of(self, name):
        return self.sizes[name]

    def evict(self, name):
        self.present.pop(name)
        self.evicted.append(name)


def test_prefetch_picks_the_next_needed_file_and_evicts_the_furthest():
    """Belady's rule on a schedule: A read at steps 0 and 10, B at 5, C at 7, D never again."""
    import numpy as np
    from shards.mirror import Prefetcher
    r = _FakeRemote({"A": 10, "B": 10, "C": 10, "D": 10})
    uses = {(0, "A"): np.array([0, 10]), (0, "B"): np.array([5]), (0, "C"): np.array([7])}
    p = Prefetcher(lambda e: uses, {0: r}, cache_limit=20, lookahead=1)
    p._epoch, p._uses, p._consumed, p._heap = 0, uses, 0, []
    for f in uses:
        p._push(f)
    assert p._next()[2] == "A"
    p._consumed = 1  # (step 0 passed without A: its entry is re-keyed to step 10)
    assert p._next()[2] == "B"
    p._consumed = 0
    r.present["A"] = 10
    r.present["D"] = 10
    p._consumed = 3  # A's next read is now step 10: B (step 5) comes first
    assert p._next()[1:] == (0, "B")
    assert p._make_room(10, 5) and r.evicted == ["D"]  # D: no further read
    r.present["B"] = 10
    assert p._next()[2] == "C"
    assert p._make_room(10, 7) and r.evicted == ["D", "A"]  # A (step 10) is read after C (step 7)
    r.present["C"] = 10
    assert not p._make_room(10, 7)  # B (5) and C (7) are needed before step 7 / in flight: no room


def test_two_ranks_two_workers_stream_every_sample_once(s3, bucket, local_cache, tmp_path):
    ref = [batches(ShardLoader(local_cache, 3, seed=5, ranks=Ranks(r, 2))) for r in range(2)]
    seen = []
    for r in range(2):
        ld = ShardLoader(Cache.open(bucket, storage_options=s3.options, local_dir=tmp_path / f"r{r}"), 3, seed=5, ranks=Ranks(r, 2), workers=Workers(num_workers=2))
        got = batches(ld)
        same(got, ref[r])
        seen += [k for b in got for k in b["keys"]]
        assert ld.prefetcher.stats["downloads"] >= 1
        ld.close()
    n = len(read_index(local_cache))
    assert len(seen) == len(set(seen)) == n - n % 6


def test_cache_limit_below_one_epoch(s3, bucket, local_cache, tmp_path):
    sizes = sorted(p.stat().st_size for p in local_cache.glob("shard-*.tar"))
    limit = sum(sizes[-3:])  # three shards of six; the steps in flight (3 x 4 samples) span two
    ref = batches(ShardLoader(local_cache, 4, seed=1), 0) + batches(ShardLoader(local_cache, 4, seed=1), 1)
    ld = ShardLoader(Cache.open(bucket, storage_options=s3.options, local_dir=tmp_path / "l"), 4, seed=1, workers=Workers(num_workers=2, prefetch_factor=1), reads=Reads(cache_limit=limit))
    got = batches(ld, 0) + batches(ld, 1)
    same(got, ref)
    st = ld.prefetcher.stats
    assert st["evictions"] >= 4 and st["downloads"] >= 8, st  # every shard fetched in both epochs
    assert st["peak_bytes"] <= limit + sizes[-1], st  # over only for a step in flight
    held = sum(p.stat().st_size for p in (tmp_path / "l").glob("shard-*.tar"))
    assert held <= limit + sizes[-1]
    ld.close()


def test_server_stopped_and_restarted_mid_epoch_costs_retries_not_samples(s3, bucket, local_cache, tmp_path):
    sizes = sorted(p.stat().st_size for p in local_cache.glob("shard-*.tar"))
    ref = batches(ShardLoader(local_cache, 4, seed=2))
    # botocore and s3fs retry on their own first; with botocore's off, an outage longer than
    # s3fs's ~2 s of retries reaches the loader's own (shards.storage.retry)
    fragile = dict(s3.options, config_kwargs={"retries": {"max_attempts": 1}})
    ld = ShardLoader(Cache.open(bucket, storage_options=fragile, local_dir=tmp_path / "l", retries=20), 4, seed=2, reads=Reads(cache_limit=sizes[-1] + 1))
    ld.set_epoch(0)
    got = []
    it = iter(ld)
    got.append(next(it))
    s3.stop()
    restart = threading.Timer(4.0, s3.start_again)
    restart.start()
    t0 = time.monotonic()
    got += list(it)
    restart.join()
    same([{k: v for k, v in b.items()} for b in got], ref)
    assert time.monotonic() - t0 > 3.0  # it did wait for the server
    remote = ld.sources.sources[0].remote
    assert remote.remote.retries_done > 0
    ld.close()


def test_resume_against_the_bucket_equals_the_uninterrupted_run(s3, bucket, tmp_path):
    full = batches(ShardLoader(Cache.open(bucket, storage_options=s3.options, local_dir=tmp_path / "a"), 2, seed=7), 1)
    first = ShardLoader(Cache.open(bucket, storage_options=s3.options, local_dir=tmp_path / "b"), 2, seed=7, workers=Workers(num_workers=2))
    first.set_epoch(1)
    got = []
    for b in first:
        got.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()})
        if len(got) == 5:
            break
    sd = first.state_dict()
    first.close()
    second = ShardLoader(Cache.open(bucket, storage_options=s3.options, local_dir=tmp_path / "c"), 2, seed=7, workers=Workers(num_workers=1))
    second.load_state_dict(sd)
    second.set_epoch(1)
    rest = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in second]
    same(got + rest, full)
    second.close()


def test_a_hostile_remote_index_cannot_reach_outside_the_local_folder(s3, local_cache, tmp_path):
    evil = tmp_path / "evil"
    shutil.copytree(local_cache, evil)
    t = read_index(evil)
    names = ["../../outside.tar" if i == 0 else n for i, n in enumerate(t.column("shard").to_pylist())]
    pq.write_table(t.set_column(t.schema.get_field_index("shard"), "shard", pa.array(names)), evil / "index.parquet")
    from shards.index import write_root  # sealed as if written so: the shard-name gate behind the root is tested
    write_root(evil, read_manifest(evil)["cache_id"])
    url = s3.upload(evil, "s3://evil-bucket/cache")
    with pytest.raises(UnsafePath):
        ShardLoader(Cache.open(url, storage_options=s3.options, local_dir=tmp_path / "l" / "rank0"), 2)
    assert not (tmp_path / "outside.tar").exists() and not (tmp_path / "l" / "outside.tar").exists()


def _digests(files) -> dict[str, str]:
    return {Path(f).name: hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in files}


def test_stage_one_uploads_and_resumes_against_the_bucket(s3, demo_cache, tiny_config, tmp_path, capsys):
    from precompute.job import run

    url = "s3://stage-one/demo"
    s3.fs.mkdir("stage-one")
    summary, manifest = run(ROOT / "data" / "demo" / "samples.jsonl", url, tiny_config, progress=False,
                            storage_options=s3.options, staging=tmp_path / "staging")
    assert manifest["counts"]["samples"] == len(read_index(demo_cache))
    listing = {p.rsplit("/", 1)[-1] for p in s3.fs.ls("stage-one/demo", detail=False, refresh=True)}
    assert {"index.parquet", "manifest.json", "rejects.parquet", "README.md", "parts"} <= listing
    assert not list((tmp_path / "staging").glob("shard-*.tar"))  # uploaded, then removed from staging
    # the uploaded shards are byte for byte those of the same job run locally
    got = tmp_path / "got"
    s3.fs.get("stage-one/demo/", str(got), recursive=True)
    assert _digests(got.glob("shard-*.tar")) == _digests(demo_cache.glob("shard-*.tar"))
    # a job killed after uploading shard-000001.tar but before its commit marker: a rerun from a
    # fresh machine (no staging) redoes that chunk only
    # (this rerun goes through the command line: --storage_options JSON, --staging)
    s3.fs.rm("stage-one/demo/parts/shard-000001.index.parquet")
    shutil.rmtree(tmp_path / "staging")
    from precompute import cli
    overrides = [f"{k}={getattr(tiny_config, k.split('.')[0])['pretrained'] if '.' in k else getattr(tiny_config, k)}"
                 for k in ("audio_tokenizer.pretrained", "image_encoder.pretrained", "image_size",
                           "samples_per_shard", "num_workers", "device")]
    rc = cli.main(["--manifest", str(ROOT / "data" / "demo" / "samples.jsonl"), "--cache", url, "--config",
                   str(ROOT / "configs" / "precompute.yaml"), *[f"--{o}" for o in overrides],
                   "--storage_options", json.dumps(s3.options), "--staging", str(tmp_path / "staging2"),
                   "--no_progress"])
    rows_in_chunk_1 = len([k for k in read_index(demo_cache).column("shard").to_pylist() if k == "shard-000001.tar"])
    out = capsys.readouterr().out
    assert rc == 0 and f"kept {rows_in_chunk_1}, " in out and "skipped (already cached) 24" in out
    assert (tmp_path / "staging2").is_dir()
    assert "testing" not in s3.fs.cat("stage-one/demo/manifest.json").decode()  # no storage options in the cache
    again = tmp_path / "again"
    s3.fs.get("stage-one/demo/", str(again), recursive=True)
    assert _digests(again.glob("shard-*.tar")) == _digests(demo_cache.glob("shard-*.tar"))
    # and a loader streams it
    ld = ShardLoader(Cache.open(url, storage_options=s3.options, local_dir=tmp_path / "read"), 4)
    assert sum(len(b["keys"]) for b in ld) == 4 * len(ld)
    ld.close()


def test_training_from_the_bucket_equals_training_from_local_files(s3, demo_cache, tmp_path, monkeypatch):
    """``shardcache train --data.cache s3://...``: the model sizes come from the bucket's
    manifest.json, the loader streams the shards; the loss of every step equals the same run on the
    local copy (storage_options through ``data.loader_kwargs``)."""
    from test_train_support import TINY_MODEL, read_metrics
    from test_train_support import from_dict
    from train.trainer import run

    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SHARDCACHE_LOCAL_CACHE", str(tmp_path / "local"))
    url = s3.upload(demo_cache, "s3://train-from/demo")

    def cfg(cache, out, **loader_kwargs):
        return from_dict({"cache": str(cache), "out": str(out), "model_kwargs": TINY_MODEL, "batch_size": 2,
                          "steps": 3, "warmup_steps": 1, "progress": False, "threads": 1, "log_every": 1,
                          "ckpt_every": 1000, "val_fraction": 0, "loader_kwargs": loader_kwargs})

    assert run(cfg(demo_cache, tmp_path / "a")) == 0
    assert run(cfg(url, tmp_path / "b", storage_options=s3.options)) == 0
    local, remote = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert len(local) == 3 and [r["loss"] for r in remote] == [r["loss"] for r in local]
    assert list((tmp_path / "local").glob("*/rank0/shard-*.tar"))  # streamed into the local folder


def test_a_rerun_on_an_edited_manifest_follows_it_in_the_bucket(s3, tiny_config, tmp_path):
    """Issue 30: a corrected transcript and a deleted row, rerun against the bucket from a fresh staging
    folder: the stale chunks are deleted in the bucket too (tar, parts), the bucket's cache holds the
    manifest's rows, and its own files pass quick verify (integrity.json uploaded last)."""
    import dataclasses
    from precompute.job import run
    from shards import ShardReader, read_cache_id
    audio = str(ROOT / "data" / "demo" / "audio" / "spk-us-0001.flac")
    rows = [{"key": f"k{i}", "text": f"Text {i}.", "audio": audio} for i in range(6)]
    cfg = dataclasses.replace(tiny_config, samples_per_shard=2, image_encoder=None)
    url = "s3://rerun/c"
    s3.fs.mkdir("rerun")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run(manifest, url, cfg, progress=False, storage_options=s3.options, staging=tmp_path / "s1")
    rows[3]["text"] = "Text 3, corrected."
    del rows[4:]                                                     # a whole chunk deleted: its name is not reused
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary, _ = run(manifest, url, cfg, progress=False, storage_options=s3.options, staging=tmp_path / "s2")
    assert summary.rerun["reencoded"] == 1 and summary.rerun["removed"] == 2 and summary.rerun["kept"] == 2
    got = tmp_path / "got"
    s3.fs.get("rerun/c/", str(got), recursive=True)
    read_cache_id(got)
    r = ShardReader(got)
    texts = {k: json.dumps(r.get(i)["json"]) for i, k in enumerate(r.keys)}
    assert sorted(texts) == ["k0", "k1", "k2", "k3"] and "Text 3, corrected." in texts["k3"]
    v = subprocess.run([sys.executable, "-m", "shardcache", "shards", "verify", str(got), "--no_progress"], cwd=ROOT,
                       capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    parts = {p.name.split(".")[0] for p in (got / "parts").glob("*.index.parquet")}
    assert parts == {s["path"][:-4] for s in json.loads((got / "manifest.json").read_text())["shards"]}
