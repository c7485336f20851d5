"""``--model.name vlm``: a LLaVA / TheWorld-shaped vision-language model on cached Cosmos latents.

A ``transformers`` causal LM (frozen by default) reads ``<image>`` tokens replaced by projected
latent patches::

    latents[b, :, k]  (C=16, H/8, W/8) float32 ─ p x p patches ─> (n_k, C*p*p) ─ projection ─> (n_k, hidden)
    input_ids  ... <image> ...    ->    ... patch_0 ... patch_{n_k - 1} ...   (k-th <image> of the sample)

As LLaVA (``llava/model/llava_arch.py`` ``prepare_inputs_labels_for_multimodal``) the image run
takes the place of the placeholder token, its labels are -100, and positions are the LM's own
1-D (RoPE) positions in row-major patch order; the projection is LLaVA-1.5's ``mlp2x_gelu``
(Linear -> GELU -> Linear) or a single Linear. TheWorld (Cosmos latents into a frozen LM) likewise
trains only the projection (~2 % of the parameters). Patches follow :class:`train.models.ReferenceModel`'s
order (row-major over (h/p, w/p), features ordered (C, p, p); H, W zero-padded to multiples of p).
With ``latents_mask`` (B, T, H, W) bool (latents of different sizes zero-padded by the loader) a
patch is kept when any of its cells is real, so image k contributes exactly its own patches.

Caption loss: next-token cross entropy on ``labels`` (assistant tokens; -100 elsewhere),
per-sample normalised (:mod:`train.recipes.lm`). Returns {"loss", "caption_loss"}.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from shards.cache import Cache, Contract
from shards.tokens import IMAGE

from .base import build_from, text_tokenizer
from .lm import DEFAULT_LM, LMRecipe, Merged, kwargs_lora, merge_placeholders, next_token_loss, touch

log = logging.getLogger("train")


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, T, H/p * W/p, C * p * p); H, W zero-padded to multiples of p."""
    B, C, T, H, W = latents.shape
    if H % p or W % p:
        latents = F.pad(latents, (0, (-W) % p, 0, (-H) % p))
        H, W = latents.shape[-2:]
    x = latents.reshape(B, C, T, H // p, p, W // p, p).permute(0, 2, 3, 5, 1, 4, 6)
    return x.reshape(B, T, (H // p) * (W // p), C * p * p)


def patchify_mask(mask: torch.Tensor, p: int) -> torch.Tensor:
    """(B, T, H, W) bool -> (B, T, H/p * W/p): a patch is valid when any of its cells is."""
    B, T, H, W = mask.shape
    if H % p or W % p:
        mask = F.pad(mask, (0, (-W) % p, 0, (-H) % p), value=False)
        H, W = mask.shape[-2:]
    return mask.reshape(B, T, H // p, p, W // p, p).any(5).any(3).reshape(B, T, (H // p) * (W // p))


class VLMModel(LMRecipe):
    """Latent-patch projection into a (frozen) causal LM (see the module docstring).

    Args (``--model.kwargs``; the spec values come from ``manifest.json`` through ``build_model``):
        lm: LM directory or hub id (default :data:`train.recipes.lm.DEFAULT_LM`).
        dtype, attn_implementation: as for ``from_pretrained`` (default float32, transformers' choice).
        freeze_lm: default True: only the projection (and LoRA adapters, if any) trains.
        lora: false | true | {r, alpha, dropout, targets}: peft LoRA on the LM (q/k/v/o_proj).
        patch_size: p (default 2): p x p latent cells per token.
        projector: ``mlp2`` (default, LLaVA-1.5) or ``linear``.
        projector_hidden: width of the mlp2 hidden layer (default: the LM hidden size).
        projection_lr: learning rate of the projection in :meth:`optimizer_groups`; default None =
            the run's lr (with a frozen LM the projection is all that trains, so ``--lr`` is its lr;
            set it, e.g. 10x lr, when LoRA or the full LM trains at a lower rate).
        max_trainable_fraction: with a frozen LM warn above this fraction (default 0.10).
        tokenizer: the text tokenizer the LM was trained with, for an LM that ships none (its contract
            compares it with the cache's; not loaded to train).
        revision, tokenizer_revision: the hub revision (branch, tag or commit; default ``main``) of ``lm``
            and of ``tokenizer`` (a local folder has none: refused).
        latent_channels, vocab_size, pad_id, image_token_id: from the cache (:func:`train.recipes.base.cache_values`).

    Batch: ``input_ids``/``labels`` int64 (B, L), ``attention_mask`` bool (B, L) (optional),
    ``latents`` float32 (B, C, T, H, W) (image k of sample b = ``latents[b, :, k]``), ``latents_mask``
    bool (B, T, H, W) (optional).
    """

    fields = ("input_ids", "labels", "latents")
    media_name = "projection"  #: optimizer_groups name of the recipe's own modules

    contract_items = {"fields": "`input_ids`, `labels`, `latents`",
                      "text_tokenizer": "the LM's tokenizer, else `model.kwargs.tokenizer` (neither: refused)"}

    @classmethod
    def contract(cls, kwargs) -> Contract:
        """Conversations with image latents from any VAE and preset (the projection is new, sized from
        the cache's latent channels), tokenized by the LM's own tokenizer (``model.kwargs.tokenizer`` for an
        LM that ships none: its token embeddings mean those ids; they are resized to the cache's vocabulary)."""
        _, fingerprint, _ = text_tokenizer(kwargs.get("lm", DEFAULT_LM), kwargs.get("tokenizer"), kwargs=kwargs)
        return cls.contract_of("--model.name vlm", {"text_tokenizer": fingerprint})

    @classmethod
    def from_cache(cls, cache: Cache, kwargs, *, latent_loss: str = "none", latent_loss_weight: float = 1.0):
        cls.no_latent_loss(latent_loss)
        return build_from(cls, cache, kwargs, ("latent_channels", "vocab_size", "pad_id", "image_token_id"))

    def __init__(self, *, latent_channels: int = 16, vocab_size: int | None = None, pad_id: int = 0,
                 image_token_id: int | None = None, lm: str = DEFAULT_LM, dtype: str = "float32",
                 attn_implementation: str | None = None, freeze_lm: bool = True, lora: Any = False,
                 patch_size: int = 2, projector: str = "mlp2", projector_hidden: int | None = None,
                 projection_lr: float | None = None, max_trainable_fraction: float = 0.10,
                 tokenizer: str | None = None, revision: str | None = None,
                 tokenizer_revision: str | None = None) -> None:
        super().__init__()
        if image_token_id is None:
            raise ValueError(f"--model.name vlm needs the id of {IMAGE}: the cache's manifest.json has no "
                             f"text.special_token_ids[{IMAGE!r}]; pass model_kwargs.image_token_id")
        if projector not in ("mlp2", "linear"):
            raise ValueError(f"projector must be mlp2 or linear, got {projector!r}")
        self.image_token_id, self.pad_id = int(image_token_id), int(pad_id)
        self.patch, self.latent_channels = int(patch_size), int(latent_channels)
        self.projection_lr = projection_lr
        self.max_trainable_fraction = max_trainable_fraction
        self._init_lm(lm, vocab_size, dtype, attn_implementation, revision)
        D = self.hidden_size
        d_in = self.latent_channels * self.patch * self.patch
        if projector == "linear":
            self.projector = nn.Sequential(nn.Linear(d_in, D))
        else:
            hid = int(projector_hidden or D)
            self.projector = nn.Sequential(nn.Linear(d_in, hid), nn.GELU(), nn.Linear(hid, D))
        self._finish_init(freeze_lm, kwargs_lora(lora))

    def media_modules(self) -> list[nn.Module]:
        return [self.projector]

    def _lr_of_media(self, lr: float) -> float:
        return float(self.projection_lr) if self.projection_lr is not None else lr

    def merge(self, batch: dict[str, Any]) -> Merged:
        """The LM inputs with every ``<image>`` replaced by its projected patches."""
        ids, valid, labels = self._text(batch)
        B = ids.shape[0]
        ph = (ids == self.image_token_id) & valid
        pb, pi = ph.nonzero(as_tuple=True)
        rank = (ph.long().cumsum(1) - 1)[pb, pi]                  # k: the k-th <image> of its sample
        embeds = self.lm.get_input_embeddings()(ids.clamp_min(0))
        latents = batch.get("latents")
        D = embeds.shape[-1]
        if pb.numel() == 0:
            none = embeds.new_zeros((0, 1, D))
            return merge_placeholders(embeds, valid, labels, ph, none, torch.zeros_like(pb))
        if latents is None or latents.dim() != 5:
            raise ValueError(f"input_ids contain {IMAGE} tokens but the batch has no latents (B, C, T, H, W)")
        if latents.shape[1] != self.latent_channels:
            raise ValueError(f"latents have {latents.shape[1]} channels, the projection was built for "
                             f"{self.latent_channels}")
        T = latents.shape[2]
        n_ph = ph.sum(1)
        mask = batch.get("latents_mask")
        if mask is not None:
            mask = mask.bool()
            n_img = mask.flatten(2).any(2).sum(1)
            bad = n_ph != n_img
        else:
            bad = n_ph > T
        if bool(bad.any()):
            b = int(bad.nonzero()[0])
            key = batch.get("keys", [None] * B)[b]
            have = int(n_img[b]) if mask is not None else T
            raise ValueError(f"sample {b} ({key}): {int(n_ph[b])} {IMAGE} tokens but {have} images in latents")
        w = self.projector[0].weight
        patches = patchify(latents.to(w.dtype), self.patch)[pb, rank]          # (N, n_p, C*p*p)
        if mask is not None:
            keep = patchify_mask(mask, self.patch)[pb, rank]                   # (N, n_p)
            order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices   # valid first, in order
            patches = patches.gather(1, order[..., None].expand_as(patches))
            lengths = keep.sum(1)
        else:
            lengths = torch.full_like(pb, patches.shape[1])
        return merge_placeholders(embeds, valid, labels, ph, self.projector(patches), lengths)

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        merged = self.merge(batch)
        hidden = self._run_lm(merged)
        loss = next_token_loss(hidden, merged.labels, self.lm.get_output_embeddings())
        if loss is None:
            loss = hidden.float().sum() * 0.0 + touch(self.lm.get_output_embeddings().parameters()).to(hidden.device)
        loss = loss + touch(self.projector.parameters()).to(loss.device)   # no image in the batch: DDP
        return {"loss": loss, "caption_loss": loss.detach()}
