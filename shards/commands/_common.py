"""Helpers shared by the ``shards`` subcommands: output, errors, locating caches and shards."""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import stat
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ShardCorrupt
from ..storage import local_path
from ..index import INDEX_SCHEMA
from ..schema import INDEX_FILE, MANIFEST_FILE
from ..unfinished import unfinished

#: index columns a query or a table may show (``members`` is a nested list: not shown)
SCALAR_COLUMNS = tuple(n for n in INDEX_SCHEMA.names if n != "members")


#: tables longer than this are printed as plain text even on a terminal (rich takes ~1 s per 1000 rows)
RICH_MAX_ROWS = 2000


class UsageError(Exception):
    """Bad arguments or a path that is not what the command needs: exit code 2."""


class NotFound(Exception):
    """A lookup (a sample key) found nothing: exit code 1."""


# --------------------------------------------------------------------------------------- output

def stdout_is_tty() -> bool:
    """Whether stdout is a terminal (tests monkeypatch this to exercise the rich output)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def stderr_is_tty() -> bool:
    """Whether stderr is a terminal (progress bars are drawn only then)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def to_jsonable(obj: Any) -> Any:
    """Convert numpy scalars/arrays, paths and tuples to JSON types; NaN and infinities -> None."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def fmt_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def fmt_value(v: Any) -> str:
    """A cell value as text: floats with 5 significant digits, None as ``-``."""
    if v is None:
        return "-"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not math.isfinite(v):
            return str(v)
        return f"{v:.5g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(fmt_value(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return str(v)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


class Out:
    """Writes a command's result as a rich table (stdout is a terminal), plain text, or JSON."""

    def __init__(self, args: Any):
        self.json = bool(getattr(args, "json", False))
        self.rich = not self.json and stdout_is_tty()
        self._console = None

    @property
    def console(self):
        if self._console is None:
            from rich.console import Console
            self._console = Console(file=sys.stdout, highlight=False)
        return self._console

    def emit_json(self, obj: Any) -> None:
        sys.stdout.write(json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False) + "\n")

    def line(self, text: str = "", style: str | None = None) -> None:
        """One line of text (``style`` is a rich style, ignored in plain text)."""
        if self.rich:
            from rich.text import Text
            self.console.print(Text(text, style=style or ""))
        else:
            sys.stdout.write(text + "\n")

    def heading(self, text: str) -> None:
        if self.rich:
            self.console.rule(f"[bold]{_escape(text)}")
        else:
            sys.stdout.write(f"== {text} ==\n")

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None,
              caption: str | None = None) -> None:
        """A table; numeric columns are right-aligned. ``title`` and ``caption`` are one-liners."""
        rows = [list(r) for r in rows]
        numeric = [bool(rows) and all(_is_number(r[j]) or r[j] is None for r in rows)
                   for j in range(len(columns))]
        cells = [[fmt_value(v) for v in r] for r in rows]
        if self.rich and len(cells) <= RICH_MAX_ROWS:
            from rich.table import Table
            from rich.text import Text
            t = Table()
            for j, c in enumerate(columns):
                t.add_column(c, justify="right" if numeric[j] else "left", overflow="fold")
            for r in cells:
                t.add_row(*(_escape(c) for c in r))
            if title:  # printed outside the table: a table title wraps at the table's width
                self.console.print(Text(title, style="bold"))
            self.console.print(t)
            if caption:
                self.console.print(Text(caption, style="dim"))
            return
        out = sys.stdout
        if title:
            out.write(title + "\n")
        widths = [max([len(c)] + [len(r[j]) for r in cells]) for j, c in enumerate(columns)]

        def fmt_row(values: Sequence[str]) -> str:
            parts = []
            for j, v in enumerate(values):
                last = j == len(values) - 1
                if numeric[j]:
                    parts.append(v.rjust(widths[j]))
                else:
                    parts.append(v if last else v.ljust(widths[j]))
            return "  ".join(parts).rstrip()

        out.write(fmt_row(list(columns)) + "\n")
        out.writelines(fmt_row(r) + "\n" for r in cells)
        if caption:
            out.write(caption + "\n")

    def kv(self, pairs: Sequence[tuple[str, Any]], title: str | None = None) -> None:
        """``name: value`` lines (a two-column grid on a terminal)."""
        if self.rich:
            from rich.table import Table
            t = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
            t.add_column(style="bold")
            t.add_column(overflow="fold")
            for k, v in pairs:
                t.add_row(_escape(k), _escape(v if isinstance(v, str) else fmt_value(v)))
            self.console.print(t)
            return
        if title:
            sys.stdout.write(title + "\n")
        width = max((len(k) for k, _ in pairs), default=0)
        for k, v in pairs:
            sys.stdout.write(f"{(k + ':').ljust(width + 1)} {v if isinstance(v, str) else fmt_value(v)}\n")

    def json_block(self, obj: Any) -> None:
        """Pretty JSON inside human output (syntax-highlighted on a terminal)."""
        text = json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False, sort_keys=True)
        if self.rich:
            from rich.json import JSON
            self.console.print(JSON(text))
        else:
            sys.stdout.write(text + "\n")


def _escape(text: str) -> str:
    from rich.markup import escape
    return escape(str(text))


def warn(message: str) -> None:
    """A warning on stderr (does not change the exit code)."""
    sys.stderr.write(f"shards: warning: {message}\n")


@contextmanager
def progress(total: int, label: str, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """Yield ``advance(name)``; draws a rich progress bar on stderr when it is a terminal."""
    if not enabled or total <= 1 or not stderr_is_tty():
        yield lambda name: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(label, total=total)

        def advance(name: str) -> None:
            bar.update(task, advance=1, description=f"{label} {name}")

        yield advance
        bar.update(task, description=label)


# ------------------------------------------------------------------------------- caches, shards

def cache_dir(arg: str | Path) -> Path:
    """Check that ``arg`` (a path or a ``file://`` URL) is a cache directory (holds index.parquet or
    manifest.json)."""
    try:
        p = local_path(arg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not p.exists():
        raise UsageError(f"{p}: no such directory")
    if not p.is_dir():
        raise UsageError(f"{p}: not a directory (expected a cache directory holding {INDEX_FILE} "
                         f"and {MANIFEST_FILE})")
    if (why := unfinished(p)) is not None:  # a stage-one job that stopped: the rerun completes it, not reindex
        raise UsageError(why)
    if not (p / INDEX_FILE).exists() and not (p / MANIFEST_FILE).exists():
        raise UsageError(f"{p}: not a shardcache cache (no {INDEX_FILE} or {MANIFEST_FILE}); "
                         f"if it holds shard tars, `shardcache shards reindex {p}` rebuilds them")
    check_version(p)
    return p


def readable(arg: str | Path) -> Path:
    """:func:`cache_dir`, then the integrity root checked before the index is read (what every reader of a
    cache does first: :func:`shards.index.verify_root`; ``index.parquet`` or ``manifest.json`` changed
    since the cache was written, or a cache being written right now, is :class:`~shards.errors.ShardCorrupt`
    naming the file and the fix, exit 1). A folder without an index (an unfinished first job) is left to
    the command."""
    from ..index import verify_root
    d = cache_dir(arg)
    if (d / INDEX_FILE).exists():
        verify_root(d)
    return d


def check_version(d: Path) -> None:
    """Raise :class:`~shards.errors.UnsupportedFormat` if ``d/manifest.json`` declares a format
    this code does not know. A missing or malformed manifest passes here (the commands that read
    the manifest report it)."""
    from ..manifest import read_manifest
    try:
        read_manifest(d)
    except (ShardCorrupt, OSError):  # UnsupportedFormat is not a ShardCorrupt: it propagates
        return


def shard_path(d: Path, name) -> Path:
    """``d / name`` for a shard name read from the index or manifest, through the one safety gate
    :func:`shards.index.safe_shard_path` (:class:`~shards.errors.UnsafePath` otherwise)."""
    from ..index import safe_shard_path
    return safe_shard_path(d, name)


def index_path(d: Path) -> Path:
    p = Path(d) / INDEX_FILE
    if not p.exists():
        raise UsageError(f"{p} not found; `shardcache shards reindex {d}` rebuilds it from the shard tars")
    return p


def read_index_columns(d: Path, columns: Sequence[str] | None = None, filter=None) -> pa.Table:
    """Read some columns of ``d/index.parquet`` (optionally filtered, with predicate pushdown)."""
    p = index_path(d)
    try:
        return pq.read_table(p, columns=list(columns) if columns is not None else None,
                             filters=filter, schema=INDEX_SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        raise ShardCorrupt(f"{p}: cannot read the index ({e}); `shardcache shards reindex {d}` rebuilds it") from e


def read_index_head(d: Path, n: int) -> pa.Table:
    """The first ``n`` rows of the index, reading only the row groups needed."""
    p = index_path(d)
    try:
        pf = pq.ParquetFile(p)
        batches = []
        got = 0
        for b in pf.iter_batches(batch_size=max(1, min(n, 65536))):
            batches.append(b)
            got += b.num_rows
            if got >= n:
                break
    except (pa.ArrowInvalid, OSError) as e:
        raise ShardCorrupt(f"{p}: cannot read the index ({e}); `shardcache shards reindex {d}` rebuilds it") from e
    table = pa.Table.from_batches(batches, schema=pf.schema_arrow) if batches else INDEX_SCHEMA.empty_table()
    return table.slice(0, n).cast(INDEX_SCHEMA)


def expand_targets(args: Sequence[str]) -> tuple[Path | None, list[Path]]:
    """``ls``/``verify`` arguments: ``(cache_dir, [])`` for one directory, else ``(None, tars)``.

    Shell-style globs are expanded here too (for quoted patterns and shells that do not);
    ``file://`` URLs are local paths.
    """
    try:
        args = [str(local_path(a)) for a in args]
    except ValueError as e:
        raise UsageError(str(e)) from None
    if len(args) == 1 and Path(args[0]).is_dir():
        return cache_dir(args[0]), []
    tars: list[Path] = []
    for a in args:
        if glob.has_magic(a) and not Path(a).exists():
            hits = sorted(glob.glob(a))
            if not hits:
                raise UsageError(f"{a}: no files match this pattern")
            tars.extend(Path(h) for h in hits)
        else:
            tars.append(Path(a))
    dirs = [t for t in tars if t.is_dir()]
    if dirs:
        raise UsageError(f"{dirs[0]}: is a directory; give either one cache directory or shard "
                         "tar paths (a list or a glob), not both")
    if not tars:
        raise UsageError("no shard paths given")
    seen: set[Path] = set()
    unique = []
    for t in tars:
        r = t.resolve()
        if r not in seen:
            seen.add(r)
            unique.append(t)
    return None, unique


def manifest_shards(manifest: dict, d: Path | None = None) -> list[dict]:
    """The manifest's shard entries, checked to have a ``path``; with ``d`` (the cache) each path
    is also checked by :func:`shard_path` (:class:`~shards.errors.UnsafePath`)."""
    shards = manifest.get("shards") or []
    if not isinstance(shards, list):
        raise ShardCorrupt(f"{MANIFEST_FILE}: \"shards\" is not a list")
    bad = [s for s in shards if not isinstance(s, dict) or "path" not in s]
    if bad:
        raise ShardCorrupt(f"{MANIFEST_FILE}: malformed shard entry {bad[0]!r}")
    if d is not None:
        for s in shards:
            shard_path(d, s["path"])
    return shards


def load_manifest(d: Path) -> dict:
    """``d/manifest.json`` as a dict (empty when absent); a malformed file is :class:`ShardCorrupt`,
    a format version this code does not know :class:`~shards.errors.UnsupportedFormat`."""
    from ..manifest import read_manifest
    return read_manifest(d)


def add_jobs_option(p: argparse.ArgumentParser, what: str) -> None:
    """``-j/--jobs N``: ``what`` run in parallel; default ``min(4, CPU cores)`` (I/O- and hash-bound
    work: more threads than that only contend for the disk)."""
    p.add_argument("-j", "--jobs", type=int, default=min(4, os.cpu_count() or 1), metavar="N",
                   help=f"{what} in parallel (default: %(default)s)")


# ------------------------------------------------------------------------------ output files
#
# A command that writes a file the user names (export-audio's WAV, stats --plot's PNG, export-lhotse's
# folder) never writes a file of a cache: only a CacheWriter session does (shards.writing). The check is
# made on what is opened, not on the path: the output's folder is opened and each of its ancestors is
# compared by (st_dev, st_ino) with the cache folder (a symlinked or bind-mounted folder is still the
# folder), and the output file is opened without truncating and compared with every file of the cache (a
# hard link is still the file). Only then is it truncated and written, through that descriptor.

def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def cache_files(cache: Path) -> dict[tuple[int, int], str]:
    """``{(st_dev, st_ino): name}`` of the cache folder itself and of every file in it and in its
    ``parts/`` (not following symlinks: a link is no file of the cache, its target may be)."""
    from ..schema import PARTS_DIR
    out = {_identity(os.stat(cache)): f"the cache folder {cache}"}
    for folder in (cache, cache / PARTS_DIR):
        try:
            names = os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for n in names:
            try:
                st = os.stat(folder / n, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not os.path.islink(folder / n):
                out[_identity(st)] = str(folder / n)
    return out


def _refuse_inside(dir_fd: int, shown: Path, cache: Path) -> None:
    """Raise :class:`UsageError` when the folder open as ``dir_fd`` is ``cache`` or lies inside it, or
    is any shardcache cache (its marker, or an index beside a manifest), walking up with ``..``."""
    from ..writing import MARKER
    fd = os.dup(dir_fd)
    try:
        while True:
            st = os.fstat(fd)
            if _identity(st) == _identity(os.stat(cache)):
                raise UsageError(f"{shown}: inside the cache folder {cache}; only the cache's writer changes "
                                 "its files: write the output outside any cache")
            if _exists(fd, MARKER) or (_exists(fd, INDEX_FILE) and _exists(fd, MANIFEST_FILE)):
                raise UsageError(f"{shown}: inside a shardcache cache folder; write the output outside any cache")
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            if _identity(os.fstat(up)) == _identity(st):  # the root
                os.close(up)
                return
            os.close(fd)
            fd = up
    finally:
        os.close(fd)


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except OSError:
        return False


def open_output(path: str | os.PathLike, cache: str | os.PathLike):
    """``path`` opened for writing (binary, truncated), after refusing (:class:`UsageError`, exit 2)
    anything that would change cache folder ``cache`` (see the comment above): a folder that is the
    cache or inside it (or inside any cache), a symlink as the file itself (``O_NOFOLLOW``), something
    not a regular file (a FIFO is opened non-blocking: never hangs), or a file that is one of the
    cache's (same ``st_dev``/``st_ino``: a hard link). Nothing is truncated or written before that; a
    file this call created is removed again when refused."""
    path, cache = Path(path), Path(cache)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UsageError(f"{parent}: no such directory") from None
    except NotADirectoryError:
        raise UsageError(f"{parent}: not a directory") from None
    try:
        known = cache_files(cache)
        _refuse_inside(dfd, path, cache)
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        created = False
        try:
            fd = os.open(path.name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
            created = True
        except FileExistsError:
            try:
                fd = os.open(path.name, flags, dir_fd=dfd)
            except OSError as e:
                import errno
                if e.errno == errno.ELOOP:
                    raise UsageError(f"{path}: a symlink ({os.readlink(path)}); refusing to write through it: "
                                     "name a plain file") from None
                if e.errno == errno.ENXIO:
                    raise UsageError(f"{path}: a FIFO with no reader; name a plain file") from None
                raise UsageError(f"{path}: cannot open it for writing ({e.strerror or e})") from None
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "not a regular file"
        elif _identity(st) in known:
            problem = (f"the same file as {known[_identity(st)]} (a hard link into the cache); only the cache's "
                       "writer changes its files")
        if problem is not None:
            os.close(fd)
            if created:
                os.unlink(path.name, dir_fd=dfd)
            raise UsageError(f"{path}: {problem}; write the output elsewhere")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        return os.fdopen(fd, "wb")
    finally:
        os.close(dfd)


def output_folder(path: str | os.PathLike, cache: str | os.PathLike) -> int:
    """A descriptor of output folder ``path`` (made, with its parents, when missing), after refusing
    (:class:`UsageError`) a folder that is cache ``cache`` or inside it (or inside any cache), by the
    opened folder's identity and its ancestors'. A folder this call made is removed again when
    refused. The caller closes the descriptor; writing through ``/proc/self/fd/N/NAME`` keeps every
    file inside the folder that was checked, whatever is renamed meanwhile."""
    path, cache = Path(path), Path(cache)
    made = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise UsageError(f"{path}: cannot make or open this folder ({e.strerror or e})") from None
    try:
        _refuse_inside(fd, path, cache)
    except UsageError:
        os.close(fd)
        if made:
            try:
                path.rmdir()
            except OSError:
                pass
        raise
    return fd
