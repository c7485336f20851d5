"""Build randomly initialised models of the real encoder architectures, for tests and dry runs.

Usage::

    python -m precompute.random_models --out models [--size tiny|full] [--only dac,wan,...] [--force] [--seed 0]

Writes ``OUT/<name>-<size>`` with ``save_pretrained`` (config + safetensors), exactly what a user's real
checkpoint directory looks like, so tests load them through the same ``from_pretrained`` path:

=============  ==========================================================================================
``dac``        transformers ``DacModel`` shaped like the Higgs Audio v2 tokenizer: 24 kHz, ratios
               [8,5,4,2,3], hop 960, 25 frames/s, 8 codebooks x 1024. tiny: encoder_hidden_size=8,
               decoder_hidden_size=64, hidden_size=32, codebook_dim=8 (~1 M params); full: ~126 M params.
``encodec``    transformers ``EncodecModel`` 24 kHz (hop 320). tiny: hidden 32, 4 filters, 1 LSTM layer.
``mimi``       transformers ``MimiModel`` 24 kHz (hop 1920). tiny: hidden 32, 1 transformer layer, 8 codebooks.
``wan``        diffusers ``AutoencoderKLWan`` (Wan 2.1 VAE, Cosmos-Predict2). tiny: base_dim=3, z_dim=16,
               dim_mult=[1,1,1,1], num_res_blocks=1; full: the default (real) config.
``cosmos``     diffusers ``AutoencoderKLCosmos`` (Cosmos 1.0 CV8x8x8). tiny: encoder channels
               (8,16,16,16), decoder (16,16,16,16), num_layers=1; full: the default config.
``tokenizer``  a byte-level BPE ``PreTrainedTokenizerFast`` (300 ids) trained on a few sentences, for ``hf``,
               plus the Llama-3 / Higgs-Audio chat tokens (``<|begin_of_text|>`` ... ``<|AUDIO_OUT|>``,
               ``<image>``) as added special tokens (ids 300..310) and a Llama-3 header-style
               ``chat_template``, so ``apply_chat_template`` and the ``tokenizer`` chat template work.
``lm``         transformers ``LlamaForCausalLM`` for the training recipes (``--model tts|vlm``). tiny:
               hidden 64, 2 layers, 4 heads (2 kv), intermediate 128, vocab 512 (covers the byte
               tokenizer's 270 ids and ``tokenizer``'s 311); full: the Llama-3.2-1B shape (~1.2 B params).
=============  ==========================================================================================

Random EnCodec and Mimi inits have all-zero codebook buffers (every frame gets code 0). Their codebooks
are filled here from a fixed calibration signal (chirp + noise), level by level as residual VQ works:
each quantizer's entries are Gaussian with the per-dimension mean and std of the residual reaching
it, and the ``cluster_size``/``cluster_usage``/``inited`` buffers are set (Mimi's cached
``codebook._embed`` is reset). Loading back gives non-constant codes. DAC's codebooks are ``nn.Embedding`` and need no fix.

Everything is seeded (``--seed``, default 0): the same command builds byte-identical weights.
Existing directories are skipped unless ``--force``; a model is written to a per-process temporary
sibling first and renamed into place, so an interrupted or concurrent build never leaves a
half-written model directory.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

SIZES = ("tiny", "full")

# -- configs ----------------------------------------------------------------------------------------


def dac_config(size: str = "tiny"):
    """``DacConfig`` with the Higgs Audio v2 tokenizer's code contract (24 kHz, hop 960, 8 x 1024)."""
    from transformers import DacConfig

    kw: dict[str, Any] = dict(
        downsampling_ratios=[8, 5, 4, 2, 3],
        upsampling_ratios=[8, 5, 4, 2, 3],
        hop_length=960,
        sampling_rate=24000,
        n_codebooks=8,
        codebook_size=1024,
    )
    if size == "tiny":
        kw.update(encoder_hidden_size=8, decoder_hidden_size=64, hidden_size=32, codebook_dim=8)
    return DacConfig(**kw)


def encodec_config(size: str = "tiny"):
    """``EncodecConfig`` of the 24 kHz model (full) or a narrow copy of it (tiny)."""
    from transformers import EncodecConfig

    if size == "tiny":
        return EncodecConfig(hidden_size=32, num_filters=4, num_lstm_layers=1, codebook_size=1024)
    return EncodecConfig()


def mimi_config(size: str = "tiny"):
    """``MimiConfig`` of kyutai/mimi (full) or a narrow copy with 8 codebooks (tiny)."""
    from transformers import MimiConfig

    if size == "tiny":
        return MimiConfig(
            hidden_size=32,
            num_filters=4,
            num_hidden_layers=1,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            codebook_dim=16,
            vector_quantization_hidden_dimension=16,
            num_quantizers=8,
            upsample_groups=32,
        )
    return MimiConfig()


def wan_kwargs(size: str = "tiny") -> dict:
    """``AutoencoderKLWan`` constructor kwargs (``{}`` = the real default config)."""
    if size == "tiny":
        return dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    return {}


def cosmos_kwargs(size: str = "tiny") -> dict:
    """``AutoencoderKLCosmos`` constructor kwargs (``{}`` = the real default config)."""
    if size == "tiny":
        return dict(
            latent_channels=16,
            encoder_block_out_channels=(8, 16, 16, 16),
            decode_block_out_channels=(16, 16, 16, 16),
            num_layers=1,
        )
    return {}


# -- in-memory builders -----------------------------------------------------------------------------


def calibration_audio(sample_rate: int = 24000, seconds: float = 2.0, seed: int = 0):
    """float32 torch ``(1, 1, T)``: a 100 Hz -> 4 kHz chirp with amplitude modulation plus noise, peak < 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = int(sample_rate * seconds)
    t = torch.arange(n, dtype=torch.float64) / sample_rate
    f0, f1 = 100.0, 4000.0
    phase = 2 * math.pi * (f0 * t + (f1 - f0) * t * t / (2 * seconds))
    x = 0.4 * torch.sin(phase) * (0.6 + 0.4 * torch.sin(2 * math.pi * 3 * t))
    x = x + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    return x.clamp(-0.99, 0.99).to(torch.float32).view(1, 1, n)


def _fill_codebooks(layers, residual, g, set_entries: Callable) -> None:
    """Data-matched random init of residual VQ ``layers`` from ``residual`` ``(B, D, frames)``, level by level."""
    import torch

    for layer in layers:
        frames = residual.permute(0, 2, 1).reshape(-1, residual.shape[1])
        k = layer.codebook.codebook_size
        mean = frames.mean(dim=0, keepdim=True)
        spread = frames.std(dim=0, keepdim=True).clamp_min(1e-6)
        # Gaussian entries with the residual's per-dimension statistics: spread out like a trained
        # codebook (copies of calibration frames would create many near-ties between entries)
        entries = mean + spread * torch.randn(k, frames.shape[1], generator=g)
        set_entries(layer.codebook, entries)
        codes = layer.encode(residual)
        residual = residual - layer.decode(codes)


def _set_encodec_entries(cb, entries) -> None:
    cb.embed.copy_(entries)
    cb.embed_avg.copy_(entries)
    cb.cluster_size.fill_(1.0)
    cb.inited.fill_(1.0)


def _set_mimi_entries(cb, entries) -> None:
    cb.embed_sum.copy_(entries)  # embed = embed_sum / cluster_usage
    cb.cluster_usage.fill_(1.0)
    cb.initialized.fill_(1.0)
    cb._embed = None  # drop the cached embed so the next access recomputes it


def make_dac(size: str = "tiny", seed: int = 0):
    """Random ``DacModel`` (eval mode) of the given size."""
    import torch
    from transformers import DacModel

    torch.manual_seed(seed)
    return DacModel(dac_config(size)).eval()


def make_encodec(size: str = "tiny", seed: int = 0):
    """Random ``EncodecModel`` with calibrated (non-zero) codebooks."""
    import torch
    from transformers import EncodecModel

    torch.manual_seed(seed)
    model = EncodecModel(encodec_config(size)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = model.encoder(calibration_audio(model.config.sampling_rate, seed=seed))
        _fill_codebooks(model.quantizer.layers, emb, g, _set_encodec_entries)
    return model


def make_mimi(size: str = "tiny", seed: int = 0):
    """Random ``MimiModel`` with calibrated (non-zero) semantic and acoustic codebooks."""
    import torch
    from transformers import MimiModel

    torch.manual_seed(seed)
    model = MimiModel(mimi_config(size)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        latents = model.encoder(calibration_audio(model.config.sampling_rate, seed=seed)).latents
        for rvq in (model.quantizer.semantic_residual_vector_quantizer, model.quantizer.acoustic_residual_vector_quantizer):
            x = rvq.input_proj(latents) if rvq.input_proj is not None else latents
            _fill_codebooks(rvq.layers, x, g, _set_mimi_entries)
    return model


def make_wan(size: str = "tiny", seed: int = 0):
    """Random ``AutoencoderKLWan`` (tiny or the real default config)."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**wan_kwargs(size)).eval()


def make_cosmos(size: str = "tiny", seed: int = 0):
    """Random ``AutoencoderKLCosmos`` (tiny or the real default config)."""
    import torch
    from diffusers import AutoencoderKLCosmos

    torch.manual_seed(seed)
    return AutoencoderKLCosmos(**cosmos_kwargs(size)).eval()


TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Precompute the audio codes, image latents and text ids once; train from shards.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich.",
    "Le cœur déçu mais l'âme plutôt naïve, Louÿs rêva de crapaüter en canoë.",
    "日本語のテキストも少し含めます。",
    "0123456789 + - * / = ( ) [ ] { } < > ! ? , . ; :",
]


#: the chat templates' special tokens, as in :data:`precompute.chat.SPECIAL_TOKENS` (same order)
CHAT_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
    "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>", "<|audio_out_bos|>", "<|AUDIO_OUT|>", "<image>",
)

#: Llama-3 header style (as Higgs-Audio renders conversations); ``content`` is a string
LLAMA3_CHAT_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)


def make_tokenizer(size: str = "tiny", seed: int = 0):
    """Byte-level BPE ``PreTrainedTokenizerFast`` (``<pad>``=0, ``<s>``=1, ``</s>``=2, ``<unk>``=3) adding
    bos/eos, with :data:`CHAT_SPECIAL_TOKENS` as added special tokens and :data:`LLAMA3_CHAT_TEMPLATE`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    vocab = 300 if size == "tiny" else 1000
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(TOKENIZER_CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> <s> $B </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    # the chat templates' tokens (precompute.chat.SPECIAL_TOKENS), each a single id after the BPE vocab
    fast.add_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIAL_TOKENS], special_tokens=True)
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


MAKERS: dict[str, Callable] = {
    "dac": make_dac,
    "encodec": make_encodec,
    "mimi": make_mimi,
    "wan": make_wan,
    "cosmos": make_cosmos,
    "tokenizer": make_tokenizer,
    "lm": make_lm,
}

# -- saving -----------------------------------------------------------------------------------------


def model_dir(out: str | Path, name: str, size: str = "tiny") -> Path:
    """``OUT/<name>-<size>``."""
    return Path(out) / f"{name}-{size}"


def build(name: str, out: str | Path, size: str = "tiny", *, force: bool = False, seed: int = 0) -> tuple[Path, bool]:
    """Build model ``name`` and ``save_pretrained`` it to ``OUT/<name>-<size>``.

    Returns ``(path, built)``; ``built`` is False when the directory existed and ``force`` is False.
    The model is written to a temporary sibling and renamed into place.

    Raises:
        ValueError: unknown name or size.
    """
    if name not in MAKERS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MAKERS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; use one of {SIZES}")
    dest = model_dir(out, name, size)
    if dest.exists() and not force:
        return dest, False
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"  # per process: concurrent builds do not collide
    if tmp.exists():
        shutil.rmtree(tmp)
    obj = MAKERS[name](size=size, seed=seed)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Writing model shards" bar per model is noise here
    try:
        obj.save_pretrained(str(tmp))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if dest.exists():
        if not force:  # another process finished the same (seeded, identical) model first
            shutil.rmtree(tmp)
            return dest, False
        shutil.rmtree(dest)
    try:
        tmp.rename(dest)
    except OSError:  # lost a race against a concurrent --force build; its result is identical
        shutil.rmtree(tmp, ignore_errors=True)
        if not dest.exists():
            raise
    return dest, True


def build_models(
    out: str | Path,
    size: str = "tiny",
    only: list[str] | None = None,
    *,
    force: bool = False,
    seed: int = 0,
    log: Callable[[str], None] | None = print,
) -> dict[str, Path]:
    """Build several models (default: all of :data:`MAKERS`); returns ``{name: directory}``."""
    names = list(MAKERS) if not only else list(only)
    unknown = [n for n in names if n not in MAKERS]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; known: {', '.join(MAKERS)}")
    result: dict[str, Path] = {}
    for name in names:
        t0 = time.perf_counter()
        path, built = build(name, out, size, force=force, seed=seed)
        result[name] = path
        if log is not None:
            if built:
                log(f"built   {path}  ({_describe_params(path)}, {time.perf_counter() - t0:.2f} s)")
            else:
                log(f"exists  {path}  (skipped; --force to rebuild)")
    return result


def _describe_params(path: Path) -> str:
    total = 0
    for f in path.glob("*.safetensors"):
        try:
            from safetensors import safe_open

            with safe_open(str(f), "np") as fh:
                for k in fh.keys():
                    total += math.prod(fh.get_slice(k).get_shape())
        except Exception:  # pragma: no cover - informational only
            return "?"
    if total == 0:
        return "tokenizer"
    return f"{total / 1e6:.2f} M params"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m precompute.random_models",
        description="Build randomly initialised encoder models of the real architectures (save_pretrained).",
    )
    parser.add_argument("--out", required=True, help="output directory (models are written to OUT/<name>-<size>)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="tiny (seconds, for tests) or full (real configs)")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {','.join(MAKERS)}")
    parser.add_argument("--force", action="store_true", help="rebuild existing directories")
    parser.add_argument("--seed", type=int, default=0, help="torch seed (default 0)")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()] or None
    try:
        build_models(args.out, args.size, only, force=args.force, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
