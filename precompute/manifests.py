"""Manifests: JSONL, Higgs-Audio ChatML, LLaVA JSON, CSV and Parquet rows -> :class:`Request` rows, as a stream.

The formats are one table, :data:`FORMATS` (name -> how it is detected, read and parsed). A manifest is
read a record at a time (:mod:`precompute.readers`: encodings, JSON lists record by record, CSV in strict
mode, Parquet by batch) by a :class:`ManifestReader`, which parses each record into a :class:`ReadRow`:
the row's :class:`Request` with what the row itself decides (its key made safe, a reject found in the row),
its key as written and its serialised form. What is decided across rows (a key seen before, two keys that
become one once made safe, a key claimed twice for the rerun's ids) is decided by
:class:`precompute.plan.ManifestPlan` without holding the rows; :func:`read_requests` gives the rows of a
small manifest as a list, those decisions applied.

Every row of the input becomes exactly one :class:`Request`, in input order; rows that cannot be used
(malformed JSON, a CSV record that is not CSV, no key-able content, empty text, a key seen before)
carry an ``error`` ``(reason, detail)`` instead of raising, so they land in ``rejects.parquet``
with the chunk they belong to, under the row's own key where it has one. No row is ever joined
to another or split. Keys: :mod:`precompute.keys`. Relative paths resolve against ``root`` (``--root``),
else the manifest's folder, and must stay inside it unless ``allow_outside_root``
(:class:`precompute.conversation.MediaRoot`).

Every value of a row is checked here, whatever its shape: the key (:func:`shards.schema.key_problem`:
no control character, valid Unicode, at most 200 bytes), text and paths
(:mod:`precompute.conversation`), numbers, and metadata stored verbatim (ChatML ``misc``,
:func:`~precompute.conversation.check_json`). A value that cannot be written safely makes its row
a ``malformed_row`` reject naming the row and the field; anything unforeseen that a row raises
(a bug) is a ``malformed_row`` too, never the end of the job.
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from shardcache.inputs import NotAFile, check_input
from shards import schema

from . import conversation as C
from .conversation import Conversation, MediaRoot, RowError
from .keys import identity_key
from .readers import (BOM, MAX_CSV_FIELD, ManifestUnreadable, Record, csv_header, csv_records, first_record,
                      json_records, parquet_records)

log = logging.getLogger("precompute")

#: the version of the parsing a row's digest covers (its serialised form is read as this code reads it)
PARSE_VERSION = 1


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


#: the names a flat row is read by (``columns`` renames them)
FLAT_NAMES = ("key", "text", "audio", "image", "speaker", "offset", "duration")


def _parse_flat(rec: dict, base: MediaRoot, columns: dict[str, str]) -> Parsed:
    """A flat row (key, text, audio, image, speaker, offset, duration; ``columns`` renames them)."""
    c_key, c_text, c_audio, c_image, c_speaker, c_offset, c_duration = (columns.get(n, n) for n in FLAT_NAMES) \
        if columns else FLAT_NAMES
    misc = rec.get("misc")
    key = _raw_key(rec.get(c_key), c_key) or _raw_key(rec.get("id"), "id") or \
        (_raw_key(misc.get("key"), "misc.key") if isinstance(misc, dict) else None)
    speaker = C.as_text(rec.get(c_speaker), c_speaker)
    audio = C.as_path(rec.get(c_audio), c_audio, base)
    image = C.as_path(rec.get(c_image), c_image, base)
    offset = C.as_seconds(rec.get(c_offset), c_offset, allow_none=False)
    duration = C.as_seconds(rec.get(c_duration), c_duration, allow_none=True)
    if duration is not None and duration <= 0:
        raise RowError(c_duration, f"must be > 0, got {rec.get(c_duration)!r}")
    if audio is None and image is None:
        raise RowError(c_audio, "row has no audio and no image")
    conv = C.from_flat(C.as_text(rec.get(c_text), c_text).strip(), audio, image, speaker, offset, duration)
    return conv, key, speaker, {}


@dataclass(frozen=True)
class ManifestFormat:
    """One manifest format (a value of ``manifest_format``).

    ``read(path, warn)`` yields ``(record, None, None, text)`` per row, or ``(None, detail, hint, text)`` for
    a row that cannot be read (``hint``: what could be read of it, for naming its reject; ``text``: the row as
    the file holds it; :mod:`precompute.readers`); ``parse``
    turns one record into ``(conversation, raw key, speaker, meta)`` (raises :class:`RowError`);
    ``suffixes`` detect it by file name, ``marker`` by a key of the first record (JSON formats,
    whose records are each parsed by their own marker, so one file may mix them).
    """

    name: str
    doc: str
    read: Callable[[Path, bool], Iterator[Record]]
    parse: Callable[[dict, MediaRoot, dict], Parsed]
    suffixes: tuple[str, ...] = ()
    marker: str | None = None


#: every manifest format by name: how it is detected, read and parsed (the one place to add one)
FORMATS: dict[str, ManifestFormat] = {f.name: f for f in (
    ManifestFormat("jsonl", "JSON lines (or a JSON list) of flat rows", json_records, _parse_flat),
    ManifestFormat("chatml", "Higgs-Audio ChatML records (messages, misc.key)", json_records, _parse_chatml,
                   marker="messages"),
    ManifestFormat("llava", "LLaVA records (conversations, image, id)", json_records, _parse_llava,
                   marker="conversations"),
    ManifestFormat("csv", "CSV (.csv) or tab-separated (.tsv) flat rows with a header", csv_records, _parse_flat,
                   suffixes=(".csv", ".tsv")),
    ManifestFormat("parquet", "Parquet flat rows", parquet_records, _parse_flat, suffixes=(".parquet", ".pq")),
)}


#: the JSON formats a record names by its marker key, in :data:`FORMATS` order
_MARKED = tuple((f.marker, f) for f in FORMATS.values() if f.marker is not None)


def _record_format(rec: dict, fmt: ManifestFormat) -> ManifestFormat:
    """The format a record of a file in ``fmt`` is parsed as: JSON records by their own marker."""
    if fmt.read is not json_records:
        return fmt
    for marker, f in _MARKED:
        if marker in rec:
            return f
    return _JSONL


_JSONL = FORMATS["jsonl"]


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


class ReadRow(NamedTuple):
    """One manifest row as read, before what is decided across rows (:mod:`precompute.plan`).

    ``req``: the :class:`Request` (``key``: the row's key made safe, or the name of a row that cannot be
    read; ``error``: a reject the row makes by itself); ``raw``: its key as written, or the
    :func:`~precompute.keys.identity_key` of a row without one (None: the row was not parsed); ``keyless``:
    the row has no key of its own; ``empty``: it has no text where text is required (``empty_text``,
    unless its key is an earlier row's); ``text``: the row as the file holds it (its digest's input)."""

    req: Request
    raw: str | None
    keyless: bool
    empty: bool
    text: str


class ManifestReader:
    """One manifest file, read as a stream of :class:`ReadRow` (:meth:`rows`; again for each pass).

    Args:
        path: manifest file (``.jsonl``/``.json``/``.csv``/``.tsv``/``.parquet``), UTF-8,
            UTF-16 or UTF-32 with a byte-order mark, or UTF-8 without (Latin-1 lines: a warning).
        root: folder that relative media paths are relative to (default: the manifest's folder);
            a path outside it is a ``malformed_row`` unless ``allow_outside_root``.
        fmt: one of :data:`FORMATS`; default: :func:`detect_format`.
        columns: for jsonl/csv/parquet, maps our names (key, text, audio, image, speaker, offset,
            duration) to the file's column names.
        require_text: reject rows without any text (reason ``empty_text``).

    Keys: the row's key made WebDataset-safe (:func:`shards.schema.safe_key`); a row without a key gets a
    hash of what identifies it (:func:`~precompute.keys.identity_key`); the key as written is kept in the
    sample's JSON (``original_key``) when it differs. Rows that cannot be read are ``malformed_row`` rejects
    named by the row's own key where it has a usable one (``misc.key``, the key column, ``key``, ``id``),
    else by ``line-N`` (text files), ``record-N`` (a JSON list) or ``row-N``; the detail names the line,
    record or row and the field.

    Raises ``FileNotFoundError`` for a missing manifest, ``ValueError`` for an unknown format and
    :class:`ManifestUnreadable` (a ``ValueError``) for a manifest that cannot be read as a whole
    (:mod:`precompute.readers`), here or while :meth:`rows` reads it; a single bad row never raises.
    """

    def __init__(self, path: str | Path, root: str | Path | None = None, fmt: str | None = None,
                 columns: dict[str, str] | None = None, require_text: bool = True, allow_outside_root: bool = False):
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
        self.path, self.format, self.columns = path, FORMATS[fmt], dict(columns or {})
        self.require_text, self.allow_outside_root = bool(require_text), bool(allow_outside_root)
        self.base = MediaRoot(root if root else path.parent, allow_outside_root)  # sources are recorded absolute
        header = csv_header(path) if self.format.read is csv_records else []
        #: what every row's digest holds besides the row: what decides how the same text is parsed (the
        #: format, the media root paths are joined to, the columns read, a CSV header). ``allow_outside_root``
        #: is not in it: it decides only whether a row is a reject, and the reject is in the digest
        self.context = json.dumps({"format": self.format.name, "root": str(self.base.root), "columns": self.columns,
                                   "require_text": self.require_text, "header": header, "parse": PARSE_VERSION},
                                  sort_keys=True, ensure_ascii=False)

    @property
    def root(self) -> Path:
        """The media root (absolute)."""
        return self.base.root

    def rows(self, warn: bool = True, keep: Callable[[int], bool] | None = None) -> Iterator[ReadRow | None]:
        """Every row of the manifest in order (``warn``: say which lines were read as Latin-1); a row whose
        position ``keep`` refuses is read but not parsed (None in its place)."""
        columns, fmt = self.columns, self.format
        for row, (rec, err, hint, text) in enumerate(fmt.read(self.path, warn)):
            if keep is not None and not keep(row):
                yield None
                continue
            if err is not None or not isinstance(rec, dict):
                detail = err or f"row {row}: expected an object, got {type(rec).__name__}"
                where = _WHERE.match(detail) if err else None
                name = _key_hint(hint, columns) or (f"{where[1]}-{where[2]}" if where else f"row-{row}")
                yield ReadRow(Request(row=row, key=name, error=(schema.MALFORMED_ROW, detail)), None, False, False, text)
                continue
            try:
                conv, raw_key, speaker, meta = _record_format(rec, fmt).parse(rec, self.base, columns)
            except RowError as e:
                yield ReadRow(Request(row=row, key=_key_hint(rec, columns) or f"row-{row}", meta={"row": row},
                                      error=(schema.MALFORMED_ROW, f"row {row}: {e}")), None, False, False, text)
                continue
            except (Exception, RecursionError) as e:  # noqa: BLE001 - no row may end the job (a bug: report it)
                log.warning("row %d of %s: unexpected %s while reading it: %s", row, self.path, type(e).__name__, e)
                yield ReadRow(Request(row=row, key=f"row-{row}", meta={"row": row}, error=(
                    schema.MALFORMED_ROW, f"row {row}: {type(e).__name__}: {str(e)[:200]}")), None, False, False, text)
                continue
            keyless = raw_key is None
            if keyless:
                raw_key = identity_key(conv, speaker)
            key = schema.safe_key(raw_key)
            if key != raw_key:
                meta["original_key"] = raw_key
            yield ReadRow(Request(row=row, key=key, conversation=conv, speaker=speaker, meta=meta), raw_key, keyless,
                          self.require_text and not conv.text, text)


def read_requests(path: str | Path, root: str | Path | None = None, fmt: str | None = None,
                  columns: dict[str, str] | None = None, require_text: bool = True,
                  allow_outside_root: bool = False) -> list[Request]:
    """Read a small manifest into a list of Requests (one per row, input order), with what is decided
    across rows applied (:class:`precompute.plan.ManifestPlan`): the same key twice is a ``duplicate_key``
    reject (also two keys equal after Unicode NFC normalisation); two different keys that sanitise to the
    same one (``a.b`` and ``a_b``) both stay, the later one with a short hash suffix checked against every
    key taken and kept within :data:`shards.schema.MAX_KEY_BYTES` (:func:`~precompute.keys.assign_keys`).
    A job reads its manifest as a stream instead (:func:`precompute.plan.ManifestPlan.build`). Arguments and
    errors: :class:`ManifestReader`."""
    from .plan import ManifestPlan
    reader = ManifestReader(path, root=root, fmt=fmt, columns=columns, require_text=require_text,
                            allow_outside_root=allow_outside_root)
    with ManifestPlan.build(reader) as plan:
        return [req for _, req in plan.requests()]


def detect_format(path: Path) -> str:
    """The manifest's format (a name of :data:`FORMATS`): by extension (``suffixes``), else by the
    first JSON record's ``marker`` key, else ``jsonl``."""
    suffix = path.suffix.lower()
    for fmt in FORMATS.values():
        if suffix in fmt.suffixes:
            return fmt.name
    first = first_record(path)
    if isinstance(first, dict):
        for fmt in FORMATS.values():
            if fmt.marker is not None and fmt.marker in first:
                return fmt.name
    return "jsonl"


__all__ = ["FORMATS", "MAX_CSV_FIELD", "ManifestFormat", "ManifestReader", "ManifestUnreadable", "ReadRow",
           "Request", "detect_format", "read_requests", "BOM"]
