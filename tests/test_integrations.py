"""The examples of docs/integrations.md, run as written on 2 CPU processes (torchrun, gloo): each is
stopped after 5 steps, then resumed from its checkpoint up to 7 steps; every rank must have trained on
the keys of an uninterrupted ShardLoader, step for step (16 samples, global batch 4: the resume lands
in epoch 1). Issue 32 items 2-3."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loaders import ShardLoader
from test_train_support import REPO, base_env, free_port, make_cache

pytestmark = [pytest.mark.ddp, pytest.mark.slow]
DOC = REPO / "docs" / "integrations.md"
TIMEOUT = 300
STOP, STEPS = 5, 7


def examples() -> dict[str, str]:
    """``{file name: code}`` of the doc's python blocks that start with ``# example: NAME``."""
    blocks = re.findall(r"```python\n(# example: (\S+)\n.*?)```", DOC.read_text(), flags=re.S)
    return {name: code for code, name in blocks}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return make_cache(tmp_path_factory.mktemp("integrations") / "cache", n=16, n_shards=2)


def reference(cache: Path, rank: int) -> list[list[str]]:
    """The keys of an uninterrupted run: the loader iterated epoch after epoch, ``STEPS`` batches."""
    ld = ShardLoader(cache, 2, seed=0, global_rank=rank, world_size=2, fields=("input_ids", "labels"))
    out = []
    while len(out) < STEPS:
        out += [b["keys"] for b in ld]
    return out[:STEPS]


def run_example(name: str, cache: Path, tmp_path: Path) -> None:
    script = tmp_path / name
    script.write_text(examples()[name])
    run = tmp_path / "run"
    run.mkdir()
    for steps in (STOP, STEPS):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", str(script), str(cache), str(run), str(steps)]
        r = subprocess.run(cmd, cwd=tmp_path, env=base_env({"PYTHONWARNINGS": "ignore"}), capture_output=True,
                           text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        if steps == STOP:
            for rank in range(2):
                assert len((run / f"keys-{rank}.jsonl").read_text().splitlines()) == STOP
    for rank in range(2):
        seen = [json.loads(line) for line in (run / f"keys-{rank}.jsonl").read_text().splitlines()]
        assert seen == reference(cache, rank), f"rank {rank}"


def test_the_doc_holds_every_example():
    assert set(examples()) == {"plain_loop.py", "hf_trainer.py", "accelerate_loop.py", "lightning_fit.py",
                               "dcp_slot.py"}


def test_plain_loop(cache, tmp_path):
    run_example("plain_loop.py", cache, tmp_path)


def test_hf_trainer_resume_from_checkpoint(cache, tmp_path):
    run_example("hf_trainer.py", cache, tmp_path)


def test_accelerate_register_for_checkpointing(cache, tmp_path):
    run_example("accelerate_loop.py", cache, tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_lightning_fit_with_ckpt_path(cache, tmp_path):
    run_example("lightning_fit.py", cache, tmp_path)


def test_torchtitan_slot_through_distributed_checkpoint(cache, tmp_path):
    run_example("dcp_slot.py", cache, tmp_path)
