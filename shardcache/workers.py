"""The automatic worker count, one rule for both stages (stage one's decode workers and stage
two's loader workers): on a GPU node, this rank's share of the CPU cores minus one for the main
process, 1 to 8; on a CPU-only run, 0 (the model's intra-op threads already use every core, and
worker processes would only compete with them: measured in ``make bench``)."""
from __future__ import annotations

import os


def cpus_per_rank() -> int:
    """CPU cores this process may use (its affinity mask), divided by the processes of this node
    (:attr:`shardcache.ranks.Ranks.local_world_size`), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    from .ranks import Ranks
    local = Ranks.detect().local_world_size
    return max(1, cpus // local)


def auto_workers(on_accelerator: bool = True) -> int:
    """Worker processes for ``auto``: ``min(8, cpus_per_rank() - 1)`` (at least 1) when the model
    runs on an accelerator, else 0."""
    if not on_accelerator:
        return 0
    return max(1, min(8, cpus_per_rank() - 1))


__all__ = ["cpus_per_rank", "auto_workers"]
