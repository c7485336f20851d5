"""The two jobs end to end on real-mini: precompute with the job's config, then train its recipe for 60
steps under torchrun with 2 processes; the loss must fall (a handful of samples is overfitted) and
metrics.jsonl must record it every step. (One process: the recipes overfit a batch in
test_recipes.py and the Higgs command trains the tts recipe in-process in test_train_recipes_cli.py;
the 1-process CLI runs once here cost ~25 s of the suite and checked nothing more.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from precompute.config import load_config
from precompute.job import run

from conftest import ROOT

JOBS = {"tts": "chatml_voice_clone.json", "vlm": "llava_multiturn.json"}


@pytest.fixture(scope="module")
def recipe_models(tiny_models) -> Path:
    return tiny_models


@pytest.fixture(scope="module")
def job_caches(real_mini, recipe_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("jobs")
    caches = {}
    for job, manifest in JOBS.items():
        cfg = load_config(ROOT / "configs" / f"precompute-{job}.yaml", [
            f"text_tokenizer.pretrained={recipe_models / 'tokenizer-tiny'}", "device=cpu", "num_workers=0",
            f"audio_tokenizer.pretrained={recipe_models / 'dac-tiny'}" if job == "tts" else
            f"image_encoder.pretrained={recipe_models / 'wan-tiny'}"])
        summary, _ = run(real_mini / manifest, out / job, cfg, progress=False)
        assert summary.rejected == 0
        caches[job] = out / job
    return caches


def _losses(run_dir: Path) -> list[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r and r.get("split") != "val"]


def _train(job: str, cache: Path, run_dir: Path, models: Path, nproc: int) -> subprocess.CompletedProcess:
    head = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                f"--nproc_per_node={nproc}"]
    cmd = head + ["-m", "train", "--cache", str(cache), "--out", str(run_dir), "--config",
                  str(ROOT / "configs" / f"train-{job}.yaml"), "--model-kwargs", json.dumps({"lm": str(models / "lm-tiny")}),
                  "--no-progress"]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2])
@pytest.mark.parametrize("job", list(JOBS))
def test_recipe_trains_and_the_loss_falls(job, nproc, job_caches, recipe_models, tmp_path):
    r = _train(job, job_caches[job], tmp_path / "run", recipe_models, nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(tmp_path / "run")
    assert len(losses) == 60  # log_every: 1
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (job, nproc, first, last)
    assert (tmp_path / "run" / "step-60").is_dir()
