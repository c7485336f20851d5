"""The shardcache on-disk format: schema, atomic writer, scanner, Parquet index, mmap reader.

Imports neither ``precompute`` nor ``loaders``/``train``; both stages import it.
"""
from .errors import CorruptSample, FingerprintMismatch, ShardCorrupt, ShardcacheError, UnsafeMember
from .index import merge_parts, read_index, read_manifest, read_rejects
from .reader import ShardReader
from .scan import scan_shard
from .schema import FORMAT_VERSION, safe_key, shard_name
from .writer import ShardWriter

__all__ = [
    "CorruptSample", "FingerprintMismatch", "ShardCorrupt", "ShardcacheError", "UnsafeMember",
    "merge_parts", "read_index", "read_manifest", "read_rejects", "ShardReader", "scan_shard",
    "FORMAT_VERSION", "safe_key", "shard_name", "ShardWriter",
]
