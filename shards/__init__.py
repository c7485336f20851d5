"""The shardcache on-disk format: schema, atomic writer, scanner, Parquet index, mmap reader.

Imports neither ``precompute`` nor ``loaders``/``train``; both stages import it.
"""
from .errors import (CorruptSample, FingerprintMismatch, ManifestError, ShardCorrupt, ShardcacheError,
                     UnsafeMember, UnsafePath, UnsupportedFormat)
from .manifest import CacheManifest, check_format_version, read_manifest
from .index import read_cache_id, read_index, read_rejects, safe_shard_path
from .merge import cache_id, merge_parts
from .reader import ShardReader, value_checks_from_manifest
from .scan import scan_shard
from .schema import FORMAT_VERSION, safe_key, shard_name
from .writer import ShardWriter
from .cache import Cache, Contract  # noqa: E402 (the cache opened once: stage two's one reader)
from .errors import ContractMismatch

__all__ = [
    "CorruptSample", "FingerprintMismatch", "ManifestError", "cache_id", "read_cache_id", "ShardCorrupt",
    "ShardcacheError", "UnsafeMember", "UnsafePath", "UnsupportedFormat", "check_format_version", "CacheManifest",
    "safe_shard_path",
    "value_checks_from_manifest",
    "merge_parts", "read_index", "read_manifest", "read_rejects", "ShardReader", "scan_shard",
    "FORMAT_VERSION", "safe_key", "shard_name", "ShardWriter",
]
__all__ += ["Cache", "Contract", "ContractMismatch"]
