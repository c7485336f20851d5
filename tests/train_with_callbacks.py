"""The train entry point with test callbacks, for tests that launch ranks with torchrun or by hand.

    python tests/train_with_callbacks.py [--fail-at-step N --fail-rank R] [--record DIR] -- TRAIN ARGS...

``--fail-at-step N --fail-rank R``: global rank R raises after optimizer step N (fault injection
lives here, not in the trainer's config). ``--record DIR``: each rank writes ``DIR/rank{RANK}.json``
when the run returns: its ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, the keys it trained on per step
and the keys it validated on (from the batches its model received), and every file write it made
under the run directory (an audit hook), plus the exit code.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))




def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-at-step", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--record", default="")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ns = p.parse_args(argv[:split])
    train_argv = argv[split + 1:]

    from train.cli import main as train_main
    from train.cli import parse_args
    from test_train_support import write_audit
    from train.trainer import Callbacks

    rank = int(os.environ.get("RANK", 0))
    run_dir = os.path.realpath(parse_args(train_argv)[0].job.dir)
    rec: dict = {"env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")},
                 "train": {}, "eval": [], "writes": []}
    if ns.record:
        sys.addaudithook(write_audit(run_dir, rec["writes"]))
    state = {"step": 0}

    def on_setup(trainer):
        real = trainer.raw.forward

        def forward(batch):
            keys = list(batch.get("keys", []))
            if trainer.raw.training:
                rec["train"].setdefault(str(state["step"] + 1), []).extend(keys)
            else:
                rec["eval"].extend(keys)
            return real(batch)
        trainer.raw.forward = forward
        rec["loader_rank"] = getattr(trainer.loader, "global_rank", None)

    def on_step(step, record):
        state["step"] = step
        if step == ns.fail_at_step and rank == ns.fail_rank:
            raise RuntimeError(f"injected failure after step {step} on rank {rank}")

    code = train_main(train_argv, callbacks=Callbacks(on_setup=on_setup, on_step=on_step))
    rec["code"] = code
    if ns.record:
        Path(ns.record).mkdir(parents=True, exist_ok=True)
        Path(ns.record, f"rank{rank}.json").write_text(json.dumps(rec))
    return code


if __name__ == "__main__":
    sys.exit(main())
