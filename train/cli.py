"""``shardcache train`` / ``torchrun --nproc_per_node=N -m shardcache train``.

Exit status: 0 when the run reached its steps; ``--job.requeue_exit_code`` (default 3) after a stop
request (SIGUSR1/SIGTERM, the stop file or ``--job.stop_at_step``), with a checkpoint saved at the
step every rank agreed on; 1 when any rank failed (the failing rank exits at once; see
:func:`train.dist.abort_on_exception`), including a run stopped by ``training.nonfinite_limit``;
2 for bad options (each named) and for a cache that does not fit the model (``cache.require``: one
line naming the item, the cache's value and the model's value; nothing was loaded).
"""
from __future__ import annotations

import argparse
import sys

from shardcache import config as S
from shardcache.config import ConfigError
from shardcache.helptext import short_help

from .config import CONFIG_ENV, TrainConfig, check_config
from .recipes.higgs_argv import translate

PROG = "shardcache train"
#: the short flags of the two paths every run names -> the option each sets
SHORT_FLAGS = {"--cache": "data.cache", "--run_dir": "job.dir"}
#: the options ``shardcache train --help`` shows (``--help_all``: every option)
COMMON = ("data.cache", "job.dir", "model.name", "model.kwargs", "data.batch_size", "data.fields", "optim.lr",
          "training.steps", "training.epochs", "training.precision", "lora.enabled", "checkpoint.every",
          "checkpoint.resume", "eval.every", "metrics.every")


def build_parser(prog: str = PROG, description: str | None = None) -> argparse.ArgumentParser:
    """``--config``, ``--print_config`` and one flag per option (callers may add their own)."""
    p = S.parser(TrainConfig, prog, description if description is not None else (
        "Train from a shardcache cache (stage two).\n\n"
        "  shardcache train --cache cache/demo --run_dir runs/demo --training.steps 50\n"
        "  torchrun --nproc_per_node=2 -m shardcache train --config configs/train.yaml --cache cache/demo\n\n"
        "Options: the defaults below, then the config file (--config FILE; else $SHARDCACHE_TRAIN_CONFIG;\n"
        "else none), then flags in their order. --cache DIR is --data.cache, --run_dir DIR is --job.dir. Exit status:\n"
        "0 done; --job.requeue_exit_code (default 3) after a stop request; 1 on an error on any rank; 2 for\n"
        "bad options (each named)."), aliases=SHORT_FLAGS)
    p.add_argument("--dry_run", action="store_true", help="check the options, the cache, the run directory and the "
                   "model's contract against the cache, then exit: no weight loads, no process group (e.g. before sbatch).")
    p.add_argument("--help_all", action="store_true", help="every option (--help shows the common ones).")
    return p


def help_text(everything: bool = False) -> str:
    """``--help`` (the common options) or ``--help_all`` (every option)."""
    return build_parser().format_help() if everything else short_help(build_parser(), COMMON, (
        "Check without training: --dry_run. Print the config: --print_config. Every option: --help_all."))


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    """Command line (the Higgs-Audio spellings translated first) -> (validated config, namespace
    with the parser's other flags, ``config_file`` and ``config_source``). Raises :class:`ConfigError`;
    ``--print_config`` prints the config and exits (``SystemExit(0)``, jsonargparse's)."""
    argv = translate(sys.argv[1:] if argv is None else list(argv))
    return S.parse(parser or build_parser(), TrainConfig, argv, CONFIG_ENV, check=check_config)


def main(argv: list[str] | None = None, callbacks=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run; ``callbacks`` (a
    :class:`train.trainer.Callbacks`) are for tests and extensions that launch through this entry
    point (e.g. fault injection under torchrun)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--help_all" in argv or "-h" in argv or "--help" in argv:
        sys.stdout.write(help_text(everything="--help_all" in argv))
        return 0
    try:
        cfg, ns = parse_args(argv)  # --print_config prints and exits here (jsonargparse)
        from .bounds import problems  # the options that reach the loader and model constructors
        if bad := problems(cfg):
            raise ConfigError(bad)
    except ConfigError as e:
        return e.report(PROG)
    from . import preflight
    try:
        preflight.check(cfg)  # cache and run directory, before anything is loaded
    except ConfigError as e:
        return e.report(PROG)
    from shardcache.weights import CheckpointUnreadable
    from shards.errors import ContractMismatch

    from .models import ContractUnknown

    if ns.dry_run:
        return dry_run(cfg)
    from shardcache.quiet import quiet_libraries
    from shardcache.ranks import Ranks

    quiet_libraries()  # library messages the user cannot act on (shardcache/quiet.py)
    from . import dist as D  # torch is imported only now: --help and --print_config stay fast
    from .metrics import NonFiniteError
    from .trainer import run

    ranks = Ranks.detect()  # checked by bounds.problems: a partial launcher environment exits 2 above
    if ranks.is_main:
        sys.stderr.write(f"{PROG}: config file: {ns.config_file or 'none'} ({ns.config_source})\n")
    try:
        return run(cfg, callbacks)
    except (ContractMismatch, CheckpointUnreadable, ContractUnknown) as e:  # the cache does not fit the model,
        # a checkpoint file its identity is read from cannot be read, or tells no contract: before any weight loaded
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    except NonFiniteError as e:  # every rank sees the same counters and stops at the same step
        sys.stderr.write(f"[rank {ranks.global_rank}] {PROG}: error: {e}\n")
        sys.stderr.flush()
        if ranks.distributed:
            D.abort_on_exception(None, e)
        return 1
    except BaseException as e:  # noqa: BLE001 - every failure must end this rank now
        if isinstance(e, SystemExit) and not ranks.distributed:
            raise
        D.abort_on_exception(None, e)
        raise  # unreachable: abort_on_exception exits


def dry_run(cfg) -> int:
    """``--dry_run``: open the cache and check the model's contract against it and a ``model.init_from``
    adapter against the run's LoRA options (what a run checks before any weight loads:
    :func:`train.trainer.check_model`), in this process only; 0 when it fits, else 2 with the one-line
    reason."""
    from shards.cache import Cache
    from shards.errors import ContractMismatch, ShardcacheError

    from .trainer import check_model
    try:
        cache = Cache.open(cfg.data.cache)
        waived = check_model(cfg, cache)
    except (ContractMismatch, ShardcacheError, ImportError, OSError, ValueError) as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    for item, have, want in waived:
        sys.stdout.write(f"{PROG}: dry run: --model.allow_other_encoder_weights: {item}: the cache has {have!r}, the "
                         f"model {want!r}\n")
    sys.stdout.write(f"{PROG}: dry run: the options, the run directory {cfg.job.dir} and the cache {cfg.data.cache} "
                     f"(id {cache.id}, {len(cache)} samples) fit --model.name {cfg.model.name}; nothing was loaded\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
