"""ShardLoader as a standard PyTorch citizen: rank and world size found on its own (process group,
else the launcher's environment), re-iteration starting the next epoch. Issue 32 item 1."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loaders import ShardLoader
from loaders.order import epoch_order
from shardcache.ranks import Ranks
from test_train_support import REPO, TESTS, base_env, free_port, make_cache

TIMEOUT = 120


def resolve_rank(global_rank=None, world_size=None):
    r = Ranks.detect(None, global_rank, world_size)
    return r.global_rank, r.world_size


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return make_cache(tmp_path_factory.mktemp("ranks") / "cache", n=24, n_shards=3)


def torchrun(cache: Path, out: Path, mode: str) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(TESTS / "loader_ranks_worker.py"), str(cache), str(out), mode]
    r = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads((out / f"keys-{r}.json").read_text()) for r in range(2)] if mode != "wrong" else []


def all_keys(cache: Path) -> list[str]:
    import pyarrow.parquet as pq
    return pq.read_table(cache / "index.parquet", columns=["key"]).column("key").to_pylist()


@pytest.mark.ddp
@pytest.mark.parametrize("mode", ["pg", pytest.param("env", marks=pytest.mark.long)])  # env: make test-long
def test_torchrun_ranks_without_rank_arguments_read_disjoint_samples(cache, tmp_path, mode):
    """Two torchrun ranks, loaders built with no rank arguments: each knows it is rank r of 2, they
    read disjoint halves of the epoch, and together every sample once (24 samples, global batch 4)."""
    a, b = torchrun(cache, tmp_path / mode, mode)
    assert (a["rank"], a["world"], b["rank"], b["world"]) == (0, 2, 1, 2)
    assert a["steps"] == b["steps"] == 24 // 4
    assert len(a["keys"]) == len(b["keys"]) == 12
    assert not set(a["keys"]) & set(b["keys"])
    assert sorted(a["keys"] + b["keys"]) == sorted(all_keys(cache))


@pytest.mark.ddp
@pytest.mark.long  # make test-long; the [pg] torchrun run of the test above covers the process group in make test
def test_explicit_world_size_differing_from_the_process_group_is_refused(cache, tmp_path):
    torchrun(cache, tmp_path, "wrong")
    for r in range(2):
        msg = (tmp_path / f"error-{r}.txt").read_text()
        assert "world_size=1" in msg and "process group" in msg and "world_size 2" in msg


def test_rank_from_environment_explicit_wins(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank() == (1, 4)
    assert resolve_rank(0, 1) == (0, 1)  # explicit arguments win over the environment
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_rank() == (1, 4)  # RANK is the global rank, LOCAL_RANK the rank within the node
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert resolve_rank() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK=2 is not a rank of WORLD_SIZE=2"):
        resolve_rank()


@pytest.mark.parametrize("env, missing", [
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, ["RANK"]),  # 2 nodes x 2, no RANK
    ({"LOCAL_RANK": "1"}, ["RANK", "WORLD_SIZE"]),
    ({"RANK": "3"}, ["WORLD_SIZE"]),
    ({"WORLD_SIZE": "4"}, ["RANK"]),
    ({"LOCAL_WORLD_SIZE": "2"}, ["RANK", "WORLD_SIZE"]),
])
def test_a_partial_launcher_environment_is_refused_naming_the_variables(monkeypatch, cache, env, missing):
    """Issue 41 item 5: a launcher that sets LOCAL_RANK/WORLD_SIZE but not RANK (2 nodes x 2) made
    the loader take LOCAL_RANK as the global rank: on the two nodes ranks 1 and 3 both read rank 1's
    share (half the samples twice, half never), exit 0. Now each partial environment is refused,
    naming what is set and what is missing."""
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError) as e:
        ShardLoader(cache, 2)
    msg = str(e.value)
    for k, v in env.items():
        assert f"{k}={v}" in msg, msg
    assert f"{' and '.join(missing)} unset" in msg, msg
    assert "global_rank=" in msg and "process group" in msg
    if "LOCAL_RANK" in env:
        assert "not the global rank" in msg


def test_explicit_arguments_or_a_process_group_settle_a_partial_environment(monkeypatch, cache, tmp_path):
    """What the environment leaves open may be given: explicit global_rank/world_size, or an
    initialised process group (whose rank is the global one whatever LOCAL_RANK says)."""
    import torch.distributed as dist
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank(3) == (3, 4)  # WORLD_SIZE from the environment, the rank given
    assert resolve_rank(3, 4) == (3, 4)
    ld = ShardLoader(cache, 2, ranks=Ranks(3, 4))
    assert (ld.global_rank, ld.world_size) == (3, 4)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.delenv("WORLD_SIZE")
    assert resolve_rank(world_size=4) == (2, 4)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert resolve_rank() == (0, 1)  # the group's, not RANK=2 or LOCAL_RANK=1
    finally:
        dist.destroy_process_group()


def epoch(loader) -> list[str]:
    return [k for batch in loader for k in batch["keys"]]


def expected_epoch(cache: Path, seed: int, e: int, n_keep: int) -> list[str]:
    """The epoch's global order (loaders.order.epoch_order of the index's shard column, the order's
    definition), cut to whole global batches."""
    import numpy as np
    import pyarrow.parquet as pq
    table = pq.read_table(cache / "index.parquet", columns=["key", "shard"])
    keys, shards = table.column("key").to_pylist(), table.column("shard").to_pylist()
    shard_of = np.unique(shards, return_inverse=True)[1]
    return [keys[i] for i in epoch_order(shard_of, seed, e)[:n_keep]]


def test_iterating_again_without_set_epoch_gives_the_next_full_epoch(cache):
    """for batch in loader twice, no set_epoch: epochs 0 and 1, each complete and different, equal to
    the (seed, epoch) order; a third loop gives epoch 2; set_epoch still selects an epoch."""
    ld = ShardLoader(cache, 4, seed=5, ranks=Ranks(0, 1))
    first, second = epoch(ld), epoch(ld)
    assert len(first) == len(second) == 24 and sorted(first) == sorted(second) == sorted(all_keys(cache))
    assert first != second and ld.epoch == 1
    assert first == expected_epoch(cache, 5, 0, 24) and second == expected_epoch(cache, 5, 1, 24)
    assert epoch(ld) == expected_epoch(cache, 5, 2, 24)
    ld.set_epoch(1)
    assert epoch(ld) == second  # set_epoch sets it, as with DistributedSampler
    other = ShardLoader(cache, 4, seed=5, ranks=Ranks(0, 1))
    other.set_epoch(1)
    assert epoch(other) == second  # a pure function of (seed, epoch)


def test_resume_after_an_epochs_last_batch_goes_on_with_the_next_epoch(cache):
    """A state recorded after the last batch of epoch 0, loaded into a fresh loader: the next loop
    is epoch 1 (what Lightning and torchtitan do: load, then iterate); a partial epoch resumes."""
    ld = ShardLoader(cache, 4, seed=2, ranks=Ranks(0, 1))
    e0 = epoch(ld)
    sd = ld.state_dict()
    e1 = epoch(ld)
    fresh = ShardLoader(cache, 4, seed=2, ranks=Ranks(0, 1))
    fresh.load_state_dict(sd)
    assert epoch(fresh) == e1 != e0
    part = ShardLoader(cache, 4, seed=2, ranks=Ranks(0, 1))
    it = iter(part)
    head = [k for _ in range(2) for k in next(it)["keys"]]
    resumed = ShardLoader(cache, 4, seed=2, ranks=Ranks(0, 1))
    resumed.load_state_dict(part.state_dict())
    assert head + epoch(resumed) == e0
