"""The plan of a stage-one job over its manifest, made in memory bounded by the chunk, not by the manifest.

:meth:`ManifestPlan.build` reads the manifest once (:class:`precompute.manifests.ManifestReader`), a block of
:data:`BLOCK_ROWS` rows at a time, and keeps of each row only fixed-size columns (numpy): three 64-bit hashes
(its key after Unicode NFC normalisation, its key made safe, its rerun id), its 16-byte digest, the 16-byte
hash of its serialised form and a byte of
flags (parsed, keyless, empty text, audio, images, outside the media root). What the job needs of a row
later (its key as written, its media files' size and modification time) goes to a
*spill file* (Arrow IPC, one record batch per block, in a temporary folder of this process), read back a
block at a time. The decisions made across rows are then taken on the columns (numpy sorts), the strings
of a group read back from the spill file only where two rows share a hash (a repeated key, keys equal once
made safe: rare), so each decision is exact:

* a row whose key is an earlier row's, also after NFC normalisation, is a ``duplicate_key`` reject (the
  first row wins; an empty-text row's key counts too);
* two different keys that become one once made safe both stay: the later row gets
  :func:`precompute.keys.suffixed`, checked against every key taken (:func:`precompute.keys.assign_keys`'s
  rule, literal keys of later rows included);
* rerun ids (:mod:`precompute.rerun`): ``key:KEY`` / ``window:HASH``, the N-th row claiming one id ``ID#N``.

A row's **digest** is computed once, from its serialised form as the file holds it (the JSON line, the list
record, the CSV record's lines, the Parquet row: :mod:`precompute.readers`) and how the file is read (format,
media root, columns, header: :attr:`ManifestReader.context`), with what the job decided about it (its sample
key, a reject found while reading) and the ``filter`` options of its scopes
(:func:`precompute.identity.filter_values`): no copy of the row is made to digest it.

:meth:`ManifestPlan.requests` reads the manifest again and yields the rows (only those of the positions
asked for, with the decisions applied); each row's serialised form is hashed again and compared, so a
manifest edited while the job ran stops it (:class:`ManifestChanged`) instead of encoding rows the plan did
not see.

Memory: about 60 bytes per row in the columns (plus 8 per row while the decisions are taken) and what
:data:`BLOCK_ROWS` rows take while they are read; the spill file takes about 100 bytes per row on disk.
"""
from __future__ import annotations

import array
import copy
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import xxhash

from shards import schema

from . import chat
from .keys import identity_key, suffixed
from .manifests import ManifestReader, ReadRow, Request
from .readers import nfc
from .sources import OUTSIDE_ROOT

#: rows read, digested and spilled at once (a record batch of the spill file)
BLOCK_ROWS = 4096
#: the flags of a row (:attr:`ManifestPlan.flags`): parsed; its rerun id is ``window:`` (no key of its own, or a
#: written key equal to its identity key); no text where text is required; it has audio; images; it names media
#: outside the media root
PARSED, WINDOW, EMPTY, AUDIO, IMAGE, OUTSIDE = 1, 2, 4, 8, 16, 32
#: the values of the option ``source_digest``: what a rerun compares of each media file
SOURCE_DIGESTS = ("stat", "content")
_SPILL = pa.schema([("raw", pa.string()), ("sources", pa.string())])
_IDENTITY_KEY = __import__("re").compile(r"h[0-9a-f]{16}")


class ManifestChanged(ValueError):
    """The manifest read again (to encode its rows) is not the manifest the job planned from: it was edited
    while the job ran. Nothing of the changed rows was written; run the job again."""


def _h(text: str) -> int:
    """The 64-bit hash of ``text`` (XXH3) the columns hold."""
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


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


def is_window(r: ReadRow) -> bool:
    """Whether a parsed row's rerun id is ``window:`` + its identity key (:mod:`precompute.rerun`): it has no
    key of its own, or its written key is its identity key (only a key of the identity keys' shape is hashed
    to tell)."""
    return r.keyless or bool(_IDENTITY_KEY.fullmatch(r.raw) and r.raw == identity_key(r.req.conversation, r.req.speaker))


def own_id(raw: str, window: bool) -> str:
    """A row's rerun id from the manifest alone (:mod:`precompute.rerun`): ``key:`` + its key as written (or
    the name of a row that cannot be parsed), ``window:`` + its identity key (:func:`is_window`)."""
    return ("window:" if window else "key:") + raw


def _strings(values: list[str]) -> pa.Array:
    """An Arrow string array of ``values`` built from its buffers (``pa.array`` of a list imports pandas)."""
    data = [v.encode("utf-8") for v in values]
    offsets = array.array("i", [0])
    offsets.extend(itertools.accumulate(map(len, data)))
    return pa.Array.from_buffers(pa.string(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))])


def _scopes(filters: dict[str, dict]) -> dict[int, bytes]:
    """The JSON of the filter values in a row's digest, by the row's media flags (AUDIO | IMAGE)."""
    out = {}
    for flags in (0, AUDIO, IMAGE, AUDIO | IMAGE):
        scopes = ["row"] + (["audio"] if flags & AUDIO else []) + (["image"] if flags & IMAGE else [])
        out[flags] = json.dumps({s: filters.get(s, {}) for s in scopes}, sort_keys=True, default=str).encode()
    return out


def _groups(h: np.ndarray, idx: np.ndarray) -> Iterator[np.ndarray]:
    """The positions of ``idx`` (ascending) that share a value of ``h`` with another, one array per value
    (ascending): the candidates of a decision across rows, to be checked on their strings."""
    if len(idx) < 2:
        return
    hv = h[idx]
    order = np.argsort(hv, kind="stable")
    s = hv[order]
    brk = np.flatnonzero(s[1:] != s[:-1]) + 1
    starts, ends = np.r_[0, brk], np.r_[brk, len(s)]
    for a, b in zip(starts[ends - starts > 1], ends[ends - starts > 1]):
        yield idx[order[a:b]]


@dataclass
class Stats:
    """What the plan counted while reading: rows, rows outside the media root (and the first one's
    detail), the media kinds the conversations hold (:func:`precompute.chat.needed_kinds`)."""

    rows: int = 0
    outside: int = 0
    first_outside: str = ""
    kinds: frozenset[str] = frozenset()


class ManifestPlan:
    """A manifest planned in bounded memory (see the module docstring). Build with :meth:`build` (a context
    manager: the spill file is deleted on exit).

    Attributes:
        reader: the :class:`~precompute.manifests.ManifestReader`.
        n: rows. ``flags``: uint8 ``(n,)``; ``digest``: uint8 ``(n, 16)``; ``h_id``: uint64 ``(n,)`` hash of
            each row's rerun id; ``h_key``: uint64 ``(n,)`` hash of each row's sample key (rows kept so far).
        rejected: bool ``(n,)``: rejected while reading (not parsed, a repeated key, empty text).
        dup: position -> the earlier row's key where the keys are equal after NFC normalisation only
            (None: the same key).
        renamed: position -> its sample key where it differs from its key made safe (a suffix).
        numbered: position -> N of its id ``ID#N`` (N >= 2).
        stats: :class:`Stats`.
    """

    def __init__(self, reader: ManifestReader, source_digest: str, filters: dict[str, dict], folder: Path):
        self.reader, self.source_digest, self.filters, self._folder = reader, source_digest, filters, folder
        self._scopes = _scopes(filters)
        self.dup: dict[int, str | None] = {}
        self.renamed: dict[int, str] = {}
        self.numbered: dict[int, int] = {}
        self.stats = Stats()
        self._spill_file: Any = None
        self._key_index: tuple[np.ndarray, np.ndarray] | None = None
        self._block: tuple[int, pa.RecordBatch] | None = None

    # ---- building --------------------------------------------------------------------------------------

    @classmethod
    def build(cls, reader: ManifestReader, *, source_digest: str = "stat", filters: dict[str, dict] | None = None,
              spill_dir: str | os.PathLike | None = None) -> "ManifestPlan":
        """Read the manifest once and take the decisions across rows (see the module docstring).
        ``spill_dir``: where the spill file's temporary folder goes (default: the system's temporary
        folder). Raises as :class:`~precompute.manifests.ManifestReader` does."""
        if source_digest not in SOURCE_DIGESTS:
            raise ValueError(f"source_digest {source_digest!r}: choose from {SOURCE_DIGESTS}")
        folder = Path(tempfile.mkdtemp(prefix="shardcache-plan-", dir=spill_dir))
        plan = cls(reader, source_digest, filters or {}, folder)
        try:
            plan._read()
            plan._decide()
        except BaseException:
            plan.close()
            raise
        return plan

    def __enter__(self) -> "ManifestPlan":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete the spill file."""
        self._block = None
        self._spill_file = None
        shutil.rmtree(self._folder, ignore_errors=True)

    @property
    def _spill(self) -> Path:
        return self._folder / "rows.arrow"

    def _read(self) -> None:
        flags, digest = bytearray(), bytearray()
        h_nfc, h_safe, h_own = array.array("Q"), array.array("Q"), array.array("Q")
        context = self.reader.context.encode("utf-8", "surrogatepass") + b"\0"
        scopes, stats, source_digest = self._scopes, self.stats, self.source_digest
        kinds: set[str] = set()
        raws: list[str] = []
        srcs: list[str] = []
        cdigs = bytearray()
        with pa.OSFile(str(self._spill), "wb") as sink, pa.ipc.new_file(sink, _SPILL) as spill:
            def flush() -> None:
                spill.write_batch(pa.record_batch([_strings(raws), _strings(srcs)], schema=_SPILL))
                raws.clear(), srcs.clear()

            for r in self.reader.rows():
                req, raw = r.req, r.raw
                cdig = hashlib.sha256(context + r.text.encode("utf-8", "surrogatepass")).digest()[:16]
                f = 0
                if raw is not None:
                    conv = req.conversation
                    window = is_window(r)
                    f = PARSED | (WINDOW if window else 0) | (EMPTY if r.empty else 0) | \
                        (AUDIO if conv.audio else 0) | (IMAGE if conv.images else 0)
                    if (conv.audio or conv.images) and len(kinds) < len(chat.KINDS):
                        kinds |= chat.needed_kinds([conv])
                    h_nfc.append(_h(nfc(raw)))
                    h_safe.append(_h(req.key))
                    h_own.append(_h(own_id(raw, window)))
                    reason = schema.EMPTY_TEXT if r.empty else None
                else:
                    raw = req.key
                    if OUTSIDE_ROOT in req.error[1]:
                        f = OUTSIDE
                        stats.outside += 1
                        stats.first_outside = stats.first_outside or req.error[1]
                    h_nfc.append(0)
                    h_safe.append(0)
                    h_own.append(_h("key:" + raw))
                    reason = req.error[0]
                flags.append(f)
                digest += self._digest(cdig, req.key, reason, f)
                raws.append(raw)
                cdigs += cdig
                srcs.append(json.dumps(sources(req, source_digest)))
                if len(raws) == BLOCK_ROWS:
                    flush()
            if raws or not flags:
                flush()
        self.n = stats.rows = len(flags)
        stats.kinds = frozenset(kinds)
        # numpy views of the buffers filled above (no copy): the columns
        self.flags = np.frombuffer(flags, np.uint8)
        self.digest = np.frombuffer(digest, np.uint8).reshape(-1, 16)
        self.cdig = np.frombuffer(cdigs, np.uint8).reshape(-1, 16)
        self._h_nfc = np.frombuffer(h_nfc, np.uint64)
        self.h_key = np.frombuffer(h_safe, np.uint64)
        self._h_own = np.frombuffer(h_own, np.uint64)

    def _digest(self, cdig: bytes, key: str, reason: str | None, f: int) -> bytes:
        """A row's digest: its serialised form (``cdig``), its sample key, its reject reason and the filter
        values of its scopes (a row rejected while reading is decided by no filter)."""
        scope = self._scopes[f & (AUDIO | IMAGE)] if f & PARSED and reason is None else b"{}"
        return hashlib.sha256(cdig + b"\0" + key.encode("utf-8", "surrogatepass") + b"\0" +
                              (reason or "").encode() + b"\0" + scope).digest()[:16]

    def _decide(self) -> None:
        """The decisions across rows (see the module docstring), on the columns."""
        parsed = (self.flags & PARSED) != 0
        # a repeated key (also after NFC normalisation): the first row keeps it
        groups = list(_groups(self._h_nfc, np.flatnonzero(parsed)))
        raw_of = self._raws_of(groups)
        for g in groups:
            seen: dict[str, str] = {}
            for p in g.tolist():
                raw = raw_of[p]
                k = nfc(raw)
                earlier = seen.get(k)
                if earlier is not None:
                    self.dup[p] = None if earlier == raw else earlier
                seen.setdefault(k, raw)
        del self._h_nfc
        rejected = ~parsed | ((self.flags & EMPTY) != 0)
        if self.dup:
            rejected[np.fromiter(self.dup, np.int64, len(self.dup))] = True
        self.rejected = rejected
        # two keys that are one once made safe: the later row gets a suffix no other row's key is
        wanted = np.flatnonzero(~rejected)
        later: list[tuple[int, str, str]] = []
        groups = list(_groups(self.h_key, wanted))
        raw_of = self._raws_of(groups)
        for g in groups:
            taken: set[str] = set()
            for p in g.tolist():
                raw = raw_of[p]
                safe = schema.safe_key(raw)
                if safe in taken:
                    later.append((p, safe, raw))
                taken.add(safe)
        if later:
            literal = np.sort(self.h_key[wanted])
            given: set[str] = set()

            def taken_by_a_row(key: str) -> bool:
                h = np.uint64(_h(key))
                i = int(np.searchsorted(literal, h))
                if i == len(literal) or literal[i] != h:
                    return False
                cand = wanted[self.h_key[wanted] == h]
                return any(schema.safe_key(raw) == key for raw in self.raws(cand))

            for p, safe, raw in sorted(later):
                attempt, key = 0, suffixed(safe, raw)
                while key in given or taken_by_a_row(key):
                    attempt += 1
                    key = suffixed(safe, raw, attempt)
                given.add(key)
                self.renamed[p] = key
            self.h_key = self.h_key.copy()
            for p, key in self.renamed.items():
                self.h_key[p] = _h(key)
        # rerun ids: the N-th row claiming one id is ID#N
        self.h_id = self._h_own
        del self._h_own
        groups = list(_groups(self.h_id, np.arange(self.n)))
        raw_of = self._raws_of(groups)
        for g in groups:
            count: dict[str, int] = {}
            for p in g.tolist():
                own = own_id(raw_of[p], bool(self.flags[p] & WINDOW))
                n = count[own] = count.get(own, 0) + 1
                if n > 1:
                    self.numbered[p] = n
        if self.numbered:
            self.h_id = self.h_id.copy()  # (a view of the read buffer until now)
        for p, n in self.numbered.items():
            self.h_id[p] = _h(f"{self.id_of(p, numbered=False)}#{n}")
        self._id_order = np.argsort(self.h_id, kind="stable").astype(np.int32 if self.n < 2**31 else np.int64)
        self._id_sorted = self.h_id[self._id_order]
        del self.h_id  # (the sorted hashes answer :meth:`find`)
        # the digests the decisions changed (a repeated key, a suffixed key)
        for p in sorted(set(self.dup) | set(self.renamed)):
            raw, cdig = self._row(p)[0], bytes(self.cdig[p])
            reason = schema.DUPLICATE_KEY if p in self.dup else (schema.EMPTY_TEXT if self.flags[p] & EMPTY else None)
            self.digest[p] = np.frombuffer(self._digest(cdig, self.key_of(p, raw), reason, int(self.flags[p])), np.uint8)

    # ---- reading back ----------------------------------------------------------------------------------

    def _batch(self, b: int) -> tuple[list, list, list]:
        """Block ``b`` of the spill file as lists (the one block held)."""
        if self._block is None or self._block[0] != b:
            if self._spill_file is None:
                self._spill_file = pa.ipc.open_file(pa.OSFile(str(self._spill), "rb"))
            batch = self._spill_file.get_batch(b)
            self._block = (b, tuple(batch.column(i).to_pylist() for i in range(2)))
        return self._block[1]

    def _row(self, p: int) -> tuple[str, str]:
        """``(raw key or name, sources JSON)`` of row ``p`` from the spill file."""
        cols = self._batch(p // BLOCK_ROWS)
        i = p % BLOCK_ROWS
        return cols[0][i], cols[1][i]

    def raws(self, positions: Iterable[int]) -> list[str]:
        """The key as written (or the name of a row not parsed) of each position (the spill file read a block
        at a time, in the order of the positions)."""
        positions = [int(p) for p in positions]
        got = self._raws_of([np.asarray(positions, np.int64)])
        return [got[p] for p in positions]

    def _raws_of(self, groups: list[np.ndarray]) -> dict[int, str]:
        """position -> raw key of every position of ``groups``, each block of the spill file read once."""
        if not groups:
            return {}
        out: dict[int, str] = {}
        for p in np.unique(np.concatenate(groups)).tolist():
            out[p] = self._row(p)[0]
        return out

    def key_of(self, p: int, raw: str | None = None) -> str:
        """Row ``p``'s sample key (rejected rows: the key they are named by)."""
        if p in self.renamed:
            return self.renamed[p]
        raw = self._row(p)[0] if raw is None else raw
        return schema.safe_key(raw) if self.flags[p] & PARSED else raw

    def id_of(self, p: int, numbered: bool = True, raw: str | None = None) -> str:
        """Row ``p``'s rerun id."""
        own = own_id(self._row(p)[0] if raw is None else raw, bool(self.flags[p] & WINDOW))
        return f"{own}#{self.numbered[p]}" if numbered and p in self.numbered else own

    def rows_with_key(self, key: str) -> list[int]:
        """The positions of the rows not rejected while reading whose sample key is ``key`` (a sorted index of
        the key hashes, built on first use)."""
        if self._key_index is None:
            ok = np.flatnonzero(~self.rejected)
            order = np.argsort(self.h_key[ok], kind="stable")
            self._key_index = (ok[order], self.h_key[ok][order])
        at, hs = self._key_index
        h = np.uint64(_h(key))
        i, j = int(np.searchsorted(hs, h, "left")), int(np.searchsorted(hs, h, "right"))
        return [int(p) for p in at[i:j] if self.key_of(int(p)) == key]

    def any_image(self) -> bool:
        """Whether a row not rejected while reading has an image."""
        return bool(np.any(((self.flags & IMAGE) != 0) & ~self.rejected))

    def find(self, row_id: str) -> int | None:
        """The position of the (last) row whose rerun id hashes as ``row_id`` does, or None. A 64-bit hash
        shared by two ids can only make a rerun re-encode a row (its digest is compared too), never keep one."""
        return self.find_all([row_id])[0]

    def find_all(self, row_ids: list[str]) -> list[int | None]:
        """:meth:`find` of each of ``row_ids`` (one sorted search for all of them)."""
        if not row_ids:
            return []
        h = np.fromiter((_h(r) if isinstance(r, str) else 0 for r in row_ids), np.uint64, len(row_ids))
        i = np.searchsorted(self._id_sorted, h, side="right") - 1
        ok = (i >= 0) & (self._id_sorted[np.maximum(i, 0)] == h)
        pos = self._id_order[np.maximum(i, 0)]
        return [int(p) if hit else None for p, hit in zip(pos.tolist(), ok.tolist())]

    def sources_of(self, p: int) -> tuple:
        """Row ``p``'s media files as :func:`sources` recorded them when the plan was made."""
        return tuple(tuple(s) for s in json.loads(self._row(p)[1]))

    def sources_text(self, p: int) -> str:
        """:meth:`sources_of` as the JSON text the spill file holds (``json.dumps`` of the list)."""
        return self._row(p)[1]

    def record(self, p: int):
        """Row ``p``'s :class:`precompute.rerun.RowRecord` (what a chunk records of it)."""
        from .rerun import RowRecord
        raw, src = self._row(p)
        key = None if self.rejected[p] else self.key_of(p, raw)
        return RowRecord(self.id_of(p, raw=raw), bytes(self.digest[p]).hex(), key,
                         tuple(tuple(s) for s in json.loads(src)))

    def records(self, positions: Iterable[int]) -> list:
        return [self.record(int(p)) for p in positions]

    def view(self) -> "ManifestPlan":
        """The plan with a spill reader of its own (for another thread or process: the shard writer)."""
        other = copy.copy(self)
        other._spill_file, other._block = None, None
        return other

    def requests(self, positions: Iterable[int] | None = None, *, check: bool = True
                 ) -> Iterator[tuple[int, Request]]:
        """``(position, request)`` of the rows at ``positions`` (ascending ints, read as they are needed; None:
        every row), the manifest read again with the decisions across rows applied (a repeated key rejected,
        empty text rejected, a suffixed key with the key as written in ``original_key``). ``check``: compare
        each row's digest with the plan's (raises :class:`ManifestChanged`)."""
        want = None if positions is None else iter(positions)
        nxt = -1 if want is None else next(want, None)
        if nxt is None:
            return
        context = self.reader.context.encode("utf-8", "surrogatepass") + b"\0"
        p = -1
        keep = None if want is None else (lambda q: q == nxt)
        for p, r in enumerate(self.reader.rows(warn=False, keep=keep)):
            if r is None:
                continue
            if p >= self.n:
                raise ManifestChanged(f"{self.reader.path}: the manifest has more rows than when the job read it "
                                      f"({self.n}): it was edited while the job ran; run it again")
            req = self._apply(p, r)
            if check and hashlib.sha256(context + r.text.encode("utf-8", "surrogatepass")).digest()[:16] \
                    != bytes(self.cdig[p]):
                raise ManifestChanged(f"{self.reader.path}: row {p} is not what it was when the job read the "
                                          "manifest: it was edited while the job ran; run the job again")
            yield p, req
            if want is not None:
                nxt = next(want, None)
                if nxt is None:
                    return
        if want is not None or p + 1 != self.n:
            raise ManifestChanged(f"{self.reader.path}: the manifest has fewer rows than when the job read it "
                                  f"({self.n}): it was edited while the job ran; run it again")

    def _apply(self, p: int, r: ReadRow) -> Request:
        req = r.req
        if r.raw is None:
            return req
        if p in self.dup:
            earlier = self.dup[p]
            req.error = (schema.DUPLICATE_KEY, f"row {req.row}: key {r.raw!r} already used by an earlier row"
                         if earlier is None else f"row {req.row}: key {r.raw!r} is an earlier row's key {earlier!r} "
                         "after Unicode NFC normalisation (they look the same)")
        elif r.empty:
            req.error = (schema.EMPTY_TEXT, f"row {req.row}: text is empty")
        elif p in self.renamed:
            req.meta["original_key"] = req.meta.get("original_key", req.key)
            req.key = self.renamed[p]
        return req


__all__ = ["BLOCK_ROWS", "ManifestChanged", "ManifestPlan", "SOURCE_DIGESTS", "Stats", "is_window", "own_id", "sources"]
