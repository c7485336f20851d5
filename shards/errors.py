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
    """A cache does not meet a model's contract (:meth:`shards.cache.Cache.require`): the message is
    one line naming each item, the cache's value and the model's value. ``item``, ``cache_value``
    and ``model_value`` are the first mismatch's; ``mismatches`` holds every ``(item, cache, model)``."""

    def __init__(self, model: str, cache: str, mismatches: list[tuple[str, object, object]]):
        self.model, self.cache, self.mismatches = model, cache, list(mismatches)
        self.item, self.cache_value, self.model_value = self.mismatches[0]
        parts = "; ".join(f"{item}: the cache has {c!r}, the model needs {m!r}" for item, c, m in self.mismatches)
        super().__init__(f"{model} cannot train on the cache {cache}: {parts} (precompute the cache with the "
                         "model's codec / tokenizer / image preset, or pick the recipe that fits it)")
