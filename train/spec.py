"""Every model's spec (after torchtitan's ``TrainSpec``): what the trainer knows about a model, declared once.

``--model.name`` names a recipe of :data:`train.recipes.RECIPES`, a plug-in recipe (``pkg.mod:Class``, a
:class:`train.recipes.base.Recipe` subclass) or a plain factory (``pkg.mod:make``, any callable returning an
``nn.Module``). :func:`model_spec` turns each into the same :class:`ModelSpec`, once: the trainer, the
loaders, the optimizer and the checkpoints read the spec and never ask what kind of model they hold.

A plain factory's spec reads every field of the cache, has the generic LoRA (``lora.targets``), the
default optimizer groups, no activation checkpointing and an empty contract the user fills with
``--model.contract`` (:meth:`shards.cache.Contract.from_dict`), the items a recipe declares in code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch.nn as nn

from shardcache.plugins import load_factory
from shards.cache import Cache, Contract

from . import lora
from .recipes import RECIPES, recipe_class
from .recipes.base import Recipe


@dataclass(frozen=True)
class ModelSpec:
    """What ``--model.name`` declares (a recipe's from its class, a plain factory's the defaults above).

    Attributes:
        name: ``--model.name`` as given.
        builds: the class or factory it builds (for messages).
        fields / optional_fields: the fields it reads (required / where the cache has them); both empty:
            every field the cache holds.
        default_checkpoint: the checkpoint ``model.kwargs.lm`` defaults to (None: built from scratch).
        contract: ``contract(kwargs)`` -> :class:`shards.cache.Contract` (configs only, no weights).
        build: ``build(cache, kwargs, latent_loss, latent_loss_weight)`` -> the model (an ``nn.Module`` whose
            ``forward(batch)`` returns a loss or a dict with ``loss``).
        lora_options: ``lora_options(kwargs, run)`` -> the LoRA options the built model will carry
            (:func:`train.lora.options`; ``run``: the run's ``lora`` section as such options, or None), or
            None without LoRA. Known before any weight loads (adapters are checked against it).
        apply_lora: ``apply_lora(model, options)`` -> the model with adapters, every other weight frozen.
        optimizer_groups: ``optimizer_groups(model, lr, weight_decay)`` -> AdamW groups, or None (the
            trainer's decay / no-decay groups).
        activation_checkpointing: ``activation_checkpointing(model, on)`` -> False when it has none.
        batch_transform: ``batch_transform(model)`` -> a loader transform (its batch layout) or None.
        checkpoint_config: ``checkpoint_config(model)`` -> a ``transformers`` config stored with each
            checkpoint (``model_config`` in ``config.json``), or None.
        checkpoint_metadata: ``checkpoint_metadata(model)`` -> ``{key: str}`` written into the checkpoint's
            safetensors header (the theworld recipe's ``projection_architecture``).
    """

    name: str
    builds: Any
    fields: tuple[str, ...]
    optional_fields: tuple[str, ...]
    default_checkpoint: str | None
    contract: Callable[[Mapping[str, Any]], Contract]
    build: Callable[..., nn.Module]
    lora_options: Callable[[Mapping[str, Any], dict | None], dict | None]
    apply_lora: Callable[[nn.Module, dict], nn.Module]
    optimizer_groups: Callable[[nn.Module, float, float], list | None]
    activation_checkpointing: Callable[[nn.Module, bool], bool]
    batch_transform: Callable[[nn.Module], Any]
    checkpoint_config: Callable[[nn.Module], dict | None]
    checkpoint_metadata: Callable[[nn.Module], dict[str, str]]

    @property
    def read_fields(self) -> tuple[str, ...]:
        """``fields`` then ``optional_fields``."""
        return self.fields + tuple(f for f in self.optional_fields if f not in self.fields)


def recipe_spec(name: str, cls: type[Recipe]) -> ModelSpec:
    """The spec of recipe class ``cls``: its declarations and its methods."""
    def apply(model: Recipe, opts: dict) -> nn.Module:
        model.enable_lora(**opts)
        return model

    return ModelSpec(
        name=name, builds=cls, fields=tuple(cls.fields), optional_fields=tuple(cls.optional_fields),
        default_checkpoint=cls.default_checkpoint, contract=lambda kwargs: cls.contract(dict(kwargs)),
        build=lambda cache, kwargs, latent_loss="none", latent_loss_weight=1.0: cls.from_cache(
            cache, dict(kwargs), latent_loss=latent_loss, latent_loss_weight=latent_loss_weight),
        lora_options=cls.lora_options, apply_lora=apply,
        optimizer_groups=lambda m, lr, wd: m.optimizer_groups(lr, wd),
        activation_checkpointing=lambda m, on: bool(m.set_activation_checkpointing(on)),
        batch_transform=lambda m: m.batch_transform, checkpoint_config=lambda m: m.checkpoint_config(),
        checkpoint_metadata=lambda m: m.checkpoint_metadata())


def factory_spec(name: str, factory: Callable[..., nn.Module]) -> ModelSpec:
    """The spec of a plain ``module:factory``: ``factory(**model.kwargs)``, the generic LoRA on the run's
    ``lora.targets``, the trainer's optimizer groups, an empty contract (``--model.contract`` fills it)."""
    def build(cache: Cache, kwargs: Mapping[str, Any], latent_loss: str = "none",
              latent_loss_weight: float = 1.0) -> nn.Module:
        if latent_loss != "none":
            raise ValueError(f"--model.latent_loss {latent_loss}: {name} is a plain factory (no latent loss)")
        m = factory(**kwargs)
        if not isinstance(m, nn.Module):
            raise TypeError(f"{name} returned {type(m).__name__}, expected a torch.nn.Module")
        return m

    def apply(model: nn.Module, opts: dict) -> nn.Module:
        lora.inject_lora(model, **opts)
        return model

    return ModelSpec(
        name=name, builds=factory, fields=(), optional_fields=(), default_checkpoint=None,
        contract=lambda kwargs: Contract(f"--model.name {name}"), build=build,
        lora_options=lambda kwargs, run: run, apply_lora=apply, optimizer_groups=lambda m, lr, wd: None,
        activation_checkpointing=lambda m, on: False, batch_transform=lambda m: None,
        checkpoint_config=lambda m: None, checkpoint_metadata=lambda m: {})


def model_spec(name: str) -> ModelSpec:
    """The spec of ``--model.name name``: a recipe of :data:`train.recipes.RECIPES`, a plug-in
    :class:`~train.recipes.base.Recipe` (``pkg.mod:Class``) or a plain factory (``pkg.mod:make``), each
    wrapped here, once. Raises ``ImportError``/``AttributeError`` for a name that does not import."""
    obj = recipe_class(name) if name in RECIPES else load_factory(name)
    if isinstance(obj, type) and issubclass(obj, Recipe):
        return recipe_spec(name, obj)
    return factory_spec(name, obj)


__all__ = ["ModelSpec", "model_spec", "recipe_spec", "factory_spec"]
