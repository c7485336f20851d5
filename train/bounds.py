"""Bounds of the training options that reach a constructor, checked before any model loads.

:func:`problems` reports, as ``(option, message)`` pairs for :class:`shardcache.config.ConfigError`
(exit status 2):

* ``data.loader_kwargs``: its keys are the sections of the loader's settings (``order``, ``workers``,
  ``reads``: each field checked against the dataclass that declares it, :func:`loaders.settings.settings_problems`,
  those the trainer sets itself refused naming their option) and ``filters``, ``storage_options``,
  ``local_dir`` (:data:`train.data.LOADER_EXTRAS`); any other key is refused, naming what it takes;
* ``model.kwargs`` of the reference model outside :data:`REFERENCE_KWARGS` (unknown keys, values of
  the wrong type or out of range, ``d_model`` not a multiple of ``n_heads``);
* a ``data.batch_size`` larger than the samples each rank gets from the cache (``manifest.json``
  ``counts.samples`` over ``$WORLD_SIZE``): with whole batches only, such a run would have no step.

Recipes' own ``model.kwargs`` are checked by the recipe's declared contract (:mod:`train.recipes`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardcache.ranks import Ranks
from shards.schema import MANIFEST_FILE as MANIFEST

#: the loader's own arguments the trainer passes itself (not ``data.loader_kwargs``' to set) -> the option
TRAINER_ARGS = {"cache": "--data.cache", "batch_size": "--data.batch_size", "seed": "--data.seed",
                "fields": "--data.fields", "ranks": "the launcher", "transform": "the recipe"}
#: the reference model's ``model.kwargs``: name -> (type, lowest, highest); the cache gives the others
REFERENCE_KWARGS: dict[str, tuple[type, float, float]] = {
    "d_model": (int, 1, 65536), "n_layers": (int, 1, 1024), "n_heads": (int, 1, 1024), "mlp_ratio": (int, 1, 64),
    "dropout": (float, 0.0, 1.0), "patch_size": (int, 1, 64), "max_positions": (int, 1, 10**7),
    "n_codebooks": (int, 1, 1024), "codebook_size": (int, 1, 1 << 20), "vocab_size": (int, 1, 1 << 24),
    "latent_channels": (int, 1, 4096)}


def _loader_kwargs(loader: str, kwargs: dict[str, Any]) -> list[tuple[str, str]]:
    """``data.loader_kwargs`` against the loader's declared settings (every loader takes ShardLoader's
    arguments: :mod:`train.data`)."""
    from loaders.settings import SECTIONS, settings_problems
    from shardcache.plugins import load_factory

    from .data import LOADER_EXTRAS, TRAINER_SET
    try:
        load_factory(loader)
    except (ImportError, AttributeError, ValueError, TypeError) as e:
        return [("data.loader", f"cannot import {loader!r}: {e}")]
    takes = ", ".join([f"{k}: {{...}} (loaders.{c.__name__})" for k, c in SECTIONS.items()] + list(LOADER_EXTRAS))
    out = [(f"data.loader_kwargs.{k}", f"not a setting of {loader}" + (
        f" (the trainer sets it: {TRAINER_ARGS[k]})" if k in TRAINER_ARGS else f"; it takes: {takes}"))
        for k in kwargs if k not in SECTIONS and k not in LOADER_EXTRAS]
    return out + [(f"data.loader_kwargs.{k}", msg) for k, msg in settings_problems(kwargs, TRAINER_SET)]


def _reference_kwargs(kwargs: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for k, v in kwargs.items():
        if k not in REFERENCE_KWARGS:
            out.append((f"model.kwargs.{k}", f"not an option of the reference model; it takes: "
                                             f"{', '.join(REFERENCE_KWARGS)}"))
            continue
        tp, lo, hi = REFERENCE_KWARGS[k]
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (tp is float or isinstance(v, int))
        if not ok or not lo <= v <= hi:
            out.append((f"model.kwargs.{k}", f"expected {'an integer' if tp is int else 'a number'} between "
                                             f"{lo:g} and {hi:g}, got {v!r}"))
    d, h = kwargs.get("d_model", 256), kwargs.get("n_heads", 4)
    if not out and d % h:
        out.append(("model.kwargs.d_model", f"{d} is not a multiple of n_heads {h}"))
    return out


def _batch_vs_cache(cache: str, batch_size: int) -> list[tuple[str, str]]:
    try:
        samples = int(json.loads((Path(cache) / MANIFEST).read_text())["counts"]["samples"])
    except (OSError, ValueError, KeyError, TypeError):
        return []  # not a local cache with counts: the loader reports it
    try:
        world = Ranks.detect().world_size
    except ValueError as e:  # a partial launcher environment: the run itself refuses it, naming it
        return [("dist", str(e))]
    if batch_size * world > samples:
        return [("data.batch_size", f"{batch_size} per rank x {world} rank(s) is more than the {samples} samples "
                                    f"of {cache}: no whole batch; use at most {max(1, samples // world)}")]
    return []


def _contract(contract: dict[str, Any]) -> list[tuple[str, str]]:
    """``model.contract``: items :meth:`shards.cache.Contract.from_dict` knows."""
    from shards.cache import Contract
    try:
        Contract.from_dict("--model.contract", contract)
    except (ValueError, TypeError) as e:
        return [("model.contract", str(e))]
    return []


def problems(cfg: Any) -> list[tuple[str, str]]:
    """Every problem of ``cfg``'s options that reach the loader and model constructors (see the
    module docstring; and ``model.contract``'s items); reads at most ``manifest.json`` of the cache,
    loads no model."""
    out = _loader_kwargs(cfg.data.loader, cfg.data.loader_kwargs) + _contract(cfg.model.contract)
    if cfg.model.name == "reference":
        out += _reference_kwargs(cfg.model.kwargs)
    return out + _batch_vs_cache(cfg.data.cache, cfg.data.batch_size)
