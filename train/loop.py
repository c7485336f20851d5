"""The training loop, top to bottom (after nanoGPT's train.py; config, parallelism, checkpointing
and metrics live in their own modules, after torchtitan).

One optimizer step::

    lr = schedule(step)                       # warmup + cosine/linear, a pure function of the step
    for micro in range(grad_accum):
        batch = next(data)                    # time spent here is the step's data wait
        with model.no_sync() unless last:     # covers forward AND backward: no all-reduce
            with autocast: out = model(batch)  # bf16 on CUDA (CPU only with --precision bf16)
            (out.loss / grad_accum).backward()  # last micro-step: DDP all-reduces the buckets
    norm = clip_grad_norm_(params)            # non-finite: skip the step (count it, log it)
    optimizer.step(); optimizer.zero_grad(set_to_none=True)
    log / validate / checkpoint / stop check  # the stop check is one all-reduce: all ranks agree

DDP: ``broadcast_buffers=False`` (``forward_sync_buffers=False`` on torch >= 2.13; buffers are
constant here, and a rank-local eval through the wrapper would otherwise broadcast),
``gradient_as_bucket_view=True``, ``static_graph`` off (it
breaks ``no_sync``: pytorch #143580). The base model is unwrapped once (``raw``) and used for
checkpoints and validation.

Validation data: ``--val-cache``, else the keys of ``--cache`` held out by ``--val-fraction``
(:class:`HeldOut`: ``sha256(key)`` mapped to [0, 1), kept out of the training loader and read by the
validation loader through the loader's ``filters=``). Validation runs every ``--eval-every`` steps
(default: at each checkpoint) and at the end, on every rank over a disjoint slice of the
validation data (the loader splits it like the training data), through the unwrapped model, with no collective inside the batch loop; the
sums (loss x samples, samples) are all-reduced once at the end. Rank-0-only validation would leave
the other ranks blocked in their next collective (past the NCCL timeout on a long eval) and idle
(W-1)/W of the GPUs; a single all-reduce after the loop cannot hang even if ranks had unequal
batch counts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import platform
import random
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from loaders.collate import AUDIO_SCALE

from . import checkpoint as C
from . import dist as D
from .config import TrainConfig
from .metrics import Metrics, peak_memory_mb
from .models import (ReferenceModel, apply_lora, build_model, count_params, data_spec, load_factory,
                     set_activation_checkpointing)

log = logging.getLogger("train")


@dataclass
class Callbacks:
    """Hooks for tests and extensions (all optional, called on every rank).

    ``on_setup(ctx)``: after the DDP wrap; ``ctx`` has model (as trained, possibly DDP), raw,
    optimizer, loader, info, start_step. ``on_micro_step(step, micro)``: after each backward.
    ``on_step(step, record)``: after each optimizer step (``record`` is the metrics record, or
    None on steps that are not logged).
    """

    on_setup: Callable[[dict], None] | None = None
    on_micro_step: Callable[[int, int], None] | None = None
    on_step: Callable[[int, dict | None], None] | None = None


# ---- pieces of the step ----------------------------------------------------------------------------

def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then cosine/linear/constant
    decay from ``lr`` to ``min_lr`` at ``steps``."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    coeff = 0.5 * (1.0 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1.0 - frac
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


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


def param_groups(raw: nn.Module, cfg: TrainConfig) -> list[dict]:
    """The model's ``optimizer_groups(lr, weight_decay)`` if it has one (a group may carry its own
    ``lr``), else weight decay on matrices/embeddings (dim >= 2), none on biases and norms. Every
    group gets ``base_lr`` (its lr before the schedule: :func:`set_lr` scales it). Raises
    ValueError when the hook's groups repeat a parameter or leave a trainable one out."""
    hook = getattr(raw, "optimizer_groups", None)
    if callable(hook):
        groups = [dict(g, params=list(g["params"])) for g in hook(cfg.lr, cfg.weight_decay)]
        ids = [id(p) for g in groups for p in g["params"]]
        missing = [n for n, p in raw.named_parameters() if p.requires_grad and id(p) not in set(ids)]
        if len(ids) != len(set(ids)) or missing:
            raise ValueError(f"{type(raw).__name__}.optimizer_groups: every trainable parameter must be in "
                             f"exactly one group (repeated: {len(ids) - len(set(ids))}, missing: {missing[:5]})")
    else:
        params = [p for p in raw.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    for g in groups:
        g["base_lr"] = float(g.setdefault("lr", cfg.lr))
    return groups


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: TrainConfig) -> float:
    """Every group's lr = its ``base_lr`` x the schedule's factor ``lr_at(step) / lr``; returns
    ``lr_at(step)`` (the lr of a group at the run's ``--lr``)."""
    lr = lr_at(step, cfg)
    for g in optimizer.param_groups:
        base = g.setdefault("base_lr", cfg.lr)
        g["lr"] = lr if base == cfg.lr else (base * lr / cfg.lr if cfg.lr else 0.0)
    return lr


def make_optimizer(raw: nn.Module, cfg: TrainConfig, device: torch.device) -> tuple[torch.optim.Optimizer, bool]:
    """AdamW over :func:`param_groups`; fused if possible."""
    groups = param_groups(raw, cfg)
    fused = cfg.fused == "on" or (cfg.fused == "auto" and fused_adamw_supported(device))
    kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if fused:
        return torch.optim.AdamW(groups, fused=True, **kw), True
    return torch.optim.AdamW(groups, foreach=device.type == "cuda" or None, **kw), False


def autocast_context(cfg: TrainConfig, device: torch.device) -> Callable[[], Any]:
    """bf16 autocast on CUDA unless --precision fp32; on CPU only with --precision bf16."""
    on = (device.type == "cuda" and cfg.precision in ("auto", "bf16")) or \
         (device.type == "cpu" and cfg.precision == "bf16")
    if on:
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Move a batch to ``device``; compact fields become float32 there (int16 audio scaled to [-1, 1],
    float16 latents widened, both exact), so the host never does the conversion."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, non_blocking=True)
            if v.dtype == torch.float16:
                v = v.float()
            elif k == "audio" and v.dtype == torch.int16:
                v = v.float() * float(AUDIO_SCALE)
        out[k] = v
    return out


def split_output(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A model's output -> (loss, other 0-dim tensors to log)."""
    if isinstance(out, torch.Tensor):
        return out, {}
    if isinstance(out, dict) and "loss" in out:
        return out["loss"], {k: v.detach() for k, v in out.items()
                             if k != "loss" and isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()}
    raise TypeError("the model must return a loss tensor or a dict with 'loss'")


def count_tokens(batch: dict[str, Any]) -> torch.Tensor | int:
    """Valid text tokens (``attention_mask``, or ``text_mask`` of older caches) + audio frames
    (``codes_mask``, or the codes that are not padding) of a batch, whichever it holds (a tensor:
    no host sync; 0 when it holds none)."""
    n: torch.Tensor | int = 0
    for mask in ("attention_mask", "text_mask", "codes_mask"):
        if mask in batch:
            n = n + batch[mask].sum()
    if "codes_mask" not in batch and "codes" in batch:
        n = n + batch["codes"][:, 0].ne(-100).sum()
    return n


def n_samples(batch: dict[str, Any]) -> int:
    """Samples in a batch: ``len(keys)``, else the first dimension of its first tensor."""
    if "keys" in batch:
        return len(batch["keys"])
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))


def batch_stream(loader: Any, pos: dict[str, int]) -> Iterator[dict]:
    """Batches forever; at the end of an epoch, ``pos['epoch'] += 1`` and ``loader.set_epoch``."""
    empty = 0
    while True:
        n = 0
        with warnings.catch_warnings():  # resuming from a checkpoint taken at the end of an epoch
            warnings.filterwarnings("ignore", message=".*already complete.*")
            it = iter(loader)
        for batch in it:
            n += 1
            yield batch
        empty = empty + 1 if n == 0 else 0
        if empty >= 2:
            raise RuntimeError("the loader yields no batches: the cache has fewer samples than one "
                               "global batch (batch_size x world size)")
        pos["epoch"] += 1
        loader.set_epoch(pos["epoch"])


def prepare_model(cfg: TrainConfig, spec: Any, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, bool]:
    """The model as configured, before compile/DDP: seeded init (``cfg.seed``: the same on every
    rank), ``--init-from`` weights, LoRA, activation checkpointing, on ``device``; and its AdamW
    (with whether it is fused). Used by the training loop and by :mod:`train.batch_size`."""
    torch.manual_seed(cfg.seed)
    raw = build_model(cfg.model, cfg.model_kwargs, spec, cfg.latent_loss, cfg.latent_loss_weight)
    if cfg.init_from:
        C.load_weights(raw, cfg.init_from)
    if cfg.lora:
        raw = apply_lora(raw, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, tuple(cfg.lora_targets))
    if cfg.activation_checkpointing and not set_activation_checkpointing(raw):
        log.warning("--activation-checkpointing: %s has no set_activation_checkpointing(); ignored",
                    type(raw).__name__)
    raw.to(device)
    optimizer, fused = make_optimizer(raw, cfg, device)
    return raw, optimizer, fused


def wrap_ddp(model: nn.Module, info: D.DistInfo, cfg: TrainConfig) -> DDP:
    """DDP without per-forward buffer broadcast, with bucket-view gradients, static_graph off.

    torch >= 2.13 renames ``broadcast_buffers`` to ``forward_sync_buffers`` (and warns on the old
    name); both mean "no buffer broadcast in forward" here, whichever this torch has.
    """
    kw: dict[str, Any] = dict(gradient_as_bucket_view=True, static_graph=False,
                              find_unused_parameters=cfg.find_unused_parameters,
                              bucket_cap_mb=cfg.bucket_cap_mb)
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        kw["forward_sync_buffers"] = False
    else:
        kw["broadcast_buffers"] = False
    return DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None, **kw)


def model_class(name: str) -> Any:
    """The class (or factory) ``--model name`` builds, without building it."""
    from .recipes import RECIPES, recipe_class
    return ReferenceModel if name == "reference" else recipe_class(name) if name in RECIPES else load_factory(name)


def cache_fields(cache: str) -> tuple[str, ...] | None:
    """The fields some sample of ``cache`` holds (None when its index cannot be read)."""
    try:
        from shards.index import INDEX_FILE
        return _cache_fields(str(cache), (Path(cache) / INDEX_FILE).stat().st_mtime_ns)
    except Exception:  # noqa: BLE001 - the loader reports a bad cache
        return None


@functools.lru_cache(maxsize=16)
def _cache_fields(cache: str, mtime_ns: int) -> tuple[str, ...]:
    """(read once per index version: the train and validation loaders and the log all ask)"""
    from loaders.dataset import cache_fields as fields_of
    from shards import read_index
    return fields_of(read_index(Path(cache)))


def resolve_fields(cfg: TrainConfig, model: Any = None, cache: str | None = None) -> tuple[str, ...] | None:
    """``--fields`` -> the loader's ``fields``: a tuple, or None = every field the cache holds.
    ``auto``: the ``fields`` attribute of ``model`` (default: of the class ``--model`` builds), less
    those no sample of ``cache`` holds (a model may declare fields that only some caches have, e.g.
    ``input_ids`` and ``text_ids``; if it holds none of them, all are asked for, and the loader names
    them); None when it declares none."""
    fields = tuple(cfg.fields)
    if fields == ("all",):
        return None
    if fields != ("auto",):
        return fields
    declared = getattr(model if model is not None else model_class(cfg.model), "fields", None)
    if not declared:
        return None
    held = cache_fields(cache) if cache else None
    return tuple(f for f in declared if held is None or f in held) or tuple(declared)


def _accepts(cls: Any, name: str) -> bool:
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


#: caches smaller than this hold nothing out (there is nothing to spare; use --val-cache)
MIN_SAMPLES_TO_HOLD_OUT = 20


def key_uniform(keys: list[str]) -> np.ndarray:
    """Each key -> a float in [0, 1): the first 8 bytes of ``sha256(key)`` / 2**64 (stable everywhere)."""
    return np.array([int.from_bytes(hashlib.sha256(k.encode()).digest()[:8], "big") for k in keys],
                    dtype=np.float64) / 2.0**64


def held_out_mask(keys: list[str], fraction: float) -> np.ndarray:
    """The keys held out for validation: ``key_uniform(key) < fraction``, so a key's membership is
    its own (the same for any run, seed, world size or added rows); when that selects none of a
    cache of >= :data:`MIN_SAMPLES_TO_HOLD_OUT` keys, the key with the smallest value. Below that
    size nothing is held out."""
    u = key_uniform(keys)
    if fraction <= 0 or len(keys) < MIN_SAMPLES_TO_HOLD_OUT:
        return np.zeros(len(keys), dtype=bool)
    mask = u < fraction
    if not mask.any():
        mask[int(np.argmin(u))] = True
    return mask


class HeldOut:
    """A loader ``filters=`` callable on the index table: the held-out keys (``part='val'``) or the
    others (``part='train'``), ANDed with ``base`` (the ``loader_kwargs`` filters, if any).
    The split is taken over the whole index; after a call, ``n_total`` / ``n_held`` say its size."""

    def __init__(self, fraction: float, part: str, base: Any = None):
        self.fraction, self.part, self.base = float(fraction), part, base
        self.n_total = self.n_held = 0

    def __call__(self, table) -> np.ndarray:
        from loaders.order import filter_rows
        held = held_out_mask(table.column("key").to_pylist(), self.fraction)
        self.n_total, self.n_held = len(held), int(held.sum())
        mask = held if self.part == "val" else ~held
        if self.base is not None:
            keep = np.zeros(len(held), dtype=bool)
            keep[filter_rows(table, self.base)] = True
            mask &= keep
        return mask

    def __repr__(self) -> str:
        return f"HeldOut({self.fraction}, {self.part!r}, base={self.base!r})"


def make_loader(cfg: TrainConfig, cache: str, batch_size: int, info: D.DistInfo, *, model: Any = None,
                held_out: HeldOut | None = None, drop_remainder: bool | None = None) -> Any:
    """The loader of ``--loader`` over ``cache`` with :func:`resolve_fields` (``model``: the built
    model, else the class of ``--model``); ``held_out`` and ``drop_remainder`` go to loaders that take
    ``filters=`` / ``drop_remainder=``. ``fields`` is left to the loader's default when it resolves
    to every field (ShardLoader: every field the cache holds)."""
    cls = load_factory(cfg.loader)
    kwargs = dict(cfg.loader_kwargs)
    if cfg.compact_batches and "compact" not in kwargs and "compact" in inspect.signature(cls).parameters:
        kwargs["compact"] = True  # converted on the device by to_device
    fields = resolve_fields(cfg, model, cache)
    if fields is not None:
        kwargs["fields"] = fields
    if held_out is not None:
        held_out.base = kwargs.get("filters")
        kwargs["filters"] = held_out
    if drop_remainder is not None and _accepts(cls, "drop_remainder"):
        kwargs["drop_remainder"] = drop_remainder
    return cls(cache, batch_size=batch_size, global_rank=info.rank, world_size=info.world_size,
               seed=cfg.seed, num_workers=cfg.num_workers, **kwargs)


def make_loaders(cfg: TrainConfig, info: D.DistInfo, model: nn.Module) -> tuple[Any, Any | None]:
    """The training loader and the validation loader (None: no validation), at epoch 0.

    Validation data: ``--val-cache``; else the keys of ``--cache`` that :func:`held_out_mask` holds
    out (excluded from training). Nothing is held out with ``--no-validation`` or
    ``--val-fraction 0``, for caches under :data:`MIN_SAMPLES_TO_HOLD_OUT` samples and with a loader
    that takes no ``filters=``; in the last two cases validation runs on the training cache only
    when ``--eval-every N`` asks for it (as before held-out splits), else not at all.
    """
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    fields, declared = resolve_fields(cfg, model, cfg.cache), resolve_fields(cfg, model)
    if info.is_main:
        log.info("fields: %s", list(fields) if fields is not None else "every field the cache holds")
        if declared and fields != declared:
            log.warning("%s declares fields %s; %s holds no %s: not read", type(model).__name__,
                        list(declared), cfg.cache, [f for f in declared if f not in (fields or ())])
    cls = load_factory(cfg.loader)
    hold = (cfg.validation and not cfg.val_cache and cfg.val_fraction > 0 and _accepts(cls, "filters"))
    train_split = HeldOut(cfg.val_fraction, "train") if hold else None
    loader = make_loader(cfg, cfg.cache, cfg.batch_size, info, model=model, held_out=train_split)
    val_loader = None
    if cfg.validation and cfg.val_cache:
        val_loader = make_loader(cfg, cfg.val_cache, eval_bs, info, model=model, drop_remainder=False)
    elif train_split is not None and train_split.n_held:
        if info.is_main:
            log.info("validation: %d of %d samples of %s held out of training (val_fraction %g, by sha256 "
                     "of the key)", train_split.n_held, train_split.n_total, cfg.cache, cfg.val_fraction)
        val_loader = make_loader(cfg, cfg.cache, eval_bs, info, model=model, drop_remainder=False,
                                 held_out=HeldOut(cfg.val_fraction, "val"))
    elif cfg.validation and cfg.val_fraction > 0:
        why = (f"the cache has fewer than {MIN_SAMPLES_TO_HOLD_OUT} samples" if train_split is not None
               else f"{cfg.loader} takes no filters=")
        if cfg.eval_every and info.is_main:
            log.warning("validation: nothing held out (%s): validating on the training cache", why)
        elif info.is_main:
            log.warning("validation: nothing held out (%s) and no --val-cache: no validation", why)
        if cfg.eval_every:
            val_loader = make_loader(cfg, cfg.cache, eval_bs, info, model=model)
    loader.set_epoch(0)
    if val_loader is not None:
        val_loader.set_epoch(0)
    return loader, val_loader


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """``--steps``, or with ``--epochs E > 0``: ``ceil(E x steps_per_epoch)``."""
    if cfg.epochs <= 0:
        return cfg.steps
    if steps_per_epoch < 1:
        raise ValueError(f"--epochs {cfg.epochs}: an epoch has no optimizer step (fewer loader batches than "
                         f"--grad-accum {cfg.grad_accum})")
    return math.ceil(round(cfg.epochs * steps_per_epoch, 6))


def check_audio_tokenizer(cfg: TrainConfig) -> None:
    """``--audio-tokenizer``: log it and warn when the cache's codes were made by another one (the
    precompute config in ``manifest.json``); it is never loaded."""
    if not cfg.audio_tokenizer:
        return
    from shards import read_manifest
    try:
        manifest = read_manifest(cfg.cache)
    except Exception:  # noqa: BLE001 - the loader reports an unreadable cache
        manifest = {}
    made = (manifest.get("config") or {}).get("audio_tokenizer")
    pre = made.get("pretrained") if isinstance(made, dict) else None
    if manifest and "n_codebooks" not in manifest:
        log.warning("--audio-tokenizer %s: the cache %s holds no codes (made without an audio tokenizer)",
                    cfg.audio_tokenizer, cfg.cache)
    elif pre is None:
        log.info("--audio-tokenizer %s: the cache's manifest.json does not name its audio tokenizer; the "
                 "cached codes are used as they are", cfg.audio_tokenizer)
    elif str(pre).rstrip("/") == str(cfg.audio_tokenizer).rstrip("/") or \
            Path(pre).resolve() == Path(cfg.audio_tokenizer).resolve():
        log.info("--audio-tokenizer %s: the cache's codes were made with it", cfg.audio_tokenizer)
    else:
        log.warning("--audio-tokenizer %s differs from the audio tokenizer the cache's codes were made with "
                    "(%s, manifest.json config.audio_tokenizer.pretrained); training uses the cached codes",
                    cfg.audio_tokenizer, pre)


class GradNormWatch:
    """Warn (global rank 0) when the pre-clip grad norm exceeds ``--grad-norm-warn``: the first 3
    times, then every 100th (a loss summed over tokens instead of averaged, a too-high lr or bad
    data show up as norms in the thousands where 1-100 is expected)."""

    def __init__(self, cfg: TrainConfig, info: D.DistInfo):
        self.limit, self.clip, self.active, self.count = cfg.grad_norm_warn, cfg.grad_clip, info.is_main, 0

    def __call__(self, step: int, norm: float) -> None:
        if not (self.active and self.limit and norm > self.limit):  # NaN > x is False
            return
        self.count += 1
        if self.count <= 3 or self.count % 100 == 0:
            log.warning("step %d: grad norm %.4g > grad_norm_warn %g (%d time(s) so far%s); expected O(1-100): "
                        "check the loss normalisation (mean, not sum, over tokens), the lr and the data",
                        step, norm, self.limit, self.count, f"; clipped to {self.clip:g}" if self.clip > 0 else "")


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, start: dict, cfg: TrainConfig, info: D.DistInfo,
             amp) -> dict[str, float]:
    """Mean validation loss over every rank's slice (see the module docstring)."""
    was_training = model.training
    model.eval()
    loader.load_state_dict(start)  # the same samples every time: rewind to where it started
    sums = torch.zeros(2, dtype=torch.float64, device=info.device)
    for i, batch in enumerate(loader):
        if cfg.eval_batches and i >= cfg.eval_batches:
            break
        batch = to_device(batch, info.device)
        with amp():
            loss, _ = split_output(model(batch))
        n = n_samples(batch)
        sums[0] += loss.detach().double() * n
        sums[1] += n
    D.all_reduce_(sums, info)
    model.train(was_training)
    return {"val_loss": (sums[0] / sums[1].clamp_min(1)).item(), "val_samples": int(sums[1].item())}


def system_info(info: D.DistInfo, cfg: TrainConfig, fused: bool) -> str:
    parts = [f"host={socket.gethostname()}", f"python={platform.python_version()}",
             f"torch={torch.__version__}", f"world={info.world_size}", f"backend={info.backend or '-'}",
             f"device={info.device}", f"threads={torch.get_num_threads()}", f"cpus={os.cpu_count()}",
             f"fused_adamw={fused}", f"precision={cfg.precision}"]
    if info.device.type == "cuda":
        parts += [f"gpu={torch.cuda.get_device_name(info.device)}", f"cuda={torch.version.cuda}",
                  f"nccl={'.'.join(map(str, torch.cuda.nccl.version()))}",
                  f"alloc_conf={os.environ.get('PYTORCH_ALLOC_CONF')}"]
    return " ".join(parts)


def setup_logging(info: D.DistInfo) -> None:
    if log.handlers:
        return
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter(f"%(asctime)s [rank {info.rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    log.addHandler(h)
    log.setLevel(logging.INFO if info.is_main else logging.WARNING)
    log.propagate = False


#: written to OUT by global rank 0 after a stop request (JSON: step, reason, exit_code). torchrun
#: reports any failing worker as exit status 1, so a job script under torchrun cannot see the
#: requeue exit code; it checks for this file instead (see scripts/slurm/train.sbatch).
REQUEUE_MARKER = "REQUEUE"


def write_requeue_marker(out: Path, step: int, reason: str, code: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (REQUEUE_MARKER + ".tmp")
    tmp.write_text(json.dumps({"step": step, "reason": reason, "exit_code": code}) + "\n")
    os.replace(tmp, out / REQUEUE_MARKER)


def make_profiler(cfg: TrainConfig, info: D.DistInfo, out: Path):
    """torch.profiler over the first wait+warmup+active steps (global rank 0 only)."""
    if not (cfg.profile and info.is_main):
        return None
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    sort = "cuda_time_total" if info.device.type == "cuda" else "cpu_time_total"

    def on_ready(p) -> None:
        (out / "profile").mkdir(parents=True, exist_ok=True)
        path = out / "profile" / f"trace-rank{info.rank}-step{p.step_num}.json"
        p.export_chrome_trace(str(path))
        log.info("profiler trace: %s\n%s", path, p.key_averages().table(sort_by=sort, row_limit=15))

    prof = profile(activities=acts, schedule=schedule(wait=cfg.profile_wait, warmup=cfg.profile_warmup,
                                                       active=cfg.profile_active, repeat=1),
                   on_trace_ready=on_ready)
    prof.start()
    return prof


# ---- the run ---------------------------------------------------------------------------------------

def run(cfg: TrainConfig, callbacks: Callbacks | None = None) -> int:
    """Train according to ``cfg``; returns 0 when done, ``cfg.requeue_exit_code`` after a stop.

    Joins the process group from the torchrun environment (if any) and leaves it on return. An
    exception propagates without teardown: the caller (``train.cli``) exits the process at once so
    that the peers fail fast instead of waiting in a collective.
    """
    info = D.init(cfg.device, cfg.backend, cfg.pg_timeout_min)
    code = train(cfg, info, callbacks or Callbacks())
    D.teardown()
    return code


def train(cfg: TrainConfig, info: D.DistInfo, cb: Callbacks) -> int:
    setup_logging(info)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if not cfg.cache:
        raise ValueError("--cache is required (a directory made by `python -m precompute`)")
    out = Path(cfg.out)
    amp = autocast_context(cfg, info.device)
    accum = cfg.grad_accum
    if info.is_main:
        log.info("effective config:\n%s", cfg.dump())

    # ---- model: identical init on every rank (same seed), then the rank's own RNG stream ----
    spec = data_spec(cfg.cache)
    raw, optimizer, fused = prepare_model(cfg, spec, info.device)
    n_train, n_total = count_params(raw)

    # ---- data: the fields the model declares; validation keys held out (see make_loaders) ----
    loader, val_loader = make_loaders(cfg, info, raw)
    steps_per_epoch = len(loader) // accum
    cfg = dataclasses.replace(cfg, steps=total_steps(cfg, steps_per_epoch))
    if info.is_main:
        check_audio_tokenizer(cfg)
        log.info("system: %s", system_info(info, cfg, fused))
        log.info("model %s: %s trainable / %s parameters (%.2f %% trainable); data %s; %d optimizer steps "
                 "per epoch (global batch %d); %d steps%s", cfg.model, f"{n_train:,}", f"{n_total:,}",
                 100 * n_train / max(n_total, 1), spec, steps_per_epoch, cfg.batch_size * info.world_size * accum,
                 cfg.steps, f" = {cfg.epochs:g} epochs" if cfg.epochs > 0 else "")

    # ---- resume (weights, optimizer, loader position, RNG) or fresh start ----
    step, skipped = 0, 0
    pos = {"epoch": 0}
    ckpt = C.resolve_resume(cfg.resume, out)
    if ckpt is not None:
        st = C.load(ckpt, model=raw, optimizer=optimizer, loader=loader, info=info)
        step, skipped, pos["epoch"] = int(st["step"]), int(st.get("skipped_steps", 0)), int(st.get("epoch", 0))
        if info.is_main:
            log.info("resumed from %s at step %d (epoch %d)", ckpt, step, pos["epoch"])
    else:
        torch.manual_seed(cfg.seed + info.rank)
        np.random.seed((cfg.seed + info.rank) % 2**32)
        random.seed(cfg.seed + info.rank)
        if cfg.resume == "auto" and info.is_main:
            log.info("--resume auto: no checkpoint in %s, starting fresh", out)
        elif info.is_main and C.list_checkpoints(out):
            log.warning("%s already holds checkpoints and --resume is not set: starting fresh; they "
                        "will be replaced or pruned (use --resume auto to continue)", out)

    # ---- parallelism: compile, then DDP ----
    model: nn.Module = torch.compile(raw) if cfg.compile else raw
    eval_model = model
    if info.distributed:
        model = wrap_ddp(model, info, cfg)
    params = [p for p in raw.parameters() if p.requires_grad]

    # ---- stop requests: a stale stop file is from an earlier job (consumed here, before a barrier) ----
    stop = D.StopRequest(info, cfg.stop_file or out / "STOP", cfg.stop_at_step)
    if info.is_main:
        if stop.stop_file.exists():
            log.warning("removing stale stop file %s", stop.stop_file)
            stop.clear_file()
        (out / REQUEUE_MARKER).unlink(missing_ok=True)
    D.barrier(info)
    stop.install()

    metrics = Metrics(out, info.is_main, cfg.steps, step, cfg.tensorboard, cfg.progress, cfg.throughput_warn)
    val_start = val_loader.state_dict() if val_loader is not None else None
    grad_watch = GradNormWatch(cfg, info)
    cb.on_setup and cb.on_setup(dict(model=model, raw=raw, optimizer=optimizer, loader=loader, info=info,
                                     start_step=step))
    prof = make_profiler(cfg, info, out)
    data = batch_stream(loader, pos)
    code = 0
    try:
        while step < cfg.steps:
            if step == cfg.fail_at_step and info.rank == cfg.fail_rank:
                raise RuntimeError(f"--fail-at-step {step} on rank {info.rank} (testing hook)")
            t_start = time.perf_counter()
            wait = 0.0
            lr = set_lr(optimizer, step, cfg)
            loss_sum = torch.zeros((), device=info.device)
            extra_sum: dict[str, torch.Tensor] = {}
            tokens = torch.zeros((), dtype=torch.long, device=info.device)
            n_seen = 0
            model.train()

            for micro in range(accum):
                t0 = time.perf_counter()
                batch = to_device(next(data), info.device)
                wait += time.perf_counter() - t0
                last = micro == accum - 1
                sync = contextlib.nullcontext() if last or not info.distributed else model.no_sync()
                with sync:                                  # no all-reduce in forward or backward
                    with amp():
                        loss, extras = split_output(model(batch))
                    (loss / accum).backward()
                loss_sum += loss.detach()
                for k, v in extras.items():
                    extra_sum[k] = extra_sum.get(k, 0) + v
                tokens += count_tokens(batch)
                n_seen += n_samples(batch)
                cb.on_micro_step and cb.on_micro_step(step, micro)

            norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            finite = bool(torch.isfinite(norm).item())
            grad_watch(step + 1, float(norm))
            if finite:
                optimizer.step()
            else:
                skipped += 1
                log.warning("step %d: non-finite grad norm %s; optimizer step skipped (%d so far)",
                            step + 1, norm.item(), skipped)
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if prof is not None:
                prof.step()

            rec = None
            if step % cfg.log_every == 0 or step == cfg.steps:
                names = sorted(extra_sum)
                stats = torch.stack([t.float() for t in [loss_sum / accum, tokens]
                                     + [extra_sum[k] / accum for k in names]])
                D.all_reduce_(stats, info)
                vals = stats.tolist()
                dt = time.perf_counter() - t_start
                rec = {"step": step, "loss": vals[0] / info.world_size, "lr": lr,
                       "grad_norm": float(norm.item()),
                       "samples_per_s": n_seen * info.world_size / dt,
                       "tokens_per_s": vals[1] / dt, "data_wait": wait / dt, "step_time_s": dt,
                       "peak_mem_mb": peak_memory_mb(info.device), "skipped_steps": skipped,
                       "epoch": pos["epoch"]}
                rec.update({k: v / info.world_size for k, v in zip(names, vals[2:])})
                metrics.log(rec)
            cb.on_step and cb.on_step(step, rec)

            if val_loader is not None and (step % (cfg.eval_every or cfg.ckpt_every) == 0 or step == cfg.steps):
                vrec = {"step": step, "split": "val",
                        **evaluate(eval_model, val_loader, val_start, cfg, info, amp)}
                metrics.log(vrec)
                if info.is_main:
                    log.info("step %d: val_loss %.4f", step, vrec["val_loss"])

            stopping = stop.agreed(step)
            if stopping or step % cfg.ckpt_every == 0 or step == cfg.steps:
                C.save(out, step, model=raw, optimizer=optimizer, loader=loader, info=info,
                       config=cfg.to_dict(), keep=cfg.keep,
                       extra={"epoch": pos["epoch"], "skipped_steps": skipped,
                              "schedule": {"kind": cfg.schedule, "lr": cfg.lr, "min_lr": cfg.min_lr,
                                           "warmup_steps": cfg.warmup_steps, "steps": cfg.steps,
                                           "epochs": cfg.epochs}})
            if stopping and step < cfg.steps:  # (a stop at the last step is just the end)
                log.warning("stop requested (%s): checkpoint saved at step %d; exiting with %d for requeue",
                            stop.reason, step, cfg.requeue_exit_code)
                if info.is_main:
                    stop.clear_file()
                    write_requeue_marker(out, step, stop.reason, cfg.requeue_exit_code)
                code = cfg.requeue_exit_code
                break
    finally:
        if prof is not None:
            prof.stop()
        metrics.close()
        stop.uninstall()
    for ld in (loader, val_loader):
        close = getattr(ld, "close", None)
        if close is not None:
            close()  # DataLoader workers
    D.barrier(info)
    return code
