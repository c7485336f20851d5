"""Run by tests/test_launchers.py in every process a launcher starts (torchrun, srun, mpirun, mpiexec).

``ranks OUT``: writes ``OUT/ranks-<global_rank>.json`` (:meth:`shardcache.ranks.Ranks.detect`);
``group OUT``: also joins a gloo process group through :meth:`Ranks.init_process_group` (the way
``shardcache train`` does) and all-reduces its rank (the sum proves every process joined one group);
``loader CACHE OUT``: a ShardLoader built with no rank arguments; writes this rank's keys of one epoch.
"""
import dataclasses
import json
import sys
from datetime import timedelta
from pathlib import Path

from shardcache.ranks import Ranks

mode = sys.argv[1]
ranks = Ranks.detect()
out = Path(sys.argv[-1])
record = dataclasses.asdict(ranks)
if mode == "group":
    import torch
    import torch.distributed as dist
    ranks.init_process_group("gloo", timedelta(minutes=2))
    t = torch.tensor([ranks.global_rank])
    dist.all_reduce(t)
    record["rank_sum"] = int(t.item())
    dist.destroy_process_group()
elif mode == "loader":
    from loaders import ShardLoader
    loader = ShardLoader(sys.argv[2], 2, seed=3)
    record["keys"] = [k for batch in loader for k in batch["keys"]]
    record["loader"] = [loader.global_rank, loader.world_size, len(loader)]
(out / f"{mode}-{ranks.global_rank}.json").write_text(json.dumps(record))
