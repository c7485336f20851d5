"""Two simulated nodes on this machine: two ``torchrun --nnodes=2 --node_rank={0,1} --nproc_per_node=2``
agents (static rendezvous on 127.0.0.1), 4 ranks with ``LOCAL_RANK = RANK % 2``, so that a global
rank / local rank mix-up (in the data split, the rank-0 writes, the checkpoint's per-rank states
or the validation) cannot pass as it can with one node, where the two are equal.

One epoch of the training keys (their count a multiple of the global batch) through the real
loader; ``tests/train_with_callbacks.py`` records, per rank, the keys its model trained and
validated on and every file it wrote under the run directory.
"""
from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch

from test_train_support import PY, REPO, TESTS, TINY_MODEL, base_env, free_port, make_cache, read_metrics, train_args
from train.data import held_out_mask

# make test-long: tests/test_train_ddp.py and test_loader_ranks.py's torchrun runs cover DDP in make test
pytestmark = [pytest.mark.ddp, pytest.mark.slow, pytest.mark.long]
NODES, PER_NODE, BATCH, VAL = 2, 2, 2, 0.1
WORLD = NODES * PER_NODE
TIMEOUT = 180


def _n_samples() -> int:
    """The smallest cache size from 40 whose training keys fill whole global batches."""
    for n in range(40, 120):
        held = held_out_mask([f"s{i:04d}" for i in range(n)], VAL).sum()
        if held and (n - held) % (WORLD * BATCH) == 0:
            return n
    raise AssertionError("no size found")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("nodes")
    n = _n_samples()
    cache = make_cache(root / "cache", n=n, n_shards=3)
    keys = [f"s{i:04d}" for i in range(n)]
    held = {k for k, m in zip(keys, held_out_mask(keys, VAL)) if m}
    steps = (n - len(held)) // (WORLD * BATCH)
    out, rec = root / "run", root / "rec"
    args = train_args(cache, out, batch_size=BATCH, steps=steps, ckpt_every=steps, val_fraction=VAL, log_every=1,
                      model_kwargs=json.dumps(TINY_MODEL), pg_timeout_min=2)
    port = free_port()
    procs = [subprocess.Popen(
        [PY, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--node_rank={node}",
         f"--nproc_per_node={PER_NODE}", "--master_addr=127.0.0.1", f"--master_port={port}",
         str(TESTS / "train_with_callbacks.py"), "--record", str(rec), "--", *args],
        cwd=REPO, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(NODES)]
    deadline, outs = time.monotonic() + TIMEOUT, []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"the 2-node run did not finish in {TIMEOUT} s")
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    ranks = [json.loads((rec / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {"out": out, "ranks": ranks, "train_keys": set(keys) - held, "held": held, "steps": steps}


def test_four_ranks_on_two_nodes(two_nodes):
    envs = [r["env"] for r in two_nodes["ranks"]]
    assert [(int(e["RANK"]), int(e["LOCAL_RANK"])) for e in envs] == [(r, r % PER_NODE) for r in range(WORLD)]
    assert {e["WORLD_SIZE"] for e in envs} == {str(WORLD)} and all(r["code"] == 0 for r in two_nodes["ranks"])
    assert [r["loader_rank"] for r in two_nodes["ranks"]] == list(range(WORLD))


def test_the_split_follows_the_global_rank(two_nodes):
    """One epoch: every training key exactly once over the 4 ranks, each rank BATCH per step."""
    seen: list[str] = []
    for r in two_nodes["ranks"]:
        assert sorted(map(int, r["train"])) == list(range(1, two_nodes["steps"] + 1))
        assert all(len(v) == BATCH for v in r["train"].values())
        seen += [k for v in r["train"].values() for k in v]
    assert len(seen) == len(set(seen)) and set(seen) == two_nodes["train_keys"]


def test_only_global_rank_0_writes_and_the_checkpoint_holds_every_rank(two_nodes):
    out, steps = two_nodes["out"], two_nodes["steps"]
    r0, *others = two_nodes["ranks"]
    assert all(r["writes"] == [] for r in others), [r["writes"][:3] for r in others]
    assert any("metrics.jsonl" in w for w in r0["writes"]) and any(f"step-{steps}" in w for w in r0["writes"])
    st = torch.load(out / f"step-{steps}" / "trainer.pt", weights_only=True)
    assert st["world_size"] == WORLD and len(st["loaders"]) == WORLD and len(st["rng"]) == WORLD
    assert len({bytes(s["torch"].numpy()) for s in st["rng"]}) == WORLD  # each rank's own RNG
    assert [r["step"] for r in read_metrics(out)] == list(range(1, steps + 1))


def test_validation_runs_on_every_rank(two_nodes):
    """The held-out keys are split over the 4 ranks (each validates some), one all-reduce gives the
    mean over all of them, written once by rank 0."""
    evaluated = [r["eval"] for r in two_nodes["ranks"]]
    assert all(evaluated) and {k for e in evaluated for k in e} == two_nodes["held"]
    val = read_metrics(two_nodes["out"], "val")
    assert [v["step"] for v in val] == [two_nodes["steps"]]
    assert val[0]["val_samples"] == sum(len(e) for e in evaluated)
