"""Training metrics: computed on the device between log steps, written on global rank 0.

Each line of ``RUN_DIR/metrics.jsonl`` is one JSON record (non-finite numbers are written as
``null``: strict JSON, which ``json.loads`` in any language reads)::

    {"step": 20, "loss": 6.93, "lr": 0.0003, "grad_norm": 1.2, "grad_norm_max": 1.9,
     "samples_per_s": 410.0, "tokens_per_s": 52000.0, "data_wait": 0.03, "step_time_s": 0.078,
     "peak_mem_mb": 812.0, "skipped_steps": 0, "epoch": 0, ...model extras such as codes_loss}

A record covers the steps since the previous one (``metrics.every`` steps): ``loss`` and the model's
extra scalars are the mean over those steps, their micro-steps and all ranks; ``grad_norm`` is the
pre-clip norm of the last step and ``grad_norm_max`` the largest of the window; ``grad_norm/<group>``
the pre-clip norm of each optimizer group's gradients in the last step (their L2 norm is
``grad_norm``; groups as :func:`train.optim.param_groups` names them: ``projection``, ``lm``...);
``samples_per_s`` / ``tokens_per_s`` are global (every rank's samples and valid text + audio
positions over this rank's wall time of the window); ``data_wait`` is the fraction of that time
spent waiting for batches; ``step_time_s`` the mean step time; ``skipped_steps`` the non-finite
steps skipped so far; ``lr/<group>`` the learning rate each group trained with in the record's last
step (its own base lr x the schedule: a projection at ``projection_lr`` shows that rate) and ``lr``
that of the group with the most parameters; ``peak_mem_mb`` the CUDA allocator peak (or the process
max RSS on CPU). With ``metrics.debug`` a record also has ``latents_mean``, ``latents_std``,
``latents_min``, ``latents_max``: the window's batches' latents over their real cells (this rank's
batches, float32; a scale far from the VAE's, e.g. latents of [0, 255] pixels, shows here first).
Validation records carry ``"split": "val"``.

:class:`StepStats` keeps every per-step quantity as a device tensor, so the steps between log steps
never wait for the GPU: the record is read back with one all-reduce and one device-to-host copy
(:meth:`StepStats.read`). The checks that need values on the host (the grad-norm warning, the
limit on consecutive non-finite steps) run on those reads, so they act with a latency of at most
``metrics.every`` steps (the non-finite limit is also checked before every checkpoint, so no
checkpoint is written after the limit was reached).

A resumed run appends to the same file after dropping records of steps beyond its checkpoint (so
every step appears once).
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import dist as D

log = logging.getLogger("train")


class NonFiniteError(RuntimeError):
    """``training.nonfinite_limit`` consecutive steps had a non-finite loss or gradient norm."""


def finite_or_none(v: Any) -> Any:
    """Non-finite floats -> None (JSON null), recursively in dicts and lists."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: finite_or_none(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite_or_none(x) for x in v]
    return v


def to_json(rec: dict[str, Any]) -> str:
    """One strict-JSON line (``null`` for NaN/inf; ``json.dumps(allow_nan=False)``)."""
    return json.dumps(finite_or_none(rec), allow_nan=False)


#: the window's latent statistics (:meth:`StepStats.add_latents`), in the order they are kept
LATENT_STATS = ("latents_sum", "latents_sum_sq", "latents_cells", "latents_min", "latents_max")


class StepStats:
    """Per-step quantities as device tensors: sums over the window since the last read, and the
    non-finite counters of the run. Nothing here reads a value back to the host except :meth:`read`
    and :meth:`consecutive_nonfinite`."""

    def __init__(self, device: torch.device, skipped: int = 0, groups: tuple[str, ...] = ()):
        self.device = device
        self.groups = tuple(groups)  #: optimizer group names of :meth:`add_step`'s ``group_norms``
        self.skipped = torch.tensor(skipped, dtype=torch.float64, device=device)   #: run total
        self.consec = torch.zeros((), dtype=torch.float64, device=device)          #: current streak
        self.start_window()

    def start_window(self) -> None:
        z = lambda: torch.zeros((), dtype=torch.float64, device=self.device)  # noqa: E731
        self.loss, self.tokens, self.norm, self.norm_max, self.over_warn = z(), z(), z(), z(), z()
        self.group_norm = torch.zeros(len(self.groups), dtype=torch.float64, device=self.device)
        self.latents: torch.Tensor | None = None  #: [sum, sum of squares, cells, min, max] of the window
        self.streak_max = self.consec.clone()
        self.extras: dict[str, torch.Tensor] = {}
        self.micro = self.steps = self.samples = 0
        self.data_wait = 0.0
        self.t0 = time.perf_counter()

    def add_latents(self, latents: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Accumulate the statistics of a batch's ``latents`` (B, C, T, H, W) over its real cells
        (``mask`` (B, T, H, W) bool, True on real cells; None = all): no host sync (no boolean
        indexing)."""
        x = latents.detach().float()
        w = torch.ones_like(x) if mask is None else mask[:, None].expand_as(x).to(x.dtype)
        big = torch.finfo(x.dtype).max
        st = torch.stack([(x * w).sum(), (x * x * w).sum(), w.sum(),
                          torch.where(w > 0, x, big).amin(), torch.where(w > 0, x, -big).amax()]).double()
        if self.latents is None:
            self.latents = st
        else:
            self.latents = torch.cat([self.latents[:3] + st[:3], torch.minimum(self.latents[3:4], st[3:4]),
                                      torch.maximum(self.latents[4:], st[4:])])

    def add_micro(self, loss: torch.Tensor, extras: dict[str, torch.Tensor], tokens: Any, samples: int) -> None:
        self.loss += loss.detach().double()
        for k, v in extras.items():
            self.extras[k] = self.extras.get(k, 0) + v.detach().double()
        self.tokens += tokens
        self.samples += samples
        self.micro += 1

    def add_step(self, norm: torch.Tensor, nonfinite: torch.Tensor, warn_above: float,
                 group_norms: torch.Tensor | None = None) -> None:
        """One optimizer step: its pre-clip global ``norm`` (0-dim), whether it was ``nonfinite``
        (0-dim bool), and the pre-clip norm of each group in :attr:`groups` ((G,), optional)."""
        if group_norms is not None:
            self.group_norm = group_norms.detach().double()
        norm = norm.detach().double()
        bad = nonfinite.double()
        self.norm = norm
        self.norm_max = torch.fmax(self.norm_max, norm)   # fmax: a NaN norm does not hide the others
        if warn_above:
            self.over_warn += (norm > warn_above).double()
        self.skipped += bad
        self.consec = (self.consec + 1) * bad
        self.streak_max = torch.maximum(self.streak_max, self.consec)
        self.steps += 1

    def consecutive_nonfinite(self) -> int:
        """The longest streak of non-finite steps in this window (one host sync)."""
        return int(self.streak_max.item())

    def read(self, info: D.DistInfo) -> tuple[dict[str, Any], dict[str, int]]:
        """(the window's record, its health: ``over_warn`` steps above the grad-norm warning,
        ``streak`` the longest run of non-finite steps), every rank's sums all-reduced: one
        all-reduce, one device-to-host copy. Every quantity travels under its name."""
        summed = {"loss": self.loss, "tokens": self.tokens, **{("extra", k): v for k, v in self.extras.items()}}
        local = {"grad_norm": self.norm, "grad_norm_max": self.norm_max, "over_warn": self.over_warn,
                 "skipped": self.skipped, "streak": self.streak_max,
                 **{f"grad_norm/{g}": v for g, v in zip(self.groups, self.group_norm.unbind())}}
        if self.latents is not None:
            local.update(zip(LATENT_STATS, self.latents.unbind()))
        reduced = torch.stack(list(summed.values()))
        D.all_reduce_(reduced, info)
        v = dict(zip([*summed, *local], torch.cat([reduced, torch.stack(list(local.values()))]).tolist()))
        n = max(self.micro, 1) * info.world_size
        dt = max(time.perf_counter() - self.t0, 1e-9)
        rec = {"loss": v["loss"] / n, "grad_norm": v["grad_norm"], "grad_norm_max": v["grad_norm_max"],
               "samples_per_s": self.samples * info.world_size / dt, "tokens_per_s": v["tokens"] / dt,
               "data_wait": self.data_wait / dt, "step_time_s": dt / max(self.steps, 1),
               "skipped_steps": int(v["skipped"])}
        rec.update({k: v[("extra", k)] / n for k in sorted(self.extras)})
        rec.update({f"grad_norm/{g}": v[f"grad_norm/{g}"] for g in self.groups})
        if v.get("latents_cells", 0) > 0:
            mean = v["latents_sum"] / v["latents_cells"]
            rec.update({"latents_mean": mean,
                        "latents_std": math.sqrt(max(v["latents_sum_sq"] / v["latents_cells"] - mean * mean, 0.0)),
                        "latents_min": v["latents_min"], "latents_max": v["latents_max"]})
        return rec, {"over_warn": int(v["over_warn"]), "streak": int(v["streak"])}


def check_nonfinite(streak: int, limit: int, step: int) -> None:
    """Raise :class:`NonFiniteError` when ``streak`` consecutive non-finite steps reach ``limit``."""
    if limit and streak >= limit:
        raise NonFiniteError(
            f"step {step}: {streak} consecutive steps with a non-finite loss or gradient norm (limit "
            f"training.nonfinite_limit={limit}); stopping without a checkpoint. Check the data, the lr "
            f"(optim.lr) and the precision (training.precision); the last good checkpoint is kept.")


class GradNormWarning:
    """Warn (global rank 0) when the pre-clip grad norm exceeded ``optim.grad_norm_warn`` within a
    log window: the first 3 windows, then every 100th (a loss summed over tokens instead of
    averaged, a too-high lr or bad data show up as norms in the thousands where 1-100 is expected)."""

    def __init__(self, limit: float, clip: float, active: bool):
        self.limit, self.clip, self.active, self.count = limit, clip, active, 0

    def __call__(self, first: int, last: int, norm_max: float, n_over: int) -> None:
        if not (self.active and self.limit and n_over):
            return
        self.count += 1
        if self.count <= 3 or self.count % 100 == 0:
            steps = f"step {last}" if first == last else f"steps {first}-{last}"
            log.warning("%s: grad norm %.4g > grad_norm_warn %g (%d step(s) over in this window, %d window(s) so "
                        "far%s); expected O(1-100): check the loss normalisation (mean, not sum, over tokens), the "
                        "lr and the data", steps, norm_max, self.limit, n_over, self.count,
                        f"; clipped to {self.clip:g}" if self.clip > 0 else "")


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

    def __init__(self, out_dir: str | Path, is_main: bool, total_steps: int, tensorboard: bool = False,
                 progress: bool = True, throughput_warn: float = 0.5):
        self.out, self.is_main, self.total_steps = Path(out_dir), is_main, total_steps
        self.tensorboard, self.progress, self.throughput_warn = tensorboard, progress, throughput_warn
        self.path = self.out / "metrics.jsonl"
        self._ema: float | None = None
        self._n = 0
        self._last_warn = -10**9
        self._file = None
        self._tb = None
        self._bar = None

    def open(self, start_step: int) -> None:
        """Start writing at ``start_step`` (0, or the step a run resumes from): records of later
        steps are dropped from ``metrics.jsonl`` first. A no-op on ranks other than the main one."""
        if not self.is_main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self._drop_after(start_step)
        self._file = open(self.path, "a", buffering=1)
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(self.out / "tb"))
            except Exception as e:  # noqa: BLE001 - tensorboard is optional
                log.warning("--tensorboard: not available (%s); JSONL only", e)
        if self.progress:
            from tqdm import tqdm
            self._bar = tqdm(total=self.total_steps, initial=start_step, desc="train", dynamic_ncols=True,
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
        if loss is not None and not (isinstance(loss, float) and math.isfinite(loss)):
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
        self._file.write(to_json(rec) + "\n")
        if self._tb is not None:
            prefix = rec.get("split", "train")
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if self._bar is not None and rec.get("split", "train") == "train":
            self._bar.n = step
            self._bar.set_postfix(loss=f"{loss:.4f}" if isinstance(loss, float) else "-",
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
