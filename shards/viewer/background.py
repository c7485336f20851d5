"""The viewer's background threads (the index's scalar columns, the side table of text, the histograms,
the tokenizer): daemon threads, so a Ctrl-C never waits for them, each joined before the interpreter
finalises (an ``atexit`` hook) or when its owner closes.

Why: a daemon thread still inside pyarrow, DuckDB or tokenizers while Python tears its modules down
hangs the process at exit or crashes it (SIGSEGV), and a closed file under a running read is the same.
"""
from __future__ import annotations

import atexit
import threading
import time
from typing import Callable

#: seconds the exit hook waits for the background threads together (a read in progress ends by itself)
JOIN_AT_EXIT_S = 60.0

_lock = threading.Lock()
_live: dict[threading.Thread, Callable[[], None] | None] = {}


def start(target: Callable[[], None], name: str, stop: Callable[[], None] | None = None) -> threading.Thread:
    """Run ``target`` in a daemon thread named ``name``, joined at exit after ``stop()`` (what makes
    ``target`` return early: sets its events) is called. Returns the started thread."""
    def run() -> None:
        try:
            target()
        finally:
            with _lock:
                _live.pop(thread, None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    with _lock:
        _live[thread] = stop
    thread.start()
    return thread


def join(thread: threading.Thread | None, stop: Callable[[], None] | None = None) -> None:
    """Call ``stop()`` (when given), then wait for ``thread`` (None or already ended: nothing to wait for)."""
    if stop is not None:
        stop()
    if thread is not None and thread is not threading.current_thread():
        thread.join()


@atexit.register
def _join_all() -> None:
    with _lock:
        live = list(_live.items())
    for _, stop in live:
        if stop is not None:
            stop()
    deadline = time.monotonic() + JOIN_AT_EXIT_S
    for thread, _ in live:
        thread.join(max(0.0, deadline - time.monotonic()))


__all__ = ["start", "join", "JOIN_AT_EXIT_S"]
