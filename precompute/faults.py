"""Two kinds of failure in stage one, told apart by type (never by an error's text).

* A **row fault**: the input is bad (undecodable media, a clip the codec refuses, codes out of range, a
  value that breaks its field's declaration). The row is rejected with a reason (``rejects.parquet``) and
  the job goes on. Every exception that is not an infrastructure fault is a row fault where a row caused
  it (a plug-in encoder's ``ValueError`` on one clip...).
* An **infrastructure fault** (:class:`InfrastructureFault`): a process of the job died (a decode worker, a
  codec process, the shard writer), the device failed (a CUDA error, out of memory), the disk is full (a
  process that hangs is not detected yet). It says nothing about the row and is **never written as a reject**:
  it is retried where that is safe (a codec process is restarted and its calls in flight are sent again, a
  bounded number of times, each logged: :mod:`precompute.encoders.processes`), else the job stops with exit
  status 1 naming the process and the signal. Committed chunks are kept, the chunk in progress is dropped, so the same command
  run again completes the cache to the bytes an uninterrupted run writes.

:func:`infrastructure` says which exceptions are infrastructure faults, by class and ``errno``
(:class:`InfrastructureFault` and its subclasses, ``MemoryError``, ``torch.cuda.OutOfMemoryError``,
``torch.AcceleratorError``, ``OSError`` with :data:`STORAGE_ERRNOS`); code that turns an exception into a
reject asks it first and re-raises those (:func:`reraise_infrastructure`).

Older versions wrote some infrastructure faults as ``encode_failed`` rejects. Their reject details are
declared in :data:`LEGACY_INFRASTRUCTURE_DETAILS` (the one place an error's text is read: records written
before the faults had a type), and a rerun redoes the chunks holding one (:func:`legacy_infrastructure_rejects`).

A job stopped by ``SIGTERM`` (SLURM's and torchrun's way to end a job) raises :class:`Stopped` in the main
thread (:func:`stop_on_sigterm`): it unwinds like any fault (the encoder thread, the writer, the shared
memory, the cache's lock all released) and the command line exits ``128 + 15``.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger("precompute")

#: ``OSError.errno`` values that are the store's fault, not the row's: no space, quota, read-only file system
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})

#: prefixes of the reject details older versions wrote for what was an infrastructure fault (``encode_failed``):
#: a codec process that died mid-job, a device error or an out-of-memory inside a codec call
LEGACY_INFRASTRUCTURE_DETAILS = (
    "RuntimeError: the codec process ended (",
    "RuntimeError: codec process: OutOfMemoryError",
    "RuntimeError: codec process: AcceleratorError",
    "OutOfMemoryError: ",
    "AcceleratorError: ",
)


class InfrastructureFault(RuntimeError):
    """A fault of the machinery, not of the row (see the module docstring): never a reject. ``what`` names the
    process or device; the message says what happened and that a rerun of the same command completes the
    cache."""

    def __init__(self, what: str, message: str):
        super().__init__(message)
        self.what = what


def signal_name(n: int) -> str:
    """``SIGKILL`` for 9 (the number itself where it names no signal)."""
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def how_it_ended(exitcode: int | None) -> str:
    """``was killed by signal SIGKILL (9)`` / ``exited with status 3`` / ``ended`` (not known), from a
    :class:`multiprocessing.Process`'s ``exitcode`` (negative: the signal)."""
    if exitcode is None:
        return "ended"
    if exitcode < 0:
        return f"was killed by signal {signal_name(-exitcode)} ({-exitcode})"
    return f"exited with status {exitcode}"


class ProcessDied(InfrastructureFault):
    """A process of the job ended while it had work: ``process`` (``codec process 1 of 2``, ``decode worker 0``,
    ``shard writer process``), its ``pid`` and ``exitcode`` (negative: killed by that signal; None: unknown)."""

    def __init__(self, process: str, pid: int | None, exitcode: int | None, detail: str = ""):
        self.process, self.pid, self.exitcode = process, pid, exitcode
        where = f"{process} (pid {pid})" if pid is not None else process
        super().__init__(process, f"{where} {how_it_ended(exitcode)}" + (f": {detail}" if detail else ""))

    @property
    def signal(self) -> str | None:
        """The signal that killed it (``SIGKILL``), or None."""
        return signal_name(-self.exitcode) if self.exitcode is not None and self.exitcode < 0 else None


class DeviceFault(InfrastructureFault):
    """The device failed a call: out of memory (device or host), a CUDA error."""


class StorageFault(InfrastructureFault):
    """The disk or the store failed a write: no space left, a quota, a read-only file system."""


class Stopped(BaseException):
    """The job was asked to stop (``SIGTERM``): unwinds the job like a fault, never caught as a row's
    (a ``BaseException``, as ``KeyboardInterrupt``). ``signum``: the signal."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal_name(signum)}")
        self.signum = signum


def _torch_faults() -> tuple[type, ...]:
    import torch
    return (torch.cuda.OutOfMemoryError, torch.AcceleratorError)


def infrastructure(e: BaseException) -> InfrastructureFault | None:
    """``e`` as an :class:`InfrastructureFault` when it is one (see the module docstring: by type and ``errno``),
    else None (a row fault where a row raised it)."""
    if isinstance(e, InfrastructureFault):
        return e
    if isinstance(e, MemoryError):
        return DeviceFault("host memory", f"out of host memory: {type(e).__name__}: {e}")
    if isinstance(e, _torch_faults()):
        return DeviceFault("device", f"{type(e).__name__}: {e}")
    if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
        return StorageFault("storage", f"{type(e).__name__}: {e}")
    return None


def reraise_infrastructure(e: BaseException) -> None:
    """Raise ``e`` (as its :class:`InfrastructureFault`) when it is one; return for a row fault. Called by every
    ``except`` that turns an exception into a reject."""
    fault = infrastructure(e)
    if fault is None:
        return
    if fault is e:
        raise e
    raise fault from e


#: fault class name -> class, for a fault a child process reports (rebuilt in the parent by its declared name)
FAULTS: dict[str, type[InfrastructureFault]] = {c.__name__: c for c in (InfrastructureFault, DeviceFault,
                                                                        StorageFault)}


def kind_of(e: BaseException) -> str | None:
    """The name of the :data:`FAULTS` class ``e`` is (what a child process sends its parent), or None (a row fault)."""
    fault = infrastructure(e)
    if fault is None:
        return None
    return next(name for name, cls in reversed(list(FAULTS.items())) if isinstance(fault, cls))


def rebuild(kind: str, what: str, message: str) -> InfrastructureFault:
    """The fault a child reported as ``kind`` (:func:`kind_of`), with its text."""
    return FAULTS.get(kind, InfrastructureFault)(what, message)


# ---- the job's processes ---------------------------------------------------------------------------------------

def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux ``/proc``; elsewhere: it exists)."""
    stat = Path(f"/proc/{pid}/stat")
    if stat.parent.parent.exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


class WorkerPids:
    """The pids of a job's decode workers, recorded by each worker as it starts (:meth:`record`, in the
    ``worker_init_fn``) in a small shared table made before they fork; :meth:`dead` names those gone, so a
    failure of the decode loader is told apart (a worker died: :class:`ProcessDied`) by a fact, not a message."""

    def __init__(self, n: int):
        import torch
        self.table = torch.zeros(max(1, n), dtype=torch.int64).share_memory_()

    def record(self, worker_id: int) -> None:
        self.table[worker_id] = os.getpid()

    def dead(self) -> list[tuple[int, int]]:
        """``[(worker id, pid)]`` of the workers that started and are gone."""
        return [(i, int(p)) for i, p in enumerate(self.table.tolist()) if p and not alive(int(p))]

    def fault(self, e: BaseException) -> ProcessDied | None:
        """The :class:`ProcessDied` of the first dead worker (``e``, the loader's error, as its detail), or None."""
        gone = self.dead()
        if not gone:
            return None
        i, pid = gone[0]
        return ProcessDied(f"decode worker {i}", pid, exit_status(pid), f"{type(e).__name__}: {e}")


def exit_status(pid: int) -> int | None:
    """How child process ``pid`` ended, as :class:`multiprocessing.Process` says it (negative: the signal), read
    without reaping it (``waitid`` with ``WNOWAIT``); None when it is not a child of this process or still runs."""
    try:
        got = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError, AttributeError):
        return None
    if got is None:
        return None
    return -got.si_status if got.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else got.si_status


def stop_on_sigterm() -> Any:
    """Make ``SIGTERM`` raise :class:`Stopped` in the main thread (once: a second one while the job unwinds is
    logged and ignored). Returns the previous handler (``signal.signal(SIGTERM, it)`` restores it); called
    from another thread it changes nothing and returns the current handler."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return signal.getsignal(signal.SIGTERM)
    state = {"stopping": False}

    def handler(signum, _frame):
        if state["stopping"]:
            log.warning("%s again: already stopping (cleaning up)", signal_name(signum))
            return
        state["stopping"] = True
        raise Stopped(signum)

    return signal.signal(signal.SIGTERM, handler)


# ---- rejects older versions wrote for infrastructure faults ----------------------------------------------------

def legacy_infrastructure(reason: str | None, detail: str | None) -> bool:
    """Whether a reject is one an older version wrote for an infrastructure fault (:data:`LEGACY_INFRASTRUCTURE_DETAILS`)."""
    from shards.schema import ENCODE_FAILED
    return reason == ENCODE_FAILED and isinstance(detail, str) and detail.startswith(LEGACY_INFRASTRUCTURE_DETAILS)


def legacy_infrastructure_rejects(out_dir: Path, stems: Iterable[str]) -> dict[str, int]:
    """Committed chunk stem -> how many of its rejects (its ``parts/STEM.rejects.parquet``) an older version
    wrote for an infrastructure fault (only chunks holding one): a rerun encodes those chunks again."""
    import pyarrow.parquet as pq

    from shards.index import part_paths
    out: dict[str, int] = {}
    for stem in stems:
        path = part_paths(Path(out_dir), stem)[1]
        if not path.exists():
            continue
        t = pq.read_table(path, columns=["reason", "detail"])
        n = sum(legacy_infrastructure(r, d) for r, d in zip(t.column("reason").to_pylist(),
                                                            t.column("detail").to_pylist()))
        if n:
            out[stem] = n
    return out


__all__ = ["InfrastructureFault", "ProcessDied", "DeviceFault", "StorageFault", "Stopped", "infrastructure",
           "reraise_infrastructure", "kind_of", "rebuild", "FAULTS", "STORAGE_ERRNOS", "WorkerPids", "alive",
           "stop_on_sigterm", "how_it_ended", "signal_name", "LEGACY_INFRASTRUCTURE_DETAILS",
           "legacy_infrastructure", "legacy_infrastructure_rejects"]
