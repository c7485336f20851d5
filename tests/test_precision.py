"""Half-precision guard: bf16 encoders are measured against float32 on the job's own rows."""
from __future__ import annotations

import dataclasses

import pytest

from precompute.config import PrecisionTolerance
from precompute.precision import PrecisionMismatch
from shards import read_manifest

from conftest import DEMO


def test_bf16_is_measured_and_recorded(tiny_config, tmp_path):
    from precompute.job import run
    cfg = dataclasses.replace(tiny_config, encoder_dtype="bfloat16", precision_samples=8,
                              precision_tolerance=PrecisionTolerance(latents_rel_err=1.0, codes_agreement=0.0))
    summary, manifest = run(DEMO / "samples.jsonl", tmp_path / "c", cfg, progress=False)
    check = manifest["precision_check"]
    assert check["dtype"] == "bfloat16" and check["samples"] == 8
    assert 0 < check["latents_rel_err"] < 1.0  # bf16 is not bit-identical to fp32...
    assert 0 <= check["codes_agreement"] <= 1.0
    assert read_manifest(tmp_path / "c")["encoders"]["audio_tokenizer"]["dtype"] == "bfloat16"
    assert summary.kept > 0


def test_bf16_outside_tolerance_stops_the_job_before_writing(tiny_config, tmp_path):
    from precompute.job import run
    cfg = dataclasses.replace(tiny_config, encoder_dtype="bfloat16",
                              precision_tolerance=PrecisionTolerance(latents_rel_err=0.0, codes_agreement=1.0))
    with pytest.raises(PrecisionMismatch, match="float32"):
        run(DEMO / "samples.jsonl", tmp_path / "c", cfg, progress=False)
    assert not list((tmp_path / "c").glob("shard-*.tar"))


def test_float32_runs_no_check(demo_cache):
    assert "precision_check" not in read_manifest(demo_cache)
