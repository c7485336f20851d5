"""LoRA adapters (peft) and their options: one injection for every model, and the options an adapter
checkpoint records so that it is loaded only with the same ones (:func:`train.checkpoint.check_adapter`).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch.nn as nn

from .imports import blocked_imports

#: the options that make an adapter what it is, in the order a refusal names them
OPTIONS = ("r", "alpha", "dropout", "targets")


def options(r: int, alpha: int, dropout: float, targets: Iterable[str]) -> dict[str, Any]:
    """The LoRA options as an adapter records them: ``{r, alpha, dropout, targets}`` (int, int, float,
    tuple of module-name suffixes)."""
    return {"r": int(r), "alpha": int(alpha), "dropout": float(dropout), "targets": tuple(targets)}


def recorded(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The options an ``adapter.json`` records (its ``lora``), as :func:`options` gives them; None
    when it records none."""
    lora = (meta or {}).get("lora")
    if not isinstance(lora, Mapping) or any(k not in lora for k in OPTIONS):
        return None
    return options(lora["r"], lora["alpha"], lora["dropout"], lora["targets"])


def differences(have: Mapping[str, Any] | None, need: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(lora.<option>, recorded, run's)`` for every option of :data:`OPTIONS` that differs (targets
    compared as sets); every option when nothing was recorded."""
    out = []
    for k in OPTIONS:
        a = None if have is None else have[k]
        b = need[k]
        same = a is not None and (set(a) == set(b) if k == "targets" else a == b)
        if not same:
            out.append((f"lora.{k}", list(a) if k == "targets" and a is not None else a,
                        list(b) if k == "targets" else b))
    return out


def inject_lora(module: nn.Module, r: int, alpha: int, dropout: float, targets: Iterable[str]) -> int:
    """peft's ``inject_adapter_in_model`` on ``targets`` (module-name suffixes) of ``module``; every
    other parameter of ``module`` freezes. Returns the number of adapter parameters. Raises
    ``ValueError`` when no module matched, ``ImportError`` without peft."""
    try:
        with blocked_imports():
            from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ImportError(f"LoRA needs peft: pip install 'shardcache[lora]' ({e})") from e
    cfg = LoraConfig(r=int(r), lora_alpha=int(alpha), lora_dropout=float(dropout), target_modules=list(targets))
    inject_adapter_in_model(cfg, module)
    n = 0
    for name, p in module.named_parameters():
        p.requires_grad = "lora_" in name
        n += p.numel() if p.requires_grad else 0
    if n == 0:
        raise ValueError(f"LoRA: no module matched {list(targets)}")
    return n


__all__ = ["OPTIONS", "options", "recorded", "differences", "inject_lora"]
