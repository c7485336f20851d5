"""Tiny random Higgs-Audio v2 models as ``transformers`` ships them: the LLM with its text tokenizer
(``higgs``) and the audio tokenizer (``higgs-audio-tokenizer``).

``higgs``: one directory like the released ``bosonai/higgs-audio-v2-generation-3B-base`` in its
``transformers`` form (``HiggsAudioV2ForConditionalGeneration``, ``model_type: higgs_audio_v2``, with
the text head): the model weights and config plus its text tokenizer, so the same path is the
precompute job's ``text_tokenizer.pretrained`` and the trainer's ``--model_path``. The tokenizer is a
byte-level BPE with Llama-3's conventions (``<|begin_of_text|>`` added in front, ``<|end_of_text|>`` =
eos = pad, as the converted checkpoint sets ``pad_token = eos_token``), the chat tokens of
:data:`shards.tokens.SPECIAL_TOKENS` and :data:`shards.tokens.HIGGS_TOKENS` (the delay token) as
single ids, and Higgs-Audio v2's real chat template (:data:`HIGGS_CHAT_TEMPLATE`). The model's ids
(``audio_token_id``, ``audio_bos_token_id``, ``audio_delay_token_id``, ``pad_token_id``) are the
tokenizer's; 8 codebooks of 1024 codes plus stream BOS 1024 / EOS 1025 (``codebook_size`` 1026, as
the converted checkpoint). tiny: hidden 64, 2 layers, 4 heads (2 kv), vocab 320; full: the 3B shape.

``higgs-audio-tokenizer``: ``HiggsAudioV2TokenizerModel`` (DAC acoustic branch + HuBERT semantic
branch, residual VQ): 24 kHz, hop 960 (25 frames/s), target bandwidths 0.5-2 kbps, so 8 codebooks
of 1024 (Higgs-Audio v2's layout). tiny: narrow DAC and a one-layer HuBERT that reads the 24 kHz
input directly (``semantic_sample_rate`` 24000: the real one resamples to 16 kHz with torchaudio);
its codebooks are calibrated like EnCodec's (:mod:`.codecs`) so codes are not constant.

The ``transformers`` port of the audio tokenizer imports ``torchaudio`` at import time and uses it
only for ``torchaudio.functional.resample`` (semantic branch, when its rate differs from the input
rate). No torchaudio build loads beside the CPU torch 2.13 used here (torchaudio 2.11, the newest
on PyPI, fails to load its extension: ``OSError``); the tests' stand-in
(:mod:`tools.torchaudio_shim`) takes its place. The tiny tokenizer
never resamples; the real 16 kHz semantic branch with the real torchaudio is untested here.
"""
from __future__ import annotations

from typing import Callable

from shards.tokens import (AUDIO_DELAY, AUDIO_OUT, AUDIO_OUT_BOS, BEGIN_OF_TEXT, END_OF_TEXT, EOT, HIGGS_TOKENS,
                           SPECIAL_TOKENS)

from . import codecs, text

#: Higgs-Audio v2's chat template, verbatim: ``CHAT_TEMPLATE`` of ``transformers``'
#: ``models/higgs_audio_v2/convert_higgs_audio_v2_to_hf.py`` (Apache-2.0), the template its converted
#: processor carries. A system message is required; a ``scene`` message right after it goes between
#: ``<|scene_desc_start|>``/``<|scene_desc_end|>`` (its audio items as
#: `` <|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>``); assistant messages must be audio only
#: (``<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>``); other messages render their text items only,
#: trimmed: **audio in a user turn is dropped**.
HIGGS_CHAT_TEMPLATE = "{{- bos_token }}\n{#- This block extracts the system message, so we can slot it into the right place. #}\n{%- if messages[0]['role'] == 'system' %}\n    {%- if messages[0]['content'] is string %}\n        {%- set system_message = messages[0]['content']|trim %}\n    {%- elif messages[0]['content'] is iterable and messages[0]['content'][0]['type'] == 'text' %}\n        {%- set system_message = messages[0]['content'][0]['text']|trim %}\n    {%- else %}\n        {{- raise_exception(\"System message content must be a string or contain text type!\") }}\n    {%- endif %}\n    {%- set messages = messages[1:] %}\n{%- else %}\n    {{- raise_exception(\"A system message is required but not provided!\") }}\n{%- endif %}\n\n{#- System message #}\n{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n{{- system_message }}\n\n{#- Check for scene message and handle it specially #}\n{%- if messages and messages[0]['role'] == 'scene' %}\n    {{- \"\\n\\n<|scene_desc_start|>\\n\" }}\n    {%- if messages[0]['content'] is string %}\n        {{- messages[0]['content'] | trim }}\n    {%- elif messages[0]['content'] is iterable %}\n        {%- for content_item in messages[0]['content'] %}\n            {%- if content_item['type'] == 'text' %}\n                {%- set text_content = content_item['text'] | trim %}\n                {{- text_content }}\n                {%- if loop.first and not loop.last %}\n                    {{- \"\\n\\n\" }}\n                {%- endif %}\n                {%- if not loop.first and not loop.last and messages[0]['content'][loop.index]['type'] != 'audio' %}\n                    {{- \"\\n\" }}\n                {%- endif %}\n            {%- elif content_item['type'] == 'audio' %}\n                {{- ' <|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}\n                {%- if not loop.last %}\n                    {{- \"\\n\" }}\n                {%- endif %}\n            {%- endif %}\n        {%- endfor %}\n    {%- endif %}\n    {{- \"\\n<|scene_desc_end|>\" }}\n    {%- set messages = messages[1:] %}\n{%- endif %}\n\n{{- \"<|eot_id|>\" }}\n\n{#- Loop through all messages #}\n{%- for message in messages %}\n    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n    {%- if message['role'] == 'assistant' %}\n        {%- if message['content'] is not iterable or message['content'][0]['type'] != 'audio' %}\n            {{- raise_exception(\"Assistant messages must contain audio content only!\") }}\n        {%- endif %}\n        {{- '<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}\n    {%- else %}\n        {%- if message['content'] is string %}\n            {{- message['content'] | trim }}\n        {%- elif message['content'] is iterable %}\n            {%- for content_item in message['content'] %}\n                {%- if content_item['type'] == 'text' %}\n                    {{- content_item['text'] | trim }}\n                {%- endif %}\n            {%- endfor %}\n        {%- endif %}\n    {%- endif %}\n    {{- '<|eot_id|>' }}\n{%- endfor %}\n\n{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|audio_out_bos|>' }}\n{%- endif %}"

#: codec contract of Higgs-Audio v2 (its audio tokenizer at 2 kbps): codebooks x codes
NUM_CODEBOOKS, CODEBOOK_SIZE = 8, 1024


# -- the audio tokenizer ------------------------------------------------------------------------------

def audio_tokenizer_config(size: str = "tiny"):
    """``HiggsAudioV2TokenizerConfig``: 24 kHz, hop 960, bandwidths up to 2 kbps (8 codebooks x 1024)."""
    from transformers import HiggsAudioV2TokenizerConfig

    kw = dict(target_bandwidths=[0.5, 1, 1.5, 2], sample_rate=24000, codebook_size=CODEBOOK_SIZE)
    if size == "tiny":
        kw.update(
            semantic_sample_rate=24000,  # no resampling: see the module docstring
            codebook_dim=8,
            acoustic_model_config=dict(encoder_hidden_size=4, downsampling_ratios=[8, 5, 4, 2, 3],
                                       upsampling_ratios=[8, 5, 4, 2, 3], decoder_hidden_size=64,
                                       hidden_size=16, hop_length=960, sampling_rate=24000),
            semantic_model_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, conv_dim=[8] * 7, num_conv_pos_embeddings=16,
                                       num_conv_pos_embedding_groups=2),
        )
    else:
        kw.update(acoustic_model_config=dict(downsampling_ratios=[8, 5, 4, 2, 3], upsampling_ratios=[8, 5, 4, 2, 3],
                                             hop_length=960, sampling_rate=24000))
    return HiggsAudioV2TokenizerConfig(**kw)


def make_audio_tokenizer(size: str = "tiny", seed: int = 0):
    """Random ``HiggsAudioV2TokenizerModel`` (eval mode) with calibrated codebooks. Where torchaudio
    cannot load, the class is the one stage one loads with ``resampler: soxr``
    (:func:`precompute.encoders.higgs_resampler.model_class`): the same weights and config, built
    whatever this process imported before (``transformers`` decides once per process whether
    torchaudio exists, so a stand-in put on the path late is not seen)."""
    import torch

    from precompute.encoders.higgs_resampler import model_class, torchaudio_version

    HiggsAudioV2TokenizerModel, _ = model_class("torchaudio" if torchaudio_version() else "soxr")
    torch.manual_seed(seed)
    model = HiggsAudioV2TokenizerModel(audio_tokenizer_config(size)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    captured = []
    hook = model.fc.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    with torch.no_grad():
        model.encode(codecs.calibration_audio(model.config.sample_rate, seed=seed))
        hook.remove()
        embeddings = captured[0].transpose(1, 2)                      # (1, D, frames): what the RVQ reads
        codecs._fill_codebooks(model.quantizer.quantizers, embeddings, g, codecs._set_encodec_entries)
    return model


# -- the LLM and its text tokenizer -------------------------------------------------------------------

def make_text_tokenizer(size: str = "tiny", seed: int = 0):
    """Llama-3-style BPE ``PreTrainedTokenizerFast`` with Higgs-Audio v2's chat template (see the module
    docstring); ``model_input_names`` input_ids and attention_mask, as Llama's."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = text.train_bpe(size, ["<unk>"])
    tok.add_special_tokens([BEGIN_OF_TEXT, END_OF_TEXT])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BEGIN_OF_TEXT} $A", pair=f"{BEGIN_OF_TEXT} $A {BEGIN_OF_TEXT} $B",
        special_tokens=[(BEGIN_OF_TEXT, tok.token_to_id(BEGIN_OF_TEXT))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BEGIN_OF_TEXT, eos_token=END_OF_TEXT,
                                   pad_token=END_OF_TEXT, unk_token="<unk>",
                                   model_input_names=["input_ids", "attention_mask"])
    text.add_chat_tokens(fast, [t for t in SPECIAL_TOKENS + HIGGS_TOKENS if t not in (BEGIN_OF_TEXT, END_OF_TEXT)])
    fast.chat_template = HIGGS_CHAT_TEMPLATE
    return fast


def model_config(tokenizer, size: str = "tiny"):
    """``HiggsAudioV2Config`` whose token ids are ``tokenizer``'s (8 codebooks of 1024 + stream BOS/EOS)."""
    from transformers import HiggsAudioV2Config

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (AUDIO_OUT, AUDIO_OUT_BOS, AUDIO_DELAY, END_OF_TEXT,
                                                           BEGIN_OF_TEXT, EOT)}
    kw = dict(num_codebooks=NUM_CODEBOOKS, codebook_size=CODEBOOK_SIZE + 2, audio_stream_bos_id=CODEBOOK_SIZE,
              audio_stream_eos_id=CODEBOOK_SIZE + 1, audio_token_id=ids[AUDIO_OUT],
              audio_bos_token_id=ids[AUDIO_OUT_BOS], audio_delay_token_id=ids[AUDIO_DELAY],
              pad_token_id=ids[END_OF_TEXT], bos_token_id=ids[BEGIN_OF_TEXT], eos_token_id=ids[EOT])
    if size == "tiny":
        kw.update(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    return HiggsAudioV2Config(**kw)


class Checkpoint:
    """Several objects saved into one directory (``save_pretrained`` of each), as a released
    checkpoint holds the model and its tokenizer together."""

    def __init__(self, *parts):
        self.parts = parts

    def save_pretrained(self, path: str) -> None:
        for p in self.parts:
            p.save_pretrained(path)


def make_higgs(size: str = "tiny", seed: int = 0) -> Checkpoint:
    """Random ``HiggsAudioV2ForConditionalGeneration`` (with its text head) + its text tokenizer."""
    import torch
    from transformers import HiggsAudioV2ForConditionalGeneration

    tok = make_text_tokenizer(size, seed)
    torch.manual_seed(seed)
    model = HiggsAudioV2ForConditionalGeneration(model_config(tok, size), use_text_head=True).eval()
    return Checkpoint(model, tok)


MAKERS: dict[str, Callable] = {"higgs": make_higgs, "higgs-audio-tokenizer": make_audio_tokenizer}
