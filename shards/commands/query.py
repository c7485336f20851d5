"""``shards query``: the index rows matching a SQL ``WHERE`` condition, evaluated by DuckDB.

The index's scalar columns are read with pyarrow and handed to an in-memory DuckDB connection whose
configuration is locked with external access disabled: the condition can read nothing but those
columns (no file, no URL, no ``ATTACH``, no setting can be changed back). The condition is parsed
as ONE SQL expression (``duckdb.SQLExpression``): a second statement (``; DROP ...``) is refused.
A cache another command is writing right now is refused (exit 2, naming the writer), as ``view``
and ``verify`` refuse it. :func:`matching_rows` takes a deadline and a cancel event (the viewer's
filter: stopped with DuckDB's ``interrupt``). Columns are those of ``index.parquet``
(:data:`shards.commands._common.SCALAR_COLUMNS`)::

    shards query CACHE --where "duration_s > 3 AND speaker = 'alice'"
    shards query CACHE --where "has_image AND n_text_tokens BETWEEN 10 AND 200" --count
    shards query CACHE --where "speaker IN ('alice', 'bob') OR key LIKE 'clone-%'" --sort duration_s --desc
"""
from __future__ import annotations

import argparse
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..index import INDEX_SCHEMA
from ._common import SCALAR_COLUMNS, Out, UsageError, read_index_columns, readable
from .needs import DUCKDB

DEFAULT_COLUMNS = ("key", "shard", "duration_s", "n_frames", "has_image", "speaker")
MAX_QUERY_CHARS = 4000
#: how often a running condition looks at its deadline and its client (seconds)
WATCH_S = 0.05
#: seconds a condition of the viewer's filter may run (``shards view --query_timeout``)
VIEWER_DEADLINE_S = 5.0


class QueryTimeout(UsageError):
    """A condition ran past its deadline and was stopped (DuckDB's interrupt): exit 2, and a 400 page
    of the viewer naming the deadline."""


class QueryCancelled(Exception):
    """A condition stopped because the request that asked for it went away (the viewer's client
    closed its connection): nobody is told, the work just ends."""


def refuse_while_written(d: str | Path, what: str) -> None:
    """Raise :class:`~shards.lock.CacheLocked` (exit 2) naming the writer when another command writes
    cache ``d`` now (also a first write, before its index exists): its index and shards are
    half-written, so ``what`` (a query, a page) would show neither the old cache nor the new one."""
    from ..lock import CacheLocked, describe, holder
    h = holder(d)
    if h:
        raise CacheLocked(f"{d} is being written right now by {describe(h)}: {what}; try again once that "
                          "command has ended", h)


def matching_rows(table: pa.Table, where: str, *, deadline_s: float | None = None,
                  cancelled: threading.Event | None = None) -> pa.Array:
    """The positions (int64, ascending) of the rows of ``table`` (index columns) for which the SQL
    condition ``where`` holds, evaluated by DuckDB (see the module docstring).

    ``deadline_s``: seconds the condition may run; past it DuckDB's ``interrupt()`` stops it and
    :class:`QueryTimeout` is raised. ``cancelled``: when this event is set (the client went away)
    the condition is stopped the same way and :class:`QueryCancelled` raised. Either is looked at
    every :data:`WATCH_S` seconds by a watcher thread, so a condition that would scan for hours
    frees its cores within that time.

    Raises :class:`UsageError` naming the problem (not one expression, unknown column, wrong types:
    DuckDB's own message, which suggests column names) and for a condition over
    :data:`MAX_QUERY_CHARS` characters.
    """
    import duckdb

    if len(where) > MAX_QUERY_CHARS:
        raise UsageError(f"--where: the condition has {len(where)} characters; at most {MAX_QUERY_CHARS}")
    con = duckdb.connect(":memory:")
    stopped: list[str] = []
    done = threading.Event()

    def watch() -> None:
        end = None if deadline_s is None else time.monotonic() + deadline_s
        while not done.wait(WATCH_S):
            if cancelled is not None and cancelled.is_set():
                stopped.append("cancelled")
            elif end is not None and time.monotonic() >= end:
                stopped.append("timeout")
            else:
                continue
            con.interrupt()
            return

    watcher = None
    if deadline_s is not None or cancelled is not None:
        watcher = threading.Thread(target=watch, name="shardcache-query-deadline", daemon=True)
    try:
        con.execute("SET enable_external_access = false")  # no files, URLs or extensions from the SQL
        con.execute("SET lock_configuration = true")       # ... and no way to switch it back
        rel = con.from_arrow(table.append_column("__row", pa.array(np.arange(table.num_rows, dtype=np.int64))))
        if watcher is not None:
            watcher.start()
        try:
            expr = duckdb.SQLExpression(where)
            rows = rel.filter(expr).project("__row").order("__row").arrow()
            if isinstance(rows, pa.RecordBatchReader):
                rows = rows.read_all()
        except duckdb.Error as e:
            if stopped == ["cancelled"]:
                raise QueryCancelled(where) from None
            if stopped == ["timeout"]:
                raise QueryTimeout(f"--where {where!r}: stopped after {deadline_s:g} s (the deadline of a "
                                   "condition); narrow it, or allow more time") from None
            raise UsageError(f"--where {where!r}: {str(e).strip()}") from None
    finally:
        done.set()
        if watcher is not None and watcher.is_alive():
            watcher.join()
        con.close()
    return rows.column("__row").combine_chunks()


def select(d: Path, where: str | None, columns: list[str] | None = None) -> pa.Table:
    """The index rows of cache ``d`` (scalar ``columns``, default all) for which the SQL condition
    ``where`` is true (every row when None), in index order (:func:`matching_rows`).

    Raises :class:`UsageError` as :func:`matching_rows` does.
    """
    table = read_index_columns(d, list(SCALAR_COLUMNS))
    if not where or not where.strip():
        return table.select(columns or list(SCALAR_COLUMNS))
    if len(where) > MAX_QUERY_CHARS:  # before DuckDB is imported
        raise UsageError(f"--where: the condition has {len(where)} characters; at most {MAX_QUERY_CHARS}")
    return table.take(matching_rows(table, where)).select(columns or list(SCALAR_COLUMNS))


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "query", parents=[common], help="index rows matching a SQL condition (DuckDB)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Print the index rows for which a SQL WHERE condition holds (evaluated by DuckDB over\n"
                    "index.parquet's columns; read-only, no file access).\n\n"
                    + textwrap.fill(", ".join(f"{c} ({INDEX_SCHEMA.field(c).type})" for c in SCALAR_COLUMNS),
                                    width=78, initial_indent="columns: ", subsequent_indent=" " * 9),
        epilog="examples:\n"
               "  shards query cache/ --where \"duration_s > 5 AND has_image\"\n"
               "  shards query cache/ --where \"speaker = 'alice' OR (n_frames >= 100 AND NOT has_image)\"\n"
               "  shards query cache/ --where \"sample_rate IN (16000, 24000)\" --count\n"
               "  shards query cache/ --where \"has_image\" --sort duration_s --desc --limit 10")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.add_argument("--where", metavar="SQL", default=None,
                   help="a SQL condition over the index columns (default: every row)")
    p.add_argument("--count", action="store_true", help="print only the number of matching rows")
    p.add_argument("--columns", metavar="COLS", default=",".join(DEFAULT_COLUMNS),
                   help="comma-separated columns to print (default: %(default)s)")
    p.add_argument("--sort", metavar="COL", help="sort the rows by this column")
    p.add_argument("--desc", action="store_true", help="with --sort: largest first")
    p.add_argument("--limit", type=int, metavar="N", help="print at most N rows")
    p.set_defaults(func=cmd_query, needs=DUCKDB)


def cmd_query(args: argparse.Namespace) -> int:
    out = Out(args)
    refuse_while_written(_local(args.dir), "not queried (its index is half-written)")
    d = readable(args.dir)
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    bad = [c for c in columns if c not in SCALAR_COLUMNS]
    if bad or not columns:
        raise UsageError(f"--columns: unknown column(s) {', '.join(bad) or '(none given)'}; "
                         f"columns: {', '.join(SCALAR_COLUMNS)}")
    if args.sort and args.sort not in SCALAR_COLUMNS:
        raise UsageError(f"--sort: unknown column {args.sort!r}; columns: {', '.join(SCALAR_COLUMNS)}")
    if args.limit is not None and args.limit < 0:
        raise UsageError("--limit must be >= 0")
    table = select(d, args.where)
    total = table.num_rows
    if args.count:
        if out.json:
            out.emit_json(dict(count=total))
        else:
            out.line(str(total))
        return 0
    if args.sort:
        table = table.sort_by([(args.sort, "descending" if args.desc else "ascending")])
    if args.limit is not None:
        table = table.slice(0, args.limit)
    table = table.select(columns)
    if out.json:
        out.emit_json(dict(count=total, rows=table.to_pylist()))
        return 0
    rows = zip(*(table.column(c).to_pylist() for c in columns)) if table.num_rows else []
    caption = f"{total} matching row(s)" + (f", showing {table.num_rows}" if table.num_rows < total else "")
    out.table(columns, rows, caption=caption if out.rich else None)
    return 0


def _local(arg: str) -> Path:
    from ..storage import local_path
    try:
        return local_path(arg)
    except ValueError as e:
        raise UsageError(str(e)) from None
