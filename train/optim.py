"""AdamW over the model's parameter groups, the learning-rate schedule as a ``LambdaLR``, and the
gradient norms per group.

Groups: the model's ``optimizer_groups(lr, weight_decay)`` if it has one (a group may carry its own
``lr``: the VLM's projection), else weight decay on matrices/embeddings (dim >= 2) and none on
biases and norms. Every group has a ``name`` (the hook's, else ``decay``/``no_decay``, else
``group<i>``): the metrics log ``lr/<name>`` and ``grad_norm/<name>``. The schedule multiplies every
group's own lr (``LambdaLR``'s ``initial_lr``) by one factor, :class:`Schedule`: linear warmup, then
constant | linear | cosine | polynomial decay to ``min_lr_ratio``. The scheduler's state (step, base
lrs, the schedule's parameters) is in every checkpoint.

Clipping (:func:`grad_norms`, :func:`clip_grads_`): the pre-clip L2 norm of each group's gradients,
the global norm as the L2 norm of those (what ``clip_grad_norm_`` computes), and every gradient
scaled by ``min(1, max_norm / (norm + 1e-6))`` (``clip_grad_norm_``'s rule), all on the device.
"""
from __future__ import annotations

import logging
import math
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

from .config import ScheduleConfig, TrainConfig
from .spec import ModelSpec, model_spec

log = logging.getLogger("train")


@dataclass
class Schedule:
    """The lr factor of optimizer step ``step`` (0-based): ``(step + 1) / warmup`` during warmup, then
    from 1 down to ``min_ratio`` at ``steps``: constant (1), linear, cosine, polynomial
    ``(1 - progress) ** power``. A callable object (not a closure), so ``LambdaLR.state_dict`` stores
    its parameters."""

    name: str
    warmup: int
    steps: int
    min_ratio: float
    power: float = 1.0

    def __call__(self, step: int) -> float:
        if self.warmup > 0 and step < self.warmup:
            return (step + 1) / self.warmup
        if self.name == "constant":
            return 1.0
        frac = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        if self.name == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * frac))
        elif self.name == "polynomial":
            decay = (1.0 - frac) ** self.power
        else:  # linear
            decay = 1.0 - frac
        return self.min_ratio + decay * (1.0 - self.min_ratio)

    @classmethod
    def of(cls, cfg: ScheduleConfig, steps: int) -> "Schedule":
        return cls(cfg.name, cfg.warmup_steps, steps, cfg.min_lr_ratio, cfg.power)


def lr_at(step: int, cfg: TrainConfig, steps: int | None = None) -> float:
    """The lr of a group at ``optim.lr`` at optimizer step ``step`` (0-based) of a run of ``steps``
    (default ``training.steps``)."""
    return cfg.optim.lr * Schedule.of(cfg.schedule, cfg.training.steps if steps is None else steps)(step)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps: int) -> LambdaLR:
    """``LambdaLR(optimizer, Schedule)``: every group's lr = its own lr x the factor of the step."""
    return LambdaLR(optimizer, Schedule.of(cfg.schedule, steps))


def restore_scheduler(scheduler: LambdaLR, state: dict[str, Any] | None, step: int) -> None:
    """Resume the schedule at ``step``: the checkpoint's scheduler ``state`` gives its position;
    this run's schedule and group lrs (its config) stay in force, with a warning where the
    checkpoint's differ. ``state`` None (checkpoints before the LambdaLR): position = ``step``."""
    mine = asdict(scheduler.lr_lambdas[0])
    bases = list(scheduler.base_lrs)
    if state is not None:
        scheduler.load_state_dict(state)
        theirs = (state.get("lr_lambdas") or [None])[0]
        if theirs and theirs != mine:
            log.warning("resuming with this config's schedule %s; the checkpoint's was %s", mine, theirs)
        if [float(b) for b in state.get("base_lrs", bases)] != [float(b) for b in bases]:
            log.warning("resuming with this config's learning rates %s; the checkpoint's were %s", bases,
                        state.get("base_lrs"))
    scheduler.lr_lambdas[0].__dict__.update(mine)
    scheduler.base_lrs = bases
    scheduler.last_epoch = step
    for g, base in zip(scheduler.optimizer.param_groups, bases):
        g["initial_lr"] = base
        g["lr"] = base * scheduler.lr_lambdas[0](step)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]  # noqa: SLF001


def step_scheduler(scheduler: LambdaLR) -> None:
    """``scheduler.step()`` without torch's "called before optimizer.step()" warning (a skipped
    non-finite step under a GradScaler does not call ``optimizer.step``; the schedule still moves)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
        scheduler.step()


def fused_adamw_supported(device: torch.device) -> bool:
    """Whether ``AdamW(fused=True)`` constructs and steps on ``device`` with this torch."""
    try:
        p = torch.nn.Parameter(torch.zeros(2, device=device))
        opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
        p.grad = torch.ones_like(p)
        opt.step()
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def param_groups(raw: nn.Module, cfg: TrainConfig, spec: ModelSpec | None = None) -> list[dict]:
    """The model's declared groups (its spec's ``optimizer_groups(model, lr, weight_decay)``: a recipe's
    :meth:`train.recipes.base.Recipe.optimizer_groups`; ``spec`` default: the spec of ``model.name``) when
    it gives some, else decay on dim >= 2 and none on the rest; every group gets an ``lr``. Raises
    ValueError when the declared groups repeat a parameter or leave a trainable one out."""
    lr, wd = cfg.optim.lr, cfg.optim.weight_decay
    declared = (spec or model_spec(cfg.model.name)).optimizer_groups(raw, lr, wd)
    if declared is not None:
        groups = [dict(g, params=list(g["params"])) for g in declared]
        ids = [id(p) for g in groups for p in g["params"]]
        missing = [n for n, p in raw.named_parameters() if p.requires_grad and id(p) not in set(ids)]
        if len(ids) != len(set(ids)) or missing:
            raise ValueError(f"{type(raw).__name__}.optimizer_groups: every trainable parameter must be in "
                             f"exactly one group (repeated: {len(ids) - len(set(ids))}, missing: {missing[:5]})")
    else:
        params = [p for p in raw.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if declared is None:
        groups[0]["name"], groups[1]["name"] = "decay", "no_decay"
    for i, g in enumerate(groups):
        g["lr"] = float(g.get("lr", lr))
        g["name"] = str(g.get("name") or f"group{i}")
    names = [g["name"] for g in groups]
    if len(set(names)) != len(names):
        raise ValueError(f"{type(raw).__name__}.optimizer_groups: group names must differ, got {names}")
    return groups


def make_optimizer(raw: nn.Module, cfg: TrainConfig, device: torch.device,
                   spec: ModelSpec | None = None) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups`: fused when ``optim.fused`` is on, or auto and this
    torch/device supports it (:func:`fused_adamw_supported`); else foreach on CUDA. Which one it is:
    ``optimizer.defaults["fused"]``."""
    o = cfg.optim
    groups = param_groups(raw, cfg, spec)
    fused = o.fused == "on" or (o.fused == "auto" and fused_adamw_supported(device))
    kw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    if fused:
        return torch.optim.AdamW(groups, fused=True, **kw)
    return torch.optim.AdamW(groups, foreach=device.type == "cuda" or None, **kw)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.defaults.get("fused"))


def skipping_step(optimizer: torch.optim.Optimizer, nonfinite: torch.Tensor) -> None:
    """``optimizer.step()`` unless ``nonfinite`` (a 0-dim bool tensor on the device).

    A fused AdamW skips on the device: it reads ``found_inf`` the way ``torch.amp.GradScaler``
    passes it (optimizers with ``_step_supports_amp_scaling``): no host sync. Other optimizers need
    the flag on the host: one sync per step (``optim.fused: off``, or a torch/device without fused
    AdamW).
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False) and is_fused(optimizer):
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        optimizer.found_inf = nonfinite.to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
    elif not bool(nonfinite):
        optimizer.step()


def trainable_groups(optimizer: torch.optim.Optimizer) -> list[tuple[int, str, list[torch.Tensor]]]:
    """``(index, name, params)`` of every optimizer group that holds a parameter, in order."""
    return [(i, str(g.get("name") or f"group{i}"), list(g["params"]))
            for i, g in enumerate(optimizer.param_groups) if g["params"]]


def grad_norms(groups: list[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """float32 ``(G,)`` on ``device``: the L2 norm of each group's gradients (parameters without a
    gradient count 0); the L2 norm of the result is the global norm. No host sync."""
    out = []
    for params in groups:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            out.append(torch.zeros((), dtype=torch.float32, device=device))
            continue
        norms = torch._foreach_norm(grads) if hasattr(torch, "_foreach_norm") else [  # noqa: SLF001
            torch.linalg.vector_norm(g) for g in grads]
        out.append(torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in norms])))
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.float32, device=device)


def clip_grads_(params: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients of ``params`` by ``min(1, max_norm / (total + 1e-6))`` on the device
    (``torch.nn.utils.clip_grad_norm_``'s rule, given the global pre-clip norm ``total``); nothing
    when ``max_norm`` is infinite."""
    if math.isinf(max_norm):
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for dev, gs in by_device.items():
        c = coef.to(dev)
        if hasattr(torch, "_foreach_mul_"):
            torch._foreach_mul_(gs, c)  # noqa: SLF001
        else:  # pragma: no cover - torch without foreach
            for g in gs:
                g.mul_(c.to(g.dtype))
