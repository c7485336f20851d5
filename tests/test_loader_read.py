"""The loader's one-copy read (loaders.read, shards.readinto) builds exactly the batches collate_fn builds
from ShardReader.get dicts, for every kind of field, and the kinds' geometry puts every value where a
plain numpy corner assignment would."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from loaders import Order, Reads, ShardLoader, Workers, collate_fn
from shards import ShardReader, ShardWriter, merge_parts, shard_name
from shards import fields as registry
from shards.kinds import FieldKind

PAD_ID = 7


@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_runs_place_every_value_in_its_corner(seed, nd):
    """Scatter random arrays with the kind's runs; compare with ``out[j][:s0, :s1, :s2] = a``."""
    rng = np.random.default_rng(seed)
    B = 7
    S_full = rng.integers(1, 6, nd)
    shapes = np.stack([[int(rng.integers(0, d + 1)) for d in S_full] for _ in range(B)]).astype(np.int64)
    if seed % 2:  # trailing axes equal in every sample: fewer, longer runs
        shapes[:, 1:] = S_full[1:]
    present = rng.random(B) > 0.2
    shapes[~present] = 0
    S = tuple(int(v) for v in shapes.max(axis=0))
    arrays = [rng.integers(0, 1000, tuple(s)).astype(np.int32) if p else None for s, p in zip(shapes, present)]
    want = np.full((B, *S), -1, np.int32)
    for j, a in enumerate(arrays):
        if a is not None:
            want[j][tuple(slice(0, d) for d in a.shape)] = a
    sample, src, dst, n = FieldKind().runs(None, shapes, present, S)
    got = np.full((B, *S), -1, np.int32).reshape(-1)
    for j, s, d, k in zip(sample, src, dst, n):
        got[d:d + k] = arrays[j].reshape(-1)[s:s + k]
    np.testing.assert_array_equal(got.reshape(want.shape), want)
    covered = np.zeros(got.shape, int)  # each value copied once, runs never overlap
    for d, k in zip(dst, n):
        covered[d:d + k] += 1
    assert covered.max(initial=0) <= 1 and covered.sum() == sum(a.size for a in arrays if a is not None)


@pytest.mark.parametrize("name,S_full", [("input_ids", (50,)), ("audio", (40000,)), ("codes", (4, 30)),
                                         ("codes", (8, 800)), ("latents", (3, 2, 5, 6)), ("latents", (2, 4, 120, 120))])
@pytest.mark.parametrize("seed", range(4))
def test_finish_pads_outside_each_corner_and_masks_it(name, S_full, seed):
    """Padding, lengths and mask written by the kind (small 1-D fields in one vectorised write, large
    ones row by row, every row full in one fill), against a cell-by-cell reference computed here."""
    from shards.kinds import BatchContext
    rng = np.random.default_rng(seed)
    f = registry.get(name)
    B = 6
    shapes = np.array([[int(rng.integers(0, d + 1)) for d in S_full] for _ in range(B)], dtype=np.int64)
    if name in ("codes", "latents"):
        shapes[:, 0] = S_full[0]  # codebooks, latent channels: never masked (codebooks: a fixed axis)
    if seed == 0:
        shapes[:] = S_full  # every row full
    present = rng.random(B) > 0.2 if seed else np.ones(B, bool)
    shapes[~present] = 0
    S = tuple(int(v) for v in np.maximum(shapes.max(axis=0), 1))
    ctx = BatchContext(pad_id=PAD_ID, compact=True)
    out = {k: torch.from_numpy(np.full(shape, 1, dtype=torch.empty((), dtype=dt).numpy().dtype))
           for k, shape, dt in f.kind.layout(f, B, S, ctx)}
    data = out[f.name].numpy()
    data[...] = 55  # the values read; the padding must replace every one outside the corners
    f.kind.finish(f, out, shapes, present, S, ctx)
    pad = f.kind.pad_value(f, ctx)
    corner = np.zeros((B, *S), bool)
    for j in range(B):
        corner[j][tuple(slice(0, d) for d in shapes[j])] = True
    np.testing.assert_array_equal(data, np.where(corner, 55, pad))
    if f.lengths:
        np.testing.assert_array_equal(out[f.lengths].numpy(), shapes[:, f.kind.lengths_axis])
    if f.mask:
        axes = f.kind.mask_axes
        want = corner[(slice(None),) + tuple(slice(None) if a in axes else 0 for a in range(len(S)))]
        np.testing.assert_array_equal(out[f.mask].numpy(), want)


def conversation_cache(out: Path, n: int = 14, seed: int = 0) -> Path:
    """Every kind of field stage one writes, ragged along every axis that can be: conversation ids and
    labels, codes, audio with item offsets (padded with the last offset) and segments (-1 rows), an
    extra 16 kHz waveform, latents of three shapes with their log-variance, samples without audio."""
    rng = np.random.default_rng(seed)
    for s, count in enumerate((n // 2, n - n // 2)):
        with ShardWriter(out, shard_name(0, s)) as w:
            for i in range(count):
                k = s * 100 + i
                L = int(rng.integers(3, 20))
                ids = rng.integers(0, 300, L).astype(np.int32)
                labels = np.where(rng.random(L) < 0.5, -100, ids).astype(np.int32)
                fields = {"json": {"sample_rate": 24000, "duration_s": 1.0}, "input_ids.npy": ids,
                          "labels.npy": labels}
                items = int(rng.integers(0, 4))
                if items:
                    F = [int(rng.integers(1, 9)) for _ in range(items)]
                    T = [f * 960 for f in F]
                    fields["codes.npy"] = rng.integers(0, 1024, (4, sum(F))).astype(np.int16)
                    fields["audio.npy"] = rng.integers(-32768, 32767, sum(T)).astype(np.int16)
                    fields["audio_starts.npy"] = np.cumsum([0] + T).astype(np.int32)
                    fields["audio_segments.npy"] = rng.integers(0, 50, (items, 6)).astype(np.int32)
                    fields["audio_16k.npy"] = rng.integers(-32768, 32767, sum(T) * 2 // 3).astype(np.int16)
                    fields["audio_16k_starts.npy"] = (np.cumsum([0] + T) * 2 // 3).astype(np.int32)
                if k % 3 != 1:
                    shp = [(8, 1, 4, 6), (8, 2, 6, 4), (8, 1, 4, 4)][(k // 3) % 3]
                    fields["latents.npy"] = rng.standard_normal(shp).astype(np.float16)
                    fields["latents_logvar.npy"] = rng.standard_normal(shp).astype(np.float16)
                w.add(f"c{k:04d}", fields)
            w.commit()
    merge_parts(out, {"codebook_size": 1024, "n_codebooks": 4, "text": {"vocab_size": 300, "pad_id": PAD_ID}})
    return out


FIELDS = ("input_ids", "labels", "codes", "audio", "audio_starts", "audio_segments", "audio_16k",
          "audio_16k_starts", "latents", "latents_logvar")


#: pad value of each field (the format's conventions: -100 where a loss ignores, the cache's text pad id,
#: the last offset for item offsets, -1 rows of segments, silence, zero latents)
PADS = {"input_ids": PAD_ID, "labels": -100, "codes": -100, "audio": 0, "audio_starts": "last",
        "audio_segments": -1, "audio_16k": 0, "audio_16k_starts": "last", "latents": 0.0, "latents_logvar": 0.0}


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> Path:
    return conversation_cache(tmp_path_factory.mktemp("conv") / "c")


def assert_same(ref: dict, got: dict) -> None:
    assert set(ref) == set(got), set(ref) ^ set(got)
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == got[k].dtype and v.shape == got[k].shape, k
            assert torch.equal(v, got[k]), k
        else:
            assert v == got[k], k


@pytest.mark.parametrize("compact", [True, False])
def test_loader_batches_equal_collate_fn_for_every_kind(conv, compact):
    reader = ShardReader(conv)
    row = {k: i for i, k in enumerate(reader.keys)}
    ld = ShardLoader(conv, 5, fields=FIELDS, seed=0, order=Order(drop_remainder=False), reads=Reads(compact=compact))
    batches = list(ld)
    assert len(batches) == 3
    partial = 0
    for b in batches:
        samples = [reader.get(row[k]) for k in b["keys"]]
        ref = collate_fn(samples, FIELDS, compact=compact, pad_id=PAD_ID)
        assert_same(ref, b)
        for j, smp in enumerate(samples):  # the padding, from the format's conventions, not from the kinds
            for name, pad in PADS.items():
                a = smp.get(name)
                want = np.full(tuple(b[name].shape[1:]), 0 if pad == "last" else pad, np.float64)
                if a is not None:
                    if pad == "last":
                        want[:] = a[-1]
                    want[tuple(slice(0, d) for d in a.shape)] = a
                scale = 1 / 32768 if name in ("audio", "audio_16k") and not compact else 1  # PCM / full scale
                np.testing.assert_array_equal(b[name][j].double().numpy(), want * scale, err_msg=name)
        partial += int((b["has_image"] & ~b["latents_mask"].flatten(1).all(dim=1)).sum())
    assert partial  # some image padded along T, H or W: several runs per sample
    assert any((~b["audio_mask"]).any() for b in batches) and any(b["audio_segments_count"].min() == 0
                                                                  for b in batches)


def test_keys_at_slices_the_arrow_key_buffer(tmp_path):
    """Keys of any rows (repeated, non-ASCII, of a sliced index whose Arrow array has an offset)."""
    keys = ["a", "ü-Ünï", "日本語-7", "", "x" * 150, "last"]
    with ShardWriter(tmp_path, shard_name(0, 0)) as w:
        for k in keys[:3] + keys[4:]:
            w.add(k or "e", {"json": {"sample_rate": 0}, "input_ids.npy": np.arange(3, dtype=np.int32)})
        w.commit()
    merge_parts(tmp_path, {"text": {"vocab_size": 10, "pad_id": 0}})
    full = ShardReader(tmp_path)
    shifted = ShardReader(tmp_path)  # the same keys in an Arrow array that starts at offset 1 of its buffers
    shifted.key_array = pa.concat_arrays([pa.array(["pad"]), shifted.key_array]).slice(1)
    assert shifted.key_array.offset == 1
    for reader in (full, shifted, ShardReader(tmp_path, index=full.index.slice(2), shard_names=full.shard_names)):
        names = reader.key_array.to_pylist()
        rows = np.array([len(names) - 1, 0, 0, 1, len(names) - 1], dtype=np.int64)
        assert reader.keys_at(rows) == [names[r] for r in rows]
        assert reader.keys_at(np.zeros(0, np.int64)) == []


def test_a_sample_twice_in_one_batch(conv):
    """(MixedLoader repeats the samples of a small source within an epoch.)"""
    ld = ShardLoader(conv, 4, fields=FIELDS, seed=0, reads=Reads(compact=True))
    reader = ShardReader(conv)
    ids = np.array([3, 3, 9, 3], dtype=np.int64)
    b = ld.sources.read_batch(ids)
    ref = collate_fn([reader.get(int(i)) for i in ids], FIELDS, compact=True, pad_id=PAD_ID)
    assert_same(ref, b)


def test_a_plugin_kind_needs_no_reader_code(tmp_path):
    """A field of a kind declared outside the project (tests/plugin_fields.py's frame features) is
    read by the same path: geometry, padding, mask and widening all come from its kind."""
    import plugin_fields  # noqa: F401 (registers "mel")
    rng = np.random.default_rng(1)
    with ShardWriter(tmp_path, shard_name(0, 0)) as w:
        for i in range(6):
            mel = rng.standard_normal((8, int(rng.integers(1, 30)))).astype(np.float16)
            w.add(f"m{i}", {"json": {}, "mel.npy": mel, "input_ids.npy": np.arange(3, dtype=np.int32)})
        w.commit()
    merge_parts(tmp_path, {})
    assert registry.get("mel").kind.name == "frame_features"
    reader = ShardReader(tmp_path)
    for compact in (True, False):
        for b in ShardLoader(tmp_path, 3, fields=("mel", "input_ids"), seed=2, reads=Reads(compact=compact)):
            ref = collate_fn([reader.get(reader.keys.index(k)) for k in b["keys"]], ("mel", "input_ids"),
                             compact=compact)
            assert_same(ref, b)
            assert b["mel"].dtype == (torch.float16 if compact else torch.float32)


def test_host_blocks_are_reused_only_once_their_batch_is_gone():
    """The loader's own process reuses batch memory (no page faults per batch), never under a live batch."""
    import gc

    from loaders.host import HostArena
    arena = HostArena(keep=2)

    def batch(n):
        return arena.allocate([("x", (n,), torch.int16), ("m", (n, 2), torch.bool)])

    small = batch(1000)
    first = small["x"].data_ptr()
    big = batch(600_000)  # does not fit the small block: a block of its own
    assert big["x"].data_ptr() != first
    x = small["x"]
    del small
    gc.collect()
    held = batch(800)
    assert held["x"].data_ptr() != first  # a tensor of the batch is still alive: not reused
    del x
    gc.collect()
    again = batch(500)
    assert again["x"].data_ptr() == first  # its batch is gone: reused
    again["x"].fill_(7)
    del big
    gc.collect()
    other = batch(500)  # the big block is free, the small one is not
    assert other["x"].data_ptr() not in (first, held["x"].data_ptr()) and (again["x"] == 7).all()


def test_read_ahead_close_waits_for_the_reads_in_flight():
    """close() returns only once no reader thread is left: a daemon thread still inside a read when
    the interpreter finalises aborts the process (SIGABRT, "terminate called without an active
    exception"; seen in the truncated-shard test of tests/test_shards_safety.py)."""
    import threading
    import time

    from loaders.readahead import ReadAhead

    started = threading.Event()

    def slow_read(step: int) -> int:
        started.set()
        time.sleep(0.3)  # a read in flight when the consumer gives up
        return step

    ahead = ReadAhead(slow_read, range(8), threads=2, depth=2)
    assert started.wait(5)
    ahead.close()
    assert not any(t.is_alive() for t in ahead._workers)
    ahead.close()  # a second close (the atexit hook after the iterator's own) is harmless


def test_reading_without_the_native_reader_says_so_once(conv, monkeypatch, caplog):
    """An install where shards._readv could not be built reads with the python executor and says
    why, once per process; asking for it (SHARDCACHE_NATIVE_READ=0) is not warned about."""
    import logging

    from shards import readinto
    monkeypatch.setattr(readinto, "EXECUTOR", "python")
    monkeypatch.setattr(readinto, "_said", False)
    monkeypatch.delenv("SHARDCACHE_NATIVE_READ", raising=False)
    with caplog.at_level(logging.WARNING, logger="loaders"):
        ShardLoader(conv, 4, fields=FIELDS).close()
        ShardLoader(conv, 4, fields=FIELDS).close()
    said = [r.getMessage() for r in caplog.records if "native reader) is not built" in r.getMessage()]
    assert len(said) == 1 and "pip install -e ." in said[0]
    caplog.clear()
    monkeypatch.setattr(readinto, "_said", False)
    monkeypatch.setenv("SHARDCACHE_NATIVE_READ", "0")
    with caplog.at_level(logging.WARNING, logger="loaders"):
        ShardLoader(conv, 4, fields=FIELDS).close()
    assert not [r for r in caplog.records if "not built" in r.getMessage()]


@pytest.mark.parametrize("threads, depth", [(1, 2), (2, 2), (3, 1)])
def test_an_epoch_after_the_first_makes_no_new_host_block(tmp_path, threads, depth):
    """The loader's own process keeps as many free blocks as its read-ahead threads and the consumer
    can hold at once, so it never makes more blocks than that, epoch after epoch (with too few kept,
    a freed block was dropped and a fresh one page-faulted in every few batches: 15 MB of float32
    batch cost milliseconds). Samples of one shape: every batch needs the same block size."""
    rng = np.random.default_rng(0)
    with ShardWriter(tmp_path, shard_name(0, 0)) as w:
        for i in range(24):
            w.add(f"u{i:03d}", {"json": {"sample_rate": 16000}, "audio.npy": rng.integers(-9, 9, 4000).astype(np.int16),
                               "input_ids.npy": rng.integers(1, 50, 7).astype(np.int32)})
        w.commit()
    merge_parts(tmp_path, {"text": {"vocab_size": 50, "pad_id": 0}})
    ld = ShardLoader(tmp_path, 3, fields=("audio", "input_ids"), seed=0, workers=Workers(read_threads=threads, prefetch_factor=depth))
    made = []
    for e in range(4):
        ld.set_epoch(e)
        for b in ld:
            del b
        made.append(ld.sources._host().blocks_made)
    assert 0 < made[0] and made[-1] <= ld.sources.host_blocks, (made, ld.sources.host_blocks)
    ld.close()
