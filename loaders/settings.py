"""The loader's settings, in three small sections: :class:`Order`, :class:`Workers`, :class:`Reads`
(and :class:`Mix` for :class:`loaders.MixedLoader`).

``ShardLoader(cache, batch_size, seed=..., fields=..., filters=..., ranks=..., order=Order(...),
workers=Workers(...), reads=Reads(...), transform=...)``: each section groups what it decides, every
field with its own docstring (the configuration style of torchtitan's ``JobConfig``), so a trainer's
config can name them (``data.loader_kwargs: {order: {shuffle: false}, reads: {checks: values}}``,
checked field by field against these declarations: :func:`settings_problems`). Every section is a
frozen dataclass that refuses a value it cannot honour when built (``ValueError`` naming the field).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

#: what a read checks: each member's checksum, the kinds' value checks, or nothing (benchmarks)
CHECKS = ("checksums", "values", "none")
#: the start methods a worker may be given (None: the loader's choice, :mod:`loaders.context`)
CONTEXTS = ("fork", "spawn", "forkserver")


def _int(owner: str, name: str, v: Any, lo: int, none: bool = False) -> None:
    if none and v is None:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{owner}.{name} must be an integer >= {lo}{' or None' if none else ''}, got {v!r}")


def _bool(owner: str, name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{owner}.{name} must be true or false, got {v!r}")


@dataclass(frozen=True)
class Order:
    """Which samples an epoch holds, in which order, cut into which steps (a pure function of
    ``(seed, epoch)`` and the index: :mod:`loaders.order`, :mod:`loaders.batching`)."""

    shuffle: bool = True
    """False: index order (shards in name order, samples in tar order)."""
    shuffle_window: int = 0
    """> 1: also shuffle within consecutive windows of that many samples of the order (across shards)."""
    drop_remainder: bool = True
    """Drop the N mod G last samples (G = world size x batch_size); False: wrap around to the start of the
    epoch's order to fill the last step."""
    max_frames: int | None = None
    """Budget batching: at most max_frames padded codes frames per batch (B x F_max), with length buckets;
    batch_size is then the most samples a batch holds. None: fixed batches of batch_size."""
    bucket_window: int | None = None
    """Budget batching: samples per sorting window (None: 64 x batch_size)."""

    def __post_init__(self):
        _bool("Order", "shuffle", self.shuffle)
        _bool("Order", "drop_remainder", self.drop_remainder)
        _int("Order", "shuffle_window", self.shuffle_window, 0)
        _int("Order", "max_frames", self.max_frames, 1, none=True)
        _int("Order", "bucket_window", self.bucket_window, 1, none=True)


@dataclass(frozen=True)
class Workers:
    """Who reads the batches: worker processes, or threads of the loader's own process."""

    num_workers: int | None = 0
    """DataLoader worker processes, each reading whole batches (0: the loader's own process reads; None:
    min(8, this rank's cores - 1), at least 1)."""
    prefetch_factor: int = 2
    """Batches each worker (or read-ahead thread) keeps ready."""
    persistent_workers: bool = True
    """Keep the worker processes between epochs (their slots, files and maps stay)."""
    multiprocessing_context: str | None = None
    """How workers start: fork | spawn | forkserver; None: fork unless CUDA is initialised in this process,
    then a forkserver with the loaders preloaded (loaders.context)."""
    timeout: float = 0.0
    """Seconds to wait for a worker's batch (0: forever)."""
    read_threads: int = 2
    """With num_workers 0: threads of this process reading the next batches while the consumer works (1: each
    batch read when asked for). Not used with workers or for remote caches (their download thread runs ahead)."""

    def __post_init__(self):
        _int("Workers", "num_workers", self.num_workers, 0, none=True)
        _int("Workers", "prefetch_factor", self.prefetch_factor, 1)
        _int("Workers", "read_threads", self.read_threads, 1)
        _bool("Workers", "persistent_workers", self.persistent_workers)
        if self.multiprocessing_context is not None and self.multiprocessing_context not in CONTEXTS:
            raise ValueError(f"Workers.multiprocessing_context must be one of {CONTEXTS} or None, "
                             f"got {self.multiprocessing_context!r}")
        if not isinstance(self.timeout, (int, float)) or isinstance(self.timeout, bool) or not self.timeout >= 0:
            raise ValueError(f"Workers.timeout must be a number of seconds >= 0, got {self.timeout!r}")


@dataclass(frozen=True)
class Reads:
    """What a batch holds and what every read checks."""

    compact: bool = False
    """Keep the stored dtypes (int16 audio, float16 latents, int32 ids, int16 codes): half the bytes to copy
    and to move; loaders.device.to_device widens them on the device. False: float32 / int64 on the host."""
    checks: str = "checksums"
    """What every read checks: checksums (each member's XXH3-64 against the index) | values (the kinds' value
    checks: codes and ids in range, floats finite) | none (benchmarks). A shard replaced, resized or deleted
    under the loader, or a member past the end of its file, is always caught."""
    skip_corrupt: int = 0
    """Damaged samples (checksum mismatch, truncated member, bad value) the loader may leave out of their
    batch (logged, named) before it raises ShardCorrupt, over its life; 0: the first one stops it."""
    verify_reads: bool = False
    """Also check every sample's sha256 against the index as it is read."""
    pin_memory: bool | None = None
    """Page-locked batches (a non_blocking copy to the GPU): None: where CUDA is available."""
    cache_limit: int | None = None
    """Remote caches: bytes of shard files kept locally (None: 32 GiB); files this epoch will not read again
    are deleted first to stay under it."""

    def __post_init__(self):
        _bool("Reads", "compact", self.compact)
        _bool("Reads", "verify_reads", self.verify_reads)
        _int("Reads", "skip_corrupt", self.skip_corrupt, 0)
        _int("Reads", "cache_limit", self.cache_limit, 1, none=True)
        if self.checks not in CHECKS:
            raise ValueError(f"Reads.checks must be one of {CHECKS}, got {self.checks!r}")
        if self.pin_memory is not None:
            _bool("Reads", "pin_memory", self.pin_memory)


@dataclass(frozen=True)
class Mix:
    """How :class:`loaders.MixedLoader` mixes its caches (:mod:`loaders.mixing`)."""

    weights: Mapping[str, float] | Sequence[float] = field(default_factory=dict)
    """{cache name: weight} or weights in the caches' order; > 0, normalised."""
    samples_per_epoch: int | None = None
    """Samples per epoch (None: floor(min_i N_i / w_i), the most before a cache repeats within an epoch)."""
    filters: Mapping[str, Any] = field(default_factory=dict)
    """{cache name: filters} (shards.filters.filter_rows) of the caches that have one."""

    def __post_init__(self):
        _int("Mix", "samples_per_epoch", self.samples_per_epoch, 1, none=True)


#: the sections of the loader's settings, by their keyword (ShardLoader(order=..., workers=..., reads=...))
SECTIONS: dict[str, type] = {"order": Order, "workers": Workers, "reads": Reads}


def build(section: str, values: Mapping[str, Any], base: Any = None) -> Any:
    """Section ``section`` (a key of :data:`SECTIONS`) with ``values`` set over ``base`` (default: the
    section's defaults). Raises ``ValueError`` naming an unknown field (and the known ones) or a value the
    section refuses."""
    cls = SECTIONS[section]
    known = [f.name for f in dataclasses.fields(cls)]
    bad = [k for k in values if k not in known]
    if bad:
        raise ValueError(f"{section}.{bad[0]}: not a field of loaders.{cls.__name__}; it has: {', '.join(known)}")
    return dataclasses.replace(base if base is not None else cls(), **dict(values))


def settings_problems(kwargs: Mapping[str, Any], set_by_caller: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``(key, message)`` for each problem of the sections in a mapping of loader settings
    ``{section: {field: value}}`` (``data.loader_kwargs``; other keys are not looked at): a section that is
    not a mapping, a field its section does not declare, a value it refuses, a field ``set_by_caller``
    names (``{"workers.num_workers": "--data.num_workers"}``: the caller sets it)."""
    out, set_by_caller = [], set_by_caller or {}
    for k, v in kwargs.items():
        if k not in SECTIONS:
            continue
        if not isinstance(v, Mapping):
            out.append((k, f"expected a mapping of loaders.{SECTIONS[k].__name__}'s fields, got {v!r}"))
            continue
        for name, value in v.items():
            if f"{k}.{name}" in set_by_caller:
                out.append((f"{k}.{name}", f"set by the trainer: use {set_by_caller[f'{k}.{name}']}"))
                continue
            try:
                build(k, {name: value})
            except ValueError as e:
                out.append((f"{k}.{name}", str(e).split(": ", 1)[-1] if str(e).startswith(f"{k}.") else str(e)))
    return out


__all__ = ["Order", "Workers", "Reads", "Mix", "SECTIONS", "CHECKS", "build", "settings_problems"]
