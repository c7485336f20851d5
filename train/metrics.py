"""Per-step metrics: JSONL (and TensorBoard if installed) and a tqdm bar, all on global rank 0 only.

Each line of ``OUT/metrics.jsonl`` is one record::

    {"step": 12, "loss": 6.93, "lr": 0.0003, "grad_norm": 1.2, "samples_per_s": 410.0,
     "tokens_per_s": 52000.0, "data_wait": 0.03, "step_time_s": 0.078, "peak_mem_mb": 812.0,
     "skipped_steps": 0, "epoch": 0, ...model extras such as codes_loss, latent_loss}

``loss`` (and the model's extra scalars) are the mean over all ranks and micro-steps of the step;
``samples_per_s`` / ``tokens_per_s`` are global (every rank's samples and valid text + audio
positions over this rank's wall time of the step); ``data_wait`` is the fraction of the step this
rank spent waiting for batches; ``peak_mem_mb`` is the CUDA allocator peak (or the process max RSS
on CPU). Validation records carry ``"split": "val"``. A resumed run appends to the same file
after dropping records of steps beyond its checkpoint (so every step appears once).
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("train")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 1024.0 if sys.platform != "darwin" else rss / 2**20
    except ImportError:  # pragma: no cover - Windows
        return float("nan")


class Metrics:
    """Writes records on the main rank; warns on a NaN loss and on a throughput drop."""

    def __init__(self, out_dir: str | Path, is_main: bool, total_steps: int, start_step: int,
                 tensorboard: bool = False, progress: bool = True, throughput_warn: float = 0.5):
        self.is_main = is_main
        self.throughput_warn = throughput_warn
        self._ema: float | None = None
        self._n = 0
        self._last_warn = -10**9
        self._file = None
        self._tb = None
        self._bar = None
        if not is_main:
            return
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "metrics.jsonl"
        self._drop_after(start_step)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(out / "tb"))
            except Exception as e:  # noqa: BLE001 - tensorboard is optional
                log.warning("--tensorboard: not available (%s); JSONL only", e)
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                             file=sys.stderr, mininterval=1.0)

    def _drop_after(self, step: int) -> None:
        """Remove records of steps after ``step`` (logged after the checkpoint a run resumes from,
        or by an earlier run in this directory when starting fresh), so each step appears once."""
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        keep = []
        for line in lines:
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except ValueError:
                pass  # a line cut by a crash
        if len(keep) != len(lines):
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, self.path)

    def log(self, rec: dict[str, Any]) -> None:
        """Record one step (call on every rank; only the main rank writes)."""
        if not self.is_main:
            return
        step = rec.get("step")
        loss = rec.get("loss")
        if loss is not None and not math.isfinite(loss):
            log.warning("step %s: non-finite loss %s", step, loss)
        sps = rec.get("samples_per_s")
        if sps and rec.get("split", "train") == "train":
            self._n += 1
            if self._ema is not None and self._n > 5 and sps < self.throughput_warn * self._ema \
                    and step - self._last_warn >= 50:
                self._last_warn = step
                log.warning("step %s: throughput dropped to %.1f samples/s (running average %.1f); "
                            "data_wait=%.2f", step, sps, self._ema, rec.get("data_wait", float("nan")))
            self._ema = sps if self._ema is None else 0.9 * self._ema + 0.1 * sps
        self._file.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            prefix = rec.get("split", "train")
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if self._bar is not None and rec.get("split", "train") == "train":
            self._bar.n = step
            self._bar.set_postfix(loss=f"{loss:.4f}" if loss is not None else "-",
                                  lr=f"{rec.get('lr', 0):.2e}", refresh=False)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
            self._file = None
