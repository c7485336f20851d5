"""``--model.name higgs``: Higgs-Audio v2 itself, ``transformers``' ``HiggsAudioV2ForConditionalGeneration``.

Loaded with ``from_pretrained`` from a local directory or a hub id (``model.kwargs.lm``, or the
Higgs-Audio command line's ``--model_path``): the released ``bosonai/higgs-audio-v2-generation-3B-base``
in its ``transformers`` form (the default), or a local directory. Its config must say
``model_type: higgs_audio_v2``; a plain causal LM is refused (``--model.name tts`` trains one).

Batches: the loader turns the cached ``input_ids``/``labels``/``codes``/``audio_segments`` into exactly
what ``HiggsAudioV2Processor(..., output_labels=True)`` builds on the fly
(:class:`loaders.higgs.HiggsBatch`, this recipe's ``batch_transform``, run in the loader's workers):
frame-expanded audio tokens and delay tokens, ``audio_input_ids`` (B, T, Q) with the delay pattern,
``audio_input_ids_mask``, left-padded text, ``labels`` and ``audio_labels``. ``labels: targets``
trains only the turns a Higgs-Audio ChatML sample trains (``start_index``) instead of everything the
processor labels; ``input_audio: codes`` feeds user-turn audio as codes instead of dropping it as
the model's chat template does (see :mod:`loaders.higgs`).

Loss: the model's own (``outputs.loss``): per codebook, next-frame cross entropy over the audio
positions, summed over codebooks, plus the text head's next-token loss when ``use_text_head``
(the released checkpoint has the head). Each is a mean over the labelled positions of the micro
batch (transformers' ``ForCausalLMLoss``), not the per-sample mean of the other recipes.

LoRA (``--lora`` / ``model.kwargs.lora``): peft adapters on the model's attention projections
(q/k/v/o_proj by default, ``lora.targets`` to change); every other weight is frozen, so LoRA
checkpoints hold the adapters only. Without LoRA the whole model trains.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from loaders.higgs import HiggsBatch
from shardcache.pretrained import resolve_pretrained
from shardcache.weights import checkpoint_sha256
from shards.cache import Cache, Contract, Unknown
from shards.tokens import AUDIO_BOS, AUDIO_EOS, AUDIO_IN, AUDIO_OUT, AUDIO_OUT_BOS, EOM, EOT

from ..imports import blocked_imports
from .base import build_from, text_tokenizer, token_ids, tokenizer_pad_id
from .lm import LMRecipe, kwargs_lora, load_causal_lm, resolve_lm, touch

log = logging.getLogger("train")

DEFAULT_HIGGS = "bosonai/higgs-audio-v2-generation-3B-base"
MODEL_TYPE = "higgs_audio_v2"
#: Higgs-Audio v2's audio tokenizer (``HiggsAudioV2TokenizerModel``): 24 kHz audio, 960 samples a frame
CODEC_NAME, CODEC_SAMPLE_RATE, CODEC_FRAME_RATE = "higgs", 24000, 25.0
#: the batch keys ``HiggsAudioV2ForConditionalGeneration.forward`` takes
INPUTS = ("input_ids", "attention_mask", "audio_input_ids", "audio_input_ids_mask", "labels", "audio_labels")


def load_config(lm: Any):
    """The ``transformers`` config of ``lm`` (dir or hub id); ``ValueError`` unless it is ``higgs_audio_v2``."""
    name = resolve_lm(lm)
    with blocked_imports():
        from transformers import AutoConfig, PretrainedConfig
        try:
            raw, _ = PretrainedConfig.get_config_dict(name)   # its model_type, before transformers resolves it
        except OSError as e:
            raise OSError(f"could not load the config of {name!r} ({e}); pass model.kwargs.lm (or --model_path) = "
                          "a Higgs-Audio v2 checkpoint directory or hub id") from e
        model_type = raw.get("model_type")
        if model_type == "higgs_audio":
            raise ValueError(f"{name} is Higgs-Audio in Boson's own format (model_type 'higgs_audio', boson_multimodal): "
                             "--model.name higgs loads transformers' form (higgs_audio_v2): convert it with "
                             "transformers' convert_higgs_audio_v2_to_hf.py (docs/higgs-audio.md), or train it with "
                             "Boson's trainer on loaders.higgs.HiggsChatMLDataset")
        if model_type != MODEL_TYPE:
            raise ValueError(f"--model.name higgs needs a {MODEL_TYPE} checkpoint (transformers' "
                             f"HiggsAudioV2ForConditionalGeneration); {name} is {model_type!r}: for a plain causal LM "
                             "use --model.name tts")
        cfg = AutoConfig.from_pretrained(name)
    return cfg


TEXT_HEAD = "text_lm_head.weight"   #: the text head's weight in a checkpoint (HiggsAudioV2ForConditionalGeneration)


def checkpoint_keys(lm: Any) -> set[str]:
    """The weight names of checkpoint ``lm`` (dir or hub id), from its ``model.safetensors.index.json``
    or ``model.safetensors`` header (no tensor read). ``OSError`` when it has neither."""
    from safetensors import safe_open
    with blocked_imports():
        from transformers.utils import cached_file

    name = resolve_lm(lm)
    index = cached_file(name, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index:
        return set(json.loads(Path(index).read_text())["weight_map"])
    single = cached_file(name, "model.safetensors", _raise_exceptions_for_missing_entries=False)
    if not single:
        raise OSError(f"{name} has no model.safetensors(.index.json): cannot tell whether it has a text head")
    with safe_open(single, "pt") as f:
        return set(f.keys())


#: the files of a checkpoint that name its paired audio tokenizer (``transformers``' processor: the
#: ``audio_tokenizer`` entry of ``processor_config.json``, or ``audio_tokenizer_config.json``)
PROCESSOR_FILES = ("audio_tokenizer_config.json", "processor_config.json")


def paired_audio_tokenizer(lm: Any) -> str | None:
    """The audio tokenizer checkpoint ``lm``'s processor names (``audio_tokenizer_name_or_path``, what
    ``HiggsAudioV2Processor.from_pretrained`` loads), None when it names none (no processor files)."""
    name = resolve_lm(lm)
    with blocked_imports():
        from transformers.utils import cached_file
    for f in PROCESSOR_FILES:
        path = cached_file(name, f, _raise_exceptions_for_missing_entries=False)
        d = json.loads(Path(path).read_text()) if path else {}
        d = d.get("audio_tokenizer", d) if f == "processor_config.json" else d
        if isinstance(d, dict) and d.get("audio_tokenizer_name_or_path"):
            return str(d["audio_tokenizer_name_or_path"])
    return None


def codec_weights(lm: Any) -> Any:
    """The weights (:func:`shardcache.weights.checkpoint_sha256`) of the audio tokenizer Higgs-Audio v2
    checkpoint ``lm`` names in its processor config; Unknown (met by no cache, saying what to give) when it
    names none or its weights cannot be read here. ``--model.audio_tokenizer`` replaces it
    (:func:`train.models.run_contract`)."""
    tok = paired_audio_tokenizer(lm)
    if not tok:
        return Unknown(f"{resolve_lm(lm)} names no audio tokenizer (no processor_config.json): name the one its codes "
                       "come from with --model.audio_tokenizer (--audio_tokenizer_path)")
    try:
        return checkpoint_sha256(resolve_pretrained(tok, what="the paired audio tokenizer"))
    except (OSError, ValueError) as e:
        return Unknown(f"the paired audio tokenizer {tok} cannot be read here ({e}): name a local copy with "
                       "--model.audio_tokenizer")


class HiggsModel(LMRecipe):
    """``HiggsAudioV2ForConditionalGeneration`` fine-tuned on the cache (see the module docstring).

    Args (``model.kwargs``; the cache's ids come from ``manifest.json`` through :class:`shards.Cache`, :func:`train.recipes.base.cache_values`):
        lm: checkpoint directory or hub id (default :data:`DEFAULT_HIGGS`).
        tokenizer: the text tokenizer ``lm`` was trained with, for a checkpoint that ships none (its
            contract compares it with the cache's; not loaded to train).
        dtype: weight dtype (float32 | bfloat16 | float16), default float32.
        attn_implementation: passed to ``from_pretrained`` (default: transformers' choice).
        lora: false | true | {r, alpha, dropout, targets}.
        labels: ``processor`` (default: what ``HiggsAudioV2Processor(output_labels=True)`` labels) |
            ``targets`` (the trained turns of the ChatML samples only, Higgs-Audio's rule).
        input_audio: ``drop`` (default, as the chat template) | ``codes`` (user-turn audio as codes).
        use_text_head: load the checkpoint's text head and add its loss (default True, as the
            converted checkpoint has it); False: audio loss only.
        create_text_head: with ``use_text_head``, a checkpoint without a text head
            (``text_lm_head.weight``) gets a new randomly initialised one (default False: refused).
        n_codebooks, codebook_size, pad_id, audio_*_token_id, eot_token_id, eom_token_id: the cache's.

    Raises ``ValueError`` when the cache does not fit the model: other placeholder ids (tokenized
    with another tokenizer), other number of codebooks, codes that reach the stream BOS/EOS ids,
    text ids past the model's vocabulary; ``use_text_head`` on a checkpoint without a text head unless
    ``create_text_head`` (checked before any weight loads).
    """

    fields = HiggsBatch.fields
    media_name = "audio"
    default_checkpoint = DEFAULT_HIGGS

    contract_items = {
        "fields": "`input_ids`, `labels`, `codes`, `audio_segments` (the processor's batch)",
        "special_tokens.<|AUDIO_OUT|>": "config `audio_token_id`",
        "special_tokens.<|audio_out_bos|>": "config `audio_bos_token_id`",
        "special_tokens.<|AUDIO|>": "its tokenizer's id", "special_tokens.<|audio_bos|>": "its tokenizer's id",
        "special_tokens.<|audio_eos|>": "its tokenizer's id", "special_tokens.<|eot_id|>": "its tokenizer's id",
        "special_tokens.<|eom_id|>": "its tokenizer's id",
        "pad_id": "its tokenizer's pad id (else eos), as stage one pads",
        "codec.name": "`higgs` (Higgs-Audio v2's audio tokenizer)", "codec.sample_rate": "24000 Hz",
        "codec.frame_rate": "25 frames/s", "codec.n_codebooks": "config `num_codebooks`",
        "codec.codebook_size": "config `audio_stream_bos_id`",
        "codec.bandwidth": "codebooks x log2(size) x 25 / 1000 kbps",
        "codec.weights": "the paired audio tokenizer: `--model.audio_tokenizer`, else the checkpoint's processor "
                         "config (neither: refused)",
        "codec.dtype": "`float32` (the processor encodes in float32)",
        "text_tokenizer": "the checkpoint's tokenizer, else `model.kwargs.tokenizer` (neither: refused)",
        "chat_template": "`llama3` (Boson's `prepare_chatml_sample` layout)",
        "label_policy": "`answers` (the assistant turns: Boson's labels)",
    }

    @classmethod
    def contract(cls, kwargs) -> Contract:
        """The checkpoint's (its config, tokenizer and processor files; the paired audio tokenizer's
        tensors, never the model's): codes of Higgs-Audio's own tokenizer (name, 24 kHz, 25 frames/s, the
        model's codebooks of ``audio_stream_bos_id`` codes, hence its bandwidth in kbps: codebooks x
        log2(size) bits x 25 / 1000; the weights of its paired audio tokenizer, computed in float32),
        rendered with Higgs-Audio's layout (``llama3``) and labelled on the answers, by its tokenizer
        (fingerprint, every special id the model reads, the pad id)."""
        lm = kwargs.get("lm", DEFAULT_HIGGS)
        cfg = load_config(lm)
        size = int(cfg.audio_stream_bos_id)
        tok, fingerprint = text_tokenizer(lm, kwargs.get("tokenizer"))
        ids = {AUDIO_OUT: int(cfg.audio_token_id), AUDIO_OUT_BOS: int(cfg.audio_bos_token_id)}
        if tok is not None:
            ids |= {t: i for t, i in token_ids(tok, (AUDIO_IN, AUDIO_BOS, AUDIO_EOS, EOT, EOM)).items()
                    if not isinstance(i, Unknown)}       # a token its tokenizer lacks is not read
        values = {f"special_tokens.{t}": i for t, i in ids.items()} | {
            "pad_id": tokenizer_pad_id(tok) if tok is not None else None,
            "codec.name": CODEC_NAME, "codec.sample_rate": CODEC_SAMPLE_RATE, "codec.frame_rate": CODEC_FRAME_RATE,
            "codec.n_codebooks": int(cfg.num_codebooks), "codec.codebook_size": size,
            "codec.bandwidth": cfg.num_codebooks * math.log2(size) * CODEC_FRAME_RATE / 1000,
            "codec.weights": codec_weights(lm), "codec.dtype": "float32",
            "text_tokenizer": fingerprint, "chat_template": "llama3", "label_policy": "answers"}
        return cls.contract_of("--model.name higgs", values)

    @classmethod
    def from_cache(cls, cache: Cache, kwargs, *, latent_loss: str = "none", latent_loss_weight: float = 1.0):
        cls.no_latent_loss(latent_loss)
        return build_from(cls, cache, kwargs, (
            "n_codebooks", "codebook_size", "vocab_size", "pad_id", "audio_in_token_id", "audio_out_token_id",
            "audio_out_bos_token_id", "audio_eos_token_id", "audio_bos_token_id", "eot_token_id", "eom_token_id"))

    def __init__(self, *, lm: str = DEFAULT_HIGGS, tokenizer: str | None = None, dtype: str = "float32",
                 attn_implementation: str | None = None, lora: Any = False, labels: str = "processor", input_audio: str = "drop", use_text_head: bool = True,
                 create_text_head: bool = False,
                 n_codebooks: int = 8, codebook_size: int = 1024, vocab_size: int | None = None, pad_id: int = 0,
                 audio_in_token_id: int | None = None, audio_out_token_id: int | None = None,
                 audio_out_bos_token_id: int | None = None, audio_eos_token_id: int | None = None,
                 audio_bos_token_id: int | None = None, eot_token_id: int | None = None,
                 eom_token_id: int | None = None) -> None:
        super().__init__()
        cfg = load_config(lm)
        cache = {AUDIO_OUT: (audio_out_token_id, cfg.audio_token_id),
                 AUDIO_OUT_BOS: (audio_out_bos_token_id, cfg.audio_bos_token_id)}
        bad = {t: ids for t, ids in cache.items() if ids[0] is not None and ids[0] != ids[1]}
        if bad:
            raise ValueError("the cache was tokenized with another tokenizer than the model's: "
                             + ", ".join(f"{t} is {a} in the cache, {b} in the model" for t, (a, b) in bad.items())
                             + f"; precompute with text_tokenizer.pretrained = {lm}")
        if int(n_codebooks) != cfg.num_codebooks:
            raise ValueError(f"the cache has {n_codebooks} codebooks, the model {cfg.num_codebooks}: encode with the "
                             "model's audio tokenizer (audio_tokenizer: {name: higgs, ...})")
        if int(codebook_size) > cfg.audio_stream_bos_id:
            raise ValueError(f"the cache's codec has {codebook_size} codes; the model's stream BOS/EOS ids are "
                             f"{cfg.audio_stream_bos_id}/{cfg.audio_stream_eos_id}: codes would collide with them")
        if vocab_size is not None and int(vocab_size) > cfg.vocab_size:
            raise ValueError(f"the cache's text vocabulary ({vocab_size}) exceeds the model's ({cfg.vocab_size})")
        self.use_text_head = bool(use_text_head)
        if self.use_text_head and not create_text_head and TEXT_HEAD not in checkpoint_keys(lm):
            raise ValueError(f"{resolve_lm(lm)} has no text head ({TEXT_HEAD}): set model.kwargs.create_text_head: "
                             "true to train a new randomly initialised one (its loss is added), or "
                             "use_text_head: false (audio loss only)")
        self.lm = load_causal_lm(lm, None, dtype, attn_implementation, model_class="HiggsAudioV2ForConditionalGeneration",
                                 use_text_head=self.use_text_head)
        self.lm_name = str(lm)
        self.lora = None
        self.hidden_size = cfg.hidden_size
        #: the loader transform (``ShardLoader(transform=...)``): the processor's batch from the cached tensors
        self.batch_transform = HiggsBatch(
            audio_token_id=cfg.audio_token_id, audio_bos_token_id=cfg.audio_bos_token_id,
            audio_delay_token_id=cfg.audio_delay_token_id, pad_token_id=pad_id,
            audio_stream_bos_id=cfg.audio_stream_bos_id, audio_stream_eos_id=cfg.audio_stream_eos_id,
            num_codebooks=cfg.num_codebooks, audio_in_token_id=audio_in_token_id,
            audio_in_bos_token_id=audio_bos_token_id, audio_eos_token_id=audio_eos_token_id,
            eot_token_id=eot_token_id, eom_token_id=eom_token_id, labels=labels, input_audio=input_audio)
        self._finish_init(False, kwargs_lora(lora))

    def media_modules(self) -> list[nn.Module]:
        return []  # every weight is the model's own: one "lm" optimizer group

    def checkpoint_config(self) -> dict:
        """The model's ``transformers`` config (stored in each checkpoint's ``config.json``)."""
        return self.lm.config.to_dict()

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """``batch``: :class:`loaders.higgs.HiggsBatch` output on the device. Returns ``{"loss"}``
        (0-dim float32): the model's own loss."""
        kw = {k: batch[k] for k in INPUTS if k in batch}
        if not self.use_text_head:
            kw.pop("labels", None)
        out = self.lm(**kw, use_cache=False)
        loss = out.loss
        if loss is None:   # nothing labelled (no audio, no text head): a zero that reaches every weight
            loss = out.logits.float().sum() * 0.0 + touch(self.lm.parameters()).to(out.logits.device)
        return {"loss": loss.float()}
