"""The identity of an encoder's weights as stored in its checkpoint, the same at stage one and in a recipe.

Stage one records, for each encoder, ``checkpoint_sha256`` (:func:`checkpoint_sha256` of the checkpoint it
loaded), ``revision`` (:func:`revision`) and ``numerics`` (:func:`numeric_policy`); a recipe computes the
same hash from the checkpoint *it* was trained with (Higgs-Audio v2's paired audio tokenizer, the vision
tower inside a Gemma 3 checkpoint) and its contract compares the two before any weight of the model loads.

Why the checkpoint's tensors and not the loaded module's ``state_dict`` (the encoders' ``weights_sha256``):
the loaded module depends on the dtype it was loaded in (a bfloat16 tower of a float32 checkpoint), on the
library (weight-norm parametrisations rename tensors) and needs the model class (the Higgs audio
tokenizer imports torchaudio); the file's tensors need none of them. The hash reads every selected tensor
once (about 1 s per 500 MB) and no model is built.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable

#: weight files of a checkpoint directory, in the order they are looked for: an index (sharded) or one
#: file; transformers' names first, then diffusers'; ``.bin`` (torch) only where no safetensors exist
WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors"),
                ("diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors"),
                ("pytorch_model.bin.index.json", "pytorch_model.bin"),
                ("diffusion_pytorch_model.bin.index.json", "diffusion_pytorch_model.bin"))
#: the tensors of Gemma 3's image path inside a ``Gemma3ForConditionalGeneration`` checkpoint (the SigLIP
#: vision tower and the multimodal projector): what stage one's ``image_features`` runs and what the
#: ``theworld`` recipe hashes from its checkpoint (``checkpoint_sha256(lm, select=under(*GEMMA3_VISION))``)
GEMMA3_VISION = ("vision_tower.", "multi_modal_projector.")
_SNAPSHOT = re.compile(r"/snapshots/([0-9a-f]{40})/")


def _fetch(pretrained: str, name: str, subfolder: str | None) -> Path | None:
    """``name`` inside ``pretrained`` (a local directory, or a hub id read through the hub's cache),
    None when it has no such file."""
    local = Path(pretrained).expanduser() / (subfolder or "")
    if Path(pretrained).expanduser().is_dir():
        return local / name if (local / name).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError
    try:
        return Path(hf_hub_download(pretrained, name, subfolder=subfolder or None))
    except (EntryNotFoundError, RemoteEntryNotFoundError):
        return None
    except Exception as e:  # noqa: BLE001 - no network, no such repo, gated...: one message names it
        if "does not exist" in str(e) or "404" in str(e):
            return None
        raise OSError(f"{pretrained}: cannot read {name} ({type(e).__name__}: {e})") from e


def weight_files(pretrained: str | Path, subfolder: str | None = None) -> list[Path]:
    """The weight files of checkpoint ``pretrained`` (directory or hub id; ``subfolder``: ``vae`` of a
    diffusers pipeline): the shards an index names, or the one file. Raises ``OSError`` when it has none."""
    pretrained = str(pretrained)
    for index, single in WEIGHT_FILES:
        idx = _fetch(pretrained, index, subfolder)
        if idx is not None:
            shards = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
            return [p for s in shards if (p := _fetch(pretrained, s, subfolder)) is not None]
        one = _fetch(pretrained, single, subfolder)
        if one is not None:
            return [one]
    where = f"{pretrained}/{subfolder}" if subfolder else pretrained
    raise OSError(f"{where} holds no weights ({', '.join(s for _, s in WEIGHT_FILES)}): cannot tell its identity")


def _tensors(path: Path) -> Iterable[tuple[str, Callable[[], Any]]]:
    """``(name, load)`` of every tensor of one weight file (``load()`` reads that tensor only)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        f = safe_open(str(path), "pt")
        for k in f.keys():
            yield k, functools.partial(f.get_tensor, k)
    else:
        import torch
        sd = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        for k, v in sd.items():
            yield k, (lambda v=v: v)


def tensor_names(pretrained: str | Path, subfolder: str | None = None) -> list[str]:
    """The tensor names of checkpoint ``pretrained`` (no tensor is read from a safetensors file)."""
    return sorted(k for p in weight_files(pretrained, subfolder) for k, _ in _tensors(p))


@functools.lru_cache(maxsize=None)
def under(*parts: str) -> Callable[[str], str | None]:
    """A key selector for :func:`checkpoint_sha256`: the tensors whose name holds one of ``parts``
    (``vision_tower.``), named from that part on, so the same weights saved with another prefix
    (``model.vision_tower...`` by transformers 5, ``vision_tower...`` by 4.x) hash alike."""
    pat = re.compile(r"(?:^|\.)((?:" + "|".join(map(re.escape, parts)) + r").*)$")

    def select(key: str) -> str | None:
        m = pat.search(key)
        return m.group(1) if m else None
    return select


@functools.lru_cache(maxsize=32)
def _sha256(files: tuple[tuple[str, int, int], ...], select: Callable[[str], str | None] | None) -> str:
    import torch
    entries = {}
    for f, _, _ in files:
        for key, load in _tensors(Path(f)):
            name = select(key) if select is not None else key
            if name is not None:
                entries[name] = load
    if not entries:
        raise OSError(f"no tensor of {', '.join(f for f, _, _ in files)} is selected: cannot tell its identity")
    h = hashlib.sha256()
    for name in sorted(entries):
        t = entries[name]().detach().to("cpu").contiguous()
        h.update(f"{name}|{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def checkpoint_sha256(pretrained: str | Path, subfolder: str | None = None,
                      select: Callable[[str], str | None] | None = None) -> str:
    """sha256 (hex) of the tensors of checkpoint ``pretrained`` as stored: for each selected tensor in
    name order, its name, dtype, shape and raw bytes. ``select(name)`` -> the name to hash it under, or
    None to leave it out (:func:`under`); default every tensor under its own name.

    The same weights saved again in the same dtype hash alike (whatever the sharding, the directory, the
    file's metadata); other values, shapes or dtypes do not. Cached per process (files with their size and
    modification time, selector).
    Raises ``OSError`` when the checkpoint has no weight file or no tensor is selected."""
    files = tuple((str(p.resolve()), (st := p.stat()).st_size, st.st_mtime_ns)
                  for p in weight_files(pretrained, subfolder))   # a file rewritten in place is hashed again
    return _sha256(files, select)


def revision(pretrained: str | Path, subfolder: str | None = None) -> str | None:
    """The hub commit a checkpoint was read at (its snapshot folder in the hub cache), None for a
    local directory."""
    try:
        files = weight_files(pretrained, subfolder)
    except OSError:
        return None
    m = _SNAPSHOT.search(str(files[0]).replace("\\", "/")) if files else None
    return m.group(1) if m else None


def numeric_policy(dtype: Any) -> dict[str, Any]:
    """What decides an encoder's float arithmetic besides its weights: the compute ``dtype`` and the TF32
    switches in effect when it ran (``torch.backends.cuda.matmul.allow_tf32`` -> ``tf32_matmul``,
    ``torch.backends.cudnn.allow_tf32`` -> ``tf32_cudnn``, ``torch.get_float32_matmul_precision()``).
    The switches change float32 matmuls and convolutions on CUDA (Ampere and later) only; the device
    itself is not recorded (a cache's identity never depended on it)."""
    import torch
    return {"dtype": str(dtype).replace("torch.", ""), "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def identity(pretrained: Any, *, dtype: Any, subfolder: str | None = None,
             select: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """The keys an encoder's ``describe()`` adds for its identity: ``checkpoint_sha256`` and ``revision`` of
    the checkpoint it was loaded from (None when it was built in memory: no ``pretrained``) and ``numerics``
    (:func:`numeric_policy`)."""
    out: dict[str, Any] = {"checkpoint_sha256": None, "revision": None}
    if pretrained:
        out["checkpoint_sha256"] = checkpoint_sha256(pretrained, subfolder, select)
        out["revision"] = revision(pretrained, subfolder)
    out["numerics"] = numeric_policy(dtype)
    return out


__all__ = ["GEMMA3_VISION", "checkpoint_sha256", "identity", "numeric_policy", "revision", "tensor_names", "under", "weight_files"]
