"""Helpers shared by the encoder wrappers: hashing, JSON canonicalisation, device/dtype and path resolution.

Nothing here knows about a particular model family.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import numpy as np

from shardcache.pretrained import BUILD_HINT, load_error, resolve_pretrained  # noqa: F401 (one owner)

#: config keys that name where a checkpoint came from or which library wrote it; they do not change
#: the outputs, so they are left out of ``describe()`` (moving a model directory keeps its fingerprint)
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "_commit_hash",
        "_diffusers_version",
        "_class_name",
        "_use_default_values",
        "dtype",
        "torch_dtype",
        "_attn_implementation_autoset",
        "architectures",
    }
)


def jsonable(obj: Any) -> Any:
    """Return ``obj`` converted to plain JSON types (dict/list/str/int/float/bool/None).

    tuples -> lists, numpy scalars/arrays -> Python numbers/lists, ``Path`` -> str, torch dtypes -> str.
    Dict keys are converted to str. Raises ``TypeError`` naming the offending type for anything else,
    and ``ValueError`` for NaN/inf floats (they have no canonical JSON form).
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"non-finite float {obj!r} cannot be fingerprinted")
        return obj
    if isinstance(obj, np.generic):
        return jsonable(obj.item())
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    try:
        import torch

        if isinstance(obj, torch.dtype):
            return str(obj).replace("torch.", "")
    except ImportError:  # pragma: no cover - torch is a hard dependency of the encoders
        pass
    raise TypeError(f"value of type {type(obj).__name__} is not JSON-serialisable: {obj!r}")


def canonical_json(obj: Any) -> str:
    """Canonical JSON text of ``obj``: keys sorted, no whitespace, ASCII only (see :func:`jsonable`)."""
    return json.dumps(jsonable(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def clean_config(config: Any) -> dict:
    """JSON-able dict of a transformers/diffusers config without :data:`VOLATILE_CONFIG_KEYS`.

    Accepts a ``PreTrainedConfig`` (uses ``to_dict()``), a diffusers ``FrozenDict`` or any mapping.
    Values that are not JSON types are stringified (configs sometimes hold enums or dtypes).
    """
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)

    def fix(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): fix(x) for k, x in v.items() if str(k) not in VOLATILE_CONFIG_KEYS}
        if isinstance(v, (list, tuple)):
            return [fix(x) for x in v]
        try:
            return jsonable(v)
        except (TypeError, ValueError):
            return repr(v)

    return fix(raw)


def state_dict_sha256(module) -> str:
    """sha256 (hex) over a torch module's ``state_dict()`` in sorted key order.

    For each key: the key, the dtype name, the shape and the raw tensor bytes (C order, CPU) are hashed,
    so a renamed, reshaped or re-typed tensor changes the hash as well as changed values. Non-persistent
    buffers are not part of ``state_dict`` and are not hashed. Cost: one pass over the weights
    (about 1 s per 500 MB on one CPU core).
    """
    import torch

    h = hashlib.sha256()
    sd = module.state_dict()
    for key in sorted(sd):
        t = sd[key]
        if not isinstance(t, torch.Tensor):  # extra state objects
            h.update(f"{key}|obj|{canonical_json(t)}".encode())
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{key}|{str(t.dtype)}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def resolve_device(device: Any) -> "torch.device":
    """``torch.device`` from a str/device; raises ``ValueError`` for CUDA when it is not available."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine")
    return dev


#: the values of the option ``encoder_dtype`` (and of encoders' ``dtype``) -> the dtype they mean
ENCODER_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16",
                  "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def resolve_dtype(dtype: Any) -> "torch.dtype":
    """``torch.dtype`` from None (float32), a torch dtype or a name (fp32/float32/fp16/bf16...)."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    name = ENCODER_DTYPES.get(str(dtype).lower().replace("torch.", ""))
    if name is None:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(ENCODER_DTYPES)}")
    return getattr(torch, name)


