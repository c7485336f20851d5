"""What a stage-one job reads of its config, typed, before any encoder loads: :class:`JobOptions`.

The config (:class:`precompute.config.PrecomputeConfig`) is read once, here and by
:meth:`precompute.job.Job.build` (the encoders, producers and decoding); everything else the job does
reads these fields: how the manifest is read (:class:`ReadOptions`), what a rerun compares
(:class:`RerunOptions`), the batch policy recorded with the cache, the chunking, the decode processes, the
precision check, and the config as the cache's ``manifest.json`` records it (local paths absolute, so the
cache reads the same from any folder).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from shardcache.config import to_dict

from .identity import CHECKPOINT_KEY, batch_policy, filter_values, walk


@dataclass(frozen=True)
class ReadOptions:
    """How the manifest is read (the ``read``-scope options): ``fmt`` (``manifest_format``; None: detected),
    ``columns``, ``allow_outside_root``."""

    fmt: str | None = None
    columns: Mapping[str, str] = field(default_factory=dict)
    allow_outside_root: bool = False

    def reader(self, manifest: str | Path, root: str | Path | None = None):
        """The :class:`precompute.manifests.ManifestReader` of ``manifest`` with these options."""
        from .manifests import ManifestReader
        return ManifestReader(manifest, root=root, fmt=self.fmt, columns=dict(self.columns),
                              allow_outside_root=self.allow_outside_root)


@dataclass(frozen=True)
class RerunOptions:
    """What a rerun compares: ``source_digest`` (stat | content), ``keep_removed`` (``keep_removed_rows``) and
    ``filters`` (row scope -> the ``filter`` options in each row's digest: :func:`precompute.identity.filter_values`)."""

    source_digest: str = "stat"
    keep_removed: bool = False
    filters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class PrecisionOptions:
    """The check of an ``encoder_dtype`` other than float32 (:mod:`precompute.precision`): ``dtype``,
    ``samples`` (``precision_samples``) and ``tolerance`` (``precision_tolerance``)."""

    dtype: str = "float32"
    samples: int = 8
    tolerance: Any = None

    @property
    def measured(self) -> bool:
        """Whether the job measures its encoders against float32 before encoding."""
        return self.dtype not in ("float32", "fp32") and self.samples > 0


@dataclass(frozen=True)
class JobOptions:
    """Every fact of the config the job reads outside :meth:`precompute.job.Job.build` (module docstring).

    ``device``: the resolved device (``cuda:LOCAL_RANK`` for ``auto`` with CUDA); ``batch``: the batch policy
    (:func:`precompute.identity.batch_policy`: recorded when a cache is started, compared on every resume);
    ``config``: the config as ``manifest.json`` records it; ``stall_timeout_s``: the stall deadline, seconds
    (:mod:`precompute.faults`)."""

    device: str
    read: ReadOptions
    rerun: RerunOptions
    batch: Mapping[str, Any]
    samples_per_shard: int
    encoder_batch_size: int
    num_workers: int | str
    precision: PrecisionOptions
    store_posterior: bool
    config: Mapping[str, Any]
    stall_timeout_s: float

    @classmethod
    def of(cls, cfg: Any, device: str) -> "JobOptions":
        """The options of ``cfg`` on ``device`` (already resolved: :func:`precompute.job.resolve_device`)."""
        return cls(device=device,
                   read=ReadOptions(cfg.manifest_format, dict(cfg.columns or {}), bool(cfg.allow_outside_root)),
                   rerun=RerunOptions(cfg.source_digest, bool(cfg.keep_removed_rows), filter_values(cfg)),
                   batch=batch_policy(cfg, device), samples_per_shard=int(cfg.samples_per_shard),
                   encoder_batch_size=int(cfg.encoder_batch_size), num_workers=cfg.num_workers,
                   precision=PrecisionOptions(cfg.encoder_dtype, int(cfg.precision_samples), cfg.precision_tolerance),
                   store_posterior=bool(cfg.store_posterior), config=recorded_config(cfg),
                   stall_timeout_s=float(cfg.stall_timeout_s))


def recorded_config(cfg: Any) -> dict[str, Any]:
    """``cfg`` as a dict, each checkpoint (``pretrained``) that names a local file or folder made absolute:
    what ``manifest.json`` records, so that reading the cache from another folder finds the same files
    (a hub id stays as it is)."""
    out = to_dict(cfg)
    for path, value, _, _ in walk(cfg):
        if path.rpartition(".")[2] == CHECKPOINT_KEY and isinstance(value, str) and os.path.exists(value):
            tree = out
            *parents, last = path.split(".")
            for p in parents:
                tree = tree[p]
            tree[last] = os.path.abspath(value)
    return out


__all__ = ["JobOptions", "PrecisionOptions", "ReadOptions", "RerunOptions", "recorded_config"]
