"""``--model.name tts``: a Higgs-Audio-shaped speech LM on a ``transformers`` causal LM.

Layout (Higgs-Audio v2, ``boson_multimodal``: ``model/higgs_audio/modeling_higgs_audio.py``,
``model/higgs_audio/utils.py`` (delay pattern, ``merge_input_ids_with_audio_features``),
``data_collator/higgs_audio_collator.py``)::

    text ... <|audio_out_bos|> <|AUDIO_OUT|> <|audio_eos|> ...      (input_ids, one placeholder per item)
                               |
                               v  replaced by the item's n + Q + 1 delayed frames
    text ... <|audio_out_bos|> f_0 f_1 ... f_{n+Q} <|audio_eos|> ...

Audio item k of a sample (row k of ``audio_segments``) is ``codes[:, start:start + n]`` (Q, n).
A stream-BOS column (id ``codebook_size``) is prepended and a stream-EOS column
(``codebook_size + 1``) appended, then the MusicGen delay pattern shifts codebook q right by q
(:func:`loaders.higgs.build_delay_pattern`, Higgs ``build_delay_pattern_mask`` with bos = stream BOS, pad = stream
EOS): (Q, n + 2) -> (Q, n + Q + 1). Frame j's input embedding is the sum over codebooks of
``audio_embed[q * (codebook_size + 2) + id[q, j]]`` (one table of Q x (codebook_size + 2) rows, as
Higgs' ``audio_codebook_embeddings``). Input (``<|AUDIO|>``) and output (``<|AUDIO_OUT|>``) items
are embedded the same way.

Audio loss (Higgs' ``label_audio_ids``): labels of an item are ``[-100, codes, EOS]`` delayed with
-100 fill, so each codebook is trained on its n codes and one EOS. The hidden state at frame j
predicts the labels of frame j + 1 through one ``Linear(hidden, codebook_size + 2)`` head per
codebook. Only OUTPUT items of trained turns count: an item is trained iff its ``<|AUDIO_OUT|>``
placeholder has a label != -100, Higgs' rule (``prepare_chatml_sample`` labels the placeholder of a
trained turn, ``HiggsAudioSampleCollator`` reads that label to pick the target items). Text loss:
next-token cross entropy on ``labels`` (a placeholder's own label is dropped with the placeholder,
as the collator masks it; the token after an item, ``<|audio_eos|>``, is predicted from the item's
last frame). Both per-sample normalised (see :mod:`train.recipes.lm`);
``loss = text_loss_weight * text_loss + audio_loss_weight * audio_loss``.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from loaders.higgs import build_delay_pattern, delay_segments, revert_delay_pattern  # noqa: F401 (re-exported)

from shards.cache import Cache, Contract
from shards.tokens import AUDIO_IN, AUDIO_OUT, AUDIO_OUT_BOS

from .base import build_from, text_tokenizer
from .lm import (DEFAULT_LM, IGNORE_INDEX, LMRecipe, Merged, kwargs_lora, merge_placeholders,
                 next_token_loss, per_sample_mean, touch)

log = logging.getLogger("train")

#: ``audio_segments`` columns (contract): item, turn, direction (0 in, 1 out), code_start, code_frames, speaker
SEG_DIRECTION, SEG_START, SEG_FRAMES = 2, 3, 4


class TTSModel(LMRecipe):
    """Higgs-Audio-shaped speech LM (see the module docstring).

    Args (``--model.kwargs``; the spec ids come from ``manifest.json`` through ``build_model``):
        lm: LM directory or hub id for ``AutoModelForCausalLM.from_pretrained`` (default :data:`train.recipes.lm.DEFAULT_LM`).
        dtype: LM weight dtype (float32 | bfloat16 | float16), default float32.
        attn_implementation: passed to ``from_pretrained`` (default: transformers' choice, sdpa).
        freeze_lm: train only the audio modules (and LoRA adapters); default False (full fine-tune).
        lora: false | true | {r, alpha, dropout, targets}: peft LoRA on the LM (q/k/v/o_proj by default).
        text_loss_weight, audio_loss_weight: loss weights (default 1, 1).
        audio_lr: learning rate of the audio embeddings and heads in :meth:`optimizer_groups`
            (default: the run's lr).
        tokenizer: the text tokenizer the LM was trained with, for an LM that ships none (its contract
            compares it with the cache's; not loaded to train).
        revision, tokenizer_revision: the hub revision (branch, tag or commit; default ``main``) of ``lm``
            and of ``tokenizer`` (a local folder has none: refused).
        n_codebooks, codebook_size, vocab_size, pad_id, audio_in_token_id, audio_out_token_id,
        audio_out_bos_token_id: from the cache (:func:`train.recipes.base.cache_values`).

    Batch: ``input_ids`` int64 (B, L), ``labels`` int64 (B, L), ``attention_mask`` bool (B, L)
    (optional), ``codes`` int64 (B, Q, F) padded -100, ``audio_segments`` int64 (B, S, 6) padded -1,
    ``audio_segments_count`` (B,) (optional). Returns {"loss", "text_loss", "audio_loss"} (0-dim float32).
    """

    fields = ("input_ids", "labels", "codes", "audio_segments")
    media_name = "audio"  #: optimizer_groups name of the recipe's own modules

    contract_items = {"fields": "`input_ids`, `labels`, `codes`, `audio_segments`",
                      f"special_tokens.{AUDIO_OUT}": "`model.kwargs.audio_out_token_id`, else any id",
                      "text_tokenizer": "the LM's tokenizer, else `model.kwargs.tokenizer` (neither: refused)"}

    @classmethod
    def contract(cls, kwargs) -> Contract:
        """Conversations with ``<|AUDIO_OUT|>`` items as codes, from any codec (the audio embeddings are new,
        sized from the cache), tokenized by the LM's own tokenizer (``model.kwargs.tokenizer`` for an LM that
        ships none: its token embeddings mean those ids; they are resized to the cache's vocabulary)."""
        _, fingerprint, _ = text_tokenizer(kwargs.get("lm", DEFAULT_LM), kwargs.get("tokenizer"), kwargs=kwargs)
        return cls.contract_of("--model.name tts", {f"special_tokens.{AUDIO_OUT}": kwargs.get("audio_out_token_id"),
                                                    "text_tokenizer": fingerprint})

    @classmethod
    def from_cache(cls, cache: Cache, kwargs, *, latent_loss: str = "none", latent_loss_weight: float = 1.0):
        cls.no_latent_loss(latent_loss)
        return build_from(cls, cache, kwargs, ("n_codebooks", "codebook_size", "vocab_size", "pad_id",
                                               "audio_in_token_id", "audio_out_token_id", "audio_out_bos_token_id"))

    def __init__(self, *, n_codebooks: int = 8, codebook_size: int = 1024, vocab_size: int | None = None,
                 pad_id: int = 0, audio_in_token_id: int | None = None, audio_out_token_id: int | None = None,
                 audio_out_bos_token_id: int | None = None, lm: str = DEFAULT_LM, dtype: str = "float32",
                 attn_implementation: str | None = None, freeze_lm: bool = False, lora: Any = False,
                 text_loss_weight: float = 1.0, audio_loss_weight: float = 1.0,
                 audio_lr: float | None = None, tokenizer: str | None = None, revision: str | None = None,
                 tokenizer_revision: str | None = None) -> None:
        super().__init__()
        if audio_out_token_id is None:
            raise ValueError(f"--model.name tts needs the id of {AUDIO_OUT}: the cache's manifest.json has no "
                             "text.special_token_ids (made without conversations?); pass "
                             "model_kwargs.audio_out_token_id (and audio_in_token_id)")
        self.n_codebooks, self.codebook_size = int(n_codebooks), int(codebook_size)
        self.stream_bos, self.stream_eos = self.codebook_size, self.codebook_size + 1
        self.pad_id = int(pad_id)
        self.audio_in_token_id = audio_in_token_id
        self.audio_out_token_id = int(audio_out_token_id)
        self.audio_out_bos_token_id = audio_out_bos_token_id
        self.text_loss_weight, self.audio_loss_weight = float(text_loss_weight), float(audio_loss_weight)
        self.audio_lr = audio_lr
        self._init_lm(lm, vocab_size, dtype, attn_implementation, revision)
        D, V, Q = self.hidden_size, self.codebook_size + 2, self.n_codebooks
        std = float(getattr(self.lm.config, "initializer_range", 0.02))
        self.audio_embed = nn.Embedding(Q * V, D)       # row q * V + id: codebook q's table
        nn.init.normal_(self.audio_embed.weight, std=std)
        self.audio_heads = nn.ModuleList(nn.Linear(D, V, bias=False) for _ in range(Q))
        for h in self.audio_heads:
            nn.init.normal_(h.weight, std=std)
        self.register_buffer("code_offsets", torch.arange(Q) * V, persistent=False)
        self._finish_init(freeze_lm, kwargs_lora(lora))

    def media_modules(self) -> list[nn.Module]:
        return [self.audio_embed, self.audio_heads]

    def _lr_of_media(self, lr: float) -> float:
        return float(self.audio_lr) if self.audio_lr is not None else lr

    # -- forward ------------------------------------------------------------------------------------

    def merge(self, batch: dict[str, Any]) -> tuple[Merged, dict[str, torch.Tensor]]:
        """The merged LM inputs and, per audio item n (placeholder order), ``ids``/``labels``
        (N, Q, M) from :func:`delay_segments`, ``direction`` (N,) and ``trained`` (N,) bool."""
        ids, valid, labels = self._text(batch)
        B = ids.shape[0]
        dev = ids.device
        is_out = ids == self.audio_out_token_id
        is_in = ids == self.audio_in_token_id if self.audio_in_token_id is not None else torch.zeros_like(is_out)
        ph = (is_out | is_in) & valid
        seg = batch.get("audio_segments")
        if seg is None:
            seg = torch.full((B, 0, 6), -1, dtype=torch.long, device=dev)
        seg = seg.long()
        if batch.get("audio_segments_count") is not None:
            row_ok = torch.arange(seg.shape[1], device=dev)[None, :] < batch["audio_segments_count"][:, None]
        else:
            row_ok = seg[..., 0] >= 0
        n_ph, n_seg = ph.sum(1), row_ok.sum(1)
        if bool((n_ph != n_seg).any()):
            b = int((n_ph != n_seg).nonzero()[0])
            key = batch.get("keys", [None] * B)[b]
            raise ValueError(f"sample {b} ({key}): {int(n_ph[b])} audio placeholder tokens but "
                             f"{int(n_seg[b])} audio_segments rows (are audio_in/out_token_id those of the cache?)")
        rows = seg[row_ok]                                            # (N, 6), row-major = placeholder order
        pb, pi = ph.nonzero(as_tuple=True)
        direction = rows[:, SEG_DIRECTION]
        out_tok = is_out[pb, pi]
        if bool((out_tok != (direction == 1)).any()):
            raise ValueError("audio_segments direction disagrees with the placeholder token "
                             f"({AUDIO_OUT} must be an output item, {AUDIO_IN} an input item)")
        prev = (pi - 1).clamp_min(0)
        if self.audio_out_bos_token_id is not None and bool(
                (out_tok & ((pi == 0) | (ids[pb, prev] != self.audio_out_bos_token_id))).any()):
            raise ValueError(f"an {AUDIO_OUT} token is not preceded by {AUDIO_OUT_BOS}")
        trained = out_tok & (labels[pb, pi] != IGNORE_INDEX)   # Higgs: the placeholder's own label
        codes = batch.get("codes")
        if codes is None:
            codes = torch.zeros((B, self.n_codebooks, 0), dtype=torch.long, device=dev)
        codes = codes.long()
        if codes.shape[1] != self.n_codebooks:
            raise ValueError(f"batch has {codes.shape[1]} codebooks, the model was built for {self.n_codebooks}")
        a_ids, a_labels, lengths = delay_segments(codes, pb, rows[:, SEG_START], rows[:, SEG_FRAMES],
                                                  self.stream_bos, self.stream_eos)
        N, Q, M = a_ids.shape
        flat = (a_ids + self.code_offsets[None, :, None]).permute(0, 2, 1).reshape(-1, Q)   # (N*M, Q)
        inserts = F.embedding_bag(flat, self.audio_embed.weight, mode="sum").view(N, M, self.hidden_size)
        embeds = self.lm.get_input_embeddings()(ids.clamp_min(0))
        merged = merge_placeholders(embeds, valid, labels, ph, inserts, lengths)
        return merged, {"ids": a_ids, "labels": a_labels, "direction": direction, "trained": trained}

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        merged, audio = self.merge(batch)
        hidden = self._run_lm(merged)                                   # (B, L2, D)
        B = hidden.shape[0]
        text_loss = next_token_loss(hidden, merged.labels, self.lm.get_output_embeddings())
        if text_loss is None:
            head = self.lm.get_output_embeddings().parameters()
            text_loss = hidden.float().sum() * 0.0 + touch(head).to(hidden.device)
        audio_loss = self._audio_loss(hidden, merged, audio, B)
        loss = self.text_loss_weight * text_loss + self.audio_loss_weight * audio_loss
        return {"loss": loss, "text_loss": text_loss.detach(), "audio_loss": audio_loss.detach()}

    def _audio_loss(self, hidden: torch.Tensor, merged: Merged, audio: dict, B: int) -> torch.Tensor:
        keep = audio["trained"].nonzero(as_tuple=True)[0]
        # 0 that reaches every audio parameter: DDP sees them used even without trained audio
        zero = touch(p for m in self.media_modules() for p in m.parameters()).to(hidden.device)
        if keep.numel() == 0:
            return zero
        lab = audio["labels"][keep][:, :, 1:]                           # frame j + 1's labels ...
        pos = merged.positions[keep][:, :-1]                            # ... from frame j's hidden state
        si, j = (lab != IGNORE_INDEX).any(1).nonzero(as_tuple=True)
        if si.numel() == 0:
            return zero
        sample = merged.batch_index[keep][si]
        h = hidden[sample, pos[si, j]]                                  # (K, D)
        h = h.to(self.audio_heads[0].weight.dtype)
        logits = torch.stack([head(h) for head in self.audio_heads], 1).float()   # (K, Q, V)
        target = lab[si, :, j]                                          # (K, Q)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="none").view(target.shape)
        ok = target != IGNORE_INDEX
        return per_sample_mean(ce[ok], sample[:, None].expand_as(target)[ok], B) + zero
