"""The two jobs end to end on real-mini: precompute with the job's config, then train its recipe for 60
steps under torchrun with 2 processes; the loss must fall (a handful of samples is overfitted) and
metrics.jsonl must record it every step. The TTS job (Higgs-Audio v2: the tiny random
``higgs_audio_v2`` model, its text tokenizer and audio tokenizer) also trains in 1 process, and its
checkpoints record the model's transformers config. (vlm in one process: the recipes overfit a batch in
test_recipes.py; the 1-process CLI run cost ~25 s of the suite and checked nothing more.)"""
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

pytestmark = pytest.mark.xdist_group("recipe_training")  # one worker builds the module's fixtures


JOBS = {"tts": "chatml_voice_clone.json", "vlm": "llava_multiturn.json"}


@pytest.fixture(scope="module")
def recipe_models(tiny_models) -> Path:
    return tiny_models


@pytest.fixture(scope="module")
def job_caches(real_mini, recipe_models, higgs_codec, tmp_path_factory):
    out = tmp_path_factory.mktemp("jobs")
    caches = {}
    overrides = {"tts": [f"text_tokenizer.pretrained={higgs_codec / 'higgs-tiny'}",
                         f"audio_tokenizer.pretrained={higgs_codec / 'higgs-audio-tokenizer-tiny'}"],
                 "vlm": [f"text_tokenizer.pretrained={recipe_models / 'tokenizer-tiny'}",
                         f"image_encoder.pretrained={recipe_models / 'wan-tiny'}"]}
    for job, manifest in JOBS.items():
        cfg = load_config(ROOT / "configs" / f"precompute-{job}.yaml",
                          overrides[job] + ["device=cpu", "num_workers=0"])
        summary, _ = run(real_mini / manifest, out / job, cfg, progress=False)
        assert summary.rejected == 0
        caches[job] = out / job
    return caches


def _losses(run_dir: Path) -> list[float]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r and r.get("split") != "val"]


def _train(job: str, cache: Path, run_dir: Path, lm: Path, nproc: int) -> subprocess.CompletedProcess:
    # the tts job's codes come from the tiny Higgs audio tokenizer beside lm: the model's paired one
    paired = ["--model.audio_tokenizer", str(lm.parent / "higgs-audio-tokenizer-tiny")] if job == "tts" else []
    head = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                f"--nproc_per_node={nproc}"]
    cmd = head + ["-m", "shardcache", "train", "--cache", str(cache), "--run_dir", str(run_dir), "--config",
                  str(ROOT / "configs" / f"train-{job}.yaml"), "--model.kwargs", json.dumps(
                      {"lm": str(lm)} if job == "tts" else {"lm": str(lm), "tokenizer": str(lm.parent / "tokenizer-tiny")}),
                  "--metrics.progress=false", *paired]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("job,nproc", [pytest.param("tts", 1, marks=pytest.mark.long), pytest.param("tts", 2, marks=pytest.mark.long),
                                         pytest.param("vlm", 2, marks=pytest.mark.long)])  # make test-long; test_train_recipes_cli.py (higgs) and test_theworld.py train in make test
def test_recipe_trains_and_the_loss_falls(job, nproc, job_caches, recipe_models, higgs_models, tmp_path):
    lm = higgs_models / "higgs-tiny" if job == "tts" else recipe_models / "lm-tiny"
    r = _train(job, job_caches[job], tmp_path / "run", lm, nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = _losses(tmp_path / "run")
    assert len(losses) == 60  # log_every: 1
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (job, nproc, first, last)
    assert (tmp_path / "run" / "step-60").is_dir()
    if job == "tts":   # a higgs_audio_v2 checkpoint: the config says so, the weights are the model's
        cfg = json.loads((tmp_path / "run" / "step-60" / "config.json").read_text())
        assert cfg["model"]["name"] == "higgs" and cfg["model_config"]["model_type"] == "higgs_audio_v2"
        from safetensors import safe_open
        with safe_open(str(tmp_path / "run" / "step-60" / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert {"lm.model.embed_audio_tokens.embed_audio_tokens.weight", "lm.audio_lm_head.weight",
                "lm.text_lm_head.weight"} <= names
