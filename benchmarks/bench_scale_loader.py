"""The loader and the commands at dataset size: 10k to 10M samples, each figure a ratio to the 10k case.

    python -m benchmarks.bench_scale_loader [--n 10000 100000 1000000 10000000] [--out DIR]

The caches are :mod:`benchmarks.scale_corpus`'s (tiny samples written with the shard writer, once, into
``$SHARDCACHE_BENCH_SCALE``; reused while their integrity root matches). Per ``N``, each in a fresh
process (so nothing of one measurement is in the memory of the next; imports and the first loader over
the 10k cache come first, so only what ``N`` samples cost is counted):

* **loader, first open on the node**: ``ShardLoader(cache, 16, fields=("codes", "input_ids",
  "labels"), ranks=Ranks(0, world))`` after the index store was deleted (:mod:`shards.columns`: this
  open reads ``index.parquet`` into it); **loader, store built**: the same again (every later open:
  other ranks, workers, the validation loader, a restarted job). Construction time, and RSS added
  (``VmRSS``; ``RssAnon``: the rank's own memory, ``RssFile``: pages of mapped files, shared by every
  process of the node) after construction and after the first batch, per sample and per rank; with
  ``world`` 1 (one rank holds the whole plan) and 8.
* **commands**: ``shardcache shards info``, ``shards verify`` (quick: every shard's sha256 too) and
  ``shards query --where ... --count``, wall time of the whole command (``python -m shardcache``),
  per sample.

Writes ``benchmarks/results/scale_loader.json`` (and ``.md``: the table ``make bench``'s summary shows).
The targets (issue 48): the loader over 10M samples adds under 64 bytes per sample per rank and
constructs in under 10 s; each command stays within a constant factor of its 10k time per sample.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SIZES = (10_000, 100_000, 1_000_000, 10_000_000)
FIELDS = ("codes", "input_ids", "labels")

#: one measurement of the loader, in a fresh process: argv = cache, warm-up cache, world, store folder, cold
_LOADER = r"""
import gc, json, shutil, sys, time
from pathlib import Path

def mem():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[k] = int(v.split()[0]) * 1024
    return out

cache, warm, world, store, cold = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
import numpy, torch, pyarrow, pyarrow.parquet
from loaders import ShardLoader
from shardcache.ranks import Ranks
from shards import Cache
from shards.columns import store_dir
from shards.index import file_sha256
fields = ("codes", "input_ids", "labels")
w = ShardLoader(warm, 16, seed=0, fields=fields, ranks=Ranks(0, world))   # imports, first uses: not counted
next(iter(w)); w.close(); del w
if cold:  # this cache's store deleted: the open reads index.parquet into it
    shutil.rmtree(store_dir(file_sha256(Path(cache) / "index.parquet")), ignore_errors=True)
gc.collect()
m0, t0, c0 = mem(), time.perf_counter(), time.process_time()
ld = ShardLoader(cache, 16, seed=0, fields=fields, ranks=Ranks(0, world))
t1, c1 = time.perf_counter(), time.process_time()
gc.collect()
m1 = mem()
batch = next(iter(ld))
m2 = mem()
print(json.dumps({"samples": len(ld.sources.sources[0].reader), "steps": len(ld), "construct_s": t1 - t0,
                  "construct_cpu_s": c1 - c0, "after_construct": {k: m1[k] - m0[k] for k in m0},
                  "after_first_batch": {k: m2[k] - m0[k] for k in m0}, "peak_VmHWM": m2["VmHWM"],
                  "batch_keys": len(batch["keys"])}))
"""


def _run(argv: list[str], env: dict | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def loader_once(cache: Path, warm: Path, world: int, cold: bool) -> dict:
    from shards.columns import store_root
    r = _run([sys.executable, "-c", _LOADER, str(cache), str(warm), str(world), str(store_root()), "1" if cold else "0"])
    if r.returncode:
        raise RuntimeError(f"loader measurement failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def command_once(argv: list[str]) -> dict:
    t0 = time.perf_counter()
    r = _run([sys.executable, "-m", "shardcache", "shards", *argv])
    wall = time.perf_counter() - t0
    return {"argv": argv, "wall_s": wall, "rc": r.returncode, "out_tail": (r.stdout + r.stderr)[-300:]}


def measure(n: int, warm: Path, log=print) -> dict:
    from benchmarks import scale_corpus
    cache = scale_corpus.cache(n, log=log)
    out: dict = {"samples": n, "cache": str(cache), "index_bytes": (cache / "index.parquet").stat().st_size,
                 "shard_bytes": sum(p.stat().st_size for p in cache.glob("shard-*.tar"))}
    out["loader_first_open"] = loader_once(cache, warm, 1, cold=True)
    log(f"scale n={n}: first open {out['loader_first_open']['construct_s']:.2f} s")
    for world in (1, 8):
        out[f"loader_world{world}"] = loader_once(cache, warm, world, cold=False)
        log(f"scale n={n}: world {world}: {out[f'loader_world{world}']['construct_s']:.2f} s, "
            f"{out[f'loader_world{world}']['after_construct']['VmRSS'] / n:.1f} B/sample")
    out["commands"] = {
        "info": command_once(["info", str(cache), "--json"]),
        "verify": command_once(["verify", str(cache), "--no_progress", "--json"]),
        "query": command_once(["query", str(cache), "--where", "n_frames > 2 AND speaker = 'spk7'", "--count"]),
    }
    for k, v in out["commands"].items():
        log(f"scale n={n}: {k} {v['wall_s']:.2f} s (exit {v['rc']})")
    return out


def ratios(rows: list[dict]) -> dict:
    """Each figure per sample, as a ratio to the smallest ``N``'s."""
    base = rows[0]
    per = lambda r, f: f(r) / r["samples"]  # noqa: E731
    figures = {
        "construct_s (first open)": lambda r: r["loader_first_open"]["construct_s"],
        "construct_s (store built)": lambda r: r["loader_world1"]["construct_s"],
        "RSS after construct": lambda r: r["loader_world1"]["after_construct"]["VmRSS"],
        "info_s": lambda r: r["commands"]["info"]["wall_s"],
        "verify_s": lambda r: r["commands"]["verify"]["wall_s"],
        "query_s": lambda r: r["commands"]["query"]["wall_s"],
    }
    return {name: [round(per(r, f) / per(base, f), 3) for r in rows] for name, f in figures.items()}


def summary_lines(r: dict) -> list[str]:
    rows = r["runs"]
    n10m = next((x for x in rows if x["samples"] == 10_000_000), None)
    head = ("**Loader and commands at scale** (`benchmarks/bench_scale_loader.py`: tiny samples written with the shard "
            "writer, `ShardLoader(cache, 16, fields=codes,input_ids,labels)` in a fresh process after a warm-up loader; "
            "RSS added by the construction, per sample; per rank with one rank (the whole plan); commands: whole "
            "`python -m shardcache shards ...` runs):")
    out = [head, "",
           "| samples | first open (builds the store) s | later opens s | RSS B/sample (anon / file) | 8 ranks: RSS B/sample "
           "| after 1st batch B/sample | `info` s | `verify` s | `query --count` s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in rows:
        n, a, b, w8 = x["samples"], x["loader_first_open"], x["loader_world1"], x["loader_world8"]
        ac = b["after_construct"]
        c = x["commands"]
        out.append(f"| {n:,} | {a['construct_s']:.2f} | {b['construct_s']:.2f} | {ac['VmRSS'] / n:.1f} "
                   f"({ac['RssAnon'] / n:.1f} / {ac['RssFile'] / n:.1f}) | {w8['after_construct']['VmRSS'] / n:.1f} | "
                   f"{b['after_first_batch']['VmRSS'] / n:.1f} | {c['info']['wall_s']:.2f} | {c['verify']['wall_s']:.2f} | "
                   f"{c['query']['wall_s']:.2f} |")
    rt = r["ratios"]
    out += ["", "Per sample, as a ratio to the 10k case (" + ", ".join(f"{x['samples']:,}" for x in rows) + "): "
            + "; ".join(f"{k} {' / '.join(f'{v:g}' for v in vals)}" for k, vals in rt.items()) + "."]
    base = rows[0]
    slope = [(x["samples"], (x["loader_world1"]["after_construct"]["VmRSS"] - base["loader_world1"]["after_construct"]
                             ["VmRSS"]) / (x["samples"] - base["samples"])) for x in rows[1:]]
    if slope:
        out += ["RSS per sample beyond the first 10k (what each further sample adds): " + ", ".join(
            f"{n:,}: {b:.1f} B" for n, b in slope) + "."]
    if n10m:
        b = n10m["loader_world1"]
        out += [f"Targets at 10M samples: RSS added {b['after_construct']['VmRSS'] / 1e7:.1f} B/sample per rank "
                f"(target < 64), construction {b['construct_s']:.2f} s with the store built, "
                f"{n10m['loader_first_open']['construct_s']:.2f} s for the node's first open (target < 10 s)."]
    return out + [""]


def run_section(sizes=SIZES, log=print) -> dict:
    """Every ``N`` of ``sizes`` whose cache is written or fits the disk (~2.7 KB per sample), measured."""
    from benchmarks import scale_corpus
    root = scale_corpus.default_dir()
    root.mkdir(parents=True, exist_ok=True)
    kept, skipped = [], {}
    for n in sizes:
        free, need = shutil.disk_usage(root).free, 2700 * n
        if _written(n) or need < free - (8 << 30):  # (8 GiB left for everyone else)
            kept.append(n)
        else:
            skipped[n] = f"needs ~{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
            log(f"scale n={n}: skipped ({skipped[n]})")
    warm = scale_corpus.cache(10_000, log=log)
    rows = [measure(n, warm, log) for n in kept]
    return {"runs": rows, "ratios": ratios(rows), "skipped": skipped, "load": _machine()}


def _written(n: int) -> bool:
    from benchmarks import scale_corpus
    return (scale_corpus.default_dir() / f"n{n}" / "integrity.json").exists()


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    r = run_section(args.n)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scale_loader.json").write_text(json.dumps(r, indent=2) + "\n")
    lines = summary_lines(r)
    (args.out / "scale_loader.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
