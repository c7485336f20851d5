"""Tiny tokenizers that carry the REAL chat templates of Llama 3, Gemma 3 and Qwen2-VL.

Weights and vocabularies cannot be downloaded here, so each tokenizer is a small byte-level BPE
(:func:`tools.testing.text.train_bpe`) with the model's own special tokens (same strings, same
roles: bos, eos, pad, turn markers, image tokens) and the model's own Jinja ``chat_template``,
copied verbatim from the released tokenizer configuration:

* :data:`LLAMA3_TEMPLATE`: ``meta-llama/Meta-Llama-3-8B-Instruct`` (``tokenizer_config.json``);
  content is ``trim``-med, BOS comes from the template.
* :data:`GEMMA3_TEMPLATE`: ``google/gemma-3-4b-it`` (``tokenizer_config.json`` /
  ``chat_template.json``); content is ``trim``-med, a system message is folded into the first user
  turn, roles must alternate, an image item renders ``<start_of_image>``, the assistant role is
  ``model``.
* :data:`QWEN2VL_TEMPLATE`: ``Qwen/Qwen2-VL-7B-Instruct`` (``chat_template.json``); ChatML
  (``<|im_start|>role\\n ... <|im_end|>\\n``), content NOT trimmed, a default system prompt when the
  first message is not one, an image item renders ``<|vision_start|><|image_pad|><|vision_end|>``.

What these test is everything a template decides (where a turn starts and ends, trimming, inserted
system prompts, BOS); the token ids themselves are not the real models'. ``make models`` builds the
Gemma 3 one (``gemma3-tokenizer-tiny``) for ``configs/precompute-theworld.yaml``.
"""
from __future__ import annotations

from typing import Callable

from shards.tokens import GEMMA_IMAGE

from .text import train_bpe

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

QWEN2VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in "
    "messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string "
    "%}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if "
    "content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = "
    "image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif "
    "%}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content "
    "%}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value "
    "}}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ "
    "content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if "
    "add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Qwen2-VL's image placeholder (the token its processor expands into the vision tokens)
QWEN2VL_IMAGE = "<|image_pad|>"

#: per model: (special tokens in vocabulary order, bos, eos, pad, unk, tokenizer adds BOS itself, template)
SPECS: dict[str, tuple] = {
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", None, None, True, LLAMA3_TEMPLATE),
    "gemma3": (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", GEMMA_IMAGE,
                "<end_of_image>", "<image_soft_token>"], "<bos>", "<eos>", "<pad>", "<unk>", True, GEMMA3_TEMPLATE),
    "qwen2vl": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 QWEN2VL_IMAGE, "<|video_pad|>"], None, "<|im_end|>", "<|endoftext|>", None, False,
                QWEN2VL_TEMPLATE),
}


def make_chat_tokenizer(model: str, size: str = "tiny", seed: int = 0):
    """A ``PreTrainedTokenizerFast`` with ``model``'s special tokens and real chat template (see the
    module docstring); ``model`` in :data:`SPECS`. BOS is prepended on ``add_special_tokens=True``
    where the real tokenizer does it (Llama 3, Gemma 3; not Qwen2-VL). Raises ``KeyError`` for an
    unknown model."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, pad, unk, adds_bos, template = SPECS[model]
    tok = train_bpe(size, specials)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, specials.index(bos))])
    kw = {k: v for k, v in dict(bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk).items() if v}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    fast.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in kw.values()]})
    fast.chat_template = template
    return fast


def make_gemma3_tokenizer(size: str = "tiny", seed: int = 0):
    """:func:`make_chat_tokenizer` for Gemma 3 (``make models``: ``gemma3-tokenizer-tiny``)."""
    return make_chat_tokenizer("gemma3", size, seed)


MAKERS: dict[str, Callable] = {"gemma3-tokenizer": make_gemma3_tokenizer}
