"""``--model.name reference`` (the default): :class:`ReferenceModel`, a small transformer trained from scratch
on every cached modality, sized from the cache (any codec, tokenizer and VAE).

:class:`ReferenceModel` uses every cached modality::

    [ text ids -> embedding ] [ image latents (C,T,h,w) -> p x p patches -> linear ] [ audio frames ]
      prefix: L tokens          prefix: T*(h/p)*(w/p) tokens                        F tokens

one causal transformer over the concatenation (pad and missing-image tokens are masked as keys;
with ``latents_mask`` (B, T, H, W) in the batch, i.e. latents of different sizes zero-padded to the
batch's largest, a patch is a valid key when any of its cells is real, so padding patches are
masked too and do not shift the positions of the tokens after them);
the input at audio frame t is the sum of the codebook embeddings of frame t-1 (a learned BOS at
t = 0) and one linear head per codebook predicts frame t's codes (cross-entropy,
``ignore_index=-100``). With ``latent_loss`` cosine|mse a latent-regression head predicts image
patch i+1 from the hidden state at patch i (next-patch regression, image samples only; with
``latents_mask``, valid patch j predicts the next valid patch and padding patches are skipped, so
a sample's loss does not depend on how much it was padded).

Loss normalisation: the mean over a sample's valid targets, then the mean over the samples of the
batch. Per-sample normalisation makes the gradient of a global batch independent of how it is split
across ranks and micro-steps (DDP averages per-rank means; token-mean losses would weight ranks
with more tokens less), which is what lets 1 x B, 2 x B/2 and 2 x B/4 x accum 2 train identically.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shards.cache import Cache, Contract
from shards.tokens import IGNORE_INDEX

from .base import Recipe

log = logging.getLogger("train")



def sinusoid(n: int, d: int) -> torch.Tensor:
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    inv = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    out = torch.zeros(n, d)
    out[:, 0::2] = torch.sin(pos * inv)
    out[:, 1::2] = torch.cos(pos * inv[: d // 2])
    return out


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, dropout: float):
        super().__init__()
        assert d % n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads, self.dropout = n_heads, dropout
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp_ratio * d)
        self.fc2 = nn.Linear(mlp_ratio * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), mask))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class ReferenceModel(Recipe):
    """Text + image-latent prefix, causal transformer over codec frames (see the module docstring)."""

    fields = ("codes",)
    optional_fields = ("input_ids", "latents")  #: (``latents`` only where samples have them)
    #: ``--lora.targets``' default: the attention and MLP projections of its blocks
    lora_targets = ("qkv", "proj", "fc1", "fc2")
    contract_items = {"fields": "codes"}

    @classmethod
    def contract(cls, kwargs: Mapping[str, Any]) -> Contract:
        """Codes (any codec: the model is sized from the cache); text and latents where the cache has them."""
        return cls.contract_of("--model.name reference", {})

    @classmethod
    def from_cache(cls, cache: Cache, kwargs: Mapping[str, Any], *, latent_loss: str = "none",
                   latent_loss_weight: float = 1.0) -> "ReferenceModel":
        """Sized from the cache (its codec's codebooks, text vocabulary, latent channels; 259 / 16 when
        it has no text / latents); ``kwargs`` (``model.kwargs``) win."""
        codec = cache.codec
        sizes = {"n_codebooks": codec.n_codebooks, "codebook_size": codec.codebook_size,
                 "vocab_size": cache.vocab_size or 259, "latent_channels": cache.latent_channels or 16,
                 "latent_loss": latent_loss, "latent_loss_weight": latent_loss_weight}
        return cls(**{**sizes, **kwargs})

    def __init__(self, n_codebooks: int = 8, codebook_size: int = 1024, vocab_size: int = 259,
                 latent_channels: int = 16, d_model: int = 256, n_layers: int = 4, n_heads: int = 4,
                 mlp_ratio: int = 4, dropout: float = 0.0, patch_size: int = 2,
                 max_positions: int = 8192, latent_loss: str = "none", latent_loss_weight: float = 1.0):
        super().__init__()
        if latent_loss not in ("none", "cosine", "mse"):
            raise ValueError(f"latent_loss must be none|cosine|mse, got {latent_loss!r}")
        self.n_codebooks, self.codebook_size = n_codebooks, codebook_size
        self.patch, self.latent_channels = patch_size, latent_channels
        self.latent_loss, self.latent_loss_weight = latent_loss, latent_loss_weight
        self.activation_checkpointing = False
        d = d_model
        patch_dim = latent_channels * patch_size * patch_size
        self.text_emb = nn.Embedding(vocab_size, d)
        self.latent_proj = nn.Linear(patch_dim, d)
        # n_codebooks tables of codebook_size rows stored as one table (row q * codebook_size + code)
        self.code_emb = nn.Embedding(n_codebooks * codebook_size, d)
        self.register_buffer("code_offsets", torch.arange(n_codebooks)[None, :, None] * codebook_size,
                             persistent=False)
        self.bos = nn.Parameter(torch.zeros(d))
        self.type_emb = nn.Embedding(3, d)  # 0 text, 1 image, 2 audio
        self.register_buffer("pos", sinusoid(max_positions, d), persistent=False)
        self.blocks = nn.ModuleList(Block(d, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.heads = nn.ModuleList(nn.Linear(d, codebook_size) for _ in range(n_codebooks))
        self.latent_head = nn.Linear(d, patch_dim) if latent_loss != "none" else None
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def set_activation_checkpointing(self, on: bool = True) -> bool:
        self.activation_checkpointing = on
        return True

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, T, h, w) -> (B, T * h/p * w/p, C * p * p); h, w zero-padded to multiples of p."""
        p = self.patch
        B, C, T, H, W = latents.shape
        if H % p or W % p:
            latents = F.pad(latents, (0, (-W) % p, 0, (-H) % p))
            H, W = latents.shape[-2:]
        x = latents.reshape(B, C, T, H // p, p, W // p, p).permute(0, 2, 3, 5, 1, 4, 6)
        return x.reshape(B, T * (H // p) * (W // p), C * p * p)

    def patchify_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, T, h, w) bool -> (B, T * h/p * w/p): the patches of :meth:`patchify`, in the same
        order; a patch is valid when any of its cells is (h, w padded with False like the latents)."""
        p = self.patch
        B, T, H, W = mask.shape
        if H % p or W % p:
            mask = F.pad(mask, (0, (-W) % p, 0, (-H) % p), value=False)
            H, W = mask.shape[-2:]
        return mask.reshape(B, T, H // p, p, W // p, p).any(5).any(3).reshape(B, T * (H // p) * (W // p))

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        codes = batch["codes"]                                   # (B, Q, F) int64, pad -100
        B, Q, Fr = codes.shape
        if Q != self.n_codebooks:
            raise ValueError(f"batch has {Q} codebooks, model was built for {self.n_codebooks}")
        audio_mask = batch.get("codes_mask")
        if audio_mask is None:
            audio_mask = codes[:, 0] != IGNORE_INDEX
        # audio input at frame t: sum over codebooks of the embeddings of frame t-1's codes
        prev = (codes[:, :, :-1].clamp_min(0) + self.code_offsets)
        audio = torch.cat([self.bos.expand(B, 1, -1), self.code_emb(prev).sum(1)], 1)
        parts, masks, types = [], [], []
        if "input_ids" in batch:  # the rendered conversation
            text = batch["input_ids"]
            tmask = batch.get("attention_mask")
            parts.append(self.text_emb(text))
            masks.append(tmask if tmask is not None else text != 0)
            types.append(0)
        n_img = 0
        patch_valid = None  # (B, n_img) from latents_mask; None: every patch of an image sample
        if batch.get("latents") is not None and batch["latents"].numel() > 0:
            latents = batch["latents"]
            patches = self.patchify(latents)
            n_img = patches.shape[1]
            has = batch.get("has_image")
            lmask = batch.get("latents_mask")
            if lmask is not None:
                if lmask.shape != latents.shape[:1] + latents.shape[2:]:
                    raise ValueError(f"latents_mask has shape {tuple(lmask.shape)}, expected (B, T, H, W) = "
                                     f"{tuple(latents.shape[:1] + latents.shape[2:])} for latents "
                                     f"{tuple(latents.shape)}")
                patch_valid = self.patchify_mask(lmask.bool())
            elif has is None:
                has = latents.flatten(1).ne(0).any(1)
            parts.append(self.latent_proj(patches))
            masks.append(patch_valid if patch_valid is not None else has[:, None].expand(B, n_img))
            types.append(1)
        parts.append(audio)
        masks.append(audio_mask)
        types.append(2)
        lengths = [p.shape[1] for p in parts]
        S = sum(lengths)
        if S > self.pos.shape[0]:
            raise ValueError(f"sequence of {S} tokens exceeds max_positions={self.pos.shape[0]} "
                             "(raise model_kwargs.max_positions or crop the clips)")
        type_ids = torch.cat([torch.full((n,), t, device=codes.device) for n, t in zip(lengths, types)])
        key_valid = torch.cat(masks, 1)                           # (B, S)
        # positions count valid tokens only: padding (text, absent image) does not shift the audio
        pos_ids = (key_valid.long().cumsum(1) - 1).clamp_min(0)
        x = torch.cat(parts, 1) + self.type_emb(type_ids) + self.pos[pos_ids]
        causal = torch.ones(S, S, dtype=torch.bool, device=codes.device).tril()
        eye = torch.eye(S, dtype=torch.bool, device=codes.device)
        attn_mask = ((causal & key_valid[:, None, :]) | eye)[:, None]  # every row sees itself: no NaN rows

        for blk in self.blocks:
            if self.activation_checkpointing and self.training:
                x = checkpoint(blk, x, attn_mask, use_reentrant=False)
            else:
                x = blk(x, attn_mask)
        h = self.norm(x)

        h_audio = h[:, S - Fr:]
        logits = torch.stack([head(h_audio) for head in self.heads], 1)  # (B, Q, F, V)
        ce = F.cross_entropy(logits.reshape(-1, self.codebook_size), codes.reshape(-1),
                             ignore_index=IGNORE_INDEX, reduction="none").view(B, -1)
        n_valid = (codes != IGNORE_INDEX).view(B, -1).sum(1)
        codes_loss = (ce.sum(1) / n_valid.clamp_min(1)).mean()
        out = {"codes_loss": codes_loss}
        loss = codes_loss
        if self.latent_head is not None and n_img:
            start = lengths[0] if types[0] == 0 else 0
            h_img = h[:, start:start + n_img]
            if patch_valid is not None:                          # padded latents: valid patches only
                lat = self._masked_latent_loss(h_img, patches, patch_valid)
            else:
                pred = self.latent_head(h_img[:, :-1])           # patch i predicts patch i+1
                target = patches[:, 1:]
                if target.shape[1] == 0:
                    lat = pred.sum() * 0.0
                else:
                    if self.latent_loss == "cosine":
                        per = (1 - F.cosine_similarity(pred, target, dim=-1, eps=1e-6)).mean(1)
                    else:
                        per = (pred - target).pow(2).mean((1, 2))
                    lat = (per * has).sum() / B                    # image-less samples add 0
            out["latent_loss"] = lat
            loss = loss + self.latent_loss_weight * lat
        out["loss"] = loss
        return out

    def _masked_latent_loss(self, h_img: torch.Tensor, patches: torch.Tensor,
                            valid: torch.Tensor) -> torch.Tensor:
        """Next-patch regression over the valid patches only: each sample's valid patches are
        taken in order (a stable sort moves them to the front), valid patch j predicts valid patch
        j+1, and the sample's loss is the mean over its pairs (0 with fewer than two valid patches);
        the batch loss is the sum over samples / B, like the unmasked loss. Padding patches are
        neither inputs nor targets, so neither the loss nor its gradient depends on how far a
        sample was padded."""
        B, n = valid.shape
        order = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices  # valid first
        h = h_img.gather(1, order[..., None].expand(-1, -1, h_img.shape[-1]))
        x = patches.gather(1, order[..., None].expand(-1, -1, patches.shape[-1]))
        pair = valid.gather(1, order)[:, 1:]                     # pair j valid <=> patch j+1 valid
        pred = self.latent_head(h[:, :-1])
        target = x[:, 1:]
        if self.latent_loss == "cosine":
            err = 1 - F.cosine_similarity(pred, target, dim=-1, eps=1e-6)
        else:
            err = (pred - target).pow(2).mean(-1)
        err = torch.where(pair, err, torch.zeros((), dtype=err.dtype, device=err.device))
        per = err.sum(1) / pair.sum(1).clamp_min(1).to(err.dtype)
        return per.sum() / B
