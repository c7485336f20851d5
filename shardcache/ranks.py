"""Which process of how many this is, for every stage and command: :class:`Ranks`, the one reader of
the launchers' environment, and the barriers and process group built on it.

Every launcher tells a process its place through environment variables of its own; a process that
reads only torchrun's (``RANK``/``WORLD_SIZE``) believes, under ``srun`` or ``mpirun`` without
torchrun, that it is rank 0 of 1, and then reads (or encodes) the whole dataset in every process.
:meth:`Ranks.detect` knows them all, as Lightning's cluster environments and Mosaic Streaming's
``distributed.py`` do, in this order (the first that applies):

1. an initialised ``torch.distributed`` process group (or the ``group`` passed): its rank and size;
2. the explicit ``global_rank``/``world_size`` arguments, with the environment for what they leave open;
3. the launcher's variables, the innermost launcher first (:data:`LAUNCHERS`): torchrun
   (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``; also ``accelerate launch``,
   deepspeed), OpenMPI's ``mpirun`` (``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``),
   MPICH / Intel MPI / PMI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``),
   a SLURM job step (``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``,
   ``SLURM_STEP_TASKS_PER_NODE`` with ``SLURM_NODEID``);
4. none: 0 of 1.

Innermost first, because launchers nest: ``srun torchrun ...`` gives each torchrun worker SLURM's
variables of its node's task (``SLURM_PROCID`` = the node) beside torchrun's own, and ``mpirun``
inside an allocation starts its daemons with ``srun``, so its ranks inherit a step of one task per
node. The variables of the innermost launcher describe this process; the outer ones describe its
parent.

SLURM's *batch script* (``sbatch``) runs with ``SLURM_PROCID=0`` and ``SLURM_NTASKS`` of the whole
allocation but no job step: a command run there without ``srun`` is one process, 0 of 1 (and says
so in :attr:`Ranks.note`), not rank 0 of ``SLURM_NTASKS`` waiting forever for peers that were never
started. A job step is recognised by ``SLURM_STEP_ID``/``SLURM_STEP_NUM_TASKS``, which only ``srun``
sets.

Refused, naming the variables (``ValueError``), unless a process group or the explicit arguments
settle what is open: a partial family (``LOCAL_RANK`` without ``RANK``: the rank within a node is
not the global rank; ``RANK`` without ``WORLD_SIZE``; a SLURM step without ``SLURM_PROCID``...); and
always: a value that is not an integer, a rank outside its world, a local rank outside its node's
processes or more processes on a node than in the world (a contradictory family), explicit values
that differ from the process group's. Two launchers that disagree are not a contradiction: they
nest (``srun torchrun``: torchrun numbers its workers in rendezvous order, not SLURM's node order),
and the innermost describes this process. No other module reads these variables
(tests/test_launchers.py greps for them).
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping

log = logging.getLogger("shardcache")


@dataclass(frozen=True)
class Launcher:
    """How one launcher names a process's place: the variable of the global rank, of the world size,
    of the rank within the node and of the processes on the node (None: derived, see
    :meth:`local_size_of`); ``marks``: the variables whose presence says this launcher started the
    process (any of them; default: the four above)."""

    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str | None
    marks: tuple[str, ...] = ()

    def present(self, env: Mapping[str, str]) -> list[str]:
        """The variables of this launcher set in ``env`` (its marks when it declares some)."""
        names = self.marks or tuple(v for v in (self.rank, self.size, self.local_rank, self.local_size) if v)
        return [v for v in names if v in env]

    def variables(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(v for v in (self.rank, self.size, self.local_rank, self.local_size, *self.marks)
                                   if v))

    def local_size_of(self, env: Mapping[str, str]) -> int | None:
        """Processes on this node, from ``env`` (None when the launcher does not say)."""
        if self.local_size is not None:
            return _int(env, self.local_size) if self.local_size in env else None
        return _slurm_tasks_on_node(env)


TORCHRUN = Launcher("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
OPENMPI = Launcher("OpenMPI (mpirun)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
PMI = Launcher("MPICH/PMI (mpiexec)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
SLURM = Launcher("SLURM (srun)", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None,
                 marks=("SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS"))
#: the launchers :meth:`Ranks.detect` knows, innermost first (see the module docstring)
LAUNCHERS = (TORCHRUN, OPENMPI, PMI, SLURM)
#: every variable this module reads to place a process (tests/test_launchers.py: no other product module
#: reads one)
LAUNCHER_VARIABLES = tuple(dict.fromkeys(v for launcher in LAUNCHERS for v in launcher.variables()))
#: the rendezvous of a process group started without torchrun: address and port of rank 0
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} is not an integer") from None


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """Tasks of this job step on this node: ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2 tasks on
    each of the first three nodes, 1 on the fourth) at ``SLURM_NODEID``."""
    spec, node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE"), env.get("SLURM_NODEID")
    if not spec or node is None:
        return None
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"cannot read SLURM_STEP_TASKS_PER_NODE={spec!r} (expected e.g. 4(x2),1)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    i = _int(env, "SLURM_NODEID")
    return counts[i] if 0 <= i < len(counts) else None


@dataclass(frozen=True)
class Ranks:
    """This process's place among the processes of a job.

    Attributes:
        global_rank: 0 .. world_size - 1; decides this process's share of the data and who writes
            what is written once (rank 0).
        world_size: processes of the job (data-parallel ranks).
        local_rank: rank within this node; only picks the accelerator (``cuda:local_rank``).
        local_world_size: processes on this node (divides the node's CPU cores between them).
        launcher: where the values came from: ``process group``, ``arguments``, a
            :class:`Launcher` name (``torchrun``, ``SLURM (srun)``...) or ``none``.
        note: a remark worth logging once (a SLURM batch shell run without ``srun``), else ``""``.
    """

    global_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"
    note: str = ""

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.global_rank == 0

    @property
    def distributed(self) -> bool:
        """True when the job has more than one process."""
        return self.world_size > 1

    @property
    def torchrun(self) -> bool:
        """True when torchrun (torch's elastic agent) started this process."""
        return self.launcher == TORCHRUN.name

    def __str__(self) -> str:
        return f"rank {self.global_rank} of {self.world_size} ({self.launcher})"

    @classmethod
    def detect(cls, group: Any = None, global_rank: int | None = None, world_size: int | None = None,
               env: Mapping[str, str] | None = None) -> "Ranks":
        """This process's :class:`Ranks` (see the module docstring for the order).

        Args:
            group: a ``torch.distributed`` process group (data parallelism over a subgroup, beside
                tensor parallelism) to take the rank and size from; default: the initialised default
                group, if any.
            global_rank, world_size: explicit values (None: detected); they win over the launcher's
                variables and must agree with an initialised process group.
            env: the environment to read (default ``os.environ``).

        Raises:
            ValueError: an explicit value differs from the process group's; the environment is
                partial, not an integer or contradictory (the message names the variables); or the
                result is not ``0 <= global_rank < world_size``.
        """
        env = os.environ if env is None else env
        families, note = _families(env)
        complete = [(n, got) for n, got, missing in families if not missing]
        group_ranks = _group_ranks(group)
        if group_ranks is not None:
            where = "the process group" if group is not None else "the initialised default process group"
            for name, given, have in (("global_rank", global_rank, group_ranks[0]),
                                      ("world_size", world_size, group_ranks[1])):
                if given is not None and int(given) != have:
                    raise ValueError(f"{name}={given} differs from {where} ({name} {have}): leave global_rank and "
                                     "world_size unset to take them from it, or pass group= the data-parallel group")
            rank, world, source = group_ranks[0], group_ranks[1], "process group"
            same = [got for _, got in complete if got["world"] == world and got["rank"] == rank]
            local = same[0] if same else {"local": None, "local_size": None}
        else:
            first = complete[0][1] if complete else (families[0][1] if families else {})
            rank = int(global_rank) if global_rank is not None else first.get("rank")
            world = int(world_size) if world_size is not None else first.get("world")
            if rank is None or world is None:
                if families:  # a partial family that the arguments do not settle
                    raise ValueError(_partial_message(env, families[0]))
                rank = 0 if rank is None else rank
                world = 1 if world is None else world
            explicit = global_rank is not None or world_size is not None
            source = "arguments" if explicit else (complete[0][0].name if complete else "none")
            local = first if complete or not explicit else {"local": None, "local_size": None}
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"need 0 <= global_rank < world_size, got rank {rank} of {world} (from {source})")
        local_rank, local_size = local.get("local"), local.get("local_size")
        if local_rank is None and local_size is None:  # nothing says how the ranks sit on nodes: one node
            local_rank, local_size = rank, world
        elif local_size is None:
            local_size = world
        elif local_rank is None:
            local_rank = rank % local_size
        if not (1 <= local_size <= world and 0 <= local_rank < local_size):
            raise ValueError(f"need 0 <= local_rank < local_world_size <= world_size, got local rank {local_rank} of "
                             f"{local_size}, world {world} (from {source})")
        return cls(int(rank), int(world), int(local_rank), int(local_size), source, note)

    # ---- a process group and barriers on these ranks --------------------------------------------------

    def rendezvous(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """``MASTER_ADDR``/``MASTER_PORT`` for a process group of these ranks: the environment's; else
        under a SLURM step the address srun was launched from (``SLURM_LAUNCH_NODE_IPADDR``) and a port
        from the job id (``15000 + SLURM_JOB_ID % 5000``, as Lightning does); else, when every rank is
        on this node, ``127.0.0.1`` and port 29500. Raises ``ValueError`` naming them otherwise (a
        multi-node ``mpirun``: ``mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...``)."""
        env = os.environ if env is None else env
        got = {k: env[k] for k in RENDEZVOUS if env.get(k)}
        if "MASTER_ADDR" not in got:
            if self.launcher == SLURM.name and env.get("SLURM_LAUNCH_NODE_IPADDR"):
                got["MASTER_ADDR"] = env["SLURM_LAUNCH_NODE_IPADDR"]
            elif self.local_world_size == self.world_size:
                got["MASTER_ADDR"] = "127.0.0.1"
        if "MASTER_PORT" not in got:
            if self.launcher == SLURM.name and env.get("SLURM_JOB_ID", "").isdigit():
                got["MASTER_PORT"] = str(15000 + int(env["SLURM_JOB_ID"]) % 5000)
            elif self.local_world_size == self.world_size:
                got["MASTER_PORT"] = "29500"
        missing = [k for k in RENDEZVOUS if k not in got]
        if missing:
            raise ValueError(f"{self}: a process group across nodes needs {' and '.join(missing)} (the address and a "
                             "free port of rank 0's node), which this launcher does not set: export them on every "
                             "node, e.g. mpirun -x MASTER_ADDR=$(hostname) -x MASTER_PORT=29500 ...")
        return got

    def init_process_group(self, backend: str, timeout: timedelta, **kwargs: Any) -> None:
        """``torch.distributed.init_process_group`` for these ranks: torchrun's own rendezvous under
        torchrun, else :meth:`rendezvous` with the rank and size given explicitly (any launcher).
        No-op for one process."""
        if not self.distributed:
            return
        import torch.distributed as dist
        if self.torchrun:
            dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
            return
        where = self.rendezvous()
        dist.init_process_group(backend=backend, timeout=timeout, rank=self.global_rank, world_size=self.world_size,
                                init_method=f"tcp://{where['MASTER_ADDR']}:{where['MASTER_PORT']}", **kwargs)

    def barrier(self) -> tuple[Callable[[], None] | None, Callable[[], None]]:
        """``(barrier, close)`` for ranks that only wait for each other and never exchange tensors
        (stage one, add-field); ``barrier`` is None for one process.

        Under torchrun the agent already runs a TCP key-value store for the rendezvous
        (``TORCHELASTIC_USE_AGENT_STORE=True``, at ``MASTER_ADDR:MASTER_PORT``), so a barrier is a
        counter in that store: no process group, no full mesh of gloo connections to set up again
        after a restart, no collective deadline. Keys carry the restart count, so a group restarted by
        ``--max-restarts`` never sees the counters of the group before it. Other launchers get a gloo
        process group (:meth:`init_process_group`; 60 min timeout)."""
        if not self.distributed:
            return None, lambda: None
        import torch.distributed as dist
        env = os.environ
        if self.torchrun and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), self.world_size,
                                  is_master=False, timeout=timedelta(minutes=30))
            prefix = f"shardcache/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            counter = itertools.count()

            def barrier() -> None:
                key = f"{prefix}/barrier{next(counter)}"
                store.add(key, 1)
                while store.add(key, 0) < self.world_size:  # no deadline: a dead peer makes torchrun restart us
                    time.sleep(0.05)

            return barrier, lambda: None
        self.init_process_group("gloo", timedelta(minutes=60))
        return dist.barrier, dist.destroy_process_group


def _group_ranks(group: Any) -> tuple[int, int] | None:
    if group is None:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch is a core dependency
            return None
        if not (dist.is_available() and dist.is_initialized()):
            return None
    else:
        import torch.distributed as dist
    return int(dist.get_rank(group)), int(dist.get_world_size(group))


def _families(env: Mapping[str, str]) -> tuple[list[tuple[Launcher, dict[str, int | None], list[str]]], str]:
    """Every launcher whose variables are present, innermost first: ``(launcher, {rank, world, local,
    local_size}, the missing variables of rank and size)``; and a note for a SLURM batch shell."""
    out = []
    for launcher in LAUNCHERS:
        if not launcher.present(env):
            continue
        missing = [v for v in (launcher.rank, launcher.size) if v not in env]
        got = {"rank": _int(env, launcher.rank) if launcher.rank in env else None,
               "world": _int(env, launcher.size) if launcher.size in env else None,
               "local": _int(env, launcher.local_rank) if launcher.local_rank in env else None,
               "local_size": launcher.local_size_of(env)}
        if not missing and (got["world"] < 1 or not 0 <= got["rank"] < got["world"]):
            raise ValueError(f"{launcher.rank}={got['rank']} is not a rank of {launcher.size}={got['world']} "
                             f"({launcher.name})")
        out.append((launcher, got, missing))
    note = ""
    if "SLURM_PROCID" in env and not SLURM.present(env) and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        note = (f"SLURM_NTASKS={env['SLURM_NTASKS']} but no job step (SLURM_STEP_ID unset): this is the batch "
                "script's one process; start the job's processes with srun to run them all")
    return out, note


def _partial_message(env: Mapping[str, str], family: tuple[Launcher, dict, list[str]]) -> str:
    launcher, _, missing = family
    found = ", ".join(f"{v}={env[v]}" for v in launcher.variables() if v in env)
    local = (f" {launcher.local_rank} is the rank within one node, not the global rank (2 nodes x 2 processes have "
             f"two {launcher.local_rank}=0): taking it would read half the samples twice and the other half never."
             if launcher.local_rank in env and launcher.rank not in env else "")
    return (f"the launcher's environment is partial: {found} set ({launcher.name}), {' and '.join(missing)} unset, so "
            f"this process's share of the data is unknown.{local} Set {launcher.rank} and {launcher.size} "
            f"({launcher.name} does), initialise the torch.distributed process group first, or pass global_rank= "
            "and world_size=")


__all__ = ["LAUNCHERS", "LAUNCHER_VARIABLES", "RENDEZVOUS", "Launcher", "Ranks"]
