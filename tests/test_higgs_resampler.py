"""``audio_tokenizer.resampler`` of the higgs codec on a machine where no torchaudio loads (the CPU torch 2.13
here): ``auto``/``soxr`` run transformers' own ``HiggsAudioV2TokenizerModel`` with its semantic branch's
24 -> 16 kHz resample computed by soxr, without making a ``torchaudio`` module.

Each check runs in a subprocess without the tests' torchaudio stand-in (tools/shims) on its path, as a user's
``shardcache precompute`` does. The reference codes come from transformers' module imported the normal way in
this process, where the stand-in (soxr under torchaudio's name) answers its ``import torchaudio``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

# a user's environment: the repository on the path, not tools/shims
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

ENCODE = """
import json, sys, numpy as np, torch
from precompute.encoders import load_audio_tokenizer
tok = load_audio_tokenizer({"name": "higgs", "pretrained": sys.argv[1], "resampler": sys.argv[2]})
clip = np.load(sys.argv[3])
codes = tok.encode([clip])[0]
with torch.inference_mode():  # what the resampler feeds: the semantic branch's features
    semantic = tok.model._extract_semantic_features(torch.from_numpy(clip)[None, None])[0]
print(json.dumps({"codes": codes.tolist(), "semantic": semantic.tolist(), "resampler": tok.describe()["resampler"],
                  "torchaudio_module": "torchaudio" in sys.modules, "module": type(tok.model).__module__}))
"""


@pytest.fixture(scope="module")
def resampling_tokenizer(tmp_path_factory):
    """A tiny random Higgs audio tokenizer whose semantic branch runs at 16 kHz (the released one's rate), so
    its input really is resampled (the tiny tokenizer of ``make models`` runs it at 24 kHz). Built in this
    process, where conftest's stand-in lets transformers import its module."""
    import torch
    from transformers import HiggsAudioV2TokenizerModel

    from tools.testing.higgs import audio_tokenizer_config
    cfg = audio_tokenizer_config("tiny")
    cfg.semantic_sample_rate = 16000
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("higgs-16k") / "tokenizer"
    HiggsAudioV2TokenizerModel(cfg).eval().save_pretrained(out)
    return out


@pytest.mark.long  # make test-long; the higgs_caches fixture runs configs/precompute-tts.yaml (resampler auto: soxr) in make test
def test_soxr_runs_transformers_model_with_soxr_and_no_torchaudio_module(resampling_tokenizer, tmp_path):
    import torch
    from transformers import HiggsAudioV2TokenizerModel

    t = np.arange(24000 * 2, dtype=np.float32) / 24000
    clip = (0.4 * np.sin(2 * np.pi * (220 + 900 * t) * t) + 0.05 * np.random.default_rng(0).standard_normal(t.size)
            ).astype(np.float32)
    np.save(tmp_path / "clip.npy", clip)
    model = HiggsAudioV2TokenizerModel.from_pretrained(resampling_tokenizer).eval()
    with torch.inference_mode():
        want = model.encode(torch.from_numpy(clip)[None, None], bandwidth=2).audio_codes[0].numpy()
        semantic = model._extract_semantic_features(torch.from_numpy(clip)[None, None])[0].numpy()
    for resampler in ("soxr", "auto"):
        r = subprocess.run([sys.executable, "-c", ENCODE, str(resampling_tokenizer), resampler, str(tmp_path / "clip.npy")],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout.strip().splitlines()[-1])
        np.testing.assert_array_equal(np.array(got["codes"]), want)   # transformers' model, soxr in its resample
        np.testing.assert_allclose(np.array(got["semantic"]), semantic, rtol=1e-5, atol=1e-6)
        assert got["resampler"].startswith("soxr ") and got["resampler"].endswith(" HQ")
        assert got["torchaudio_module"] is False                       # nothing else sees a torchaudio
        assert got["module"] == "precompute.encoders.higgs_resampler._soxr_model"   # a module of the product's name
        assert ("torchaudio cannot be imported here" in r.stderr) == (resampler == "auto")
    r = subprocess.run([sys.executable, "-c", ENCODE, str(resampling_tokenizer), "torchaudio", str(tmp_path / "clip.npy")],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "audio_tokenizer.resampler: soxr (or auto)" in r.stderr


@pytest.mark.slow
@pytest.mark.long  # make test-long; the higgs_caches fixture precomputes with configs/precompute-tts.yaml in make test
def test_the_tts_config_precomputes_voice_cloning_where_no_torchaudio_loads(real_mini, higgs_models, tmp_path):
    """``shardcache precompute --config configs/precompute-tts.yaml`` on the real-mini voice-cloning manifest, run
    as a user runs it (no stand-in): ``resampler: auto`` takes soxr, says so, and the manifest records it."""
    cache = tmp_path / "tts"
    r = subprocess.run([sys.executable, "-m", "shardcache", "precompute", "--manifest",
                        str(real_mini / "chatml_voice_clone.json"), "--cache", str(cache), "--config",
                        "configs/precompute-tts.yaml", "--no_progress",
                        "--audio_tokenizer.pretrained", str(higgs_models / "higgs-audio-tokenizer-tiny"),
                        "--text_tokenizer.pretrained", str(higgs_models / "higgs-tiny")],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "audio_tokenizer.resampler auto: torchaudio cannot be imported here" in r.stderr
    man = json.loads((cache / "manifest.json").read_text())
    n = sum(1 for _ in json.loads((real_mini / "chatml_voice_clone.json").read_text()))
    assert (man["counts"]["samples"], man["counts"]["rejected"]) == (n, 0)
    assert man["config"]["audio_tokenizer"]["resampler"] == "auto"
