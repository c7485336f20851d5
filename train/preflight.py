"""Checks of ``shardcache train``'s paths before anything is loaded: a missing or wrong cache, and a
run directory that already holds a run. Each failure is a :class:`shardcache.config.ConfigError`
naming the option, reported by ``train.cli`` as one line and exit status 2 (no config dump, no
traceback, no model loaded).
"""
from __future__ import annotations

from pathlib import Path

from shardcache.config import ConfigError


def cache_problem(path: str) -> str | None:
    """Why the local directory ``path`` is not a cache to train on (None when it is, or when it is a
    URL: the loader reports remote problems). A cache holds ``index.parquet`` and ``manifest.json``
    (stage one writes both); a directory with shards but no index is one whose stage one did not end."""
    from shards.storage import is_url
    if not path or is_url(path):
        return None
    p = Path(path)
    if not p.exists():
        return f"{path} does not exist: give the directory `shardcache precompute --cache DIR` wrote"
    if not p.is_dir():  # a manifest where the cache belongs?
        return (f"{path} is a file (a manifest?), not a cache directory: training reads the tensors stage one caches. "
                f"Run\n  shardcache precompute --manifest {path} --cache DIR --config configs/precompute-tts.yaml\n"
                "first, then pass --cache DIR (or --train_data_file DIR).")
    if not (p / "index.parquet").is_file():
        if any(p.glob("*.tar")) or (p / "parts").is_dir():
            return (f"{path} has shards but no index.parquet: its stage one did not finish; rerun the same "
                    "`shardcache precompute ... --cache` (committed shards are kept)")
        return (f"{path} is not a shardcache cache (no index.parquet or manifest.json): give the directory "
                "`shardcache precompute --cache DIR` wrote")
    return None


#: what marks a run directory as holding a run: checkpoints and the metrics log
RUN_MARKERS = ("metrics.jsonl",)


def run_problem(run_dir: str, resume: str) -> str | None:
    """Why starting in ``run_dir`` needs a choice: it holds a run (``step-N`` checkpoints or
    ``metrics.jsonl``) and ``resume`` is ``''``; None otherwise (``auto``, ``fresh`` or a checkpoint
    named are choices). The message names the flags and the Makefile's variables (``RESUME=auto|fresh``,
    ``RUN=``), since ``make train`` is how the README's users meet it."""
    from .checkpoint import list_checkpoints
    if resume or not Path(run_dir).is_dir():
        return None
    held = [p.name for _, p in list_checkpoints(run_dir)] + [m for m in RUN_MARKERS if (Path(run_dir) / m).exists()]
    if not held:
        return None
    return (f"{run_dir} already holds a run ({', '.join(held)}): --checkpoint.resume auto continues it, "
            "--checkpoint.resume fresh starts again and replaces it, or give another --run_dir "
            "(with make train: RESUME=auto, RESUME=fresh or another RUN=)")


def check(cfg) -> None:
    """Raise :class:`ConfigError` for every path problem of ``cfg`` (a ``TrainConfig``)."""
    problems = [(name, why) for name, why in (("data.cache", cache_problem(cfg.data.cache)),
                                              ("data.val_cache", cache_problem(cfg.data.val_cache)),
                                              ("checkpoint.resume", run_problem(cfg.job.dir, cfg.checkpoint.resume)))
                if why]
    if problems:
        raise ConfigError(problems)
