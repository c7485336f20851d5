"""Process groups, ranks, devices, and stop requests that every rank agrees on.

Ranks come from :meth:`shardcache.ranks.Ranks.detect` (torchrun, srun, mpirun or a PMI launcher;
the rendezvous from ``MASTER_ADDR``/``MASTER_PORT`` or what the launcher tells); without a launcher
the run is a single process with no process group, and every collective helper here degrades to
the identity.

Stop requests: SIGUSR1 or SIGTERM (a second SIGTERM kills at once) or the stop file set a local
flag; :meth:`StopRequest.agreed` all-reduces it (MAX) once per step, so every rank stops after the
same step even when only one of them received the signal. torchrun does not forward SIGUSR1
(pytorch #154849): under SLURM the batch shell receives it (``--signal=B:USR1@300``) and touches the
stop file (see ``scripts/slurm/train.sbatch``).

Failures: a rank that raises logs the traceback and leaves the process at once
(:func:`abort_on_exception`), which closes its sockets; peers blocked in a gloo collective then
fail immediately ("connection closed by peer") and exit too; under NCCL, torchrun and
``srun --kill-on-bad-exit=1`` stop the other workers, and the process-group timeout
(``--pg-timeout-min``) is the backstop.
"""
from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardcache.ranks import Ranks

log = logging.getLogger("train")

ALLOC_CONF = "expandable_segments:True"
#: every environment variable this process set itself (name -> value); logged at start by the trainer
ENV_SET: dict[str, str] = {}


def set_env_default(name: str, value: str) -> bool:
    """``os.environ[name] = value`` unless the user set it; recorded in :data:`ENV_SET` (and logged
    by the caller), so no setting happens silently. Returns whether it was set."""
    if name in os.environ:
        return False
    os.environ[name] = value
    ENV_SET[name] = value
    return True


def set_alloc_conf() -> dict[str, str]:
    """Set ``PYTORCH_ALLOC_CONF`` and ``PYTORCH_CUDA_ALLOC_CONF`` (older torch reads only the latter)
    to ``expandable_segments:True`` (less fragmentation with variable-length batches) unless the user
    set them; must run before CUDA is initialised. Returns what it set (see :func:`log_env_set`)."""
    return {v: ALLOC_CONF for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if set_env_default(v, ALLOC_CONF)}


def log_env_set() -> None:
    """Log (logger ``train``) every environment variable this process set, or that it set none."""
    if ENV_SET:
        log.info("environment set by shardcache (unset before; export your own value to override): %s",
                 " ".join(f"{k}={v}" for k, v in ENV_SET.items()))
    else:
        log.info("environment: shardcache set no variable (PYTORCH_ALLOC_CONF/PYTORCH_CUDA_ALLOC_CONF were set "
                 "by the user: %s / %s)", os.environ.get("PYTORCH_ALLOC_CONF"),
                 os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def env_ranks() -> tuple[int, int, int]:
    """(global rank, local rank, world size) of this process (:meth:`shardcache.ranks.Ranks.detect`;
    0, 0, 1 without a launcher). Raises ``ValueError`` for a partial launcher environment."""
    r = Ranks.detect()
    return r.global_rank, r.local_rank, r.world_size


def init(device: str = "auto", backend: str = "auto", timeout_min: float = 30.0) -> DistInfo:
    """Pick the device, set the allocator config (:func:`set_alloc_conf`), and join the process group
    when the world has more than one process (:class:`shardcache.ranks.Ranks`: any launcher). The
    global rank decides everything that is global (data split, rank-0 writes); the local rank only
    picks the GPU."""
    set_alloc_conf()
    ranks = Ranks.detect()
    rank, local, world = ranks.global_rank, ranks.local_rank, ranks.world_size
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    info = DistInfo(rank=rank, local_rank=local, world_size=world, device=dev)
    if world > 1:
        be = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
        kwargs: dict[str, Any] = {}
        if be == "nccl":
            kwargs["device_id"] = dev  # eager init: a missing peer fails here, not at the first all-reduce
        ranks.init_process_group(be, datetime.timedelta(minutes=timeout_min), **kwargs)
        if dist.get_rank() != rank or dist.get_world_size() != world:
            raise RuntimeError(f"process group says rank {dist.get_rank()}/{dist.get_world_size()}, "
                               f"environment says {rank}/{world}")
        info.backend = be
    return info


def teardown() -> None:
    """Leave the process group (no-op without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.distributed:
        if info.backend == "nccl":
            dist.barrier(device_ids=[info.local_rank])
        else:
            dist.barrier()


def all_reduce_(t: torch.Tensor, info: DistInfo, op=None) -> torch.Tensor:
    """In-place all-reduce (SUM by default); identity in a single process."""
    if info.distributed:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def all_gather_object(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not info.distributed:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def abort_on_exception(info: DistInfo | None, exc: BaseException) -> None:
    """Log a rank's exception and leave the process now, so that peers do not hang on it.

    ``os._exit`` skips interpreter cleanup (which could block in a collective or in a DataLoader
    worker join) and closes this rank's sockets, so the peers' pending collectives fail.
    """
    import traceback

    rank = info.rank if info else env_ranks()[0]
    sys.stderr.write(f"[rank {rank}] training failed: {type(exc).__name__}: {exc}\n")
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    for h in logging.getLogger().handlers + log.handlers:
        try:
            h.flush()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


class StopRequest:
    """Stop flag set by SIGUSR1/SIGTERM or a stop file; :meth:`agreed` makes every rank agree.

    ``install()`` must run in the main thread. ``agreed(step)`` is a collective: call it on every
    rank at the same step.
    """

    SIGNALS = ("SIGUSR1", "SIGTERM")

    def __init__(self, info: DistInfo, stop_file: str | Path, stop_at_step: int = 0):
        self.info = info
        self.stop_file = Path(stop_file)
        self.stop_at_step = stop_at_step
        self.reason = ""
        self._flag = threading.Event()
        self._old: dict[int, Any] = {}

    def install(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            try:
                signal.signal(sig, old)
            except (ValueError, TypeError):
                pass
        self._old.clear()

    def _handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == getattr(signal, "SIGTERM", None) and self._flag.is_set():
            # second SIGTERM: the scheduler is out of patience; die now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.reason = self.reason or name
        self._flag.set()

    def request(self, reason: str = "requested") -> None:
        self.reason = self.reason or reason
        self._flag.set()

    def local(self, step: int) -> bool:
        """This rank's view: a signal arrived, the stop file exists, or stop_at_step is reached."""
        if self._flag.is_set():
            return True
        if self.stop_at_step and step >= self.stop_at_step:
            self.reason = self.reason or f"stop_at_step={self.stop_at_step}"
            return True
        if self.stop_file.exists():
            self.reason = self.reason or f"stop file {self.stop_file}"
            return True
        return False

    def agreed(self, step: int) -> bool:
        """True on every rank when any rank wants to stop (one small all-reduce, MAX)."""
        want = self.local(step)
        if not self.info.distributed:
            return want
        t = torch.tensor([1 if want else 0], dtype=torch.int32, device=self.info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        agreed = bool(t.item())
        if agreed and not want:
            self.reason = self.reason or "another rank requested a stop"
        return agreed

    def clear_file(self) -> None:
        """Remove the stop file (rank 0, after the stop checkpoint is complete)."""
        try:
            self.stop_file.unlink()
        except FileNotFoundError:
            pass
