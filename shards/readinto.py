"""One copy: members of a batch's samples straight from the shard files into their place in the batch.

:meth:`shards.ShardReader.read_into` (implemented here) takes, per field, the batch buffer and the
*runs* its kind computed (:meth:`shards.kinds.FieldKind.runs`: which bytes of each sample's
stored array go where in the padded batch tensor). It builds the batch's read plan with numpy: every
run sorted by file and offset, each member's runs together, the descriptor of each run's file, the
checksum each member must have. Then an *executor* carries it out: one ``preadv`` per stretch of a
file whose runs lie at most :data:`READ_THROUGH` bytes apart, filling at most :data:`READ_CAP` bytes
beyond its first run (one buffer per run; the few hundred bytes of tar and zip headers between two
members of a sample go to a scratch buffer), so the kernel copies the bytes from the page cache
into the batch tensors: no mapping, no page faults on the source, no intermediate array. Each
member is hashed where it landed right after the ``preadv`` that completes it, while it is still in
cache, and compared with the XXH3-64 the index recorded when the cache was written
(:mod:`shards.checksum`).

Two executors, the same plan, the same bytes and checks (the tests compare them):

* **native** (``shards._readv``, ``shards/native/readv.c``, built by ``pip install``): the whole
  plan in one call that holds no GIL. Used whenever it is built.
* **python**: the same loop with :func:`os.preadv` and :mod:`xxhash`, for installs without a C
  compiler (``SHARDCACHE_NATIVE_READ=0`` selects it). Every ``preadv`` and every hash of more than
  64 KiB hands the GIL over, ~60 times per batch of 16 samples of 360 KiB: with two read threads the
  threads wait for each other (docs/benchmarks.md), where the native executor's threads copy and
  hash in parallel.

Nothing here raises for a damaged sample: :func:`read_into` returns ``(position, message)`` for
each sample whose bytes are not what the index says (checksum mismatch, file shorter than the
member), the message naming the shard, the key and the member, so the loader can stop or skip it
(its ``skip_corrupt`` budget). A shard replaced, resized or deleted under the reader raises
:class:`~shards.errors.ShardCorrupt` at once (:meth:`shards.files.ShardFiles.check`).
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .checksum import ALGORITHM, checksum_of_parts, xxh3_64_intdigest as _xxh3
from .files import IOV_MAX, read_segments

if TYPE_CHECKING:  # pragma: no cover
    from .reader import ShardReader

#: the calling convention of ``shards._readv`` this module speaks (API_VERSION in readv.c)
NATIVE_API = 2
try:  # built by `pip install` (setup.py); absent where no C compiler was found
    from . import _readv
except ImportError:  # pragma: no cover - depends on the install
    _readv = None
if _readv is not None and getattr(_readv, "API_VERSION", None) != NATIVE_API:  # built from older sources
    warnings.warn(f"shards._readv was built from other sources (API {getattr(_readv, 'API_VERSION', 1)}, this "
                  f"code needs {NATIVE_API}): reading with the python executor; run `pip install -e .` "
                  "(`make setup`) again to rebuild it", RuntimeWarning, stacklevel=1)
    _readv = None

#: bytes between two members (of one file) that one ``preadv`` reads through into a scratch buffer
#: rather than issuing a second call: tar headers (512 B + padding), zip local headers, ``.npy``
#: headers, small members that were not asked for
READ_THROUGH = 4096
#: bytes one ``preadv`` fills at most beyond its first run (a run larger than this is one call, small
#: members are grouped): the members a call completes are hashed right after it, so their bytes must
#: still be in the core's cache. One call for a whole batch (several MB) made the hash read them back
#: from memory (the A/B figures: docs/benchmarks.md; a member of ~220 KiB of audio is one call)
READ_CAP = 256 << 10
#: the executor: "native" where ``shards._readv`` is built (unless ``SHARDCACHE_NATIVE_READ=0``), else "python"
EXECUTOR = "native" if _readv is not None and os.environ.get("SHARDCACHE_NATIVE_READ", "1") != "0" else "python"
_STATUS_MISMATCH, _STATUS_SHORT = 1, 2
_said = False


def say_executor(log) -> None:
    """Once per process, when the reads fall back to the python executor although nobody asked for
    it: say why and how to get the native one (``log``: a :class:`logging.Logger`)."""
    global _said
    if EXECUTOR == "python" and not _said and os.environ.get("SHARDCACHE_NATIVE_READ", "1") != "0":
        _said = True
        log.warning("shards._readv (the loader's native reader) is not built: batches are read with the python "
                    "executor, same batches but slower with several read threads or workers; install a C "
                    "compiler and run `pip install -e .` (`make setup`) again")


#: widenings the native executor does per member, right after reading it (shards/native/readv.c):
#: ``(widening, stored dtype, host dtype) -> op`` (widening: :meth:`shards.kinds.FieldKind.host_widening`;
#: a cast with a scale other than 1 only for int16 -> float32, the PCM scale)
CONVERSIONS = {("cast", "int16", "float32"): 1, ("cast", "float16", "float32"): 2, ("bf16", "int16", "float32"): 3,
               ("cast", "int16", "int64"): 4, ("cast", "int32", "int64"): 5}


def conversion(widening: tuple | None, stored: str, host: str) -> tuple[int, float] | None:
    """``(op, scale)`` of the native executor for a field stored as ``stored`` and batched as
    ``host`` (dtype names) whose kind widens as ``widening``; None when it has none (the caller
    widens the whole tensor after the read: :meth:`shards.kinds.FieldKind.widen_host`), or when the
    executor is the python one."""
    if widening is None or EXECUTOR != "native":
        return None
    op = CONVERSIONS.get((widening[0], stored, host))
    scale = float(widening[1]) if len(widening) > 1 else 1.0
    if op is None or (scale != 1.0 and op != 1):
        return None
    return op, scale


def read_into(reader: "ShardReader", rows: np.ndarray, plans: Sequence[tuple[str, memoryview, tuple]],
              checksums: bool = True, executor: str | None = None) -> list[tuple[int, str]]:
    """Copy members of index ``rows`` into batch buffers (see the module docstring).

    Args:
        reader: the :class:`~shards.ShardReader` whose index ``rows`` refers to.
        rows: int64 ``(B,)`` index row of each batch position.
        plans: per field ``(name, buf, (pos, src, dst, n))`` or ``(name, buf, (pos, src, dst, n),
            (out, op, scale))``: ``buf`` a writable flat byte memoryview of the field's batch tensor
            (storage dtype); run ``r`` copies ``n[r]`` bytes from byte ``src[r]`` of the stored array
            of ``rows[pos[r]]`` to byte ``dst[r]`` of ``buf`` (int64 arrays; a kind's runs times the
            itemsize). A sample's runs of one field must be in stored order and cover the whole
            array. With ``(out, op, scale)`` (native executor only, :func:`conversion`) each run is
            also widened into ``out`` (the flat bytes of the batch tensor in its host dtype) at the
            same element index, once its member is read and checked.
        checksums: compare each member read with the index's checksum (members whose index
            entry has none are not checked).
        executor: ``"native"`` or ``"python"`` (default :data:`EXECUTOR`).

    Returns ``[(position, message)]``, one per damaged sample (first problem), in batch order.
    Raises :class:`~shards.errors.ShardCorrupt` when a shard was replaced, resized or deleted
    since it was pinned (or is missing), ``OSError`` when the system fails a read (EIO),
    ``ValueError`` for runs outside their buffer.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if not plans:
        return []
    B = len(rows)
    keys, offs, ns, dsts, mids, wants, known = [], [], [], [], [], [], []
    for i, (name, _, (pos, src, dst, n), *_) in enumerate(plans):
        fa = reader.field(name)
        r = rows[pos]
        start = fa.offsets(r)
        fnum = fa.files(r, reader.shard_of[r])
        keys.append((fnum << _FILE_SHIFT) | start)  # the member: by file, then its offset
        offs.append(start + src)
        ns.append(n)
        dsts.append(dst)
        mids.append(pos + i * B)  # member: field i of batch position pos
        if checksums:
            wants.append(fa.sums(r))
            known.append(np.ones(len(r), bool))  # every member has a checksum (ShardReader.field)
    key, off, n, dst, mid = (np.concatenate(c) for c in (keys, offs, ns, dsts, mids))
    if not len(off):
        return []
    # by file and member, each member's runs together in stored order (a sample may come twice)
    order = np.lexsort((off, mid, key))
    key, off, n, dst, mid = key[order], off[order], n[order], dst[order], mid[order]
    file = key >> _FILE_SHIFT
    first = _starts(mid)  # each member's first run
    last = np.empty_like(first)  # and its last
    last[:-1] = first[1:] - 1
    last[-1] = len(mid) - 1
    if checksums:
        want = np.concatenate(wants)[order][first].astype(np.uint64)
        check = np.concatenate(known)[order][first].astype(np.uint8)
    else:
        want, check = np.zeros(len(first), np.uint64), np.zeros(len(first), np.uint8)
    where = _Where(reader, rows, plans)
    starts = _starts(file)  # runs are sorted by file
    fds = reader.io.checked_fds(file[starts].tolist(), lambda f: where.first_in(f, file, mid % B))
    fd = np.repeat(np.asarray(fds, dtype=np.int32), np.diff(starts, append=len(file)))
    status, got = np.zeros(len(first), np.int8), np.zeros(len(first), np.uint64)
    bufs = tuple(p[1] for p in plans)
    convs = tuple(p[3] if len(p) > 3 else None for p in plans)
    if (executor or EXECUTOR) == "native":
        bad = _readv.read_members(fd, off, n, (mid // B).astype(np.int32), dst, bufs, last, want, check, status,
                                  got, READ_THROUGH, READ_CAP, convs if any(convs) else None)
    else:
        if any(convs):
            raise ValueError("the python executor does not widen: widen after the read (FieldKind.widen_host)")
        bad = _read_members(fd, off, n, (mid // B).astype(np.int32), dst, bufs, last, want, check, status, got)
    if not bad:
        return []
    problems: dict[int, str] = {}
    for m in np.flatnonzero(status).tolist():
        j = int(first[m])
        p, q = int(mid[j]) // B, int(mid[j]) % B
        if q in problems:
            continue
        if status[m] == _STATUS_SHORT:
            size = os.fstat(int(fd[j])).st_size
            problems[q] = where.short(p, q, size, int(reader.field(plans[p][0]).offsets(rows[q:q + 1])[0]))
        else:
            problems[q] = where.mismatch(p, q, int(got[m]), int(want[m]))
    return sorted(problems.items())


def _read_members(fd, off, n, buf, dst, bufs, last, want, check, status, got, read_through: int = READ_THROUGH,
                  read_cap: int = READ_CAP) -> int:
    """The python executor: what ``shards._readv.read_members`` does (shards/native/readv.c), with
    :func:`os.preadv` and :mod:`xxhash`; same arguments, same outputs."""
    fdl, offl, nl, bufl, dstl, lastl = (a.tolist() for a in (fd, off, n, buf, dst, last))
    views = [bufs[b][d:d + k] for b, d, k in zip(bufl, dstl, nl)]
    scratch = memoryview(bytearray(read_through))
    nseg, nmem, problems = len(offl), len(lastl), 0
    j = mi = 0
    while j < nseg:
        s, prev, iov, k = offl[j], offl[j] + nl[j], [views[j]], j + 1
        while (k < nseg and fdl[k] == fdl[j] and 0 <= offl[k] - prev <= read_through and len(iov) < IOV_MAX - 2
               and prev - s < read_cap):
            if offl[k] > prev:
                iov.append(scratch[:offl[k] - prev])
            iov.append(views[k])
            prev = offl[k] + nl[k]
            k += 1
        have = read_segments(fdl[j], s, iov, prev - s)
        if have < prev - s:  # the file ended: every member with a run past its end is short
            m = mi
            for r in range(j, k):
                while lastl[m] < r:
                    m += 1
                if offl[r] + nl[r] > s + have and status[m] == 0:
                    status[m] = _STATUS_SHORT
                    problems += 1
        while mi < nmem and lastl[mi] < k:  # the members this read completed
            f0 = lastl[mi - 1] + 1 if mi else 0
            if status[mi] == 0 and check[mi]:
                h = _xxh3(views[f0]) if f0 == lastl[mi] else checksum_of_parts(views[f0:lastl[mi] + 1])
                got[mi] = h
                if h != int(want[mi]):
                    status[mi] = _STATUS_MISMATCH
                    problems += 1
            mi += 1
        j = k
    return problems


def _starts(a: np.ndarray) -> np.ndarray:
    """int64 indices where a new value begins in ``a`` (1-D, non-empty), 0 first (not ``np.r_``:
    this is on the path of every batch)."""
    new = np.empty(len(a), dtype=bool)
    new[0] = True
    np.not_equal(a[1:], a[:-1], out=new[1:])
    return np.flatnonzero(new)


#: bits of a member's sort key that hold its byte offset (the file number above them: 1 TiB per
#: shard at most)
_FILE_SHIFT = 40


class _Where:
    """Messages naming the shard, the sample and the member (built only when needed)."""

    def __init__(self, reader, rows, plans):
        self.reader, self.rows, self.names = reader, rows, [p[0] for p in plans]

    def _at(self, p: int, q: int) -> str:
        row = self.rows[q:q + 1]
        fa = self.reader.field(self.names[p])
        f = int(fa.files(row, self.reader.shard_of[row])[0])
        return f"{self.reader.io.paths[f]}: sample {self.reader.key(int(row[0]))!r} member {self.names[p]}.npy"

    def first_in(self, f: int, file: np.ndarray, pos: np.ndarray) -> str:
        row = int(self.rows[int(pos[int(np.argmax(file == f))])])
        return f"sample {self.reader.key(row)!r}"

    def short(self, p: int, q: int, size: int, start: int) -> str:
        return (f"{self._at(p, q)}: the member starts at byte {start} but the file is {size} bytes now "
                "(truncated while being read?); run `shardcache shards verify`")

    def mismatch(self, p: int, q: int, got: int, want: int) -> str:
        return (f"{self._at(p, q)}: checksum mismatch ({ALGORITHM} of the bytes read {got:016x}, recorded "
                f"in the index when the cache was written {want:016x}): the bytes changed since (disk or "
                "memory fault, or the file was modified); run `shardcache shards verify --deep` and re-run precompute "
                "for this shard")


__all__ = ["read_into", "conversion", "say_executor", "READ_THROUGH", "READ_CAP", "EXECUTOR", "CONVERSIONS"]
