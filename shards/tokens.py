"""The text conventions of a cache: the one place that names the special tokens and ``IGNORE_INDEX``.

Stage one renders conversations with these strings (:mod:`precompute.chat`), ``manifest.json`` records their ids (``text.special_token_ids``)
and the trainer reads the ids back by these names (:class:`shards.cache.Cache`).

Layout (Higgs-Audio's ``boson_multimodal/dataset/chatml_dataset.py`` ``prepare_chatml_sample``,
Llama-3 headers)::

    <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>

audio in a user/system turn is ``<|audio_bos|><|AUDIO|><|audio_eos|>``, audio in an assistant
turn ``<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>``, an image ``<image>`` (LLaVA; Gemma 3's
``<start_of_image>`` by config). Labels follow ``prepare_chatml_sample``: the three audio-out tokens of
a trained assistant turn carry their own ids as labels, the audio-in tokens and images never do.
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
#: what follows a ChatML message's recipient (Boson's ``prepare_chatml_sample``: ``f"{recipient}<|recipient|>"``)
RECIPIENT = "<|recipient|>"
IMAGE = "<image>"
#: Gemma 3's image placeholder: its chat template renders an image item as this token and its
#: processor expands it into the SigLIP soft tokens (``chat_template`` of ``google/gemma-3-4b-it``)
GEMMA_IMAGE = "<start_of_image>"
#: TheWorld's world-token markers (``kasohrab/theworld``, ``python/theworld/constants.py``): the world
#: embeddings of an image sit between them, right after BOS (``TheWorld._inject_world_tokens``)
WORLD_START, WORLD_END = "<start_of_world>", "<end_of_world>"
#: Gemma 3's image soft token: ``Gemma3Processor`` expands each ``<start_of_image>`` into
#: ``mm_tokens_per_image`` of them (``config.image_token_id``, where the image features go)
GEMMA_IMAGE_SOFT = "<image_soft_token>"
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
#: media placeholder tokens: one per media item; the k-th stands for item k of its kind (the image
#: placeholder is configurable: ``image_token`` in the stage-one config, :data:`IMAGE` by default)
PLACEHOLDERS = (AUDIO_IN, AUDIO_OUT, IMAGE)
#: the tokens around each audio placeholder, by direction (Higgs-Audio's layout)
AUDIO_IN_TOKENS = (AUDIO_BOS, AUDIO_IN, AUDIO_EOS)
AUDIO_OUT_TOKENS = (AUDIO_OUT_BOS, AUDIO_OUT, AUDIO_EOS)

__all__ = ["GEMMA_IMAGE_SOFT", "IGNORE_INDEX", "BEGIN_OF_TEXT", "START_HEADER", "END_HEADER", "EOT", "EOM", "AUDIO_BOS",
           "AUDIO_IN", "AUDIO_EOS", "AUDIO_OUT_BOS", "AUDIO_OUT", "RECIPIENT", "IMAGE", "GEMMA_IMAGE", "WORLD_START",
           "WORLD_END", "SPECIAL_TOKENS", "PLACEHOLDERS", "AUDIO_IN_TOKENS", "AUDIO_OUT_TOKENS", "END_OF_TEXT",
           "AUDIO_DELAY", "HIGGS_TOKENS"]


def vocab_sha256(tokenizer) -> str:
    """The fingerprint of a ``transformers`` tokenizer (``manifest.json``
    ``encoders.text_tokenizer.vocab_sha256``, and what a recipe's contract compares it with): sha256 of
    its full ``tokenizers`` pipeline (normaliser, pre-tokeniser, model, post-processor), its vocabulary
    (added tokens included) and its special-token map. Stage one and stage two compute it here."""
    import hashlib
    import json

    def canonical(obj) -> str:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)

    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    h.update(canonical(sorted(tokenizer.get_vocab().items())).encode())
    h.update(canonical({k: str(v) for k, v in tokenizer.special_tokens_map.items()}).encode())
    return h.hexdigest()
