"""``python -m train`` / ``torchrun --nproc_per_node=N -m train`` / ``shardcache-train``.

Exit status: 0 when the run reached ``--steps``; ``--requeue-exit-code`` (default 3) after a stop
request (SIGUSR1/SIGTERM, the stop file or ``--stop-at-step``), with a checkpoint saved at the step
every rank agreed on; 1 when any rank failed (the failing rank exits at once; see
:func:`train.dist.abort_on_exception`); 2 for bad options.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .config import parse_args

    try:
        cfg, ns = parse_args(argv)
    except ValueError as e:
        sys.stderr.write(f"python -m train: error: {e}\n")
        return 2
    if ns.print_config:
        sys.stdout.write(cfg.dump())
        return 0
    from . import dist as D  # torch is imported only now: --help and --print-config stay fast
    from .loop import run

    try:
        return run(cfg)
    except BaseException as e:  # noqa: BLE001 - every failure must end this rank now
        if isinstance(e, SystemExit) and not D.env_ranks()[2] > 1:
            raise
        D.abort_on_exception(None, e)
        raise  # unreachable: abort_on_exception exits


if __name__ == "__main__":
    sys.exit(main())
