"""The native executor of the loader's read (``shards._readv``, shards/native/readv.c) does what the
python executor (``shards.readinto._read_members``) does: the same batches, float32 ones included
(widened per member in C vs ``FieldKind.widen_host`` after the read), the same damaged samples named
with the same words; its widenings equal numpy's conversions for every int16 and float16 bit
pattern; and a plan that would write outside its buffers is refused before a byte is read."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loaders import Order, Reads, ShardLoader, Workers
from shards import ShardCorrupt
from shards import readinto
from shards.kinds import PCM16_SCALE
from test_loader_read import FIELDS, assert_same, conversation_cache
from test_train_support import make_cache

_readv = readinto._readv
if _readv is None and (shutil.which("cc") or shutil.which("gcc")):
    pytest.fail("shards._readv was not built although a C compiler is here: run `pip install -e .` (make setup) "
                "and read its output", pytrace=False)
pytestmark = pytest.mark.skipif(_readv is None, reason="shards._readv not built (no C compiler)")


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> Path:
    return conversation_cache(tmp_path_factory.mktemp("native") / "c")


def batch_with(monkeypatch, executor: str, ld: ShardLoader, ids) -> dict:
    monkeypatch.setattr(readinto, "EXECUTOR", executor)
    b = ld.sources.read_batch(np.asarray(ids, dtype=np.int64))
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()}


@pytest.mark.parametrize("compact", [True, False])
def test_both_executors_build_the_same_batches(conv, monkeypatch, compact):
    """Every kind (ragged audio, codes, ids, offsets, segments, partial latents), samples repeated,
    compact and float32 (int16 -> float32 PCM, float16 -> float32, int16/int32 -> int64)."""
    ld = ShardLoader(conv, 5, fields=FIELDS, seed=0, reads=Reads(compact=compact))
    rng = np.random.default_rng(0)
    for ids in [rng.integers(0, ld.sources.n, 5) for _ in range(8)] + [[3, 3, 9, 3, 0]]:
        native = batch_with(monkeypatch, "native", ld, ids)
        python = batch_with(monkeypatch, "python", ld, ids)
        assert_same(python, native)
        assert native["audio"].dtype == (torch.int16 if compact else torch.float32)
    ld.close()


@pytest.fixture
def cache(tmp_path) -> Path:
    return make_cache(tmp_path / "cache", n=12, n_shards=2)


def damage(executor: str, cache: Path, monkeypatch, after_first=None) -> str:
    """The message of the ShardCorrupt that stops an epoch read by ``executor`` (``after_first``:
    called once the first batch is read, the shards open)."""
    monkeypatch.setattr(readinto, "EXECUTOR", executor)
    ld = ShardLoader(cache, 4, order=Order(shuffle=False), workers=Workers(read_threads=1))
    it = iter(ld)
    next(it)
    if after_first is not None:
        after_first()
    with pytest.raises(ShardCorrupt) as e:
        list(it)
    ld.close()
    return str(e.value)


def test_a_flipped_bit_is_named_alike(cache, monkeypatch):
    from test_integrity import flip_low_bit
    flip_low_bit(cache, "s0009", "latents.npy", index=7)
    native, python = damage("native", cache, monkeypatch), damage("python", cache, monkeypatch)
    assert native == python and "sample 's0009' member latents.npy: checksum mismatch" in native, native


def test_a_short_file_is_named_alike(cache, tmp_path, monkeypatch):
    from shards.files import ShardFiles
    monkeypatch.setattr(ShardFiles, "check", lambda self, i, where: None)  # as if it shrank after the check
    copy = Path(shutil.copytree(cache, tmp_path / "copy"))
    got = [damage(ex, c, monkeypatch, lambda c=c: os.truncate(c / "shard-r0000-000000.tar", 30000))
           for ex, c in (("native", cache), ("python", copy))]
    assert got[0] == got[1].replace(str(copy), str(cache)) and "but the file is 30000 bytes now" in got[0], got


# ----------------------------------------------------------------------------- the widenings, bit for bit

def read_converted(tmp_path: Path, data: np.ndarray, op: int, scale: float, out_dtype, at: int = 0) -> np.ndarray:
    """``data`` written to a file, read back by one run of read_members into a staging buffer and
    widened into an ``out_dtype`` buffer by conversion ``op`` (at element ``at`` of staging and
    output: an output not aligned to 32 bytes)."""
    path = tmp_path / "values.bin"
    path.write_bytes(b"\x00" * 100 + data.tobytes())
    staging = np.zeros(data.nbytes + at * data.itemsize, np.uint8)
    out = np.zeros(data.size + at, out_dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        status, got = np.zeros(1, np.int8), np.zeros(1, np.uint64)
        bad = _readv.read_members(np.array([fd], np.int32), np.array([100], np.int64),
                                  np.array([data.nbytes], np.int64), np.zeros(1, np.int32),
                                  np.array([at * data.itemsize], np.int64),
                                  (memoryview(staging),), np.zeros(1, np.int64), np.zeros(1, np.uint64),
                                  np.zeros(1, np.uint8), status, got, 4096, 1 << 18,
                                  ((memoryview(out).cast("B"), op, scale),))
    finally:
        os.close(fd)
    assert bad == 0 and staging[at * data.itemsize:].tobytes() == data.tobytes() and not out[:at].any()
    return out[at:]


EVERY_INT16 = np.arange(-32768, 32768, dtype=np.int32).astype(np.int16)


@pytest.mark.parametrize("at", [0, 3])
def test_pcm_to_float32_equals_numpy(tmp_path, at):
    out = read_converted(tmp_path, EVERY_INT16, readinto.CONVERSIONS[("cast", "int16", "float32")],
                         float(PCM16_SCALE), np.float32, at)
    want = EVERY_INT16.astype(np.float32) * PCM16_SCALE
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("f16c, at", [(True, 0), (True, 5), (False, 0)])
def test_float16_to_float32_equals_numpy_for_every_bit_pattern(tmp_path, f16c, at):
    """Normals, subnormals, +-0, +-inf bit for bit; NaN stays NaN (F16C may set the quiet bit)."""
    was = _readv.use_f16c()
    try:
        _readv.use_f16c(f16c)
        out = read_converted(tmp_path, EVERY_INT16, readinto.CONVERSIONS[("cast", "float16", "float32")], 1.0,
                             np.float32, at)
    finally:
        _readv.use_f16c(was)
    want = EVERY_INT16.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert nan.sum() == 2 * 1023 and np.isnan(out[nan]).all()
    np.testing.assert_array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_bfloat16_bits_and_integer_widenings_equal_numpy(tmp_path):
    c = readinto.CONVERSIONS
    bf = read_converted(tmp_path, EVERY_INT16, c[("bf16", "int16", "float32")], 1.0, np.float32)
    np.testing.assert_array_equal(bf.view(np.uint32), EVERY_INT16.view(np.uint16).astype(np.uint32) << 16)
    wide = read_converted(tmp_path, EVERY_INT16, c[("cast", "int16", "int64")], 1.0, np.int64)
    np.testing.assert_array_equal(wide, EVERY_INT16.astype(np.int64))
    i32 = np.r_[np.iinfo(np.int32).min, -1, 0, 1, np.iinfo(np.int32).max,
                np.random.default_rng(0).integers(-2**31, 2**31, 5000)].astype(np.int32)
    np.testing.assert_array_equal(read_converted(tmp_path, i32, c[("cast", "int32", "int64")], 1.0, np.int64),
                                  i32.astype(np.int64))


# ----------------------------------------------------------------------------- plans refused

def test_a_plan_outside_its_buffers_is_refused_before_reading(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 16)
    fd = os.open(path, os.O_RDONLY)
    buf = np.full(64, 7, np.uint8)

    def call(off=0, n=32, dst=0, last=(0,), convs=None):
        return _readv.read_members(np.array([fd], np.int32), np.array([off], np.int64), np.array([n], np.int64),
                                   np.zeros(1, np.int32), np.array([dst], np.int64), (memoryview(buf),),
                                   np.array(last, np.int64), np.zeros(len(last), np.uint64),
                                   np.zeros(len(last), np.uint8), np.zeros(len(last), np.int8),
                                   np.zeros(len(last), np.uint64), 4096, 1 << 18, convs)
    try:
        for kw in (dict(dst=40), dict(n=-1), dict(off=-5), dict(last=(1,)), dict(last=(0, 0)),
                   dict(convs=((memoryview(np.zeros(8, np.uint8)), 1, 1.0),)),  # 32 int16 -> 128 bytes
                   dict(convs=((memoryview(np.zeros(256, np.uint8)), 99, 1.0),))):
            with pytest.raises(ValueError):
                call(**kw)
            assert (buf == 7).all(), kw  # nothing read
        assert call() == 0 and buf[:32].tobytes() == bytes(range(32))
    finally:
        os.close(fd)
    with pytest.raises(OSError):  # a failing preadv (here: a closed descriptor) is an OSError
        call()


# ----------------------------------------------------------------------------- any plan, both executors

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def plans(draw):
    """Files of random bytes; runs at increasing offsets per file (gaps, empty runs, runs past the end
    of the file), cut into members; each run a region of one of a few buffers; recorded checksums
    right, wrong or absent; small READ_THROUGH / READ_CAP so that stretches split and merge."""
    import xxhash
    n_files = draw(st.integers(1, 3))
    files = [draw(st.binary(min_size=0, max_size=6000)) for _ in range(n_files)]
    runs = []  # (file, offset, length)
    for f, data in enumerate(files):
        pos = draw(st.integers(0, 64))
        for _ in range(draw(st.integers(0, 6))):
            length = draw(st.integers(0, 1500))
            runs.append((f, pos, length))
            pos += length + draw(st.sampled_from([0, 0, 3, 100, 600, 2000]))
    if not runs:
        runs.append((0, 0, 0))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(runs) - 1)), max_size=len(runs)))) - {len(runs)})
    last = [c - 1 for c in cuts] + [len(runs) - 1]
    n_bufs = draw(st.integers(1, 3))
    sizes, buf_of, dst = [0] * n_bufs, [], []
    for _, _, length in runs:
        b = draw(st.integers(0, n_bufs - 1))
        pad = draw(st.integers(0, 9))
        buf_of.append(b)
        dst.append(sizes[b] + pad)
        sizes[b] += pad + length
    want, check = [], []
    for m, hi in enumerate(last):
        lo = last[m - 1] + 1 if m else 0
        member = b"".join(files[f][o:o + k] for f, o, k in runs[lo:hi + 1])
        right = xxhash.xxh3_64_intdigest(member)
        how = draw(st.sampled_from(["right", "right", "wrong", "unchecked"]))
        want.append(right if how != "wrong" else right ^ 1)
        check.append(how != "unchecked")
    return (files, runs, last, buf_of, dst, sizes, want, check, draw(st.sampled_from([0, 16, 4096])),
            draw(st.sampled_from([1, 700, 1 << 18])))


def _edge_plan():
    """A member ending exactly at the end of its file, then one past it, in one preadv: only the
    second is short."""
    import xxhash
    data = bytes(range(100))
    return ([data], [(0, 0, 100), (0, 100, 20)], [0, 1], [0, 0], [0, 100], [120],
            [xxhash.xxh3_64_intdigest(data), 0], [True, True], 4096, 1 << 18)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans())
@example(plan=_edge_plan())
def test_any_plan_reads_and_checks_alike_in_both_executors(tmp_path, plan):
    """The same bytes in the same places (reads past the end of a file included), the same status
    for every member (0 read and right or unchecked, 1 checksum mismatch, 2 file too short) and the
    same checksums, whatever the grouping of runs into preadv calls."""
    files, runs, last, buf_of, dst, sizes, want, check, read_through, read_cap = plan
    fds = []
    for i, data in enumerate(files):
        p = tmp_path / f"f{i}"
        p.write_bytes(data)
        fds.append(os.open(p, os.O_RDONLY))
    try:
        a = dict(fd=np.array([fds[f] for f, _, _ in runs], np.int32), off=np.array([o for _, o, _ in runs], np.int64),
                 n=np.array([k for _, _, k in runs], np.int64), buf=np.array(buf_of, np.int32),
                 dst=np.array(dst, np.int64), last=np.array(last, np.int64), want=np.array(want, np.uint64),
                 check=np.array(check, np.uint8))
        out = {}
        for name in ("native", "python"):
            bufs = tuple(memoryview(np.full(max(s, 1), 0xAB, np.uint8)) for s in sizes)
            status, got = np.zeros(len(last), np.int8), np.zeros(len(last), np.uint64)
            if name == "native":
                bad = _readv.read_members(a["fd"], a["off"], a["n"], a["buf"], a["dst"], bufs, a["last"], a["want"],
                                          a["check"], status, got, read_through, read_cap)
            else:
                bad = readinto._read_members(a["fd"], a["off"], a["n"], a["buf"], a["dst"], bufs, a["last"],
                                             a["want"], a["check"], status, got, read_through, read_cap)
            out[name] = (bad, [bytes(b) for b in bufs], status.tolist(), got.tolist())
    finally:
        for fd in fds:
            os.close(fd)
    assert out["native"] == out["python"]
    bad, _, status, _ = out["native"]
    for m, hi in enumerate(last):  # and both right, from the plan alone
        lo = last[m - 1] + 1 if m else 0
        short = any(k and o + k > len(files[f]) for f, o, k in runs[lo:hi + 1])
        expect = 2 if short else (1 if check[m] and want[m] != plan_hash(files, runs[lo:hi + 1]) else 0)
        assert status[m] == expect, (m, status, expect)
    assert bad == sum(1 for s in status if s)


def plan_hash(files, runs) -> int:
    import xxhash
    return xxhash.xxh3_64_intdigest(b"".join(files[f][o:o + k] for f, o, k in runs))
