"""Manifest readers: JSONL, Higgs-Audio ChatML, LLaVA JSON, CSV and Parquet -> :class:`Request` rows.

Every row of the input becomes exactly one :class:`Request`, in input order; rows that cannot be
used (malformed JSON, no key-able content, empty text, a key seen before) carry an ``error``
``(reason, detail)`` instead of raising, so they land in ``rejects.parquet`` with the chunk they
belong to. Relative paths resolve against ``root`` (``--root``), else the manifest's folder.
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from shards import schema

FORMATS = ("jsonl", "chatml", "llava", "csv", "parquet")


@dataclass
class Request:
    """One manifest row to encode.

    ``audio``/``image`` are absolute paths or None; ``offset_s``/``duration_s`` (seconds) slice
    the decoded audio (ChatML); ``meta`` is stored verbatim in the sample's ``json`` member;
    ``error`` is ``(reason_code, detail)`` for a row rejected while reading the manifest.
    """

    row: int
    key: str
    text: str = ""
    audio: str | None = None
    image: str | None = None
    speaker: str = ""
    offset_s: float = 0.0
    duration_s: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    error: tuple[str, str] | None = None

    @property
    def source(self) -> str:
        """The row's input files, for reject listings."""
        return ";".join(p for p in (self.audio, self.image) if p)


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


def _first_record(path: Path) -> Any:
    text = path.read_text(encoding="utf-8", errors="replace").lstrip()
    if text.startswith("["):
        try:
            data = json.loads(text)
            return data[0] if data else None
        except ValueError:
            return None
    for line in text.splitlines():
        if line.strip():
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _json_records(path: Path) -> Iterator[tuple[Any, str | None]]:
    """Yield ``(record, None)`` or ``(None, error_detail)`` for a JSON list or a JSONL file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        for rec in data:
            yield rec, None
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line), None
        except ValueError as e:
            yield None, f"line {n}: {e}"


def _hash_key(*parts: str | None) -> str:
    return "h" + hashlib.sha256("\0".join(p or "" for p in parts).encode()).hexdigest()[:16]


def _chatml(rec: dict, assistant_only: bool = True) -> dict:
    """Flatten a Higgs-Audio ChatML sample: text from user turns, audio/image items by role."""
    texts, audios, images = [], [], []
    for msg in rec.get("messages") or []:
        role = msg.get("role")
        content = msg.get("content")
        items = content if isinstance(content, list) else [content]
        for item in items:
            if isinstance(item, str):
                if role == "user":
                    texts.append(item)
            elif isinstance(item, dict):
                kind = item.get("type")
                if kind == "text" and role == "user":
                    texts.append(item.get("text", ""))
                elif kind == "audio" and (role == "assistant" or not assistant_only):
                    audios.append(item)
                elif kind == "image":
                    images.append(item.get("image_url"))
    misc = rec.get("misc") or {}
    audio = audios[0] if audios else {}
    return dict(
        key=misc.get("key") or rec.get("key") or rec.get("id"),
        text="\n".join(t for t in texts if t),
        audio=audio.get("audio_url"),
        offset_s=float(audio.get("offset") or 0.0),
        duration_s=audio.get("duration"),
        image=images[0] if images else None,
        speaker=rec.get("speaker") or "",
        meta={"messages": rec.get("messages"), "start_index": rec.get("start_index"), "misc": misc,
              "n_audio_items": len(audios)},
    )


def _llava(rec: dict) -> dict:
    conv = rec.get("conversations") or []
    answer = next((c.get("value", "") for c in conv if c.get("from") in ("gpt", "assistant")), "")
    return dict(key=rec.get("id"), text=answer, image=rec.get("image"), audio=rec.get("audio"),
                meta={"conversations": conv})


def _flat(rec: dict, columns: dict[str, str]) -> dict:
    get = lambda name: rec.get(columns.get(name, name))  # noqa: E731
    misc = rec.get("misc") if isinstance(rec.get("misc"), dict) else {}
    return dict(key=get("key") or rec.get("id") or misc.get("key"), text=get("text"),
                audio=get("audio"), image=get("image"), speaker=get("speaker") or "",
                offset_s=float(get("offset") or 0.0), duration_s=get("duration"))


def _table_records(path: Path, fmt: str) -> Iterator[tuple[Any, str | None]]:
    if fmt == "parquet":
        import pyarrow.parquet as pq
        for rec in pq.read_table(path).to_pylist():
            yield rec, None
        return
    with open(path, newline="", encoding="utf-8") as f:
        dialect = "excel-tab" if path.suffix.lower() == ".tsv" else "excel"
        for rec in csv.DictReader(f, dialect=dialect):
            yield {k: (v if v != "" else None) for k, v in rec.items()}, None


def read_manifest(path: str | Path, root: str | Path | None = None, fmt: str | None = None,
                  columns: dict[str, str] | None = None, require_text: bool = True) -> list[Request]:
    """Read a manifest into Requests (one per row, input order).

    Args:
        path: manifest file (``.jsonl``/``.json``/``.csv``/``.tsv``/``.parquet``).
        root: folder that relative media paths are relative to (default: the manifest's folder).
        fmt: one of :data:`FORMATS`; default: :func:`detect_format`.
        columns: for jsonl/csv/parquet, maps our names (key, text, audio, image, speaker, offset,
            duration) to the file's column names.
        require_text: reject rows whose text is empty (reason ``empty_text``).

    Raises ``FileNotFoundError`` for a missing manifest and ``ValueError`` for an unknown format or
    a JSON list that does not parse; a single bad row never raises.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"manifest {path} does not exist")
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown manifest format {fmt!r}; known: {', '.join(FORMATS)}")
    base = Path(os.path.abspath(root if root else path.parent))  # sources are recorded absolute
    columns = columns or {}
    records = _table_records(path, fmt) if fmt in ("csv", "parquet") else _json_records(path)
    out: list[Request] = []
    seen: set[str] = set()
    for row, (rec, err) in enumerate(records):
        if err is not None or not isinstance(rec, dict):
            detail = err or f"row {row}: expected an object, got {type(rec).__name__}"
            line = detail.split(":")[0].replace(" ", "-") if err else f"row-{row}"
            out.append(Request(row=row, key=line, error=(schema.MALFORMED_ROW, detail)))
            continue
        flat = _chatml(rec) if fmt == "chatml" else _llava(rec) if fmt == "llava" else _flat(rec, columns)
        audio = str(base / flat["audio"]) if flat.get("audio") else None
        image = str(base / flat["image"]) if flat.get("image") else None
        raw_key = flat.get("key")
        key = schema.safe_key(raw_key) if raw_key not in (None, "") else _hash_key(flat.get("audio"), flat.get("image"))
        meta = dict(flat.get("meta") or {})
        if raw_key not in (None, "") and str(raw_key) != key:
            meta["original_key"] = str(raw_key)
        req = Request(row=row, key=key, text=str(flat.get("text") or ""), audio=audio, image=image,
                      speaker=str(flat.get("speaker") or ""), offset_s=float(flat.get("offset_s") or 0.0),
                      duration_s=None if flat.get("duration_s") is None else float(flat["duration_s"]),
                      meta=meta)
        if audio is None and image is None:
            req.error = (schema.MALFORMED_ROW, f"row {row}: no audio and no image")
        elif key in seen:
            req.error = (schema.DUPLICATE_KEY, f"row {row}: key {key!r} already used by an earlier row")
        elif require_text and not req.text.strip():
            req.error = (schema.EMPTY_TEXT, f"row {row}: text is empty")
        seen.add(key)
        out.append(req)
    return out
