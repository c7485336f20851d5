"""Training recipes on real ``transformers`` architectures, selected by ``--model NAME``.

=======  =======================================================================================
``tts``  :class:`~train.recipes.tts.TTSModel`: Higgs-Audio-shaped speech LM (delay-pattern codec
         frames in place of ``<|AUDIO|>``/``<|AUDIO_OUT|>``, one head per codebook, text + audio loss).
``vlm``  :class:`~train.recipes.vlm.VLMModel`: LLaVA/TheWorld-shaped (Cosmos latent patches projected
         in place of ``<image>``, frozen LM by default, caption loss).
=======  =======================================================================================

Both load ``model_kwargs.lm`` (default ``models/lm-tiny``) with ``AutoModelForCausalLM``, declare the
cached ``fields`` they need, handle LoRA themselves (``enable_lora``) and expose
``optimizer_groups(lr, weight_decay)``.
"""
from __future__ import annotations

import importlib

#: ``--model`` name -> "module:class" (imported on use: transformers loads only when a recipe is chosen)
RECIPES = {
    "tts": "train.recipes.tts:TTSModel",
    "vlm": "train.recipes.vlm:VLMModel",
}


def recipe_class(name: str):
    """The class of recipe ``name`` (a key of :data:`RECIPES`)."""
    mod, _, cls = RECIPES[name].partition(":")
    return getattr(importlib.import_module(mod), cls)
