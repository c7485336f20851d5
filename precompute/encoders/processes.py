"""Several copies of a codec on one device, each in a process of its own (``audio_tokenizer.processes: N``).

A codec whose calls are bound by kernel launches (the Higgs-Audio v2 tokenizer: ~190 module calls
per clip, docs/benchmarks.md) keeps a GPU busy only a fraction of the time from one Python thread;
N processes launch N calls at once. Each process loads the same checkpoint with the same options on
the same device and runs whole calls (:class:`precompute.encoders.batching.Call`): a call's codes
do not depend on which process ran it, so the cache is bit-identical to one process's. The parent
sends each call's input (``size x 1 x length`` float32) as one JSON header and the raw bytes
(``Connection.send_bytes``: no pickle) and reads the codes back the same way; calls go to the
processes in turn.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import weakref
from typing import Any

import numpy as np


def _serve(conn, recipe: tuple[type, str, dict], parent: int) -> None:
    """A codec process: load the codec (one process), then encode each call received on ``conn``."""
    from ..lock import die_with_parent
    die_with_parent(parent)
    import torch

    from ..transfer import to_device
    cls, pretrained, options = recipe
    codec = cls.from_pretrained(pretrained, **dict(options, processes=1))
    conn.send_bytes(b"{}")  # ready
    while True:
        try:
            head = json.loads(conn.recv_bytes())
        except EOFError:
            return
        if head.get("op") == "stop":
            return
        x = np.empty(head["shape"], dtype=np.float32)  # writable: torch takes it as it is
        conn.recv_bytes_into(memoryview(x).cast("B"))
        try:
            with torch.inference_mode():
                codes = codec._encode_batch(to_device(x, codec.device, codec.dtype)).to("cpu").numpy()
            codes = np.ascontiguousarray(codes)
            conn.send_bytes(json.dumps({"shape": list(codes.shape), "dtype": codes.dtype.str}).encode())
            conn.send_bytes(memoryview(codes).cast("B") if codes.size else b"")
        except Exception as e:  # noqa: BLE001 - the parent raises it for the call's clips
            conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())


class _Worker:
    """One codec process, and a thread here that reads its replies as they come (so neither side ever
    blocks writing to a full pipe while the other does)."""

    def __init__(self, ctx, recipe: tuple):
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_serve, args=(child, recipe, os.getpid()), daemon=True,
                                   name="codec-process")
        self.process.start()
        child.close()
        self.send_lock = threading.Lock()
        self.cond = threading.Condition()
        self.sent = 0  # calls sent
        self.replies: dict[int, Any] = {}
        self.dead: str | None = None

    def ready(self) -> "_Worker":
        """Wait until the process has loaded the codec; then read its replies as they come."""
        self.conn.recv_bytes()  # ready: the codec is loaded
        self.reader = threading.Thread(target=self._read, daemon=True, name="codec-process-reader")
        self.reader.start()
        return self

    def _read(self) -> None:
        n = 0
        try:
            while True:
                head = json.loads(self.conn.recv_bytes())
                if "error" in head:
                    got: Any = RuntimeError(f"codec process: {head['error']}")
                else:
                    got = np.frombuffer(self.conn.recv_bytes(), dtype=np.dtype(head["dtype"])).reshape(head["shape"])
                with self.cond:
                    self.replies[n] = got
                    self.cond.notify_all()
                n += 1
        except (EOFError, OSError) as e:
            with self.cond:
                self.dead = f"the codec process ended ({type(e).__name__})"
                self.cond.notify_all()


class Remote:
    """A call sent to a codec process; :meth:`numpy` waits for its codes (``(size, n_q, frames)``)."""

    def __init__(self, worker: _Worker, seq: int):
        self.worker, self.seq = worker, seq

    def numpy(self) -> np.ndarray:
        w = self.worker
        with w.cond:
            while self.seq not in w.replies:
                if w.dead is not None:
                    raise RuntimeError(w.dead)
                w.cond.wait()
            got = w.replies.pop(self.seq)
        if isinstance(got, Exception):
            raise got
        return got


class CodecPool:
    """``n`` processes each holding the codec of ``recipe`` (``(class, pretrained, options)``, what
    ``class.from_pretrained`` takes); :meth:`submit` sends one call's input to the next process."""

    def __init__(self, recipe: tuple[type, str, dict], n: int):
        ctx = mp.get_context("spawn")  # CUDA in the parent: a forked child could not use it
        self.workers = [w.ready() for w in [_Worker(ctx, recipe) for _ in range(n)]]  # all start, then load at once
        self._next = 0
        self._lock = threading.Lock()
        weakref.finalize(self, CodecPool._stop, self.workers)

    def submit(self, x: np.ndarray) -> Remote:
        """Send ``x`` (float32 ``(size, 1, length)``) to the next process; the codes come with ``numpy()``."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        with self._lock:
            w = self.workers[self._next]
            self._next = (self._next + 1) % len(self.workers)
        with w.send_lock:
            w.conn.send_bytes(json.dumps({"shape": list(x.shape)}).encode())
            w.conn.send_bytes(memoryview(x).cast("B"))
            seq, w.sent = w.sent, w.sent + 1
        return Remote(w, seq)

    @staticmethod
    def _stop(workers: list[_Worker]) -> None:
        for w in workers:
            try:
                w.conn.send_bytes(json.dumps({"op": "stop"}).encode())
            except OSError:
                pass
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()

    def close(self) -> None:
        CodecPool._stop(self.workers)


__all__ = ["CodecPool", "Remote"]
