"""Exceptions shared by both stages. Every message names the file and says what to do."""
from __future__ import annotations


class ShardcacheError(Exception):
    """Base class of every error this project raises on purpose."""


class WriteRefused(ShardcacheError):
    """A command that writes a cache refused before writing anything: another command writes it
    (:class:`shards.lock.CacheLocked`, naming the holder) or the folder is not one it may write
    (:class:`shards.writing.NotACache`). Every command line exits 2 for it."""

    exit_code = 2


class ShardCorrupt(ShardcacheError):
    """A shard, its index rows or its manifest entry disagree (truncated tar, bad checksum...)."""


class UnsafePath(ShardCorrupt):
    """An index or manifest names a shard that is not a plain file directly inside the cache
    directory (an absolute path, ``..``, a path separator, or a symlink resolving outside)."""


class ManifestError(ShardCorrupt):
    """A cache's ``manifest.json`` is missing, or a field of it has the wrong type or range; the
    message names the file and the field."""


class UnsupportedFormat(ShardcacheError):
    """``manifest.json`` has a ``format_version`` this code does not know (newer, or not an int)."""


class UnsafeMember(ShardcacheError):
    """A shard holds a member that would need unpickling (``.pkl``, ``.pyd``, ``.pth``, ``.pt``)."""


class FingerprintMismatch(ShardcacheError):
    """A cache directory was made by different encoders or preprocessing than the current job."""


class CorruptSample(ShardcacheError):
    """One input sample cannot be used; ``reason`` is a code from :mod:`shards.schema`."""

    def __init__(self, reason: str, detail: str, source: str = ""):
        super().__init__(f"{reason}: {detail}" + (f" ({source})" if source else ""))
        self.reason = reason
        self.detail = detail
        self.source = source


class ContractMismatch(ShardcacheError):
    """What a model needs and what it is given disagree (a cache and a model's contract,
    :meth:`shards.cache.Cache.require`; a LoRA adapter and the run's options,
    :func:`train.checkpoint.check_adapter`). The message is one line starting ``ContractMismatch:``
    that names every item, the one side's value and the other's. ``item``, ``cache_value`` and
    ``model_value`` are the first mismatch's; ``mismatches`` holds every ``(item, have, need)``.

    Args:
        model: who needs (``--model.name higgs``); cache: what does not fit (a cache's path);
        have / need: how the two values are introduced (``the cache has`` / ``the model needs``);
        hint: what to do, appended in parentheses."""

    def __init__(self, model: str, cache: str, mismatches: list[tuple[str, object, object]], *,
                 have: str = "the cache has", need: str = "the model needs", what: str = "cannot train on the cache",
                 hint: str = "precompute the cache with the model's encoders, template and preset, or pick the "
                             "recipe that fits it"):
        self.model, self.cache, self.mismatches = model, cache, list(mismatches)
        self.item, self.cache_value, self.model_value = self.mismatches[0]
        parts = "; ".join(f"{item}: {have} {c!r}, {need} {m!r}" for item, c, m in self.mismatches)
        super().__init__(f"ContractMismatch: {model} {what} {cache}: {parts}" + (f" ({hint})" if hint else ""))
