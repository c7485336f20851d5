"""The ``shardcache`` command: one entry point for both stages and the cache tools.

::

    shardcache precompute --manifest train.json --cache /data/cache --config configs/precompute-tts.yaml
    shardcache add-field CACHE --field codes_mimi --audio_tokenizer mimi
    shardcache drop-field CACHE codes_mimi
    shardcache check /data/cache --manifest train.json --samples 16
    torchrun --nproc_per_node=8 -m shardcache train --cache /data/cache --run_dir runs/exp1
    shardcache find-batch-size --cache /data/cache --config configs/train.yaml
    shardcache shards info /data/cache

The one console script (``shardcache``; ``python -m shardcache`` and ``torchrun -m shardcache`` run
the same). Each subcommand's module is imported only when it runs, so ``shardcache --help`` is fast.
The packages have no ``__main__`` of their own: ``python -m train`` from a directory holding a
``train.py`` of one's own would run that file instead.
"""
from __future__ import annotations

import importlib
import sys

#: subcommand -> (module:function taking argv and returning an exit status, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "precompute": ("precompute.cli:main", "stage one: encode a manifest into a cache (codes, latents, token ids)"),
    "add-field": ("precompute.add_field:main_add", "encode a new field of an existing cache into sidecar tars"),
    "drop-field": ("precompute.add_field:main_drop", "remove a field added with add-field"),
    "check": ("shardcache.commands.check:main", "re-derive random samples from the sources and compare them with the cache"),
    "train": ("train.cli:main", "stage two: train from a cache (torchrun -m shardcache train ... for DDP)"),
    "find-batch-size": ("train.batch_size:main", "time training steps at batch sizes 1, 2, 4... and recommend one"),
    "shards": ("shards.cli:main", "inspect, query, verify and repair a cache (info, show, verify, reindex...)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: shardcache [--version] COMMAND [options]   (shardcache COMMAND --help for its options)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "Exit status: 0 done, 1 the work failed, 2 bad options (named on stderr); train also",
              "exits with its --job.requeue_exit_code (default 3) after a stop request."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to the subcommand's own ``main``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from shards.cli import version
        sys.stdout.write(version() + "\n")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"shardcache: error: unknown command {name!r}\n\n" + usage())
        return 2
    module, _, func = COMMANDS[name][0].partition(":")
    code = getattr(importlib.import_module(module), func)(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
