"""Stage one: wall time vs encoder-only time over the same batches, samples/s, audio opens/sample.

For each model size (tiny, and ``full`` = real-size DAC (Higgs-shaped) and Wan VAE configs with
random weights, where the encoders dominate) and each corpus (the demo, and real-mini when present):

1. ``job``: the real job (decode workers + batched encoders + writer thread) into a fresh cache;
   its ``encoder_s`` is the time spent inside encoder calls, ``wall_s`` the wall time from the
   first batch to the last shard commit (model loading and weight hashing are ``setup_s``).
2. ``encoders_alone``: the same rows decoded up front, then only the encoder calls timed, batched
   exactly as the job batches them. ``wall / encoders_alone`` is how well decoding and writing are
   hidden behind the encoders (target <= 1.15 with the real-size configs).
3. audio file opens per decoded row, counted by wrapping ``io.open`` in a ``num_workers=0`` run.
"""
from __future__ import annotations

import builtins
import dataclasses
import io
import tempfile
from pathlib import Path

import torch

from precompute.config import load_config
from precompute.job import Summary, encode_batch, load_encoders, run
from precompute.manifests import read_manifest
from precompute.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]


def _config(models: Path, size: str, **kw):
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        f"audio_tokenizer.pretrained={models / f'dac-{size}'}",
        f"image_encoder.pretrained={models / f'wan-{size}'}", "device=cpu"])
    return dataclasses.replace(cfg, **kw)


def encoders_alone(manifest: Path, cfg) -> tuple[float, int]:
    """Seconds spent in encoder calls when every row is decoded beforehand (same batching as the job)."""
    enc = load_encoders(cfg, "cpu")
    rates = tuple(dict.fromkeys([cfg.sample_rate, enc.audio.sample_rate]))
    prepared = [prepare(r, 0, cfg, rates, enc.text, enc.image.spatial_factor) for r in read_manifest(manifest)]
    summary = Summary()
    with torch.inference_mode():
        for i in range(0, len(prepared), cfg.batch_size):
            encode_batch(prepared[i:i + cfg.batch_size], enc, cfg, summary, "cpu")
    return summary.encoder_s, sum(p.error is None for p in prepared)


def audio_opens(manifest: Path, cfg) -> dict:
    """Audio file opens per decoded manifest row in a single-process run (1.0 = one read per row)."""
    counted: list[str] = []
    real = io.open

    def counting(file, *a, **k):
        if str(file).lower().endswith((".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a")):
            counted.append(str(file))
        return real(file, *a, **k)

    io.open = builtins.open = counting
    try:
        with tempfile.TemporaryDirectory() as d:
            summary, _ = run(manifest, Path(d) / "c", dataclasses.replace(cfg, num_workers=0), progress=False)
    finally:
        io.open = builtins.open = real
    decoded = [r for r in read_manifest(manifest) if r.error is None and r.audio and Path(r.audio).is_file()]
    return {"audio_rows_decoded": len(decoded), "audio_opens": len(counted),
            "audio_opens_per_row": round(len(counted) / max(1, len(decoded)), 3)}


def bench(manifest: Path, models: Path, size: str, repeats: int = 1) -> dict:
    cfg = _config(models, size)
    walls, enc_in_job = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            summary, _ = run(manifest, Path(d) / "c", cfg, progress=False)
        walls.append(summary.wall_s)
        enc_in_job.append(summary.encoder_s)
    wall = sorted(walls)[len(walls) // 2]
    alone, kept = encoders_alone(manifest, cfg)
    return {
        "corpus": manifest.parent.name, "models": size, "samples": summary.kept, "rejected": summary.rejected,
        "setup_s": round(summary.setup_s, 2), "wall_s": round(wall, 2), "encoder_s_in_job": round(sorted(enc_in_job)[len(enc_in_job) // 2], 2),
        "encoders_alone_s": round(alone, 2), "wall_over_encoders_alone": round(wall / alone, 3),
        "encoder_busy": round(summary.encoder_busy, 3), "samples_per_s": round(summary.kept / wall, 2),
    } | (audio_opens(manifest, cfg) if size == "tiny" else {})
