"""The per-member checksum: XXH3-64 of each index entry's bytes, recorded at write time, checked on every read.

Where it comes from: :func:`shards.scan.scan_shard` (the one function that turns a written tar
into index rows: stage one's shards, ``add-field`` sidecars, ``shards reindex``) stores, in each
member entry of ``index.parquet`` (field :data:`COLUMN` of :data:`shards.index.MEMBER_TYPE`,
uint64), the checksum of the bytes the entry locates: an array's raw payload (``offset``,
``size``: exactly the bytes a loader copies into a batch, ``.npy`` header excluded), or a whole
member (``json``, ``tensors.npz``); an entry without one is refused as damage.

Why XXH3-64 (:mod:`xxhash`, ``xxh3_64`` with seed 0): the fastest of the checksums measured (crc32c,
google-crc32c, ISA-L crc32, zlib.crc32; figures in docs/benchmarks.md). The reader hashes each member right after copying it into
its batch (the bytes are still in cache), so the check costs one pass over cached bytes per read
(see docs/loader.md for the measured cost). It detects accidental damage (bit flips, torn or
misplaced writes, a shard rewritten under a reader); it is not a defence against an attacker who
can also rewrite the index (``shards verify`` checks the sha256 recorded in ``manifest.json``).
"""
from __future__ import annotations

from typing import Iterable

import xxhash

#: name of the member-entry field holding the checksum (uint64; null = not recorded)
COLUMN = "xxh3"
#: what it is, for messages and docs
ALGORITHM = "xxh3_64"


from xxhash import xxh3_64_intdigest  # noqa: E402,F401 - the hot path calls it directly (shards.readinto)


def checksum(data) -> int:
    """XXH3-64 (seed 0) of a bytes-like object (bytes, memoryview, C-contiguous numpy array) as an
    unsigned int in ``[0, 2**64)``."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_of_parts(parts: Iterable) -> int:
    """:func:`checksum` of the concatenation of ``parts`` (bytes-like objects), without joining them
    (a member copied into several rows of a padded batch tensor is hashed where it landed)."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


__all__ = ["COLUMN", "ALGORITHM", "checksum", "checksum_of_parts"]
