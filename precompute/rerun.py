"""Reruns that follow the manifest: which committed chunks still hold what the manifest says.

Every committed chunk records, in its index part's job metadata, the id and the digest of each
manifest row it covered (``{"rows": [id...], "digests": [digest...]}``). A row's id is its key
(``key#2``, ``key#3``... for later rows of a manifest that repeats a key: those are rejects); its
digest (:func:`row_digest`) covers everything the row says (text, turns, media paths, windows,
speaker, the metadata stored with the sample) except its position, and its sources: each media
file's path, size and modification time (``source_digest: stat``, the default) or its bytes
(``source_digest: content``).

On a rerun :func:`plan_rerun` compares the committed chunks with the manifest:

* a chunk whose rows are all in the manifest with the same digest is **kept** as it is;
* a chunk holding a row whose digest changed (a corrected transcript, a corrected media path, a
  replaced media file) or a row no longer in the manifest is **stale**: it is deleted (tar, parts,
  sidecars of added fields) and its rows still in the manifest are encoded again. A chunk is the
  unit of work, so the unchanged rows of a stale chunk are re-encoded with it (counted apart);
* with ``keep_removed_rows: true`` a row no longer in the manifest does not make its chunk stale:
  it stays in the cache and the job says how many such rows it kept (a chunk that is stale for
  another reason is still redone, and then those rows go);
* rows in no committed chunk are **added** (new chunks, numbered after every chunk there is).

A chunk committed without digests (by an older version) is stale: it is redone once.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .manifests import Request

#: the values of the option ``source_digest``: what a rerun compares of each media file
SOURCE_DIGESTS = ("stat", "content")


def row_ids(requests: list[Request]) -> list[str]:
    """The id of each row: its key; ``key#N`` for the N-th row (N >= 2) with a key already seen."""
    seen: dict[str, int] = {}
    out = []
    for r in requests:
        n = seen[r.key] = seen.get(r.key, 0) + 1
        out.append(r.key if n == 1 else f"{r.key}#{n}")
    return out


def _source(path: str, how: str) -> list[Any]:
    """What a row's digest records of one media file: ``[path, size, mtime_ns]`` or
    ``[path, size, sha256 of the bytes]``; ``[path, None]`` for a file that cannot be read."""
    try:
        st = os.stat(path)
        if how == "stat":
            return [path, st.st_size, st.st_mtime_ns]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while b := f.read(4 << 20):
                h.update(b)
        return [path, st.st_size, h.hexdigest()]
    except OSError:
        return [path, None]


def _plain(value: Any) -> Any:
    """JSON-able form of a row's values (bytes, e.g. a base64 ``raw_audio``, as their sha256)."""
    if isinstance(value, (bytes, bytearray)):
        return {"sha256": hashlib.sha256(value).hexdigest()}
    return repr(value)


def row_digest(req: Request, source_digest: str = "stat") -> str:
    """sha256 (hex) of what manifest row ``req`` says (all of it but its position ``row``) and of
    its media files (see :data:`SOURCE_DIGESTS`). Raises ``ValueError`` for another ``source_digest``."""
    if source_digest not in SOURCE_DIGESTS:
        raise ValueError(f"source_digest {source_digest!r}: choose from {SOURCE_DIGESTS}")
    row = {f.name: getattr(req, f.name) for f in dataclasses.fields(req) if f.name not in ("row", "conversation")}
    conv = req.conversation
    row["conversation"] = None if conv is None else dataclasses.asdict(conv)
    sources = [] if conv is None else [_source(s, source_digest) for s in conv.sources if not s.startswith("<")]
    text = json.dumps({"row": row, "sources": sources}, sort_keys=True, ensure_ascii=False, default=_plain)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class RerunPlan:
    """What a rerun keeps and redoes. ``covered``: row ids held by the chunks kept; ``stale``: the
    chunk stems to delete and encode again. Counts of manifest rows: ``kept`` (in a kept chunk),
    ``reencoded`` (changed since their chunk was written), ``reencoded_with_chunk`` (unchanged,
    re-encoded because their chunk is stale), ``added`` (in no committed chunk); of cached rows no
    longer in the manifest: ``removed`` and ``kept_removed`` (kept with ``keep_removed_rows``)."""

    covered: set[str] = field(default_factory=set)
    stale: list[str] = field(default_factory=list)
    kept: int = 0
    reencoded: int = 0
    reencoded_with_chunk: int = 0
    removed: int = 0
    kept_removed: int = 0
    added: int = 0
    old_chunks: int = 0  #: stale chunks committed without digests (by an older version)

    def counts(self) -> dict[str, int]:
        """The counts as a dict (what the job reports)."""
        return {k: getattr(self, k) for k in ("kept", "reencoded", "reencoded_with_chunk", "removed",
                                              "kept_removed", "added")}

    def describe(self) -> str:
        """One line: ``rerun: kept N, re-encoded N (+M unchanged rows of their chunks), removed N, added N``."""
        s = (f"rerun: kept {self.kept}, re-encoded {self.reencoded}"
             + (f" (+{self.reencoded_with_chunk} unchanged rows of their chunks)" if self.reencoded_with_chunk else "")
             + f", removed {self.removed}, added {self.added}")
        if self.kept_removed:
            s += f"; kept {self.kept_removed} cached rows no longer in the manifest (keep_removed_rows: true)"
        if self.old_chunks:
            s += f"; {self.old_chunks} chunk(s) written without row digests redone"
        return s


def plan_rerun(requests: list[Request], done: dict[str, dict | None], *, source_digest: str = "stat",
               keep_removed: bool = False) -> tuple[RerunPlan, list[str], list[str]]:
    """Compare the committed chunks ``done`` (stem -> the job metadata of its index part) with the
    manifest rows ``requests``.

    Returns ``(plan, ids, digests)``: the :class:`RerunPlan` and each request's id and digest (in
    request order, recorded by the chunks this run commits).
    """
    ids = row_ids(requests)
    digests = [row_digest(r, source_digest) for r in requests]
    now = dict(zip(ids, digests))
    plan = RerunPlan()
    seen: set[str] = set()
    for stem in sorted(done):
        meta = done[stem] or {}
        rows, digs = list(meta.get("rows") or []), meta.get("digests")
        seen.update(rows)
        if not isinstance(digs, list) or len(digs) != len(rows):
            plan.stale.append(stem)
            plan.old_chunks += 1
            plan.reencoded_with_chunk += sum(r in now for r in rows)
            plan.removed += sum(r not in now for r in rows)
            continue
        changed = [r for r, d in zip(rows, digs) if r in now and now[r] != d]
        gone = [r for r in rows if r not in now]
        if changed or (gone and not keep_removed):
            plan.stale.append(stem)
            plan.reencoded += len(changed)
            plan.reencoded_with_chunk += sum(r in now for r in rows) - len(changed)
            plan.removed += len(gone)
        else:
            plan.covered.update(rows)
            plan.kept += len(rows) - len(gone)
            plan.kept_removed += len(gone)
    plan.added = sum(i not in seen for i in ids)
    return plan, ids, digests


__all__ = ["SOURCE_DIGESTS", "RerunPlan", "plan_rerun", "row_digest", "row_ids"]
