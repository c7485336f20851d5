"""Stage one at dataset size: planning time, no-change rerun time and peak RSS per rank for N = 10k, 100k, 1M rows.

    python -m benchmarks.run --only scale_stage_one [--scale-sizes 10000,100000,1000000]   # in make bench
    python -m benchmarks.bench_scale_stage_one [--sizes 10000,100000]                      # this section alone

The corpus (as issue 48 measured it): N flat JSONL rows, each naming the same 0.1 s clip (24 kHz, so nothing
is resampled), with a key, a speaker and, for the first :data:`ENCODED` rows, a line of text; the rows after
those have no text: they are read, keyed, checked, digested, planned and recorded in their chunks like the
others and rejected ``empty_text`` without being decoded, so every N encodes the same 10,000 clips (a 1M-row
job encoding every row would take an hour of this machine's CPU) and the figures measure what grows with the
manifest. A zero-cost codec (:class:`FirstCallCodec`: zeros, and the time of its first call), no image
encoder, the bytes tokenizer, decoding in the job's process (``num_workers: 0``, the CPU default), 256 rows per
shard. Written once per N under ``$SHARDCACHE_BENCH_CORPUS`` (default ``~/.cache/shardcache/bench-corpus``),
outside the repository.

Each measurement runs in a process of its own (its peak RSS is its own), one rank's job:

* **fresh**: :func:`precompute.job.run` into an empty cache. **Planning** is the time from the call to the
  codec's first call (reading, keying, checking and digesting every row, the rerun plan, the chunks, loading
  the encoders, decoding the first batch), imports excluded (made before the clock starts: the decoders'
  libraries too, :func:`precompute.pipeline.preload_decoders`);
* **rerun**: the same job again on the cache it wrote, nothing changed: the whole call (it loads no encoder and
  encodes nothing);
* **peak RSS** (``VmHWM``, MiB) of each process: the fresh job's before rank 0 merges the index (every rank's
  own work: planning, decoding, encoding, writing) and with the merge (:func:`shards.merge.merge_parts`, rank 0
  only: it reads the parts one at a time and holds the keys), the rerun's; and what each adds over the process after its imports.

Times are given in wall seconds and in CPU seconds of the process (every thread): the machine is shared, so
the CPU figure is the one that says what a row costs a core (as the ceiling section does). Every figure is
per row and as a ratio to the smallest N of the same run; ``slope`` is the cost of one more row between the
smallest and the largest N (the fixed costs taken out). Targets (issue 48): peak RSS at the largest N within
1.5x of the smallest, planning and the no-change rerun under 50 us (CPU) per row at the largest N. Written
to ``benchmarks/results/scale_stage_one.json`` (and ``.md``).
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
#: rows of each corpus that are encoded (the others have no text: rejected while reading, see the module docstring)
ENCODED = 10_000

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


def write_corpus(n: int, where: Path | None = None, encoded: int | None = None) -> Path:
    """``scale-N-E/manifest.jsonl`` (N rows naming ``clip.wav``; the rows after the first ``encoded``, default
    :data:`ENCODED`, have no text) and the clip, written once; returns the manifest."""
    encoded = ENCODED if encoded is None else encoded
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


def _status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory figure in MiB (``VmRSS``: now; ``VmHWM``: the peak so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def child(mode: str, manifest: Path, cache: Path) -> dict:
    """One job in this process (``mode``: fresh | rerun): its timings and RSS."""
    import dataclasses

    import precompute.job as job
    from precompute.config import load_config
    from precompute.pipeline import preload_decoders
    cfg = load_config(ROOT / "configs" / "precompute.yaml", ["device=cpu", "num_workers=0"])
    cfg = dataclasses.replace(cfg, audio_tokenizer={"factory": "benchmarks.bench_scale_stage_one:codec"},
                              image_encoder=None)
    import benchmarks.bench_scale_stage_one as me  # the codec's module as the job imports it (FIRST_CALL)
    preload_decoders()  # what the job's decoders import (librosa's lazy modules: seconds): imports are not planning
    import pyarrow.parquet  # noqa: F401 - (what the merge imports)
    after_imports = _status_mib("VmRSS")
    before_merge: list[float] = []
    merge = job.merge_parts

    def measured_merge(*args, **kwargs):  # the peak of the rank's own work, then rank 0's merge
        before_merge.append(_status_mib("VmHWM"))
        return merge(*args, **kwargs)

    job.merge_parts = measured_merge
    t0, c0 = time.perf_counter(), time.process_time()
    summary, _ = job.run(manifest, cache, cfg, progress=False)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    first = (me.FIRST_CALL[0][0] - t0, me.FIRST_CALL[0][1] - c0) if me.FIRST_CALL else (None, None)
    r3 = lambda x: round(x, 3) if x is not None else None  # noqa: E731
    peak = _status_mib("VmHWM")
    return {"mode": mode, "kept": summary.kept, "rejected": summary.rejected, "skipped": summary.skipped_rows,
            "total_s": r3(total), "total_cpu_s": r3(cpu), "planning_s": r3(first[0]), "planning_cpu_s": r3(first[1]),
            "loop_s": r3(summary.wall_s), "rss_after_imports_MiB": round(after_imports, 1),
            "peak_rss_before_merge_MiB": round(before_merge[0] if before_merge else peak, 1),
            "merged": bool(before_merge), "peak_rss_MiB": round(peak, 1), "rerun": summary.rerun}


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
        encoded = min(n, ENCODED)
        if fresh["kept"] != encoded or fresh["kept"] + fresh["rejected"] != n or rerun["rerun"].get("kept") != n \
                or rerun["kept"] + rerun["rejected"] != 0:
            raise RuntimeError(f"N={n}: unexpected counts: fresh {fresh}, rerun {rerun}")
        per = lambda s: round(s / n * 1e6, 2)  # noqa: E731 - microseconds per row
        rows.append({"rows": n, "encoded": encoded, "fresh": fresh, "rerun": rerun,
                     "planning_us_per_row": per(fresh["planning_s"]),
                     "planning_cpu_us_per_row": per(fresh["planning_cpu_s"]),
                     "rerun_us_per_row": per(rerun["total_s"]), "rerun_cpu_us_per_row": per(rerun["total_cpu_s"]),
                     "peak_rss_MiB": max(fresh["peak_rss_before_merge_MiB"], rerun["peak_rss_MiB"]),
                     "peak_rss_with_merge_MiB": fresh["peak_rss_MiB"],
                     "rss_over_imports_MiB": round(max(fresh["peak_rss_before_merge_MiB"] - fresh["rss_after_imports_MiB"],
                                                       rerun["peak_rss_MiB"] - rerun["rss_after_imports_MiB"]), 1),
                     "merge_adds_MiB": round(fresh["peak_rss_MiB"] - fresh["peak_rss_before_merge_MiB"], 1)})
    base, top = rows[0], rows[-1]
    keys = ("planning_us_per_row", "planning_cpu_us_per_row", "rerun_us_per_row", "rerun_cpu_us_per_row",
            "peak_rss_MiB", "peak_rss_with_merge_MiB")
    for r in rows:
        r["ratio_to_smallest"] = {k: round(r[k] / base[k], 3) if base[k] else None for k in keys}
        r["bytes_per_row_over_imports"] = round(r["rss_over_imports_MiB"] * 2**20 / r["rows"], 1)
    slope = {}
    if top["rows"] > base["rows"]:
        dn = top["rows"] - base["rows"]
        for k, (mode, field) in {"planning_us_per_row": ("fresh", "planning_s"),
                                 "planning_cpu_us_per_row": ("fresh", "planning_cpu_s"),
                                 "rerun_us_per_row": ("rerun", "total_s"),
                                 "rerun_cpu_us_per_row": ("rerun", "total_cpu_s")}.items():
            slope[k] = round((top[mode][field] - base[mode][field]) / dn * 1e6, 2)
        slope["rss_bytes_per_row"] = round((top["peak_rss_MiB"] - base["peak_rss_MiB"]) * 2**20 / dn, 1)
        slope["merge_bytes_per_row"] = round((top["peak_rss_with_merge_MiB"] - base["peak_rss_with_merge_MiB"])
                                             * 2**20 / dn, 1)
    targets = {"peak_rss_ratio": (top["ratio_to_smallest"]["peak_rss_MiB"], RSS_RATIO_TARGET),
               "peak_rss_with_merge_ratio": (top["ratio_to_smallest"]["peak_rss_with_merge_MiB"], RSS_RATIO_TARGET),
               "planning_cpu_us_per_row": (top["planning_cpu_us_per_row"], US_PER_ROW_TARGET),
               "rerun_cpu_us_per_row": (top["rerun_cpu_us_per_row"], US_PER_ROW_TARGET)}
    met = {k: v <= t for k, (v, t) in targets.items()}
    return {"sizes": [r["rows"] for r in rows], "encoded": ENCODED, "runs": rows, "slope": slope, "targets": targets,
            "met": met, "loadavg": list(os.getloadavg()), "cpus": os.cpu_count()}


def summary_lines(r: dict) -> list[str]:
    """The section of ``make bench``'s summary."""
    out = [f"**Stage one at scale** (N flat JSONL rows naming one 0.1 s clip, the first {r['encoded']:,} encoded, the "
           "others read, planned and recorded but rejected empty_text unread; a zero-cost codec, the bytes tokenizer, "
           "one rank decoding in its process; each job in a process of its own; CPU = the process's CPU time, all "
           f"threads; ratios to N = {r['sizes'][0]:,} of this run; load average {r['loadavg'][0]:.1f} on "
           f"{r['cpus']} cores):", "",
           "| rows | planning us/row (CPU) | no-change rerun us/row (CPU) | peak RSS MiB (with rank 0's merge) | "
           "over imports, bytes/row | planning x | rerun x | RSS x (with merge) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in r["runs"]:
        q = x["ratio_to_smallest"]
        out.append(f"| {x['rows']:,} | {x['planning_us_per_row']:.1f} ({x['planning_cpu_us_per_row']:.1f}) | "
                   f"{x['rerun_us_per_row']:.1f} ({x['rerun_cpu_us_per_row']:.1f}) | {x['peak_rss_MiB']:.0f} "
                   f"({x['peak_rss_with_merge_MiB']:.0f}) | {x['bytes_per_row_over_imports']:.0f} | "
                   f"{q['planning_cpu_us_per_row']:.2f} | {q['rerun_cpu_us_per_row']:.2f} | {q['peak_rss_MiB']:.2f} "
                   f"({q['peak_rss_with_merge_MiB']:.2f}) |")
    t, met, sl = r["targets"], r["met"], r.get("slope") or {}
    word = lambda k: "met" if met[k] else "NOT met"  # noqa: E731
    out += ["", f"Targets (issue 48), at the largest N: peak RSS / the smallest N's {t['peak_rss_ratio'][0]:.2f} "
            f"(target <= {t['peak_rss_ratio'][1]}: {word('peak_rss_ratio')}; with rank 0's merge "
            f"{t['peak_rss_with_merge_ratio'][0]:.2f}: {word('peak_rss_with_merge_ratio')}); planning "
            f"{t['planning_cpu_us_per_row'][0]:.1f} CPU-us/row (target < {t['planning_cpu_us_per_row'][1]:.0f}: "
            f"{word('planning_cpu_us_per_row')}); no-change rerun {t['rerun_cpu_us_per_row'][0]:.1f} CPU-us/row "
            f"(target < {t['rerun_cpu_us_per_row'][1]:.0f}: {word('rerun_cpu_us_per_row')})."]
    if sl:
        out.append(f"One more row costs (smallest to largest N): planning {sl['planning_us_per_row']:.1f} us "
                   f"({sl['planning_cpu_us_per_row']:.1f} CPU), rerun {sl['rerun_us_per_row']:.1f} us "
                   f"({sl['rerun_cpu_us_per_row']:.1f} CPU), peak RSS {sl['rss_bytes_per_row']:.0f} bytes "
                   f"({sl['merge_bytes_per_row']:.0f} with rank 0's merge).")
    return out + [""]


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
