"""The demo path a new user runs: demo cache -> `torchrun --nproc_per_node=2 -m shardcache train` (gloo, CPU)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.long  # make test-long; CI's first command (make precompute train) is this run
def test_torchrun_two_ranks_trains_on_the_demo_cache(demo_cache, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "shardcache", "train",
           "--config", str(ROOT / "configs" / "train-demo.yaml"), "--cache", str(demo_cache), "--run_dir", str(out),
           "--training.steps", "6", "--checkpoint.every", "3", "--metrics.every", "1", "--metrics.progress=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpts = sorted(p.name for p in out.iterdir() if p.name.startswith("step-"))
    assert ckpts == ["step-3", "step-6"]
    assert any(f.suffix == ".safetensors" for f in (out / "step-6").iterdir())
    records = [json.loads(line) for line in next(out.glob("*.jsonl")).read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
