"""Batch-size finder: ``shardcache find-batch-size --cache DIR [train options]`` 

Builds the trainer of ``shardcache train`` on one device (:class:`train.trainer.Trainer`: the same
model, contract check, optimizer, schedule, precision and loader from ``--config``,
``--model.name``, ``--model.kwargs``, ``--training.precision``, ``--model.activation_checkpointing``,
``--lora.enabled``, ``--model.compile``, ``--data.loader_kwargs``..., without validation) and times its real
training step (:meth:`~train.trainer.Trainer.train_step`: ``--training.grad_accum`` micro-steps, forward,
backward, grad norms, clipping, AdamW step, schedule; the loader's wait left out) at batch sizes 1, 2, 4, ... (powers of two, then
``--max_batch_size`` itself). Each size runs ``--steps`` steps on real batches of the cache; the
first is a warm-up (allocator, optimizer state, autotuning, compilation) and is left out of the
timing when there are two or more. The search stops at the first out-of-memory error
(``torch.OutOfMemoryError``; nothing is retried), at ``--max_batch_size``, or when the cache has too
few samples for one batch of the next size.

It prints one row per size (samples/s, median step time, peak memory) and a recommendation:

* on CUDA, the largest size whose peak reserved memory is within ``--margin`` (default 0.9) of the
  memory the device had free when the finder started (headroom for longer clips, fragmentation);
* on CPU, the size with the best samples/s (the peak RSS of a process cannot be reset between sizes,
  so memory says little there).

The batch size is per rank and micro-step (``--data.batch_size`` of ``shardcache train``): DDP adds
gradient buckets (about the size of the trainable parameters) on top; ``--training.grad_accum`` adds nothing.
Run it on one device, without torchrun. ``--steps`` here means steps per batch size (not the
training length); ``--json FILE`` also writes the result.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loaders.device import DevicePrefetcher
from shardcache.config import ConfigError, bounded

from . import dist as D
from .cli import build_parser, parse_args
from .config import TrainConfig
from .data import batch_stream, make_loader, to_device
from .metrics import peak_memory_mb
from .trainer import Trainer, setup_logging

log = logging.getLogger("train")


def candidate_sizes(max_batch_size: int, start: int = 1) -> list[int]:
    """``start, 2*start, 4*start, ...`` below ``max_batch_size``, then ``max_batch_size`` itself."""
    if max_batch_size < 1 or start < 1:
        raise ValueError("max_batch_size and start must be >= 1")
    sizes, b = [], start
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    sizes.append(max_batch_size)
    return sizes


def is_oom(e: BaseException) -> bool:
    """A CUDA out-of-memory error (or the CPU allocator's 'can't allocate memory')."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def train_step(trainer: Trainer) -> None:
    """One optimizer step of the real training loop: :meth:`train.trainer.Trainer.train_step`
    (``grad_accum`` micro-steps, autocast, scaled backward, per-group grad norms, clipping, the
    skipping AdamW step, the schedule)."""
    trainer.train_step()


def pick_device(cfg: TrainConfig) -> torch.device:
    """``cfg.dist.device`` for one process: cuda:LOCAL_RANK (0 without a launcher) or cpu."""
    use_cuda = torch.cuda.is_available() if cfg.dist.device == "auto" else cfg.dist.device.startswith("cuda")
    if not use_cuda:
        return torch.device("cpu")
    dev = torch.device("cuda", D.env_ranks()[1])
    torch.cuda.set_device(dev)
    return dev


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def recommend(results: list[dict], device_type: str, capacity_mb: float | None,
              margin: float) -> tuple[int | None, str]:
    """(batch size, why) from the measured rows (see the module docstring)."""
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return None, "no batch size completed a step"
    if device_type == "cuda" and capacity_mb:
        limit = margin * capacity_mb
        fit = [r for r in ok if r["peak_reserved_mb"] <= limit]
        if not fit:
            return None, (f"even batch size {ok[0]['batch_size']} needs {ok[0]['peak_reserved_mb']:.0f} MiB, "
                          f"over {margin:g} x {capacity_mb:.0f} MiB")
        best = max(fit, key=lambda r: r["batch_size"])
        return best["batch_size"], (f"largest that fits in {margin:g} x {capacity_mb:.0f} MiB "
                                    f"(peak {best['peak_reserved_mb']:.0f} MiB reserved)")
    best = max(ok, key=lambda r: (r["samples_per_s"], -r["batch_size"]))
    return best["batch_size"], f"best samples/s on {device_type}"


def find_batch_size(cfg: TrainConfig, max_batch_size: int = 1024, steps: int = 3, margin: float = 0.9,
                    start: int = 1) -> dict[str, Any]:
    """Try batch sizes ``start, 2*start, ...`` up to ``max_batch_size`` (see the module docstring).

    Returns ``{"device", "results": [{"batch_size", "status" (ok|oom|too_few_samples),
    "samples_per_s", "step_time_s", "peak_mem_mb", "peak_reserved_mb" (CUDA only), "error"}...]
    (None where not measured), "recommended", "reason", "stopped" (oom|max_batch_size|too_few_samples),
    "capacity_mb" (CUDA: free memory at the start), "margin", "steps"}``. An ``oom`` row is the size
    that ran out of memory; a ``too_few_samples`` row the size the cache could not fill (not run).
    """
    if not cfg.data.cache:
        raise ValueError("--cache is required (a directory made by `shardcache precompute`)")
    if steps < 1:
        raise ValueError("steps must be >= 1")
    if not 0 < margin <= 1:
        raise ValueError("margin must be in (0, 1]")
    if cfg.dist.threads:
        torch.set_num_threads(cfg.dist.threads)
    D.set_alloc_conf()
    D.log_env_set()
    device = pick_device(cfg)
    info = D.DistInfo(device=device)
    capacity_mb = None
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        capacity_mb = free / 2**20
    sizes = candidate_sizes(max_batch_size, start)
    run = copy.deepcopy(cfg)  # the trainer of `shardcache train`, without validation, at the first size
    run.eval.enabled, run.data.batch_size = False, sizes[0]
    trainer = Trainer(run, info)
    trainer.loader.close()
    results: list[dict[str, Any]] = []
    stopped = "max_batch_size"
    for i, bs in enumerate(sizes):
        row: dict[str, Any] = {"batch_size": bs, "status": "ok", "samples_per_s": None,
                               "step_time_s": None, "peak_mem_mb": None, "peak_reserved_mb": None,
                               "error": ""}
        results.append(row)
        try:
            loader = make_loader(run, trainer.cache, bs, info, model=trainer.raw)
        except ValueError as e:  # ShardLoader: "an epoch has no step"
            if i == 0:
                raise
            row.update(status="too_few_samples", error=str(e))
            stopped = "too_few_samples"
            break
        if len(loader) < run.training.grad_accum:
            if i == 0:
                raise ValueError(f"{cfg.data.cache}: the loader yields no optimizer step of batch {bs}")
            row.update(status="too_few_samples", error=f"the loader yields no batch of {bs} samples")
            stopped = "too_few_samples"
            loader.close()
            break
        loader.set_epoch(0)
        trainer.loader, trainer.pos = loader, {"epoch": 0}
        trainer.data = DevicePrefetcher(batch_stream(loader, trainer.pos), device, convert=to_device,
                                        state=lambda: {}, ahead=False)
        _release(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        oom = None
        times: list[float] = []
        try:
            for _ in range(steps):
                _sync(device)
                wait, t0 = trainer.stats.data_wait, time.perf_counter()
                train_step(trainer)
                _sync(device)
                times.append(time.perf_counter() - t0 - (trainer.stats.data_wait - wait))
        except Exception as e:  # noqa: BLE001 - only an OOM is a result; anything else propagates
            if not is_oom(e):
                raise
            oom = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            trainer.data = None  # drop references to the batches before measuring/freeing
            trainer.optimizer.zero_grad(set_to_none=True)
            loader.close()
        if oom is not None:  # (the exception, and the frames it holds, are gone here)
            row.update(status="oom", error=oom)
            stopped = "oom"
            log.info("batch size %d: out of memory", bs)
            _release(device)
            break
        timed = times[1:] if len(times) > 1 else times
        dt = max(statistics.median(timed), 1e-9)
        row.update(step_time_s=dt, samples_per_s=bs * run.training.grad_accum / dt,
                   peak_mem_mb=peak_memory_mb(device),
                   peak_reserved_mb=(torch.cuda.max_memory_reserved(device) / 2**20
                                     if device.type == "cuda" else None))
        log.info("batch size %d: %.1f samples/s, %.1f ms/step, peak %.0f MiB", bs, row["samples_per_s"],
                 1000 * dt, row["peak_mem_mb"])
    best, reason = recommend(results, device.type, capacity_mb, margin)
    return {"device": str(device), "results": results, "recommended": best, "reason": reason,
            "stopped": stopped, "capacity_mb": capacity_mb, "margin": margin, "steps": steps}


def format_table(res: dict[str, Any]) -> str:
    """The result as a text table plus the recommendation."""
    cuda = res["device"].startswith("cuda")
    mem_head = "peak alloc MiB" if cuda else "peak RSS MiB"
    head = f"{'batch':>7}  {'samples/s':>10}  {'step ms':>9}  {mem_head:>14}" + \
        (f"  {'reserved MiB':>12}" if cuda else "") + "  status"
    lines = [head, "-" * len(head)]
    for r in res["results"]:
        def num(v, fmt):
            return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "-"
        ms = None if r["step_time_s"] is None else 1000 * r["step_time_s"]
        line = (f"{r['batch_size']:>7}  {num(r['samples_per_s'], '10.1f'):>10}  "
                f"{num(ms, '9.1f'):>9}  {num(r['peak_mem_mb'], '14.0f'):>14}")
        if cuda:
            line += f"  {num(r['peak_reserved_mb'], '12.0f'):>12}"
        lines.append(line + f"  {r['status']}")
    why = {"oom": "stopped at the first out-of-memory error",
           "max_batch_size": "stopped at --max_batch_size",
           "too_few_samples": "stopped: the cache has too few samples for a larger batch"}[res["stopped"]]
    lines.append(f"device {res['device']}; {res['steps']} step(s) per size; {why}")
    if res["recommended"] is None:
        lines.append(f"no recommendation: {res['reason']}")
    else:
        lines.append(f"recommended --data.batch_size {res['recommended']} ({res['reason']})")
    return "\n".join(lines)


def build_finder_parser() -> argparse.ArgumentParser:
    p = build_parser(
        prog="shardcache find-batch-size",
        description=(
            "Find the largest / fastest per-rank batch size for the configured model on one device.\n\n"
            "  shardcache find-batch-size --cache cache/demo --config configs/train.yaml\n"
            "  shardcache find-batch-size --cache /data/cache --max_batch_size 256 --margin 0.85\n\n"
            "Takes every option of `shardcache train` (defaults < config file < flags), except\n"
            "that --steps is the number of steps per batch size. Exit status 0, 2 for bad options and for a\n"
            "cache that does not fit the model."))
    g = p.add_argument_group("batch-size finder")
    g.add_argument("--max_batch_size", type=bounded(int, gt=0, le=1 << 20), default=1024,
                   help="largest batch size tried (default: 1024).")
    g.add_argument("--steps", type=bounded(int, gt=0, le=10_000), default=3,
                   help="training steps per batch size; the first is a warm-up when >= 2 (default: 3).")
    g.add_argument("--margin", type=bounded(float, gt=0.0, le=1.0), default=0.9,
                   help="CUDA: recommend the largest size whose peak reserved memory is within this "
                        "fraction of the free device memory (default: 0.9).")
    g.add_argument("--start", type=bounded(int, gt=0, le=1 << 20), default=1,
                   help="first batch size tried; the next ones double it (default: 1).")
    g.add_argument("--json", default="", metavar="FILE", help="also write the result as JSON to FILE.")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg, ns = parse_args(argv, build_finder_parser())
        if not cfg.data.cache:
            raise ConfigError([("data.cache", "required (a directory made by `shardcache precompute`)")])
    except ConfigError as e:
        return e.report("shardcache find-batch-size")
    from shards.errors import ContractMismatch
    setup_logging(D.DistInfo())
    try:
        res = find_batch_size(cfg, max_batch_size=ns.max_batch_size, steps=ns.steps, margin=ns.margin,
                              start=ns.start)
    except ContractMismatch as e:  # the cache does not fit the model: nothing was loaded
        sys.stderr.write(f"shardcache find-batch-size: error: {e}\n")
        return 2
    sys.stdout.write(format_table(res) + "\n")
    if ns.json:
        Path(ns.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0
