"""Two kinds of failure in stage one, told apart by type (never by an error's text).

* A **row fault**: the input is bad (undecodable media, a clip the codec refuses, codes out of range, a
  value that breaks its field's declaration). The row is rejected with a reason (``rejects.parquet``) and
  the job goes on. Every exception that is not an infrastructure fault is a row fault where a row caused
  it (a plug-in encoder's ``ValueError`` on one clip...).
* An **infrastructure fault** (:class:`InfrastructureFault`): a process of the job died (a decode worker, a
  codec process, the shard writer) or hung (:class:`ProcessHung`: no progress for ``stall_timeout_s``), the
  device failed (a CUDA error, out of memory), the disk is full. It says nothing about the row and is **never
  written as a reject**:
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

A process that hangs is found by its **stall deadline** (``stall_timeout_s``, an operational option: default
600 s, generous for a real codec's call on a slow CPU): a codec process with calls in flight that answers none
for that long, a decode worker that spends that long on one row (:class:`WorkerPids`, the loader's ``timeout``),
the shard writer that takes no row and sends no commit for that long (:mod:`precompute.writer`) is killed
(``SIGKILL``) and handled as a death of that process: a codec process is restarted (its calls sent again),
a decode worker or the writer fails the job (:class:`ProcessHung`, naming the process, what it was doing and
the deadline). Work on the encoder thread (:mod:`precompute.executor`: a plug-in encoder, a codec in this
process) that makes no progress for that long fails the job too; a thread cannot be killed, so the job stops
around it. The work of a thread records its progress on the thread's :class:`Watch` (:func:`current_watch`).

A job stopped by ``SIGTERM`` (SLURM's and torchrun's way to end a job) raises :class:`Stopped` in the main
thread (:func:`stop_on_sigterm`): it unwinds like any fault (the encoder thread, the writer, the shared
memory, the cache's lock all released) and the command line exits ``128 + 15``. Where that exception is swallowed
(raised inside a C library's callback, which prints and drops it), the job stops at its next row
(:func:`raise_if_stopped`), before anything read meanwhile is written.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

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
        self.process, self.pid, self.exitcode, self._detail = process, pid, exitcode, detail
        where = f"{process} (pid {pid})" if pid is not None else process
        super().__init__(process, f"{where} {how_it_ended(exitcode)}" + (f": {detail}" if detail else ""))

    @property
    def signal(self) -> str | None:
        """The signal that killed it (``SIGKILL``), or None."""
        return signal_name(-self.exitcode) if self.exitcode is not None and self.exitcode < 0 else None

    def again(self, detail: str) -> "ProcessDied":
        """The same fault with ``detail`` added (what the job did about it)."""
        return ProcessDied(self.process, self.pid, self.exitcode, "; ".join(filter(None, (self.detail, detail))))

    @property
    def detail(self) -> str:
        return self._detail


class ProcessHung(ProcessDied):
    """A process (or thread) of the job that made no progress for ``stall_s`` seconds (``stall_timeout_s``) while it
    had work; ``doing`` says what (``1 codec call(s) unanswered``, ``decoding row KEY``). A process is killed
    (``SIGKILL``: ``killed`` True) and handled as its death: retried where that process's death is, else the job
    fails naming it. A thread cannot be killed (``killed`` False, ``pid`` None): the job stops around it."""

    def __init__(self, process: str, pid: int | None, stall_s: float, doing: str, killed: bool = True,
                 detail: str = ""):
        self.process, self.pid, self.stall_s, self.doing, self.killed = process, pid, float(stall_s), doing, killed
        self.exitcode = -int(signal.SIGKILL) if killed else None
        self._detail = detail
        where = f"{process} (pid {pid})" if pid is not None else process
        fate = "killed with SIGKILL" if killed else "a thread cannot be killed: the job stops"
        InfrastructureFault.__init__(self, process, f"{where} hung: {doing}, no progress for {self.stall_s:g} s "
                                                    f"(stall_timeout_s); {fate}" + (f"; {detail}" if detail else ""))

    def again(self, detail: str) -> "ProcessHung":
        return ProcessHung(self.process, self.pid, self.stall_s, self.doing, self.killed,
                           "; ".join(filter(None, (self._detail, detail))))


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
    """The pids of a job's decode workers and what each is doing, in a small shared table made before they fork:
    each worker records its pid as it starts (:meth:`record`, in the ``worker_init_fn``) and the row it is decoding
    (:meth:`begin` / :meth:`end` around each row, :class:`precompute.chunks.RowsDataset`); :meth:`dead` names
    those gone and :meth:`hung` those on one row past the stall deadline, so a failure of the decode loader is told
    apart (a worker died, a worker hung) by a fact, not a message. Times are ``time.monotonic()`` seconds (Linux:
    one clock for every process of the machine)."""

    def __init__(self, n: int):
        import torch
        self.workers = int(n)  # (0: the job decodes in its own process, without a deadline)
        n = max(1, n)
        self.table = torch.zeros(n, dtype=torch.int64).share_memory_()
        self.rows = torch.full((n,), -1, dtype=torch.int64).share_memory_()  # the item each decodes (-1: none)
        self.since = torch.zeros(n, dtype=torch.float64).share_memory_()  # when it began that item
        self.reported: ProcessDied | None = None  # the fault :meth:`receive` raised (the loader is shut down)

    def record(self, worker_id: int) -> None:
        self.table[worker_id] = os.getpid()

    def begin(self, item: int) -> None:
        """In a decode worker: it starts decoding row ``item`` (its manifest position; in the main process:
        nothing)."""
        from torch.utils.data import get_worker_info
        info = get_worker_info()
        if info is not None:
            self.rows[info.id], self.since[info.id] = item, time.monotonic()

    def end(self) -> None:
        """In a decode worker: the item it was decoding is done."""
        from torch.utils.data import get_worker_info
        info = get_worker_info()
        if info is not None:
            self.rows[info.id], self.since[info.id] = -1, 0.0

    def dead(self) -> list[tuple[int, int]]:
        """``[(worker id, pid)]`` of the workers that started and are gone."""
        return [(i, int(p)) for i, p in enumerate(self.table.tolist()) if p and not alive(int(p))]

    def hung(self, stall_s: float) -> list[tuple[int, int, int, float]]:
        """``[(worker id, pid, item, seconds on it)]`` of the live workers on one item for more than ``stall_s``."""
        now = time.monotonic()
        return [(i, int(p), int(r), now - t) for i, (p, r, t) in
                enumerate(zip(self.table.tolist(), self.rows.tolist(), self.since.tolist()))
                if p and r >= 0 and t > 0 and now - t > stall_s and alive(int(p))]

    def fault(self, e: BaseException, stall_s: float | None = None,
              row: Callable[[int], str] | None = None) -> ProcessDied | None:
        """The :class:`ProcessDied` of the first dead worker (``e``, the loader's error, as its detail), else (with a
        deadline ``stall_s``) the :class:`ProcessHung` of a worker on one row past it (``row(item)`` names the row;
        :meth:`receive` kills it); None when every worker is alive and within the deadline, and once :meth:`receive`
        raised a fault (the workers it shut down are not dead ones)."""
        if self.reported is not None:
            return None
        gone = self.dead()
        if gone:
            i, pid = gone[0]
            return ProcessDied(f"decode worker {i}", pid, exit_status(pid), f"{type(e).__name__}: {e}")
        stuck = self.hung(stall_s) if stall_s else []
        if not stuck:
            return None
        return _row_hang(stuck[0], stall_s, row)

    def _all_hung(self, stall_s: float) -> ProcessHung:
        """The hang of every live worker: no batch came for the deadline and none was on a row."""
        pids = [(i, int(p)) for i, p in enumerate(self.table.tolist()) if p and alive(int(p))]
        return ProcessHung("decode workers " + ", ".join(str(i) for i, _ in pids), None, stall_s,
                           "none delivered the next batch and none was decoding a row",
                           detail="pids " + ", ".join(str(p) for _, p in pids))

    def receive(self, batches: Iterator, stall_s: float, row: Callable[[int], str] | None = None) -> Iterator:
        """``batches`` (the iterator of a decode loader whose ``timeout`` is ``stall_s``; nothing else may hold it),
        each failure of it raised as the fault of the worker that died or hung (:meth:`fault`; the loader's error
        as its cause). A loader that gave no batch for ``stall_s`` while no worker was on a row (a worker stopped
        between rows) is a hang of every worker (with no worker, decoding in this process, there is no deadline).
        Hung workers are killed once the loader is shut down (so that the
        loader never reports their deaths in the middle of the job's cleanup).

        The loader's ``timeout`` bounds its wait for a batch's message, not what follows: taking the batch's
        shared memory from the worker that sent it (a file descriptor, passed by that worker) blocks for good
        when the worker stopped meanwhile. So while it waits for a batch a watchdog thread looks every
        ``stall_s / 4`` (at most 1 s): a worker on one row past the deadline, or a wait of twice the deadline (the
        loader's own timeout did not end it), is the hang; the watchdog kills those workers (``SIGKILL``), which
        ends the wait with an error, and this raises that hang."""
        import threading
        waiting: list[float | None] = [None]  # since when next(batches) waits (None: not waiting)
        found: list[ProcessHung] = []  # the hang the watchdog killed for
        done = threading.Event()

        def watchdog() -> None:
            while not done.wait(poll_every(stall_s)):
                since = waiting[0]
                if since is None or found or self.reported is not None:
                    continue
                stuck = self.hung(stall_s)
                if stuck:
                    found.append(_row_hang(stuck[0], stall_s, row))
                    kill(found[0].pid)
                elif time.monotonic() - since > 2 * stall_s:
                    found.append(self._all_hung(stall_s))
                    for p in self.table.tolist():
                        if p:
                            kill(int(p))

        if self.workers:
            threading.Thread(target=watchdog, daemon=True, name="decode-watchdog").start()
        try:
            while True:
                t = waiting[0] = time.monotonic()
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                except Exception as e:  # noqa: BLE001 - the loader's error: raised as it is unless a worker caused it
                    fault = found[0] if found else self.fault(e, stall_s, row)
                    if fault is None and self.workers and time.monotonic() - t >= stall_s:  # its timeout: no batch
                        fault = self._all_hung(stall_s)
                    if fault is None:
                        raise
                    cause = e
                    while e is not None:  # (their frames hold the loader's iterator: it must go for its workers to)
                        e.__traceback__, e = None, e.__cause__ or e.__context__
                    break
                finally:
                    waiting[0] = None
                yield batch
        finally:
            done.set()
        del batches  # the loader shuts its workers down, and forgets them
        self.reported = fault
        if isinstance(fault, ProcessHung):
            for p in [fault.pid] if fault.pid is not None else [int(p) for p in self.table.tolist() if p]:
                kill(p)
        raise fault from cause


def _row_hang(stuck: tuple[int, int, int, float], stall_s: float, row: Callable[[int], str] | None) -> ProcessHung:
    """The hang of a decode worker on one row (``stuck``: an entry of :meth:`WorkerPids.hung`)."""
    i, pid, item, _ = stuck
    return ProcessHung(f"decode worker {i}", pid, stall_s, f"decoding {row(item) if row else f'item {item}'}")


def kill(pid: int) -> None:
    """``SIGKILL`` to ``pid`` (a process of the job that hung); gone already: nothing."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def poll_every(stall_s: float) -> float:
    """How often a waiter looks at a stall deadline of ``stall_s`` seconds: a quarter of it, at most one second."""
    return min(1.0, stall_s / 4)


class _Local(threading.local):
    watch: "Watch | None" = None


_LOCAL = _Local()


class Watch:
    """The progress of one thread's work against its stall deadline ``stall_s`` (seconds, ``stall_timeout_s``):
    :meth:`beat` records progress (a batch begun, a codec call answered, a codec process within its own
    deadline), :meth:`idle_s` the seconds since; ``doing`` says what the work is at (for the message of a hang).
    Work that runs under a watch (:meth:`on_this_thread`) finds it with :func:`current_watch`: the codec pool
    (:mod:`precompute.encoders.processes`) takes its deadline from it, and beats it while a process it waits for is
    within that deadline (the pool, not the thread, then deals with a hang)."""

    def __init__(self, stall_s: float):
        self.stall_s = float(stall_s)
        self.doing = "its work"
        self._last = time.monotonic()

    def beat(self, doing: str | None = None) -> None:
        self._last = time.monotonic()
        if doing is not None:
            self.doing = doing

    def idle_s(self) -> float:
        return time.monotonic() - self._last

    @property
    def poll_s(self) -> float:
        """How often a waiter looks at the deadline (:func:`poll_every`)."""
        return poll_every(self.stall_s)

    @contextlib.contextmanager
    def on_this_thread(self) -> Iterator["Watch"]:
        previous, _LOCAL.watch = _LOCAL.watch, self
        try:
            yield self
        finally:
            _LOCAL.watch = previous


def current_watch() -> Watch | None:
    """The :class:`Watch` the calling thread works under (:meth:`Watch.on_this_thread`), or None (no deadline)."""
    return _LOCAL.watch


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


class _StopHandler:
    """The ``SIGTERM`` handler :func:`stop_on_sigterm` installs: the first signal raises :class:`Stopped` and is
    kept (``signum``) for :func:`raise_if_stopped`; another while the job unwinds is logged and ignored."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:
            log.warning("%s again: already stopping (cleaning up)", signal_name(signum))
            return
        self.signum = signum
        raise Stopped(signum)


def stop_on_sigterm() -> Any:
    """Make ``SIGTERM`` raise :class:`Stopped` in the main thread (once: a second one while the job unwinds is
    logged and ignored; where the first was swallowed, :func:`raise_if_stopped` raises it again). Returns the
    previous handler (``signal.signal(SIGTERM, it)`` restores it); called from another thread it changes nothing
    and returns the current handler."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        return signal.getsignal(signal.SIGTERM)
    return signal.signal(signal.SIGTERM, _StopHandler())


def raise_if_stopped() -> None:
    """Raise :class:`Stopped` again when :func:`stop_on_sigterm`'s handler (still the one installed) received
    ``SIGTERM``. A job calls it between rows: the handler's exception is raised wherever the main thread is, and
    where that is a C library's callback (soundfile reading a file object through cffi) or a ``__del__`` it is
    printed and dropped, the read it interrupted getting nothing; the job stops here instead, before the row read
    then is written. Nothing when no such handler is installed (a job run from Python without the command line)."""
    handler = signal.getsignal(signal.SIGTERM)
    if isinstance(handler, _StopHandler) and handler.signum is not None:
        raise Stopped(handler.signum)


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


__all__ = ["InfrastructureFault", "ProcessDied", "ProcessHung", "Watch", "current_watch", "kill", "poll_every",
           "DeviceFault", "StorageFault", "Stopped", "infrastructure",
           "reraise_infrastructure", "kind_of", "rebuild", "FAULTS", "STORAGE_ERRNOS", "WorkerPids", "alive",
           "stop_on_sigterm", "raise_if_stopped", "how_it_ended", "signal_name", "LEGACY_INFRASTRUCTURE_DETAILS",
           "legacy_infrastructure", "legacy_infrastructure_rejects"]
