"""Cache fingerprint: one hash over the encoders' ``describe()`` dicts and the preprocessing settings.

A cache directory stores the fingerprint it was made with; ``precompute`` refuses to add shards to a
cache whose fingerprint differs (other weights, config, dtype, encode version, sample rate, crop...),
so latents or codes from two different encoders are never mixed. Order matters: pass the describe
dicts in a fixed order (e.g. audio, image, text).
"""
from __future__ import annotations

import hashlib
from typing import Any

from ._common import canonical_json

#: part of the hashed payload; bump if the payload layout changes
FINGERPRINT_SCHEMA = "shardcache.encoders.fingerprint/1"


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
    return canonical_json({"schema": FINGERPRINT_SCHEMA, "encoders": list(describe_dicts), "preprocessing": preprocessing})


def fingerprint(*describe_dicts: dict, preprocessing: dict) -> str:
    """sha256 hex digest (64 chars) of :func:`fingerprint_payload`.

    Example: ``fingerprint(tok.describe(), vae.describe(), preprocessing={"sample_rate": 24000, "crop": 256})``.
    Keys are sorted, so dict order does not matter; list order and every value do.
    """
    return hashlib.sha256(fingerprint_payload(*describe_dicts, preprocessing=preprocessing).encode("ascii")).hexdigest()


def fingerprints_match(expected: str, *describe_dicts: dict, preprocessing: dict) -> bool:
    """True when ``expected`` equals the fingerprint of the given encoders and preprocessing."""
    return expected == fingerprint(*describe_dicts, preprocessing=preprocessing)


__all__: list[Any] = ["fingerprint", "fingerprint_payload", "fingerprints_match", "FINGERPRINT_SCHEMA"]
