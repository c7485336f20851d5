"""Read-ahead threads for a loader without worker processes (``num_workers=0``).

The loader's own process reads the next batches while the consumer works on the current one, in
``threads`` threads: thread ``k`` reads steps ``start + k, start + k + threads, ...`` of the epoch
(as DataLoader workers split steps; :class:`loaders.loader.ShardLoader` hands batches out in step
order, so the sequence is the same for any number of threads). The heavy parts of a read release
the GIL (``os.preadv`` copying from the page cache, XXH3 hashing, numpy), so two threads on two
cores read about twice what one does, and a training loop's step overlaps the next batch's read.

Each thread keeps at most ``depth`` batches that the consumer has not taken yet (its own budget:
the thread that holds the step the consumer waits for has none outstanding, so it is never
blocked). An exception raised while reading step ``s`` is delivered as that step's item
(:class:`Failed`) and raised when the consumer reaches ``s``, so a damaged sample stops the
consumer exactly where a single-threaded read would (``state_dict`` counts only batches taken).

The threads are always joined before the interpreter finalises: :meth:`ReadAhead.close` waits for
them, and an ``atexit`` hook closes any read-ahead still open (an iterator abandoned unfinished).
A daemon thread still inside a read when Python finalises is ended with ``pthread_exit`` from
within C++ frames (torch, numpy), and the process aborts ("terminate called without an active
exception", SIGABRT) after the program has finished.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Any, Callable, Iterator

_OPEN: "weakref.WeakSet[ReadAhead]" = weakref.WeakSet()
_JOIN_TIMEOUT_S = 30.0  # one batch read; a thread still busy after this is left (and logged by Python)


class Failed:
    """The exception of one step's read, carried to the consumer in step order."""

    def __init__(self, error: BaseException):
        self.error = error


class ReadAhead:
    """Iterate ``(step, batch)`` of ``steps`` (a ``range``) read by ``read(step)`` in ``threads``
    threads, in the order the reads finish (the consumer re-orders by step).

    Call :meth:`taken` when the consumer takes a step's batch (frees that thread's budget) and
    :meth:`close` when the iteration is abandoned (threads stop after their current read).
    """

    def __init__(self, read: Callable[[int], Any], steps: range, threads: int = 2, depth: int = 2):
        self._read, self._steps = read, steps
        self.threads = max(1, min(int(threads), len(steps) or 1))
        self._budget = [threading.Semaphore(max(1, int(depth))) for _ in range(self.threads)]
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._left = len(steps)
        self._workers = [threading.Thread(target=self._work, args=(k,), daemon=True,
                                          name=f"shardcache-read-{k}") for k in range(self.threads)]
        _OPEN.add(self)
        for t in self._workers:
            t.start()

    def _work(self, k: int) -> None:
        for s in self._steps[k::self.threads]:
            self._budget[k].acquire()
            if self._stop.is_set():
                return
            try:
                item = self._read(s)
            except BaseException as e:  # noqa: BLE001 - delivered to the consumer at its step
                item = Failed(e)
            self._queue.put((s, item))
            if isinstance(item, Failed) or self._stop.is_set():
                return

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        while self._left:
            s, item = self._queue.get()
            self._left -= 1
            yield s, item

    def taken(self, step: int) -> None:
        """The consumer took ``step``'s batch: its thread may read one more."""
        self._budget[(step - self._steps.start) // self._steps.step % self.threads].release()

    def close(self) -> None:
        """Stop reading and wait for the threads (each finishes its current read, at most one batch);
        batches not taken are dropped. Safe to call more than once and from any thread but a reader."""
        self._stop.set()
        for b in self._budget:
            b.release()
        me = threading.current_thread()
        for t in self._workers:
            if t is not me:
                t.join(_JOIN_TIMEOUT_S)
        _OPEN.discard(self)


@atexit.register
def _close_all() -> None:
    """Join every read-ahead thread before the interpreter finalises (see the module docstring)."""
    for ahead in list(_OPEN):
        ahead.close()


__all__ = ["ReadAhead", "Failed"]
