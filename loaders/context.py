"""How the loader's DataLoader workers are started (the ``multiprocessing`` context).

The platform default (``fork`` on Linux) unless CUDA is already initialised in this process: a
forked child of a CUDA process cannot use CUDA, and the driver's threads make ``fork`` unsafe, so
then ``"forkserver"`` (``"spawn"`` where forkserver is missing).

A forkserver is one clean process that forks each worker. By default it imports nothing of ours,
so every worker imports torch, numpy and :mod:`loaders` itself before its first batch (seconds;
once per loader with persistent workers, again for the eval loader and every resume).
:func:`worker_context` adds :data:`FORKSERVER_PRELOAD` to what the forkserver imports when it
starts, so workers are forked with those modules loaded and only the first loader pays the import
(the figures: docs/benchmarks.md).
"""
from __future__ import annotations

import multiprocessing as mp
from typing import Any

#: modules the forkserver imports once (``multiprocessing.set_forkserver_preload``), before any worker
FORKSERVER_PRELOAD: tuple[str, ...] = ("loaders",)


def _cuda_initialised() -> bool:
    import torch
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def preload_forkserver(modules=None) -> list[str]:
    """Add ``modules`` (default :data:`FORKSERVER_PRELOAD`) to the forkserver's preload list, keeping
    what is there (``__main__`` by default, or what the user set). Takes effect when this process's
    forkserver starts; a forkserver already running keeps its modules. Returns the list now set."""
    from multiprocessing import forkserver
    current = getattr(forkserver._forkserver, "_preload_modules", None)
    current = ["__main__"] if current is None else list(current)  # None: CPython's default
    wanted = current + [m for m in (FORKSERVER_PRELOAD if modules is None else modules) if m not in current]
    if wanted != current:
        mp.get_context("forkserver").set_forkserver_preload(wanted)
    return wanted


def worker_context(requested: Any = None) -> Any:
    """The ``multiprocessing_context`` for the DataLoader: ``requested`` when given (a name or a
    context), else as the module docstring says. Whenever the result is the forkserver, it is given
    :data:`FORKSERVER_PRELOAD`. Returns None (the platform default), a start-method name or the
    context passed in."""
    ctx = requested
    if ctx is None and _cuda_initialised():
        ctx = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    method = ctx if isinstance(ctx, str) or ctx is None else ctx.get_start_method()
    if method == "forkserver":
        preload_forkserver()
    return ctx


__all__ = ["worker_context", "preload_forkserver", "FORKSERVER_PRELOAD"]
