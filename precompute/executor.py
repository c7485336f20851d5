"""The encoder thread: stage one's encoder calls run here, off the main thread.

The main thread receives decoded rows, runs the host-only producers, checks values, builds the json
member and hands rows to the shard writer; everything that calls an encoder is submitted here
(:meth:`EncoderThread.submit`) and collected later (the returned future), so those steps overlap
the encoders. On CUDA the thread works on a stream of its own; the encoders queue their calls
(:meth:`precompute.producers.Producer.submit`: inputs from pinned memory, outputs copied back into
pinned memory without blocking) and the thread waits once per batch. A plug-in encoder with only a
synchronous ``encode()`` runs here too: a CUDA call and its synchronisation release the GIL, so the
main thread goes on meanwhile.

Timings (:class:`Timings`): ``busy_s`` (the thread's wall time on work: queueing and waiting),
``host_s`` (queueing only: the Python and kernel launches of the encoders), ``device_s`` (CUDA:
between an event recorded before the batch's first call and one after its last, on the stream).
"""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Timings:
    """Seconds the encoder thread spent (see the module docstring)."""

    busy_s: float = 0.0
    host_s: float = 0.0
    device_s: float = 0.0
    batches: int = 0


class EncoderThread:
    """One worker thread for a job's encoder work on ``device`` (see the module docstring).

    ``submit(fn, *args)``: ``fn(*args)`` queues the work and returns a callable that waits for it and
    gives its result; both run on the thread (under ``torch.inference_mode`` and, on CUDA, the
    thread's stream); the future's result is that result. Work runs in submission order. Use as a
    context manager (or :meth:`close`)."""

    def __init__(self, device: str = "cpu"):
        import torch
        self.device = str(device)
        self.cuda = self.device.startswith("cuda")
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        if self.cuda:  # what the main thread queued so far (weights moved, the probe's calls) comes first
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.timings = Timings()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoders")

    def _run(self, fn: Callable[..., Callable[[], Any]], args: tuple) -> Any:
        import torch
        t0 = time.perf_counter()
        with torch.inference_mode(), (torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            try:
                wait = fn(*args)
                host = time.perf_counter() - t0
                if self.cuda:
                    end.record()
                out = wait()
                device = 0.0
                if self.cuda:
                    end.synchronize()
                    device = start.elapsed_time(end) / 1e3
            finally:
                busy = time.perf_counter() - t0
                with self._lock:
                    self.timings.busy_s += busy
                    self.timings.batches += 1
        with self._lock:
            self.timings.host_s += host
            self.timings.device_s += device
        return out

    def submit(self, fn: Callable[..., Callable[[], Any]], *args: Any) -> Future:
        return self._pool.submit(self._run, fn, args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "EncoderThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["EncoderThread", "Timings"]
