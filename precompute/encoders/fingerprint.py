"""Cache fingerprint: one hash over the encoders' ``describe()`` dicts and the preprocessing settings.

A cache directory stores the fingerprint it was made with; ``precompute`` refuses to add shards to a
cache whose fingerprint differs (other weights, config, dtype, encode version, sample rate, crop...),
so latents or codes from two different encoders are never mixed. Order matters: pass the describe
dicts in a fixed order (e.g. audio, image, text).

Where an encoder's weights were read (its ``describe()``'s ``loaded_from``: the hub id and snapshot commit, or
the local folder; :data:`shardcache.weights.SOURCE_KEY`) is recorded beside its hashes and left out of the
fingerprint: the same files given as a hub id or as a folder make the same cache; their hashes decide.
"""
from __future__ import annotations

import hashlib
from typing import Any

from shardcache.weights import SOURCE_KEY

from ._common import canonical_json

#: part of the hashed payload; bump if the payload layout changes
FINGERPRINT_SCHEMA = "shardcache.encoders.fingerprint/1"


def without_source(obj: Any) -> Any:
    """``obj`` with every mapping's :data:`shardcache.weights.SOURCE_KEY` entry left out, at any depth (an
    encoder's description nests in a producer's, the producers' in the preprocessing)."""
    if isinstance(obj, dict):
        return {k: without_source(v) for k, v in obj.items() if k != SOURCE_KEY}
    if isinstance(obj, (list, tuple)):
        return [without_source(v) for v in obj]
    return obj


def fingerprint_payload(*describe_dicts: dict, preprocessing: dict) -> str:
    """The canonical JSON text that :func:`fingerprint` hashes (store it next to the hash to debug mismatches).

    Raises:
        TypeError: an argument is not a dict, or holds a value with no JSON form.
        ValueError: a NaN/inf float.
    """
    for i, d in enumerate(describe_dicts):
        if not isinstance(d, dict):
            raise TypeError(f"describe dict {i} must be a dict, got {type(d).__name__}")
    if not isinstance(preprocessing, dict):
        raise TypeError(f"preprocessing must be a dict, got {type(preprocessing).__name__}")
    return canonical_json({"schema": FINGERPRINT_SCHEMA, "encoders": without_source(list(describe_dicts)),
                           "preprocessing": without_source(preprocessing)})


def fingerprint(*describe_dicts: dict, preprocessing: dict) -> str:
    """sha256 hex digest (64 chars) of :func:`fingerprint_payload`.

    Example: ``fingerprint(tok.describe(), vae.describe(), preprocessing={"sample_rate": 24000, "crop": 256})``.
    Keys are sorted, so dict order does not matter; list order and every value do.
    """
    return hashlib.sha256(fingerprint_payload(*describe_dicts, preprocessing=preprocessing).encode("ascii")).hexdigest()


def fingerprints_match(expected: str, *describe_dicts: dict, preprocessing: dict) -> bool:
    """True when ``expected`` equals the fingerprint of the given encoders and preprocessing."""
    return expected == fingerprint(*describe_dicts, preprocessing=preprocessing)


__all__: list[Any] = ["fingerprint", "fingerprint_payload", "fingerprints_match", "without_source", "FINGERPRINT_SCHEMA"]
