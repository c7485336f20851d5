"""``make bench``: every figure as a ratio of two things measured in the same run.

    python -m benchmarks.run [--quick] [--only ceiling,scale_stage_one,overlap,precompute,loader,cache,train_step,data_wait,ddp,scale_loader]
                             [--ceiling-n 2000] [--scale-sizes 10000,100000,1000000] [--overlap-n 600]
                             [--scale-n 10000 100000 1000000 10000000]

Writes ``benchmarks/results/<name>.json`` per section and ``benchmarks/results/summary.md`` (the
table the README shows). Uses the bundled demo data and, when present,
``../shared/data/real-mini``; ``ceiling`` (stage one with null encoders, :mod:`benchmarks.bench_ceiling`)
a synthetic corpus of ``--ceiling-n`` samples per job kind, written once outside the repository
(:mod:`benchmarks.synth_corpus`); ``scale_stage_one`` (:mod:`benchmarks.bench_scale_stage_one`) stage one's
planning, no-change rerun and peak RSS per rank for manifests of ``--scale-sizes`` rows; ``overlap``
(:mod:`benchmarks.bench_overlap`) the real job with a stand-in codec that waits 50 ms per clip without the GIL,
one decode process: wall / encoder time; ``scale_loader`` (:mod:`benchmarks.bench_scale_loader`) the loader's
construction and memory and ``shards info / verify / query`` over caches of ``--scale-n`` tiny samples (written
once outside the repository, :mod:`benchmarks.scale_corpus`), each per sample as a ratio to the 10k case
(``--only scale_loader``: that section alone). ``--quick`` skips the real-size (randomly initialised) encoders.
Needs the test models: ``python -m tools.testing --out models`` (tiny) and
``--size full --only dac,wan`` (built here on demand).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEMO = ROOT / "data" / "demo" / "samples.jsonl"
REAL_MINI = Path(os.environ.get("SHARDCACHE_REAL_MINI", ROOT.parent / "shared" / "data" / "real-mini"))
MODELS = ROOT / "models"
SECTIONS = ("ceiling", "scale_stage_one", "overlap", "precompute", "loader", "cache", "train_step", "data_wait", "ddp",
            "scale_loader")


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cores": os.cpu_count(), "cpu": cpu, "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def ensure_models(size: str) -> None:
    only = "dac,wan"
    if not all((MODELS / f"{m}-{size}").is_dir() for m in only.split(",")):
        subprocess.run([sys.executable, "-m", "tools.testing", "--out", str(MODELS), "--size", size,
                        "--only", only], check=True, cwd=ROOT)


def tiny_config(**kw):
    from precompute.config import load_config
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        f"audio_tokenizer.pretrained={MODELS / 'dac-tiny'}", f"image_encoder.pretrained={MODELS / 'wan-tiny'}",
        "device=cpu"])
    return dataclasses.replace(cfg, **kw)


def corpora() -> list[Path]:
    """The demo, and real-mini's flat manifest and two conversation manifests when present."""
    real = [REAL_MINI / n for n in ("samples_with_corrupt.jsonl", "chatml_voice_clone.json", "llava_multiturn.json")]
    return [DEMO] + [m for m in real if m.exists()]


def write_result(out: Path | None, name: str, result: dict, markdown: str) -> None:
    """``OUT/NAME.json`` (``result``) and ``OUT/NAME.md`` (``markdown``), rewritten after each measurement so
    that a run cut short keeps what it finished; nothing when ``out`` is None (a smoke run)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)


def save(name: str, data) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")


def loader_lines(r: dict) -> list[str]:
    """The loader section of the summary (``loader.json`` of ``bench_loader.py``)."""
    cat = r["cat"]
    per = r["cache"]["bytes"] / r["cache"]["samples"]
    peers = r.get("peers") or {}
    lit = (peers.get("litdata") or {}).get("samples_s")
    lit_rc = (peers.get("litdata") or {}).get("ratio_to_cat")
    out = [f"**Loader** ({r['cache']['samples']} samples of ~{r['cache']['KiB_per_sample']:.0f} KiB in "
           f"{r['cache']['shards']} shards, page cache; {r.get('epochs', 3)} rounds of one `cat` then one epoch per "
           "configuration, samples/s the median over the rounds, every ratio the median over the rounds of the ratio "
           "within a round (LitData and Mosaic: through their ratio to a `cat` right before each of their epochs); "
           f"ShardLoader: padded, collated torch batches of {r['batch_size']}, checksums checked unless said, one "
           "process = two read-ahead threads unless \"read on demand\"; peers: per-sample dicts of numpy arrays, not "
           "collated, one process; workers: persistent DataLoader processes collating into reused shared-memory "
           "slots):", "",
           "| reader | samples/s | MB/s | x `cat` | x LitData (one process) | x ShardLoader one process, same dtypes |",
           "| --- | --- | --- | --- | --- | --- |",
           f"| `cat` > /dev/null | {cat['samples_s']:.0f} | {cat['MB_s']:.0f} | 1.00 | | |"]
    ceiling = r.get("copy_ceiling") or {}
    for k, label in (("batch", "one `preadv` per sample into a reused batch buffer (the one-copy ceiling)"),
                     ("l2", "one `preadv` per sample through a 128 KiB buffer (as `cat`)")):
        if k in ceiling:
            v = ceiling[k]
            out.append(f"| {label} | {v['samples_s']:.0f} | {v['samples_s'] * per / 1e6:.0f} | "
                       f"{v['ratio_to_cat']:.2f} | | |")
    base = {}  # the one-process loader (read-ahead threads, checksums) of each dtype: its epochs
    for x in r["shardloader"]:
        if x["num_workers"] == 0 and x["checks"] == "checksums" and x.get("read_threads", 2) > 1:
            base.setdefault(x["compact"], x["samples_s_epochs"])
    for x in r["shardloader"]:
        lx = f"{x['ratio_to_litdata']:.2f}" if x.get("ratio_to_litdata") else "-"
        rel = f"{statistics.median(a / b for a, b in zip(x['samples_s_epochs'], base[x['compact']])):.2f}"
        out.append(f"| ShardLoader, {x['label']} | {x['samples_s']:.0f} | {x['MB_s']:.0f} | {x['ratio_to_cat']:.2f} | "
                   f"{lx} | {rel} |")
    for name, label in (("litdata", "LitData `StreamingDataset`"), ("mosaic", "Mosaic `StreamingDataset`")):
        v = peers.get(name) or {}
        if "samples_s" in v:
            lx = f"{v['samples_s'] / lit:.2f}" if lit else "-"
            rc = v.get("ratio_to_cat", v["samples_s"] / cat["samples_s"])
            lx = f"{rc / lit_rc:.2f}" if lit_rc else "-"
            out.append(f"| {label} {v.get('version', '')}, one process (no collate) | {v['samples_s']:.0f} | "
                       f"{v['samples_s'] * per / 1e6:.0f} | {rc:.2f} | {lx} | |")
    if "skipped" in peers:
        out.append(f"| LitData, Mosaic Streaming | skipped: {peers['skipped']} | | | | |")
    rem = r.get("remote") or {}
    names = {"cold_epoch": "first epoch (every shard downloaded)", "warm_epoch": "second epoch (shards held locally)",
             "cache_limited": "2 epochs, cache_limit = 1/4 of the cache"}
    for k, label in names.items():
        if k in rem:
            out.append(f"| ShardLoader from `s3://` (moto server on 127.0.0.1), compact, {label} | "
                       f"{rem[k]['samples_s']:.0f} | | | | {rem[k]['ratio_to_local']:.2f} |")
    out += [f"| ShardLoader, one process, real-mini `{x['cache']}` cache ({x['KiB_per_sample']:.0f} KiB/sample, "
            f"batch {x['batch_size']}) | {x['samples_s']:.0f} | {x['MB_s']:.0f} | {x['ratio_to_cat']:.2f} | | |"
            for x in r.get("real_caches", [])]
    w = r["webdataset"]
    lx = f"{w['samples_s'] / lit:.2f}" if lit else "-"
    out.append(f"| webdataset `.decode()` (no collate) | {w['samples_s']:.0f} | {w['MB_s']:.0f} | "
               f"{w['ratio_to_cat']:.2f} | {lx} | |")
    t = r.get("targets") or {}
    names = {"compact_over_cat": "one process compact / `cat`", "compact_over_litdata": "one process compact / LitData",
             "float32_over_cat": "one process float32 / `cat`",
             "2_workers_over_one_process_compact": "2 workers / one process (compact, 2 read-ahead threads)",
             "2_workers_over_one_thread_compact": "2 workers / one process reading on demand (one thread, compact)",
             "2_workers_over_one_process_float32": "2 workers / one process (float32)",
             "checksums_over_none": "checksums checked / nothing checked",
             "checksums_over_none_one_thread": "checksums checked / nothing checked, one thread",
             "checksums_over_values": "checksums checked / value checks (before checksums)"}
    parts = []
    for k, label in names.items():
        v, target = t.get(k, (None, None))
        if v is not None:
            parts.append(f"{label} {v:.2f}" + (f" (target {target})" if target else ""))
    best = r.get("best_peer")
    load = r["machine"]
    out += ["", "Ratios: " + "; ".join(parts) + "." + (f" Best peer: {best['name']}." if best else ""),
            f"Shard bytes / raw tensor bytes: {r['cache'].get('disk_over_tensor', '-')}. Startup (construct the loader "
            "from the index, workers=0 / 2): " + " / ".join(f"{x['construct_s'] * 1e3:.0f} ms" for x in r["resume"]
                                                             if x["fraction"] < 0.5) +
            ". Resume latency (fresh loader, load_state_dict, to the first batch): " + ", ".join(
                f"{x['fraction']:.0%} of epoch, workers={x['num_workers']}: {x['resume_to_first_batch_s'] * 1e3:.0f} ms"
                for x in r["resume"]) + ". RSS (RssAnon MiB, main/workers) per epoch: " + ", ".join(
                f"{x['main_MiB'].get('RssAnon', 0):.0f}/{x['workers_RssAnon_MiB']:.0f}" for x in r["rss"]) +
            _forkserver_part(r.get("forkserver_first_batch")) +
            f". Load average during the run: {load.get('loadavg_start', [0])[0]:.1f} -> "
            f"{load.get('loadavg_end', [0])[0]:.1f} on {load['cpus']} cores (shared machine).", ""]
    return out


def _forkserver_part(f: dict | None) -> str:
    if not f:
        return ""
    ms = lambda xs: ", ".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731
    return (". Forkserver workers (the start method once CUDA is initialised), first batch of 3 successive "
            f"loaders: {ms(f['preload_on_s'])} ms with the loaders preloaded in the server, "
            f"{ms(f['preload_off_s'])} ms without")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the real-size encoder configs")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--ceiling-n", type=int, default=2000, help="samples per job kind of the ceiling section")
    ap.add_argument("--scale-sizes", default="10000,100000,1000000",
                    help="manifest rows of the scale_stage_one section (comma list, smallest first)")
    ap.add_argument("--overlap-n", type=int, default=600, help="rows per job kind of the overlap section")
    ap.add_argument("--scale-n", type=int, nargs="+", default=[10_000, 100_000, 1_000_000, 10_000_000],
                    help="samples of the scale_loader section's caches (those that fit the disk)")
    args = ap.parse_args(argv)
    only = set(args.only.split(","))
    ensure_models("tiny")
    if not args.quick and only & {"precompute", "train_step"}:
        ensure_models("full")
    sizes = ["tiny"] if args.quick else ["tiny", "full"]
    info = machine()
    lines = [f"Machine: {info['cores']} cores, {info['cpu']}, GPU: {info['gpu'] or 'none'}; torch {info['torch']}; "
             f"{info['date']}. Command: `make bench`.", ""]
    tmp = Path(tempfile.mkdtemp(prefix="shardcache-bench-"))
    from precompute.job import run as precompute
    caches = {}
    from benchmarks.bench_precompute import corpus_name
    for manifest in corpora() if only - {"ceiling", "scale_stage_one", "overlap", "precompute", "ddp", "scale_loader"} else []:  # the caches the readers read
        caches[manifest] = tmp / corpus_name(manifest)
        precompute(manifest, caches[manifest], tiny_config(samples_per_shard=64), progress=False)

    marks: dict[str, int] = {}
    marks["ceiling"] = len(lines)
    if "ceiling" in only:
        from benchmarks import bench_ceiling
        r = bench_ceiling.run_section(args.ceiling_n)
        save("ceiling", r | {"machine": info})
        lines += bench_ceiling.summary_lines(r)

    marks["scale_stage_one"] = len(lines)
    if "scale_stage_one" in only:
        from benchmarks import bench_scale_stage_one
        r = bench_scale_stage_one.run_section([int(x) for x in args.scale_sizes.split(",")])
        save("scale_stage_one", r | {"machine": info})
        lines += bench_scale_stage_one.summary_lines(r)

    marks["overlap"] = len(lines)
    if "overlap" in only:
        from benchmarks import bench_overlap
        r = bench_overlap.run_section(args.overlap_n)
        save("overlap", r | {"machine": info})
        lines += bench_overlap.summary_lines(r)

    marks["precompute"] = len(lines)
    if "precompute" in only:
        from benchmarks import bench_precompute
        rows = [bench_precompute.bench(m, MODELS, size) for m in corpora() for size in sizes
                if size == "tiny" or m == DEMO]
        save("precompute", {"machine": info, "runs": rows})
        lines += ["**Stage one** (decode + encode + write wall time vs the encoder calls alone over the same batches; "
                  "model loading excluded):", "",
                  "| corpus | encoders | samples | samples/s | wall / encoders alone | encoder busy | audio opens per file |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['corpus']} | {r['models']} | {r['samples']} | {r['samples_per_s']} | "
                  f"{r['wall_over_encoders_alone']} | {r['encoder_busy']:.0%} | {r.get('audio_opens_per_file') or '-'} |"
                  for r in rows] + [""]

    marks["loader"] = len(lines)
    if "loader" in only:
        # own process: RSS figures must not include this process's encoders
        conv = [c for m, c in caches.items() if m.suffix == ".json"]  # the conversation caches
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_loader.py"), "--out",
                        str(RESULTS / "loader.json"), "--real-cache", *map(str, conv)], check=True, cwd=ROOT)
        lines += loader_lines(json.loads((RESULTS / "loader.json").read_text()))

    marks["cache"] = len(lines)
    if "cache" in only:
        from benchmarks import bench_cache
        rows = {corpus_name(m): {"padding": bench_cache.padding_waste(c), "bytes": bench_cache.bytes_on_disk(c)}
                for m, c in caches.items()}  # padding: None for a cache without codes (image-text)
        save("cache", rows)
        lines += ["**Padding and bytes** (codes frames padded per batch of 16, fixed vs budget batches with length buckets; "
                  "shard bytes vs raw tensor bytes):", "",
                  "| corpus | padding fixed | padding bucketed | disk bytes / sample | disk / tensor bytes |",
                  "| --- | --- | --- | --- | --- |"]
        pct = lambda v, mode: f"{v['padding'][mode]['waste']:.1%}" if v["padding"] else "-"  # noqa: E731
        lines += [f"| {k} | {pct(v, 'fixed')} | {pct(v, 'bucketed')} | "
                  f"{v['bytes']['disk_bytes_per_sample']} | {v['bytes']['disk_over_tensor']} |" for k, v in rows.items()] + [""]

    marks["train_step"] = len(lines)
    if "train_step" in only:
        from benchmarks import bench_train_step
        rows = []
        for size in sizes:
            cfg = tiny_config(audio_tokenizer={"name": "dac", "pretrained": str(MODELS / f"dac-{size}")},
                              image_encoder={"name": "wan", "pretrained": str(MODELS / f"wan-{size}")})
            rows.append(dict(bench_train_step.bench(DEMO, caches[DEMO], cfg), encoders=size))
        save("train_step", rows)
        lines += ["**Training step** (reference model, batch 4, demo data; cached shards vs decode + resample + codec + "
                  "VAE every step):", "", "| encoders | cached s/step | uncached s/step | uncached / cached |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {r['encoders']} | {r['cached_step_s']} | {r['uncached_step_s']} | {r['uncached_over_cached']} |"
                  for r in rows] + [""]

    marks["data_wait"] = len(lines)
    if "data_wait" in only:
        from benchmarks import bench_data_wait
        real = [c for m, c in caches.items() if m.name == "samples_with_corrupt.jsonl"]
        r = bench_data_wait.bench(real[0] if real else caches[DEMO], steps=40)
        save("data_wait", r)
        lines += [f"**Data wait in training** (`shardcache train`, reference model of configs/train-demo.yaml, batch "
                  f"{r['batch_size']}, one CPU process, `{r['cache']}` cache, median over steps after warm-up; on "
                  "this 2-core machine the workers share the cores with the step):", "",
                  "| num_workers | data wait (median, share of step) | data wait (max) | s/step (median) |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {x['num_workers']} | {x['data_wait_median']:.2%} | {x['data_wait_max']:.2%} | {x['step_s_median']:.3f} |"
                  for x in r["runs"]]
        lines += ["", f"Step time with 2 workers / with 0: {r['step_ratio_2_over_0']:.2f}. The GPU figures (data wait of "
                  "the recipes' steps with 0, 2 and 8 workers on an H100) are `make bench-gpu`'s: see the GPU section.", ""]

    marks["ddp"] = len(lines)
    if "ddp" in only:
        from benchmarks import bench_ddp
        r = bench_ddp.bench()
        save("ddp", r)
        lines += [f"**DDP** (2 gloo processes, accumulation {r['accum']}): gradient all-reduce buckets per optimiser "
                  f"step {r['with_no_sync']['allreduce_buckets_per_step']:.0f} with `no_sync` vs "
                  f"{r['every_micro_step']['allreduce_buckets_per_step']:.0f} without ({r['allreduce_ratio']}x); "
                  f"step time {r['with_no_sync']['step_s']} s vs {r['every_micro_step']['step_s']} s.", ""]

    marks["scale_loader"] = len(lines)
    if "scale_loader" in only:
        from benchmarks import bench_scale_loader
        r = bench_scale_loader.run_section(args.scale_n)
        save("scale_loader", r | {"machine": info})
        lines += bench_scale_loader.summary_lines(r)

    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    marks["end"] = len(lines)
    bounds = list(marks.values())
    for (name, start), end in zip(list(marks.items())[:-1], bounds[1:]):
        if name in only:  # one markdown file per section; sections not rerun keep their last table
            (RESULTS / f"{name}.md").write_text("\n".join(lines[start:end]) + "\n")
    summary = "\n".join(lines[:bounds[0]]) + "\n" + "".join(
        (RESULTS / f"{n}.md").read_text() for n in SECTIONS if (RESULTS / f"{n}.md").exists())
    (RESULTS / "summary.md").write_text(summary)
    print(summary)
    print(f"wrote {RESULTS}/*.json and summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
