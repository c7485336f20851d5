"""The text conventions of a cache: the one place that names the special tokens and ``IGNORE_INDEX``.

Stage one renders conversations with these strings (:mod:`precompute.chat`), the test tokenizers
add them (:mod:`shardcache.testing`), ``manifest.json`` records their ids (``text.special_token_ids``)
and the trainer reads the ids back by these names (:func:`train.models.data_spec`).

Layout (Higgs-Audio's ``boson_multimodal/dataset/chatml_dataset.py`` ``prepare_chatml_sample``,
Llama-3 headers)::

    <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>

audio in a user/system turn is ``<|audio_bos|><|AUDIO|><|audio_eos|>``, audio in an assistant
turn ``<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>``, an image ``<image>`` (LLaVA).
"""
from __future__ import annotations

#: label of a token that is not trained, and pad of codes: PyTorch's ``CrossEntropyLoss`` default
#: ``ignore_index``
IGNORE_INDEX = -100

BEGIN_OF_TEXT = "<|begin_of_text|>"
START_HEADER, END_HEADER = "<|start_header_id|>", "<|end_header_id|>"
EOT, EOM = "<|eot_id|>", "<|eom_id|>"
AUDIO_BOS, AUDIO_IN, AUDIO_EOS = "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"
AUDIO_OUT_BOS, AUDIO_OUT = "<|audio_out_bos|>", "<|AUDIO_OUT|>"
IMAGE = "<image>"
#: Higgs-Audio v2's tokenizer (a Llama-3 tokenizer): end of text = its pad (``pad_token_id`` 128001),
#: and the delay token that ``transformers``' ``HiggsAudioV2Processor`` writes after the frames of an
#: audio item (its ``audio_delay_token``, id 128014: a Llama-3 reserved token). Not in
#: :data:`SPECIAL_TOKENS`: no cache layout renders them (the trainer inserts delay tokens).
END_OF_TEXT = "<|end_of_text|>"
AUDIO_DELAY = "<|reserved_special_token_6|>"
HIGGS_TOKENS = (END_OF_TEXT, AUDIO_DELAY)

#: every special token the chat layouts use, in this order (the byte tokenizer gives them ids
#: 259, 260, ...; the test tokenizer adds them after its BPE vocabulary)
SPECIAL_TOKENS = (BEGIN_OF_TEXT, START_HEADER, END_HEADER, EOT, EOM, AUDIO_BOS, AUDIO_IN, AUDIO_EOS,
                  AUDIO_OUT_BOS, AUDIO_OUT, IMAGE)
#: media placeholder tokens: one per media item; the k-th stands for item k of its kind
PLACEHOLDERS = (AUDIO_IN, AUDIO_OUT, IMAGE)

__all__ = ["IGNORE_INDEX", "BEGIN_OF_TEXT", "START_HEADER", "END_HEADER", "EOT", "EOM", "AUDIO_BOS",
           "AUDIO_IN", "AUDIO_EOS", "AUDIO_OUT_BOS", "AUDIO_OUT", "IMAGE", "SPECIAL_TOKENS", "PLACEHOLDERS",
           "END_OF_TEXT", "AUDIO_DELAY", "HIGGS_TOKENS"]
