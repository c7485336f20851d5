"""Stage one: wall time vs encoder-only time over the same batches, samples/s, audio opens/sample.

For each model size (tiny, and ``full`` = real-size DAC (Higgs-shaped) and Wan VAE configs with
random weights, where the encoders dominate) and each corpus (the demo, and real-mini when present):

1. ``job``: the real job (decode workers + batched encoders + writer thread) into a fresh cache;
   its ``encoder_s`` is the time spent inside encoder calls, ``wall_s`` the wall time from the
   first batch to the last shard commit (model loading and weight hashing are ``setup_s``).
2. ``encoders_alone``: the same rows decoded up front, then only the encoder calls timed, batched
   exactly as the job batches them (:class:`precompute.pipeline.EncodeStream`: by length). ``wall / encoders_alone`` is how well decoding and writing are
   hidden behind the encoders (target <= 1.15 with the real-size configs).
3. audio file opens per distinct audio file of each conversation, counted by wrapping ``io.open``
   in a ``num_workers=0`` run (1.0: each file opened once per conversation, whatever number of its
   items use it).
"""
from __future__ import annotations

import builtins
import dataclasses
import io
import tempfile
from pathlib import Path

import torch

from precompute.config import load_config
from precompute.encode import Summary
from precompute.job import Job
from precompute.chunks import plan_chunks
from precompute.job import run
from precompute.manifests import read_requests
from precompute.pipeline import EncodeStream

ROOT = Path(__file__).resolve().parents[1]


def corpus_name(manifest: Path) -> str:
    """``demo`` / ``real-mini`` for the flat manifests, else the manifest's stem (``chatml_voice_clone``)."""
    return manifest.parent.name if manifest.name in ("samples.jsonl", "samples_with_corrupt.jsonl") else manifest.stem


def _config(models: Path, size: str, device: str = "cpu", **kw):
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        f"audio_tokenizer.pretrained={models / f'dac-{size}'}",
        f"image_encoder.pretrained={models / f'wan-{size}'}", f"device={device}"])
    return dataclasses.replace(cfg, **kw)


def encoders_alone(manifest: Path, cfg, limit: int | None = None) -> tuple[float, int]:
    """Seconds spent in encoder calls when every row (the first ``limit``) is decoded beforehand, batched
    as the job batches them, after one warm-up call (kernel selection, lazy initialisation; the job's
    own first batch is its probe); and the rows encoded."""
    requests = read_requests(manifest, fmt=cfg.manifest_format)
    pipe = Job.build(cfg, cfg.device, requests)  # the tokens the rows need, as the job checks them
    plan = plan_chunks(len(requests), cfg.samples_per_shard)
    items = [(requests[p], c) for c, chunk in enumerate(plan) for p in chunk.positions.tolist()][:limit]
    prepared = [pipe.prepare(r, c) for r, c in items]
    summary = Summary()
    stream = EncodeStream(lambda rows: pipe.encode(rows, summary), pipe.batch_size, pipe.window)  # as the job batches
    with torch.inference_mode():
        pipe.encode(prepared[:cfg.encoder_batch_size], Summary())
        stream.feed(prepared)
        stream.close()
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
    # one open per distinct existing file of each conversation (a reference clip shared by several
    # conversations is opened once in each of them)
    needed = sum(len({a.source for a in r.conversation.audio if Path(a.source).is_file()})
                 for r in read_requests(manifest) if r.error is None)
    return {"audio_files_decoded": needed, "audio_opens": len(counted),
            "audio_opens_per_file": round(len(counted) / needed, 3) if needed else None}


def bench(manifest: Path, models: Path, size: str, repeats: int = 1, device: str = "cpu") -> dict:
    cfg = _config(models, size, device)
    walls, enc_in_job = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            summary, _ = run(manifest, Path(d) / "c", cfg, progress=False)
        walls.append(summary.wall_s)
        enc_in_job.append(summary.encoder_s)
    wall = sorted(walls)[len(walls) // 2]
    alone, kept = encoders_alone(manifest, cfg)
    return {
        "corpus": corpus_name(manifest), "models": size, "samples": summary.kept, "rejected": summary.rejected,
        "setup_s": round(summary.setup_s, 2), "wall_s": round(wall, 2), "encoder_s_in_job": round(sorted(enc_in_job)[len(enc_in_job) // 2], 2),
        "encoders_alone_s": round(alone, 2), "wall_over_encoders_alone": round(wall / alone, 3),
        "encoder_busy": round(summary.encoder_busy, 3), "samples_per_s": round(summary.kept / wall, 2),
    } | (audio_opens(manifest, cfg) if size == "tiny" else {})
