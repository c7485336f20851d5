"""Tiny random text models: a byte-level BPE tokenizer with the chat layouts' special tokens and a
Llama-3 chat template, and a ``LlamaForCausalLM`` for the training recipes."""
from __future__ import annotations

from typing import Callable

from shards.tokens import SPECIAL_TOKENS


TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Precompute the audio codes, image latents and text ids once; train from shards.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "Le cœur déçu mais l'âme plutôt naïve, Louÿs rêva de crapaüter en canoë.",
    "日本語のテキストも少し含めます。",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
]


#: Llama-3 header style (as Higgs-Audio renders conversations); ``content`` is a string
LLAMA3_CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)


def train_bpe(size: str, specials: list[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on :data:`TOKENIZER_CORPUS` (300 ids tiny,
    1000 full), ``specials`` first (ids 0, 1, ...); no post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    vocab = 300 if size == "tiny" else 1000
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TOKENIZER_CORPUS * 4, trainer=trainer)
    return tok


def add_chat_tokens(fast, tokens) -> None:
    """Add ``tokens`` to a ``PreTrainedTokenizerFast`` as special tokens, each a single id after its vocabulary."""
    from tokenizers import AddedToken

    fast.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens], special_tokens=True)


def make_tokenizer(size: str = "tiny", seed: int = 0):
    """Byte-level BPE ``PreTrainedTokenizerFast`` (``<pad>``=0, ``<s>``=1, ``</s>``=2, ``<unk>``=3) adding
    bos/eos, with :data:`SPECIAL_TOKENS` as added special tokens and :data:`LLAMA3_CHAT_TEMPLATE`."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = train_bpe(size, ["<pad>", "<s>", "</s>", "<unk>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> <s> $B </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    # the chat templates' tokens (shards.tokens.SPECIAL_TOKENS), each a single id after the BPE vocab
    add_chat_tokens(fast, SPECIAL_TOKENS)
    fast.chat_template = LLAMA3_CHAT_TEMPLATE
    return fast


def lm_config(size: str = "tiny"):
    """``LlamaConfig``: tiny (64 wide, 2 layers, vocab 512) or the Llama-3.2-1B shape (full)."""
    from transformers import LlamaConfig

    if size == "tiny":
        return LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            # with the default 0.02 a random frozen LM's logits hardly depend on its inputs, so a
            # trainable projection alone (the vlm recipe) could not fit even a few captions; a
            # pretrained LM's do depend on them
            initializer_range=0.2,
        )
    return LlamaConfig(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128001,
    )


def make_lm(size: str = "tiny", seed: int = 0):
    """Random ``LlamaForCausalLM`` (eval mode) for the ``tts``/``vlm`` training recipes."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(lm_config(size)).eval()


MAKERS: dict[str, Callable] = {"tokenizer": make_tokenizer, "lm": make_lm}
