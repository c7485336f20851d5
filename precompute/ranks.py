"""How the ranks of a stage-one job wait for each other: barriers on torchrun's own store.

Stage one's ranks never exchange tensors; they only need two barriers (fingerprint recorded; every
rank has read the committed chunks before anyone commits). Under torchrun the agent already runs a
TCP key-value store for the rendezvous (``TORCHELASTIC_USE_AGENT_STORE=True``, at
``MASTER_ADDR:MASTER_PORT``), so a barrier is a counter in that store: no process group, no full
mesh of gloo connections to set up again after a restart (which was refused now and then on a
loaded machine), and no collective deadline. Keys carry the restart count, so a group restarted by
``--max-restarts`` never sees the counters of the group before it. Other launchers fall back to a
gloo process group.
"""
from __future__ import annotations

import itertools
import os
import time
from datetime import timedelta
from typing import Callable


def make_barrier(world_size: int, global_rank: int) -> tuple[Callable[[], None] | None, Callable[[], None]]:
    """``(barrier, close)`` for this rank; ``barrier`` is None when ``world_size`` is 1."""
    if world_size <= 1:
        return None, lambda: None
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                              is_master=False, timeout=timedelta(minutes=30))
        prefix = f"shardcache/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        counter = itertools.count()

        def barrier() -> None:
            key = f"{prefix}/barrier{next(counter)}"
            store.add(key, 1)
            while store.add(key, 0) < world_size:  # no deadline: a dead peer makes torchrun restart us
                time.sleep(0.05)

        return barrier, lambda: None
    dist.init_process_group("gloo", timeout=timedelta(minutes=60))
    return dist.barrier, dist.destroy_process_group
