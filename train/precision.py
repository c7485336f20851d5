"""Mixed precision: autocast dtype and, for float16, a ``torch.amp.GradScaler``.

``training.precision``:

* ``auto``: on CUDA, bf16 where ``torch.cuda.is_bf16_supported()`` (Ampere and newer), else fp16
  with a GradScaler (V100, T4); on CPU fp32 (CPU autocast is slower than fp32 for these models);
* ``bf16``: autocast to bfloat16 (on CPU too), no scaler (bf16 has fp32's exponent range);
* ``fp16``: autocast to float16 with a GradScaler (loss scaling against gradient underflow; a
  step whose scaled gradients overflow is skipped and the scale halves); on CPU where this torch
  supports it (CPU autocast to float16 and ``GradScaler("cpu")``, torch >= 2.3);
* ``fp32``: no autocast.

The weights and the optimizer state stay float32 (autocast casts per op); the scaler's state is
saved in every checkpoint.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve(precision: str, device: torch.device) -> str:
    """``training.precision`` -> bf16 | fp16 | fp32 on ``device`` (see the module docstring).
    Raises ValueError for fp16 where this torch has no float16 autocast or GradScaler for the device."""
    if precision == "auto":
        if device.type != "cuda":
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if precision == "fp16" and not fp16_supported(device):
        raise ValueError(f"--training.precision fp16: this torch ({torch.__version__}) has no float16 autocast "
                         f"with a GradScaler on {device.type}; use bf16 or fp32")
    return precision


def fp16_supported(device: torch.device) -> bool:
    """Whether float16 autocast and ``torch.amp.GradScaler(device.type)`` work on ``device``."""
    try:
        torch.amp.GradScaler(device.type)
        with torch.autocast(device_type=device.type, dtype=torch.float16):
            y = torch.nn.functional.linear(torch.ones(2, 2, device=device), torch.ones(2, 2, device=device))
        return y.dtype == torch.float16
    except (RuntimeError, AttributeError, TypeError, ValueError):
        return False


@dataclass
class Precision:
    """What a step needs: ``autocast()`` (a fresh context each call), ``scaler`` (fp16 only),
    ``name`` (bf16 | fp16 | fp32, as resolved)."""

    name: str
    device: torch.device
    scaler: Any = None

    @classmethod
    def of(cls, precision: str, device: torch.device) -> "Precision":
        name = resolve(precision, device)
        scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
        return cls(name, device, scaler)

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES.get(self.name)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def context(self) -> Callable[[], contextlib.AbstractContextManager]:
        """A factory of autocast contexts (for code that takes one)."""
        return self.autocast

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the GradScaler under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """fp16: divide the gradients by the scale (before clipping); records overflow on the device."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
