"""Manifest readers: JSONL, Higgs-Audio ChatML, LLaVA JSON, CSV and Parquet -> :class:`Request` rows.

Every row of the input becomes exactly one :class:`Request`, in input order; rows that cannot be
used (malformed JSON, no key-able content, empty text, a key seen before) carry an ``error``
``(reason, detail)`` instead of raising, so they land in ``rejects.parquet`` with the chunk they
belong to. Relative paths resolve against ``root`` (``--root``), else the manifest's folder, and
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
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from shards import schema

from . import conversation as C
from .config import MANIFEST_FORMATS
from .conversation import Conversation, MediaRoot, RowError
from .keys import assign_keys, identity_key

log = logging.getLogger("precompute")

FORMATS = MANIFEST_FORMATS  # the option values (owner: precompute.config)
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


def detect_format(path: Path) -> str:
    """Guess the manifest shape from the extension and, for ``.json``, the first record."""
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix in (".csv", ".tsv"):
        return "csv"
    first = _first_record(path)
    if isinstance(first, dict) and "messages" in first:
        return "chatml"
    if isinstance(first, dict) and "conversations" in first:
        return "llava"
    return "jsonl"


def decode_text(data: bytes, where: str) -> str:
    """UTF-8 text (a leading BOM dropped); bytes that are not UTF-8 are read as Latin-1, with a warning."""
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        log.warning("%s is not valid UTF-8 (%s); reading it as Latin-1", where, e)
        return data.decode("latin-1")


def read_text(path: Path) -> str:
    """A manifest's whole text: UTF-8 (a leading BOM dropped), line by line where the file is not
    all UTF-8: a line that is not is read as Latin-1 (one warning names them), the others stay
    UTF-8 (one bad byte must not change the text of every other row)."""
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
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


def _is_json_list(path: Path, text: bytes | str) -> bool:
    """Whether ``path`` holds one JSON list of records (a ``.json`` file starting with ``[``) rather
    than JSON lines: a ``.jsonl`` file is always read line by line, so a first line that is itself a
    JSON array (a bad row) is that row's problem, not the file's."""
    start = b"[" if isinstance(text, bytes) else "["
    return path.suffix.lower() != ".jsonl" and text.lstrip().startswith(start)


def _first_record(path: Path) -> Any:
    text = read_text(path).lstrip()
    try:
        if _is_json_list(path, text):
            data = json.loads(text)
            return data[0] if isinstance(data, list) and data else None
        line = next((x for x in text.splitlines() if x.strip()), None)
        return json.loads(line) if line is not None else None
    except (ValueError, RecursionError):
        return None


def _json_records(path: Path) -> Iterator[tuple[Any, str | None]]:
    """Yield ``(record, None)`` or ``(None, error_detail)`` for a JSON list or a JSONL file.

    Raises ``ValueError`` naming the file for a JSON list that does not parse as a whole (its rows
    cannot be told apart)."""
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if _is_json_list(path, raw):
        try:
            data = json.loads(decode_text(raw, str(path)))
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        except RecursionError:
            raise ValueError(f"{path}: not readable JSON (nested too deeply)") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records")
        for rec in data:
            yield rec, None
        return
    for n, line in enumerate(raw.splitlines(), 1):  # line by line: one Latin-1 line costs only itself
        if not line.strip():
            continue
        try:
            yield json.loads(decode_text(line, f"{path}:{n}")), None
        except ValueError as e:
            yield None, f"line {n}: {e}"
        except RecursionError:
            yield None, f"line {n}: JSON nested too deeply"


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
    why = schema.key_problem(schema.safe_key(value))
    if why is not None:
        raise RowError(name, why)
    return value


def _parse(rec: dict, fmt: str, base: MediaRoot, columns: dict[str, str]) -> tuple[Conversation, str | None, str, dict]:
    """One record -> (conversation, raw key, speaker, meta). Raises :class:`RowError`.

    In JSON manifests each record is read by its own shape (``messages``: ChatML,
    ``conversations``: LLaVA, else a flat row), so one file may mix them.
    """
    if fmt in ("jsonl", "chatml", "llava"):
        fmt = "chatml" if "messages" in rec else "llava" if "conversations" in rec else "jsonl"
    if fmt == "chatml":
        conv, speaker = C.from_chatml(rec, base)
        misc = rec.get("misc") if isinstance(rec.get("misc"), dict) else {}
        key = _raw_key(misc.get("key"), "misc.key") or _raw_key(rec.get("key"), "key") or _raw_key(rec.get("id"), "id")
        meta = {"misc": C.check_json(misc, "misc")} if misc else {}
        return conv, key, speaker, meta
    if fmt == "llava":
        conv = C.from_llava(rec, base)
        return conv, _raw_key(rec.get("id"), "id"), C.as_text(rec.get("speaker"), "speaker"), {}
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


def _table_records(path: Path, fmt: str) -> Iterator[tuple[Any, str | None]]:
    if fmt == "parquet":
        import pyarrow.parquet as pq
        for rec in pq.read_table(path).to_pylist():
            yield rec, None
        return
    dialect = "excel-tab" if path.suffix.lower() == ".tsv" else "excel"
    reader = csv.DictReader(io.StringIO(read_text(path), newline=""), dialect=dialect)
    limit = csv.field_size_limit()
    csv.field_size_limit(MAX_CSV_FIELD)  # a big cell is a row's problem (caps, checks), not the reader's
    try:
        n = 1
        while True:
            try:
                rec = next(reader)
            except StopIteration:
                return
            except csv.Error as e:  # the reader goes on at the next line
                n = reader.line_num
                yield None, f"line {n}: not CSV ({e})"
                continue
            n = reader.line_num
            if None in rec:  # more cells than header columns
                yield None, f"line {n}: {len(rec[None])} more cell(s) than the header has columns"
                continue
            yield {k: (v if v != "" else None) for k, v in rec.items()}, None
    finally:
        csv.field_size_limit(limit)


def read_requests(path: str | Path, root: str | Path | None = None, fmt: str | None = None,
                  columns: dict[str, str] | None = None, require_text: bool = True,
                  allow_outside_root: bool = False) -> list[Request]:
    """Read a manifest into Requests (one per row, input order).

    Args:
        path: manifest file (``.jsonl``/``.json``/``.csv``/``.tsv``/``.parquet``), UTF-8 (a BOM
            is fine) or, with a warning, Latin-1.
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

    Raises ``FileNotFoundError`` for a missing manifest and ``ValueError`` for an unknown format or
    a JSON list that does not parse; a single bad row never raises: malformed values become
    ``malformed_row`` rejects naming the row and the field.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"manifest {path} does not exist")
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown manifest format {fmt!r}; known: {', '.join(FORMATS)}")
    base = MediaRoot(root if root else path.parent, allow_outside_root)  # sources are recorded absolute
    columns = columns or {}
    records = _table_records(path, fmt) if fmt in ("csv", "parquet") else _json_records(path)
    out: list[Request] = []
    raw_seen: set[str] = set()
    for row, (rec, err) in enumerate(records):
        if err is not None or not isinstance(rec, dict):
            detail = err or f"row {row}: expected an object, got {type(rec).__name__}"
            line = detail.split(":")[0].replace(" ", "-") if err else f"row-{row}"
            out.append(Request(row=row, key=line, error=(schema.MALFORMED_ROW, detail)))
            continue
        try:
            conv, raw_key, speaker, meta = _parse(rec, fmt, base, columns)
        except RowError as e:
            out.append(Request(row=row, key=f"row-{row}", meta={"row": row},
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
        if raw_key in raw_seen:
            req.error = (schema.DUPLICATE_KEY, f"row {row}: key {raw_key!r} already used by an earlier row")
        elif require_text and not conv.text:
            req.error = (schema.EMPTY_TEXT, f"row {row}: text is empty")
        raw_seen.add(raw_key)
        out.append(req)
    wanted = [(r.key, r.meta.get("original_key", r.key)) if r.error is None else None for r in out]
    for req, key in zip(out, assign_keys(wanted)):
        if key is not None and key != req.key:  # another row has this key: keep both rows
            req.meta["original_key"] = req.meta.get("original_key", req.key)
            req.key = key
    return out
