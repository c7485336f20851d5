"""What the trainer reads: loaders over the cache, the held-out validation split, batches on the device.

Fields: ``data.fields: auto`` reads the fields the recipe declares that the cache holds
(:func:`resolve_fields`).

A loader (``data.loader``, default ``loaders:ShardLoader``; a plug-in ``module:class``) takes
``ShardLoader``'s arguments: the cache (a :class:`shards.Cache`), ``batch_size``, ``seed``, ``fields``,
``filters``, ``ranks`` (:class:`shardcache.ranks.Ranks`), ``order`` / ``workers`` / ``reads``
(:class:`loaders.Order`, :class:`loaders.Workers`, :class:`loaders.Reads`: the trainer sets
``workers.num_workers`` from ``data.num_workers``, ``reads.compact`` from ``data.compact_batches``,
``reads.skip_corrupt`` from ``data.skip_corrupt`` and ``order.drop_remainder``; ``data.loader_kwargs``
sets the others, as ``{order: {...}, workers: {...}, reads: {...}}``, beside ``filters`` and a remote
cache's ``storage_options`` / ``local_dir``) and ``transform``; it has ``set_epoch``,
``state_dict``/``load_state_dict``, ``__len__`` and ``close``. Validation data: ``--data.val_cache``, else the keys of ``--data.cache``
held out by ``--data.val_fraction`` (:class:`HeldOut`: ``sha256(key)`` mapped to [0, 1), kept out
of the training loader and read by the validation loader through the loader's ``filters=``).

Batches stay compact on the host (the cache's dtypes: ``data.compact_batches``) and are widened
on the device by :func:`loaders.device.to_device` (each field by its kind), without a host sync.
"""
from __future__ import annotations

import hashlib
import logging
import math
import warnings
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn

from loaders.device import to_device  # noqa: F401 (the trainer's batch move)
from loaders.settings import Order, Reads, Workers, build
from shardcache.plugins import load_factory
from shardcache.ranks import Ranks
from shards import fields as registry
from shards.cache import Cache, Contract
from shards.filters import RowFilter, filter_rows
from shards.mirror import default_local_dir
from shards.storage import is_url

from . import dist as D
from .config import TrainConfig
from .spec import ModelSpec, model_spec

log = logging.getLogger("train")

#: caches smaller than this hold nothing out (there is nothing to spare; use --data.val_cache)
MIN_SAMPLES_TO_HOLD_OUT = 20


# ---- batches on the device ---------------------------------------------------------------------------

def count_tokens(batch: dict[str, Any]) -> torch.Tensor | int:
    """Tokens of a batch for throughput: the sum over its fields of what each field's kind counts
    (:meth:`shards.kinds.FieldKind.count_tokens`: real text tokens, real codec frames); a 0-dim
    tensor (no host sync), 0 when the batch holds none."""
    n: torch.Tensor | int = 0
    for k in batch:
        f = registry.lookup(k)
        if f is not None:
            n = n + f.kind.count_tokens(f, batch)
    return n


def n_samples(batch: dict[str, Any]) -> int:
    """Samples in a batch: ``len(keys)``, else the first dimension of its first tensor."""
    if "keys" in batch:
        return len(batch["keys"])
    return next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))


def batch_stream(loader: Any, pos: dict[str, int]) -> Iterator[dict]:
    """Batches forever; at the end of an epoch, ``pos['epoch'] += 1`` and ``loader.set_epoch``.
    Raises RuntimeError when two epochs in a row yield nothing."""
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


# ---- fields --------------------------------------------------------------------------------------------

#: the keys of ``data.loader_kwargs`` that are not sections of the loader's settings: they reach the
#: loader's ``filters`` and :meth:`shards.Cache.open` (a remote cache)
LOADER_EXTRAS = ("filters", "storage_options", "local_dir")
#: the loader settings the trainer sets itself -> the option that sets them
TRAINER_SET = {"workers.num_workers": "--data.num_workers", "reads.compact": "--data.compact_batches",
               "reads.skip_corrupt": "--data.skip_corrupt",
               "order.drop_remainder": "nothing (training drops the remainder, validation reads every sample)"}


def open_cache(cfg: TrainConfig, cache: "str | Cache") -> Cache:
    """``cache`` opened once (:class:`shards.Cache`; a URL with ``data.loader_kwargs``' ``storage_options``,
    mirrored into ``local_dir``, default this rank's folder: :func:`shards.mirror.default_local_dir`)."""
    if isinstance(cache, Cache):
        return cache
    kw = cfg.data.loader_kwargs
    local_dir = kw.get("local_dir") or (default_local_dir(str(cache), Ranks.detect().global_rank)
                                        if is_url(cache) else None)
    return Cache.open(cache, kw.get("storage_options"), local_dir)


def resolve_fields(cfg: TrainConfig, spec: ModelSpec | None = None, cache: "Cache | None" = None
                   ) -> tuple[str, ...] | None:
    """``data.fields`` -> the loader's ``fields``: a tuple, or None = every field the cache holds.
    ``auto``: the fields the model reads (its spec's ``fields`` and ``optional_fields``, then those a
    ``--model.contract`` adds; ``spec`` default: the spec of ``model.name``), less those no sample of
    ``cache`` holds (a model may declare fields that only some caches have, e.g. ``input_ids`` and
    ``latents``; if it holds none of them, all are asked for, and the loader names them); None when the
    model declares none (a plain factory without ``--model.contract``)."""
    fields = tuple(cfg.data.fields)
    if fields == ("all",):
        return None
    if fields != ("auto",):
        return fields
    spec = spec or model_spec(cfg.model.name)
    declared = spec.read_fields
    if cfg.model.contract:
        declared += tuple(f for f in Contract.from_dict(spec.name, cfg.model.contract).read_fields if f not in declared)
    if not declared:
        return None
    held = cache.fields if cache is not None else None
    return tuple(f for f in declared if held is None or f in held) or declared


# ---- held-out validation split -------------------------------------------------------------------------

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


class HeldOut(RowFilter):
    """A loader ``filters=`` callable on the index's columns: the held-out keys (``part='val'``) or the
    others (``part='train'``), ANDed with ``base`` (the ``loader_kwargs`` filters, if any).
    The split is taken over the whole index; after a call, ``n_total`` / ``n_held`` say its size.
    It reads the ``key`` column (and those ``base`` reads: :attr:`columns`)."""

    def __init__(self, fraction: float, part: str, base: Any = None):
        self.fraction, self.part, self.base = float(fraction), part, base
        self.n_total = self.n_held = 0

    @property
    def columns(self) -> tuple[str, ...]:
        from shards.filters import columns_of
        return tuple(dict.fromkeys(("key",) + columns_of(self.base)))

    def __call__(self, table) -> np.ndarray:
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


# ---- loaders -------------------------------------------------------------------------------------------

def num_workers(setting: int | str, device: torch.device) -> int | None:
    """``data.num_workers`` -> the loader's ``num_workers``: a count as given; ``auto``: None on
    CUDA (the loader's own rule, ``loaders.loader.default_num_workers``), 0 on CPU."""
    if setting != "auto":
        return int(setting)
    return None if device.type == "cuda" else 0


def make_loader(cfg: TrainConfig, cache: "Cache | str", batch_size: int, info: D.DistInfo, *, model: Any = None,
                spec: ModelSpec | None = None, held_out: HeldOut | None = None, drop_remainder: bool = True) -> Any:
    """The loader of ``data.loader`` over ``cache`` (a :class:`shards.Cache`, or a path opened here)
    for global rank ``info.rank`` of ``info.world_size`` with :func:`resolve_fields` (``spec``: the model's,
    default the spec of ``model.name``) and the built ``model``'s batch transform (its spec's
    ``batch_transform``; none without ``model``); ``held_out``
    filters the rows (ANDed with ``loader_kwargs.filters``). ``fields`` is None (the loader's default)
    when it resolves to every field. Every loader takes these arguments (module docstring)."""
    cache = open_cache(cfg, cache)
    cls = load_factory(cfg.data.loader)
    d, given = cfg.data, cfg.data.loader_kwargs
    order = build("order", given.get("order") or {}, Order(drop_remainder=drop_remainder))
    workers = build("workers", given.get("workers") or {}, Workers(num_workers=num_workers(d.num_workers, info.device)))
    reads = build("reads", given.get("reads") or {}, Reads(compact=bool(d.compact_batches),  # widened by to_device
                                                           skip_corrupt=d.skip_corrupt))
    spec = spec or model_spec(cfg.model.name)
    filters = given.get("filters")
    if held_out is not None:
        held_out.base, filters = filters, held_out
    transform = spec.batch_transform(model) if model is not None else None  # the model's own batch layout,
    return cls(cache, batch_size, seed=d.seed, fields=resolve_fields(cfg, spec, cache), filters=filters,  # built in
               ranks=Ranks.detect(global_rank=info.rank, world_size=info.world_size), order=order,  # the workers
               workers=workers, reads=reads, transform=transform)


def make_loaders(cfg: TrainConfig, info: D.DistInfo, model: nn.Module, cache: "Cache | None" = None,
                 spec: ModelSpec | None = None) -> tuple[Any, Any | None]:
    """The training loader over ``cache`` (default: ``data.cache`` opened) and the validation loader
    (None: no validation), at epoch 0.

    Validation data: ``data.val_cache``; else the keys of ``data.cache`` that :func:`held_out_mask`
    holds out (excluded from training). Nothing is held out with ``eval.enabled: false`` or
    ``data.val_fraction: 0`` and for caches under :data:`MIN_SAMPLES_TO_HOLD_OUT` samples; then
    validation runs on the training cache only when ``eval.every`` asks for it, else not at all.
    """
    d, ev = cfg.data, cfg.eval
    cache = open_cache(cfg, cache if cache is not None else d.cache)
    eval_bs = ev.batch_size or d.batch_size
    spec = spec or model_spec(cfg.model.name)
    fields, declared = resolve_fields(cfg, spec, cache), resolve_fields(cfg, spec)
    if info.is_main:
        log.info("fields: %s", list(fields) if fields is not None else "every field the cache holds")
        missed = [] if fields is None else [f for f in declared or () if f not in fields]
        if missed:
            log.warning("%s declares fields %s; %s holds no %s: not read", spec.name,
                        list(declared), d.cache, missed)
    hold = ev.enabled and not d.val_cache and d.val_fraction > 0
    train_split = HeldOut(d.val_fraction, "train") if hold else None
    loader = make_loader(cfg, cache, d.batch_size, info, model=model, spec=spec, held_out=train_split)
    val_loader = None
    if ev.enabled and d.val_cache:
        val_loader = make_loader(cfg, d.val_cache, eval_bs, info, model=model, spec=spec, drop_remainder=False)
    elif train_split is not None and train_split.n_held:
        if info.is_main:
            log.info("validation: %d of %d samples of %s held out of training (val_fraction %g, by sha256 "
                     "of the key)", train_split.n_held, train_split.n_total, d.cache, d.val_fraction)
        val_loader = make_loader(cfg, cache, eval_bs, info, model=model, spec=spec, drop_remainder=False,
                                 held_out=HeldOut(d.val_fraction, "val"))
    elif ev.enabled and d.val_fraction > 0:
        why = f"the cache has fewer than {MIN_SAMPLES_TO_HOLD_OUT} samples"
        if info.is_main:
            log.warning("validation: nothing held out (%s)%s", why, ": validating on the training cache"
                        if ev.every else " and no --data.val_cache: no validation")
        if ev.every:
            val_loader = make_loader(cfg, cache, eval_bs, info, model=model, spec=spec)
    loader.set_epoch(0)
    if val_loader is not None:
        val_loader.set_epoch(0)
    return loader, val_loader


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """``training.steps``, or with ``training.epochs E > 0``: ``ceil(E x steps_per_epoch)``."""
    t = cfg.training
    if t.epochs <= 0:
        return t.steps
    if steps_per_epoch < 1:
        raise ValueError(f"--training.epochs {t.epochs}: an epoch has no optimizer step (fewer loader batches "
                         f"than --training.grad_accum {t.grad_accum})")
    return math.ceil(round(t.epochs * steps_per_epoch, 6))
