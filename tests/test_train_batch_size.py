"""The batch-size finder (``shardcache find-batch-size`` / :func:`train.batch_size.find_batch_size`)
on CPU with the tiny synthetic cache; out-of-memory is simulated by patching the step."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from test_train_support import PY, REAL_LOADER, REPO, TINY_MODEL, base_env, make_cache
from train import batch_size as BS
from test_train_support import from_dict

FAKE = "test_train_support:FakeLoader"
LOADERS = [FAKE, REAL_LOADER]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return make_cache(tmp_path_factory.mktemp("cache") / "c", n=24)


def cfg_for(cache: Path, **kw):
    base = dict(cache=str(cache), loader=FAKE, model_kwargs=TINY_MODEL, threads=1, progress=False,
                device="cpu")
    base.update(kw)
    return from_dict(base)


def test_candidate_sizes():
    assert BS.candidate_sizes(8) == [1, 2, 4, 8]
    assert BS.candidate_sizes(6) == [1, 2, 4, 6]
    assert BS.candidate_sizes(1) == [1]
    assert BS.candidate_sizes(20, start=4) == [4, 8, 16, 20]


@pytest.mark.parametrize("extra", [{}, {"activation_checkpointing": True, "precision": "fp16",
                                        "latent_loss": "mse"}])
def test_increasing_sizes_up_to_max(cache, extra):
    res = BS.find_batch_size(cfg_for(cache, **extra), max_batch_size=8, steps=2)
    rows = res["results"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4, 8]
    assert all(r["status"] == "ok" for r in rows) and res["stopped"] == "max_batch_size"
    assert all(r["step_time_s"] > 0 and r["samples_per_s"] > 0 and r["peak_mem_mb"] > 0 for r in rows)
    assert res["device"] == "cpu" and res["capacity_mb"] is None
    best = max(rows, key=lambda r: r["samples_per_s"])["batch_size"]
    assert res["recommended"] == best  # CPU: the best samples/s
    table = BS.format_table(res)
    assert f"recommended --data.batch_size {best}" in table and "stopped at --max_batch_size" in table


@pytest.mark.parametrize("loader", LOADERS)
def test_stops_when_cache_too_small(cache, loader):
    res = BS.find_batch_size(cfg_for(cache, loader=loader), max_batch_size=1024, steps=1, start=4)
    rows = res["results"]
    assert [r["batch_size"] for r in rows] == [4, 8, 16, 32]  # 24 samples: no batch of 32
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "too_few_samples"]
    assert res["stopped"] == "too_few_samples" and res["recommended"] in (4, 8, 16)


def test_oom_stops_and_recommends_the_last_size_that_fit(cache, monkeypatch):
    """The OOM is raised inside the trainer's own micro-step (the step the finder times is
    Trainer.train_step, the step `shardcache train` runs)."""
    from train.trainer import Trainer
    real_step = Trainer.forward_backward_step
    seen = []

    def step(self, batch, sync_grads):
        bs = batch["codes"].shape[0]
        seen.append(bs)
        if bs >= 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        time.sleep(0.05)  # a fixed per-step cost, as on a GPU: samples/s grows with the batch
        return real_step(self, batch, sync_grads)

    monkeypatch.setattr(Trainer, "forward_backward_step", step)
    res = BS.find_batch_size(cfg_for(cache), max_batch_size=1024, steps=2)
    rows = res["results"]
    assert [r["batch_size"] for r in rows] == [1, 2, 4, 8]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "oom"]
    assert "OutOfMemoryError" in rows[-1]["error"] and rows[-1]["samples_per_s"] is None
    assert res["stopped"] == "oom" and res["recommended"] == 4
    assert seen == [1, 1, 2, 2, 4, 4, 8]  # nothing retried after the OOM
    assert "stopped at the first out-of-memory error" in BS.format_table(res)


def test_the_finder_runs_the_trainers_step(cache, monkeypatch):
    """Each timed step is Trainer.train_step with the run's options: grad_accum micro-steps per step
    and the trainer's clipping and grad norms (its StepStats count the steps)."""
    from train.trainer import Trainer
    calls = []
    real = Trainer.train_step

    def spy(self):
        micro, steps = self.stats.micro, self.stats.steps
        real(self)
        calls.append((self.stats.micro - micro, self.stats.steps - steps))

    monkeypatch.setattr(Trainer, "train_step", spy)
    res = BS.find_batch_size(cfg_for(cache, grad_accum=2, grad_clip=0.5), max_batch_size=2, steps=2)
    assert [r["status"] for r in res["results"]] == ["ok", "ok"]
    assert calls == [(2, 1)] * 4


def test_recommend_on_cuda_uses_the_margin():
    rows = [{"batch_size": b, "status": "ok", "samples_per_s": float(b), "peak_reserved_mb": mem}
            for b, mem in [(1, 300.0), (2, 500.0), (4, 880.0), (8, 950.0)]]
    assert BS.recommend(rows, "cuda", 1000.0, 0.9)[0] == 4     # 950 > 0.9 x 1000
    assert BS.recommend(rows, "cuda", 1000.0, 1.0)[0] == 8
    assert BS.recommend(rows, "cuda", 1000.0, 0.2)[0] is None
    assert BS.recommend(rows, "cpu", None, 0.9)[0] == 8        # CPU: best samples/s
    assert BS.recommend([], "cpu", None, 0.9)[0] is None


@pytest.mark.long  # make test-long; the search's unit tests of this file run in make test
def test_cli(cache, tmp_path, capsys):
    out = tmp_path / "res.json"
    args = ["--cache", str(cache), "--config", "none", "--data.loader", FAKE, "--model.kwargs", json.dumps(TINY_MODEL),
            "--dist.threads", "1", "--dist.device", "cpu", "--max_batch_size", "4", "--steps", "2", "--json", str(out)]
    r = subprocess.run([PY, "-m", "shardcache", "find-batch-size", *args], cwd=REPO, env=base_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "samples/s" in r.stdout and "recommended --data.batch_size" in r.stdout
    res = json.loads(out.read_text())
    assert [row["batch_size"] for row in res["results"]] == [1, 2, 4] and res["recommended"] in (1, 2, 4)
    assert BS.main([*args, "--margin", "1.5"]) == 2 and "margin: expected a number > 0 and <= 1, got 1.5" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        BS.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--max_batch_size" in text and "--model.activation_checkpointing" in text
