"""``--profile``: torch.profiler over the first steps, a Chrome trace and a Markdown report.

The trainer marks the phases of a step with ``torch.profiler.record_function`` ranges
(:data:`PHASES`: ``data_wait``, ``forward``, ``backward``, ``optimizer``). After the recorded steps
(``profile.wait`` skipped, ``profile.warmup``, ``profile.active`` recorded) global rank 0 writes
``RUN_DIR/profile/trace-rank0-stepN.json`` (chrome://tracing, Perfetto) and
``RUN_DIR/profile/report.md``:

* the time in each phase and in communication (the process group's all-reduce / broadcast ops:
  DDP's gradient buckets, which run during backward, so that share overlaps ``backward``), as the
  sum over the recorded steps, per step and as a share of the step (the ``ProfilerStep`` ranges);
  host wall time, and on CUDA also the device time of the kernels launched inside each range;
* the top operators by self time (device time on CUDA, host time on CPU).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any


from . import dist as D
from .config import ProfileConfig

log = logging.getLogger("train")

PHASES = ("data_wait", "forward", "backward", "optimizer")
#: operator names of collectives (gloo/nccl process-group ops, c10d dispatch)
COMM = re.compile(r"(all_?reduce|all_?gather|broadcast|reduce_scatter|nccl|gloo:)", re.I)


def _t(e: Any, what: str) -> float:
    """An averaged event's ``what`` time in microseconds (device time under either attribute name)."""
    if what == "device":
        return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0) or 0.0)
    if what == "self_device":
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0) or 0.0)
    return float(getattr(e, what))


def report(events: list[Any], steps: int, device_type: str, first_step: int) -> str:
    """The Markdown report from ``profiler.key_averages()`` (see the module docstring)."""
    by = {e.key: e for e in events}
    step_us = sum(_t(e, "cpu_time_total") for e in events if e.key.startswith("ProfilerStep"))
    cuda = device_type == "cuda"
    rows = [(p, _t(by[p], "cpu_time_total") if p in by else 0.0, _t(by[p], "device") if p in by else 0.0)
            for p in PHASES]
    comm = [e for e in events if COMM.search(e.key) and e.key not in PHASES and not e.key.startswith("ProfilerStep")]
    rows.append(("communication", sum(_t(e, "self_cpu_time_total") for e in comm),
                 sum(_t(e, "self_device") for e in comm)))
    n = max(steps, 1)
    lines = [f"# Profile of steps {first_step}-{first_step + steps - 1} (global rank 0, {device_type})", "",
             f"Recorded steps: {steps}; step time (ProfilerStep ranges): {step_us / 1e3 / n:.2f} ms per step.", "",
             "| phase | host ms (total) | host ms per step | share of step |" + (" device ms (total) |" if cuda else ""),
             "| --- | --- | --- | --- |" + (" --- |" if cuda else "")]
    for name, host, dev in rows:
        share = f"{100 * host / step_us:.1f} %" if step_us else "-"
        lines.append(f"| {name} | {host / 1e3:.2f} | {host / 1e3 / n:.2f} | {share} |"
                     + (f" {dev / 1e3:.2f} |" if cuda else ""))
    lines += ["", "Communication (DDP's all-reduce of gradient buckets) runs during backward: its share overlaps "
              "the backward row.", ""]
    key = "self_device" if cuda else "self_cpu_time_total"
    ops = [e for e in events if e.key not in PHASES and not e.key.startswith("ProfilerStep")]
    ops.sort(key=lambda e: _t(e, key), reverse=True)
    lines += [f"## Top operators by self {'device' if cuda else 'host'} time", "",
              "| operator | calls | self ms | total ms |", "| --- | --- | --- | --- |"]
    for e in ops[:15]:
        total = _t(e, "device") if cuda else _t(e, "cpu_time_total")
        lines.append(f"| `{e.key}` | {e.count} | {_t(e, key) / 1e3:.3f} | {total / 1e3:.3f} |")
    return "\n".join(lines) + "\n"


class StepProfiler:
    """torch.profiler on global rank 0 over the schedule of ``cfg``; :meth:`step` after each
    optimizer step, :meth:`stop` at the end (writes nothing if the schedule never completed)."""

    def __init__(self, cfg: ProfileConfig, info: D.DistInfo, out: Path):
        self.info, self.out, self.cfg = info, Path(out), cfg
        self.first = 0
        self.prof = None

    @classmethod
    def maybe(cls, cfg: ProfileConfig, info: D.DistInfo, out: Path) -> "StepProfiler | None":
        return cls(cfg, info, out) if cfg.enabled and info.is_main else None

    def start(self, start_step: int) -> None:
        """Begin the schedule after optimizer step ``start_step`` (0, or the step a run resumes from)."""
        from torch.profiler import ProfilerActivity, profile, schedule

        cfg = self.cfg
        self.first = start_step + cfg.wait + cfg.warmup + 1
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.info.device.type == "cuda" else [])
        self.prof = profile(activities=acts, on_trace_ready=self._ready,
                            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1))
        self.prof.start()

    def _ready(self, p) -> None:
        d = self.out / "profile"
        d.mkdir(parents=True, exist_ok=True)
        trace = d / f"trace-rank{self.info.rank}-step{p.step_num}.json"
        p.export_chrome_trace(str(trace))
        text = report(list(p.key_averages()), self.cfg.active, self.info.device.type, self.first)
        (d / "report.md").write_text(text)
        log.info("profiler: trace %s, report %s\n%s", trace, d / "report.md", text)

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
