"""Checkpoints: gather every rank's state, write atomically on global rank 0, keep the last K, resume.

Layout of ``RUN_DIR/step-N/`` (N = optimizer steps completed)::

    model.safetensors   weights of the unwrapped model (no DDP/compile prefixes); or, with LoRA:
    adapter.safetensors the trainable tensors only (LoRA adapters + a recipe's own media modules)
    adapter.json        ... the base model they belong to (its id and a fingerprint of its weights) and
                        the LoRA options they were made with (``lora``: r, alpha, dropout, targets),
                        compared with the run's before any weight loads (:func:`check_adapter`)
    optimizer.pt        optimizer.state_dict()                           } torch.save of plain tensors
    trainer.pt          step, epoch, skipped steps, LR scheduler, grad    } and containers, read back
                        scaler, config, loader + RNG states of EVERY rank } with weights_only=True
    config.json         the effective config (for people); a model with ``checkpoint_config()`` adds
                        what it returns under ``model_config`` (the higgs recipe: its transformers
                        config, ``model_type: higgs_audio_v2``); ``contract``: the items of the
                        model's contract the cache did not meet and the run accepted
                        (``--model.allow_other_encoder_weights``)

The safetensors header (``__metadata__``) of the weights holds ``step``, ``format`` and what the model's
spec records about its own heads (``checkpoint_metadata``: the theworld recipe's
``projection_architecture``, read back when the file is a ``projection_checkpoint``).

Saving is a collective: every rank contributes its loader position and RNG states (torch, numpy,
python, cuda) through ``all_gather_object``; rank 0 alone writes ``step-N.tmp/``, fsyncs each file
and the directory, renames it to ``step-N/`` and fsyncs the run dir; only then are older
checkpoints beyond ``keep`` (and stale ``*.tmp`` dirs) deleted. A directory named ``step-N`` is
therefore complete when written; a crash leaves at most a ``.tmp`` that nothing reads and the next
save removes. All ranks wait at a barrier until rank 0 is done, so no rank can exit (and make a
launcher kill rank 0) in the middle of a write.

Files can still be damaged later (a disk, a copy cut short). ``--checkpoint.resume auto`` checks
the newest checkpoint before using it (every safetensors header against the file size, every
``.pt`` zip directory: :func:`check_readable`); a damaged one is named in a warning and the one
before it is used.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from shards.errors import ContractMismatch
from shards.index import fsync_dir

from . import dist as D
from . import lora as L

log = logging.getLogger("train")

CKPT_RE = re.compile(r"^step-(\d+)$")
WEIGHTS, ADAPTER, ADAPTER_META = "model.safetensors", "adapter.safetensors", "adapter.json"
REQUIRED = ("optimizer.pt", "trainer.pt")   #: plus WEIGHTS or ADAPTER
FORMAT = 2  #: 2: lr_scheduler, scaler and LoRA adapter checkpoints (1 still loads)


class CheckpointDamaged(RuntimeError):
    """A checkpoint file cannot be read (truncated, not a safetensors / torch zip file)."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


# ---- plain state -----------------------------------------------------------------------------------

def to_plain(obj: Any) -> Any:
    """Containers of python scalars, strings and CPU tensors only (what ``weights_only`` loads)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj).copy())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {(k.item() if isinstance(k, np.generic) else k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(v) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint (plain containers/tensors only)")


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states as plain objects."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    st = {"torch": torch.get_rng_state(), "python": random.getstate(),
          "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def set_rng_state(st: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(st["torch"])
    py = st["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = st["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


# ---- files -----------------------------------------------------------------------------------------

def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def is_complete(p: Path) -> bool:
    """A ``step-N`` directory with the trainer and optimizer state and weights (full or adapter)."""
    return p.is_dir() and all((p / f).exists() for f in REQUIRED) and \
        ((p / WEIGHTS).exists() or (p / ADAPTER).exists())


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(step, path)`` in ``out_dir``, oldest first."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        m = CKPT_RE.match(p.name)
        if m and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def _check_safetensors(path: Path) -> None:
    """The header parses and the file holds every byte it promises (a truncated file fails)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointDamaged(path, f"{size} bytes: too short for a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise CheckpointDamaged(path, f"header of {n} bytes in a file of {size} bytes (truncated?)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointDamaged(path, f"unreadable safetensors header ({e})") from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise CheckpointDamaged(path, f"{size} bytes, expected {8 + n + end} from its header (truncated?)")


def check_readable(path: str | Path) -> None:
    """Raise :class:`CheckpointDamaged` naming the first file of checkpoint ``path`` that cannot be
    read: a safetensors file whose size differs from its header's, a ``.pt`` whose zip directory is
    missing (a truncated ``torch.save``). Cheap: no tensor is read."""
    path = Path(path)
    for name in (WEIGHTS, ADAPTER):
        if (path / name).exists():
            _check_safetensors(path / name)
    for name in REQUIRED:
        try:
            with zipfile.ZipFile(path / name) as z:
                if not any(n.endswith("data.pkl") for n in z.namelist()):
                    raise CheckpointDamaged(path / name, "not a torch.save file (no data.pkl)")
        except (zipfile.BadZipFile, OSError) as e:
            raise CheckpointDamaged(path / name, f"unreadable ({e})") from None
    if (path / ADAPTER).exists():
        try:
            json.loads((path / ADAPTER_META).read_text())
        except (OSError, ValueError) as e:
            raise CheckpointDamaged(path / ADAPTER_META, f"unreadable ({e})") from None


def resolve_resume(resume: str, out_dir: str | Path, info: D.DistInfo | None = None) -> Path | None:
    """``''`` or ``'fresh'`` -> None; ``'auto'`` -> the newest complete, readable checkpoint in ``out_dir`` (damaged
    newer ones are named in a warning and skipped), None when there is none; else that directory
    (which must be complete and readable). Raises :class:`CheckpointDamaged` when ``auto`` finds
    checkpoints but none readable, FileNotFoundError for a named directory that is not a checkpoint.
    With a process group, global rank 0 decides and every rank gets its answer."""
    if not resume or resume == "fresh":
        return None
    if info is not None and info.distributed:
        mine = _resolve(resume, out_dir) if info.is_main else None  # (an error on rank 0 ends the job)
        return _agree(mine, info)
    return _resolve(resume, out_dir)


def _agree(mine: Path | None, info: D.DistInfo) -> Path | None:
    got = D.all_gather_object(None if mine is None else str(mine), info)[0]
    return None if got is None else Path(got)


def _resolve(resume: str, out_dir: str | Path) -> Path | None:
    if resume != "auto":
        p = Path(resume)
        if not is_complete(p):
            raise FileNotFoundError(f"--checkpoint.resume {resume}: not a complete checkpoint directory (needs "
                                    f"{', '.join(REQUIRED)} and {WEIGHTS} or {ADAPTER}); use --resume auto for the "
                                    "newest in the run dir")
        check_readable(p)
        return p
    found = list_checkpoints(out_dir)
    damaged = []
    for _, p in reversed(found):
        try:
            check_readable(p)
        except CheckpointDamaged as e:
            damaged.append(e)
            log.warning("checkpoint %s is damaged (%s: %s); trying the one before it", p, e.path.name, e.reason)
            continue
        if damaged:
            log.warning("--resume auto: resuming from %s, not from the damaged %s", p,
                        ", ".join(str(d.path.parent) for d in damaged))
        return p
    if damaged:
        raise CheckpointDamaged(Path(out_dir), "every checkpoint is damaged: " + "; ".join(map(str, damaged)))
    return None


def _save_tensor_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(obj: Any, path: Path) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by state-dict name (what a LoRA checkpoint holds)."""
    return {n: p.detach().contiguous().cpu() for n, p in model.named_parameters() if p.requires_grad}


def base_fingerprint(model: nn.Module, samples: int = 4096) -> str:
    """sha256 over the frozen parameters of ``model`` (those a LoRA checkpoint leaves out): each
    one's name, dtype, shape and ``samples`` evenly spaced elements. Cheap for an 8 B model, and
    any other base (other weights, another size or architecture) gives another fingerprint with
    overwhelming probability."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda x: x[0]):
        if p.requires_grad:
            continue
        flat = p.detach().reshape(-1)
        # evenly spaced indices in integer arithmetic: a float32 linspace rounds n - 1 up past the end
        # for some n > 2**24 (Llama-3.2-1B's 262,668,288-element embedding gave index n: IndexError)
        k = min(samples, flat.numel())
        idx = torch.arange(k, device=flat.device) * max(flat.numel() - 1, 0) // max(k - 1, 1)
        h.update(f"{name}|{p.dtype}|{tuple(p.shape)}|".encode())
        h.update(flat[idx].float().cpu().numpy().tobytes())
    return h.hexdigest()


def write_dir(out_dir: Path, step: int, model: nn.Module, optimizer_state: dict, trainer_state: dict,
              config: dict, adapter: dict | None = None, metadata: dict[str, str] | None = None) -> Path:
    """Write ``out_dir/step-N`` atomically (tmp dir, fsync, rename). ``adapter`` (the base's id and
    fingerprint, LoRA options): write the trainable tensors only. ``metadata``: more ``{key: str}`` for the
    weights' safetensors header (the model's ``checkpoint_metadata``). Returns the final path."""
    from safetensors.torch import save_file, save_model

    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"step-{step}"
    tmp = out_dir / f"step-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    meta = {**{str(k): str(v) for k, v in (metadata or {}).items()}, "step": str(step), "format": str(FORMAT)}
    if adapter is None:
        save_model(model, str(tmp / WEIGHTS), metadata=meta)
        _fsync_file(tmp / WEIGHTS)
    else:
        save_file(trainable_state(model), str(tmp / ADAPTER), metadata={**meta, "base": str(adapter["base"])})
        _fsync_file(tmp / ADAPTER)
        _write_json(adapter, tmp / ADAPTER_META)
    _save_tensor_file(optimizer_state, tmp / "optimizer.pt")
    _save_tensor_file(trainer_state, tmp / "trainer.pt")
    _write_json(config, tmp / "config.json")
    fsync_dir(tmp)
    old = None
    if final.exists():  # same step saved again (e.g. a resumed run stopped at once): swap it out
        old = out_dir / f"step-{step}.old.tmp"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def prune(out_dir: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep`` and leftover ``*.tmp`` dirs."""
    removed = []
    for p in Path(out_dir).glob("step-*.tmp"):
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    for _, p in list_checkpoints(out_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    if removed:
        fsync_dir(Path(out_dir))
    return removed


# ---- the collective save / load ------------------------------------------------------------------

def save(out_dir: str | Path, step: int, *, model: nn.Module, state: dict[str, Any], loader_state: dict[str, Any],
         info: D.DistInfo, config: dict, keep: int, adapter: dict | None = None,
         metadata: dict[str, str] | None = None) -> Path | None:
    """Collective: gather loader + RNG states of every rank, rank 0 writes ``step-N``, all wait.

    ``loader_state``: this rank's loader position after the last batch trained on (its
    ``state_dict()``; with batches prefetched to the device, the one recorded with that batch).

    ``model`` is the unwrapped model (not DDP, not compiled); ``state``: ``optimizer`` (its
    state_dict) and the trainer's own stateful parts (``lr_scheduler``, ``scaler``, ``train_state``:
    plain values), the same on every rank; ``adapter``, ``metadata``: see :func:`write_dir`. Returns the
    path on rank 0, None elsewhere.
    """
    local = {"loader": to_plain(loader_state), "rng": rng_state(info.device)}
    states = D.all_gather_object(local, info)
    path = None
    if info.is_main:
        rest = {k: v for k, v in state.items() if k != "optimizer"}
        trainer_state = to_plain({
            "format": FORMAT, "step": step, "world_size": info.world_size,
            "loaders": [s["loader"] for s in states], "rng": [s["rng"] for s in states],
            "config": config, **rest,
        })
        path = write_dir(Path(out_dir), step, model, to_plain(state["optimizer"]), trainer_state, config, adapter,
                         metadata)
        prune(Path(out_dir), keep)
        log.info("saved checkpoint %s", path)
    D.barrier(info)
    return path


def load_weights(model: nn.Module, path: str | Path, strict: bool = True) -> None:
    """Load ``model.safetensors`` of a checkpoint dir (or a .safetensors file) into ``model``."""
    from safetensors.torch import load_model

    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS
    missing, unexpected = load_model(model, str(p), strict=strict)
    if missing or unexpected:
        log.warning("loaded %s with missing=%s unexpected=%s", p, missing[:8], unexpected[:8])


def is_adapter(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint directory holding a LoRA adapter (not full weights)."""
    p = Path(path)
    return p.is_dir() and (p / ADAPTER).exists() and not (p / WEIGHTS).exists()


def check_adapter(path: str | Path, lora: dict | None, what: str = "--model.init_from") -> dict:
    """Refuse adapter checkpoint ``path`` unless it was made with the LoRA options ``lora`` (the run's, as
    the model will carry them: :meth:`train.spec.ModelSpec.lora_options`), before any weight loads: the
    options decide the adapters' shapes (``r``, ``targets``) and the function they compute (``alpha / r``
    scales them; ``dropout``), so an adapter of another rank would not load and one of another alpha
    would load and compute something else. Returns ``adapter.json``.

    Raises ``ValueError`` when the run has no LoRA, :class:`shards.errors.ContractMismatch` naming every
    option that differs (``lora.r``, ``lora.alpha``, ``lora.dropout``, ``lora.targets``), the adapter's
    value and the run's (also when the adapter records none)."""
    p = Path(path)
    meta = json.loads((p / ADAPTER_META).read_text())
    if lora is None:
        raise ValueError(f"{what} {path} is a LoRA adapter checkpoint: enable --lora with its options "
                         f"({meta.get('lora')})")
    diff = L.differences(L.recorded(meta), lora)
    if diff:
        raise ContractMismatch(f"{what} {path}", "(its adapter.json)", diff, have="the adapter has",
                               need="the run has", what="was made with other LoRA options", hint=(
                                   "set --lora.r / --lora.alpha / --lora.dropout / --lora.targets (or "
                                   "model.kwargs.lora) to the adapter's, or start without it"))
    return meta


def load_adapter(model: nn.Module, path: str | Path, lora: dict | None = None) -> dict:
    """Load an adapter checkpoint onto ``model`` (LoRA already applied, base weights loaded): every
    saved tensor must name a parameter of ``model`` and every trainable parameter must be saved.
    ``lora``: the run's LoRA options, checked first (:func:`check_adapter`). Raises ValueError when the
    base's fingerprint differs from the one the adapter was trained on (naming both bases). Returns
    ``adapter.json``."""
    from safetensors.torch import load_file

    p = Path(path)
    meta = check_adapter(p, lora) if lora is not None else json.loads((p / ADAPTER_META).read_text())
    mine = base_fingerprint(model)
    if meta.get("base_fingerprint") and meta["base_fingerprint"] != mine:
        raise ValueError(f"{p}: this adapter was trained on the base {meta.get('base')!r} (weights fingerprint "
                         f"{meta['base_fingerprint'][:16]}...), this run's base has fingerprint {mine[:16]}...: "
                         "refusing to load it onto another base model (model.kwargs.lm / init_from / seed)")
    tensors = load_file(str(p / ADAPTER))
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    missing = sorted(n for n, q in params.items() if q.requires_grad and n not in tensors)
    if unknown or missing:
        raise ValueError(f"{p / ADAPTER} does not fit this model (LoRA options {meta.get('lora')}): "
                         f"unknown tensors {unknown[:5]}, trainable parameters not in it {missing[:5]}")
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t)
    return meta


def load_model(model: nn.Module, path: str | Path, lora: dict | None = None) -> None:
    """The weights of checkpoint ``path`` into ``model``: full (``model.safetensors``, strict) or a
    LoRA adapter (:func:`load_adapter`, checked against the run's LoRA options ``lora`` when given)."""
    if is_adapter(path):
        load_adapter(model, path, lora)
    else:
        load_weights(model, path, strict=True)


#: files of a base checkpoint directory copied beside an export (tokenizer, chat template, processor)
EXPORT_COPIES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                 "tokenizer.model", "chat_template.jinja", "chat_template.json", "processor_config.json",
                 "preprocessor_config.json")


def export_pretrained(model: nn.Module, out_dir: str | Path, base: str | Path | None = None) -> Path:
    """Write a recipe whose every weight is its ``transformers`` model (``model.lm``; the higgs recipe) as
    a ``from_pretrained`` directory: LoRA adapters, if any, merged into their base layers and removed
    (peft's ``LoraLayer.merge`` then the base layer put back, what ``PeftModel.merge_and_unload`` does;
    the recipe's LM is changed in place), then ``model.lm.save_pretrained(out_dir)`` (safetensors), and
    the tokenizer / chat template / processor files of ``base`` (a local checkpoint directory) copied.

    Load a run first (:func:`load_model` on ``step-N``). Returns ``out_dir``. Raises ``ValueError`` for a
    recipe with weights outside its LM (its :meth:`media_modules`: they would be lost).
    """
    media = model.media_modules()
    if media:
        raise ValueError(f"{type(model).__name__} has weights outside its LM ({', '.join(type(m).__name__ for m in media)}): "
                         "a from_pretrained export of the LM alone would lose them")
    from peft.tuners.tuners_utils import BaseTunerLayer

    lm = model.lm
    for name, module in [(n, m) for n, m in lm.named_modules() if isinstance(m, BaseTunerLayer)]:
        module.merge()
        parent, _, attr = name.rpartition(".")
        setattr(lm.get_submodule(parent) if parent else lm, attr, module.get_base_layer())
    if "peft_config" in vars(lm):
        del lm.peft_config
    model.lora = None
    out = Path(out_dir)
    lm.save_pretrained(str(out))
    if base is not None and Path(base).is_dir():
        for f in EXPORT_COPIES:
            if (Path(base) / f).is_file():
                shutil.copy2(Path(base) / f, out / f)
    log.info("exported %s to %s (from_pretrained)", type(lm).__name__, out)
    return out


def read_state(path: str | Path, info: D.DistInfo) -> dict[str, Any]:
    """The optimizer and trainer state of checkpoint ``path`` for this rank, and its RNG restored.

    Returns ``trainer.pt``'s contents with ``optimizer`` (the optimizer state_dict) and ``loader``
    (this rank's position) added. With the same world size each rank takes its own saved loader and
    RNG state; with another world size (same global batch) every rank gives the loader rank 0's
    state (the position is global: the loader maps it onto the new split) and reseeds its RNGs
    from (seed, step, rank).
    """
    path = Path(path)
    st = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    st["optimizer"] = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    same_world = st["world_size"] == info.world_size
    st["loader"] = st["loaders"][info.rank if same_world else 0]
    if same_world:
        set_rng_state(st["rng"][info.rank], info.device)
    else:
        log.warning("checkpoint written by %d ranks, resuming on %d: data position kept, RNG reseeded",
                    st["world_size"], info.world_size)
        config = st.get("config", {})
        seed = int((config.get("data") or {}).get("seed", config.get("seed", 0)))
        seed = seed * 1_000_003 + int(st["step"]) * 101 + info.rank
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
    return st


class Checkpointer:
    """The checkpoints of one run (after torchtitan's ``CheckpointManager``): the run directory, how
    many to keep, which one to resume from (``checkpoint.resume``), and what an adapter checkpoint
    records about its base (``adapter``: :func:`train.trainer.adapter_info`). Built once by the
    trainer; :meth:`save` and :meth:`load` are its two verbs (both collective with a process group).
    """

    def __init__(self, out_dir: str | Path, info: D.DistInfo, *, keep: int, resume: str = "",
                 adapter: dict | None = None, metadata: dict[str, str] | None = None):
        self.out, self.info, self.keep, self.resume, self.adapter = Path(out_dir), info, int(keep), resume, adapter
        self.metadata = metadata   #: the model's ``checkpoint_metadata`` (its weights' safetensors header)

    def find(self) -> Path | None:
        """The checkpoint to resume from (:func:`resolve_resume`), None for a fresh start."""
        return resolve_resume(self.resume, self.out, self.info)

    def existing(self) -> list[tuple[int, Path]]:
        """The complete checkpoints of the run directory, oldest first."""
        return list_checkpoints(self.out)

    def load(self, path: Path, model: nn.Module, check: Any = None) -> dict[str, Any]:
        """This rank's state of ``path`` (:func:`read_state`), then the weights into ``model`` (full or
        adapter); ``check(state, path)`` runs in between (it may refuse the checkpoint)."""
        st = read_state(path, self.info)
        if check is not None:
            check(st, path)
        load_model(model, path, (self.adapter or {}).get("lora"))
        return st

    def save(self, step: int, *, model: nn.Module, state: dict[str, Any], loader_state: dict[str, Any],
             config: dict) -> Path | None:
        """Checkpoint ``step-N`` (:func:`save`; the path on rank 0, None elsewhere)."""
        return save(self.out, step, model=model, state=state, loader_state=loader_state, info=self.info,
                    config=config, keep=self.keep, adapter=self.adapter, metadata=self.metadata)
