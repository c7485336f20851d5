"""Run by tests/test_loader_ranks.py under ``torchrun --nproc_per_node=2``: builds a ShardLoader with
no rank arguments (``pg``: after init_process_group; ``env``: from RANK/WORLD_SIZE only; ``wrong``:
an explicit world_size that differs from the process group: Ranks.detect refuses it) and writes this rank's keys of one
epoch to ``OUT/keys-<RANK>.json``."""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from loaders import ShardLoader
from shardcache.ranks import Ranks

cache, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
if mode in ("pg", "wrong"):
    dist.init_process_group("gloo")
if mode == "wrong":
    try:
        ShardLoader(cache, 2, ranks=Ranks.detect(world_size=1))
    except ValueError as e:
        (out / f"error-{os.environ['RANK']}.txt").write_text(str(e))
    dist.destroy_process_group()
    sys.exit(0)
loader = ShardLoader(cache, 2, seed=3)
keys = [k for batch in loader for k in batch["keys"]]
(out / f"keys-{os.environ['RANK']}.json").write_text(json.dumps(
    {"keys": keys, "rank": loader.global_rank, "world": loader.world_size, "steps": len(loader)}))
if dist.is_initialized():
    dist.destroy_process_group()
