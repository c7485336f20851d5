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

Each loads ``model_kwargs.lm`` (a directory or hub id; its default is the module's ``DEFAULT_*``),
declares the cached ``fields`` it needs, handles LoRA itself (``enable_lora``) and exposes
``optimizer_groups(lr, weight_decay)``.
"""
from __future__ import annotations

import importlib

#: ``--model`` name -> "module:class" (imported on use: transformers loads only when a recipe is chosen)
RECIPES = {
    "higgs": "train.recipes.higgs:HiggsModel",
    "tts": "train.recipes.tts:TTSModel",
    "vlm": "train.recipes.vlm:VLMModel",
    "theworld": "train.recipes.theworld:TheWorldModel",
}


def recipe_class(name: str):
    """The class of recipe ``name`` (a key of :data:`RECIPES`)."""
    mod, _, cls = RECIPES[name].partition(":")
    return getattr(importlib.import_module(mod), cls)
