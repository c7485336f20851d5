"""Decode workers end with their job; the cache's writer lock itself is :mod:`shards.lock`.

The writer lock moved to :mod:`shards.lock` (every command that writes a cache takes it, through
:class:`shards.writing.CacheWriter`, not only stage one); its names are re-exported here for the
code and scripts that import them from ``precompute.lock``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

from shards.lock import LOCK_FILE, CacheLock, CacheLocked, describe, holder, job_id  # noqa: F401 (re-exported)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, worker_id: int | None = None) -> None:
    """Make this (forked worker) process get SIGKILL when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), and exit at once if the parent ``parent_pid`` is already gone.
    ``worker_id`` (what a DataLoader passes to its ``worker_init_fn``) is not used.

    Used as the decode workers' ``worker_init_fn``: a ``kill -9`` of the job leaves no worker behind
    (a worker that outlived its job would go on decoding into a cache another job now writes).
    Elsewhere than Linux it only does the parent check (torch's workers also poll their parent).
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


__all__ = ["CacheLock", "CacheLocked", "LOCK_FILE", "describe", "die_with_parent", "holder", "job_id"]
