"""The model of a run: its spec (:func:`train.spec.model_spec`), its contract against the cache, then the
model built.

A training model is any ``nn.Module`` whose ``forward(batch)`` takes the collated batch dict of
:class:`loaders.ShardLoader` and returns a scalar loss tensor or a dict with ``loss`` (other 0-dim
tensors in the dict are logged). ``--model.name`` names a recipe (:data:`train.recipes.RECIPES`:
``reference``, ``higgs``, ``tts``, ``vlm``, ``theworld``), a plug-in :class:`train.recipes.base.Recipe`
(``pkg.mod:Class``) or a plain factory (``pkg.mod:make``, called with ``--model.kwargs``); every one
has a :class:`train.spec.ModelSpec`.

The contract a run checks (:func:`run_contract`) is the spec's, with what the run's options add: the
audio tokenizer the model was trained with (``--model.audio_tokenizer``: its weights are the codec's)
and the items of ``--model.contract`` (a plain factory's whole contract). ``cache.require`` runs on it
before any weight loads; ``--model.allow_other_encoder_weights`` lets encoder outputs of other weights
train, the run recording every such item.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch.nn as nn

from shardcache.pretrained import resolve_pretrained
from shardcache.weights import weights_of
from shards.cache import Cache, Codec, Contract
from shards.errors import ShardcacheError
from shards.tokens import IGNORE_INDEX  # noqa: F401 (re-exported)

from . import lora as L
from .recipes.reference import ReferenceModel  # noqa: F401 (re-exported: the default model)
from .spec import ModelSpec, model_spec


class ContractUnknown(ShardcacheError):
    """The model's contract cannot be derived from its checkpoint (no config there, another architecture than
    the recipe needs): ``shardcache train`` exits 2 on it, naming the model and why, before any weight loads."""

    exit_code = 2


def run_contract(name: str, kwargs: Mapping[str, Any], audio_tokenizer: str = "",
                 contract: Mapping[str, Any] | None = None, spec: ModelSpec | None = None,
                 audio_tokenizer_revision: str = "") -> Contract:
    """The contract a run of ``--model.name name`` checks: the spec's contract for ``kwargs``, its codec's
    weights replaced by those of ``audio_tokenizer`` (``--model.audio_tokenizer``: a directory or hub id,
    at ``audio_tokenizer_revision``, ``--model.audio_tokenizer_revision``: default ``main``; the checkpoint
    the model's codes came from; it wins over what a recipe reads from its checkpoint's processor config),
    then ``contract`` (``--model.contract``) added where the spec says "any".
    Reads configs and checkpoint files, never the model's weights. Raises ``ValueError`` for a
    ``--model.contract`` that names unknown items or contradicts the spec,
    :class:`shardcache.weights.CheckpointUnreadable` for a checkpoint file (an audio tokenizer's, a VAE's, the
    vision tower's) that cannot be read, :class:`ContractUnknown` for a checkpoint the spec cannot derive its
    contract from (``OSError`` / ``ValueError`` of its ``contract``): ``shardcache train`` exits 2 on either."""
    spec = spec or model_spec(name)
    try:
        c = spec.contract(dict(kwargs))
    except (OSError, ValueError) as e:
        raise ContractUnknown(f"--model.name {name}: {e}") from e
    if audio_tokenizer_revision and not audio_tokenizer:
        raise ContractUnknown(f"--model.audio_tokenizer_revision {audio_tokenizer_revision!r} without "
                              "--model.audio_tokenizer: name the audio tokenizer (a hub id) whose revision it is")
    if audio_tokenizer:
        weights = weights_of(resolve_pretrained(audio_tokenizer, what="--model.audio_tokenizer"),
                             revision=audio_tokenizer_revision or None, what="--model.audio_tokenizer_revision")
        c = dataclasses.replace(c, codec=dataclasses.replace(c.codec or Codec(), weights=weights))
    if contract:
        c = c.merged(Contract.from_dict(c.model, contract))
    return c


def build_model(model: str, model_kwargs: Mapping[str, Any], cache: "Cache | str", latent_loss: str = "none",
                latent_loss_weight: float = 1.0, *, contract: Contract | None = None,
                allow_other_weights: bool = False) -> nn.Module:
    """The model ``model`` names for ``cache`` (a :class:`shards.Cache` or a path): ``contract`` (default:
    the spec's for ``model_kwargs``) checked against the cache first (``cache.require``: raises
    :class:`shards.ContractMismatch` before any weight loads), then the spec's ``build``."""
    spec = model_spec(model)
    cache = Cache.open(cache)
    cache.require(contract if contract is not None else spec.contract(dict(model_kwargs)),
                  allow_other_weights=allow_other_weights)
    return spec.build(cache, dict(model_kwargs), latent_loss, latent_loss_weight)


def apply_lora(model: nn.Module, r: int, alpha: int, dropout: float, targets: tuple, *, spec: ModelSpec,
               kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """LoRA adapters on ``model`` (built by ``spec`` with ``kwargs``) as the run's ``lora`` section asks:
    the spec's options for them (:meth:`train.recipes.base.Recipe.lora_options`: the default targets mean
    the recipe's own) applied by the spec (a recipe: adapters on its LM only, its media modules stay
    trainable; a plain factory: peft on ``targets``)."""
    return spec.apply_lora(model, spec.lora_options(dict(kwargs or {}), L.options(r, alpha, dropout, targets)))


def count_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return train, total


__all__ = ["ContractUnknown", "ReferenceModel", "run_contract", "build_model", "apply_lora", "count_params", "model_spec"]
