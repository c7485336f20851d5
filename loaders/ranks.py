"""Which rank of how many a loader serves: explicit arguments, else the process group, else the
launcher's environment, as LitData and Mosaic Streaming do.

:func:`resolve_rank` is the one place :class:`loaders.ShardLoader` and :class:`loaders.MixedLoader`
learn their ``global_rank`` and ``world_size``.

The environment settles them only when it is complete: ``RANK`` and ``WORLD_SIZE`` (what torchrun,
``accelerate launch`` and the SLURM wrappers set). ``LOCAL_RANK`` is the rank within one node: on 2
nodes x 2 processes, two processes have ``LOCAL_RANK=0``, so taking it as the global rank would read
half the samples twice and never the other half. A partial environment (``LOCAL_RANK`` or
``LOCAL_WORLD_SIZE`` without ``RANK``, ``RANK`` without ``WORLD_SIZE``, ``WORLD_SIZE`` without
``RANK``) is refused, naming what is set and what is missing, unless a process group or the explicit
arguments settle what it leaves open.
"""
from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

#: the launcher variables that say something about this process's rank; RANK and WORLD_SIZE settle it
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _int_variable(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} is not an integer") from None


def _from_environment(global_rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world)`` from explicit values and ``RANK``/``WORLD_SIZE``; 0 of 1 without any launcher
    variable. Raises ``ValueError`` naming the variables when what is set leaves the global rank or
    the world size open (see the module docstring)."""
    env = os.environ
    present = [v for v in LAUNCHER_VARIABLES if v in env]
    rank = global_rank if global_rank is not None else (_int_variable("RANK") if "RANK" in env else None)
    world = world_size if world_size is not None else (_int_variable("WORLD_SIZE") if "WORLD_SIZE" in env else None)
    if not present:
        return (0 if rank is None else rank), (1 if world is None else world)
    if rank is None or world is None:
        missing = [v for v, open_ in (("RANK", rank is None), ("WORLD_SIZE", world is None)) if open_]
        found = ", ".join(f"{v}={env[v]}" for v in present)
        local = (" LOCAL_RANK is the rank within one node, not the global rank (2 nodes x 2 processes have "
                 "two LOCAL_RANK=0): taking it would read half the samples twice and the other half never."
                 if "LOCAL_RANK" in env and rank is None else "")
        raise ValueError(
            f"the launcher's environment is partial: {found} set, {' and '.join(missing)} unset, so this "
            f"process's share of the data is unknown.{local} Set RANK and WORLD_SIZE (torchrun and "
            "`accelerate launch` do), initialise the torch.distributed process group before building the "
            "loader, or pass global_rank= and world_size= (ShardLoader, MixedLoader)")
    return rank, world


def resolve_rank(global_rank: int | None = None, world_size: int | None = None,
                 group: Any = None) -> tuple[int, int]:
    """``(global_rank, world_size)`` of this process's share of the data.

    Args:
        global_rank, world_size: explicit values (None: detected). An explicit value wins over the
            environment variables; it must agree with an initialised process group.
        group: a ``torch.distributed`` process group to take the rank and size from instead of the
            default one (data parallelism over a subgroup, e.g. beside tensor parallelism).

    Detection, first that applies: ``group`` or the initialised default process group
    (``torch.distributed.get_rank()/get_world_size()``); the explicit values with ``RANK`` /
    ``WORLD_SIZE`` for what they leave open (torchrun, SLURM wrappers, accelerate); 0 of 1 when no
    launcher variable (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) is set.
    ``LOCAL_RANK`` is never taken as the global rank.

    Raises ``ValueError`` when an explicit value differs from the process group's (the ranks would
    read overlapping or missing data), when the environment is partial and nothing else settles it
    (``LOCAL_RANK`` without ``RANK``, ``RANK`` without ``WORLD_SIZE``...: the message names the
    variables), or when the result is not ``0 <= rank < world``.
    """
    if group is not None or (dist.is_available() and dist.is_initialized()):
        where = "the process group" if group is not None else "the initialised default process group"
        detected = (dist.get_rank(group), dist.get_world_size(group))
        for name, given, found in (("global_rank", global_rank, detected[0]), ("world_size", world_size, detected[1])):
            if given is not None and int(given) != found:
                raise ValueError(
                    f"{name}={given} differs from {where} ({name} {found}): leave global_rank and world_size "
                    "unset to take them from it, or pass group= the data-parallel process group")
        rank, world = detected
    else:
        rank, world = _from_environment(None if global_rank is None else int(global_rank),
                                        None if world_size is None else int(world_size))
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= global_rank < world_size, got rank {rank} of {world}")
    return int(rank), int(world)
