"""How stage one keeps its encoders fed: decode processes sized from measured rates, encoder batches
formed by length, rows written back in manifest order, decode libraries imported once.

* :func:`decode_workers`: the decode processes one encoder needs, from the CPU seconds one row
  takes to decode and the seconds the encoder takes per row (both measured on the job's first
  batch by :func:`probe_rates`), capped by this rank's cores.
* :class:`LengthBatcher`: decoded rows are held in a window (``window`` rows of one chunk) and
  handed to the encoders in batches of rows of similar length (audio samples, image shapes), so an
  encoder that groups equal lengths internally (the codecs' :func:`precompute.encoders.audio.plan_batches`,
  the VAE's equal-shape groups) runs full batches instead of one clip at a time. Every batch is full
  but the last of each chunk. Encoders' outputs do not depend on their batch companions (the
  encoder contract), so the cache is the same as without buckets.
* :class:`InOrder`: the encoded rows go back into manifest order before the shard writer (the tar
  is a function of the manifest, not of the batching).
* :class:`EncodeStream`: the two above around an ``encode`` that may return a handle still being
  worked on (the encoder thread, :mod:`precompute.executor`): up to ``depth`` batches are in
  flight, so the encoder always has the next batch queued while the main thread finishes the last.
* :func:`preload_decoders`: imports the decode libraries (librosa/soxr, soundfile, Pillow) and runs
  a first resample in the parent, so the forked decode workers inherit them instead of importing
  them again (1.5 CPU-s per worker for librosa alone, measured in ``make bench``).
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Any, Callable, Iterable

import numpy as np

log = logging.getLogger("precompute")

_PRELOADED = False


def preload_decoders() -> None:
    """Import the decode path's libraries and run one tiny resample (once per process)."""
    global _PRELOADED
    if _PRELOADED:
        return
    import io

    from PIL import Image

    from . import images  # noqa: F401 - Pillow's modules the image path uses
    from .audio import resample
    resample(np.zeros(480, np.float32), 48000, 24000)  # librosa's lazy modules and soxr
    Image.preinit()  # the common format plug-ins (JPEG, PNG...)
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, "JPEG")
    Image.open(buf).load()  # what a JPEG's first decode imports (EXIF parsing)
    _PRELOADED = True


def decode_workers(cpus: int, decode_s_per_row: float, encode_s_per_row: float, headroom: float = 1.25,
                   at_least: int = 8) -> int:
    """Decode processes that keep one encoder fed: ``ceil(headroom * decode / encode)`` but never fewer
    than ``at_least``, and at most ``cpus - 1`` (a core stays with the main process: encoder launches,
    the writer thread).

    The floor: on a GPU host the rates asked for one process in both recipes' jobs, and one fed the
    encoders worse than eight (docs/benchmarks.md, stage one at steady state). A single process has
    no slack for a slow row, for the transfer of decoded rows to the main process, or for refilling
    the length window; an idle one costs little.

    Args:
        cpus: CPU cores of this rank (:func:`shardcache.workers.cpus_per_rank`).
        decode_s_per_row: CPU seconds one row takes to decode (one process).
        encode_s_per_row: seconds the encoders take per row (wall, device-synchronised).
        headroom: over-provisioning for rows slower than the measured ones.
        at_least: the fewest processes (where the cores allow).
    """
    if cpus <= 1:
        return 0
    need = cpus - 1 if encode_s_per_row <= 0 else math.ceil(headroom * decode_s_per_row / encode_s_per_row)
    return max(1, min(cpus - 1, max(at_least, need)))


def probe_rates(prepare: Callable[[Any], Any], encode: Callable[[list], Any], rows: list) -> tuple[float, float]:
    """``(decode CPU seconds per row, encoder seconds per row)`` over ``rows`` (the job's first
    encoder batch): ``prepare`` each row in this thread, then ``encode`` the batch twice and keep
    the second time (the first carries one-off costs: kernel selection, lazy initialisation).
    ``encode(batch)`` returns its encoder seconds."""
    preload_decoders()
    t = time.thread_time()
    prepared = [prepare(r) for r in rows]
    decode = (time.thread_time() - t) / max(1, len(rows))
    encode(prepared)
    return decode, encode(prepared) / max(1, len(rows))


def job_workers(num_workers: int | str, device: str, pipe: Any, rows: list, batch_size: int) -> int:
    """Decode processes of a job: ``num_workers`` when it is a count; ``auto``: 0 on the CPU (the
    encoders' threads already use every core), else :func:`decode_workers` from this rank's cores
    and the rates :func:`probe_rates` measures on the first ``batch_size`` of ``rows`` (requests)
    with ``pipe`` (:class:`precompute.job.Job`: its ``prepare`` and ``encode``)."""
    from shardcache.workers import cpus_per_rank

    from .encode import Summary
    if num_workers != "auto":
        return int(num_workers)
    if not rows or str(device).startswith("cpu"):
        return 0

    def encode(batch: list) -> float:
        import torch
        s = Summary()
        with torch.inference_mode():
            pipe.encode(batch, s)
        return s.encoder_s

    decode, enc = probe_rates(pipe.prepare, encode, rows[:batch_size])
    n = decode_workers(cpus_per_rank(), decode, enc)
    log.info(
        "num_workers auto: %d decode processes (first batch: decode %.1f CPU-ms per row, encoders %.1f ms per "
        "row; %d cores)", n, decode * 1e3, enc * 1e3, cpus_per_rank())
    return n


def length_key(p: Any) -> tuple:
    """Sort key of a decoded row: its image shapes, then its audio samples (every item, first rate)."""
    return (tuple(im.shape for im in p.images), sum(next(iter(a.values())).size for a in p.audio if a))


class LengthBatcher:
    """Encoder batches of similar length from decoded rows of one chunk at a time (module docstring).

    :meth:`add` takes rows in manifest order (one decode batch, never two chunks) and returns the
    encoder batches now ready, each a list of ``(position, row)`` (``position``: the row's index in
    the order rows were added); :meth:`flush` returns the rest. ``window``: rows held at most
    (``batch_size`` gives batches in arrival order: no buckets).
    """

    def __init__(self, batch_size: int, window: int):
        if batch_size < 1 or window < batch_size:
            raise ValueError(f"LengthBatcher: need 1 <= batch_size <= window, got {batch_size}, {window}")
        self.batch_size, self.window = batch_size, window
        self.held: list[tuple[int, Any]] = []
        self.chunk: Any = None
        self.seen = 0

    def add(self, rows: Iterable[Any]) -> list[list[tuple[int, Any]]]:
        out: list[list[tuple[int, Any]]] = []
        for p in rows:
            if self.held and p.chunk != self.chunk:
                out += self.flush()
            self.chunk = p.chunk
            self.held.append((self.seen, p))
            self.seen += 1
            if len(self.held) >= self.window:
                out.append(self._closest())
        return out

    def flush(self) -> list[list[tuple[int, Any]]]:
        self.held.sort(key=lambda x: (length_key(x[1]), x[0]))
        out = [self.held[i:i + self.batch_size] for i in range(0, len(self.held), self.batch_size)]
        self.held = []
        return out

    def _closest(self) -> list[tuple[int, Any]]:
        """One full batch out of the full window: the oldest held row and the ``batch_size - 1`` rows
        of lengths closest to it (one image shape first, then the least range of audio lengths). The
        rest stay held, so the window slides: released whole, it left the encoder idle while it
        refilled. The oldest row goes first so that no row waits in the window for the chunk's end
        (holding every later row's result in :class:`InOrder` until then)."""
        keyed = sorted(((length_key(p), pos), (pos, p)) for pos, p in self.held)
        keys, self.held, b = [k for (k, _), _ in keyed], [row for _, row in keyed], self.batch_size
        j = min(range(len(self.held)), key=lambda k: self.held[k][0])  # the oldest row
        i = min(range(max(0, j - b + 1), min(j, len(keys) - b) + 1),
                key=lambda i: (keys[i][0] != keys[i + b - 1][0], keys[i + b - 1][1] - keys[i][1]))
        out, self.held = self.held[i:i + b], self.held[:i] + self.held[i + b:]
        return out


class InOrder:
    """Releases items pushed as ``(position, item)`` in any order as the run ``0, 1, 2...`` completes."""

    def __init__(self):
        self.next, self.pending = 0, {}

    def push(self, position: int, item: Any) -> list[Any]:
        self.pending[position] = item
        out = []
        while self.next in self.pending:
            out.append(self.pending.pop(self.next))
            self.next += 1
        return out


class EncodeStream:
    """Decoded rows in, encoded rows out in manifest order: :class:`LengthBatcher` + ``encode`` +
    :class:`InOrder`. ``encode(rows)`` returns one result per row, in order
    (:func:`precompute.encode.encode_batch`), or a handle with ``done()`` and ``result()`` (the list,
    when ready: :class:`precompute.encode.Work` through the job's ``finish``); at most ``depth`` such
    batches stay in flight (0: each is collected at once). ``batches`` records the size of every
    encoder batch; ``waited_s`` the seconds spent blocked on a handle's result."""

    def __init__(self, encode: Callable[[list], Any], batch_size: int, window: int | None = None,
                 depth: int = 0):
        self.encode = encode
        self.batcher = LengthBatcher(batch_size, window or 8 * batch_size)
        self.order = InOrder()
        self.batches: list[int] = []
        self.depth = depth
        self.in_flight: deque = deque()
        self.waited_s = 0.0

    def _run(self, batches: list[list[tuple[int, Any]]]) -> list[Any]:
        for b in batches:
            self.batches.append(len(b))
            self.in_flight.append((b, self.encode([p for _, p in b])))
        return self._collect(self.depth)

    def _collect(self, keep: int) -> list[Any]:
        out = []
        while self.in_flight and (len(self.in_flight) > keep or _ready(self.in_flight[0][1])):
            b, got = self.in_flight.popleft()
            if not isinstance(got, list):
                t = time.perf_counter()
                got = got.result()
                self.waited_s += time.perf_counter() - t
            for (pos, _), r in zip(b, got):
                out += self.order.push(pos, r)
        return out

    def feed(self, rows: Iterable[Any]) -> list[Any]:
        """Encode what is ready after ``rows``; return the results now in order."""
        return self._run(self.batcher.add(rows))

    def close(self) -> list[Any]:
        """Encode every held row; return the remaining results in order."""
        out = self._run(self.batcher.flush()) + self._collect(0)
        if self.order.pending:
            raise RuntimeError(f"EncodeStream: {len(self.order.pending)} rows out of order at the end")
        return out


def _ready(got: Any) -> bool:
    return isinstance(got, list) or got.done()


__all__ = ["preload_decoders", "decode_workers", "probe_rates", "job_workers", "length_key", "LengthBatcher", "InOrder",
           "EncodeStream"]
