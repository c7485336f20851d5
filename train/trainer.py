"""The trainer (after torchtitan's ``Trainer``) and :func:`train`, the run read top to bottom.

:class:`Trainer` owns the parts of a run and builds every one of them in ``__init__`` (model,
optimizer, LR scheduler, grad scaler, loaders and the batch stream on the device, metrics,
profiler, checkpointer, :class:`TrainState`); :meth:`Trainer.resume` only loads state into them.
It runs one optimizer step (:meth:`Trainer.train_step`, made of micro-steps
:meth:`Trainer.forward_backward_step`), validates (:meth:`Trainer.evaluate`) and saves / resumes
through one state dict (:meth:`Trainer.state_dict`, :class:`train.checkpoint.Checkpointer`). One
optimizer step::

    for micro in range(grad_accum):
        batch = next(data)                      # on the device, widened; the wait is the step's data wait
        forward_backward_step(batch, sync_grads=last)
            with model.no_sync() unless last:   # covers forward AND backward: no all-reduce
                with autocast: out = model(batch)   # bf16 / fp16 (GradScaler) / fp32: train.precision
                backward(out.loss / grad_accum) # last micro-step: DDP all-reduces the buckets
    unscale (fp16); norms of each optimizer group's grads; norm = their L2 norm; clip to optim.grad_clip
    optimizer step, skipped on the device when the norm is not finite; scheduler.step()

Nothing in a step reads a value back to the host: losses, token counts, grad norms (global and
per group) and the non-finite counters stay device tensors (:class:`train.metrics.StepStats`)
until a log step. The
skip of a non-finite step happens on the device with the fused AdamW (``found_inf``, as
``torch.amp.GradScaler`` does); other optimizers need one host sync per step for it.

DDP: ``broadcast_buffers=False`` (``forward_sync_buffers=False`` on torch >= 2.13; buffers are
constant here, and a rank-local eval through the wrapper would otherwise broadcast),
``gradient_as_bucket_view=True``, ``static_graph`` off (it breaks ``no_sync``: pytorch #143580).
The base model is unwrapped once (``raw``) for checkpoints; validation runs on every rank through
the compiled, unwrapped model with one all-reduce at the end (rank-0-only validation would leave
the other ranks blocked in their next collective, past the NCCL timeout on a long eval).

Ranks: everything global (the data split, who writes, the checkpoint's per-rank states) follows
the global rank ``RANK``; the local rank only picks the GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import os
import platform
import random
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function

from loaders.device import DevicePrefetcher
from shardcache import config as S
from shardcache.changes import changes_line
from shards.cache import Cache

from . import checkpoint as C
from . import dist as D
from . import lora as L
from .config import TrainConfig
from .data import batch_stream, count_tokens, make_loaders, n_samples, open_cache, to_device, total_steps
from .metrics import GradNormWarning, Metrics, StepStats, check_nonfinite, peak_memory_mb
from .models import count_params, run_contract
from .optim import (clip_grads_, grad_norms, is_fused, make_optimizer, make_scheduler, restore_scheduler,
                    skipping_step, step_scheduler, trainable_groups)
from .precision import Precision
from .profiling import StepProfiler
from .spec import ModelSpec, model_spec

log = logging.getLogger("train")

#: written to RUN_DIR by global rank 0 after a stop request (JSON: step, reason, exit_code). torchrun
#: reports any failing worker as exit status 1, so a job script under torchrun cannot see the
#: requeue exit code; it checks for this file instead (see scripts/slurm/train.sbatch).
REQUEUE_MARKER = "REQUEUE"


@dataclass
class Callbacks:
    """Hooks for tests and extensions (all optional, called on every rank).

    ``on_setup(trainer)``: once the model is wrapped and the run resumed (a :class:`Trainer`:
    ``model`` as trained, ``raw``, ``optimizer``, ``scheduler``, ``loader``, ``info``, ``state``).
    ``on_micro_step(step, micro)``: after each backward (``step``: optimizer steps done before it).
    ``on_step(step, record)``: after each optimizer step (``record``: the metrics record on log
    steps, else None). An exception in a hook fails the run like any other (exit 1 on every rank).
    """

    on_setup: Callable[["Trainer"], None] | None = None
    on_micro_step: Callable[[int, int], None] | None = None
    on_step: Callable[[int, dict | None], None] | None = None


@dataclass
class TrainState:
    """The loop's own counters (stateful: saved in every checkpoint)."""

    step: int = 0           #: optimizer steps done
    epoch: int = 0          #: the loader's epoch
    skipped_steps: int = 0  #: non-finite steps skipped so far (as of the last checkpoint or log step)

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.epoch = int(sd["step"]), int(sd.get("epoch", 0))
        self.skipped_steps = int(sd.get("skipped_steps", 0))


# ---- building the model ------------------------------------------------------------------------------

def run_lora(cfg: TrainConfig) -> dict | None:
    """The run's ``lora`` section as LoRA options (:func:`train.lora.options`), None when off."""
    lo = cfg.lora
    return L.options(lo.r, lo.alpha, lo.dropout, lo.targets) if lo.enabled else None


def check_model(cfg: TrainConfig, cache: Cache, spec: ModelSpec | None = None,
                resume_from: str | Path | None = None) -> list[tuple[str, Any, Any]]:
    """What a run checks before any weight loads: the model's contract (:func:`train.models.run_contract`)
    against ``cache`` and the adapters it will load (``model.init_from``, ``resume_from``) against the LoRA
    options the model will carry (:func:`train.checkpoint.check_adapter`). Returns the contract items the
    run accepts unmet (``--model.allow_other_encoder_weights``: encoder outputs of other weights).
    Raises :class:`shards.ContractMismatch` (exit 2 at the command line)."""
    m = cfg.model
    spec = spec or model_spec(m.name)
    contract = run_contract(m.name, m.kwargs, m.audio_tokenizer, m.contract, spec, m.audio_tokenizer_revision)
    waived = cache.require(contract, allow_other_weights=m.allow_other_encoder_weights)
    lora = spec.lora_options(dict(m.kwargs), run_lora(cfg))
    for path, what in ((m.init_from, "--model.init_from"), (resume_from, "--checkpoint.resume")):
        if path and C.is_adapter(path):
            C.check_adapter(path, lora, what)
    return waived


def prepare_model(cfg: TrainConfig, cache: Cache, device: torch.device, spec: ModelSpec | None = None,
                  checked: bool = False) -> nn.Module:
    """The model as configured for ``cache`` (an opened :class:`shards.Cache`), before compile/DDP,
    on ``device``: unless ``checked``, :func:`check_model` first (raises :class:`shards.ContractMismatch`
    before any weight loads), seeded init (``data.seed``: the same on every rank), ``model.init_from``
    (full weights before LoRA, an adapter after it), LoRA, activation checkpointing, each as the model's
    spec (``spec``, default the spec of ``model.name``) declares. Used by the trainer and by
    :mod:`train.batch_size`."""
    m = cfg.model
    spec = spec or model_spec(m.name)
    if not checked:
        check_model(cfg, cache, spec)
    torch.manual_seed(cfg.data.seed)
    raw = spec.build(cache, dict(m.kwargs), m.latent_loss, m.latent_loss_weight)
    adapter_init = bool(m.init_from) and C.is_adapter(m.init_from)
    if m.init_from and not adapter_init:
        C.load_weights(raw, m.init_from)
    lora = spec.lora_options(dict(m.kwargs), run_lora(cfg))
    if cfg.lora.enabled:
        raw = spec.apply_lora(raw, lora)
    if adapter_init:
        C.load_adapter(raw, m.init_from, lora)
    if m.activation_checkpointing and not spec.activation_checkpointing(raw, True):
        log.warning("--model.activation_checkpointing: %s declares no activation checkpointing; ignored", spec.name)
    return raw.to(device)


def adapter_info(cfg: TrainConfig, raw: nn.Module, spec: ModelSpec | None = None) -> dict | None:
    """With LoRA: what an adapter checkpoint records about its base (id, weights fingerprint) and the
    LoRA options (``lora``: r, alpha, dropout, targets) it is loaded with only."""
    if not cfg.lora.enabled:
        return None
    m = cfg.model
    spec = spec or model_spec(m.name)
    checkpoint = spec.default_checkpoint
    base = str(m.kwargs.get("lm", checkpoint)) if checkpoint else \
        f"{m.name} {json.dumps(m.kwargs, sort_keys=True)} seed {cfg.data.seed}"
    if m.init_from and not C.is_adapter(m.init_from):
        base += f" + {m.init_from}"
    lora = spec.lora_options(dict(m.kwargs), run_lora(cfg))
    return {"format": 1, "model": m.name, "base": base, "base_fingerprint": C.base_fingerprint(raw),
            "lora": {k: list(v) if isinstance(v, tuple) else v for k, v in dict(lora).items()}}


def wrap_ddp(model: nn.Module, info: D.DistInfo, cfg: TrainConfig) -> DDP:
    """DDP without per-forward buffer broadcast, with bucket-view gradients, static_graph off.

    torch >= 2.13 renames ``broadcast_buffers`` to ``forward_sync_buffers`` (and warns on the old
    name); both mean "no buffer broadcast in forward" here, whichever this torch has.
    """
    kw: dict[str, Any] = dict(gradient_as_bucket_view=True, static_graph=False,
                              find_unused_parameters=cfg.dist.find_unused_parameters,
                              bucket_cap_mb=cfg.dist.bucket_cap_mb)
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        kw["forward_sync_buffers"] = False
    else:
        kw["broadcast_buffers"] = False
    return DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None, **kw)


def eval_due(step: int, steps: int, every: int, ckpt_every: int, stagger: bool = True) -> bool:
    """Whether to validate after optimizer step ``step`` (1-based) of ``steps``: at multiples of
    ``every`` (0: ``ckpt_every``) and at the last step. With ``stagger`` a multiple that is a
    checkpoint step (a multiple of ``ckpt_every``) moves to the next step, so validation and a
    checkpoint never share a step (TheWorld staggered them to avoid its eval OOM); the exceptions
    are the last step and ``ckpt_every`` 1 (every step a checkpoint), where the trainer writes the
    checkpoint first. E.g. every 500, ckpt_every 1000: 500, 1001, 1500, 2001, ..."""
    every = every or ckpt_every
    if step == steps:
        return True
    if not stagger or ckpt_every == 1:
        return step % every == 0
    moved = step > 1 and (step - 1) % every == 0 and (step - 1) % ckpt_every == 0
    return step % ckpt_every != 0 and (step % every == 0 or moved)


def split_output(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A model's output -> (loss, other 0-dim float tensors to log)."""
    if isinstance(out, torch.Tensor):
        return out, {}
    if isinstance(out, dict) and "loss" in out:
        return out["loss"], {k: v.detach() for k, v in out.items()
                             if k != "loss" and isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()}
    raise TypeError("the model must return a loss tensor or a dict with 'loss'")


def setup_logging(info: D.DistInfo) -> None:
    """The ``train`` logger: timestamps and the global rank; INFO on rank 0, WARNING elsewhere, where
    records logged with ``extra={"once": True}`` (a finding equal on every rank) are dropped."""
    if log.handlers:
        return
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter(f"%(asctime)s [rank {info.rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    if not info.is_main:
        h.addFilter(lambda record: not record.__dict__.get("once", False))
    log.addHandler(h)
    log.setLevel(logging.INFO if info.is_main else logging.WARNING)
    log.propagate = False


def system_info(info: D.DistInfo, precision: str, fused: bool) -> str:
    parts = [f"host={socket.gethostname()}", f"python={platform.python_version()}",
             f"torch={torch.__version__}", f"world={info.world_size}", f"backend={info.backend or '-'}",
             f"device={info.device}", f"threads={torch.get_num_threads()}", f"cpus={os.cpu_count()}",
             f"fused_adamw={fused}", f"precision={precision}"]
    if info.device.type == "cuda":
        parts += [f"gpu={torch.cuda.get_device_name(info.device)}", f"cuda={torch.version.cuda}",
                  f"nccl={'.'.join(map(str, torch.cuda.nccl.version()))}"]
    return " ".join(parts)


# ---- the trainer ---------------------------------------------------------------------------------------

class Trainer:
    """Everything one run owns (see the module docstring). Build it on every rank with the same
    config; :meth:`resume`, then :meth:`train_step` until ``state.step == steps``."""

    def __init__(self, cfg: TrainConfig, info: D.DistInfo, callbacks: Callbacks | None = None):
        setup_logging(info)
        if cfg.dist.threads:
            torch.set_num_threads(cfg.dist.threads)
        if not cfg.data.cache:
            raise ValueError("--data.cache is required (a directory made by `shardcache precompute`)")
        self.cfg, self.info, self.cb = cfg, info, callbacks or Callbacks()
        self.out = Path(cfg.job.dir)
        if info.is_main:
            D.log_env_set()
            log.info("%s", changes_line(cfg))  # the whole config: --print_config
        self.cache = open_cache(cfg, cfg.data.cache)  # manifest + index read once, for everything below
        self.cache_id = self.cache.id                  # recorded in every checkpoint
        self.precision = Precision.of(cfg.training.precision, info.device)
        self.spec = model_spec(cfg.model.name)        # what the model declares (train.spec)
        self.resume_from = C.resolve_resume(cfg.checkpoint.resume, self.out, info)   # decided before any weight loads
        #: contract items the cache does not meet that the run accepts (recorded in every checkpoint)
        self.waived = check_model(cfg, self.cache, self.spec, self.resume_from)
        if self.waived and info.is_main:
            log.warning("--model.allow_other_encoder_weights: training on encoder outputs of other weights than "
                        "the model's: %s", "; ".join(f"{i}: the cache has {c!r}, the model {w!r}" for i, c, w in self.waived))
        self.raw = prepare_model(cfg, self.cache, info.device, self.spec, checked=True)   # identical init on every rank
        self.loader, self.val_loader = make_loaders(cfg, info, self.raw, self.cache, self.spec)
        steps_per_epoch = len(self.loader) // cfg.training.grad_accum
        self.steps = total_steps(cfg, steps_per_epoch)
        self.optimizer = make_optimizer(self.raw, cfg, info.device, self.spec)
        self.scheduler = make_scheduler(self.optimizer, cfg, self.steps)
        self.checkpointer = C.Checkpointer(self.out, info, keep=cfg.checkpoint.keep, resume=cfg.checkpoint.resume,
                                           adapter=adapter_info(cfg, self.raw, self.spec),
                                           metadata=self.spec.checkpoint_metadata(self.raw))
        self.state = TrainState()
        # parallelism: compile, then DDP (the compiled, unwrapped model validates)
        self.eval_model: nn.Module = torch.compile(self.raw) if cfg.model.compile else self.raw
        self.model = wrap_ddp(self.eval_model, info, cfg) if info.distributed else self.eval_model
        self.params = [p for p in self.raw.parameters() if p.requires_grad]
        self.groups = trainable_groups(self.optimizer)  # (index, name, params): lr/<name>, grad_norm/<name>
        self.main_group = max(self.groups, key=lambda g: sum(p.numel() for p in g[2]))[0] if self.groups else 0
        self.stats = self._new_stats()
        self.grad_warn = GradNormWarning(cfg.optim.grad_norm_warn, cfg.optim.grad_clip, info.is_main)
        self.val_start = self.val_loader.state_dict() if self.val_loader is not None else None
        self.stop = D.StopRequest(info, cfg.job.stop_file or self.out / "STOP", cfg.job.stop_at_step)
        self.run_start_step = 0
        c = cfg.metrics
        self.metrics = Metrics(self.out, info.is_main, self.steps, c.tensorboard, c.progress, c.throughput_warn)
        self.profiler = StepProfiler.maybe(cfg.profile, info, self.out)
        # batches on the device, one ahead on CUDA; .state: the loader position of the batch last handed
        # out. The stream starts at the loader's position when first read (after resume(), if any).
        self.pos = {"epoch": 0}
        ahead = {"auto": None, "on": True, "off": False}[cfg.data.prefetch_to_device]
        self.data = DevicePrefetcher(batch_stream(self.loader, self.pos), info.device, convert=to_device,
                                     state=lambda: {"loader": self.loader.state_dict(), "epoch": self.pos["epoch"]},
                                     ahead=ahead)
        if info.is_main:
            n_train, n_total = count_params(self.raw)
            log.info("system: %s", system_info(info, self.precision.name, is_fused(self.optimizer)))
            log.info("model %s: %s trainable / %s parameters (%.2f %% trainable); data %s; %d optimizer steps "
                     "per epoch (global batch %d); %d steps%s", cfg.model.name, f"{n_train:,}", f"{n_total:,}",
                     100 * n_train / max(n_total, 1), self.cache, steps_per_epoch,
                     cfg.data.batch_size * info.world_size * cfg.training.grad_accum, self.steps,
                     f" = {cfg.training.epochs:g} epochs" if cfg.training.epochs > 0 else "")

    # ---- stateful parts -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Optimizer, LR scheduler, grad scaler and loop counters (the model's weights and each
        rank's loader position and RNG are added by :func:`train.checkpoint.save`)."""
        self.state.skipped_steps = int(self.stats.skipped.item())
        return {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.scheduler.state_dict(),
                "scaler": self.precision.state_dict(), "train_state": self.state.state_dict(),
                "cache_id": self.cache_id,
                # the loop counters at the top level too: train.checkpoint's RNG seeding and people read them
                "step": self.state.step, "epoch": self.state.epoch, "skipped_steps": self.state.skipped_steps}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """The inverse of :meth:`state_dict` plus this rank's ``loader`` position."""
        self.optimizer.load_state_dict(sd["optimizer"])
        self.state.load_state_dict(sd["train_state"])
        restore_scheduler(self.scheduler, sd.get("lr_scheduler"), self.state.step)
        self.precision.load_state_dict(sd.get("scaler"))
        self.loader.load_state_dict(sd["loader"])
        self.stats = self._new_stats(skipped=self.state.skipped_steps)

    def _new_stats(self, skipped: int = 0) -> StepStats:
        return StepStats(self.info.device, skipped=skipped, groups=tuple(name for _, name, _ in self.groups))

    def save(self) -> None:
        """Checkpoint ``step-N`` (collective); first stops the run if the non-finite limit was reached."""
        self.check_health()
        self.state.epoch = self.data.state["epoch"]
        config = S.to_dict(self.cfg)
        exported = self.spec.checkpoint_config(self.raw)
        if exported is not None:  # e.g. the higgs recipe's transformers config
            config["model_config"] = exported
        if self.waived:   # what the cache does not meet and the run accepted (--model.allow_other_encoder_weights)
            config["contract"] = {"waived": [{"item": i, "cache": c, "model": w} for i, c, w in self.waived]}
        self.checkpointer.save(self.state.step, model=self.raw, state=self.state_dict(),
                               loader_state=self.data.state["loader"], config=config)

    def resume(self) -> None:
        """Load ``checkpoint.resume`` (weights, optimizer, schedule, scaler, loader position, RNG), or
        seed this rank's RNGs for a fresh start. Loads state only: every component exists already."""
        path = self.resume_from
        if path is not None:
            self.load_state_dict(self.checkpointer.load(path, self.raw, check=self.check_cache))
            self.loader.set_epoch(self.state.epoch)  # the epoch batch_stream counts (nothing left if complete)
            if self.info.is_main:
                log.info("resumed from %s at step %d (epoch %d)", path, self.state.step, self.state.epoch)
        else:
            seed = self.cfg.data.seed + self.info.rank
            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)
            if self.cfg.checkpoint.resume == "auto" and self.info.is_main:
                log.info("--resume auto: no checkpoint in %s, starting fresh", self.out)
            elif self.info.is_main and self.checkpointer.existing():  # --checkpoint.resume fresh (train.preflight)
                old = self.checkpointer.existing()
                log.info("--checkpoint.resume fresh: removing the run's checkpoints %s in %s",
                         ", ".join(p.name for _, p in old), self.out)
                for _, p in old:
                    shutil.rmtree(p)
        self.run_start_step = self.state.step
        self.pos["epoch"] = self.state.epoch

    def check_cache(self, st: dict[str, Any], path: Path) -> None:
        """Refuse a checkpoint made on another cache (its ``cache_id`` differs from ours), naming both
        ids and caches, unless ``checkpoint.allow_other_cache``: then warn and let the loader continue
        by position (``cache_id`` removed from its state). A checkpoint that records no cache id is
        refused the same way."""
        theirs = st.get("cache_id")
        if theirs == self.cache_id:
            return
        was = ((st.get("config") or {}).get("data") or {}).get("cache", "?")
        what = (f"checkpoint {path} was trained on the cache {was} (cache id {theirs}); --data.cache "
                f"{self.cfg.data.cache} has cache id {self.cache_id}")
        if not self.cfg.checkpoint.allow_other_cache:
            raise ValueError(f"{what}: resuming would continue at a data position that means other samples. "
                             "Resume on the same cache, start a new run dir, or pass "
                             "--checkpoint.allow_other_cache to resume anyway")
        if self.info.is_main:
            log.warning("%s: resuming anyway (--checkpoint.allow_other_cache)", what)
        st["loader"] = {k: v for k, v in st["loader"].items() if k != "cache_id"}

    # ---- one optimizer step -----------------------------------------------------------------------------

    def forward_backward_step(self, batch: dict[str, Any], sync_grads: bool) -> tuple[torch.Tensor, dict]:
        """One micro-step on ``batch`` (on the device): forward under autocast and the (scaled)
        backward of ``loss / grad_accum``; without ``sync_grads`` both run under DDP's ``no_sync``
        (no all-reduce in forward or backward). Returns ``(loss, extras)`` (device tensors)."""
        accum = self.cfg.training.grad_accum
        sync = contextlib.nullcontext() if sync_grads or not self.info.distributed else self.model.no_sync()
        with sync:
            with record_function("forward"), self.precision.autocast():
                loss, extras = split_output(self.model(batch))
            with record_function("backward"):
                self.precision.backward(loss / accum)
        return loss, extras

    def train_step(self) -> None:
        """Micro-steps (:meth:`forward_backward_step`, gradients synchronised on the last only);
        unscale, clip, a step skipped on the device when the norm is not finite, the schedule; no
        host sync (see the module docstring)."""
        accum = self.cfg.training.grad_accum
        self.model.train()
        for micro in range(accum):
            with record_function("data_wait"):
                t0 = time.perf_counter()
                batch = next(self.data)  # on the device, compact fields widened (loaders.device.to_device)
                self.stats.data_wait += time.perf_counter() - t0
            loss, extras = self.forward_backward_step(batch, sync_grads=micro == accum - 1)
            self.stats.add_micro(loss, extras, count_tokens(batch), n_samples(batch))
            if self.cfg.metrics.debug and isinstance(batch.get("latents"), torch.Tensor):
                self.stats.add_latents(batch["latents"], batch.get("latents_mask"))
            if self.cb.on_micro_step:
                self.cb.on_micro_step(self.state.step, micro)
        with record_function("optimizer"):
            self.precision.unscale_(self.optimizer)
            clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
            group_norms = grad_norms([params for _, _, params in self.groups], self.info.device)
            norm = torch.linalg.vector_norm(group_norms)     # = clip_grad_norm_'s global pre-clip norm
            clip_grads_(self.params, clip, norm)
            nonfinite = ~torch.isfinite(norm)
            if self.precision.scaler is not None:              # skips overflowing (non-finite) steps itself
                self.precision.scaler.step(self.optimizer)
                self.precision.scaler.update()
            else:
                skipping_step(self.optimizer, nonfinite)
            self.optimizer.zero_grad(set_to_none=True)
            step_scheduler(self.scheduler)
        self.stats.add_step(norm, nonfinite, self.cfg.optim.grad_norm_warn, group_norms)
        self.state.step += 1

    # ---- what happens between steps --------------------------------------------------------------------

    def due(self, every: int) -> bool:
        """Whether the step just done is a multiple of ``every`` or the last one."""
        return self.state.step % every == 0 or self.state.step == self.steps

    def eval_due(self) -> bool:
        """Whether to validate after the step just done (:func:`eval_due`)."""
        c = self.cfg
        return eval_due(self.state.step, self.steps, c.eval.every, c.checkpoint.every, c.eval.stagger)

    def log_metrics(self) -> dict[str, Any]:
        """The metrics record of the steps since the last one (the only host sync of those steps),
        written on rank 0; then the grad-norm warning and the non-finite limit."""
        rec, health = self.stats.read(self.info)
        first = self.state.step - self.stats.steps + 1
        factor = self.scheduler.lr_lambdas[0](self.state.step - 1)  # the schedule of the record's last step
        lrs = {name: self.scheduler.base_lrs[i] * factor for i, name, _ in self.groups}
        self.state.skipped_steps = rec["skipped_steps"]
        main = self.scheduler.base_lrs[self.main_group] if self.groups else self.cfg.optim.lr
        rec = {"step": self.state.step, **rec, "lr": main * factor, **{f"lr/{k}": v for k, v in lrs.items()},
               "peak_mem_mb": peak_memory_mb(self.info.device), "epoch": self.data.state["epoch"]}
        self.metrics.log(rec)
        if self.cfg.metrics.debug:
            log.debug("step %d: %s", self.state.step, rec)
        self.grad_warn(first, self.state.step, rec["grad_norm_max"], health["over_warn"])
        self._check(health["streak"])
        self.stats.start_window()
        return rec

    def check_health(self) -> None:
        """Stop (:class:`train.metrics.NonFiniteError`) when the non-finite steps in a row reached
        ``training.nonfinite_limit`` (one host sync)."""
        self._check(self.stats.consecutive_nonfinite())

    def _check(self, streak: int) -> None:
        limit = self.cfg.training.nonfinite_limit
        if limit and self.state.step == self.steps:  # a run shorter than the limit that never had a finite step
            limit = min(limit, self.state.step - self.run_start_step)
        check_nonfinite(streak, limit, self.state.step)

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Mean validation loss over every rank's slice of the validation data (the same samples
        each time), one all-reduce at the end; logged as a ``split: val`` record."""
        model, was_training = self.eval_model, self.eval_model.training
        model.eval()
        self.val_loader.load_state_dict(self.val_start)
        sums = torch.zeros(2, dtype=torch.float64, device=self.info.device)
        for i, batch in enumerate(self.val_loader):
            if self.cfg.eval.batches and i >= self.cfg.eval.batches:
                break
            batch = to_device(batch, self.info.device)
            with self.precision.autocast():
                loss, _ = split_output(model(batch))
            n = n_samples(batch)
            sums[0] += loss.detach().double() * n
            sums[1] += n
        D.all_reduce_(sums, self.info)
        model.train(was_training)
        total, count = sums.tolist()
        rec = {"step": self.state.step, "split": "val", "val_loss": total / max(count, 1), "val_samples": int(count)}
        self.metrics.log(rec)
        if self.info.is_main:
            log.info("step %d: val_loss %.4f", self.state.step, rec["val_loss"])
        return rec

    def stop_requested(self) -> bool:
        """Whether every rank agrees to stop now. Single process: checked after every step. With a
        process group (one all-reduce and a host sync) only on log, eval and checkpoint steps, so a
        stop request is acted on within ``metrics.every`` steps."""
        c = self.cfg
        if self.info.distributed and not (self.due(c.metrics.every) or self.due(c.checkpoint.every)
                                          or self.eval_due()):
            return False
        return self.stop.agreed(self.state.step)

    def requeue(self) -> int:
        """After the stop checkpoint: rank 0 consumes the stop file and writes the requeue marker."""
        code = self.cfg.job.requeue_exit_code
        log.warning("stop requested (%s): checkpoint saved at step %d; exiting with %d for requeue",
                    self.stop.reason, self.state.step, code)
        if self.info.is_main:
            self.stop.clear_file()
            self.out.mkdir(parents=True, exist_ok=True)
            tmp = self.out / (REQUEUE_MARKER + ".tmp")
            tmp.write_text(json.dumps({"step": self.state.step, "reason": self.stop.reason, "exit_code": code}) + "\n")
            os.replace(tmp, self.out / REQUEUE_MARKER)
        return code

    @contextlib.contextmanager
    def running(self) -> Iterator["Trainer"]:
        """Stop requests (a stale stop file is from an earlier job: removed); metrics and profiler start
        at the run's first step; at the end the loaders' workers are closed and every rank meets at a
        barrier."""
        if self.info.is_main:
            if self.stop.stop_file.exists():
                log.warning("removing stale stop file %s", self.stop.stop_file)
                self.stop.clear_file()
            (self.out / REQUEUE_MARKER).unlink(missing_ok=True)
        D.barrier(self.info)
        self.stop.install()
        self.metrics.open(self.state.step)
        if self.profiler is not None:
            self.profiler.start(self.state.step)
        if self.cb.on_setup:
            self.cb.on_setup(self)
        try:
            yield self
        finally:
            if self.profiler is not None:
                self.profiler.stop()
            self.metrics.close()
            self.stop.uninstall()
            for ld in (self.loader, self.val_loader):
                if ld is not None:
                    ld.close()  # DataLoader workers
        D.barrier(self.info)  # (not after a failure: the peers may be gone; the CLI exits this rank at once)


# ---- the run -------------------------------------------------------------------------------------------

def train(cfg: TrainConfig, info: D.DistInfo, callbacks: Callbacks | None = None) -> int:
    """One run on this rank: 0 when ``steps`` are done, ``job.requeue_exit_code`` after a stop
    request (checkpoint saved). Raises on failure (:class:`train.metrics.NonFiniteError` when the
    loss stays non-finite)."""
    t = Trainer(cfg, info, callbacks)
    t.resume()
    code, last = 0, None
    with t.running():
        while t.state.step < t.steps:
            t.train_step()
            record = t.log_metrics() if t.due(cfg.metrics.every) else None
            last = record or last
            if t.cb.on_step:
                t.cb.on_step(t.state.step, record)
            stopping = t.stop_requested()
            saving = stopping or t.due(cfg.checkpoint.every)
            validating = t.val_loader is not None and t.eval_due()
            if validating and not (saving and cfg.eval.stagger):
                t.evaluate()
            if saving:
                t.save()
            if validating and saving and cfg.eval.stagger:  # the checkpoint is complete before the eval
                t.evaluate()
            if stopping and t.state.step < t.steps:  # (a stop at the last step is just the end)
                code = t.requeue()
                break
            if t.profiler is not None:
                t.profiler.step()
    if info.is_main:
        log.info("%s", run_summary(t, last, code))
    return code


def run_summary(t: Trainer, last: dict[str, Any] | None, code: int) -> str:
    """The end-of-run line: steps done (of the run's total, this run's share), the last logged loss,
    the newest checkpoint and where the metrics went."""
    ckpts = t.checkpointer.existing()
    loss = f"{last['loss']:.4g}" if last and last.get("loss") is not None else "not logged"
    where = f"checkpoints in {t.out} (newest {ckpts[-1][1].name})" if ckpts else f"no checkpoint in {t.out}"
    head = "done" if code == 0 else f"stopped for requeue (exit {code})"
    return (f"{head}: step {t.state.step} of {t.steps} ({t.state.step - t.run_start_step} this run), "
            f"last loss {loss}; {where}; metrics in {t.metrics.path}")


def run(cfg: TrainConfig, callbacks: Callbacks | None = None) -> int:
    """Join the process group from the torchrun environment (if any), :func:`train`, leave it.

    An exception propagates without teardown: the caller (``train.cli``) exits the process at once
    so that the peers fail fast instead of waiting in a collective.
    """
    info = D.init(cfg.dist.device, cfg.dist.backend, cfg.dist.pg_timeout_min)
    code = train(cfg, info, callbacks)
    D.teardown()
    return code
