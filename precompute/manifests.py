"""Manifest readers: JSONL, Higgs-Audio ChatML, LLaVA JSON, CSV and Parquet -> :class:`Request` rows.

The formats are one table, :data:`FORMATS` (name -> how it is detected, read and parsed). Every
row of the input becomes exactly one :class:`Request`, in input order; rows that cannot be used
(malformed JSON, a CSV record that is not CSV, no key-able content, empty text, a key seen before)
carry an ``error`` ``(reason, detail)`` instead of raising, so they land in ``rejects.parquet``
with the chunk they belong to, under the row's own key where it has one. No row is ever joined
to another or split: CSV/TSV are read in strict mode and read again after a bad record
(:func:`_csv_records`), a JSON list record by record (:func:`_json_list`). Encodings come from a
byte-order mark or are UTF-8 (:func:`read_text`). Keys: :mod:`precompute.keys`. Relative paths resolve against ``root`` (``--root``), else the manifest's folder, and
must stay inside it unless ``allow_outside_root`` (:class:`precompute.conversation.MediaRoot`).

Every value of a row is checked here, whatever its shape: the key (:func:`shards.schema.key_problem`:
no control character, valid Unicode, at most 200 bytes), text and paths
(:mod:`precompute.conversation`), numbers, and metadata stored verbatim (ChatML ``misc``,
:func:`~precompute.conversation.check_json`). A value that cannot be written safely makes its row
a ``malformed_row`` reject naming the row and the field; anything unforeseen that a row raises
(a bug) is a ``malformed_row`` too, never the end of the job.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from shardcache.inputs import NotAFile, check_input, read_input
from shards import schema

from . import conversation as C
from .conversation import Conversation, MediaRoot, RowError
from .keys import assign_keys, identity_key

log = logging.getLogger("precompute")

#: the largest CSV cell read (characters); a longer one makes its line a malformed_row
MAX_CSV_FIELD = 1 << 28


@dataclass
class Request:
    """One manifest row to encode: a :class:`~precompute.conversation.Conversation`.

    ``meta`` is stored verbatim in the sample's ``json`` member (the original row's fields that
    are not part of the conversation, ``original_key``...); ``error`` is ``(reason_code, detail)``
    for a row rejected while reading the manifest (then ``conversation`` may be None).
    """

    row: int
    key: str
    conversation: Conversation | None = None
    speaker: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    error: tuple[str, str] | None = None

    @property
    def source(self) -> str:
        """The row's input files, for reject listings."""
        return ";".join(self.conversation.sources) if self.conversation is not None else ""

    @property
    def text(self) -> str:
        return self.conversation.text if self.conversation is not None else ""

    @property
    def has_image(self) -> bool:
        return self.conversation is not None and bool(self.conversation.images)

    @property
    def has_audio(self) -> bool:
        return self.conversation is not None and bool(self.conversation.audio)


class ManifestUnreadable(ValueError):
    """The manifest as a whole cannot be read (an encoding it cannot be decoded in, a JSON list that
    is not closed, a CSV header that is not CSV); the message names the file and what to do. The
    command line exits 2 for it, before any model loads."""


#: byte-order marks, longest first (``FF FE 00 00`` is UTF-32-LE, not UTF-16-LE)
BOMS = ((b"\x00\x00\xfe\xff", "utf-32-be"), (b"\xff\xfe\x00\x00", "utf-32-le"), (b"\xef\xbb\xbf", "utf-8"),
        (b"\xfe\xff", "utf-16-be"), (b"\xff\xfe", "utf-16-le"))


def detect_format(path: Path) -> str:
    """The manifest's format (a name of :data:`FORMATS`): by extension (``suffixes``), else by the
    first JSON record's ``marker`` key, else ``jsonl``."""
    suffix = path.suffix.lower()
    for fmt in FORMATS.values():
        if suffix in fmt.suffixes:
            return fmt.name
    first = _first_record(path)
    if isinstance(first, dict):
        for fmt in FORMATS.values():
            if fmt.marker is not None and fmt.marker in first:
                return fmt.name
    return "jsonl"


def _wide_without_bom(data: bytes) -> str | None:
    """The name of the UTF-16/32 encoding ``data`` looks like when it has no BOM (at least a quarter
    of its first 4 KiB are NUL bytes, in the pattern of ASCII text in that encoding), else None. A
    few NULs in UTF-8 text are a row's problem, not the file's."""
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


def read_text(path: Path) -> str:
    """A manifest's whole text. A byte-order mark says the encoding (UTF-8, UTF-16 or UTF-32, either
    byte order; dropped); without one the text is UTF-8, line by line where the file is not all
    UTF-8: a line that is not is read as Latin-1 (one warning names them), the others stay UTF-8
    (one bad byte must not change the text of every other row). Raises
    :class:`ManifestUnreadable` naming the encoding for UTF-16/32 without a BOM (its NUL bytes
    would make every row unreadable) or UTF-16/32 that does not decode."""
    data = read_input(path, "manifest")
    for bom, codec in BOMS:
        if data.startswith(bom):
            data = data[len(bom):]
            if codec == "utf-8":
                break
            try:  # a lone surrogate stays one: the row holding it is rejected, not the file
                return data.decode(codec, "surrogatepass")
            except UnicodeDecodeError as e:
                raise ManifestUnreadable(f"manifest {path}: starts with a {codec.upper()} byte-order mark but "
                                         f"is not {codec.upper()} ({e}); save it as UTF-8") from None
    else:
        wide = _wide_without_bom(data)
        if wide is not None:
            raise ManifestUnreadable(f"manifest {path}: looks like {wide} without a byte-order mark (NUL bytes "
                                     f"between the characters); save it as UTF-8, or as {wide} with a BOM")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    out, latin = [], []
    for n, line in enumerate(data.splitlines(keepends=True), 1):
        try:
            out.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(line.decode("latin-1"))
            latin.append(n)
    log.warning("%s: line(s) %s%s are not valid UTF-8; read as Latin-1", path, ", ".join(map(str, latin[:10])),
                f" and {len(latin) - 10} more" if len(latin) > 10 else "")
    return "".join(out)


def _lines(text: str) -> list[str]:
    """Physical lines (ends kept) split at ``\\n``, ``\\r`` and ``\\r\\n`` only, as the csv module and
    JSON lines count them (not at U+2028 and the other breaks ``str.splitlines`` knows)."""
    return list(io.StringIO(text, newline=""))


def _is_json_list(path: Path, text: str) -> bool:
    """Whether ``path`` holds one JSON list of records (a ``.json`` file starting with ``[``) rather
    than JSON lines: a ``.jsonl`` file is always read line by line, so a first line that is itself a
    JSON array (a bad row) is that row's problem, not the file's."""
    return path.suffix.lower() != ".jsonl" and text.lstrip().startswith("[")


def _first_record(path: Path) -> Any:
    try:
        for rec, err, _ in _json_records(path):
            return rec if err is None else None
    except ValueError:
        return None
    return None


#: U+FEFF, the byte-order mark: at the start of a file it says the encoding (dropped); anywhere else it is
#: an invisible character (files joined with their BOMs) that would become part of a key or a column name
BOM = "\ufeff"


def _nfc(text: str) -> str:
    return text if text.isascii() else unicodedata.normalize("NFC", text)


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose member names are all different, also after Unicode NFC normalisation
    (``"caf\\u00e9"`` and ``"cafe\\u0301"`` look the same): ``json`` keeps the last of repeated names
    silently, so a row ``{"audio": "a.wav", "audio": "b.wav"}`` would be read as b.wav. Raises
    ``ValueError`` naming the name (the row becomes a ``malformed_row`` reject)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"repeated key {dup!r}: a JSON object may name a key once (which value was meant?)")
    if not all(k.isascii() for k in obj):
        norm: dict[str, str] = {}
        for k in obj:
            other = norm.setdefault(_nfc(k), k)
            if other != k:
                raise ValueError(f"keys {other!r} and {k!r} are the same after Unicode NFC normalisation: a JSON "
                                 "object may name a key once")
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_strict_object)


#: a JSON string (escapes included) or one structural character: what the record scanner steps on
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]', re.S)
_JSON_WS = re.compile(r"[ \t\n\r]*")


def _value_end(text: str, start: int, closers: str = ",]") -> int:
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
        end = _value_end(text, colon + 1, ",}")
        try:
            out[json.loads(m.group())] = text[colon + 1:end].strip()
        except ValueError:
            return out
        pos = end + 1
    return out


def _record_hint(text: str) -> dict:
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
        hint["misc"] = {k: v for k, v in _record_hint(misc).items() if k == "key"}
    return hint


def _json_list(path: Path, text: str) -> Iterator[tuple[Any, str | None, dict | None]]:
    """The records of a JSON list, one at a time: a record that does not parse (nested too deeply,
    an integer past Python's limit, bad syntax) is that record's ``record N (line L)`` error, named
    by its key where one can be read; the others are read as usual. Raises
    :class:`ManifestUnreadable` when the text is not a list or the list is not closed."""
    decoder = _DECODER
    pos = _JSON_WS.match(text, text.index("[") + 1).end()
    if text.startswith("]", pos):
        pos = _JSON_WS.match(text, pos + 1).end()
    else:
        n = 0
        while True:
            start = pos
            try:
                rec, end = decoder.raw_decode(text, pos)
                end = _JSON_WS.match(text, end).end()
                err = None if text.startswith((",", "]"), end) else "expected ',' or ']' after the record"
            except ValueError as e:
                rec, err = None, str(e)
            except RecursionError:
                rec, err = None, "nested too deeply"
            if err is not None:
                end = _value_end(text, start)
                line = text.count("\n", 0, start) + 1
                yield None, f"record {n} (line {line}): not readable JSON ({err})", _record_hint(text[start:end])
            else:
                yield rec, None, None
            if end >= len(text):
                raise ManifestUnreadable(f"manifest {path}: not valid JSON: the list of records is not closed "
                                         "with ']'")
            pos = _JSON_WS.match(text, end + 1).end()
            if text[end] == "]":
                break
            n += 1
    if text[pos:].strip():
        raise ManifestUnreadable(f"manifest {path}: not valid JSON: text after the list of records")


def _json_records(path: Path) -> Iterator[tuple[Any, str | None, dict | None]]:
    """Yield ``(record, None, None)`` or ``(None, error_detail, hint)`` for a JSON list or a JSONL file
    (``hint``: for a JSON list record, what could be read of its key, for naming its reject; a JSONL
    line is named by its line number)."""
    text = read_text(path)
    if _is_json_list(path, text):
        yield from _json_list(path, text)
        return
    for n, line in enumerate(_lines(text), 1):  # line by line: one bad line costs only itself
        if not line.strip():
            continue
        if line.startswith(BOM):
            yield None, f"line {n}: starts with a byte-order mark (U+FEFF; files joined with their BOMs?)", None
            continue
        try:  # a line that is not JSON is named by its line (what it holds is not trusted for a key)
            yield _DECODER.decode(line), None, None
        except ValueError as e:
            yield None, f"line {n}: {e}", None
        except RecursionError:
            yield None, f"line {n}: JSON nested too deeply", None


def _raw_key(value: Any, name: str) -> str | None:
    """The row's key as written (None when absent); raises :class:`RowError` for a key that cannot
    name a sample even once made WebDataset-safe (:func:`shards.schema.key_problem`)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError(name, f"expected a string key, got {type(value).__name__}")
    value = str(value)
    if not value.strip():
        raise RowError(name, "key is empty or only whitespace")
    if BOM in value:
        raise RowError(name, f"key {value!r:.60} holds a byte-order mark (U+FEFF, invisible: it would look like "
                             "another key)")
    why = schema.key_problem(schema.safe_key(value))
    if why is not None:
        raise RowError(name, why)
    return value


Parsed = tuple[Conversation, "str | None", str, dict]


def _parse_chatml(rec: dict, base: MediaRoot, columns: dict[str, str]) -> Parsed:
    """A Higgs-Audio ChatML record (``messages``; key: ``misc.key``, else ``key``, else ``id``)."""
    conv, speaker = C.from_chatml(rec, base)
    misc = rec.get("misc") if isinstance(rec.get("misc"), dict) else {}
    key = _raw_key(misc.get("key"), "misc.key") or _raw_key(rec.get("key"), "key") or _raw_key(rec.get("id"), "id")
    meta = {"misc": C.check_json(misc, "misc")} if misc else {}
    return conv, key, speaker, meta


def _parse_llava(rec: dict, base: MediaRoot, columns: dict[str, str]) -> Parsed:
    """A LLaVA record (``conversations``, ``image``; key: ``id``)."""
    conv = C.from_llava(rec, base)
    return conv, _raw_key(rec.get("id"), "id"), C.as_text(rec.get("speaker"), "speaker"), {}


def _parse_flat(rec: dict, base: MediaRoot, columns: dict[str, str]) -> Parsed:
    """A flat row (key, text, audio, image, speaker, offset, duration; ``columns`` renames them)."""
    col = lambda name: columns.get(name, name)  # noqa: E731
    get = lambda name: rec.get(col(name))  # noqa: E731
    misc = rec.get("misc") if isinstance(rec.get("misc"), dict) else {}
    key = _raw_key(get("key"), col("key")) or _raw_key(rec.get("id"), "id") or _raw_key(misc.get("key"), "misc.key")
    speaker = C.as_text(get("speaker"), col("speaker"))
    audio = C.as_path(get("audio"), col("audio"), base)
    image = C.as_path(get("image"), col("image"), base)
    offset = C.as_seconds(get("offset"), col("offset"), allow_none=False)
    duration = C.as_seconds(get("duration"), col("duration"), allow_none=True)
    if duration is not None and duration <= 0:
        raise RowError(col("duration"), f"must be > 0, got {get('duration')!r}")
    if audio is None and image is None:
        raise RowError(col("audio"), "row has no audio and no image")
    conv = C.from_flat(C.as_text(get("text"), col("text")).strip(), audio, image, speaker, offset, duration)
    return conv, key, speaker, {}


Records = Iterator[tuple[Any, "str | None", "dict | None"]]


def _check_columns(path: Path, names: list[str], where: str) -> None:
    """Raise :class:`ManifestUnreadable` when two column names of ``names`` are equal (also after Unicode
    NFC normalisation) or one holds a byte-order mark: which column was meant could only be guessed."""
    seen: dict[str, str] = {}
    for name in names:
        if name == "":
            continue  # unnamed columns (a trailing separator) are never read
        if BOM in name:
            raise ManifestUnreadable(f"manifest {path}: {where} column {name!r} holds a byte-order mark (U+FEFF; "
                                     "files joined with their BOMs?): remove it")
        other = seen.get(_nfc(name))
        seen.setdefault(_nfc(name), name)
        if other is not None:
            same = "twice" if other == name else f"twice ({other!r} and {name!r} are the same after Unicode NFC " \
                                                 "normalisation)"
            raise ManifestUnreadable(f"manifest {path}: {where} names the column {name!r} {same}: which one holds "
                                     "the values? Rename or remove one")


def _parquet_records(path: Path) -> Records:
    import pyarrow.parquet as pq
    _check_columns(path, pq.read_schema(path).names, "the schema")
    for rec in pq.read_table(path).to_pylist():
        yield rec, None, None


def _csv_error(first: int, last: int, what: str, line: str, dialect: str, header: list[str]) -> tuple:
    """The reject of a CSV record that starts on line ``first``: what its own line holds serves as
    the hint for its key."""
    where = f"line {first}" if last <= first else f"line {first} (read up to line {last}; lines {first + 1}-{last} read again)"
    try:
        cells = next(csv.reader([line], dialect=dialect), [])
    except csv.Error:
        cells = []
    return None, f"{where}: {what}", dict(zip(header, cells))


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


def _csv_records(path: Path) -> Records:
    """The rows of a CSV (``.tsv``: tab-separated) file, through the csv module in strict mode.

    A record that is not CSV (a quote not closed, text after a closing quote), that has more cells
    than the header, or that spans lines of which one reads on its own as a whole row, is a reject
    naming its first line; the reader then reads again from the next line, so a stray quote costs
    its own row only and never joins the rows after it to it. Quoted cells may hold quotes,
    separators and line breaks. Raises :class:`ManifestUnreadable` when the header is not CSV.
    """
    dialect = "excel-tab" if path.suffix.lower() == ".tsv" else "excel"
    lines = _lines(read_text(path))
    header: list[str] | None = None
    limit = csv.field_size_limit()
    csv.field_size_limit(MAX_CSV_FIELD)  # a big cell is a row's problem (caps, checks), not the reader's
    try:
        start = 0  # index of the line the reader starts at
        while start < len(lines):
            reader = csv.reader(itertools.islice(lines, start, None), dialect=dialect, strict=True)
            restart = None
            while restart is None:
                first = start + reader.line_num + 1  # 1-based number of the record's first line
                try:
                    cells = next(reader)
                except StopIteration:
                    return
                except csv.Error as e:
                    if header is None:
                        raise ManifestUnreadable(f"manifest {path}: header line {first} is not CSV ({e})") from None
                    yield _csv_error(first, start + reader.line_num, f"not CSV ({e})", lines[first - 1], dialect,
                                     header)
                    restart = first
                    continue
                last = start + reader.line_num
                if not cells:
                    continue
                if header is None:
                    _check_columns(path, cells, f"header line {first}")
                    header = cells
                    continue
                if cells[0].startswith(BOM):
                    yield _csv_error(first, last, "starts with a byte-order mark (U+FEFF; files joined with their "
                                     "BOMs?)", lines[first - 1], dialect, header)
                    continue
                joined = _whole_rows_inside(lines[first:last - 1], dialect, len(header)) if last - first > 1 else None
                if len(cells) > len(header) or joined is not None:
                    what = (f"a quoted cell holds line {first + 1 + joined}, which reads as a whole row: is a quote "
                            "on this line not closed?" if joined is not None else
                            f"{len(cells) - len(header)} more cell(s) than the header has columns")
                    yield _csv_error(first, last, what, lines[first - 1], dialect, header)
                    if last > first:
                        restart = first
                    continue
                yield {k: (v if v != "" else None) for k, v in zip(header, cells)}, None, None
            start = restart
    finally:
        csv.field_size_limit(limit)


@dataclass(frozen=True)
class ManifestFormat:
    """One manifest format (a value of ``manifest_format``).

    ``read(path)`` yields ``(record, None, None)`` per row, or ``(None, detail, hint)`` for a row
    that cannot be read (``hint``: what could be read of it, for naming its reject); ``parse``
    turns one record into ``(conversation, raw key, speaker, meta)`` (raises :class:`RowError`);
    ``suffixes`` detect it by file name, ``marker`` by a key of the first record (JSON formats,
    whose records are each parsed by their own marker, so one file may mix them).
    """

    name: str
    doc: str
    read: Callable[[Path], Records]
    parse: Callable[[dict, MediaRoot, dict], Parsed]
    suffixes: tuple[str, ...] = ()
    marker: str | None = None


#: every manifest format by name: how it is detected, read and parsed (the one place to add one)
FORMATS: dict[str, ManifestFormat] = {f.name: f for f in (
    ManifestFormat("jsonl", "JSON lines (or a JSON list) of flat rows", _json_records, _parse_flat),
    ManifestFormat("chatml", "Higgs-Audio ChatML records (messages, misc.key)", _json_records, _parse_chatml,
                   marker="messages"),
    ManifestFormat("llava", "LLaVA records (conversations, image, id)", _json_records, _parse_llava,
                   marker="conversations"),
    ManifestFormat("csv", "CSV (.csv) or tab-separated (.tsv) flat rows with a header", _csv_records, _parse_flat,
                   suffixes=(".csv", ".tsv")),
    ManifestFormat("parquet", "Parquet flat rows", _parquet_records, _parse_flat, suffixes=(".parquet", ".pq")),
)}


def _record_format(rec: dict, fmt: ManifestFormat) -> ManifestFormat:
    """The format a record of a file in ``fmt`` is parsed as: JSON records by their own marker."""
    if fmt.read is not _json_records:
        return fmt
    return next((f for f in FORMATS.values() if f.marker is not None and f.marker in rec), FORMATS["jsonl"])


def _key_hint(rec: Any, columns: dict[str, str]) -> str | None:
    """The key of a record that is rejected, where it has a usable one (``misc.key``, the key
    column, ``key``, ``id``), made safe; else None (the reject is named by row or line)."""
    if not isinstance(rec, dict):
        return None
    misc = rec.get("misc") if isinstance(rec.get("misc"), dict) else {}
    for value in (misc.get("key"), rec.get(columns.get("key", "key")), rec.get("key"), rec.get("id")):
        try:
            raw = _raw_key(value, "key")
        except (RowError, ValueError):
            continue
        if raw is not None:
            return schema.safe_key(raw)
    return None


#: how a reader's error detail names where the row is (``line N`` of a text file, ``record N`` of a JSON list)
_WHERE = re.compile(r"^(line|record) (\d+)")


def read_requests(path: str | Path, root: str | Path | None = None, fmt: str | None = None,
                  columns: dict[str, str] | None = None, require_text: bool = True,
                  allow_outside_root: bool = False) -> list[Request]:
    """Read a manifest into Requests (one per row, input order).

    Args:
        path: manifest file (``.jsonl``/``.json``/``.csv``/``.tsv``/``.parquet``), UTF-8,
            UTF-16 or UTF-32 with a byte-order mark, or UTF-8 without (Latin-1 lines: a warning).
        root: folder that relative media paths are relative to (default: the manifest's folder);
            a path outside it is a ``malformed_row`` unless ``allow_outside_root``.
        fmt: one of :data:`FORMATS`; default: :func:`detect_format`.
        columns: for jsonl/csv/parquet, maps our names (key, text, audio, image, speaker, offset,
            duration) to the file's column names.
        require_text: reject rows without any text (reason ``empty_text``).

    Keys (:mod:`precompute.keys`): the row's key made WebDataset-safe
    (:func:`shards.schema.safe_key`); a row without a key gets a hash of what identifies it
    (sources with offset and duration, inline audio bytes, text and turns:
    :func:`~precompute.keys.identity_key`). Two different keys that sanitise to the same one
    (``a.b`` and ``a_b``) both stay: the later one gets a short hash suffix, checked against every
    key taken and kept within :data:`shards.schema.MAX_KEY_BYTES`
    (:func:`~precompute.keys.assign_keys`); the original key is kept in the sample's JSON
    (``original_key``). The same key twice is a ``duplicate_key`` reject.

    Rows that cannot be read are ``malformed_row`` rejects named by the row's own key where it has
    a usable one (``misc.key``, the key column, ``key``, ``id``), else by ``line-N`` (text files),
    ``record-N`` (a JSON list) or ``row-N``; the detail names the line, record or row and the field.

    Raises ``FileNotFoundError`` for a missing manifest, ``ValueError`` for an unknown format and
    :class:`ManifestUnreadable` (a ``ValueError``) for a manifest that cannot be read as a whole
    (see :func:`read_text`, :func:`_json_list`, :func:`_csv_records`); a single bad row never
    raises.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"manifest {path} does not exist")
    try:  # a FIFO or device is refused, never waited on
        check_input(path, "manifest")
    except NotAFile as e:
        raise ManifestUnreadable(str(e)) from None
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown manifest format {fmt!r}; known: {', '.join(FORMATS)}")
    base = MediaRoot(root if root else path.parent, allow_outside_root)  # sources are recorded absolute
    columns = columns or {}
    fmt_ = FORMATS[fmt]
    out: list[Request] = []
    raw_seen: dict[str, str] = {}  # NFC of each key read -> the key as written
    for row, (rec, err, hint) in enumerate(fmt_.read(path)):
        if err is not None or not isinstance(rec, dict):
            detail = err or f"row {row}: expected an object, got {type(rec).__name__}"
            where = _WHERE.match(detail) if err else None
            name = _key_hint(hint, columns) or (f"{where[1]}-{where[2]}" if where else f"row-{row}")
            out.append(Request(row=row, key=name, error=(schema.MALFORMED_ROW, detail)))
            continue
        try:
            conv, raw_key, speaker, meta = _record_format(rec, fmt_).parse(rec, base, columns)
        except RowError as e:
            out.append(Request(row=row, key=_key_hint(rec, columns) or f"row-{row}", meta={"row": row},
                               error=(schema.MALFORMED_ROW, f"row {row}: {e}")))
            continue
        except (Exception, RecursionError) as e:  # noqa: BLE001 - no row may end the job (a bug: report it)
            log.warning("row %d of %s: unexpected %s while reading it: %s", row, path, type(e).__name__, e)
            out.append(Request(row=row, key=f"row-{row}", meta={"row": row},
                               error=(schema.MALFORMED_ROW, f"row {row}: {type(e).__name__}: {str(e)[:200]}")))
            continue
        if raw_key is None:
            raw_key = identity_key(conv, speaker)
        key = schema.safe_key(raw_key)
        if key != raw_key:
            meta["original_key"] = raw_key
        req = Request(row=row, key=key, conversation=conv, speaker=speaker, meta=meta)
        earlier = raw_seen.get(_nfc(raw_key))
        if earlier == raw_key:
            req.error = (schema.DUPLICATE_KEY, f"row {row}: key {raw_key!r} already used by an earlier row")
        elif earlier is not None:  # two keys that look the same: which row is which could only be guessed
            req.error = (schema.DUPLICATE_KEY, f"row {row}: key {raw_key!r} is an earlier row's key {earlier!r} "
                                               "after Unicode NFC normalisation (they look the same)")
        elif require_text and not conv.text:
            req.error = (schema.EMPTY_TEXT, f"row {row}: text is empty")
        raw_seen.setdefault(_nfc(raw_key), raw_key)
        out.append(req)
    wanted = [(r.key, r.meta.get("original_key", r.key)) if r.error is None else None for r in out]
    for req, key in zip(out, assign_keys(wanted)):
        if key is not None and key != req.key:  # another row has this key: keep both rows
            req.meta["original_key"] = req.meta.get("original_key", req.key)
            req.key = key
    return out
