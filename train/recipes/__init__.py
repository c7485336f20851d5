"""Training recipes on real ``transformers`` architectures, selected by ``--model.name NAME``: the names
of :data:`RECIPES` (each class's docstring says what it trains).

Each loads ``model_kwargs.lm`` (a directory or hub id; its default is the module's ``DEFAULT_*``),
declares its contract (:class:`train.recipes.base.Recipe`: the cached fields, special tokens, codec,
tokenizer, image preset and feature encoder it needs, checked by ``cache.require`` before any weight
loads), handles LoRA itself (``enable_lora``) and exposes
``optimizer_groups(lr, weight_decay)``.
A new recipe: one module with a ``Recipe`` subclass, plus its entry in :data:`RECIPES`.
"""
from __future__ import annotations

import importlib

#: ``--model`` name -> "module:class" (imported on use: transformers loads only when a recipe is chosen)
RECIPES = {
    "reference": "train.recipes.reference:ReferenceModel",
    "higgs": "train.recipes.higgs:HiggsModel",
    "tts": "train.recipes.tts:TTSModel",
    "vlm": "train.recipes.vlm:VLMModel",
    "theworld": "train.recipes.theworld:TheWorldModel",
}


def recipe_class(name: str):
    """The class of recipe ``name`` (a key of :data:`RECIPES`)."""
    mod, _, cls = RECIPES[name].partition(":")
    return getattr(importlib.import_module(mod), cls)
