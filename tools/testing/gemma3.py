"""A tiny random Gemma 3 (``Gemma3ForConditionalGeneration``) saved together with its processor,
like the released ``google/gemma-3-4b-it`` directory: ``config.json`` + ``model.safetensors`` +
``processor_config.json`` (``Gemma3ImageProcessor``: resize to the vision tower's
``image_size``, rescale 1/255, normalise with mean = std = 0.5) + the tokenizer of
:func:`tools.testing.chat_templates.make_chat_tokenizer` (Gemma 3's special tokens and its
real chat template) declaring ``boi_token`` / ``eoi_token`` / ``image_token`` as the released
tokenizer does, so ``Gemma3Processor`` expands each ``<start_of_image>`` into
``"\\n\\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\\n\\n"``.

tiny: SigLIP vision tower 64 x 64 px, patch 8 (8 x 8 patches), hidden 32, 1 layer; the projector
average-pools to ``mm_tokens_per_image = 16`` (4 x 4) tokens; Gemma 3 text model hidden 64, 2
layers, 4 heads (2 kv, head_dim 16), vocab 320 (covers the 300-id tokenizer and the TheWorld markers
added at stage one). ``initializer_range`` 0.2 (as the tiny Llama of :mod:`.text`): with 0.02 a
random frozen LM's logits hardly depend on its inputs, so a projection alone could not fit anything.
The projector's ``mm_input_projection_weight`` is drawn at random too (transformers initialises it
to zeros, which would make every image feature 0). full: the ``google/gemma-3-4b-it`` shapes
(a ~4.3 B-parameter model: seconds to describe, minutes to build).
"""
from __future__ import annotations

from typing import Callable

#: what the tokenizer declares (``tokenizer_config.json`` ``extra_special_tokens``), as the released one
GEMMA3_EXTRA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}


def gemma3_config(size: str = "tiny", tokenizer=None):
    """``Gemma3Config`` (tiny or the gemma-3-4b-it shapes) with the image token ids of ``tokenizer``."""
    from transformers import Gemma3Config

    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in GEMMA3_EXTRA_TOKENS.items()} if tokenizer else \
        {"boi_token": 255_999, "eoi_token": 256_000, "image_token": 262_144}
    if size == "tiny":
        return Gemma3Config(
            text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=320, sliding_window=512,
                             max_position_embeddings=32768, initializer_range=0.2),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=64, patch_size=8),
            mm_tokens_per_image=16, boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
            image_token_index=ids["image_token"], initializer_range=0.2)
    return Gemma3Config(
        text_config=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                         query_pre_attn_scalar=256, rope_scaling={"factor": 8.0, "rope_type": "linear"}),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=896, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=256, boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"])


class Gemma3Bundle:
    """The model and its processor; :meth:`save_pretrained` writes both into one directory."""

    def __init__(self, model, processor):
        self.model, self.processor = model, processor

    def save_pretrained(self, path: str) -> None:
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)


def make_gemma3_processor(size: str = "tiny", seed: int = 0, image_size: int = 64, image_seq_length: int = 16):
    """``Gemma3Processor`` over the tiny Gemma 3 tokenizer and a ``Gemma3ImageProcessor`` of
    ``image_size`` px (the PIL backend, which needs no torchvision; values as the released one's)."""
    import tempfile

    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from .chat_templates import make_chat_tokenizer

    with tempfile.TemporaryDirectory() as d:  # reloaded so the extra special tokens become attributes
        make_chat_tokenizer("gemma3", size, seed).save_pretrained(d)
        tok = AutoTokenizer.from_pretrained(d, extra_special_tokens=dict(GEMMA3_EXTRA_TOKENS))
    ip = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3)
    return Gemma3Processor(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template,
                           image_seq_length=image_seq_length)


def make_gemma3(size: str = "tiny", seed: int = 0) -> Gemma3Bundle:
    """Random ``Gemma3ForConditionalGeneration`` (eval mode) + its ``Gemma3Processor`` (see the module docstring)."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    cfg = gemma3_config(size)
    proc = make_gemma3_processor(size, seed, cfg.vision_config.image_size, cfg.mm_tokens_per_image)
    cfg = gemma3_config(size, proc.tokenizer)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        w = model.model.multi_modal_projector.mm_input_projection_weight
        w.normal_(0.0, cfg.vision_config.hidden_size ** -0.5)
    return Gemma3Bundle(model, proc)


MAKERS: dict[str, Callable] = {"gemma3": make_gemma3}
