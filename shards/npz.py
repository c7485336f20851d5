"""The packed tensor member ``KEY.tensors.npz``: every array of a sample in one uncompressed zip.

Why one member: a tar member costs a 512-byte header plus padding to a 512-byte block, so a
conversation sample with 6 small arrays (``input_ids``, ``labels``, ``audio_segments``,
``audio_starts``, short ``codes``...) would pay ~1 KiB per array for a few hundred bytes of data.
Packed, a sample is two tar members (``KEY.json``, ``KEY.tensors.npz``; disk / tensor bytes
measured: docs/benchmarks.md).

The container is a standard ``.npz`` (what :func:`numpy.savez` writes and ``numpy.load(f,
allow_pickle=False)`` reads: a zip of ``NAME.npy`` entries), with three properties the readers
of this project rely on:

* every entry is STORED (no compression), so each array's bytes sit contiguously in the shard and
  :class:`shards.ShardReader` reads them by the byte offsets recorded in the index
  (``np.frombuffer``, no zip or npy parsing at read time);
* each array payload starts on a :data:`ALIGN`-byte boundary of the member (so of the tar, whose
  members start on 512-byte blocks): the local header's extra field carries the padding (the
  0xD935 "alignment" extra of Android's zipalign; readers skip unknown extras), the central
  directory carries none;
* the bytes are a pure function of the arrays (fixed 1980-01-01 timestamps, entries in the order
  given), so a rerun writes byte-identical shards.

Upstream ``webdataset`` ``.decode()`` and Hugging Face ``datasets`` decode ``.npz`` members to a
mapping of arrays (``sample["tensors.npz"]["codes"]``); ``np.load(io.BytesIO(member))`` works too.
Zip64 is never needed: a member larger than 4 GiB is refused.
"""
from __future__ import annotations

import functools
import io
import struct
import threading
import zipfile
import zlib

import numpy as np

#: tar member name (after ``KEY.``) of the packed arrays
MEMBER = "tensors.npz"
#: alignment (bytes) of every array payload inside the member
ALIGN = 64
_LOCAL = struct.Struct("<4s5H3L2H")       # local file header, 30 bytes
_CENTRAL = struct.Struct("<4s6H3L5H2L")   # central directory entry, 46 bytes
_END = struct.Struct("<4s4H2LH")          # end of central directory, 22 bytes
_DOS_DATE, _DOS_TIME = (0 << 9) | (1 << 5) | 1, 0  # 1980-01-01 00:00:00
_PAD_ID = 0xD935
_MADE_BY = (3 << 8) | 20  # Unix, zip 2.0: external attributes are a file mode


def npy_bytes(array: np.ndarray) -> bytes:
    """Serialise an array as ``.npy`` bytes (C order, never pickled): what ``numpy.save`` writes. The
    header (a function of the dtype and shape alone) of an array like one serialised before is reused."""
    a = np.ascontiguousarray(array)
    key = (a.dtype, a.shape)
    head = _HEADS.get(key)
    if head is None:
        buf = io.BytesIO()
        np.save(buf, a, allow_pickle=False)
        out = buf.getvalue()
        if len(_HEADS) < 4096 and not a.dtype.hasobject:
            _HEADS[key] = out[:len(out) - a.nbytes]
        return out
    return head + a.tobytes()


#: (dtype, shape) -> the ``.npy`` header ``numpy.save`` writes for it (dict reads and writes are atomic)
_HEADS: dict[tuple, bytes] = {}


#: numpy parses an ``.npy`` header with ``ast.literal_eval``. CPython 3.11 keeps the AST converter's
#: recursion counter per interpreter, not per call: two threads parsing at once, with a garbage
#: collection running Python finalizers between them, raise ``SystemError: AST constructor
#: recursion depth mismatch`` (seen in ``shards verify``'s shard threads and reproduced by
#: tests/test_packed_format.py). Header parses are microseconds: they take turns.
_HEADER_LOCK = threading.Lock()


def npy_header(data: bytes | memoryview) -> tuple[int, str, tuple[int, ...]]:
    """Parse an ``.npy`` blob's header: ``(header_len, dtype_str, shape)``; the array data starts
    ``header_len`` bytes into ``data``. Raises ``ValueError`` for Fortran order or object dtypes
    (they would need copying or unpickling) and for anything that is not ``.npy``. Thread-safe
    (see :data:`_HEADER_LOCK`). A header already parsed (the same bytes: arrays of one shape and
    dtype, what most samples of a cache share) is answered from :func:`_parsed` without parsing."""
    head = bytes(data[:12])
    if head[:6] == _NPY_MAGIC and len(head) >= 10:
        n, start = ((struct.unpack_from("<H", head, 8)[0], 10) if head[6] == 1 else
                    (struct.unpack_from("<I", head, 8)[0], 12) if head[6] in (2, 3) and len(head) >= 12 else (-1, 0))
        if 0 <= n <= _MAX_CACHED_HEADER and start + n <= len(data):
            return _parsed(bytes(data[:start + n]))
    return _parse(data)


_NPY_MAGIC = b"\x93NUMPY"
#: headers longer than this (a shape of thousands of dimensions) are parsed every time
_MAX_CACHED_HEADER = 1024


@functools.lru_cache(maxsize=4096)
def _parsed(head: bytes) -> tuple[int, str, tuple[int, ...]]:
    """:func:`_parse` of one whole header (magic to the end of its dict), remembered: numpy's
    ``literal_eval`` of the dict was most of the writer's time per sample (a refused header raises
    again each time: errors are not remembered)."""
    return _parse(head)


def _parse(data: bytes | memoryview) -> tuple[int, str, tuple[int, ...]]:
    fp = io.BytesIO(data)
    with _HEADER_LOCK:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
    if fortran:
        raise ValueError("Fortran-ordered array")
    if dtype.hasobject:
        raise ValueError("object dtype would need pickle")
    return fp.tell(), dtype.str, tuple(int(s) for s in shape)


def pack(arrays: dict[str, np.ndarray]) -> bytes:
    """The ``.npz`` bytes of ``{name: array}`` (entries ``name.npy`` in the given order), each
    array payload :data:`ALIGN`-byte aligned. Raises ``ValueError`` past 4 GiB."""
    out = bytearray()
    central = bytearray()
    for name, array in arrays.items():
        data = npy_bytes(array)
        fname = f"{name}.npy".encode()
        hlen = npy_header(data)[0]
        start = len(out) + _LOCAL.size + len(fname)
        pad = -(start + 4 + hlen) % ALIGN  # the extra field is 4 bytes + pad
        extra = struct.pack("<2H", _PAD_ID, pad) + b"\0" * pad
        crc = zlib.crc32(data)
        offset = len(out)
        out += _LOCAL.pack(b"PK\x03\x04", 20, 0, 0, _DOS_TIME, _DOS_DATE, crc, len(data), len(data),
                           len(fname), len(extra)) + fname + extra + data
        central += _CENTRAL.pack(b"PK\x01\x02", _MADE_BY, 20, 0, 0, _DOS_TIME, _DOS_DATE, crc, len(data),
                                 len(data), len(fname), 0, 0, 0, 0, 0o100644 << 16, offset) + fname
    if len(out) + len(central) >= 1 << 32 or len(arrays) >= 1 << 16:
        raise ValueError("a sample's arrays exceed 4 GiB (or 65535 arrays): not supported in one member")
    cd_offset = len(out)
    out += central + _END.pack(b"PK\x05\x06", 0, 0, len(arrays), len(arrays), len(central), cd_offset, 0)
    return bytes(out)


def entries(data: bytes | memoryview) -> list[tuple[str, int, int, str, tuple[int, ...]]]:
    """The arrays of an ``.npz`` member: ``[(name, payload_offset, payload_size, dtype_str, shape)]``
    with offsets relative to the start of ``data`` and ``name`` without ``.npy``.

    Raises ``ValueError`` for a member that is not a zip of stored ``.npy`` entries (a compressed
    entry cannot be read by offset; an entry that is not ``.npy``; a truncated member).
    """
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ValueError(f"not a readable .npz ({e})") from None
    out = []
    for info in infos:
        if not info.filename.endswith(".npy"):
            raise ValueError(f"entry {info.filename!r} is not .npy")
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"entry {info.filename!r} is compressed (np.savez_compressed); shardcache "
                             "reads arrays by offset and needs stored entries (np.savez)")
        h = info.header_offset
        head = bytes(data[h:h + _LOCAL.size])
        if len(head) < _LOCAL.size or head[:4] != b"PK\x03\x04":
            raise ValueError(f"entry {info.filename!r}: bad local header")
        n, e = struct.unpack("<2H", head[26:30])
        start = h + _LOCAL.size + n + e
        if start + info.file_size > len(data):
            raise ValueError(f"entry {info.filename!r} is truncated")
        hlen, dtype, shape = npy_header(data[start:start + info.file_size])
        out.append((info.filename[:-4], start + hlen, info.file_size - hlen, dtype, shape))
    return out


__all__ = ["MEMBER", "ALIGN", "pack", "entries", "npy_bytes", "npy_header"]
