"""Several copies of a codec on one device, each in a process of its own (``audio_tokenizer.processes: N``).

A codec whose calls are bound by kernel launches (the Higgs-Audio v2 tokenizer: ~190 module calls
per clip, docs/benchmarks.md) keeps a GPU busy only a fraction of the time from one Python thread;
N processes launch N calls at once. Each process loads the same checkpoint with the same options on
the same device and runs whole calls (:class:`precompute.encoders.batching.Call`): a call's codes
do not depend on which process ran it, so the cache is bit-identical to one process's. The parent
sends each call's input (``size x 1 x length`` float32) as one JSON header and the raw bytes
(``Connection.send_bytes``: no pickle) and reads the codes back the same way; calls go to the
processes in turn.

A codec process that dies (the OOM killer, a node fault, a ``kill``) is an infrastructure fault, never a
row's (:mod:`precompute.faults`): the pool starts a fresh process in its place and sends it the calls
the dead one had not answered, in order, at most :data:`RESTARTS` times per pool (each logged); past
that, waiting for a call raises :class:`precompute.faults.ProcessDied` naming the process and the
signal, and the job stops (its committed chunks kept for a rerun). A call the codec itself fails in a
process comes back as that error: a row fault for the call's clips, unless it is an infrastructure
fault there (a CUDA error, out of memory: :func:`precompute.faults.kind_of`).

A codec process that **hangs** is handled as one that died: with a stall deadline (the watch of the thread
that waits, :func:`precompute.faults.current_watch`: the job's encoder thread, ``stall_timeout_s``), a process
with calls in flight that answers none of them for that long, or does not finish loading the codec in that long,
is killed (``SIGKILL``) and replaced as above (:class:`precompute.faults.ProcessHung` naming it and the
deadline, in the log and, past the restarts, in the job's error). While a process is within its deadline the
waiter beats the watch, so the encoder thread's own deadline leaves the hang to the pool. Without a watch
(``shardcache check``, a codec used on its own) there is no deadline.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np

from ..faults import ProcessDied, ProcessHung, Watch, current_watch, kill, kind_of, rebuild

log = logging.getLogger("precompute")

#: codec processes a pool restarts at most (all its processes together) before a death fails the job
RESTARTS = 2


def _serve(conn, recipe: tuple[type, str, dict], parent: int) -> None:
    """A codec process: load the codec (one process), then encode each call received on ``conn``."""
    from tqdm import tqdm

    from ..lock import die_with_parent
    die_with_parent(parent)
    tqdm.set_lock(threading.RLock())  # (its default lock is a named semaphore here, left behind by a killed process)
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
        except Exception as e:  # noqa: BLE001 - the parent raises it for the call's clips (or fails the job)
            conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}", "fault": kind_of(e)}).encode())


class _Call:
    """One call's input and where it was last sent (``worker``, ``seq``: its number on that worker)."""

    __slots__ = ("x", "worker", "seq")

    def __init__(self, x: np.ndarray):
        self.x, self.worker, self.seq = x, None, -1


class _Worker:
    """One codec process (``name``: ``codec process 1 of 2``), a thread here that reads its replies as they come
    and one that writes its calls (so neither side ever blocks writing to a full pipe while the other does, and a
    process that stops reading blocks no caller). ``inflight``: the
    calls sent and not yet answered (what a replacement is sent again); ``dead``: the
    :class:`~precompute.faults.ProcessDied` once it is gone; ``replacement``: the worker started in its place.
    ``watch``: the stall deadline of the thread that started it (:func:`precompute.faults.current_watch`; None:
    none). Started here, used once :meth:`ready`."""

    def __init__(self, ctx, recipe: tuple, name: str, watch: Watch | None = None):
        self.name = name
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_serve, args=(child, recipe, os.getpid()), daemon=True,
                                   name="codec-process")
        self.process.start()
        child.close()
        self.send_lock = threading.Lock()
        self.cond = threading.Condition()
        self.sent = 0  # calls sent
        self.replies: dict[int, Any] = {}
        self.inflight: dict[int, _Call] = {}
        self.dead: ProcessDied | None = None
        self.replacement: _Worker | None = None
        self.hung: ProcessHung | None = None  # set before it is killed for a hang: what its death is
        self.progress_t = time.monotonic()  # its last progress: a reply, or a call sent while none was in flight
        self.watch, self.started = watch, time.monotonic()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # calls to send, in order (None: stop)
        self.sender: threading.Thread | None = None  # writes the outbox once the codec is loaded (:meth:`ready`)

    def ready(self) -> "_Worker":
        """Wait until the process has loaded the codec (processes start at once and load side by side:
        :class:`CodecPool`); then read its replies and write its calls as they come. Raises
        :class:`~precompute.faults.ProcessDied` when the process dies before its codec is loaded,
        :class:`~precompute.faults.ProcessHung` when it loads longer than its watch's deadline (killed)."""
        try:
            self._wait_ready(self.watch)
        except (EOFError, OSError):
            self.process.join(timeout=10)
            self.conn.close()
            if self.hung is not None:
                raise self.hung from None
            raise ProcessDied(self.name, self.process.pid, self.process.exitcode, "while loading the codec") from None
        self.reader = threading.Thread(target=self._read, daemon=True, name="codec-process-reader")
        self.reader.start()
        self.sender = threading.Thread(target=self._send, daemon=True, name="codec-process-sender")
        self.sender.start()
        return self

    def _wait_ready(self, watch: Watch | None) -> None:
        """Wait for the process to say its codec is loaded (raises ``EOFError`` when it died, or was killed for
        loading longer than ``watch``'s deadline since it started); the watch is beaten meanwhile."""
        while watch is not None and not self.conn.poll(watch.poll_s):
            if time.monotonic() - self.started > watch.stall_s:
                self.hang(watch.stall_s, "loading the codec")
            elif self.process.is_alive():
                watch.beat()
        self.conn.recv_bytes()  # ready: the codec is loaded

    def idle_s(self) -> float:
        """Seconds it has had calls in flight and answered none (0 with none in flight); hold ``cond``."""
        return time.monotonic() - self.progress_t if self.inflight else 0.0

    def hang(self, stall_s: float, doing: str) -> None:
        """Kill the process for a hang (``doing``: what it did not finish); its reader then records it dead, as
        :attr:`hung`."""
        if self.hung is None:
            self.hung = ProcessHung(self.name, self.process.pid, stall_s, doing)
            kill(self.process.pid)

    def send(self, call: _Call) -> None:
        """Send ``call`` (registered in :attr:`inflight` first: a process that dies meanwhile is noticed by the
        reader, and whoever waits for the call sends it again, :meth:`CodecPool._revive`)."""
        with self.send_lock:
            with self.cond:
                seq, self.sent = self.sent, self.sent + 1
                if not self.inflight:
                    self.progress_t = time.monotonic()
                self.inflight[seq] = call
                call.worker, call.seq = self, seq
            self.outbox.put(call)

    def _send(self) -> None:
        """The sender thread: each call of :attr:`outbox` written to the process in order (a process that stopped
        reading blocks this thread, never the caller: its deadline still runs), then the stop."""
        while True:
            call = self.outbox.get()
            try:
                if call is None:
                    self.conn.send_bytes(json.dumps({"op": "stop"}).encode())
                    return
                self.conn.send_bytes(json.dumps({"shape": list(call.x.shape)}).encode())
                self.conn.send_bytes(memoryview(call.x).cast("B"))
            except OSError:  # the process is gone: the reader sees the pipe close
                if call is None:
                    return

    def _read(self) -> None:
        n = 0
        try:
            while True:
                head = json.loads(self.conn.recv_bytes())
                if "error" in head:
                    got: Any = rebuild(head["fault"], self.name, f"{self.name}: {head['error']}") if head.get("fault") \
                        else RuntimeError(f"codec process: {head['error']}")
                else:
                    got = np.frombuffer(self.conn.recv_bytes(), dtype=np.dtype(head["dtype"])).reshape(head["shape"])
                with self.cond:
                    self.replies[n] = got
                    self.inflight.pop(n, None)
                    self.progress_t = time.monotonic()
                    self.cond.notify_all()
                n += 1
        except (EOFError, OSError):
            self.process.join(timeout=10)  # its exit code: the signal that killed it
            with self.cond:
                self.dead = self.hung or ProcessDied(self.name, self.process.pid, self.process.exitcode)
                self.cond.notify_all()


class Remote:
    """A call sent to a codec process; :meth:`numpy` waits for its codes (``(size, n_q, frames)``), following the
    call to the process that replaced a dead one. Raises :class:`~precompute.faults.ProcessDied` once the pool
    has no restart left, or the codec's own error for the call."""

    def __init__(self, pool: "CodecPool", call: _Call):
        self.pool, self.call = pool, call

    def numpy(self) -> np.ndarray:
        call, watch = self.call, current_watch()
        while True:
            w = call.worker
            with w.cond:
                while call.seq not in w.replies and w.dead is None:
                    w.cond.wait(watch.poll_s if watch is not None else None)
                    if watch is None or call.seq in w.replies or w.dead is not None:
                        continue
                    if w.idle_s() > watch.stall_s:  # killed: its reader records it dead, then it is replaced
                        w.hang(watch.stall_s, f"{len(w.inflight)} codec call(s) unanswered")
                    else:
                        watch.beat()  # the process is within its deadline: the pool deals with a hang
                if call.seq in w.replies:
                    got = w.replies.pop(call.seq)
                    break
            self.pool._revive(w)  # moves the call to a fresh process (or raises)
        if isinstance(got, Exception):
            raise got
        return got


class CodecPool:
    """``n`` processes each holding the codec of ``recipe`` (``(class, pretrained, options)``, what
    ``class.from_pretrained`` takes); :meth:`submit` sends one call's input to the next process. A dead process
    is replaced (see the module docstring), at most ``restarts`` times (default :data:`RESTARTS`)."""

    def __init__(self, recipe: tuple[type, str, dict], n: int, restarts: int | None = None):
        self._ctx = mp.get_context("spawn")  # CUDA in the parent: a forked child could not use it
        self._recipe = recipe
        self.restarts_left = RESTARTS if restarts is None else int(restarts)
        self.restarted = 0
        self.workers: list[_Worker] = []
        weakref.finalize(self, CodecPool._stop, self.workers)  # (the list itself: replacements go into it)
        for i in range(n):  # all start, then load side by side
            self.workers.append(_Worker(self._ctx, recipe, f"codec process {i + 1} of {n}", current_watch()))
        for w in self.workers:
            w.ready()
        self._next = 0
        self._lock = threading.Lock()

    def submit(self, x: np.ndarray) -> Remote:
        """Send ``x`` (float32 ``(size, 1, length)``) to the next process; the codes come with ``numpy()``."""
        call = _Call(np.ascontiguousarray(x, dtype=np.float32))
        with self._lock:
            w = self.workers[self._next]
            self._next = (self._next + 1) % len(self.workers)
        if w.dead is not None:
            w = self._revive(w)
        w.send(call)
        return Remote(self, call)

    def _revive(self, w: _Worker) -> _Worker:
        """The process in place of dead ``w`` (started on first need, :data:`RESTARTS` at most), with every call
        ``w`` had not answered sent to it in order. Raises ``w``'s :class:`~precompute.faults.ProcessDied` when
        no restart is left, or the new process's when it dies while loading."""
        with self._lock, w.send_lock:
            if w.replacement is None:
                with w.cond:
                    waiting = len(w.inflight)
                if self.restarts_left <= 0:
                    raise w.dead.again(f"{waiting} codec call(s) unanswered; restarted {self.restarted} time(s) "
                                       "already, the most this job does (precompute.encoders.processes.RESTARTS)")
                self.restarts_left -= 1
                self.restarted += 1
                log.warning("%s; starting a fresh one in its place and sending it the %d call(s) it had not "
                            "answered (restart %d; %d left)", w.dead, waiting, self.restarted, self.restarts_left)
                w.replacement = _Worker(self._ctx, self._recipe, w.name, current_watch()).ready()
                self.workers[self.workers.index(w)] = w.replacement
                w.outbox.put(None)  # (its sender thread ends)
            target = w.replacement
            with w.cond:
                moving = [call for _, call in sorted(w.inflight.items())]
                w.inflight.clear()
            for call in moving:  # (under the locks: a waiter sees its call moved once it may look again)
                target.send(call)
        return target

    @staticmethod
    def _stop(workers: list[_Worker]) -> None:
        for w in workers:
            if w.sender is None:  # still loading (a pool whose other process failed to start): nothing to finish
                w.process.kill()
            w.outbox.put(None)
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=10)
            w.conn.close()

    def close(self) -> None:
        CodecPool._stop(self.workers)


__all__ = ["CodecPool", "Remote", "RESTARTS"]
