"""One copy: members of a batch's samples straight from the shard files into their place in the batch.

:meth:`shards.ShardReader.read_into` (implemented here) takes, per field, the batch buffer and the
*runs* its kind computed (:meth:`shards.kinds.FieldKind.runs`: which bytes of each sample's
stored array go where in the padded batch tensor). It sorts every run of the batch by file and
offset, merges neighbours into one ``os.preadv`` per stretch of a file of at most
:data:`READ_CAP` bytes beyond its first run (one buffer per run; the few hundred bytes of tar and
zip headers between two members of a sample go to a scratch buffer), and the kernel copies the
bytes from the page cache into the batch tensors: no mapping, no page faults on the source, no
intermediate array. Then each member is hashed where it landed, while it is still in cache, and
compared with the XXH3-64 the index recorded when the cache was written (:mod:`shards.checksum`).

Nothing here raises for a damaged sample: :func:`read_into` returns ``(position, message)`` for
each sample whose bytes are not what the index says (checksum mismatch, file shorter than the
member), the message naming the shard, the key and the member, so the loader can stop or skip it
(its ``skip_corrupt`` budget). A shard replaced, resized or deleted under the reader raises
:class:`~shards.errors.ShardCorrupt` at once (:meth:`shards.files.ShardFiles.check`).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .checksum import ALGORITHM, checksum_of_parts, xxh3_64_intdigest as _xxh3
from .files import IOV_MAX, read_segments

if TYPE_CHECKING:  # pragma: no cover
    from .reader import ShardReader

#: bytes between two members (of one file) that one ``preadv`` reads through into a scratch buffer
#: rather than issuing a second call: tar headers (512 B + padding), zip local headers, ``.npy``
#: headers, small members that were not asked for
READ_THROUGH = 4096
_SCRATCH = memoryview(bytearray(READ_THROUGH))
#: bytes one ``preadv`` fills at most (whole runs: a run larger than this is one call, small
#: members are grouped): the members a call completes are hashed right after it, so their bytes must
#: still be in the core's cache. One call for a whole batch (up to IOV_MAX runs, several MB) made
#: the hash read them back from memory: checksums cost 0.81-0.86 x the unchecked rate in CPU time,
#: 0.90-0.94 with 32-128 KiB calls (A/B on make bench's loader cache, 2-core EPYC VM). With two
#: read-ahead threads every call is a GIL hand-over: 256 KiB calls (a member of ~220 KiB of audio
#: in one) read 7-30 % more batches per second than 32 KiB ones, checked or not (interleaved A/B,
#: 3 runs, same cache)
READ_CAP = 256 << 10


def read_into(reader: "ShardReader", rows: np.ndarray, plans: Sequence[tuple[str, memoryview, tuple]],
              checksums: bool = True) -> list[tuple[int, str]]:
    """Copy members of index ``rows`` into batch buffers (see the module docstring).

    Args:
        reader: the :class:`~shards.ShardReader` whose index ``rows`` refers to.
        rows: int64 ``(B,)`` index row of each batch position.
        plans: per field ``(name, buf, (pos, src, dst, n))``: ``buf`` a writable flat byte
            memoryview of the field's batch tensor (storage dtype); run ``r`` copies ``n[r]`` bytes
            from byte ``src[r]`` of the stored array of ``rows[pos[r]]`` to byte ``dst[r]`` of
            ``buf`` (int64 arrays; a kind's runs times the itemsize). A sample's runs of one field
            must be in stored order and cover the whole array.
        checksums: compare each member read with the index's checksum (members whose index
            entry has none are not checked).

    Returns ``[(position, message)]``, one per damaged sample (first problem), in batch order.
    Raises :class:`~shards.errors.ShardCorrupt` when a shard was replaced, resized or deleted
    since it was pinned (or is missing).
    """
    rows = np.asarray(rows, dtype=np.int64)
    if not plans:
        return []
    B = len(rows)
    keys, offs, ns, dsts, mids, wants, known = [], [], [], [], [], [], []
    for i, (name, _, (pos, src, dst, n)) in enumerate(plans):
        fa = reader.field(name)
        r = rows[pos]
        start = fa.off[r]
        fnum = (reader.shard_of if fa.file is None else fa.file)[r].astype(np.int64)
        keys.append((fnum << _FILE_SHIFT) | start)  # the member: by file, then its offset
        offs.append(start + src)
        ns.append(n)
        dsts.append(dst)
        mids.append(pos + i * B)  # member: field i of batch position pos
        if checksums:
            wants.append(fa.xxh3[r])
            known.append(True if fa.all_summed else fa.has_sum[r])
    key, off, n, dst, mid = (np.concatenate(c) for c in (keys, offs, ns, dsts, mids))
    # by file and member, each member's runs together in stored order (a sample may come twice)
    order = np.lexsort((off, mid, key))
    key, off, n, dst, mid = key[order], off[order], n[order], dst[order], mid[order]
    file = key >> _FILE_SHIFT
    end = off + n
    new = np.ones(len(off), dtype=bool)
    if len(off) > 1:
        gap = off[1:] - end[:-1]
        new[1:] = (file[1:] != file[:-1]) | (gap < 0) | (gap > READ_THROUGH)
    first = np.flatnonzero(np.r_[True, mid[1:] != mid[:-1]])
    if checksums:
        w = np.concatenate(wants)[order][first].tolist()
        if all(k is True for k in known):
            m_want = w
        else:
            has = np.concatenate([np.broadcast_to(k, len(m)) for k, m in zip(known, mids)])[order][first]
            m_want = [x if h else None for x, h in zip(w, has.tolist())]
    else:
        m_want = [None] * len(first)
    midl = mid.tolist()
    bufs = [p[1] for p in plans]
    views = [bufs[m // B][d:d + k] for m, d, k in zip(midl, dst.tolist(), n.tolist())]
    where = _Where(reader, rows, plans)
    filel = file.tolist()
    for f in set(filel):  # one stat per file per batch: replaced or resized?
        reader.io.check(f, lambda f=f: where.first_in(f, file, mid % B))
    problems: dict[int, str] = {}
    # members: each is a run of consecutive segments; hashed right after the preadv that completes
    # it, while its bytes are still in the core's cache (a sample is ~0.4 MB, a batch many MB)
    m_first = first.tolist()
    m_last = [x - 1 for x in m_first[1:]] + [len(midl) - 1]
    mi, n_members = 0, len(m_first)
    starts = np.flatnonzero(new).tolist() + [len(off)]
    offl, endl = off.tolist(), end.tolist()
    for a, b in zip(starts[:-1], starts[1:]):
        fd = reader.io.fd(filel[a], lambda f=filel[a]: where.first_in(f, file, mid % B))
        j = a
        while j < b:  # one preadv per stretch (fewer than IOV_MAX buffers)
            s, iov, k = offl[j], [views[j]], j + 1
            prev = endl[j]
            while k < b and len(iov) < IOV_MAX - 1 and prev - s < READ_CAP:
                g = offl[k] - prev
                if g:
                    iov.append(_SCRATCH[:g])
                iov.append(views[k])
                prev = endl[k]
                k += 1
            total = prev - s
            got = read_segments(fd, s, iov, total)
            if got < total:
                size = os.fstat(fd).st_size
                for m in range(j, k):
                    q = midl[m] % B
                    if endl[m] > s + got and q not in problems:
                        problems[q] = where.short(midl[m] // B, q, size, int(_member_start(reader, plans, rows, midl[m], B)))
            while mi < n_members and m_last[mi] < k:  # the members this read completed
                want, f0, f1 = m_want[mi], m_first[mi], m_last[mi]
                mi += 1
                if want is None:
                    continue
                q = midl[f0] % B
                if problems and q in problems:
                    continue
                got_sum = _xxh3(views[f0]) if f0 == f1 else checksum_of_parts(views[f0:f1 + 1])
                if got_sum != want:
                    problems[q] = where.mismatch(midl[f0] // B, q, got_sum, want)
            j = k
    return sorted(problems.items())


#: bits of a member's sort key that hold its byte offset (the file number above them: 1 TiB per
#: shard at most)
_FILE_SHIFT = 40


def _member_start(reader, plans, rows, m: int, B: int) -> int:
    """Byte offset in its file of member ``m`` (field ``m // B`` of batch position ``m % B``)."""
    return int(reader.field(plans[m // B][0]).off[rows[m % B]])


class _Where:
    """Messages naming the shard, the sample and the member (built only when needed)."""

    def __init__(self, reader, rows, plans):
        self.reader, self.rows, self.names = reader, rows, [p[0] for p in plans]

    def _at(self, p: int, q: int) -> str:
        row = int(self.rows[q])
        fa = self.reader.field(self.names[p])
        f = int(self.reader.shard_of[row] if fa.file is None else fa.file[row])
        return f"{self.reader.io.paths[f]}: sample {self.reader.key_array[row].as_py()!r} member {self.names[p]}.npy"

    def first_in(self, f: int, file: np.ndarray, pos: np.ndarray) -> str:
        row = int(self.rows[int(pos[int(np.argmax(file == f))])])
        return f"sample {self.reader.key_array[row].as_py()!r}"

    def short(self, p: int, q: int, size: int, start: int) -> str:
        return (f"{self._at(p, q)}: the member starts at byte {start} but the file is {size} bytes now "
                "(truncated while being read?); run `shards verify`")

    def mismatch(self, p: int, q: int, got: int, want: int) -> str:
        return (f"{self._at(p, q)}: checksum mismatch ({ALGORITHM} of the bytes read {got:016x}, recorded "
                f"in the index when the cache was written {want:016x}): the bytes changed since (disk or "
                "memory fault, or the file was modified); run `shards verify --deep` and re-run precompute "
                "for this shard")


__all__ = ["read_into", "READ_THROUGH"]
