"""What the ``tts`` and ``vlm`` recipes share: a ``transformers`` causal LM, media placeholders
expanded into embedding runs, per-sample next-token loss, LoRA, optimizer groups.

Conventions (from Higgs-Audio ``boson_multimodal/model/higgs_audio/utils.py``
``merge_input_ids_with_audio_features`` and LLaVA's ``prepare_inputs_labels_for_multimodal``):
the k-th placeholder token of a sample (``<|AUDIO|>``/``<|AUDIO_OUT|>`` or ``<image>``) is replaced
in place by the embeddings of media item k; text labels keep their tokens, the inserted positions
get label -100; labels are not shifted in the batch (HF convention): position t predicts the label
at t + 1 here.

Losses are normalised per sample (mean over a sample's targets, then the sum over samples / B, a
sample without targets adding 0) like :class:`train.models.ReferenceModel`, so the gradient of a
global batch does not depend on how it is split across ranks and micro-steps.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardcache.pretrained import BUILD_HINT, resolve_pretrained
from shards.tokens import IGNORE_INDEX

from .. import lora as L
from ..imports import blocked_imports
from .base import Recipe

log = logging.getLogger("train")
ONCE = {"once": True}  # the same on every rank: said by global rank 0 only (train.trainer.setup_logging)

DEFAULT_LM = "meta-llama/Llama-3.2-1B"
#: LoRA targets of the recipes: the attention projections of Llama/Qwen/Mistral-style LMs
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LM_HINT = "pass model_kwargs.lm = a local checkpoint directory or a Hugging Face hub id; " + BUILD_HINT


# -- loading ----------------------------------------------------------------------------------------

def resolve_lm(lm: Any) -> str:
    """``lm`` as a ``from_pretrained`` argument (:func:`shardcache.pretrained.resolve_pretrained`: a
    missing local directory fails at once, with the command that builds the tiny test LM)."""
    return resolve_pretrained(lm, what="model_kwargs.lm")


def load_causal_lm(lm: Any, vocab_size: int | None = None, dtype: str | torch.dtype = "float32",
                   attn_implementation: str | None = None, model_class: str = "AutoModelForCausalLM",
                   revision: str | None = None, **from_pretrained: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(lm, revision=revision)`` (or the ``transformers`` class named
    ``model_class``, with the extra ``from_pretrained`` keyword arguments; ``revision``: ``model.kwargs.revision``,
    the hub id's branch, tag or commit, default ``main``); token embeddings resized (mean init, transformers'
    default) when the cache's ``vocab_size`` exceeds the LM's. Raises
    :class:`shardcache.weights.LocalRevision` for a ``revision`` with a local folder."""
    from shardcache.weights import checkpoint
    name = resolve_lm(lm)
    checkpoint(name, revision=revision, what="model.kwargs.revision")   # a folder has no revisions: refused
    if isinstance(dtype, str):
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if dtype not in names:
            raise ValueError(f"model_kwargs.dtype must be one of {sorted(names)}, got {dtype!r}")
        dtype = names[dtype]
    with blocked_imports():  # no PIL/soundfile via transformers' optional helpers
        import transformers
        from transformers.utils import logging as hf_logging

        # from_pretrained's ``dtype`` was ``torch_dtype`` before transformers 4.56
        old = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (4, 56)
        kw: dict[str, Any] = {"torch_dtype" if old else "dtype": dtype, "revision": revision or None, **from_pretrained}
        if attn_implementation:
            kw["attn_implementation"] = attn_implementation

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a "Loading weights" bar per rank is noise in training logs
        try:
            model = getattr(transformers, model_class).from_pretrained(name, **kw)
        except OSError as e:
            raise OSError(f"could not load the LM {name!r} ({e}); {LM_HINT}") from e
        finally:
            if bars:
                hf_logging.enable_progress_bar()
    n = model.get_input_embeddings().weight.shape[0]
    if vocab_size is not None and vocab_size > n:
        log.info("resizing %s token embeddings %d -> %d (the cache's text vocab; new rows drawn from the old rows' "
                 "mean and covariance, transformers' mean_resizing)", name, n, vocab_size)
        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its own warning of mean_resizing, once per rank, repeats the line above
        try:
            model.resize_token_embeddings(vocab_size, mean_resizing=True)
        finally:
            hf_logging.set_verbosity(level)
    return model


def decoder_of(lm: nn.Module) -> nn.Module:
    """The LM without its head (``LlamaModel`` of a ``LlamaForCausalLM``): returns hidden states."""
    dec = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if dec is None:
        dec = getattr(lm, getattr(lm, "base_model_prefix", "model"), None)
    if dec is None or dec is lm:
        raise TypeError(f"cannot find the decoder of {type(lm).__name__}")
    return dec


def kwargs_lora(lora: Any, r: int = 8, alpha: int = 16, dropout: float = 0.0,
                targets: Iterable[str] | None = None) -> dict | None:
    """model_kwargs ``lora`` (false | true | {r, alpha, dropout, targets}) -> options
    (:func:`train.lora.options`) or None."""
    if not lora:
        return None
    opts = {"r": r, "alpha": alpha, "dropout": dropout, "targets": tuple(targets or DEFAULT_LORA_TARGETS)}
    if isinstance(lora, dict):
        unknown = set(lora) - set(opts)
        if unknown:
            raise ValueError(f"model_kwargs.lora: unknown keys {sorted(unknown)}; use r, alpha, dropout, targets")
        opts.update(lora)
    elif lora is not True:
        raise ValueError(f"model_kwargs.lora must be true/false or a dict, got {lora!r}")
    return L.options(**opts)


# -- merging placeholders ---------------------------------------------------------------------------

@dataclass
class Merged:
    """A batch with every placeholder replaced by its run of embeddings (L2 = longest result).

    inputs_embeds (B, L2, D) in the LM's dtype; attention_mask (B, L2) bool (True on content,
    right-padded); labels (B, L2) int64 (text labels at the text tokens' new positions, -100 on
    inserted runs and padding); positions (N, M) int64: where column j of the N-th placeholder's run
    landed (valid where ``j < lengths[n]``); batch_index (N,) and token_index (N,) of each
    placeholder in the input; lengths (N,) int64: run lengths.
    """

    inputs_embeds: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    batch_index: torch.Tensor
    token_index: torch.Tensor
    lengths: torch.Tensor


def merge_placeholders(embeds: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor,
                       ph_mask: torch.Tensor, inserts: torch.Tensor, lengths: torch.Tensor) -> Merged:
    """Replace placeholder n (row-major order of ``ph_mask``) by ``inserts[n, :lengths[n]]``.

    embeds (B, L, D) token embeddings; valid (B, L) bool real tokens (padding is dropped and
    re-added at the end); labels (B, L) int64; ph_mask (B, L) bool placeholders (within ``valid``);
    inserts (N, M, D) float; lengths (N,) int64 <= M. Differentiable in ``embeds`` and ``inserts``.
    """
    B, L, D = embeds.shape
    dev = embeds.device
    ph_mask = ph_mask & valid
    pb, pi = ph_mask.nonzero(as_tuple=True)
    if pb.numel() != lengths.numel():
        raise ValueError(f"{pb.numel()} placeholder tokens but {lengths.numel()} media items")
    counts = valid.long()
    counts[pb, pi] = lengths
    ends = counts.cumsum(1)
    starts = ends - counts
    new_len = ends[:, -1] if L else torch.zeros(B, dtype=torch.long, device=dev)
    L2 = max(int(new_len.max()) if B else 0, 1)
    tb, ti = (valid & ~ph_mask).nonzero(as_tuple=True)
    tpos = starts[tb, ti]
    out = embeds.new_zeros(B, L2, D).index_put((tb, tpos), embeds[tb, ti])
    new_labels = labels.new_full((B, L2), IGNORE_INDEX).index_put((tb, tpos), labels[tb, ti])
    M = inserts.shape[1]
    cols = torch.arange(M, device=dev)
    ok = cols[None, :] < lengths[:, None]
    positions = starts[pb, pi][:, None] + cols[None, :]
    nb = pb[:, None].expand(-1, M)
    out = out.index_put((nb[ok], positions[ok]), inserts[ok].to(out.dtype))
    attn = torch.arange(L2, device=dev)[None, :] < new_len[:, None]
    return Merged(out, attn, new_labels, positions, pb, pi, lengths)


# -- losses -----------------------------------------------------------------------------------------

def touch(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """0.0 that depends on every parameter in ``params``: a step in which a module has nothing to
    do (no audio, no image in the batch) still gives it a (zero) gradient, so DDP needs no
    ``find_unused_parameters``."""
    terms = [p.reshape(-1)[:1].sum() for p in params if p.requires_grad]
    if not terms:
        return torch.zeros(())
    return torch.stack([t.float() for t in terms]).sum() * 0.0


def per_sample_mean(values: torch.Tensor, sample: torch.Tensor, B: int) -> torch.Tensor:
    """sum over samples of (mean of ``values`` (K,) float over the entries of each sample) / B."""
    total = torch.zeros(B, dtype=torch.float32, device=values.device).index_add(0, sample, values.float())
    count = torch.zeros(B, dtype=torch.float32, device=values.device).index_add(
        0, sample, torch.ones_like(values, dtype=torch.float32))
    return (total / count.clamp_min(1)).sum() / B


def next_token_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module) -> torch.Tensor | None:
    """Per-sample next-token cross entropy: hidden (B, L, D) at t predicts labels (B, L) at t + 1
    (-100 ignored). The head runs on the predicting positions only. None when nothing is labelled."""
    B = hidden.shape[0]
    b, t = (labels[:, 1:] != IGNORE_INDEX).nonzero(as_tuple=True)
    if b.numel() == 0:
        return None
    h = hidden[b, t]
    w = getattr(head, "weight", None)
    logits = head(h.to(w.dtype) if w is not None else h).float()
    ce = F.cross_entropy(logits, labels[b, t + 1], reduction="none")
    return per_sample_mean(ce, b, B)


# -- the shared module ------------------------------------------------------------------------------

class LMRecipe(Recipe):
    """Base of the recipes on a ``transformers`` LM: ``self.lm`` (an HF causal LM) plus the recipe's own
    modules (:meth:`media_modules`, always trainable). Handles freezing, LoRA (:meth:`enable_lora`),
    activation checkpointing, trainable-fraction logging and :meth:`optimizer_groups`."""

    default_checkpoint = DEFAULT_LM
    lora_targets = DEFAULT_LORA_TARGETS

    #: with a frozen LM, warn when more than this fraction of the parameters trains
    max_trainable_fraction: float | None = None
    #: name of the media modules' groups in :meth:`optimizer_groups`
    media_name = "media"

    def _init_lm(self, lm: Any, vocab_size: int, dtype: Any, attn_implementation: str | None,
                 revision: str | None = None) -> None:
        self.lm = load_causal_lm(lm, vocab_size, dtype, attn_implementation, revision=revision)
        self.lm_name = str(lm)
        self.lora: dict | None = None
        self.hidden_size = self.lm.get_input_embeddings().weight.shape[1]

    def _finish_init(self, freeze_lm: bool, lora: dict | None) -> None:
        self.freeze_lm = bool(freeze_lm)
        for p in self.lm.parameters():
            p.requires_grad = not self.freeze_lm
        if lora is not None:
            self.enable_lora(**lora)
        else:
            self.log_trainable()

    # -- LoRA, checkpointing, logging ---------------------------------------------------------------

    @classmethod
    def lora_options(cls, kwargs: Any, run: dict | None) -> dict | None:
        """``model.kwargs.lora`` (:func:`kwargs_lora`), else the run's section (its default targets mean
        :data:`DEFAULT_LORA_TARGETS`). Raises ``ValueError`` when both are given and differ (as
        :meth:`enable_lora` would)."""
        own, theirs = kwargs_lora(kwargs.get("lora")), super().lora_options(kwargs, run)
        if own is not None and theirs is not None and own != theirs:
            raise ValueError(f"LoRA: model.kwargs.lora gives {own}, the run's lora section {theirs}")
        return own or theirs

    def enable_lora(self, r: int = 8, alpha: int = 16, dropout: float = 0.0,
                    targets: Iterable[str] | None = None) -> None:
        """LoRA adapters on the LM only (default targets :data:`DEFAULT_LORA_TARGETS`); the LM's own
        weights freeze, the recipe's media modules stay trainable. A second call with the same
        options does nothing (``model_kwargs.lora`` and ``--lora`` together); other options raise."""
        opts = L.options(r, alpha, dropout, targets or DEFAULT_LORA_TARGETS)
        if self.lora is not None:
            if opts != self.lora:
                raise ValueError(f"LoRA already applied with {self.lora}; asked again with {opts}")
            return
        n = L.inject_lora(self.lm, **opts)
        self.lora = opts
        log.info("LoRA on %s: r=%d alpha=%d dropout=%g targets=%s (%d adapter parameters)",
                 self.lm_name, opts["r"], opts["alpha"], opts["dropout"], list(opts["targets"]), n)
        self.log_trainable()

    def set_activation_checkpointing(self, on: bool = True) -> bool:
        """HF activation (gradient) checkpointing of the LM's layers, non-reentrant (works with a
        frozen LM); ``activation_checkpointing_*`` where transformers has it (>= 5.x), else the
        older ``gradient_checkpointing_*``."""
        kw = {"use_reentrant": False}
        if hasattr(self.lm, "activation_checkpointing_enable"):
            if on:
                self.lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                self.lm.activation_checkpointing_disable()
        elif on:
            self.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        else:
            self.lm.gradient_checkpointing_disable()
        return True

    def trainable_fraction(self) -> float:
        total = sum(p.numel() for p in self.parameters())
        return sum(p.numel() for p in self.parameters() if p.requires_grad) / max(total, 1)

    def log_trainable(self) -> float:
        """Log (logger ``train``) trainable / total parameters; warn when the LM is frozen (no LoRA
        either) and more than :attr:`max_trainable_fraction` trains."""
        total = sum(p.numel() for p in self.parameters())
        train = sum(p.numel() for p in self.parameters() if p.requires_grad)
        frac = train / max(total, 1)
        mode = f"LoRA r={self.lora['r']}" if self.lora else ("frozen LM" if self.freeze_lm else "full LM")
        log.info("%s (%s): %d of %d parameters trainable (%.2f %%)", type(self).__name__, mode, train,
                 total, 100 * frac)
        limit = self.max_trainable_fraction
        if limit is not None and (self.freeze_lm or self.lora) and frac > limit:
            log.warning("%s: %.1f %% of the parameters train with a frozen LM (expected < %.0f %%; "
                        "TheWorld trains ~2 %%): is the projection too large?", type(self).__name__,
                        100 * frac, 100 * limit, extra=ONCE)
        return frac

    # -- optimizer ----------------------------------------------------------------------------------

    def media_modules(self) -> list[nn.Module]:
        """The recipe's own modules (audio embeddings and heads, image projection)."""
        raise NotImplementedError

    def _lr_of_media(self, lr: float) -> float:
        return lr

    def optimizer_groups(self, lr: float, weight_decay: float) -> list[dict]:
        """AdamW parameter groups over the trainable parameters: :attr:`media_name` (the recipe's own
        modules, at :meth:`_lr_of_media`) and ``lm`` (LoRA adapters or the unfrozen LM, at ``lr``),
        each split into weight decay on matrices/embeddings (dim >= 2) and none (``*_no_decay``) on
        biases/norms, the convention of ``train.optim.param_groups``. Each group has ``params``,
        ``lr`` (absolute, before the schedule), ``weight_decay`` and ``name``; empty groups are left
        out; every trainable parameter is in exactly one group."""
        media_ids = {id(p) for m in self.media_modules() for p in m.parameters()}
        groups = []
        for part, group_lr in ((self.media_name, self._lr_of_media(lr)), ("lm", lr)):
            params = [(n, p) for n, p in self.named_parameters()
                      if p.requires_grad and ((id(p) in media_ids) == (part == self.media_name))]
            decay = [p for _, p in params if p.dim() >= 2]
            no_decay = [p for _, p in params if p.dim() < 2]
            for suffix, ps, wd in (("", decay, weight_decay), ("_no_decay", no_decay, 0.0)):
                if ps:
                    groups.append({"params": ps, "lr": float(group_lr), "weight_decay": float(wd),
                                   "name": part + suffix})
        return groups

    # -- helpers for forward ------------------------------------------------------------------------

    def _text(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids (B, L) int64, valid (B, L) bool, labels (B, L) int64 from a batch."""
        ids = batch["input_ids"].long()
        labels = batch["labels"].long() if "labels" in batch else torch.full_like(ids, IGNORE_INDEX)
        if batch.get("attention_mask") is not None:
            valid = batch["attention_mask"].bool()
        elif batch.get("input_lengths") is not None:
            valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < batch["input_lengths"][:, None]
        else:  # right padding: trailing pads are never attended by real tokens (causal), labels -100
            valid = torch.ones_like(ids, dtype=torch.bool)
        n = self.lm.get_input_embeddings().weight.shape[0]
        if ids.numel() and (int(ids.max()) >= n or int(ids.min()) < 0):
            raise ValueError(f"input_ids outside the LM's vocabulary [0, {n}): the cache was tokenized "
                             f"for another vocabulary (ids {int(ids.min())}..{int(ids.max())})")
        return ids, valid, labels

    def _run_lm(self, merged: Merged) -> torch.Tensor:
        """Last hidden states (B, L2, D) of the LM over the merged embeddings."""
        out = decoder_of(self.lm)(inputs_embeds=merged.inputs_embeds,
                                  attention_mask=merged.attention_mask.long(), use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
