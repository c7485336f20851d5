"""Sample keys: one distinct WebDataset-safe key per kept manifest row, never longer than the limit.

A row's key is its manifest key made safe (:func:`shards.schema.safe_key`) or, for a row without
one, :func:`identity_key`: a hash of what identifies the row (its sources with their windows, the
bytes of inline audio, its text and turns). :func:`assign_keys` then gives every row a key no
other row has: first each row whose safe key is still free takes it (in manifest order), then
each row whose safe key was taken by another row gets ``SAFE-HHHHHHHH`` (8 hex of a hash of its
own manifest key), with ``SAFE`` shortened so the whole key stays within
:data:`shards.schema.MAX_KEY_BYTES`, and checked against every key taken so far, literal or
suffixed (a taken one is hashed again). A literal key that looks like a suffixed one therefore
never meets it in a tar.
"""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

from shards import schema

from .conversation import Conversation

#: hex digits of the suffix that tells two rows with the same safe key apart
SUFFIX_HEX = 8


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def identity_key(conv: Conversation, speaker: str = "") -> str:
    """Key of a row without one: ``h`` + 16 hex digits of a SHA-256 over the row's identity.

    The identity is every audio item's source, offset (s), duration (s), direction and speaker
    (inline ``raw_audio``: a hash of its bytes), every image's source and turn, and the
    conversation's turns and text (:meth:`Conversation.to_json`): segments of one recording
    (``offset``/``duration``), or one file with two transcripts, get different keys; the same row
    twice gets the same key (a ``duplicate_key`` reject). Stable across runs and machines.
    """
    ident = {
        "audio": [[a.source, a.offset_s, a.duration_s, a.direction, a.turn, a.speaker,
                   hashlib.sha256(a.data).hexdigest() if a.data is not None else None] for a in conv.audio],
        "images": [[i.source, i.turn] for i in conv.images],
        "conversation": conv.to_json(),
        "speaker": speaker,
    }
    return "h" + _sha(json.dumps(ident, sort_keys=True))[:16]


def _shorten(key: str, max_bytes: int) -> str:
    """``key`` cut to at most ``max_bytes`` bytes of UTF-8, at a character boundary."""
    data = key.encode("utf-8")
    if len(data) <= max_bytes:
        return key
    return data[:max_bytes].decode("utf-8", "ignore")


def suffixed(safe: str, raw: str, attempt: int = 0) -> str:
    """``safe`` + ``-`` + :data:`SUFFIX_HEX` hex digits of a hash of ``raw`` (and ``attempt`` when
    > 0), ``safe`` shortened so the result has at most :data:`shards.schema.MAX_KEY_BYTES` bytes."""
    digest = _sha(raw if attempt == 0 else f"{raw}\0{attempt}")[:SUFFIX_HEX]
    return f"{_shorten(safe, schema.MAX_KEY_BYTES - 1 - SUFFIX_HEX)}-{digest}"


def assign_keys(wanted: Sequence[tuple[str, str] | None]) -> list[str | None]:
    """Distinct final keys for rows wanting ``(safe_key, raw_key)`` (None: the row takes no key).

    Returns one key per entry (None where the entry is None): the safe key where it is free (first
    row in order wins), else :func:`suffixed`, checked against every key already taken (literal
    keys of later rows included), so no two entries share a key and none is longer than
    :data:`shards.schema.MAX_KEY_BYTES` bytes (``safe_key`` itself must already be within it).
    """
    taken: set[str] = set()
    out: list[str | None] = [None] * len(wanted)
    later: list[int] = []
    for i, w in enumerate(wanted):
        if w is None:
            continue
        if w[0] in taken:
            later.append(i)
        else:
            taken.add(w[0])
            out[i] = w[0]
    for i in later:
        safe, raw = wanted[i]
        attempt = 0
        key = suffixed(safe, raw)
        while key in taken:
            attempt += 1
            key = suffixed(safe, raw, attempt)
        taken.add(key)
        out[i] = key
    return out
