"""precompute.pipeline: decode workers sized from measured rates, length-bucketed encoder batches
(full, same cache as without buckets), rows back in manifest order, decode libraries preloaded."""
from __future__ import annotations

import dataclasses
import functools
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from precompute.encoders.audio import plan_batches
from precompute.pipeline import EncodeStream, InOrder, LengthBatcher, decode_workers

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo" / "samples.jsonl"


def test_decode_workers_follow_the_measured_rates_and_the_cores():
    # 50 ms of CPU to decode a row, 10 ms of GPU per row: 5 decode processes keep up, 7 with 25 % headroom
    assert decode_workers(64, 0.050, 0.010, at_least=1) == 7
    assert decode_workers(64, 0.050, 0.001) == 63  # a faster encoder needs every core but the main one
    assert decode_workers(8, 0.050, 0.001) == 7
    assert decode_workers(64, 0.001, 0.010, at_least=1) == 1  # decoding 10x faster than encoding: one process
    assert decode_workers(1, 0.050, 0.010) == 0  # one core: decode inline
    assert decode_workers(16, 0.020, 0.010, headroom=1.0, at_least=1) == 2
    # the floor (8 by default: one process fed the encoders worse than eight on an H200), within the cores
    assert decode_workers(64, 0.001, 0.010) == 8 and decode_workers(16, 0.050, 0.010) == 8
    assert decode_workers(4, 0.001, 0.010) == 3 and decode_workers(2, 0.001, 0.010) == 1


def _row(chunk: int, n: int, shape=None) -> SimpleNamespace:
    return SimpleNamespace(chunk=chunk, audio=[{24000: np.zeros(n, np.float32)}] if n else [],
                           images=[np.zeros(shape, np.uint8)] if shape else [])


def test_length_batches_are_full_of_equal_lengths_within_a_chunk():
    rng = random.Random(0)
    hop = 960
    lengths = [rng.choice([3, 5, 8, 13]) * hop for _ in range(160)]  # four clip lengths, shuffled
    rows = [_row(i // 80, n) for i, n in enumerate(lengths)]  # two chunks of 80 rows

    def run(window):
        b = LengthBatcher(8, window)
        out = []
        for i in range(0, len(rows), 8):  # decode batches of 8 (as the DataLoader gives them)
            out += b.add(rows[i:i + 8])
        return out + b.flush()

    bucketed, plain = run(64), run(8)
    for batches in (bucketed, plain):
        assert sorted(pos for b in batches for pos, _ in b) == list(range(160))  # every row once
        assert all(len({p.chunk for _, p in b}) == 1 for b in batches)  # never two chunks
        assert all(len(b) == 8 for b in batches)  # 80 rows per chunk: all full
    sub = lambda bs: sum(len(plan_batches([p.audio[0][24000].size for _, p in b], hop, 8, 10**9))  # noqa: E731
                         for b in bs)
    # the codec's own sub-batches (equal frame counts): far fewer, i.e. fuller, with buckets
    print(sub(bucketed), sub(plain))
    assert sub(bucketed) <= 32 < 50 < sub(plain)


def test_a_full_length_window_releases_one_batch_and_slides():
    """A full window gives the encoder one batch and keeps the rest held: released whole, it left the
    encoder idle while it refilled (measured: docs/benchmarks.md). The batch is the oldest held row and
    the rows of the lengths closest to it, so no row waits in the window for the chunk's end."""
    lengths = (5, 9, 5, 2, 9, 6, 2, 9, 2, 5, 9, 2, 3, 1, 7, 4)
    rows = [_row(0, n * 960) for n in lengths]
    b = LengthBatcher(4, 16)
    assert b.add(rows[:15]) == []
    got = b.add(rows[15:])
    assert len(got) == 1 and len(b.held) == 12
    assert 0 in [pos for pos, _ in got[0]]  # the oldest row
    assert sorted(p.audio[0][24000].size // 960 for _, p in got[0]) == [4, 5, 5, 5]  # and its closest lengths
    assert b.add([_row(0, 8 * 960)] * 3) == []  # not full again yet
    got = b.add([_row(0, 8 * 960)])
    assert 1 in [pos for pos, _ in got[0]]  # the oldest now (a 9)
    assert sorted(p.audio[0][24000].size // 960 for _, p in got[0]) == [9, 9, 9, 9]
    rest = b.flush()
    assert [len(x) for x in rest] == [4, 4, 4] and not b.held


def test_length_batcher_keeps_image_shapes_together_and_flushes_partial_batches():
    rows = [_row(0, 0, (64, 64 + 8 * (i % 3), 3)) for i in range(10)]
    b = LengthBatcher(4, 16)
    got = b.add(rows) + b.flush()
    assert [len(x) for x in got] == [4, 4, 2] or sorted(len(x) for x in got) == [2, 4, 4]
    assert sum(len({p.images[0].shape for _, p in x}) for x in got) <= 5


def test_in_order_releases_each_item_once_in_position_order():
    order = InOrder()
    pos = list(range(50))
    random.Random(1).shuffle(pos)
    out = [x for p in pos for x in order.push(p, f"row{p}")]
    assert out == [f"row{i}" for i in range(50)] and not order.pending


def test_encode_stream_returns_results_in_input_order_whatever_the_buckets():
    rows = [_row(0, n) for n in (9, 1, 7, 3, 5, 2, 8, 4, 6, 10)]
    for i, r in enumerate(rows):
        r.key = i
    s = EncodeStream(lambda b: [p.key for p in b], 2, window=6)
    out = []
    for i in range(0, 10, 3):
        out += s.feed(rows[i:i + 3])
    assert out + s.close() == list(range(10))
    assert s.batches == [2, 2, 2, 2, 2]


def _shards(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache.glob("*.tar"))}


def test_bucketed_job_writes_the_same_cache_as_unbucketed(tiny_config, tmp_path, monkeypatch):
    """The real job with the tiny DAC codec and Wan VAE (the VAE batches images bucketed by aspect, so the
    job holds a window of rows) over the demo's clips of different lengths: encoder batches of 2 formed
    from windows of 16 rows vs in manifest order (a window of one batch). Every sample, key and byte of codes, ids and
    waveforms is the same; the latents of a VAE call differ with its companions only by float
    rounding (measured on this CPU: up to 2 float16 steps), well within ``shardcache check``'s
    tolerance."""
    import precompute.job as job
    from shards import ShardReader
    cfg = dataclasses.replace(tiny_config, encoder_batch_size=2, samples_per_shard=24, image_resize="bucket")
    batch_sizes, windows = [], []

    class Recording(EncodeStream):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            windows.append(self.batcher.window)

        def close(self):
            out = super().close()
            batch_sizes.extend(self.batches)
            return out

    monkeypatch.setattr(job, "EncodeStream", Recording)
    job.run(DEMO, tmp_path / "bucketed", cfg, progress=False)
    monkeypatch.setattr(job, "WINDOW_BATCHES", 1)
    job.run(DEMO, tmp_path / "plain", cfg, progress=False)
    assert windows == [16, 2]
    assert batch_sizes and all(n == 2 for n in batch_sizes[:-1])
    a, b = ShardReader(tmp_path / "bucketed"), ShardReader(tmp_path / "plain")
    assert a.keys == b.keys and len(a.keys) > 10
    for i, key in enumerate(a.keys):
        x, y = a.get(i), b.get(i)
        assert x.keys() == y.keys()
        for name in x:
            if name == "latents":
                err = np.linalg.norm(x[name] - y[name]) / np.linalg.norm(y[name])
                assert err < 1e-3, (key, err)
            elif isinstance(x[name], np.ndarray):
                np.testing.assert_array_equal(x[name], y[name], err_msg=f"{key} {name}")
            else:
                assert x[name] == y[name], (key, name)


def test_preloaded_decoders_leave_nothing_to_import_in_a_forked_worker():
    """After preload_decoders() a forked decode worker's first resample, audio and JPEG decode
    import no module (they were imported once, before the fork)."""
    code = """
import io, os, sys
import numpy as np
from precompute.pipeline import preload_decoders
preload_decoders()
pid = os.fork()
if pid == 0:
    before = set(sys.modules)
    from precompute.audio import resample
    import soundfile as sf
    from PIL import Image
    resample(np.zeros(4800, np.float32), 44100, 16000)
    buf = io.BytesIO(); sf.write(buf, np.zeros(800, np.float32), 16000, format="FLAC"); buf.seek(0); sf.read(buf)
    j = io.BytesIO(); Image.new("RGB", (32, 32)).save(j, "JPEG"); j.seek(0); Image.open(j).load()
    new = sorted(set(sys.modules) - before)
    print("NEW", new, flush=True)
    os._exit(0 if not new else 3)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_decode_workers_reject_nothing_silently():
    with pytest.raises(ValueError, match="batch_size <= window"):
        LengthBatcher(8, 4)


def test_job_workers_measure_the_first_batch_on_an_accelerator(monkeypatch):
    """``auto`` on a device: decode CPU time and encoder time of the first batch set the count (a
    counted decode of ~20 ms CPU per row against 1 ms of encoder per row: ~25 with the headroom)."""
    import time as _time

    import shardcache.workers
    from precompute.pipeline import job_workers

    def burn(_row):
        t = _time.thread_time()
        while _time.thread_time() - t < 0.02:
            pass
        return _row

    class Pipe:
        prepare = staticmethod(burn)

        @staticmethod
        def encode(batch, summary):
            summary.encoder_s += 0.001 * len(batch)
            return batch

    monkeypatch.setattr(shardcache.workers, "cpus_per_rank", lambda: 64)
    assert job_workers(3, "cuda:0", Pipe, list(range(8)), 4) == 3
    assert job_workers("auto", "cpu", Pipe, list(range(8)), 4) == 0
    assert 20 <= job_workers("auto", "cuda:0", Pipe, list(range(8)), 4) <= 40
    monkeypatch.setattr(shardcache.workers, "cpus_per_rank", lambda: 8)
    assert job_workers("auto", "cuda:0", Pipe, list(range(8)), 4) == 7


def test_to_device_copies_values_and_casts():
    import torch

    from precompute.transfer import to_device
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]  # not contiguous
    x = to_device(a, "cpu", torch.bfloat16)
    assert x.dtype == torch.bfloat16 and torch.equal(x.float(), torch.from_numpy(a.copy()))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_to_device_copies_from_pinned_memory_on_cuda(monkeypatch):
    import torch

    from precompute.transfer import to_device
    pinned = []
    real = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a: pinned.append(1) or real(self, *a))
    x = to_device(np.ones((2, 3), np.float32), "cuda")
    torch.cuda.synchronize()
    assert pinned and x.is_cuda and float(x.sum()) == 6.0
