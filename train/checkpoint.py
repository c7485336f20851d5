"""Checkpoints: gather every rank's state, write atomically on global rank 0, keep the last K, resume.

Layout of ``OUT/step-N/`` (N = optimizer steps completed)::

    model.safetensors   weights of the unwrapped model (no DDP/compile prefixes)
    optimizer.pt        optimizer.state_dict()                     } torch.save of plain tensors and
    trainer.pt          step, epoch, schedule, counters, config,    } containers, read back with
                        loader state and RNG states of EVERY rank   } torch.load(weights_only=True)
    config.json         the effective config (for people)

Saving is a collective: every rank contributes its loader position and RNG states (torch, numpy,
python, cuda) through ``all_gather_object``; rank 0 alone writes ``step-N.tmp/``, fsyncs each file
and the directory, renames it to ``step-N/`` and fsyncs ``OUT``; only then are older checkpoints
beyond ``keep`` (and stale ``*.tmp`` dirs) deleted. A directory named ``step-N`` is therefore
always complete; a crash leaves at most a ``.tmp`` that nothing reads and the next save removes.
All ranks wait at a barrier until rank 0 is done, so no rank can exit (and make a launcher kill
rank 0) in the middle of a write.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from shards.index import fsync_dir

from . import dist as D

log = logging.getLogger("train")

CKPT_RE = re.compile(r"^step-(\d+)$")
REQUIRED = ("model.safetensors", "optimizer.pt", "trainer.pt")
FORMAT = 1


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


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints ``(step, path)`` in ``out_dir``, oldest first."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        m = CKPT_RE.match(p.name)
        if m and p.is_dir() and all((p / f).exists() for f in REQUIRED):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest(out_dir: str | Path) -> Path | None:
    ck = list_checkpoints(out_dir)
    return ck[-1][1] if ck else None


def resolve_resume(resume: str, out_dir: str | Path) -> Path | None:
    """``''`` -> None; ``'auto'`` -> newest complete checkpoint or None; else that directory."""
    if not resume:
        return None
    if resume == "auto":
        return latest(out_dir)
    p = Path(resume)
    if not (p.is_dir() and all((p / f).exists() for f in REQUIRED)):
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint directory "
                                f"(needs {', '.join(REQUIRED)}); use --resume auto for the newest in --out")
    return p


def _save_tensor_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_dir(out_dir: Path, step: int, model: nn.Module, optimizer_state: dict, trainer_state: dict,
              config: dict) -> Path:
    """Write ``out_dir/step-N`` atomically (tmp dir, fsync, rename). Returns the final path."""
    from safetensors.torch import save_model

    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"step-{step}"
    tmp = out_dir / f"step-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"), metadata={"step": str(step), "format": str(FORMAT)})
    _fsync_file(tmp / "model.safetensors")
    _save_tensor_file(optimizer_state, tmp / "optimizer.pt")
    _save_tensor_file(trainer_state, tmp / "trainer.pt")
    with open(tmp / "config.json", "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
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

def save(out_dir: str | Path, step: int, *, model: nn.Module, optimizer: torch.optim.Optimizer,
         loader: Any, info: D.DistInfo, config: dict, keep: int, extra: dict | None = None) -> Path | None:
    """Collective: gather loader + RNG states of every rank, rank 0 writes ``step-N``, all wait.

    ``model`` is the unwrapped model (not DDP, not compiled). Returns the path on rank 0.
    """
    local = {"loader": to_plain(loader.state_dict()), "rng": rng_state(info.device)}
    states = D.all_gather_object(local, info)
    path = None
    if info.is_main:
        trainer_state = to_plain({
            "format": FORMAT, "step": step, "world_size": info.world_size,
            "loaders": [s["loader"] for s in states], "rng": [s["rng"] for s in states],
            "config": config, **(extra or {}),
        })
        path = write_dir(Path(out_dir), step, model, to_plain(optimizer.state_dict()), trainer_state, config)
        prune(Path(out_dir), keep)
        log.info("saved checkpoint %s", path)
    D.barrier(info)
    return path


def load_weights(model: nn.Module, path: str | Path, strict: bool = True) -> None:
    """Load ``model.safetensors`` of a checkpoint dir (or a .safetensors file) into ``model``."""
    from safetensors.torch import load_model

    p = Path(path)
    if p.is_dir():
        p = p / "model.safetensors"
    missing, unexpected = load_model(model, str(p), strict=strict)
    if missing or unexpected:
        log.warning("loaded %s with missing=%s unexpected=%s", p, missing[:8], unexpected[:8])


def load(path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any,
         info: D.DistInfo) -> dict[str, Any]:
    """Restore weights, optimizer, this rank's loader position and RNG; return the trainer state.

    The optimizer's per-group ``base_lr`` (the lr before the schedule) stays as this run configured
    it, so a resumed run with another ``--lr`` uses the new one, as it did before groups had their own.

    With the same world size each rank takes its own saved state. With another world size (same
    global batch) every rank gives the loader rank 0's state (the position is global: the loader
    maps it onto the new split) and reseeds its RNGs from (seed, step, rank).
    """
    path = Path(path)
    load_weights(model, path, strict=True)
    base_lrs = [g.get("base_lr") for g in optimizer.param_groups]
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    for g, base in zip(optimizer.param_groups, base_lrs):  # the lrs are this run's config, as before
        if base is not None:
            g["base_lr"] = base
    st = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    same_world = st["world_size"] == info.world_size
    loader.load_state_dict(st["loaders"][info.rank if same_world else 0])
    if same_world:
        set_rng_state(st["rng"][info.rank], info.device)
    else:
        log.warning("checkpoint written by %d ranks, resuming on %d: data position kept, RNG reseeded",
                    st["world_size"], info.world_size)
        seed = int(st.get("config", {}).get("seed", 0)) * 1_000_003 + int(st["step"]) * 101 + info.rank
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)
    return st
