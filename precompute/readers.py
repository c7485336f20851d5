"""A manifest file read as a stream of records: lines in the encoding the file says, JSON records one at a
time (JSON lines or one JSON list), CSV records in strict mode, Parquet rows a batch at a time.

Nothing here holds more than the record being read and one block of the file (:data:`BLOCK` characters):
a manifest of any number of rows is read in bounded memory, and read again (a second pass) the same way.
Every reader yields ``(record, None, None, text)`` for a row it could read, or ``(None, detail, hint,
text)`` for one it could not (``detail`` names the line or record, ``hint`` is what could be read of it,
for naming its reject); ``text`` is the row's serialised form as the file holds it (the JSON line, the
list record, the CSV record's lines, the Parquet row as sorted JSON), what the row's digest is computed
from (:mod:`precompute.plan`).

* **Encodings** (:class:`TextLines`): a byte-order mark says UTF-8, UTF-16 or UTF-32 (either byte order;
  dropped); without one the text is UTF-8, and a line that is not is read as Latin-1 (one warning names the
  lines; one bad byte does not change the text of every other row). A UTF-16/32 file without a BOM is
  refused naming the encoding (its NUL bytes would make every row unreadable), as is UTF-16/32 that does
  not decode. Lines end at ``\\n``, ``\\r`` and ``\\r\\n`` only, as the csv module and JSON lines count them.
* **JSON lists** (:func:`json_list`) are decoded record by record with ``json.JSONDecoder.raw_decode``
  over a sliding window of the text: a record that does not parse (nested too deeply, an integer past
  Python's limit, bad syntax) is that record's ``record N (line L)`` error, named by its key where one can
  be read, and the reader goes on at the next record; a list that is not closed refuses the file.
* **CSV/TSV** (:func:`csv_records`) go through the csv module in strict mode; a record that is not CSV,
  has more cells than the header, or spans lines of which one reads on its own as a whole row, is a reject
  naming its first line, and the reader reads again from the next line (it keeps the lines of the record
  being read, no more).

Raises :class:`ManifestUnreadable` (a ``ValueError``) for a file that cannot be read as a whole; the
command line exits 2 for it, before any model loads.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import os
import re
import unicodedata
from pathlib import Path
from typing import Any, Iterator

from shardcache.inputs import NotAFile, check_input, kind

log = logging.getLogger("precompute")

#: characters of text a reader holds at most besides the record being read (a JSON list's window)
BLOCK = 1 << 20
#: the largest CSV cell read (characters); a longer one makes its line a malformed_row
MAX_CSV_FIELD = 1 << 28
#: Parquet rows decoded at once
PARQUET_BATCH = 4096
#: byte-order marks, longest first (``FF FE 00 00`` is UTF-32-LE, not UTF-16-LE)
BOMS = ((b"\x00\x00\xfe\xff", "utf-32-be"), (b"\xff\xfe\x00\x00", "utf-32-le"), (b"\xef\xbb\xbf", "utf-8"),
        (b"\xfe\xff", "utf-16-be"), (b"\xff\xfe", "utf-16-le"))
#: U+FEFF, the byte-order mark: at the start of a file it says the encoding (dropped); anywhere else it is
#: an invisible character (files joined with their BOMs) that would become part of a key or a column name
BOM = "\ufeff"

Record = tuple[Any, "str | None", "dict | None", str]


class ManifestUnreadable(ValueError):
    """The manifest as a whole cannot be read (an encoding it cannot be decoded in, a JSON list that
    is not closed, a CSV header that is not CSV); the message names the file and what to do. The
    command line exits 2 for it, before any model loads."""


def nfc(text: str) -> str:
    """``text`` in Unicode NFC (ASCII text as it is)."""
    return text if text.isascii() else unicodedata.normalize("NFC", text)


def wide_without_bom(data: bytes) -> str | None:
    """The name of the UTF-16/32 encoding ``data`` (a file's first bytes) looks like when it has no BOM (at
    least a quarter of its first 4 KiB are NUL bytes, in the pattern of ASCII text in that encoding), else
    None. A few NULs in UTF-8 text are a row's problem, not the file's."""
    head = data[:4096]
    if len(head) < 4 or head.count(0) * 4 < len(head):
        return None
    z = [head[k::4].count(0) / max(1, len(head[k::4])) for k in range(4)]
    hi, lo = (lambda *ks: all(z[k] > 0.5 for k in ks)), (lambda *ks: all(z[k] < 0.5 for k in ks))
    if hi(1, 2, 3) and lo(0):
        return "UTF-32-LE"
    if hi(0, 1, 2) and lo(3):
        return "UTF-32-BE"
    if hi(1, 3) and lo(0, 2):
        return "UTF-16-LE"
    if hi(0, 2) and lo(1, 3):
        return "UTF-16-BE"
    return "UTF-16 or UTF-32"


def _open(path: Path):
    """The regular file ``path`` opened for reading (binary) through a descriptor opened ``O_NONBLOCK`` and
    checked with ``fstat`` (a FIFO or device is refused, never waited on: :func:`shardcache.inputs.check_input`)."""
    p = check_input(path, "manifest")
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    f = os.fdopen(fd, "rb")
    if (k := kind(os.fstat(fd).st_mode)) is not None:
        f.close()
        raise NotAFile("manifest", p, k)
    return f


#: where a physical line ends inside a chunk split at b"\n": a lone "\r" (not followed by "\n")
_LONE_CR = re.compile(rb"(?<=\r)(?!\n)")


class TextLines:
    """The lines (ends kept) of the manifest at ``path``, decoded as the module docstring says, read a
    line at a time. Iterating again reads the file again. ``warn``: log the Latin-1 lines once the file
    has been read (a second pass over the same file says nothing)."""

    def __init__(self, path: Path, warn: bool = True):
        self.path, self.warn = Path(path), warn

    def __iter__(self) -> Iterator[str]:
        with _open(self.path) as f:
            head = f.read(4096)
            for bom, codec in BOMS:
                if head.startswith(bom):
                    f.seek(len(bom))
                    if codec != "utf-8":
                        yield from self._wide(f, codec)
                        return
                    break
            else:
                f.seek(0)
                wide = wide_without_bom(head)
                if wide is not None:
                    raise ManifestUnreadable(f"manifest {self.path}: looks like {wide} without a byte-order mark "
                                             f"(NUL bytes between the characters); save it as UTF-8, or as {wide} "
                                             "with a BOM")
            yield from self._utf8(f)

    def _wide(self, f, codec: str) -> Iterator[str]:
        text = io.TextIOWrapper(f, encoding=codec, errors="surrogatepass", newline="")  # closes f with it
        try:  # a lone surrogate stays one: the row holding it is rejected, not the file
            yield from text
        except UnicodeDecodeError as e:
            raise ManifestUnreadable(f"manifest {self.path}: starts with a {codec.upper()} byte-order mark but "
                                     f"is not {codec.upper()} ({e}); save it as UTF-8") from None

    def _utf8(self, f) -> Iterator[str]:
        latin: list[int] = []
        n = 0
        for chunk in f:  # split at b"\n"; a lone "\r" ends a line too
            for line in (_LONE_CR.split(chunk) if b"\r" in chunk else (chunk,)):
                if not line:
                    continue
                n += 1
                try:
                    yield line.decode("utf-8")
                except UnicodeDecodeError:
                    latin.append(n)
                    yield line.decode("latin-1")
        if latin and self.warn:
            log.warning("%s: line(s) %s%s are not valid UTF-8; read as Latin-1", self.path,
                        ", ".join(map(str, latin[:10])), f" and {len(latin) - 10} more" if len(latin) > 10 else "")


def strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose member names are all different, also after Unicode NFC normalisation
    (``"caf\\u00e9"`` and ``"cafe\\u0301"`` look the same): ``json`` keeps the last of repeated names
    silently, so a row ``{"audio": "a.wav", "audio": "b.wav"}`` would be read as b.wav. Raises
    ``ValueError`` naming the name (the row becomes a ``malformed_row`` reject)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"repeated key {dup!r}: a JSON object may name a key once (which value was meant?)")
    if not "".join(obj).isascii():
        norm: dict[str, str] = {}
        for k in obj:
            other = norm.setdefault(nfc(k), k)
            if other != k:
                raise ValueError(f"keys {other!r} and {k!r} are the same after Unicode NFC normalisation: a JSON "
                                 "object may name a key once")
    return obj


DECODER = json.JSONDecoder(object_pairs_hook=strict_object)

#: a JSON string (escapes included) or one structural character: what the record scanner steps on
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]', re.S)
_JSON_WS = re.compile(r"[ \t\n\r]*")


def value_end(text: str, start: int, closers: str = ",]") -> int:
    """Index of the first character of ``closers`` at nesting depth 0 from ``start`` (strings
    skipped), or ``len(text)``: where a JSON value that does not parse ends."""
    depth = 0
    for m in _JSON_TOKEN.finditer(text, start):
        tok = m.group()
        if tok in "[{":
            depth += 1
        elif tok in "]}":
            if depth == 0 and tok in closers:
                return m.start()
            depth = max(0, depth - 1)
        elif tok in closers and depth == 0:
            return m.start()
    return len(text)


def _members(text: str) -> dict[str, str]:
    """The top-level members of the JSON object ``text`` as ``{name: value text}``, found without
    parsing the values (for naming a record that does not parse: its ``key``, ``id``, ``misc``)."""
    out: dict[str, str] = {}
    pos = _JSON_WS.match(text, 0).end()
    if not text.startswith("{", pos):
        return out
    pos += 1
    while pos < len(text):
        m = _JSON_TOKEN.match(text, _JSON_WS.match(text, pos).end())
        if m is None or not m.group().startswith('"'):
            return out
        colon = _JSON_WS.match(text, m.end()).end()
        if not text.startswith(":", colon):
            return out
        end = value_end(text, colon + 1, ",}")
        try:
            out[json.loads(m.group())] = text[colon + 1:end].strip()
        except ValueError:
            return out
        pos = end + 1
    return out


def record_hint(text: str) -> dict:
    """What can be read of a record that does not parse: its short top-level members (``key``,
    ``id``) and ``misc.key``, for naming its reject."""
    hint: dict[str, Any] = {}
    members = _members(text)
    for name in ("key", "id"):
        value = members.get(name, "")
        if value.startswith('"') and len(value) < 4096:
            try:
                hint[name] = json.loads(value)
            except ValueError:
                pass
    misc = members.get("misc", "")
    if misc.startswith("{"):
        hint["misc"] = {k: v for k, v in record_hint(misc).items() if k == "key"}
    return hint


class _Window:
    """The text of a file as a window over its lines: ``buf`` holds the text from character ``base`` on,
    ``nl`` counts the newlines before ``base`` and ``last_nl`` is the index of the last one (-1: none)."""

    def __init__(self, lines: Iterator[str]):
        self.lines, self.buf, self.base, self.nl, self.last_nl, self.eof = lines, "", 0, 0, -1, False

    def fill(self, at_least: int | None = None) -> bool:
        """Read at least ``at_least`` (default :data:`BLOCK`) more characters (fewer at the end of the file);
        False at its end."""
        if self.eof:
            return False
        at_least = at_least or BLOCK
        parts, n = [], 0
        for line in self.lines:
            parts.append(line)
            n += len(line)
            if n >= at_least:
                break
        else:
            self.eof = True
        self.buf += "".join(parts)
        return n > 0

    def drop(self, upto: int) -> None:
        """Forget the text before ``buf[upto]``."""
        if upto <= 0:
            return
        gone = self.buf[:upto]
        k = gone.count("\n")
        if k:
            self.nl += k
            self.last_nl = self.base + gone.rindex("\n")
        self.base += upto
        self.buf = self.buf[upto:]

    def line_of(self, i: int) -> int:
        """1-based line of ``buf[i]``."""
        return self.nl + self.buf.count("\n", 0, i) + 1

    def decode_error(self, e: json.JSONDecodeError) -> str:
        """``e`` (raised on ``buf``) as the decoder would word it over the whole text."""
        pos = self.base + e.pos
        k = self.buf.rfind("\n", 0, e.pos)
        col = e.pos - k if k >= 0 else pos - self.last_nl
        return f"{e.msg}: line {self.line_of(e.pos)} column {col} (char {pos})"


def _ws(w: _Window, pos: int) -> int:
    """The index after the JSON whitespace at ``buf[pos]`` (reading on while the window ends in it)."""
    while True:
        end = _JSON_WS.match(w.buf, pos).end()
        if end < len(w.buf) or not w.fill():
            return end


def json_list(path: Path, lines: Iterator[str]) -> Iterator[Record]:
    """The records of a JSON list, one at a time (see the module docstring). Raises
    :class:`ManifestUnreadable` when the list is not closed or text follows it."""
    not_closed = f"manifest {path}: not valid JSON: the list of records is not closed with ']'"
    w = _Window(lines)
    while "[" not in w.buf and w.fill():
        pass
    pos = _ws(w, w.buf.index("[") + 1)
    if w.buf.startswith("]", pos):
        pos = _ws(w, pos + 1)
    else:
        n = 0
        while True:
            if pos > BLOCK:
                w.drop(pos)
                pos = 0
            start = pos
            while True:  # decode the record, reading on while it may go on past the window
                try:
                    rec, vend = DECODER.raw_decode(w.buf, start)
                except (ValueError, RecursionError) as e:
                    if value_end(w.buf, start) >= len(w.buf) and w.fill(max(BLOCK, len(w.buf))):
                        continue
                    rec, vend = None, -1
                    err = ("nested too deeply" if isinstance(e, RecursionError) else
                           w.decode_error(e) if isinstance(e, json.JSONDecodeError) else str(e))
                    break
                if vend >= len(w.buf) and w.fill():
                    continue
                err = None
                break
            if err is None:
                end = _ws(w, vend)
                if end >= len(w.buf):
                    raise ManifestUnreadable(not_closed)
                if not w.buf.startswith((",", "]"), end):
                    err = "expected ',' or ']' after the record"
            if err is not None:
                end = value_end(w.buf, start)
                while end >= len(w.buf) and w.fill(max(BLOCK, len(w.buf))):
                    end = value_end(w.buf, start)
                text = w.buf[start:end]
                yield None, f"record {n} (line {w.line_of(start)}): not readable JSON ({err})", record_hint(text), text
            else:
                yield rec, None, None, w.buf[start:vend]
            if end >= len(w.buf):
                raise ManifestUnreadable(not_closed)
            closer = w.buf[end]
            pos = _ws(w, end + 1)
            if closer == "]":
                break
            n += 1
    while True:  # only whitespace may follow the list
        if w.buf[pos:].strip():
            raise ManifestUnreadable(f"manifest {path}: not valid JSON: text after the list of records")
        w.drop(len(w.buf))
        pos = 0
        if not w.fill():
            return


def is_json_list(path: Path, lines: Iterator[str]) -> tuple[bool, Iterator[str]]:
    """Whether ``path`` holds one JSON list of records (a ``.json`` file whose text starts with ``[``)
    rather than JSON lines (a ``.jsonl`` file is always read line by line, so a first line that is itself
    a JSON array is that row's problem, not the file's); returns the lines again, none lost."""
    if path.suffix.lower() == ".jsonl":
        return False, lines
    head: list[str] = []
    for line in lines:
        head.append(line)
        if line.strip():
            break
    return "".join(head).lstrip().startswith("["), itertools.chain(head, lines)


def json_records(path: Path, warn: bool = True) -> Iterator[Record]:
    """Yield the records of a JSON list or a JSONL file (see the module docstring; a JSONL line is named
    by its line number, a list record by its index and line)."""
    listed, lines = is_json_list(path, iter(TextLines(path, warn)))
    if listed:
        yield from json_list(path, lines)
        return
    for n, line in enumerate(lines, 1):  # line by line: one bad line costs only itself
        if not line.strip():
            continue
        text = line.rstrip("\r\n")
        if line.startswith(BOM):
            yield None, f"line {n}: starts with a byte-order mark (U+FEFF; files joined with their BOMs?)", None, text
            continue
        try:  # a line that is not JSON is named by its line (what it holds is not trusted for a key)
            yield DECODER.decode(line), None, None, text
        except ValueError as e:
            yield None, f"line {n}: {e}", None, text
        except RecursionError:
            yield None, f"line {n}: JSON nested too deeply", None, text


def first_record(path: Path) -> Any:
    """The first record of a JSON or JSONL file (None when it has none that reads)."""
    try:
        for rec, err, _, _ in json_records(path, warn=False):
            return rec if err is None else None
    except ValueError:
        return None
    return None


def check_columns(path: Path, names: list[str], where: str) -> None:
    """Raise :class:`ManifestUnreadable` when two column names of ``names`` are equal (also after Unicode
    NFC normalisation) or one holds a byte-order mark: which column was meant could only be guessed."""
    seen: dict[str, str] = {}
    for name in names:
        if name == "":
            continue  # unnamed columns (a trailing separator) are never read
        if BOM in name:
            raise ManifestUnreadable(f"manifest {path}: {where} column {name!r} holds a byte-order mark (U+FEFF; "
                                     "files joined with their BOMs?): remove it")
        other = seen.get(nfc(name))
        seen.setdefault(nfc(name), name)
        if other is not None:
            same = "twice" if other == name else f"twice ({other!r} and {name!r} are the same after Unicode NFC " \
                                                 "normalisation)"
            raise ManifestUnreadable(f"manifest {path}: {where} names the column {name!r} {same}: which one holds "
                                     "the values? Rename or remove one")


def parquet_records(path: Path, warn: bool = True) -> Iterator[Record]:
    """The rows of a Parquet file, :data:`PARQUET_BATCH` at a time (a row group is what pyarrow reads at once)."""
    import pyarrow.parquet as pq
    pf = pq.ParquetFile(path)
    check_columns(path, pf.schema_arrow.names, "the schema")
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH):
        for rec in batch.to_pylist():
            yield rec, None, None, json.dumps(rec, sort_keys=True, ensure_ascii=False, default=repr)


class _Lookback:
    """The lines of a file by index, read on demand, the ones below :meth:`release` forgotten."""

    def __init__(self, lines: Iterator[str]):
        self.lines, self.held, self.start, self.eof = lines, [], 0, False

    def get(self, i: int) -> str | None:
        while i >= self.start + len(self.held) and not self.eof:
            line = next(self.lines, None)
            if line is None:
                self.eof = True
            else:
                self.held.append(line)
        return self.held[i - self.start] if i - self.start < len(self.held) else None

    def span(self, a: int, b: int) -> list[str]:
        return [x for x in (self.get(i) for i in range(a, b)) if x is not None]

    def from_(self, i: int) -> Iterator[str]:
        while (line := self.get(i)) is not None:
            yield line
            i += 1

    def release(self, below: int) -> None:
        if below > self.start:
            del self.held[:below - self.start]
            self.start = below


def _csv_error(first: int, last: int, what: str, line: str, dialect: str, header: list[str], text: str) -> Record:
    """The reject of a CSV record that starts on line ``first``: what its own line holds serves as
    the hint for its key."""
    where = f"line {first}" if last <= first else f"line {first} (read up to line {last}; lines {first + 1}-{last} read again)"
    try:
        cells = next(csv.reader([line], dialect=dialect), [])
    except csv.Error:
        cells = []
    return None, f"{where}: {what}", dict(zip(header, cells)), text


def _whole_rows_inside(lines: list[str], dialect: str, n: int) -> int | None:
    """The first of ``lines`` (the lines wholly inside one quoted cell) that reads on its own as a
    complete row of ``n`` > 1 cells, or None: then a quote opened on the record's first line most
    likely joined rows (valid CSV, but not what was meant)."""
    for i, line in enumerate(lines):
        try:
            cells = next(csv.reader([line], dialect=dialect, strict=True), [])
        except csv.Error:
            continue
        if n > 1 and len(cells) == n:
            return i
    return None


def csv_header(path: Path) -> list[str]:
    """The header of a CSV/TSV manifest (what its rows' digests include beside each record)."""
    dialect = "excel-tab" if path.suffix.lower() == ".tsv" else "excel"
    for line in TextLines(path, warn=False):
        try:
            cells = next(csv.reader([line], dialect=dialect), [])
        except csv.Error:
            return []
        if cells:
            return cells
    return []


def csv_records(path: Path, warn: bool = True) -> Iterator[Record]:
    """The rows of a CSV (``.tsv``: tab-separated) file, through the csv module in strict mode (see the
    module docstring). Raises :class:`ManifestUnreadable` when the header is not CSV."""
    dialect = "excel-tab" if path.suffix.lower() == ".tsv" else "excel"
    lines = _Lookback(iter(TextLines(path, warn)))
    header: list[str] | None = None
    limit = csv.field_size_limit()
    csv.field_size_limit(MAX_CSV_FIELD)  # a big cell is a row's problem (caps, checks), not the reader's
    try:
        start = 0  # index of the line the reader starts at
        while lines.get(start) is not None:
            reader = csv.reader(lines.from_(start), dialect=dialect, strict=True)
            restart = None
            while restart is None:
                first = start + reader.line_num + 1  # 1-based number of the record's first line
                lines.release(first - 1)
                try:
                    cells = next(reader)
                except StopIteration:
                    return
                except csv.Error as e:
                    last = start + reader.line_num
                    if header is None:
                        raise ManifestUnreadable(f"manifest {path}: header line {first} is not CSV ({e})") from None
                    yield _csv_error(first, last, f"not CSV ({e})", lines.get(first - 1) or "", dialect, header,
                                     "".join(lines.span(first - 1, last)))
                    restart = first
                    continue
                last = start + reader.line_num
                if not cells:
                    continue
                if header is None:
                    check_columns(path, cells, f"header line {first}")
                    header = cells
                    continue
                text = "".join(lines.span(first - 1, last)).rstrip("\r\n")
                if cells[0].startswith(BOM):
                    yield _csv_error(first, last, "starts with a byte-order mark (U+FEFF; files joined with their "
                                     "BOMs?)", lines.get(first - 1) or "", dialect, header, text)
                    continue
                joined = _whole_rows_inside(lines.span(first, last - 1), dialect, len(header)) \
                    if last - first > 1 else None
                if len(cells) > len(header) or joined is not None:
                    what = (f"a quoted cell holds line {first + 1 + joined}, which reads as a whole row: is a quote "
                            "on this line not closed?" if joined is not None else
                            f"{len(cells) - len(header)} more cell(s) than the header has columns")
                    yield _csv_error(first, last, what, lines.get(first - 1) or "", dialect, header, text)
                    if last > first:
                        restart = first
                    continue
                yield {k: (v if v != "" else None) for k, v in zip(header, cells)}, None, None, text
            start = restart
    finally:
        csv.field_size_limit(limit)


__all__ = ["BLOCK", "BOM", "BOMS", "MAX_CSV_FIELD", "ManifestUnreadable", "TextLines", "check_columns",
           "csv_header", "csv_records", "first_record", "is_json_list", "json_list", "json_records", "nfc",
           "parquet_records", "record_hint", "strict_object", "value_end", "wide_without_bom"]
