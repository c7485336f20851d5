"""The reference model, the recipe registry (``--model NAME``, :data:`train.recipes.RECIPES`) and the
``module:factory`` plug-in loader.

A training model is any ``nn.Module`` whose ``forward(batch)`` takes the collated batch dict of
:class:`loaders.ShardLoader` and returns a scalar loss tensor or a dict with ``loss`` (other 0-dim
tensors in the dict are logged). ``--model pkg.mod:make`` imports ``pkg.mod`` and calls
``make(**kwargs)`` where kwargs are ``--model-kwargs`` plus those of :class:`DataSpec` fields
(``n_codebooks``, ``codebook_size``, ``vocab_size``, ``latent_channels``, ``pad_id`` and the
placeholder token ids) and ``latent_loss`` / ``latent_loss_weight`` that the factory names in its
signature. Optional hooks a model may have: ``fields`` (the cached fields it needs),
``enable_lora(r, alpha, dropout, targets)`` (used by :func:`apply_lora` instead of adapting every
matching module), ``optimizer_groups(lr, weight_decay)`` (AdamW parameter groups, each with its own
``lr``), ``set_activation_checkpointing(on)``.

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

import contextlib
import inspect
import sys
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from shardcache.plugins import load_factory  # noqa: F401 (re-exported for train.data)
from shards import tokens
from shards.tokens import IGNORE_INDEX

log = logging.getLogger("train")



@dataclass
class DataSpec:
    """What the cache holds (from ``manifest.json``; defaults where it does not say).

    The first four fields size the reference model; the token ids locate the media placeholders
    of conversation caches (``manifest.json`` ``text.special_token_ids``; None when the cache does
    not say, e.g. a cache without conversations or with a tokenizer lacking the token).
    """

    n_codebooks: int = 8
    codebook_size: int = 1024
    vocab_size: int = 259
    latent_channels: int = 16
    pad_id: int = 0                              #: pad of ``input_ids`` (== loaders' default)
    audio_in_token_id: int | None = None         #: ``<|AUDIO|>``: audio in a user/system turn
    audio_out_token_id: int | None = None        #: ``<|AUDIO_OUT|>``: audio in an assistant turn
    image_token_id: int | None = None            #: the image placeholder (``text.placeholders.image``, ``<image>``)
    audio_out_bos_token_id: int | None = None    #: ``<|audio_out_bos|>`` (right before ``<|AUDIO_OUT|>``)
    audio_eos_token_id: int | None = None        #: ``<|audio_eos|>`` (right after a placeholder)
    audio_bos_token_id: int | None = None        #: ``<|audio_bos|>`` (right before ``<|AUDIO|>``)
    eot_token_id: int | None = None              #: ``<|eot_id|>`` (end of a turn)
    eom_token_id: int | None = None              #: ``<|eom_id|>`` (end of an assistant turn followed by another)
    image_soft_token_id: int | None = None       #: Gemma 3's ``<image_soft_token>`` (expanded image sequence)
    world_start_token_id: int | None = None      #: TheWorld's world start marker (``text.world_tokens[0]``)
    world_end_token_id: int | None = None        #: TheWorld's world end marker (``text.world_tokens[1]``)


#: DataSpec field -> special token in ``manifest.json`` ``text.special_token_ids``
_TOKEN_FIELDS = {
    "audio_in_token_id": tokens.AUDIO_IN,
    "audio_out_token_id": tokens.AUDIO_OUT,
    "image_token_id": tokens.IMAGE,
    "audio_out_bos_token_id": tokens.AUDIO_OUT_BOS,
    "audio_eos_token_id": tokens.AUDIO_EOS,
    "audio_bos_token_id": tokens.AUDIO_BOS,
    "eot_token_id": tokens.EOT,
    "eom_token_id": tokens.EOM,
}


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def data_spec(cache_dir: str | Path) -> DataSpec:
    """Read the :class:`DataSpec` of a cache from its ``manifest.json``.

    ``n_codebooks`` / ``codebook_size`` / ``latent_channels``: top-level keys (written only when the
    job had an audio tokenizer / image encoder). ``vocab_size`` / ``pad_id`` / token ids: the ``text``
    section (``vocab_size``, ``pad_id``, ``special_token_ids``), else the top-level
    ``text_vocab_size`` / ``text_pad_id``. Anything absent keeps the default (8 / 1024 / 259 / 16,
    pad 0, token ids None).

    Raises :class:`shards.ManifestError` naming ``manifest.json`` and the field when the file is
    missing or a field has the wrong type (a model sized from a guess failed later with an
    ``IndexError`` deep in an embedding), :class:`shards.UnsupportedFormat` for a newer cache.
    """
    from shards.manifest import CacheManifest
    spec = DataSpec()
    manifest = CacheManifest.read_required(cache_dir)
    values = {
        "n_codebooks": manifest.n_codebooks,
        "codebook_size": manifest.codebook_size,
        "latent_channels": manifest.latent_channels,
        "vocab_size": manifest.vocab_size(),
        "pad_id": manifest.pad_id(),
    }
    specials = manifest.text.special_token_ids if manifest.text is not None else {}
    # the image placeholder is configurable at stage one (text.placeholders.image; <image> before it was)
    placeholders = (manifest.text.extra.get("placeholders") if manifest.text is not None else None) or {}
    world = (manifest.text.extra.get("world_tokens") if manifest.text is not None else None) or ()
    names = _TOKEN_FIELDS | {"image_token_id": placeholders.get("image") or tokens.IMAGE,
                             "image_soft_token_id": tokens.GEMMA_IMAGE_SOFT}
    if len(world) == 2:
        names |= {"world_start_token_id": world[0], "world_end_token_id": world[1]}
    values.update({f: specials.get(tok) for f, tok in names.items()})
    for fname, v in values.items():
        if _int(v) is not None:
            setattr(spec, fname, _int(v))
    return spec


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


class ReferenceModel(nn.Module):
    """Text + image-latent prefix, causal transformer over codec frames (see the module docstring)."""

    #: what it reads from a cache (``latents`` only where samples have them)
    fields = ("codes", "input_ids", "latents")

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

    def set_activation_checkpointing(self, on: bool = True) -> None:
        self.activation_checkpointing = on

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


def build_model(model: str, model_kwargs: dict, spec: DataSpec, latent_loss: str = "none",
                latent_loss_weight: float = 1.0) -> nn.Module:
    """The reference model, a recipe (a name of :data:`train.recipes.RECIPES`) or
    ``module:factory(**kwargs)`` (see the module docstring). :class:`DataSpec` values are passed
    to every parameter of the same name that ``model_kwargs`` does not set."""
    from .recipes import RECIPES, recipe_class

    if model == "reference":
        factory = ReferenceModel
    elif model in RECIPES:
        factory = recipe_class(model)
    else:
        factory = load_factory(model)
    kwargs = dict(model_kwargs)
    offered = dict(vars(spec), latent_loss=latent_loss, latent_loss_weight=latent_loss_weight)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    for k, v in offered.items():
        if k in params and k not in kwargs:
            kwargs[k] = v
    if model in RECIPES and latent_loss != "none":
        log.warning("--latent-loss %s is ignored by --model %s", latent_loss, model)
    m = factory(**kwargs)
    if not isinstance(m, nn.Module):
        raise TypeError(f"{model} returned {type(m).__name__}, expected a torch.nn.Module")
    return m


#: modules a training process must never load (decoders and VAEs belong to stage one)
FORBIDDEN_MODULES = ("librosa", "soundfile", "PIL", "diffusers")


@contextlib.contextmanager
def blocked_imports(names: tuple[str, ...]):
    """Make ``import NAME`` fail (and ``importlib.util.find_spec`` return None) inside the block.

    peft imports transformers, whose optional audio/image helpers would otherwise load soundfile
    and PIL into the training process; with them "absent" transformers skips those helpers.
    """
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for n in added:
            if sys.modules.get(n, 0) is None:
                del sys.modules[n]


#: ``--lora-targets`` default (the reference model's module names); a model with its own
#: ``enable_lora`` gets ``targets=None`` (its own default) for it
REFERENCE_LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")


def apply_lora(model: nn.Module, r: int, alpha: int, dropout: float, targets: tuple) -> nn.Module:
    """Inject peft LoRA adapters into ``targets`` (module-name suffixes) and freeze everything else.

    A model with an ``enable_lora(r, alpha, dropout, targets)`` method (every recipe:
    adapters on the LM only, their audio/image modules stay trainable) does it itself; the
    reference model's default targets are then replaced by the model's own default (None).
    """
    if hasattr(model, "enable_lora"):
        own = None if tuple(targets) == REFERENCE_LORA_TARGETS else tuple(targets)
        model.enable_lora(r=r, alpha=alpha, dropout=dropout, targets=own)
        return model
    try:
        with blocked_imports(FORBIDDEN_MODULES):
            from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ImportError(f"--lora needs peft: pip install 'shardcache[lora]' ({e})") from e
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets))
    model = inject_adapter_in_model(cfg, model)
    n = 0
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
        n += p.requires_grad
    if n == 0:
        raise ValueError(f"--lora: no module matched {list(targets)}")
    return model


def set_activation_checkpointing(model: nn.Module) -> bool:
    """Turn on activation checkpointing where the model supports it (``set_activation_checkpointing``
    or HF-style ``gradient_checkpointing_enable``). Returns False if it does not."""
    if hasattr(model, "set_activation_checkpointing"):
        model.set_activation_checkpointing(True)
        return True
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return True
    return False


def count_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return train, total
