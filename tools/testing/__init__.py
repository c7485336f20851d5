"""Test and demo support: randomly initialised models of the real architectures (no weights can be
downloaded here), for the tests, the demo and ``make models``.

Usage::

    python -m tools.testing --out models [--size tiny|full] [--only dac,wan,...] [--force] [--seed 0]

Writes ``OUT/<name>-<size>`` with ``save_pretrained`` (config + safetensors), exactly what a user's real
checkpoint directory looks like, so tests load them through the same ``from_pretrained`` path:

====================  ==========================================================================================
``dac``               transformers ``DacModel`` shaped like the Higgs Audio v2 tokenizer: 24 kHz, ratios
                      [8,5,4,2,3], hop 960, 25 frames/s, 8 codebooks x 1024. tiny: encoder_hidden_size=8,
                      decoder_hidden_size=64, hidden_size=32, codebook_dim=8 (~1 M params); full: ~126 M params.
``encodec``           transformers ``EncodecModel`` 24 kHz (hop 320). tiny: hidden 32, 4 filters, 1 LSTM layer.
``mimi``              transformers ``MimiModel`` 24 kHz (hop 1920). tiny: hidden 32, 1 transformer layer, 8 codebooks.
``wan``               diffusers ``AutoencoderKLWan`` (Wan 2.1 VAE, Cosmos-Predict2). tiny: base_dim=3, z_dim=16,
                      dim_mult=[1,1,1,1], num_res_blocks=1; full: the default (real) config.
``cosmos``            diffusers ``AutoencoderKLCosmos`` (Cosmos 1.0 CV8x8x8). tiny: encoder channels
                      (8,16,16,16), decoder (16,16,16,16), num_layers=1; full: the default config.
``tokenizer``         a byte-level BPE ``PreTrainedTokenizerFast`` (300 ids) trained on a few sentences, for ``hf``,
                      plus the Llama-3 / Higgs-Audio chat tokens (``<|begin_of_text|>`` ... ``<|AUDIO_OUT|>``,
                      ``<image>``) as added special tokens (ids 300..310) and a Llama-3 header-style
                      ``chat_template``, so ``apply_chat_template`` and the ``tokenizer`` chat template work.
``gemma3-tokenizer``  a byte-level BPE with Gemma 3's special tokens (``<bos>``, ``<start_of_turn>``,
                      ``<start_of_image>``...) and its real chat template (:mod:`.chat_templates`; also Llama 3's and
                      Qwen2-VL's, built by the tests).
``lm``                transformers ``LlamaForCausalLM`` for the training recipes (``--model.name tts|vlm``). tiny:
                      hidden 64, 2 layers, 4 heads (2 kv), intermediate 128, vocab 512 (covers the byte
                      tokenizer's 270 ids and ``tokenizer``'s 311); full: the Llama-3.2-1B shape (~1.2 B params).
``higgs``             transformers ``HiggsAudioV2ForConditionalGeneration`` (``model_type: higgs_audio_v2``, text
                      head included) and its text tokenizer in one directory, like the released checkpoint:
                      Llama-3 conventions, the chat tokens and the delay token as single ids, Higgs-Audio v2's
                      real chat template; 8 codebooks of 1024 + stream BOS/EOS. tiny: hidden 64, 2 layers (:mod:`.higgs`).
``higgs-audio-tokenizer``
                      transformers ``HiggsAudioV2TokenizerModel``: 24 kHz, 25 frames/s, 8 codebooks x
                      1024. tiny: narrow DAC + one-layer HuBERT reading 24 kHz (built and run with the test
                      stand-in for torchaudio where the real one cannot load: :mod:`tools.torchaudio_shim`).
``gemma3``            transformers ``Gemma3ForConditionalGeneration`` + its ``Gemma3Processor`` in one directory,
                      like ``google/gemma-3-4b-it`` (``--model.name theworld``, stage one's ``image_features``). tiny:
                      SigLIP 64 px / patch 8, 16 image tokens, Gemma 3 text hidden 64, 2 layers (:mod:`.gemma3`).
====================  ===================================================================================

EnCodec, Mimi and Higgs-tokenizer codebooks are calibrated so random models give non-constant codes (:mod:`.codecs`).

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
import time
from pathlib import Path
from typing import Callable

from . import chat_templates, codecs, gemma3, higgs, text, vaes

SIZES = ("tiny", "full")

#: name -> ``make(size, seed)``: every model this package builds (one module per family)
MAKERS: dict[str, Callable] = {**codecs.MAKERS, **vaes.MAKERS, **text.MAKERS, **chat_templates.MAKERS,
                               **higgs.MAKERS, **gemma3.MAKERS}

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
        prog="python -m tools.testing",
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


