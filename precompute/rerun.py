"""Reruns that follow the manifest: which committed chunks still hold what the manifest says.

Every committed chunk records, in its index part's job metadata (:func:`chunk_meta`), for each manifest row
it covered: the row's **id**, its **digest**, the sample **key** it was written under (None: rejected) and
its **sources** (each media file's path, size, modification time and, with ``source_digest: content``, the
sha256 of its bytes).

* The **id** comes from the manifest, never from the keys the job assigns (:func:`row_ids`): a row with its
  own key is ``key:`` + that key as written; a row without one is ``window:`` + the hash of its sources with
  their windows (offset, duration), inline audio bytes, text and turns
  (:func:`precompute.keys.identity_key`); a row the reader could not parse is ``key:`` + the key it names
  (else its position). Reordering, inserting, fixing or removing rows never changes another row's id (only
  rows claiming one id are numbered ``#2``, ``#3``... in order: a key repeated in the manifest).
* The **digest** (:func:`row_digest`) covers everything the row says but its position, the decisions the job
  takes about it across rows (the sample key it gets, a reject reason found while reading), and the
  ``filter`` options that decide it (:func:`precompute.identity.filter_values`: the audio filters for a row
  with audio, the image filters for one with images, the row filters for every row).
* The **sources** are compared by what ``source_digest`` asks (:func:`sources_unchanged`): ``stat``, size
  and modification time; ``content``, the sha256 (recorded in either mode when it was read; a file recorded
  by stat alone counts as unchanged while its size and modification time are). Switching the mode re-encodes
  nothing that did not change.

On a rerun :func:`plan_rerun` compares the committed chunks with the manifest:

* a chunk whose rows are all in the manifest, unchanged, is **kept** as it is;
* a chunk holding a changed row (a corrected transcript or media path, a replaced media file, a filter
  that now decides it, another sample key) or a row no longer in the manifest is **stale**: it is deleted
  (tar, parts, sidecars of added fields) and its rows still in the manifest are encoded again. A chunk is
  the unit of work, so the unchanged rows of a stale chunk are re-encoded with it (counted apart);
* with ``keep_removed_rows: true`` a row no longer in the manifest does not make its chunk stale: it stays
  in the cache with the same bytes, and the job says how many such rows it kept. When its chunk is stale for
  another reason, its sample is carried (read before the chunk is deleted) into a chunk of its own
  (:func:`carry_removed`, :func:`write_carried`); only a row of the manifest that now takes its sample key
  removes it (the manifest wins: the cache never holds a key twice);
* rows in no committed chunk are **added** (new chunks, numbered after every chunk there is).

A chunk committed by an older version (no ``rows_version`` 2) is stale: it is redone once. So is a chunk
holding a reject an older version wrote for an infrastructure fault (a codec process that died mid-job:
:func:`precompute.faults.legacy_infrastructure_rejects`): the fault was not the row's, the row is tried again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from shards import npz, schema

from .keys import identity_key
from .manifests import Request

log = logging.getLogger("precompute")

#: the values of the option ``source_digest``: what a rerun compares of each media file
SOURCE_DIGESTS = ("stat", "content")
#: the version of the per-row record of a chunk (:func:`chunk_meta`)
ROWS_VERSION = 2


@dataclass(frozen=True)
class RowRecord:
    """What a chunk records of one manifest row: ``id`` (:func:`row_ids`), ``digest`` (:func:`row_digest`),
    ``key`` (the sample key; None once the row was rejected) and ``sources`` (:func:`sources`)."""

    id: str
    digest: str
    key: str | None
    sources: tuple


def _own_id(req: Request) -> str:
    """A row's identity from the manifest alone (see the module docstring)."""
    conv = req.conversation
    if conv is None:  # not parsed: the key it names, else its position (nothing else is known of it)
        return "key:" + req.key
    raw = req.meta.get("original_key", req.key)  # the key as the manifest wrote it (before suffixes)
    if raw == identity_key(conv, req.speaker):
        return "window:" + raw
    return "key:" + raw


def row_ids(requests: Iterable[Request]) -> list[str]:
    """The id of each row (:func:`_own_id`); ``ID#N`` for the N-th row (N >= 2) claiming an id already seen."""
    seen: dict[str, int] = {}
    out = []
    for r in requests:
        own = _own_id(r)
        n = seen[own] = seen.get(own, 0) + 1
        out.append(own if n == 1 else f"{own}#{n}")
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(4 << 20):
            h.update(b)
    return h.hexdigest()


def sources(req: Request, source_digest: str = "stat") -> tuple:
    """``(path, size, mtime_ns, sha256 or None)`` of each media file of a row (``sha256`` with
    ``source_digest: content`` only); ``(path, None, None, None)`` for a file that cannot be read."""
    if source_digest not in SOURCE_DIGESTS:
        raise ValueError(f"source_digest {source_digest!r}: choose from {SOURCE_DIGESTS}")
    out = []
    for path in ([] if req.conversation is None else [s for s in req.conversation.sources if not s.startswith("<")]):
        try:
            st = os.stat(path)
            out.append((path, st.st_size, st.st_mtime_ns, _sha256(path) if source_digest == "content" else None))
        except OSError:
            out.append((path, None, None, None))
    return tuple(out)


def sources_unchanged(recorded: Iterable, now: Iterable, source_digest: str) -> bool:
    """Whether a row's media files are what its chunk recorded: the same paths; with ``stat`` the same size and
    modification time; with ``content`` the same sha256 where one was recorded, else the same size and
    modification time (the file was not touched since it was read)."""
    recorded, now = [tuple(x) + (None,) * (4 - len(x)) for x in recorded], list(now)
    if [r[0] for r in recorded] != [n[0] for n in now]:
        return False
    for (_, size, mtime, sha), (_, size_now, mtime_now, sha_now) in zip(recorded, now):
        if source_digest == "content" and sha is not None and sha_now is not None:
            if sha != sha_now:
                return False
        elif (size, mtime) != (size_now, mtime_now):
            return False
    return True


def _plain(value: Any) -> Any:
    """JSON-able form of a row's values (bytes, e.g. a base64 ``raw_audio``, as their sha256)."""
    if isinstance(value, (bytes, bytearray)):
        return {"sha256": hashlib.sha256(value).hexdigest()}
    return repr(value)


def row_digest(req: Request, filters: dict[str, dict] | None = None) -> str:
    """sha256 (hex) of what manifest row ``req`` says (all of it but its position: ``row``, the ``row`` of its
    metadata, the line or row number in a reject's detail), of what the job decided about it across rows (its
    sample key, the reason of a reject found while reading) and of the ``filters`` values that decide it
    (scope -> ``{option: value}``, :func:`precompute.identity.filter_values`: ``row`` for every parsed row,
    ``audio`` / ``image`` for a row with audio / images). Its media files are compared apart (:func:`sources`)."""
    filters = filters or {}
    row = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)
           if f.name not in ("row", "conversation", "error", "meta")}
    row["meta"] = {k: v for k, v in req.meta.items() if k != "row"}
    row["reject"] = req.error[0] if req.error else None
    conv = req.conversation
    row["conversation"] = None if conv is None else dataclasses.asdict(conv)
    decided = {}
    if conv is not None and req.error is None:
        scopes = ["row"] + (["audio"] if conv.audio else []) + (["image"] if conv.images else [])
        decided = {s: filters.get(s, {}) for s in scopes}
    text = json.dumps({"row": row, "filters": decided}, sort_keys=True, ensure_ascii=False, default=_plain)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def chunk_meta(records: list[RowRecord], kept_keys: Iterable[str]) -> dict[str, Any]:
    """The job metadata a committed chunk records (see the module docstring); ``kept_keys``: the keys the
    chunk wrote samples for (the other rows were rejected)."""
    kept = set(kept_keys)
    return {"rows_version": ROWS_VERSION, "rows": [r.id for r in records], "digests": [r.digest for r in records],
            "keys": [r.key if r.key in kept else None for r in records],
            "sources": [[list(s) for s in r.sources] for r in records]}


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
    old_chunks: int = 0  #: stale chunks committed by an older version (no per-row records)
    #: rows an older version rejected for an infrastructure fault, tried again (their chunks redone)
    retried: int = 0
    key_taken: int = 0   #: removed rows not kept because a row of the manifest now has their key
    #: stale chunk stem -> the records ``(id, digest, key, sources)`` of its removed rows kept (carried over)
    carry: dict[str, list[tuple]] = field(default_factory=dict)

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
        if self.key_taken:
            s += f"; {self.key_taken} removed row(s) not kept: a row of the manifest now has their key"
        if self.old_chunks:
            s += f"; {self.old_chunks} chunk(s) written by an older version redone"
        if self.retried:
            s += (f"; {self.retried} row(s) an older version rejected for an infrastructure fault (a process or "
                  "device that failed, not the row) tried again with their chunks")
        return s


def _records(meta: dict) -> list[tuple] | None:
    """A chunk's per-row records ``(id, digest, key, sources)``, None when it has none of this version."""
    rows = meta.get("rows")
    if meta.get("rows_version") != ROWS_VERSION or not isinstance(rows, list):
        return None
    cols = [meta.get(k) for k in ("digests", "keys", "sources")]
    if not all(isinstance(c, list) and len(c) == len(rows) for c in cols):
        return None
    return list(zip(rows, *cols))


def plan_rerun(requests: list[Request], done: dict[str, dict | None], *, source_digest: str = "stat",
               keep_removed: bool = False, filters: dict[str, dict] | None = None,
               retry: dict[str, int] | None = None) -> tuple[RerunPlan, list[RowRecord]]:
    """Compare the committed chunks ``done`` (stem -> the job metadata of its index part) with the
    manifest rows ``requests`` (``filters``: :func:`precompute.identity.filter_values` of the job).
    ``retry``: stem -> how many rejects of that chunk an older version wrote for an infrastructure fault
    (:func:`precompute.faults.legacy_infrastructure_rejects`): those chunks are stale too, their rows tried again.

    Returns ``(plan, records)``: the :class:`RerunPlan` and each request's :class:`RowRecord` (in request
    order, recorded by the chunks this run commits).
    """
    ids = row_ids(requests)
    records = [RowRecord(i, row_digest(r, filters), r.key if r.error is None else None, sources(r, source_digest))
               for i, r in zip(ids, requests)]
    now = {rec.id: rec for rec in records}
    plan = RerunPlan()
    seen: set[str] = set()
    chunks: dict[str, list[tuple]] = {}
    for stem in sorted(done):
        recs = _records(done[stem] or {})
        if recs is None:
            plan.stale.append(stem)
            plan.old_chunks += 1
            rows = list((done[stem] or {}).get("rows") or [])
            seen.update(rows)
            plan.reencoded_with_chunk += sum(r in now for r in rows)
            plan.removed += sum(r not in now for r in rows)
            continue
        seen.update(r[0] for r in recs)
        chunks[stem] = recs

    def changed(rec: tuple) -> bool:
        cur = now[rec[0]]
        return cur.digest != rec[1] or not sources_unchanged(rec[3], cur.sources, source_digest)

    stale = {stem for stem, recs in chunks.items()
             if any(changed(r) for r in recs if r[0] in now) or (not keep_removed and any(r[0] not in now for r in recs))}
    again = {stem: n for stem, n in (retry or {}).items() if stem in chunks}  # (old chunks are stale already)
    stale |= set(again)
    plan.retried = sum(again.values())
    taken: set[str] = set()
    while keep_removed:  # a removed row kept must not hold a key a row to encode now takes
        covered = {r[0] for stem, recs in chunks.items() if stem not in stale for r in recs}
        wanted = {rec.key for rec in records if rec.id not in covered and rec.key is not None}
        clash = {stem for stem, recs in chunks.items() if stem not in stale
                 and any(r[0] not in now and r[2] is not None and r[2] in wanted for r in recs)}
        if not clash:
            break
        taken |= {r[0] for stem in clash for r in chunks[stem] if r[0] not in now and r[2] in wanted}
        stale |= clash
    plan.key_taken = len(taken)
    for stem, recs in chunks.items():
        present = [r for r in recs if r[0] in now]
        gone = len(recs) - len(present)
        if stem in stale:
            plan.stale.append(stem)
            n_changed = sum(changed(r) for r in present)
            plan.reencoded += n_changed
            plan.reencoded_with_chunk += len(present) - n_changed
            carry = [r for r in recs if keep_removed and r[0] not in now and r[2] is not None and r[0] not in taken]
            if carry:
                plan.carry[stem] = carry
            plan.kept_removed += len(carry)
            plan.removed += gone - len(carry)
        else:
            plan.covered.update(r[0] for r in recs)
            plan.kept += len(present)
            plan.kept_removed += gone
    plan.stale.sort()
    plan.added = sum(i not in seen for i in ids)
    return plan, records


def _fields(members: dict[str, bytes]) -> dict[str, Any]:
    """A sample's tar members (``json``, ``tensors.npz``, ``NAME.npy``) as :meth:`shards.ShardWriter.add` takes
    them (its bytes written again are the same: sorted JSON, packed arrays in sorted order)."""
    out: dict[str, Any] = {}
    for name, data in members.items():
        if name == "json":
            out["json"] = json.loads(data)
        elif name == npz.MEMBER:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                out |= {f"{k}.npy": z[k] for k in z.files}
        elif name.endswith(".npy"):
            out[name] = np.load(io.BytesIO(data), allow_pickle=False)
    return out


def carry_removed(local: Path, plan: RerunPlan) -> list[tuple[RowRecord, dict[str, Any]]]:
    """The samples of the removed rows ``keep_removed_rows`` keeps from stale chunks (``plan.carry``), read
    from their tars before the chunks are deleted: ``[(record, fields)]``. A tar that is not in ``local``
    (a cache in object storage keeps none in staging) loses its removed rows, with a warning."""
    out = []
    for stem, recs in sorted(plan.carry.items()):
        path = Path(local) / f"{stem}.tar"
        if not path.exists():
            log.warning("%s is not in the local staging folder: its %d removed row(s) are not kept", path.name, len(recs))
            continue
        wanted = {r[2]: r for r in recs}
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(path) as tf:
            for m in tf:
                key, _, member = m.name.partition(".")
                if key in wanted and m.isfile():
                    members.setdefault(key, {})[member] = tf.extractfile(m).read()
        out += [(RowRecord(r[0], r[1], key, tuple(tuple(s) for s in r[3])), _fields(members[key]))
                for key, r in wanted.items() if key in members]
    return out


def carried_name(plan_names: Iterable[str], kept_stems: Iterable[str], n_rows: int, per_shard: int) -> str:
    """The shard name of the chunk the carried rows go into: after every chunk the job plans or keeps, and
    after every position of the manifest."""
    numbers = [schema.parse_shard_name(n)[1] for n in plan_names] + \
        [schema.parse_shard_name(s + ".tar")[1] for s in kept_stems] + [-(-n_rows // per_shard) - 1]
    return schema.chunk_shard_name(max(numbers) + 1)


def write_carried(output: Any, name: str, carried: list[tuple[RowRecord, dict[str, Any]]]) -> None:
    """Commit the carried samples (:func:`carry_removed`) as chunk ``name`` of ``output`` (a
    :class:`precompute.output.LocalOutput`), recording their rows as they were."""
    from shards.writer import ShardWriter
    writer = ShardWriter(output.local, name)
    for rec, fields in carried:
        writer.add(rec.key, fields)
    entry = writer.commit(chunk_meta([rec for rec, _ in carried], writer.keys))
    output.chunk_committed(name, entry is not None)


__all__ = ["SOURCE_DIGESTS", "ROWS_VERSION", "RowRecord", "RerunPlan", "plan_rerun", "row_digest", "row_ids",
           "sources", "sources_unchanged", "chunk_meta", "carry_removed", "carried_name", "write_carried"]
