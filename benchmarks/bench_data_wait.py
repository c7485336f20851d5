"""Data wait of real training steps: ``shardcache train`` with ``num_workers`` 0 and 2 on one cache.

Each run is the trainer as users run it (one process, the reference model, the real loader with
compact batches, ``DevicePrefetcher``), logging every step; from ``metrics.jsonl`` we take, over
the steps after warm-up, the median ``data_wait`` (the fraction of step time spent waiting for the
next batch) and the median ``step_time_s``. On a GPU the target is a data wait under 2 % of the
step; on this CPU-only machine the loader's workers compete with the training threads for the same
cores, so the figures say how much of a CPU step the loader costs, not what a GPU node sees.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardcache.ranks import LAUNCHER_VARIABLES, RENDEZVOUS

ROOT = Path(__file__).resolve().parents[1]


def run_once(cache: Path, workers: int, steps: int, batch_size: int, out: Path,
             config: Path = ROOT / "configs" / "train-demo.yaml", extra: tuple = ("--dist.threads", "1")) -> dict:
    """One ``shardcache train`` run (``config`` plus ``extra`` flags); the medians of its metrics.

    Raises:
        RuntimeError: the run failed (its exit status and the end of its stderr).
    """
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in (*LAUNCHER_VARIABLES, *RENDEZVOUS):  # one process, whatever launched the benchmark
        env.pop(k, None)
    cmd = [sys.executable, "-m", "shardcache", "train", "--config", str(config),
           "--cache", str(cache), "--run_dir", str(out), "--training.steps", str(steps),
           "--data.batch_size", str(batch_size), "--data.num_workers", str(workers), "--metrics.every", "1",
           "--eval.enabled=false", "--checkpoint.every", str(10 * steps), "--metrics.progress=false", *extra]
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise RuntimeError(f"shardcache train exited {done.returncode} ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "split" not in r][max(5, steps // 5):]  # after warm-up (workers start, allocator)
    return {"num_workers": workers, "steps_measured": len(recs),
            "data_wait_median": statistics.median(r["data_wait"] for r in recs),
            "data_wait_max": max(r["data_wait"] for r in recs),
            "step_s_median": statistics.median(r["step_time_s"] for r in recs)}


def bench(cache: Path, steps: int = 60, batch_size: int = 8, workers=(0, 2)) -> dict:
    """Both runs on ``cache``; ``step_ratio``: the median step time with 2 workers over 0."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_data_wait_"))
    rows = [run_once(cache, w, steps, batch_size, tmp / f"w{w}") for w in workers]
    by = {r["num_workers"]: r for r in rows}
    return {"cache": cache.name, "batch_size": batch_size, "steps": steps, "runs": rows,
            "step_ratio_2_over_0": by[2]["step_s_median"] / by[0]["step_s_median"] if 2 in by and 0 in by else None}


if __name__ == "__main__":
    print(json.dumps(bench(Path(sys.argv[1])), indent=2))
