"""Stage one at dataset size: planning time, no-change rerun time and peak RSS per rank for N = 10k, 100k, 1M rows.

    python -m benchmarks.run --only scale_stage_one [--scale-sizes 10000,100000,1000000]   # in make bench
    python -m benchmarks.bench_scale_stage_one [--sizes 10000,100000]                      # this section alone

The corpus (as issue 48 measured it): N flat JSONL rows, each naming the same 0.1 s clip (24 kHz, so
nothing is resampled), with a key, a line of text and a speaker; a zero-cost codec
(:class:`FirstCallCodec`: zeros, and the time of its first call), no image encoder, the bytes tokenizer,
decoding in the job's process (``num_workers: 0``, the CPU default), the default 256 rows per shard. Written
once per N under ``$SHARDCACHE_BENCH_CORPUS`` (default ``~/.cache/shardcache/bench-corpus``), outside the
repository.

Each measurement runs in a process of its own (its peak RSS is its own: ``ru_maxrss``), the job of one rank:

* **fresh**: :func:`precompute.job.run` into an empty cache. **Planning** is the time from the call to the
  codec's first call (reading, keying, checking and digesting every row, the rerun plan, the chunks, loading
  the encoders), imports excluded (they are made before the clock starts);
* **rerun**: the same job again on the cache it wrote, nothing changed: the whole call (it encodes nothing);
* **peak RSS** of each process (MiB), and what it adds over the same process's RSS right after its imports.

Every figure is reported per row and as a ratio to the 10k case (the smallest N) of the same run; the targets
(issue 48): peak RSS at 1M rows within 1.5x of 10k rows, planning and the no-change rerun under 50 us per row.
Written to ``benchmarks/results/scale_stage_one.json`` (and ``.md``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SIZES = (10_000, 100_000, 1_000_000)
#: targets of issue 48
RSS_RATIO_TARGET = 1.5
US_PER_ROW_TARGET = 50.0
CLIP_S = 0.1
SAMPLE_RATE = 24_000

#: ``(perf_counter(), process_time())`` of the codec's first call in this process (empty: not called yet)
FIRST_CALL: list[tuple[float, float]] = []


class FirstCallCodec:
    """A zero-cost codec (:class:`precompute.encoders.AudioTokenizer`): int16 zeros ``(8, ceil(n / 960))``
    per clip of ``n`` samples at 24 kHz, and the ``time.perf_counter()`` of its first call in
    :data:`FIRST_CALL` (the end of the job's planning)."""

    sample_rate, hop_length, n_codebooks, codebook_size = SAMPLE_RATE, 960, 8, 1024
    frame_rate = sample_rate / hop_length

    def encode(self, waveforms: list) -> list:
        import numpy as np
        if not FIRST_CALL:
            FIRST_CALL.append((time.perf_counter(), time.process_time()))
        return [np.zeros((self.n_codebooks, -(-len(w) // self.hop_length)), np.int16) for w in waveforms]

    def describe(self) -> dict:
        return {"class": "benchmarks.bench_scale_stage_one.FirstCallCodec", "name": "first-call", "config": {},
                "weights_sha256": "none"}


def codec(device: str = "cpu") -> FirstCallCodec:
    """Factory of ``audio_tokenizer: {factory: benchmarks.bench_scale_stage_one:codec}``."""
    return FirstCallCodec()


def corpus_dir() -> Path:
    return Path(os.environ.get("SHARDCACHE_BENCH_CORPUS") or Path.home() / ".cache" / "shardcache" / "bench-corpus")


def write_corpus(n: int, where: Path | None = None, encoded: int = 10_000) -> Path:
    """``scale-N/manifest.jsonl`` (N rows naming ``clip.wav``; the rows after the first ``encoded`` have no text)
    and the clip, written once; returns the manifest."""
    folder = (where or corpus_dir()) / f"scale-{n}-{encoded}"
    manifest = folder / "manifest.jsonl"
    if manifest.exists():
        return manifest
    import numpy as np
    import soundfile as sf
    folder.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(CLIP_S * SAMPLE_RATE)) / SAMPLE_RATE
    sf.write(folder / "clip.wav", (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), SAMPLE_RATE,
             subtype="PCM_16")
    tmp = manifest.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i in range(n):
            text = f"Row {i} of the scale benchmark, one line of text." if i < encoded else ""
            f.write(json.dumps({"key": f"row-{i:08d}", "text": text, "audio": "clip.wav",
                                "speaker": f"spk-{i % 97:02d}"}) + "\n")
    tmp.rename(manifest)
    return manifest


def _rss_mib() -> float:
    """This process's peak RSS in MiB (``ru_maxrss``: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def child(mode: str, manifest: Path, cache: Path) -> dict:
    """One job in this process (``mode``: fresh | rerun): its timings and RSS."""
    import dataclasses

    from precompute.config import load_config
    from precompute.job import run
    cfg = load_config(ROOT / "configs" / "precompute.yaml", ["device=cpu", "num_workers=0"])
    cfg = dataclasses.replace(cfg, audio_tokenizer={"factory": "benchmarks.bench_scale_stage_one:codec"},
                              image_encoder=None)
    import benchmarks.bench_scale_stage_one as me  # the codec's module as the job imports it (FIRST_CALL)
    from precompute.pipeline import preload_decoders
    preload_decoders()  # what the job's decoders import (librosa's lazy modules: seconds): imports are not planning
    after_imports = _current_rss_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    summary, _ = run(manifest, cache, cfg, progress=False)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    first = (me.FIRST_CALL[0][0] - t0, me.FIRST_CALL[0][1] - c0) if me.FIRST_CALL else (None, None)
    r3 = lambda x: round(x, 3) if x is not None else None  # noqa: E731
    return {"mode": mode, "kept": summary.kept, "rejected": summary.rejected, "skipped": summary.skipped_rows,
            "total_s": r3(total), "total_cpu_s": r3(cpu), "planning_s": r3(first[0]), "planning_cpu_s": r3(first[1]),
            "loop_s": r3(summary.wall_s), "rss_after_imports_MiB": round(after_imports, 1),
            "peak_rss_MiB": round(_rss_mib(), 1), "rerun": summary.rerun}


def _child_run(mode: str, manifest: Path, cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_scale_stage_one", "--child", mode, "--manifest",
                          str(manifest), "--cache", str(cache)], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run of {manifest} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_section(sizes=SIZES) -> dict:
    """Every N of ``sizes`` (the smallest is the reference of the ratios): fresh and rerun, one process each."""
    rows = []
    for n in sorted(sizes):
        manifest = write_corpus(n)
        with tempfile.TemporaryDirectory(prefix="shardcache-scale-") as d:
            fresh = _child_run("fresh", manifest, Path(d) / "cache")
            rerun = _child_run("rerun", manifest, Path(d) / "cache")
        if fresh["kept"] != n or rerun["kept"] != 0 or rerun["rerun"].get("kept") != n:
            raise RuntimeError(f"N={n}: unexpected counts: fresh {fresh}, rerun {rerun}")
        rows.append({"rows": n, "fresh": fresh, "rerun": rerun,
                     "planning_us_per_row": round(fresh["planning_s"] / n * 1e6, 2),
                     "rerun_us_per_row": round(rerun["total_s"] / n * 1e6, 2),
                     "peak_rss_MiB": max(fresh["peak_rss_MiB"], rerun["peak_rss_MiB"]),
                     "rss_over_imports_MiB": round(max(fresh["peak_rss_MiB"] - fresh["rss_after_imports_MiB"],
                                                       rerun["peak_rss_MiB"] - rerun["rss_after_imports_MiB"]), 1)})
    base = rows[0]
    for r in rows:
        r["ratio_to_smallest"] = {k: round(r[k] / base[k], 3) if base[k] else None
                                  for k in ("planning_us_per_row", "rerun_us_per_row", "peak_rss_MiB")}
        r["bytes_per_row_over_imports"] = round(r["rss_over_imports_MiB"] * 2**20 / r["rows"], 1)
    top = rows[-1]
    targets = {"peak_rss_ratio": (top["ratio_to_smallest"]["peak_rss_MiB"], RSS_RATIO_TARGET),
               "planning_us_per_row": (max(r["planning_us_per_row"] for r in rows), US_PER_ROW_TARGET),
               "rerun_us_per_row": (max(r["rerun_us_per_row"] for r in rows), US_PER_ROW_TARGET)}
    met = {k: v <= t for k, (v, t) in targets.items()}
    return {"sizes": [r["rows"] for r in rows], "runs": rows, "targets": targets, "met": met,
            "loadavg": list(os.getloadavg()), "cpus": os.cpu_count()}


def summary_lines(r: dict) -> list[str]:
    """The section of ``make bench``'s summary."""
    out = [f"**Stage one at scale** (N flat JSONL rows naming one 0.1 s clip, a zero-cost codec, the bytes "
           f"tokenizer, one rank, decoding in its process; each job in a process of its own; ratios to "
           f"N = {r['sizes'][0]:,} of this run; load average {r['loadavg'][0]:.1f} on {r['cpus']} cores):", "",
           "| rows | planning (us/row) | no-change rerun (us/row) | peak RSS (MiB) | over imports (bytes/row) | "
           "planning x | rerun x | RSS x |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in r["runs"]:
        q = x["ratio_to_smallest"]
        out.append(f"| {x['rows']:,} | {x['planning_us_per_row']:.1f} | {x['rerun_us_per_row']:.1f} | "
                   f"{x['peak_rss_MiB']:.0f} | {x['bytes_per_row_over_imports']:.0f} | {q['planning_us_per_row']:.2f} | "
                   f"{q['rerun_us_per_row']:.2f} | {q['peak_rss_MiB']:.2f} |")
    t, met = r["targets"], r["met"]
    out += ["", "Targets (issue 48): peak RSS at the largest N / the smallest "
            f"{t['peak_rss_ratio'][0]:.2f} (target <= {t['peak_rss_ratio'][1]}: {'met' if met['peak_rss_ratio'] else 'NOT met'}); "
            f"planning at most {t['planning_us_per_row'][0]:.1f} us/row (target < {t['planning_us_per_row'][1]:.0f}: "
            f"{'met' if met['planning_us_per_row'] else 'NOT met'}); no-change rerun at most "
            f"{t['rerun_us_per_row'][0]:.1f} us/row (target < {t['rerun_us_per_row'][1]:.0f}: "
            f"{'met' if met['rerun_us_per_row'] else 'NOT met'}).", ""]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma list of row counts (smallest first)")
    ap.add_argument("--out", type=Path, default=RESULTS / "scale_stage_one.json")
    ap.add_argument("--child", choices=("fresh", "rerun"), help=argparse.SUPPRESS)
    ap.add_argument("--manifest", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.manifest, args.cache)))
        return 0
    r = run_section([int(s) for s in args.sizes.split(",")])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2) + "\n")
    lines = summary_lines(r)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
