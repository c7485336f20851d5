"""``--model.name theworld``: TheWorld (github.com/kasohrab/theworld, ``python/theworld/modeling/``) from a
cache: Gemma 3 (``transformers``' ``Gemma3ForConditionalGeneration``, ``google/gemma-3-4b-it``) with
its image features taken from the cache and Cosmos "world tokens" projected from cached latents.

The LM's inputs, for a batch of the cache (``input_ids`` rendered through Gemma 3's chat template,
each image expanded into Gemma's image sequence and one world-marker pair per image after BOS, all
at stage one)::

    inputs_embeds = embed_tokens(input_ids)                          (B, L, D)  Gemma's scaled embedding
    inputs_embeds[input_ids == <image_soft_token>] = image_features  masked_scatter, image k of sample b
                                                                     = its k-th run of soft tokens
    world_k = GELU(W2 GELU(W1 z_k))      z_k = latents[b, :, k] (C, H, W) -> (H*W, C) row-major
    ... <start_of_world> world_k <end_of_world> ...                 inserted between image k's pair

which is what TheWorld computes on the fly: ``gemma_vision.py`` (``embed_tokens``,
``get_image_features``, ``get_placeholder_mask``, ``masked_scatter``), ``world_projector.py``
(one token per latent cell, ``Linear(z_dim, D) -> GELU -> Linear(D, D) -> GELU``) and ``fusion.py``
(``embeds[:, :sow + 1] + world + embeds[:, eow:]``, attention mask 1 on the world tokens). TheWorld
has one image per batch position; here image ``k`` of a sample goes with its ``k``-th marker pair.
Labels are -100 on the inserted world tokens (and, from stage one, on the image sequence and the
markers). ``token_type_ids`` (1 on the image soft tokens, 0 elsewhere, world tokens included) go to
Gemma 3, whose ``create_masks_for_vision_model`` lets an image's tokens attend to each other
bidirectionally, as the processor's ``token_type_ids`` do on the fly.

Nothing of the image path runs in training: the SigLIP vision tower and its projector ran once at
stage one (``image_features``, bfloat16) and are dropped from the model right after loading, so they
never reach the device (``vision_tower: true`` keeps them, to feed ``pixel_values`` on the fly, as the
tests do to compare both paths). The LM is frozen (``freeze_lm``, default True) and trains through
LoRA adapters when asked (``lora``); the world projection always trains (``projection_lr``). A
TheWorld projection state dict continues training with ``projection_checkpoint``.

Loss: next-token cross entropy on ``labels``, per-sample normalised like the other recipes
(:mod:`train.recipes.lm`). Returns ``{"loss", "caption_loss"}``.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from shardcache.pretrained import GEMMA3_PIXEL_OPTIONS, image_processor_options, resolve_pretrained
from shardcache.weights import GEMMA3_VISION, CheckpointMissing, checkpoint, under, weights_of
from shards.cache import Cache, Contract, Unknown
from shards.tokens import GEMMA_IMAGE_SOFT, WORLD_END, WORLD_START

from ..imports import blocked_imports
from .base import build_from, text_tokenizer, token_ids, tokenizer_pad_id
from .lm import LMRecipe, kwargs_lora, load_causal_lm, merge_placeholders, next_token_loss, resolve_lm, touch

log = logging.getLogger("train")

DEFAULT_GEMMA3 = "google/gemma-3-4b-it"
MODEL_TYPE = "gemma3"
#: TheWorld's world markers (``TheWorld._inject_world_tokens``; configs/precompute-theworld.yaml)
WORLD_TOKENS = (WORLD_START, WORLD_END)
#: the image preset TheWorld's projection was trained on (``cosmos_vae_encoder.py``: ``img.convert("RGB")``,
#: ``TF.resize(img, [512, 512])`` of the whole image, ``to_tensor(img) * 255``, the Wan 2.1 VAE of
#: Cosmos-Predict2 in bfloat16, raw ``mode()`` latents of 16 channels); latents stored as float16
PIXEL_RANGE = "0..255"
IMAGE_PRESET = {"encoder": "wan", "size": 512, "resize": "stretch", "rgb": "convert", "pixel_range": PIXEL_RANGE,
                "normalized": False, "latent_channels": 16, "dtype": "bfloat16", "latents_dtype": "float16"}
#: TheWorld's text and labels: its collate's layout (``chat_template: theworld``) and its forward's labels
#: (``_forward_with_world``: every input token, -100 on the world embeddings only)
CHAT_TEMPLATE, LABEL_POLICY = "theworld", "all_but_world"


#: TheWorld's projection architectures (``world_projector.py`` ``_build_projection``)
PROJECTIONS = ("mlp", "mlp_no_final_gelu", "linear")


class WorldProjector(nn.Module):
    """TheWorld's world projection (``world_projector.py``, spatial mode): latents ``(N, C, H, W)`` -> one
    token per latent cell, row-major ``(N, H*W, C)`` -> ``projection`` -> ``(N, H*W, D)``, where
    ``projection`` is TheWorld's module for ``architecture`` (its ``projection_architecture``):
    ``mlp`` ``Linear(C, D) -> GELU -> Linear(D, D) -> GELU`` (state-dict keys ``projection.0.*``,
    ``projection.2.*``), ``mlp_no_final_gelu`` the same without the last GELU (same keys and shapes),
    ``linear`` one ``Linear(C, D)`` (``projection.weight``, ``projection.bias``)."""

    def __init__(self, z_dim: int, hidden: int, architecture: str = "mlp"):
        super().__init__()
        if architecture not in PROJECTIONS:
            raise ValueError(f"model.kwargs.projection_architecture: expected one of {', '.join(PROJECTIONS)}, "
                             f"got {architecture!r}")
        self.architecture = architecture
        if architecture == "linear":
            self.projection = nn.Linear(z_dim, hidden)
        else:
            layers = [nn.Linear(z_dim, hidden), nn.GELU(), nn.Linear(hidden, hidden)]
            self.projection = nn.Sequential(*layers, *([nn.GELU()] if architecture == "mlp" else []))

    @staticmethod
    def tokens(latents: torch.Tensor) -> torch.Tensor:
        """``(N, C, H, W)`` -> ``(N, H*W, C)``: one token per cell, row-major (TheWorld's layout)."""
        return latents.flatten(2).transpose(1, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.projection(tokens.to(next(self.projection.parameters()).dtype))


_PROJECTION_KEY = re.compile(r"(?:^|\.)projection\.(?:([0-9]+)\.)?(weight|bias)$")


#: the key of a checkpoint's safetensors header (and of TheWorld's ``config.json``) that records its
#: projection's architecture (:meth:`TheWorldModel.checkpoint_metadata` writes it with every checkpoint)
ARCH_KEY = "projection_architecture"


def _projection_file(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """``({key: lazy tensor or tensor}, safetensors header metadata)`` of a projection checkpoint; a
    safetensors file is not read beyond its header until a tensor is asked for."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        f = safe_open(str(path), "pt")
        return {k: f for k in f.keys()}, dict(f.metadata() or {})
    raw = torch.load(str(path), map_location="cpu", weights_only=True)
    raw = raw.get("state_dict", raw) if isinstance(raw, dict) else raw
    return dict(raw), {}


def projection_record(path: str | Path) -> tuple[str | None, str]:
    """``(architecture, where)``: what records checkpoint ``path``'s projection architecture: its own
    safetensors header (a checkpoint this project wrote: :data:`ARCH_KEY`), else TheWorld's ``config.json``
    beside it (``save_pretrained``'s ``projection_architecture``); ``(None, "")`` when nothing does.
    Raises ``ValueError`` when the two records disagree."""
    path = Path(path)
    _, meta = _projection_file(path)
    config = path.parent / "config.json"
    named = json.loads(config.read_text()).get(ARCH_KEY) if config.is_file() else None
    own = meta.get(ARCH_KEY)
    if own and named and own != named:
        raise ValueError(f"projection_checkpoint {path}: its header records {ARCH_KEY} {own}, {config} says {named}")
    return (own, f"{path}'s header") if own else (named, str(config)) if named else (None, "")


def projection_architecture(path: str | Path, architecture: str | None = None) -> tuple[str, str]:
    """``(architecture, family)`` of projection checkpoint ``path`` from its keys and its record
    (:func:`projection_record`), checked against ``architecture`` (``model.kwargs.projection_architecture``).
    Reads keys and headers only. Why an MLP needs a record or a name: ``mlp`` and ``mlp_no_final_gelu``
    have the same keys and shapes and differ only in the function they compute (a last GELU), so the
    tensors alone cannot tell them apart; a ``linear`` projection is told by its keys.

    Raises ``ValueError`` naming what was found: no projection or a layout of no known architecture, a
    name that contradicts the keys or the record, an MLP that nothing records or names."""
    path = Path(path)
    keys, _ = _projection_file(path)
    found = {(m.group(1) + "." if m.group(1) else "") + m.group(2) for k in keys if (m := _PROJECTION_KEY.search(k))}
    family = "mlp" if found == {"0.weight", "0.bias", "2.weight", "2.bias"} else \
        "linear" if found == {"weight", "bias"} else None
    if family is None:
        raise ValueError(f"projection_checkpoint {path}: not a TheWorld projection ({', '.join(PROJECTIONS)}): "
                         f"projection keys {sorted(found) or 'none'} (of {len(keys)} keys, e.g. {sorted(keys)[:4]})")
    named, where = projection_record(path)
    if architecture and named and architecture != named:
        raise ValueError(f"model.kwargs.projection_architecture is {architecture}, but {where} says "
                         f"projection_architecture: {named}")
    arch = architecture or named
    if family == "linear":
        if arch not in (None, "linear"):
            raise ValueError(f"projection_checkpoint {path} holds one Linear (projection.weight/bias: TheWorld's "
                             f"linear projection), projection_architecture is {arch}")
        return "linear", family
    if arch == "linear":
        raise ValueError(f"projection_checkpoint {path} holds a two-layer MLP (projection.0/2), "
                         "projection_architecture is linear")
    if arch is None:
        raise ValueError(f"projection_checkpoint {path} holds a two-layer MLP, which is TheWorld's mlp or "
                         "mlp_no_final_gelu (same keys and shapes: the tensors cannot tell which) and nothing records "
                         "which (no projection_architecture in its header or in a config.json beside it): set "
                         "model.kwargs.projection_architecture")
    return arch, family


def load_projection_state(path: str | Path, z_dim: int, hidden: int, architecture: str | None = None
                          ) -> tuple[str, dict[str, torch.Tensor], list[str]]:
    """A TheWorld projection checkpoint recognised by its keys, shapes and record: ``(architecture, state
    dict for WorldProjector.projection's parent, unexpected keys)``.

    ``path``: ``.safetensors`` (TheWorld's ``model.safetensors``, or a ``step-N`` checkpoint of this
    project), or a torch file of tensors only (read with ``weights_only=True``). Keys ending
    ``projection.0/2.weight|bias`` are a two-layer MLP (``mlp`` or ``mlp_no_final_gelu``),
    ``projection.weight|bias`` a ``linear`` one; which MLP: :func:`projection_architecture`. Shapes must be
    ``(hidden, z_dim)`` in (spatial mode) and ``(hidden, hidden)`` between. Other keys (LM weights, LoRA
    adapters) are returned as unexpected, never loaded.

    Raises ``ValueError`` as :func:`projection_architecture`, and for other shapes (TheWorld's channel
    mode: input ``H*W``).
    """
    path = Path(path)
    arch, family = projection_architecture(path, architecture)
    keys, _ = _projection_file(path)
    found, unexpected = {}, []
    for k, v in keys.items():
        m = _PROJECTION_KEY.search(k)
        if m:
            found[(m.group(1) + "." if m.group(1) else "") + m.group(2)] = v.get_tensor(k) if not isinstance(
                v, torch.Tensor) else v
        else:
            unexpected.append(k)
    shapes = {k: tuple(v.shape) for k, v in found.items() if k.endswith("weight")}
    want = {"0.weight": (hidden, z_dim), "2.weight": (hidden, hidden)} if family == "mlp" else {"weight": (hidden, z_dim)}
    if shapes != want:
        first = shapes.get("0.weight", shapes.get("weight"))
        hint = (f" (input {first[1]} = latent cells: TheWorld's channel mode, world_projection_mode: channel, "
                "is not supported)" if first and first[1] != z_dim else "")
        raise ValueError(f"projection_checkpoint {path}: weight shapes {shapes}, the model needs {want} (latent "
                         f"channels {z_dim}, LM hidden size {hidden}){hint}")
    return arch, {("projection." + k): v for k, v in found.items()}, unexpected


#: TheWorld's VAE (``cosmos_vae_encoder.py``): the ``vae`` component of the Cosmos-Predict2 pipeline it loads
DEFAULT_VAE, DEFAULT_VAE_SUBFOLDER = "nvidia/Cosmos-Predict2-2B-Video2World", "vae"


def vae_weights(vae: str = DEFAULT_VAE, subfolder: str | None = None, revision: str | None = None) -> Any:
    """The weights (:func:`shardcache.weights.weights_of`, the files ``diffusers`` loads, decided in a child
    process: a training process never imports ``diffusers``) of the VAE ``vae`` names: a VAE directory or
    hub id (at ``revision``, ``model.kwargs.vae_revision``: default ``main``), or a diffusers pipeline holding
    it in ``subfolder`` (default: ``vae`` where the checkpoint has no ``config.json`` of its own but
    ``vae/config.json``, as stage one finds it; TheWorld's ``nvidia/Cosmos-Predict2-2B-Video2World``).
    :class:`shards.cache.Unknown` (refused, naming ``model.kwargs.vae``; waived by
    ``--model.allow_other_encoder_weights``) when its weights are not here (not in the hub cache) or
    ``diffusers`` is not installed to say which they are. Raises :class:`shardcache.weights.CheckpointUnreadable`
    for weight files that are there and cannot be read, :class:`shardcache.weights.LocalRevision` for a
    ``revision`` with a local folder."""
    name = resolve_pretrained(vae, what="model.kwargs.vae")
    ckpt = checkpoint(name, revision=revision, what="model.kwargs.vae_revision")   # a folder has no revisions
    if subfolder is None and vae == DEFAULT_VAE:
        subfolder = DEFAULT_VAE_SUBFOLDER
    elif subfolder is None:
        if ckpt.fetch("config.json") is None and ckpt.fetch(f"{DEFAULT_VAE_SUBFOLDER}/config.json") is not None:
            subfolder = DEFAULT_VAE_SUBFOLDER
    try:
        return weights_of(name, subfolder, library="diffusers", isolated=True, revision=revision)
    except CheckpointMissing as e:
        return Unknown(f"the VAE's weights are not here ({e}): name the VAE the projection was trained with in "
                       f"model.kwargs.vae (default {DEFAULT_VAE}, subfolder {DEFAULT_VAE_SUBFOLDER})")


def check_config(lm: Any, revision: str | None = None):
    """The ``transformers`` config of ``lm`` (at ``revision``, default ``main``); ``ValueError`` unless it is a
    Gemma 3 (``gemma3``). Raises :class:`shardcache.weights.LocalRevision` for a ``revision`` with a local folder."""
    name = resolve_lm(lm)
    checkpoint(name, revision=revision, what="model.kwargs.revision")   # a folder has no revisions: refused
    with blocked_imports():
        from transformers import AutoConfig
        try:
            cfg = AutoConfig.from_pretrained(name, revision=revision or None)
        except OSError as e:
            raise OSError(f"could not load the config of {name!r} ({e}); pass model.kwargs.lm = a Gemma 3 "
                          "directory or hub id") from e
    if cfg.model_type != MODEL_TYPE:
        raise ValueError(f"--model.name theworld needs a Gemma 3 checkpoint (Gemma3ForConditionalGeneration, e.g. "
                         f"google/gemma-3-4b-it); {name} is {cfg.model_type!r}")
    return cfg


class TheWorldModel(LMRecipe):
    """Gemma 3 + TheWorld's world tokens on cached image features and latents (see the module docstring).

    Args (``model.kwargs``; ids and sizes of the cache come from ``manifest.json`` via
    :func:`train.recipes.base.cache_values`):
        lm: Gemma 3 directory or hub id (default :data:`DEFAULT_GEMMA3`).
        dtype: weight dtype of the LM and the projection (float32 | bfloat16 | float16; default float32).
        attn_implementation: passed to ``from_pretrained`` (Gemma 3 refuses flash attention: its
            bidirectional image mask).
        freeze_lm: default True: the LM trains only through LoRA adapters (if any).
        lora: false | true | {r, alpha, dropout, targets}: peft LoRA on the LM's q/k/v/o_proj.
        projection_lr: learning rate of the world projection (default: the run's lr).
        projection_checkpoint: a TheWorld projection state dict to start from (:func:`load_projection_state`:
            recognised by keys and shapes; other keys, e.g. LM weights, are reported and not loaded).
        projection_architecture: TheWorld's ``mlp`` | ``mlp_no_final_gelu`` | ``linear`` (default: the
            checkpoint's, else ``mlp``, TheWorld's default).
        vision_tower: keep Gemma's vision tower and projector (default False: dropped, never on the
            device); needed only for batches holding ``pixel_values`` instead of ``image_features``.
        vision_dtype: dtype the kept vision tower runs in (default bfloat16, as stage one).
        max_trainable_fraction: warn above this trainable fraction with a frozen LM (default 0.10).
        revision: the hub revision (branch, tag or commit; default ``main``) of ``lm``, for its config,
            tokenizer, processor config, vision tower and weights alike (a local folder has none: refused).
        tokenizer_revision, vae_revision: the hub revisions of ``tokenizer`` and ``vae`` (default ``main``).
        tokenizer, chat_template, label_policy, image_size, vae, vae_subfolder: what the cache must have been
            made with (the contract; not used to build): the text tokenizer for a checkpoint that ships none,
            the template (default ``theworld``: TheWorld's collate; it and ``tokenizer`` render with the
            checkpoint's own chat template, whose text is compared too) and label policy (default
            ``all_but_world``: TheWorld's forward labels every input token), the VAE's input size (default 512)
            and the VAE whose weights are compared (a directory or hub id; default TheWorld's,
            :data:`DEFAULT_VAE` in its ``vae`` subfolder: :func:`vae_weights`).
        latent_channels, vocab_size, pad_id, image_token_id (``<start_of_image>``),
        image_soft_token_id, world_start_token_id, world_end_token_id: the cache's.

    Batch (on the device): ``input_ids``/``labels`` int64 (B, L), ``attention_mask`` bool (B, L);
    ``image_features`` (B, N, T, D) bfloat16 or float32 with ``image_features_mask`` bool (B, N)
    (or ``pixel_values`` (n_images, 3, S, S) float32 in sample order, with ``vision_tower: true``);
    ``latents`` float32 (B, C, N, H, W) with ``latents_mask`` bool (B, N, H, W).

    Raises ``ValueError`` when the cache does not fit the model: not a Gemma 3, other image-token id
    (tokenized with another tokenizer), no world markers in the cache, image tokens that do not match
    the features (a cache made without ``image_features``), markers that do not match the images.
    """

    fields = ("input_ids", "labels", "latents", "image_features")
    media_name = "projection"
    default_checkpoint = DEFAULT_GEMMA3

    contract_items = {
        "fields": "`input_ids`, `labels`, `latents`, `image_features`",
        f"special_tokens.{GEMMA_IMAGE_SOFT}": "config `image_token_index`",
        **{f"special_tokens.{t}": "its tokenizer with the markers added" for t in WORLD_TOKENS},
        "pad_id": "its tokenizer's pad id",
        "text_tokenizer": "the checkpoint's tokenizer (else `model.kwargs.tokenizer`) with the world markers added",
        "chat_template": "`model.kwargs.chat_template`, default `theworld` (TheWorld's collate)",
        "chat_template_sha256": "its tokenizer's own chat template (`tokenizer_config.json` or `chat_template.jinja`), "
                                "which `theworld` and `tokenizer` render with",
        "label_policy": "`model.kwargs.label_policy`, default `all_but_world` (TheWorld's forward)",
        "image.encoder": "`wan` (Cosmos-Predict2's Wan 2.1 VAE)",
        "image.size": "`model.kwargs.image_size`, default 512", "image.resize": "`stretch`", "image.rgb": "`convert`",
        "image.pixel_range": "`0..255`", "image.normalized": "false (raw `mode()` latents)",
        "image.latent_channels": "16 (the VAE's `z_dim`)",
        "image.dtype": "`bfloat16`", "image.latents_dtype": "`float16`",
        "image.weights": "the VAE of `model.kwargs.vae` (default TheWorld's: `nvidia/Cosmos-Predict2-2B-Video2World`, "
                         "`vae/`; not here: refused)",
        "feature_encoder.name": "`gemma3`", "feature_encoder.tokens_per_image": "config `mm_tokens_per_image`",
        "feature_encoder.hidden_size": "config `text_config.hidden_size`", "feature_encoder.dtype": "`bfloat16`",
        "feature_encoder.weights": "the vision tower and projector inside the checkpoint",
        "feature_encoder.image_processor": "its image processor config's resize, rescale and normalise options",
    }

    @classmethod
    def contract(cls, kwargs) -> Contract:
        """The checkpoint's (config, tokenizer, image processor config, the vision tower's tensors; never the
        LM's weights): ``image_features`` of Gemma 3's own vision tower (its tokens per image, hidden size,
        bfloat16, the weights of the tower and projector inside ``lm``, its processor's resize, rescale and
        normalise options), its tokenizer with TheWorld's world markers added (fingerprint, the markers' and
        ``<image_soft_token>`` ids, the pad id; its chat template's text where the cache was rendered with it),
        TheWorld's text and labels (``chat_template`` / ``label_policy`` kwargs, default TheWorld's own) and
        latents of TheWorld's image preset (:data:`IMAGE_PRESET`; ``image_size`` kwarg; the latent channels of
        ``projection_checkpoint`` when given) from the VAE's weights (``vae``, default TheWorld's:
        :func:`vae_weights`)."""
        lm, revision = kwargs.get("lm", DEFAULT_GEMMA3), kwargs.get("revision")
        cfg = check_config(lm, revision)
        tok, fingerprint, template = text_tokenizer(lm, kwargs.get("tokenizer"), WORLD_TOKENS, kwargs=kwargs)
        chat_template = kwargs.get("chat_template", CHAT_TEMPLATE)
        markers = token_ids(tok, WORLD_TOKENS) if tok is not None else dict.fromkeys(WORLD_TOKENS)
        image = dict(IMAGE_PRESET, size=int(kwargs.get("image_size", IMAGE_PRESET["size"])))
        if kwargs.get("projection_checkpoint"):   # its architecture, from its keys and record: before any weight loads
            projection_architecture(kwargs["projection_checkpoint"], kwargs.get("projection_architecture"))
        values = {f"special_tokens.{t}": i for t, i in ({GEMMA_IMAGE_SOFT: int(cfg.image_token_id)} | markers).items()}
        try:
            with blocked_imports():
                pixels = image_processor_options(resolve_lm(lm), GEMMA3_PIXEL_OPTIONS, revision=revision)
        except OSError as e:
            pixels = Unknown(f"{lm} has no image processor config transformers can read ({e})")
        values |= {"pad_id": tokenizer_pad_id(tok) if tok is not None else None, "text_tokenizer": fingerprint,
                   "chat_template": chat_template,
                   "chat_template_sha256": template if chat_template in ("theworld", "tokenizer") else None,
                   "label_policy": kwargs.get("label_policy", LABEL_POLICY),
                   **{f"image.{k}": v for k, v in image.items()},
                   "image.weights": vae_weights(kwargs.get("vae", DEFAULT_VAE), kwargs.get("vae_subfolder"),
                                                kwargs.get("vae_revision")),
                   "feature_encoder.name": MODEL_TYPE, "feature_encoder.tokens_per_image": int(cfg.mm_tokens_per_image),
                   "feature_encoder.hidden_size": int(cfg.text_config.hidden_size), "feature_encoder.dtype": "bfloat16",
                   "feature_encoder.weights": weights_of(resolve_lm(lm), select=under(*GEMMA3_VISION),
                                                         revision=revision, what="model.kwargs.revision"),
                   "feature_encoder.image_processor": pixels}
        return cls.contract_of("--model.name theworld", values)

    @classmethod
    def from_cache(cls, cache: Cache, kwargs, *, latent_loss: str = "none", latent_loss_weight: float = 1.0):
        cls.no_latent_loss(latent_loss)
        return build_from(cls, cache, kwargs, (
            "latent_channels", "vocab_size", "pad_id", "image_token_id", "image_soft_token_id",
            "world_start_token_id", "world_end_token_id"))

    def __init__(self, *, lm: str = DEFAULT_GEMMA3, dtype: str = "float32", attn_implementation: str | None = None,
                 freeze_lm: bool = True, lora: Any = False, projection_lr: float | None = None,
                 projection_checkpoint: str | None = None, projection_architecture: str | None = None,
                 vision_tower: bool = False,
                 vision_dtype: str = "bfloat16", max_trainable_fraction: float = 0.10, latent_channels: int = 16,
                 vocab_size: int | None = None, pad_id: int = 0, image_token_id: int | None = None,
                 image_soft_token_id: int | None = None, world_start_token_id: int | None = None,
                 world_end_token_id: int | None = None, tokenizer: str | None = None,
                 chat_template: str = CHAT_TEMPLATE, label_policy: str = LABEL_POLICY, image_size: int = 512,
                 vae: str = DEFAULT_VAE, vae_subfolder: str | None = None, revision: str | None = None,
                 tokenizer_revision: str | None = None, vae_revision: str | None = None) -> None:
        super().__init__()
        cfg = check_config(lm, revision)
        if image_soft_token_id is not None and int(image_soft_token_id) != cfg.image_token_id:
            raise ValueError(f"the cache's {GEMMA_IMAGE_SOFT} is {image_soft_token_id}, the model's image_token_id "
                             f"{cfg.image_token_id}: precompute with text_tokenizer.pretrained = {lm}")
        if world_start_token_id is None or world_end_token_id is None:
            raise ValueError("--model.name theworld needs the world markers in the cache (precompute with "
                             f"world_tokens: [{WORLD_START}, {WORLD_END}], configs/precompute-theworld.yaml)")
        self.soft_id, self.pad_id = int(cfg.image_token_id), int(pad_id)
        self.sow_id, self.eow_id = int(world_start_token_id), int(world_end_token_id)
        self.latent_channels = int(latent_channels)
        self.projection_lr, self.max_trainable_fraction = projection_lr, max_trainable_fraction
        self.lm = load_causal_lm(lm, vocab_size, dtype, attn_implementation,
                                 model_class="Gemma3ForConditionalGeneration", revision=revision)
        self.lm_name, self.lora = str(lm), None
        inner = self.lm.model
        self.keep_vision = bool(vision_tower)
        if self.keep_vision:
            vd = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[vision_dtype]
            inner.vision_tower.to(vd)
            inner.multi_modal_projector.to(vd)
        else:  # ran at stage one: never on the device, never run
            inner.vision_tower = None
            inner.multi_modal_projector = None
        self.hidden_size = self.lm.get_input_embeddings().weight.shape[1]
        arch, state, unexpected = projection_architecture or "mlp", None, []
        if projection_checkpoint:
            arch, state, unexpected = load_projection_state(projection_checkpoint, self.latent_channels,
                                                            self.hidden_size, projection_architecture)
        self.world_projector = WorldProjector(self.latent_channels, self.hidden_size, arch).to(
            self.lm.get_input_embeddings().weight.dtype)
        if state is not None:
            self.world_projector.load_state_dict(state)
            log.info("world projection (%s) loaded from %s", arch, projection_checkpoint)
            if unexpected:
                log.warning("projection_checkpoint %s: %d key(s) that are not the world projection were NOT loaded "
                            "(e.g. %s): LM weights or adapters trained with it are not used", projection_checkpoint,
                            len(unexpected), ", ".join(sorted(unexpected)[:3]))
        self._finish_init(freeze_lm, kwargs_lora(lora))

    def media_modules(self) -> list[nn.Module]:
        return [self.world_projector]

    def checkpoint_metadata(self) -> dict[str, str]:
        """The world projection's architecture (:data:`ARCH_KEY`), so that a checkpoint of this run given
        as ``projection_checkpoint`` is told apart from the other MLP variant (its keys cannot be)."""
        return {ARCH_KEY: self.world_projector.architecture}

    def _lr_of_media(self, lr: float) -> float:
        return float(self.projection_lr) if self.projection_lr is not None else lr

    def checkpoint_config(self) -> dict:
        """The model's ``transformers`` config (stored in each checkpoint's ``config.json``)."""
        return self.lm.config.to_dict()

    def log_trainable(self) -> float:
        frac = super().log_trainable()
        log.info("TheWorldModel: trainable fraction %.4f (world projection%s)", frac,
                 " + LoRA" if self.lora else (" + LM" if not self.freeze_lm else " only"))
        return frac

    # -- the inputs ---------------------------------------------------------------------------------

    def image_features(self, batch: dict[str, Any]) -> torch.Tensor | None:
        """Every image's features in sample order, ``(n_images, T, D)``: the cached ones
        (``image_features[image_features_mask]``) or, with ``pixel_values`` and ``vision_tower: true``,
        Gemma's own ``get_image_features(pixel_values).pooler_output``. None when the batch has neither."""
        feats = batch.get("image_features")
        if feats is not None:
            mask = batch.get("image_features_mask")
            return feats[mask.bool()] if mask is not None else feats.flatten(0, 1)
        pv = batch.get("pixel_values")
        if pv is None:
            return None
        if not self.keep_vision:
            raise ValueError("a batch with pixel_values needs model.kwargs.vision_tower: true (the cache's "
                             "image_features make it unnecessary)")
        inner = self.lm.model
        w = next(inner.vision_tower.parameters())
        return inner.get_image_features(pv.to(w.device, w.dtype), return_dict=True).pooler_output

    def inputs(self, batch: dict[str, Any]):
        """``(merged, token_type_ids)``: the LM inputs (:class:`train.recipes.lm.Merged`: embeddings
        with image features scattered and world tokens inserted, attention mask, labels) and
        ``token_type_ids`` int64 ``(B, L2)`` (1 on image soft tokens)."""
        ids, valid, labels = self._text(batch)
        B = ids.shape[0]
        embeds = self.lm.get_input_embeddings()(ids.clamp_min(0))
        soft = (ids == self.soft_id) & valid
        feats = self.image_features(batch)
        n_soft = int(soft.sum())
        if n_soft or feats is not None:
            have = 0 if feats is None else feats.shape[0] * feats.shape[1]
            if have != n_soft:
                raise ValueError(f"{n_soft} image tokens in input_ids but {have} image feature vectors "
                                 f"({'none' if feats is None else tuple(feats.shape)}): was the cache made with "
                                 "image_features (input_ids with Gemma's expanded image sequence)?")
            if n_soft:   # gemma_vision.py: inputs_embeds.masked_scatter(special_image_mask, image_features)
                embeds = embeds.masked_scatter(soft[..., None].expand_as(embeds), feats.to(embeds.dtype))
        sow = (ids == self.sow_id) & valid
        pb, pi = sow.nonzero(as_tuple=True)
        D = embeds.shape[-1]
        if pb.numel():
            k = (sow.long().cumsum(1) - 1)[pb, pi]                     # pair k <-> image k of the sample
            lat = batch.get("latents")
            if lat is None or lat.dim() != 5:
                raise ValueError("input_ids hold world markers but the batch has no latents (B, C, T, H, W)")
            if lat.shape[1] != self.latent_channels:
                raise ValueError(f"latents have {lat.shape[1]} channels, the world projection {self.latent_channels}")
            n_img = batch["latents_mask"].flatten(2).any(2).sum(1) if batch.get("latents_mask") is not None \
                else torch.full((B,), lat.shape[2], device=ids.device)
            bad = sow.sum(1) != n_img
            if bool(bad.any()):
                b = int(bad.nonzero()[0])
                raise ValueError(f"sample {b} ({batch.get('keys', [None] * B)[b]}): {int(sow[b].sum())} world marker "
                                 f"pairs but {int(n_img[b])} images in latents")
            z = lat[pb, :, k]                                           # (N, C, H, W)
            tokens = WorldProjector.tokens(z)                           # (N, H*W, C)
            lengths = torch.full_like(pb, tokens.shape[1])
            if batch.get("latents_mask") is not None:                   # padded latents: real cells first
                keep = batch["latents_mask"].bool()[pb, k].flatten(1)
                order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices
                tokens = tokens.gather(1, order[..., None].expand_as(tokens))
                lengths = keep.sum(1)
            world = self.world_projector(tokens)                        # (N, H*W, D)
            inserts = torch.cat([embeds[pb, pi][:, None].to(world.dtype), world], 1)   # the marker, then its world
            lengths = lengths + 1
        else:
            inserts, lengths = embeds.new_zeros((0, 1, D)), torch.zeros_like(pb)
        merged = merge_placeholders(embeds, valid, labels, sow, inserts, lengths)
        counts = valid.long()
        counts[pb, pi] = lengths
        starts = counts.cumsum(1) - counts                              # new position of every input token
        if pb.numel():   # the marker keeps its own label (TheWorld's labels_before ends with it; -100 unless
            merged.labels[pb, starts[pb, pi]] = labels[pb, pi]          # label_policy: all_but_world)
        tb, ti = soft.nonzero(as_tuple=True)
        token_type = torch.zeros(merged.labels.shape, dtype=torch.long, device=ids.device)
        token_type[tb, starts[tb, ti]] = 1
        return merged, token_type

    def forward(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        merged, token_type = self.inputs(batch)
        out = self.lm.model(inputs_embeds=merged.inputs_embeds, attention_mask=merged.attention_mask.long(),
                            token_type_ids=token_type, use_cache=False)
        hidden = out.last_hidden_state
        head = self.lm.get_output_embeddings()
        loss = next_token_loss(hidden, merged.labels, head)
        if loss is None:
            loss = hidden.float().sum() * 0.0 + touch(head.parameters()).to(hidden.device)
        loss = loss + touch(self.world_projector.parameters()).to(loss.device)   # no image: DDP still sees it
        return {"loss": loss, "caption_loss": loss.detach()}
