"""Training recipes on real ``transformers`` architectures, selected by ``--model NAME``.

=======  =======================================================================================
``higgs`` :class:`~train.recipes.higgs.HiggsModel`: Higgs-Audio v2 itself (``transformers``'
         ``HiggsAudioV2ForConditionalGeneration``, the released checkpoint), on batches built as its
         own processor builds them (:class:`loaders.higgs.HiggsBatch`).
``tts``  :class:`~train.recipes.tts.TTSModel`: Higgs-Audio-shaped speech LM on any ``transformers``
         causal LM (delay-pattern codec frames in place of ``<|AUDIO|>``/``<|AUDIO_OUT|>``, new audio
         embeddings and one head per codebook, text + audio loss): for an LM that is not Higgs-Audio,
         and for input audio (``<|AUDIO|>``) as codes, which Higgs-Audio v2 has no path for.
``vlm``  :class:`~train.recipes.vlm.VLMModel`: LLaVA/TheWorld-shaped (Cosmos latent patches projected
         in place of ``<image>``, frozen LM by default, caption loss).
``theworld`` :class:`~train.recipes.theworld.TheWorldModel`: TheWorld itself: Gemma 3
         (``Gemma3ForConditionalGeneration``) with cached SigLIP ``image_features`` scattered at its image
         tokens and TheWorld's world projection of cached Cosmos latents between the world markers.
=======  =======================================================================================

``tts`` and ``vlm`` load ``model_kwargs.lm`` (default ``models/lm-tiny``) with ``AutoModelForCausalLM``,
``higgs`` (default ``models/higgs-tiny``) with ``HiggsAudioV2ForConditionalGeneration``, ``theworld``
(default ``models/gemma3-tiny``) with ``Gemma3ForConditionalGeneration``; each declares
its contract (:class:`train.recipes.base.Recipe`: the cached fields, special tokens, codec,
tokenizer, image preset and feature encoder it needs, checked by ``cache.require`` before any weight
loads), handles LoRA itself (``enable_lora``) and exposes ``optimizer_groups(lr, weight_decay)``.
A new recipe: one module with a ``Recipe`` subclass, plus its line here.
"""
from __future__ import annotations

import importlib

#: ``--model`` name -> "module:class" (imported on use: transformers loads only when a recipe is chosen)
RECIPES = {
    "reference": "train.models:ReferenceModel",
    "higgs": "train.recipes.higgs:HiggsModel",
    "tts": "train.recipes.tts:TTSModel",
    "vlm": "train.recipes.vlm:VLMModel",
    "theworld": "train.recipes.theworld:TheWorldModel",
}


def recipe_class(name: str):
    """The class of recipe ``name`` (a key of :data:`RECIPES`)."""
    mod, _, cls = RECIPES[name].partition(":")
    return getattr(importlib.import_module(mod), cls)
