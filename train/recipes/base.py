"""The recipe base class: what a model declares so that the trainer never probes it.

A recipe is an ``nn.Module`` subclass of :class:`Recipe` that declares (and :func:`train.spec.recipe_spec`
turns into its :class:`train.spec.ModelSpec`):

* :attr:`Recipe.contract_items` (which contract items it checks and where the model's value comes from:
  the contract table of docs/training.md is generated from them) and :meth:`Recipe.contract` (a
  classmethod, cheap: configs, tokenizer files and the encoders' checkpoint tensors, never the model's
  weights): what it needs from a cache (:class:`shards.cache.Contract`: fields, special tokens and pad id,
  the codec with its weights, the text tokenizer's fingerprint, template and label policy, the image
  preset, the feature encoder with its weights). ``cache.require(contract)`` refuses a mismatch before
  any weight loads, naming every item, the cache's value and the model's value.
* :meth:`Recipe.from_cache`: the model built from an opened :class:`shards.Cache` and ``model.kwargs``
  (the cache's sizes and token ids, ``model.kwargs`` winning).
* :attr:`Recipe.default_checkpoint` (the checkpoint ``model.kwargs.lm`` defaults to; None for a model
  trained from scratch), :attr:`Recipe.lora_targets` (module-name suffixes LoRA adapts by default),
  :meth:`Recipe.enable_lora`, :meth:`Recipe.optimizer_groups` (None: the trainer's decay/no-decay
  groups), :meth:`Recipe.set_activation_checkpointing`, :attr:`Recipe.batch_transform` (a loader
  transform that builds the model's batch layout in the loader's workers, or None), how to export
  (:meth:`Recipe.checkpoint_config`: a ``transformers`` config stored with each checkpoint, or None)
  and what its checkpoints record about its own heads (:meth:`Recipe.checkpoint_metadata`).

A new recipe is one module with a :class:`Recipe` subclass plus its entry in
:data:`train.recipes.RECIPES` (or ``--model.name pkg.mod:Class`` for a plug-in recipe).
"""
from __future__ import annotations

import logging
from typing import Any, ClassVar, Iterable, Mapping

import torch.nn as nn

from shardcache import pretrained as P
from shards import tokens
from shards.cache import Cache, Contract

from .. import lora as L
from ..config import LoraConfig
from ..imports import blocked_imports


def cache_values(cache: Cache) -> dict[str, Any]:
    """The cache's sizes and token ids under the keyword names the recipes take (absent ones left out):
    ``n_codebooks``, ``codebook_size``, ``vocab_size``, ``pad_id``, ``latent_channels`` and the ids of
    the placeholders and markers (``audio_in_token_id`` ``<|AUDIO|>``, ``audio_out_token_id``
    ``<|AUDIO_OUT|>``, ``audio_out_bos_token_id``, ``audio_eos_token_id``, ``audio_bos_token_id``,
    ``eot_token_id``, ``eom_token_id``, ``image_token_id`` (``text.placeholders.image``, else
    ``<image>``), ``image_soft_token_id`` (Gemma 3's), ``world_start_token_id`` / ``world_end_token_id``
    (``text.world_tokens``))."""
    codec = cache.codec
    world = cache.world_tokens or (None, None)
    ids = {"audio_in_token_id": tokens.AUDIO_IN, "audio_out_token_id": tokens.AUDIO_OUT,
           "audio_out_bos_token_id": tokens.AUDIO_OUT_BOS, "audio_eos_token_id": tokens.AUDIO_EOS,
           "audio_bos_token_id": tokens.AUDIO_BOS, "eot_token_id": tokens.EOT, "eom_token_id": tokens.EOM,
           "image_token_id": cache.image_placeholder or tokens.IMAGE,
           "image_soft_token_id": tokens.GEMMA_IMAGE_SOFT,
           "world_start_token_id": world[0], "world_end_token_id": world[1]}
    out = {"n_codebooks": codec.n_codebooks if codec else None, "codebook_size": codec.codebook_size if codec else None,
           "vocab_size": cache.vocab_size, "pad_id": cache.pad_id, "latent_channels": cache.latent_channels}
    out |= {k: cache.token_id(t) if t else None for k, t in ids.items()}
    return {k: v for k, v in out.items() if v is not None}


def load_tokenizer(checkpoint: Any, added: Iterable[str] = (), what: str = "model_kwargs.lm",
                   revision: str | None = None):
    """:func:`shardcache.pretrained.load_tokenizer` without PIL or soundfile (:func:`train.imports.blocked_imports`)."""
    with blocked_imports():
        return P.load_tokenizer(checkpoint, added, what, revision=revision)


def text_tokenizer(checkpoint: Any, named: Any = None, added: Iterable[str] = (), *,
                   kwargs: Mapping[str, Any] | None = None) -> tuple[Any, Any, Any]:
    """``(tokenizer, fingerprint, template)`` of the text tokenizer a recipe's checkpoint was trained with
    (:func:`shardcache.pretrained.tokenizer_identity`: ``named``, ``model.kwargs.tokenizer`` at
    ``model.kwargs.tokenizer_revision``, else the one ``checkpoint`` ships at ``model.kwargs.revision``,
    both read from ``kwargs``; never "any"), without PIL or soundfile."""
    kw = kwargs or {}
    with blocked_imports():
        return P.tokenizer_identity(checkpoint, named, added, revision=kw.get("revision"),
                                    named_revision=kw.get("tokenizer_revision"))


token_ids, tokenizer_pad_id = P.token_ids, P.tokenizer_pad_id


def build_from(cls: type, cache: Cache, kwargs: Mapping[str, Any], names: Iterable[str]) -> Any:
    """``cls(**values, **kwargs)``: the :func:`cache_values` named in ``names`` (those the cache has),
    ``kwargs`` (``model.kwargs``) winning."""
    values = cache_values(cache)
    return cls(**{**{n: values[n] for n in names if n in values}, **kwargs})


class Recipe(nn.Module):
    """Base of every model ``--model`` names (see the module docstring)."""

    #: the fields the model reads (the cache must hold each: its contract's ``fields``)
    fields: ClassVar[tuple[str, ...]] = ()
    #: fields it reads where the cache holds them
    optional_fields: ClassVar[tuple[str, ...]] = ()
    #: the checkpoint ``model.kwargs.lm`` defaults to (None: built from scratch)
    default_checkpoint: ClassVar[str | None] = None
    #: module-name suffixes the generic LoRA adapts (:meth:`enable_lora`)
    lora_targets: ClassVar[tuple[str, ...]] = ()
    #: the LoRA options applied by the recipe itself (:meth:`enable_lora` of LM recipes), recorded
    #: with adapter checkpoints; None: the run's ``lora`` section
    lora: dict | None = None
    #: a loader ``transform`` (the model's own batch layout, built in the loader's workers), or None
    batch_transform: Any = None
    #: the contract items it checks -> where the model's value comes from (the generated contract table
    #: of docs/training.md); :meth:`contract` sets only these (:meth:`contract_of`)
    contract_items: ClassVar[dict[str, str]] = {}

    @classmethod
    def contract_of(cls, model: str, values: Mapping[str, Any], reads: tuple[str, ...] | None = None) -> Contract:
        """The contract with :attr:`fields` / :attr:`optional_fields` and ``values`` (``{item: value}``, named
        as :meth:`shards.cache.Contract.items` names them; ``None``: any), for a model whose batch ``reads``
        those fields (default: :attr:`fields` and :attr:`optional_fields`): only the items of fields it reads
        are compared (:data:`shards.cache.ITEM_FIELDS`). Raises ``ValueError`` for an item
        :attr:`contract_items` does not declare (the docs would not show it)."""
        bad = [k for k in values if k not in cls.contract_items]
        if bad:
            raise ValueError(f"{cls.__name__}.contract sets items it does not declare in contract_items: {bad}")
        return Contract.from_items(model, values, fields=cls.fields, optional_fields=cls.optional_fields,
                                   reads=tuple(cls.fields) + tuple(cls.optional_fields) if reads is None else reads)

    @classmethod
    def lora_options(cls, kwargs: Mapping[str, Any], run: dict | None) -> dict | None:
        """The LoRA options (:func:`train.lora.options`) the model built with ``kwargs`` carries after the
        run's ``lora`` section ``run`` (None: off) is applied: ``run``, whose default targets (the
        ``--lora.targets`` default) mean :attr:`lora_targets`. Known before any weight loads."""
        if run is None:
            return None
        targets = run["targets"]
        return L.options(run["r"], run["alpha"], run["dropout"],
                         tuple(cls.lora_targets) if tuple(targets) == tuple(LoraConfig().targets) else targets)

    @classmethod
    def contract(cls, kwargs: Mapping[str, Any]) -> Contract:
        """What the model built with ``kwargs`` (``model.kwargs``) needs from a cache. Reads configs
        only (never weights). Raises ``ValueError``/``OSError`` for a checkpoint it cannot use."""
        raise NotImplementedError(f"{cls.__name__} declares no contract")

    @classmethod
    def from_cache(cls, cache: Cache, kwargs: Mapping[str, Any], *, latent_loss: str = "none",
                   latent_loss_weight: float = 1.0) -> "Recipe":
        """The model for ``cache`` (its sizes and token ids) with ``kwargs`` (``model.kwargs``, which
        win). ``latent_loss``/``latent_loss_weight``: ``--model.latent_loss`` (recipes without a
        latent loss refuse anything but ``none``)."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a cache")

    @classmethod
    def no_latent_loss(cls, latent_loss: str) -> None:
        """Warn that ``--model.latent_loss`` is ignored by a recipe that has none."""
        if latent_loss != "none":
            logging.getLogger("train").warning("--model.latent_loss %s is ignored by %s", latent_loss, cls.__name__)

    # -- training hooks, declared (the trainer calls them on every recipe) ------------------------------
    def enable_lora(self, r: int, alpha: int, dropout: float, targets: Iterable[str] | None = None) -> None:
        """peft LoRA adapters on ``targets`` (default :attr:`lora_targets`); every other weight
        freezes. Raises ``ValueError`` when nothing matched, ``ImportError`` without peft."""
        L.inject_lora(self, r, alpha, dropout, tuple(targets or self.lora_targets))

    def set_activation_checkpointing(self, on: bool = True) -> bool:
        """Turn activation checkpointing on/off; False when the model has none (the default)."""
        return False

    def optimizer_groups(self, lr: float, weight_decay: float) -> list[dict] | None:
        """AdamW parameter groups (each with ``params``, ``lr``, ``name``...), or None: the trainer's
        default groups (:func:`train.optim.param_groups`)."""
        return None

    def checkpoint_config(self) -> dict | None:
        """How to export: a ``transformers`` config written with each checkpoint (``config.json``) so
        that it loads with ``from_pretrained``; None for a model without one."""
        return None

    def checkpoint_metadata(self) -> dict[str, str]:
        """What each checkpoint's safetensors header records about the model's own heads (the theworld
        recipe: ``projection_architecture``), read back when such a file is loaded; {} by default."""
        return {}

