"""``make bench-gpu``'s code (benchmarks/gpu.py) on the CPU with the tiny models (``--smoke``).

The GPU run is rare (a device is lent to few sessions) and it must not be the first run of this
code: the encoder names must resolve to the right model directories and the recipes' configs must
still train. Each run here is the real code path with ``device=cpu``; the figures are not checked,
only that every measurement ran and has the shape the GPU results use.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _smoke(*args: str, timeout: int = 600) -> str:
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--smoke", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
@pytest.mark.long  # make test-long; make bench-gpu runs it for real
def test_encoders_smoke():
    """Every encoder row: the VAE, Gemma 3's SigLIP + projector and each codec of CODECS, loaded
    through the precompute registry from the model built for it (the Higgs tokenizer once read the
    Higgs LM's directory: AttributeError)."""
    from benchmarks.gpu import CODECS
    out = _smoke("--sections", "vae", "siglip", "codecs")
    assert "| Wan 2.1 VAE | float32 |" in out and "| Gemma 3 SigLIP + projector | bfloat16 |" in out
    for name in CODECS:
        assert f"| {name} | float32 |" in out


@pytest.mark.long
def test_recipes_data_wait_smoke(real_mini):
    """Each recipe's data-wait run trains on a cache made with its own precompute config (the TTS
    recipe once got a DAC cache and a Llama LM for ``--model.name higgs``)."""
    from benchmarks.gpu import DATA_WAIT_RUNS
    out = _smoke("--sections", "data_wait", "--recipes", *[f"{r}:{s}" for r, s in DATA_WAIT_RUNS if s == "tiny"])
    for recipe, size in DATA_WAIT_RUNS:
        if size == "tiny":
            assert f"| {recipe} (" in out, out


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_steady_state_set_reaches_the_codec runs in make test
def test_steady_state_smoke():
    """``benchmarks/gpu_steady.py``'s code on the CPU (tiny models, 24 rows per job): both recipes'
    configs take the benchmark's model directories, every row is kept, the encoders-alone pass ran
    and the table has a row per job (the GPU run must not be this code's first)."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_steady", "--smoke"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [j["job"] for j in jobs] == ["tts", "theworld"]
    for j in jobs:
        assert j["kept"] == j["rows"] == 24 and j["encoders_alone"]["rows"] == 8 and j["wall_over_encoders_alone"] > 0
        assert f"| {j['job']} | 24 (12) |" in r.stdout


def test_steady_state_set_reaches_the_codec():
    """``gpu_steady --set KEY=VALUE`` overrides the job's config as ``shardcache precompute --KEY=VALUE`` does
    and reaches the encoder the job loads, while the benchmark's model directory stays the codec's
    ``pretrained``."""
    from benchmarks.gpu_steady import config, models
    from precompute.encode import load_encoders
    dirs = models("tiny")
    cfg = config("tts", dirs, "cpu", ["audio_tokenizer.max_batch_size=8"])
    assert cfg.audio_tokenizer["pretrained"] == str(dirs["codec"])
    assert load_encoders(cfg, "cpu").audio.max_batch_size == 8
    assert load_encoders(config("tts", dirs, "cpu"), "cpu").audio.max_batch_size == 1  # CPU default


def test_codec_batch_compare():
    """``gpu_codec_batch.compare`` counts a flipped code and a clip of another shape."""
    import numpy as np

    from benchmarks.gpu_codec_batch import compare
    ref = [np.zeros((8, 10), np.int16), np.ones((8, 5), np.int16)]
    assert compare(ref, [a.copy() for a in ref]) == {"identical": 2, "total": 2, "equal_codes": 1.0,
                                                      "max_frames_differing": 0}
    got = [a.copy() for a in ref]
    got[0][2, 3] = got[0][5, 3] = got[0][0, 7] = 7  # two frames of clip 0
    assert compare(ref, got) == {"identical": 1, "total": 2, "equal_codes": 117 / 120, "max_frames_differing": 2}
    got[1] = np.ones((8, 4), np.int16)
    assert compare(ref, got) == {"identical": 0, "total": 2, "equal_codes": 77 / 120, "max_frames_differing": 5}


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_codec_batch_compare runs in make test
def test_codec_batch_smoke(tmp_path):
    """``benchmarks/gpu_codec_batch.py`` on the CPU (tiny models, 6 clips, max_batch_size 1 and 2): each
    codec loads through the registry with its recipe's options, clip by clip is identical to itself across
    calls (on the CPU encoding is deterministic: a comparison that reads the wrong codes fails here), and
    the results file and table have a row per codec and batch size."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_codec_batch", "--smoke", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_codec_batch.json").read_text())
    assert [c["codec"] for c in result["codecs"]] == ["higgs", "dac"]
    for c in result["codecs"]:
        assert c["clips"] == 6 and [x["max_batch_size"] for x in c["runs"]] == [1, 2]
        one = c["runs"][0]
        assert one["vs_batch_1"]["identical"] == one["repeat"]["identical"] == one["repeat"]["total"] == 6
        for x in c["runs"]:
            assert x["vs_batch_1"]["total"] == 6 and 0 <= x["vs_batch_1"]["equal_codes"] <= 1 and x["audio_s_per_s"] > 0
            assert f"| {c['codec']} | {x['max_batch_size']} |" in (tmp_path / "gpu_codec_batch.md").read_text()
    # the composition probe: clip 0 with other clips at the same place gives its codes again (CPU)
    assert [c["codec"] for c in result["composition"]] == ["higgs", "dac"]
    for c in result["composition"]:
        assert c["batch"] == 2 and all(c[k]["total"] == 1 for k in ("other_clips", "silent_clips", "moved_last", "alone"))
        assert c["other_clips"]["identical"] == 1 and f"| {c['codec']} | 2 | yes |" in (tmp_path / "gpu_codec_batch.md").read_text()


@pytest.mark.long
def test_stage_one_gpu_checks_smoke():
    """``benchmarks/gpu_stage_one.py`` (make bench-gpu-stage-one) on the CPU with the tiny models: the place
    probe of both codecs, the Higgs variants (batched, 2 processes) with their comparisons, both recipes'
    jobs with the time split (the GPU run must not be this code's first)."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu_stage_one", "--smoke"], cwd=ROOT, capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("| place | zero = real companions |") == 2
    assert "processes 2: 6/6" in r.stdout and "| tts | 16 (8) |" in r.stdout and "| theworld | 16 (8) |" in r.stdout
    assert "| tts |" in r.stdout.split("Where the time went")[1]
