"""Helpers shared by the encoder wrappers: hashing, JSON canonicalisation, device/dtype and path resolution.

Nothing here knows about a particular model family.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

#: how to create local test models when a ``pretrained`` directory is missing
BUILD_HINT = (
    "To build small randomly initialised test models of the real architectures run: "
    "python -m precompute.random_models --out models"
)

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


_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def resolve_dtype(dtype: Any) -> "torch.dtype":
    """``torch.dtype`` from None (float32), a torch dtype or a name (fp32/float32/fp16/bf16...)."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    name = _DTYPES.get(str(dtype).lower().replace("torch.", ""))
    if name is None:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return getattr(torch, name)


#: directory names written by ``precompute.random_models`` (``dac-tiny``, ``wan-full``...): never hub ids
_RANDOM_MODEL_DIR = re.compile(r"^(dac|encodec|mimi|wan|cosmos|tokenizer|lm)-(tiny|full)$")


def resolve_pretrained(pretrained: Any, *, what: str) -> str:
    """Return ``pretrained`` as a string for ``from_pretrained``, failing early on missing local dirs.

    A value is treated as a local path when it exists, is absolute, starts with ``.``/``~``, has more
    than one ``/``, its first component is an existing directory (``models/dac-tiny`` when
    ``models/`` exists) or its last component is a ``precompute.random_models`` name (``dac-tiny``,
    ``wan-full``...; so a forgotten ``make models`` fails at once instead of after the hub client's
    retries). A missing local path raises ``FileNotFoundError`` with :data:`BUILD_HINT`.
    Anything else (``org/name``, ``name``) is passed on as a Hugging Face hub id; if loading it fails
    the caller raises :func:`load_error`, which carries the same hint.
    """
    if pretrained is None or str(pretrained).strip() == "":
        raise ValueError(f"{what}: 'pretrained' (a local directory or hub id) is required. {BUILD_HINT}")
    text = os.fspath(pretrained) if isinstance(pretrained, os.PathLike) else str(pretrained)
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise NotADirectoryError(f"{what}: pretrained path {text!r} is a file; expected a model directory")
    looks_local = (
        isinstance(pretrained, os.PathLike)
        or path.is_absolute()
        or text.startswith((".", "~"))
        or text.count("/") > 1
        or Path(text.split("/", 1)[0]).is_dir()
        or _RANDOM_MODEL_DIR.match(path.name) is not None
        or os.sep != "/" and os.sep in text
    )
    if looks_local:
        raise FileNotFoundError(f"{what}: model directory {text!r} does not exist. {BUILD_HINT}")
    return text


def load_error(what: str, pretrained: str, err: Exception) -> Exception:
    """An ``OSError`` explaining that ``pretrained`` could not be loaded, chained by the caller."""
    return OSError(
        f"{what}: could not load {pretrained!r} as a local directory or Hugging Face hub id "
        f"({type(err).__name__}: {err}). {BUILD_HINT}"
    )
