"""Which rank of how many a loader serves: explicit arguments, else the process group, else the
launcher's environment, as LitData and Mosaic Streaming do.

:func:`resolve_rank` is the one place :class:`loaders.ShardLoader` and :class:`loaders.MixedLoader`
learn their ``global_rank`` and ``world_size``.
"""
from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist


def _from_environment() -> tuple[int, int, str] | None:
    """``(rank, world, where)`` from ``RANK``/``WORLD_SIZE`` (``LOCAL_RANK``/``LOCAL_WORLD_SIZE``
    when ``RANK`` is unset), or None when the launcher set none of them."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"]), int(env.get("WORLD_SIZE", 1)), "RANK/WORLD_SIZE"
    if "LOCAL_RANK" in env:
        world = env.get("WORLD_SIZE", env.get("LOCAL_WORLD_SIZE", 1))
        return int(env["LOCAL_RANK"]), int(world), "LOCAL_RANK/WORLD_SIZE"
    return None


def resolve_rank(global_rank: int | None = None, world_size: int | None = None,
                 group: Any = None) -> tuple[int, int]:
    """``(global_rank, world_size)`` of this process's share of the data.

    Args:
        global_rank, world_size: explicit values (None: detected). An explicit value wins over the
            environment variables; it must agree with an initialised process group.
        group: a ``torch.distributed`` process group to take the rank and size from instead of the
            default one (data parallelism over a subgroup, e.g. beside tensor parallelism).

    Detection, first that applies: ``group`` or the initialised default process group
    (``torch.distributed.get_rank()/get_world_size()``); ``RANK``/``WORLD_SIZE`` (torchrun, SLURM
    wrappers, accelerate); ``LOCAL_RANK`` with ``WORLD_SIZE`` or ``LOCAL_WORLD_SIZE``; else 0 of 1.

    Raises ``ValueError`` when an explicit value differs from the process group's (the ranks would
    read overlapping or missing data), or when the result is not ``0 <= rank < world``.
    """
    detected: tuple[int, int, str] | None = None
    if group is not None or (dist.is_available() and dist.is_initialized()):
        where = "the process group" if group is not None else "the initialised default process group"
        detected = (dist.get_rank(group), dist.get_world_size(group), where)
        for name, given, found in (("global_rank", global_rank, detected[0]), ("world_size", world_size, detected[1])):
            if given is not None and int(given) != found:
                raise ValueError(
                    f"{name}={given} differs from {where} ({name} {found}): leave global_rank and world_size "
                    "unset to take them from it, or pass group= the data-parallel process group")
    else:
        detected = _from_environment()
    rank = int(global_rank) if global_rank is not None else detected[0] if detected else 0
    world = int(world_size) if world_size is not None else detected[1] if detected else 1
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= global_rank < world_size, got rank {rank} of {world}")
    return rank, world
