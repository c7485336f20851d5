"""The encoder thread: stage one's encoder calls run here, off the main thread.

The main thread receives decoded rows, runs the host-only producers, checks values, builds the json
member and hands rows to the shard writer; everything that calls an encoder is submitted here
(:meth:`EncoderThread.submit`) and collected later (the returned future), so those steps overlap
the encoders. On CUDA the thread works on a stream of its own; the encoders queue their calls
(:meth:`precompute.producers.Producer.submit`: inputs from pinned memory, outputs copied back into
pinned memory without blocking) and the thread waits once per batch. A plug-in encoder with only a
synchronous ``encode()`` runs here too: a CUDA call and its synchronisation release the GIL, so the
main thread goes on meanwhile.

A stall deadline (``stall_s``, the job's ``stall_timeout_s``): the thread works under a
:class:`precompute.faults.Watch`, beaten as each batch begins and by the codec pool while a codec process it
waits for is within its own deadline (:mod:`precompute.encoders.processes`). Waiting for a batch's result
(its future's ``result()``) raises :class:`precompute.faults.ProcessHung` naming the encoder thread once it made
no progress for ``stall_s``: a plug-in encoder that never returns, a codec in this process stuck in a call. A
thread cannot be killed: the job stops (exit 1), :meth:`EncoderThread.close` leaves the thread (a daemon) where
it is, and the rows of the batch are not written (the rerun encodes them).

Timings (:class:`Timings`): ``busy_s`` (the thread's wall time on work: queueing and waiting),
``host_s`` (queueing only: the Python and kernel launches of the encoders), ``device_s`` (CUDA:
between an event recorded before the batch's first call and one after its last, on the stream).
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from .faults import ProcessHung, Watch

log = logging.getLogger("precompute")


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
    context manager (or :meth:`close`). ``stall_s``: the stall deadline (seconds; None: none), see the module
    docstring; ``hung``: the :class:`~precompute.faults.ProcessHung` once a wait found the thread hung."""

    def __init__(self, device: str = "cpu", stall_s: float | None = None):
        import torch
        self.device = str(device)
        self.cuda = self.device.startswith("cuda")
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        if self.cuda:  # what the main thread queued so far (weights moved, the probe's calls) comes first
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.timings = Timings()
        self.watch = Watch(stall_s) if stall_s else None
        self.hung: ProcessHung | None = None
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # a daemon thread: one that hangs in an encoder's call must not keep the process from exiting
        self._thread = threading.Thread(target=self._serve, daemon=True, name="encoders_0")  # (as a pool names it)
        self._thread.start()

    def _serve(self) -> None:
        with self.watch.on_this_thread() if self.watch else contextlib.nullcontext():
            while True:
                item = self._queue.get()
                if item is None:
                    return
                future, fn, args = item
                if not future.set_running_or_notify_cancel():
                    continue
                if self.watch is not None:
                    self.watch.beat("a batch of the encoders")
                try:
                    result = self._run(fn, args)
                except BaseException as e:  # noqa: BLE001 - raised by the future's result()
                    future.set_exception(e)
                else:
                    future.set_result(result)

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
        future = _Watched(self)
        self._queue.put((future, fn, args))
        return future

    def _hang(self) -> ProcessHung:
        """The thread's :class:`~precompute.faults.ProcessHung` (recorded in :attr:`hung`)."""
        if self.hung is None:
            self.hung = ProcessHung("encoder thread", None, self.watch.stall_s, self.watch.doing, killed=False)
        return self.hung

    def close(self) -> None:
        """Cancel the work not begun, and wait for the work under way (a hung thread, or one that hangs while
        this waits: left as it is, a daemon)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self._queue.put(None)
        try:
            self._join()
        except BaseException:  # interrupted (SIGTERM): the work under way still ends (or hangs) first
            self._join()
            raise

    def _join(self) -> None:
        while self.hung is None:
            self._thread.join(timeout=self.watch.poll_s if self.watch else None)
            if not self._thread.is_alive():
                return
            if self.watch is not None and self.watch.idle_s() > self.watch.stall_s:
                self._hang()
        log.warning("%s (the thread is left behind: a daemon)", self.hung)

    def __enter__(self) -> "EncoderThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Watched(Future):
    """A future of the encoder thread whose ``result()`` (without a timeout) raises the thread's
    :class:`~precompute.faults.ProcessHung` once it made no progress for its deadline."""

    def __init__(self, thread: EncoderThread):
        super().__init__()
        self._encoders = thread

    def result(self, timeout: float | None = None) -> Any:
        watch = self._encoders.watch
        if timeout is not None or watch is None:
            return super().result(timeout)
        while not self.done():
            if self._encoders.hung is not None:
                raise self._encoders.hung
            try:
                return super().result(timeout=watch.poll_s)
            except TimeoutError:
                if not self.done() and watch.idle_s() > watch.stall_s:
                    raise self._encoders._hang() from None
        return super().result()


__all__ = ["EncoderThread", "Timings"]
