"""The ceiling benchmark's parts (no speed asserted here: speeds are make bench's): null encoders
with the real encoders' output contract, the synthetic corpus, one job kind end to end."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from benchmarks import null_encoders, synth_corpus
from precompute.encoders.base import AudioTokenizer, ImageEncoder, check_protocol

ROOT = Path(__file__).resolve().parents[1]


def test_null_encoders_keep_the_encoder_contract_and_shapes():
    codec = check_protocol(null_encoders.codec(), AudioTokenizer)
    got = codec.encode([np.zeros(24000 * 10, np.float32), np.zeros(961, np.float32)])
    assert [c.shape for c in got] == [(8, 250), (8, 2)] and all(c.dtype == np.int16 for c in got)
    vae = check_protocol(null_encoders.vae(), ImageEncoder)
    z = vae.encode(np.zeros((2, 512, 256, 3), np.uint8))
    assert z.shape == (2, 16, 1, 64, 32) and z.dtype == np.float32
    p = null_encoders.image_features()
    assert p.image_sequence.count("<image_soft_token>") == 256
    f = p.encoder.encode([np.zeros((100, 80, 3), np.uint8)])
    assert f[0].shape == (256, 2560) and f[0].dtype == np.int16


@pytest.mark.slow
def test_synthetic_corpus_has_the_formats_rates_and_sizes_asked_for(tmp_path):
    m = synth_corpus.write(tmp_path, 9, jobs=1)
    rows = [json.loads(x) for x in m["speech"].read_text().splitlines()]
    infos = [sf.info(tmp_path / r["audio"]) for r in rows]
    assert {(i.format, i.samplerate) for i in infos} == {(f, r) for f in ("WAV", "FLAC", "MP3")
                                                          for r in (16000, 44100, 48000)}
    assert all(abs(i.duration - 10.0) < 0.1 for i in infos)
    sizes = {Image.open(tmp_path / x["image"]).size for x in json.loads(m["llava"].read_text())}
    assert len(sizes) >= 5 and all(Image.open(p).format == "JPEG" for p in (tmp_path / "images").iterdir())
    convs = json.loads(m["voice_clone"].read_text())
    assert len(convs) == 9 and all(sum(isinstance(x["content"], dict) for x in c["messages"]) == 2 for c in convs)


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "models" / "higgs-tiny").is_dir(), reason="needs the test models (make models)")
def test_a_voice_clone_job_runs_on_null_encoders(tmp_path):
    from benchmarks import bench_ceiling
    m = synth_corpus.write(tmp_path / "corpus", 3, jobs=1)
    r = bench_ceiling.job(m["voice_clone"], bench_ceiling.config("voice_clone"), workers=0)
    assert r["samples"] == 3 and r["rejected"] == 0 and r["audio_s"] == 60.0


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "models" / "higgs-tiny").is_dir(), reason="needs the test models (make models)")
def test_the_overlap_section_runs_the_job_with_the_sleeping_stand_in(tmp_path):
    """make bench's overlap section on 6 voice-cloning rows (12 clips), the stand-in codec waiting 5 ms per
    clip: every row kept, the encoder thread's time covers the waits, the split is reported."""
    from benchmarks import bench_overlap
    m = synth_corpus.write(tmp_path / "corpus", 3, jobs=1)
    r = bench_overlap.job(bench_overlap.repeated(m["voice_clone"], 6), "voice_clone", 5.0, 0)
    assert r["rows"] == 6 and r["rejected"] == 0 and r["clips"] == 12 and r["sleep_s"] == 0.06
    assert r["encoder_s"] >= 0.06 and r["wall_over_encoder"] > 0 and {"receive_s", "host_s", "collect_wait_s"} <= set(r)
    assert "| voice_clone | 6 | 12 |" in "\n".join(bench_overlap.summary_lines(
        {"ms_per_clip": 5.0, "workers": 0, "target": 1.05, "jobs": [r], "loadavg_start": (0,), "loadavg_end": (0,),
         "cpus": 2}))
