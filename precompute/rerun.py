"""Reruns that follow the manifest: which committed chunks still hold what the manifest says.

Every committed chunk records, in its index part's job metadata (:func:`chunk_meta`), for each manifest row
it covered: the row's **id**, its **digest**, the sample **key** it was written under (None: rejected) and
its **sources** (each media file's path, size, modification time and, with ``source_digest: content``, the
sha256 of its bytes). The plan of the manifest (:class:`precompute.plan.ManifestPlan`) gives the same for
each row of the manifest now, in columns.

* The **id** comes from the manifest, never from the keys the job assigns (:func:`precompute.plan.own_id`):
  a row with its own key is ``key:`` + that key as written; a row without one is ``window:`` + the hash of
  its sources with their windows (offset, duration), inline audio bytes, text and turns
  (:func:`precompute.keys.identity_key`); a row the reader could not parse is ``key:`` + the key it names
  (else its position). Reordering, inserting, fixing or removing rows never changes another row's id (only
  rows claiming one id are numbered ``#2``, ``#3``... in order: a key repeated in the manifest).
* The **digest** covers the row as the manifest holds it (its serialised form and how the file is read),
  the decisions the job takes about it across rows (the sample key it gets, a reject reason found while
  reading), and the ``filter`` options that decide it (:func:`precompute.identity.filter_values`: the audio
  filters for a row with audio, the image filters for one with images, the row filters for every row).
* The **sources** are compared by what ``source_digest`` asks (:func:`sources_unchanged`): ``stat``, size
  and modification time; ``content``, the sha256 (recorded in either mode when it was read; a file recorded
  by stat alone counts as unchanged while its size and modification time are). Switching the mode re-encodes
  nothing that did not change.

On a rerun :func:`plan_rerun` compares the committed chunks with the manifest, one chunk's records at a time:

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

A chunk committed by an older version (no ``rows_version`` 3: before the digest was computed from the
serialised row) is stale: it is redone once. So is a chunk holding a reject an older version wrote for an
infrastructure fault (a codec process that died mid-job: :func:`precompute.faults.legacy_infrastructure_rejects`):
the fault was not the row's, the row is tried again.
"""
from __future__ import annotations

import io
import json
import logging
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from shards import npz, schema

from .plan import SOURCE_DIGESTS, sources

log = logging.getLogger("precompute")

#: the version of the per-row record of a chunk (:func:`chunk_meta`)
ROWS_VERSION = 3


@dataclass(frozen=True)
class RowRecord:
    """What a chunk records of one manifest row: ``id`` (:func:`precompute.plan.own_id`), ``digest`` (hex,
    :class:`precompute.plan.ManifestPlan`), ``key`` (the sample key; None once the row was rejected) and
    ``sources`` (:func:`precompute.plan.sources`)."""

    id: str
    digest: str
    key: str | None
    sources: tuple


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


def chunk_meta(records: list[RowRecord], kept_keys: Iterable[str]) -> dict[str, Any]:
    """The job metadata a committed chunk records (see the module docstring); ``kept_keys``: the keys the
    chunk wrote samples for (the other rows were rejected)."""
    kept = set(kept_keys)
    return {"rows_version": ROWS_VERSION, "rows": [r.id for r in records], "digests": [r.digest for r in records],
            "keys": [r.key if r.key in kept else None for r in records],
            "sources": [[list(s) for s in r.sources] for r in records]}


@dataclass
class RerunPlan:
    """What a rerun keeps and redoes. ``covered``: bool ``(rows,)``, the manifest rows held by the chunks
    kept; ``stale``: the chunk stems to delete and encode again. Counts of manifest rows: ``kept`` (in a kept chunk),
    ``reencoded`` (changed since their chunk was written), ``reencoded_with_chunk`` (unchanged,
    re-encoded because their chunk is stale), ``added`` (in no committed chunk); of cached rows no
    longer in the manifest: ``removed`` and ``kept_removed`` (kept with ``keep_removed_rows``)."""

    covered: Any = None
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


def plan_rerun(plan: Any, done: Mapping[str, dict | None], *, keep_removed: bool = False,
               retry: Mapping[str, int] | None = None) -> RerunPlan:
    """Compare the committed chunks ``done`` (stem -> the job metadata of its index part, read one at a time)
    with the manifest's :class:`precompute.plan.ManifestPlan` (its digests, sample keys and the media files
    it recorded; ``plan.source_digest`` says how media files are compared). ``retry``: stem -> how many
    rejects of that chunk an older version wrote for an infrastructure fault
    (:func:`precompute.faults.legacy_infrastructure_rejects`): those chunks are stale too, their rows tried
    again. Returns the :class:`RerunPlan`."""
    n, mode = plan.n, plan.source_digest
    in_cache = np.zeros(n, bool)  # the row's id is in a committed chunk
    covered = np.zeros(n, bool)
    out = RerunPlan()
    stale: dict[str, tuple[int, int, list]] = {}  # stem -> (rows present, rows changed, records of removed rows)
    with_removed: dict[str, tuple[np.ndarray, list]] = {}  # kept chunks holding removed rows: (present, removed)
    kept = 0
    for stem in sorted(done):
        meta = done[stem] or {}
        recs = _records(meta)
        if recs is None:
            out.stale.append(stem)
            out.old_chunks += 1
            rows = list(meta.get("rows") or [])
            pos = [p for p in plan.find_all(rows) if p is not None]
            in_cache[pos] = True
            out.reencoded_with_chunk += len(pos)
            out.removed += len(rows) - len(pos)
            continue
        pos = plan.find_all([r[0] for r in recs])
        present = np.array([p for p in pos if p is not None], np.int64)
        removed = [r for r, p in zip(recs, pos) if p is None]
        in_cache[present] = True
        changed = _changed(plan, [(p, r) for r, p in zip(recs, pos) if p is not None], mode)
        if changed or (removed and not keep_removed) or stem in (retry or {}):
            stale[stem] = (len(present), changed, removed)
            out.retried += (retry or {}).get(stem, 0)
        else:
            covered[present] = True
            if removed:
                with_removed[stem] = (present, removed)
            else:
                kept += len(present)
    taken: set[str] = set()
    while keep_removed and with_removed:  # a removed row kept must not hold a key a row to encode now takes
        clash = {}
        for stem, (present, removed) in with_removed.items():
            hit = [r[0] for r in removed if r[2] is not None and _wanted(plan, r[2], covered)]
            if hit:
                clash[stem] = hit
        if not clash:
            break
        for stem, hit in clash.items():
            present, removed = with_removed.pop(stem)
            covered[present] = False
            taken.update(hit)
            stale[stem] = (len(present), 0, removed)
    out.key_taken = len(taken)
    for stem, (present, changed, removed) in stale.items():
        out.stale.append(stem)
        out.reencoded += changed
        out.reencoded_with_chunk += present - changed
        carry = [r for r in removed if keep_removed and r[2] is not None and r[0] not in taken]
        if carry:
            out.carry[stem] = carry
        out.kept_removed += len(carry)
        out.removed += len(removed) - len(carry)
    for stem, (present, removed) in with_removed.items():
        kept += len(present)
        out.kept_removed += len(removed)
    out.kept = kept
    out.stale.sort()
    out.covered = covered
    out.added = int(n - in_cache.sum())
    return out


def _changed(plan: Any, pairs: list[tuple[int, tuple]], mode: str) -> int:
    """How many manifest rows ``p`` are not what a chunk recorded as ``rec`` (``pairs``): another digest (all
    compared at once), or media files that changed (:func:`sources_unchanged`)."""
    if not pairs:
        return 0
    try:
        recorded = np.frombuffer(bytes.fromhex("".join(rec[1] for _, rec in pairs)), np.uint8).reshape(-1, 16)
    except (TypeError, ValueError):  # a digest that is not 32 hex digits: that row has changed
        return sum(not isinstance(rec[1], str) or rec[1] != bytes(plan.digest[p]).hex() or
                   not sources_unchanged(rec[3], plan.sources_of(p), mode) for p, rec in pairs)
    same = (recorded == plan.digest[[p for p, _ in pairs]]).all(axis=1)
    return sum(not ok or (json.dumps(rec[3]) != plan.sources_text(p)  # equal as recorded: unchanged in either mode
                          and not sources_unchanged(rec[3], plan.sources_of(p), mode))
               for (p, rec), ok in zip(pairs, same.tolist()))


def _wanted(plan: Any, key: str, covered: np.ndarray) -> bool:
    """Whether a row of the manifest to encode now (not held by a kept chunk, not rejected) has sample key ``key``."""
    return any(not covered[p] for p in plan.rows_with_key(key))


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


__all__ = ["SOURCE_DIGESTS", "ROWS_VERSION", "RowRecord", "RerunPlan", "plan_rerun", "sources", "sources_unchanged",
           "chunk_meta", "carry_removed", "carried_name", "write_carried"]
