"""Stage one's overlap on the CPU: how much of a job's wall time is its encoder's.

    python -m benchmarks.run --only overlap            # what make bench runs
    python -m benchmarks.bench_overlap [--n 200] [--ms 50] [--workers 1] [--kinds speech,voice_clone]

The real job (:func:`precompute.job.run`, TTS config: Higgs-shaped codes, 24 kHz waveforms, the
16 kHz input-audio field) on the synthetic corpus (:mod:`benchmarks.synth_corpus`), with a stand-in
codec that waits ``--ms`` per clip in ``time.sleep`` (:class:`benchmarks.null_encoders.SleepingCodec`:
the GIL is free meanwhile, as during a CUDA call and its synchronisation) and ``--workers`` decode
processes. ``wall / encoder`` is the job's processing wall time (first batch to last commit:
``Summary.wall_s``) over the time its encoder thread spent in the codec (``Summary.encoder_s``);
1.0 means every other step (receiving decoded rows, the host producers, value checks, the json
member, the shard writer) ran while the codec waited. ``sleep`` is clips x ``--ms``, the least the
encoder can take. The main thread's split (receive, host work, waiting for the encoder thread,
waiting for the writer) is :meth:`precompute.encode.Summary.split`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.bench_ceiling import config as ceiling_config

#: the issue's target: wall / encoder time with the stand-in at 50 ms per clip and one decode process
TARGET = 1.05
KINDS = ("speech", "voice_clone")


def config(kind: str, ms: float, gil_ms: float = 0.0, **kw):
    """The kind's recipe config (TTS) with the sleeping stand-in codec (``gil_ms`` per clip holding the GIL first)."""
    cfg = ceiling_config(kind)
    return dataclasses.replace(cfg, audio_tokenizer={"factory": "benchmarks.null_encoders:sleeping_codec", "kwargs": {
        "seconds_per_clip": ms / 1e3, "gil_seconds_per_clip": gil_ms / 1e3}}, **kw)


def job(manifest: Path, kind: str, ms: float, workers: int, gil_ms: float = 0.0) -> dict:
    """One job over ``manifest``: wall, encoder and sleep seconds, their ratios, the main thread's split."""
    from precompute.job import run
    cfg = config(kind, ms, gil_ms, num_workers=workers)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        summary, _ = run(manifest, Path(d) / "c", cfg, progress=False)
        total = time.perf_counter() - t0
    clips = _clips(manifest)
    sleep = clips * (ms + gil_ms) / 1e3
    return {"kind": kind, "rows": summary.kept, "rejected": summary.rejected, "clips": clips, "ms_per_clip": ms,
            "gil_ms_per_clip": gil_ms,
            "workers": workers, "setup_s": round(summary.setup_s, 2), "total_s": round(total, 2),
            "sleep_s": round(sleep, 2), **summary.split(),
            "wall_over_encoder": round(summary.wall_s / summary.encoder_s, 3) if summary.encoder_s else None,
            "wall_over_sleep": round(summary.wall_s / sleep, 3) if sleep else None}


def _clips(manifest: Path) -> int:
    """Audio items of the manifest's rows (every row of the synthetic corpus is kept)."""
    from precompute.manifests import read_requests
    return sum(len(r.conversation.audio) for r in read_requests(manifest) if r.error is None)


def repeated(manifest: Path, n: int) -> Path:
    """``n`` rows of ``manifest`` (a JSONL of flat rows or a JSON list of conversations), its rows repeated
    under new keys (every row is decoded and encoded again: nothing is cached between rows), beside it."""
    if manifest.suffix == ".jsonl":
        rows = [json.loads(x) for x in manifest.read_text().splitlines() if x.strip()]
    else:
        rows = json.loads(manifest.read_text())
    out = []
    for i in range(n):
        row = json.loads(json.dumps(rows[i % len(rows)]))
        if "misc" in row:
            row["misc"]["key"] += f"-{i}"
        elif "id" in row:
            row["id"] += f"-{i}"
        else:
            row["key"] += f"-{i}"
        out.append(row)
    path = manifest.parent / f"overlap-{manifest.stem}-{n}{manifest.suffix}"
    path.write_text("".join(json.dumps(r) + "\n" for r in out) if manifest.suffix == ".jsonl" else json.dumps(out))
    return path


def run_section(n: int = 600, ms: float = 50.0, workers: int = 1, kinds=KINDS, distinct: int = 200) -> dict:
    """``make bench``'s overlap section: each kind once, ``n`` rows over ``distinct`` conversations of the
    synthetic corpus (written or reused)."""
    from benchmarks import synth_corpus
    load0 = os.getloadavg()
    manifests = synth_corpus.write(synth_corpus.default_dir(), distinct)
    rows = [job(repeated(manifests[k], n), k, ms, workers) for k in kinds]
    return {"n": n, "ms_per_clip": ms, "workers": workers, "target": TARGET, "jobs": rows,
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "cpus": os.cpu_count()}


def summary_lines(r: dict) -> list[str]:
    """The overlap section of ``benchmarks/results/summary.md``."""
    out = [f"**Overlap** (the real job, TTS config, with a stand-in codec that waits {r['ms_per_clip']:g} ms per clip "
           f"without the GIL, as a CUDA call does; {r['workers']} decode process; synthetic corpus; wall = first batch "
           "to last commit; encoder = the encoder thread's time in the codec; main thread: waiting for decoded rows, "
           "host producers + checks + json, waiting for the encoder, waiting for the writer):", "",
           "| job kind | rows | clips | wall s | encoder s | wall / encoder | wall / (clips x sleep) | receive s | "
           "host s | wait encoder s | wait writer s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for j in r["jobs"]:
        out.append(f"| {j['kind']} | {j['rows']} | {j['clips']} | {j['wall_s']:.2f} | {j['encoder_s']:.2f} | "
                   f"{j['wall_over_encoder']} | {j['wall_over_sleep']} | {j['receive_s']:.2f} | {j['host_s']:.2f} | "
                   f"{j['collect_wait_s']:.2f} | {j['writer_wait_s']:.2f} |")
    worst = max(j["wall_over_encoder"] for j in r["jobs"])
    out += ["", f"Target: wall / encoder <= {r['target']} (worst here {worst}). Load average "
            f"{r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f} on {r['cpus']} cores (shared machine).", ""]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=600, help="rows per job kind")
    ap.add_argument("--ms", type=float, default=50.0, help="the stand-in codec's wait per clip (ms)")
    ap.add_argument("--workers", type=int, default=1, help="decode processes")
    ap.add_argument("--kinds", default=",".join(KINDS))
    args = ap.parse_args(argv)
    r = run_section(args.n, args.ms, args.workers, args.kinds.split(","))
    print(json.dumps(r["jobs"], indent=1))
    print("\n".join(summary_lines(r)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
