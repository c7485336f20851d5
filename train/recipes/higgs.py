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

import logging
from typing import Any

import torch
import torch.nn as nn

from loaders.higgs import (CODEC_FRAME_RATE, CODEC_NAME, CODEC_SAMPLE_RATE, PROCESSOR_FILES,  # noqa: F401 (re-exported)
                           HiggsBatch, codec_weights, contract_values, paired_audio_tokenizer)
from shardcache.weights import tensor_names
from shards.cache import Cache, Contract
from shards.tokens import AUDIO_BOS, AUDIO_EOS, AUDIO_IN, AUDIO_OUT, AUDIO_OUT_BOS, EOM, EOT

from ..imports import blocked_imports
from .base import build_from
from .lm import LMRecipe, kwargs_lora, load_causal_lm, resolve_lm, touch

log = logging.getLogger("train")

DEFAULT_HIGGS = "bosonai/higgs-audio-v2-generation-3B-base"
MODEL_TYPE = "higgs_audio_v2"
#: the batch keys ``HiggsAudioV2ForConditionalGeneration.forward`` takes
INPUTS = ("input_ids", "attention_mask", "audio_input_ids", "audio_input_ids_mask", "labels", "audio_labels")


def load_config(lm: Any, revision: str | None = None):
    """The ``transformers`` config of ``lm`` (dir or hub id, at ``revision``: default ``main``); ``ValueError``
    unless it is ``higgs_audio_v2``; :class:`shardcache.weights.LocalRevision` for a ``revision`` with a folder."""
    from shardcache.weights import checkpoint
    name = resolve_lm(lm)
    checkpoint(name, revision=revision, what="model.kwargs.revision")   # a folder has no revisions: refused
    revision = revision or None
    with blocked_imports():
        from transformers import AutoConfig, PretrainedConfig
        try:
            raw, _ = PretrainedConfig.get_config_dict(name, revision=revision)   # its model_type, before transformers
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
        cfg = AutoConfig.from_pretrained(name, revision=revision)
    return cfg


TEXT_HEAD = "text_lm_head.weight"   #: the text head's weight in a checkpoint (HiggsAudioV2ForConditionalGeneration)


def checkpoint_keys(lm: Any, revision: str | None = None) -> set[str]:
    """The weight names of checkpoint ``lm`` (dir or hub id, at ``revision``) in the files ``transformers`` loads
    (:func:`shardcache.weights.tensor_names`: headers only). Raises
    :class:`shardcache.weights.CheckpointUnreadable` naming the file that cannot be read."""
    return set(tensor_names(resolve_lm(lm), revision=revision))


class HiggsModel(LMRecipe):
    """``HiggsAudioV2ForConditionalGeneration`` fine-tuned on the cache (see the module docstring).

    Args (``model.kwargs``; the cache's ids come from ``manifest.json`` through :class:`shards.Cache`, :func:`train.recipes.base.cache_values`):
        lm: checkpoint directory or hub id (default :data:`DEFAULT_HIGGS`).
        tokenizer: the text tokenizer ``lm`` was trained with, for a checkpoint that ships none (its
            contract compares it with the cache's; not loaded to train).
        revision, tokenizer_revision: the hub revision (branch, tag or commit; default ``main``) of ``lm``
            (its config, tokenizer, processor config and weights alike) and of ``tokenizer`` (a local folder has
            none: refused). The audio tokenizer's: ``--model.audio_tokenizer_revision``; the one the
            checkpoint's processor config names is read at its ``main``, as ``HiggsAudioV2Processor`` loads it.
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
        f"special_tokens.{AUDIO_OUT}": "config `audio_token_id`",
        f"special_tokens.{AUDIO_OUT_BOS}": "config `audio_bos_token_id`",
        **{f"special_tokens.{t}": "its tokenizer's id" for t in (AUDIO_IN, AUDIO_BOS, AUDIO_EOS, EOT, EOM)},
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
        "label_policy": "`answers` (the assistant turns: Boson's labels), with `labels: targets` only (the "
                        "processor's labels are made from the ids: the cached ones are not read)",
    }

    @classmethod
    def contract(cls, kwargs) -> Contract:
        """The checkpoint's (its config, tokenizer and processor files; the paired audio tokenizer's
        tensors, never the model's): :func:`loaders.higgs.contract_values`, what
        :class:`loaders.higgs.HiggsChatMLDataset` compares too, over the fields a batch of
        ``model.kwargs.labels`` reads (:meth:`loaders.higgs.HiggsBatch.fields_read`: the cached labels, so
        their policy, only with ``labels: targets``)."""
        lm = kwargs.get("lm", DEFAULT_HIGGS)
        load_config(lm, kwargs.get("revision"))   # a Higgs-Audio v2 checkpoint in transformers' form, or refused
        with blocked_imports():
            values = contract_values(lm, kwargs.get("tokenizer"), revision=kwargs.get("revision"),
                                     tokenizer_revision=kwargs.get("tokenizer_revision"))
        return cls.contract_of("--model.name higgs", values,
                               reads=HiggsBatch.fields_read(kwargs.get("labels", "processor")))

    @classmethod
    def from_cache(cls, cache: Cache, kwargs, *, latent_loss: str = "none", latent_loss_weight: float = 1.0):
        cls.no_latent_loss(latent_loss)
        return build_from(cls, cache, kwargs, (
            "n_codebooks", "codebook_size", "vocab_size", "pad_id", "audio_in_token_id", "audio_out_token_id",
            "audio_out_bos_token_id", "audio_eos_token_id", "audio_bos_token_id", "eot_token_id", "eom_token_id"))

    def __init__(self, *, lm: str = DEFAULT_HIGGS, tokenizer: str | None = None, revision: str | None = None,
                 tokenizer_revision: str | None = None, dtype: str = "float32",
                 attn_implementation: str | None = None, lora: Any = False, labels: str = "processor", input_audio: str = "drop", use_text_head: bool = True,
                 create_text_head: bool = False,
                 n_codebooks: int = 8, codebook_size: int = 1024, vocab_size: int | None = None, pad_id: int = 0,
                 audio_in_token_id: int | None = None, audio_out_token_id: int | None = None,
                 audio_out_bos_token_id: int | None = None, audio_eos_token_id: int | None = None,
                 audio_bos_token_id: int | None = None, eot_token_id: int | None = None,
                 eom_token_id: int | None = None) -> None:
        super().__init__()
        cfg = load_config(lm, revision)
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
        if self.use_text_head and not create_text_head and TEXT_HEAD not in checkpoint_keys(lm, revision):
            raise ValueError(f"{resolve_lm(lm)} has no text head ({TEXT_HEAD}): set model.kwargs.create_text_head: "
                             "true to train a new randomly initialised one (its loss is added), or "
                             "use_text_head: false (audio loss only)")
        self.lm = load_causal_lm(lm, None, dtype, attn_implementation, model_class="HiggsAudioV2ForConditionalGeneration",
                                 revision=revision, use_text_head=self.use_text_head)
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
