"""``shardcache shards``: inspect, query, verify and repair a shardcache cache directory.

Run ``shardcache shards --help`` or ``shardcache shards COMMAND --help``. Every command takes
``--json`` for scripts; on a terminal results are rich tables, otherwise plain text. Exit codes:
0 success, 1 a check failed / a sample was not found / the cache is corrupt, 2 usage error (bad
arguments, a path that is not a cache), 130 interrupted.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from .commands.needs import Needs
from .errors import ShardcacheError, WriteRefused

EPILOG = """\
examples:
  shardcache shards info cache/
  shardcache shards ls cache/
  shardcache shards ls 'cache/shard-00000*.tar'
  shardcache shards head cache/ -n 3
  shardcache shards show cache/ spk-us-0001
  shardcache shards query cache/ --where "duration_s > 5 and has_image" --count
  shardcache shards stats cache/ --plot stats.png
  shardcache shards view cache/                  (a web viewer on http://127.0.0.1:8000/)
  shardcache shards verify cache/ --deep
  shardcache shards export-audio cache/ spk-us-0001 out.wav
  shardcache shards export-lhotse cache/ shar/   (Lhotse Shar: audio, text, speaker, codes)
  shardcache shards rejects cache/ --reason unreadable_audio
  shardcache shards reindex cache/

exit codes: 0 ok, 1 check failed / not found / corrupt cache, 2 usage error or a library the
command needs is not installed (query, stats, export-audio, reindex: pip install "shardcache[inspect]";
the core install runs info, ls, head, show, verify and rejects).
"""


def version() -> str:
    """``shardcache VERSION (cache format N)``: the installed distribution's version ("unknown" when
    running from a checkout that is not installed) and the cache format this code writes."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    from .schema import FORMAT_VERSION
    try:
        v = dist_version("shardcache")
    except PackageNotFoundError:
        v = "unknown"
    return f"shardcache {v} (cache format {FORMAT_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    from .commands import MODULES
    parser = argparse.ArgumentParser(
        prog="shardcache shards",
        description="Inspect, query, verify and repair a shardcache cache directory "
                    "(manifest.json, index.parquet, rejects.parquet, shard-*.tar).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version())
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON (also accepted after the command)")
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a subcommand without --json must not reset `shards --json COMMAND`
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print the result as JSON (for scripts) instead of a table")
    parser.set_defaults(needs=Needs())  # what a command needs beyond the core (commands.needs)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for module in MODULES:
        module.register(sub, common)
    return parser


def _error(command: str | None, message: str) -> None:
    prefix = f"shardcache shards {command}" if command else "shardcache shards"
    sys.stderr.write(f"{prefix}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:  # --help, --version, or a usage error (argparse exits with 2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    from .commands._common import NotFound, UsageError
    from .commands.needs import MissingModule, from_import_error, require
    try:
        require(args.needs)
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except (UsageError, MissingModule) as e:
        _error(args.command, str(e))
        return 2
    except ModuleNotFoundError as e:  # a library missing on a path the declaration did not name
        _error(args.command, str(from_import_error(e, args.needs)))
        return 2
    except NotFound as e:
        _error(args.command, str(e))
        return 1
    except FileNotFoundError as e:
        _error(args.command, str(e) if e.filename is None else f"{e.filename}: {e.strerror}")
        return 2
    except WriteRefused as e:  # another command writes the cache (named), or the folder is no cache
        _error(args.command, str(e))
        return 2
    except ShardcacheError as e:
        _error(args.command, str(e))
        return 1
    except BrokenPipeError:  # `shardcache shards query ... | head` closed the pipe: not an error message
        _silence_stdout()
        return 141
    except OSError as e:
        _error(args.command, str(e) if e.filename is None else f"{e.filename}: {e.strerror}")
        return 1
    except KeyboardInterrupt:
        _error(args.command, "interrupted")
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
