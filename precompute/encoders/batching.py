"""How a codec groups clips into calls, reproducibly: fixed-shape calls of ``size`` clips x a length
bucket, every clip's place in its call known (and recorded in the cache, so ``shardcache check``
rebuilds the very call).

Measured on an H200 (docs/benchmarks.md, ``benchmarks/gpu_codec_batch.py``): a clip's codes in a
batched call did not change with the other clips of the call (other speech, or silence) but did
change with its place in the call and with the call's shape. So a batched clip's codes are a
function of (clip, place, call shape): with the shape a function of the clip's own length (its
bucket) and the place recorded, a batched cache is reproducible run to run and checkable clip by
clip, whatever companions a clip had. Companions that failed (an invalid waveform) and the places
left over in a bucket's last call are zero slots, so no clip's place depends on another's fate.

Clip by clip (``size`` 1, the default) is the canonical encoding of :mod:`precompute.encoders.audio`:
a clip's codes depend on the clip and the weights only; nothing is recorded.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

#: what a fixed-shape call is, in describe(): part of the codec's identity when batching
CALLS = "fixed shape: size clips x the length bucket, zero padding at the end, zero slots where no clip"


@dataclass(frozen=True)
class BatchPolicy:
    """How clips are grouped into calls.

    Attributes:
        size: clips per call (``max_batch_size``); 1 = clip by clip (codes depend on the clip alone).
        bucket_s: seconds per length bucket when ``size > 1``: a clip is zero-padded at the end to the
            next multiple of the bucket (rounded to the codec's hop); 0 = clips of equal length only
            (each call holds clips padded to their own canonical length: far fewer full calls on
            real data).
    """

    size: int = 1
    bucket_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {self.size!r}")
        if not isinstance(self.bucket_s, (int, float)) or isinstance(self.bucket_s, bool) or \
                not 0 <= float(self.bucket_s) <= 3600 or math.isnan(float(self.bucket_s)):
            raise ValueError(f"bucket_s must be a number of seconds in [0, 3600], got {self.bucket_s!r}")

    @property
    def batched(self) -> bool:
        return self.size > 1

    def describe(self) -> dict[str, Any]:
        """The policy as the codec's identity records it (only when batching: clip by clip records nothing)."""
        return {"size": self.size, "bucket_s": float(self.bucket_s), "calls": CALLS}


@dataclass(frozen=True)
class Call:
    """One encoder call of ``size`` clips x ``length`` samples: ``places[p]`` is the index (into the
    list of clips being encoded) of the clip at place ``p``, or -1 for a zero slot."""

    size: int
    length: int
    places: tuple[int, ...]

    def place_of(self, clip: int) -> int:
        return self.places.index(clip)

    @classmethod
    def alone(cls, size: int, length: int, place: int) -> "Call":
        """The call that rebuilds one recorded clip (index 0) at ``place``, every other place a zero slot."""
        if not 0 <= place < size:
            raise ValueError(f"place {place} outside a call of {size} clips")
        return cls(size, length, tuple(0 if p == place else -1 for p in range(size)))


def bucket(n: int, step: int) -> int:
    """``n`` samples rounded up to a multiple of ``step`` (``step`` 0: ``n``)."""
    return n if step <= 0 else -(-n // step) * step


def plan_calls(lengths: Sequence[int], canonical: Callable[[int], int], policy: BatchPolicy, step: int,
               max_call_samples: int) -> list[Call]:
    """The calls that encode clips of ``lengths`` samples (clips of 0 samples get none).

    Args:
        lengths: samples of each clip.
        canonical: the length a clip of ``n`` samples is encoded at alone (DAC: ``ceil(n / hop) * hop``;
            the Higgs tokenizer: ``n``).
        policy: :class:`BatchPolicy`.
        step: the bucket in samples (a multiple of the hop; 0: no buckets).
        max_call_samples: the most ``size x length`` samples of one call (a longer clip goes alone).

    Returns:
        Clip by clip: one ``Call(1, canonical(n), (i,))`` per clip in input order. Batched: clips
        grouped by ``bucket(canonical(n), step)`` (groups in increasing length, clips of a group in
        input order) and cut into calls of ``max(1, min(size, max_call_samples // length))`` places,
        the last call of a group filled with zero slots.
    """
    if not policy.batched:
        return [Call(1, canonical(int(n)), (i,)) for i, n in enumerate(lengths) if n]
    groups: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(lengths):
        if n:
            groups[bucket(canonical(int(n)), step)].append(i)
    calls = []
    for length in sorted(groups):
        size = max(1, min(policy.size, max_call_samples // length))
        idx = groups[length]
        for a in range(0, len(idx), size):
            part = tuple(idx[a:a + size])
            calls.append(Call(size, length, part + (-1,) * (size - len(part))))
    return calls


__all__ = ["BatchPolicy", "Call", "bucket", "plan_calls", "CALLS"]
