"""Start N processes the way each launcher does, for tests/test_launchers.py.

``torchrun`` (torch's own ``torch.distributed.run``), OpenMPI's ``mpirun`` and MPICH's ``mpiexec.hydra``
are the real launchers (Debian's openmpi-bin and mpich: ``make launchers``; a test skips naming that
target where one is missing). SLURM's ``srun`` cannot run without a SLURM cluster, so :func:`srun`
starts the processes itself with the environment srun gives each task of a job step, variable for
variable as srun's manual lists it ("OUTPUT ENVIRONMENT VARIABLES"): two nodes when there are 4
tasks (``SLURM_STEP_TASKS_PER_NODE=2(x2)``), so the local ranks repeat across nodes as they do on a
real allocation.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import pytest

from test_train_support import REPO, base_env, free_port

TIMEOUT = 300
MPIRUN = shutil.which("mpirun.openmpi")
MPIEXEC = shutil.which("mpiexec.hydra") or shutil.which("mpiexec.mpich")
#: the launchers a test runs under (``srun`` emulated, the others real)
NAMES = ("torchrun", "srun", "mpirun", "mpiexec")
_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def clean_env(extra: dict | None = None) -> dict:
    """The tests' environment without any launcher's variables (a test may itself run under one)."""
    env = {k: v for k, v in base_env().items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL")) and k not in _TORCH_VARS}
    env.update(extra or {})
    return env


def srun_task_env(procid: int, ntasks: int, *, job_id: int = 4242, nodes: int | None = None) -> dict[str, str]:
    """The variables ``srun --ntasks=N`` sets for task ``procid`` of step 0 of job ``job_id``; block
    distribution over ``nodes`` nodes (default: 2 when ``ntasks`` is even and > 2, else 1)."""
    nodes = nodes or (2 if ntasks > 2 and ntasks % 2 == 0 else 1)
    per = ntasks // nodes
    node = procid // per
    return {
        "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_JOB_NAME": "precompute",
        "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(procid % per),
        "SLURM_NODEID": str(node), "SLURM_NTASKS": str(ntasks), "SLURM_NPROCS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_STEP_TASKS_PER_NODE": f"{per}(x{nodes})" if nodes > 1 else str(per),
        "SLURM_TASKS_PER_NODE": f"{per}(x{nodes})" if nodes > 1 else str(per), "SLURM_GTIDS": str(procid),
        "SLURM_STEP_NODELIST": f"node[0-{nodes - 1}]" if nodes > 1 else "node0", "SLURMD_NODENAME": f"node{node}",
        "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_SRUN_COMM_HOST": "127.0.0.1", "SLURM_CPUS_ON_NODE": "2",
    }


def launch(launcher: str, nproc: int, argv: list[str], *, env: dict | None = None,
           timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``python ARGV...`` in ``nproc`` processes under ``launcher`` (:data:`NAMES`), in the
    repository; returns the launcher's result (``srun``: the first failing task's, else the last).
    Skips the test when the launcher is not installed."""
    env = clean_env(env)
    py = [sys.executable, *argv]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={free_port()}", *argv]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if launcher == "mpirun":
        if MPIRUN is None:
            pytest.skip("OpenMPI's mpirun is not installed: make launchers (Debian's openmpi-bin)")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl="self,tcp",
                   OMPI_MCA_rmaps_base_oversubscribe="1", MASTER_PORT=str(free_port()))
        return subprocess.run([MPIRUN, "-np", str(nproc), *py], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    if launcher == "mpiexec":
        if MPIEXEC is None:
            pytest.skip("MPICH's mpiexec (hydra, PMI) is not installed: make launchers (Debian's mpich)")
        env.update(MASTER_PORT=str(free_port()))
        return subprocess.run([MPIEXEC, "-np", str(nproc), *py], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    if launcher == "srun":
        # a job id of its own per launch, whose port (Ranks.rendezvous: 15000 + id % 5000) is free here
        job = 35000 + _free_port_between(15000, 20000) - 15000
        procs = [subprocess.Popen(py, cwd=REPO, env={**env, **srun_task_env(r, nproc, job_id=job)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(nproc)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
        failed = [r for r in results if r.returncode]
        done = failed[0] if failed else results[-1]
        done.stdout, done.stderr = "".join(r.stdout for r in results), "".join(r.stderr for r in results)
        return done
    raise ValueError(f"unknown launcher {launcher!r}; known: {NAMES}")


def _free_port_between(lo: int, hi: int) -> int:
    import random
    import socket
    for port in random.sample(range(lo, hi), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {lo}..{hi}")
