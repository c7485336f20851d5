"""DDP: gradient all-reduces per optimiser step with and without ``no_sync`` accumulation.

Two gloo processes on this machine, the reference model, ``accum`` micro-steps per optimiser step.
``with_no_sync`` is what ``train.loop`` does (forward and backward of the non-final micro-steps
inside ``model.no_sync()``); ``every_micro_step`` is the seed scripts' behaviour (an all-reduce
after every backward). A DDP comm hook counts bucket all-reduces; wall time per optimiser step is
the median over the measured steps of rank 0.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, accum: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from train.models import ReferenceModel
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {}
    for mode in ("with_no_sync", "every_micro_step"):
        torch.manual_seed(0)
        model = DDP(ReferenceModel(d_model=128, n_layers=2), broadcast_buffers=False, gradient_as_bucket_view=True)
        calls = [0]

        def hook(pg, bucket):
            calls[0] += 1
            return default_hooks.allreduce_hook(pg, bucket)

        model.register_comm_hook(None, hook)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(rank)
        batch = {"codes": torch.randint(0, 1024, (2, 8, 50), generator=g),
                 "input_ids": torch.randint(3, 259, (2, 20), generator=g),
                 "latents": torch.randn(2, 16, 1, 8, 8, generator=g), "has_image": torch.ones(2, dtype=torch.bool)}
        times = []
        for step in range(steps + 1):
            t = time.perf_counter()
            for micro in range(accum):
                last = micro == accum - 1
                ctx = model.no_sync() if (mode == "with_no_sync" and not last) else contextlib.nullcontext()
                with ctx:
                    model(batch)["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step:  # the first step warms up (and DDP rebuilds its buckets after it)
                times.append(time.perf_counter() - t)
            else:
                calls[0] = 0
        result[mode] = {"allreduce_buckets_per_step": calls[0] / steps,
                        "step_s": round(statistics.median(times), 4)}
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def bench(accum: int = 4, steps: int = 5) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "ddp.json"
        mp.start_processes(_worker, args=(2, _free_port(), accum, steps, str(out)), nprocs=2,
                           start_method="spawn", join=True)
        result = json.loads(out.read_text())
    result["accum"] = accum
    result["allreduce_ratio"] = round(result["every_micro_step"]["allreduce_buckets_per_step"]
                                      / result["with_no_sync"]["allreduce_buckets_per_step"], 2)
    return result


if __name__ == "__main__":
    print(json.dumps(bench(), indent=2))
