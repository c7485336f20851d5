"""``loaders.higgs.HiggsChatMLDataset`` against the real ``boson-multimodal`` 0.1.1 (Higgs-Audio's own
code). It pins ``transformers<4.47`` and cannot be imported beside transformers 5, so it runs in a venv
of its own (``make boson-venv``, built on first use from the package index: skipped, with the reason,
where that cannot be done; ``$SHARDCACHE_BOSON_VENV`` puts it elsewhere, e.g. somewhere that outlives a
fresh clone) through ``tests/boson_check.py``.

On a voice-cloning cache: each sample's ``input_ids``/``label_ids`` equal Boson's ``prepare_chatml_sample``
on the same ChatML record (Boson's label rule computed by Boson's code), ``HiggsAudioSampleCollator``
trains exactly the target items' columns (frames + delay) of ``label_audio_ids``, and ``HiggsAudioModel``
(tiny random config) runs forward on the batch.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

VENV = Path(os.environ.get("SHARDCACHE_BOSON_VENV", ROOT / "build" / "boson-venv"))


@pytest.fixture(scope="session")
def boson_python() -> str:
    py = VENV / "bin" / "python"
    if not (VENV / ".installed").exists():
        if not os.environ.get("SHARDCACHE_BUILD_BOSON"):  # minutes of installs: `make test-long` does it
            pytest.skip(f"{VENV} not built: `make test-long` (or `make boson-venv`) builds it and runs this test")
        try:
            r = subprocess.run(["make", "-s", "boson-venv", f"PYTHON={sys.executable}", f"BOSON_VENV={VENV}"], cwd=ROOT,
                               capture_output=True, text=True, timeout=1500)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"could not build {VENV} (make boson-venv): {e}")
        if r.returncode != 0:
            pytest.skip(f"could not build {VENV} (make boson-venv): {(r.stdout + r.stderr)[-800:]}")
    return str(py)


@pytest.mark.slow
def test_boson_collator_and_model_on_the_dataset(boson_python, higgs_caches, higgs_models):
    cache, recs = higgs_caches["voice_clone"]
    manifest = cache.parent / "voice_clone.json"
    r = subprocess.run([boson_python, str(ROOT / "tests" / "boson_check.py"), str(cache), str(manifest),
                        str(higgs_models / "higgs-tiny")], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["n"] == len(recs) and all(got["same_tokens"]) and all(got["same_labels"])
    assert got["speakers"] == sorted({rec["speaker"] for rec in recs.values()})     # one map for the cache
    # the columns each item occupies in label_audio_ids: its frames + 2 stream tokens + Q - 1 delay columns;
    # a target item (its turn at or after start_index) trains all but its first (frames + delay)
    Q, at, want = 8, 0, []
    starts = []
    for item in got["items"]:
        width = item["frames"] + Q + 1
        starts.append(at)
        if item["target"]:
            want += list(range(at + 1, at + width))
        at += width
    assert got["audio_out_ids_start"] == starts and got["label_audio_ids_shape"] == [Q, at]
    assert any(i["target"] for i in got["items"]) and any(not i["target"] for i in got["items"])
    assert got["trained_columns"] == want
    assert got["finite"] and got["audio_logits_shape"] == [at, Q, 1026]
