"""Decoded rows cross from the decode processes to the main process in shared memory
(:mod:`precompute.shared_batch`), unchanged and without a copy in the main process."""
from __future__ import annotations

import numpy as np
import torch
from numpy.lib.array_utils import byte_bounds
from torch.utils.data import DataLoader, Dataset

from precompute.manifests import Request
from precompute.prepare import Prepared
from precompute.shared_batch import pack, unpack


def _row(i: int) -> Prepared:
    rng = np.random.default_rng(i)
    return Prepared(req=Request(row=i, key=f"row{i}"), chunk=i // 2,
                    audio=[{24000: rng.standard_normal(24000 + 7 * i).astype(np.float32),
                            16000: rng.standard_normal(16000 + i).astype(np.float32)}, {24000: np.zeros(0, np.float32)}],
                    durations=[1.0, 0.0], orig_sample_rates=[48000, 16000],
                    images=[rng.integers(0, 256, (16, 24 + 8 * i, 3), dtype=np.uint8)],
                    source_images=[rng.integers(0, 256, (33, 17, 3), dtype=np.uint8)[:, ::2]],  # not contiguous
                    input_ids=np.arange(5 + i, dtype=np.int32), labels=None if i % 2 else np.full(5 + i, -100, np.int32))


class Rows(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Prepared:
        return _row(i)


def _same(a: Prepared, b: Prepared) -> None:
    assert a.req.key == b.req.key and a.chunk == b.chunk and a.durations == b.durations
    assert [sorted(x) for x in a.audio] == [sorted(x) for x in b.audio]
    for x, y in zip(a.audio, b.audio):
        for rate in x:
            assert x[rate].dtype == y[rate].dtype and np.array_equal(x[rate], y[rate])
    for xs, ys in ((a.images, b.images), (a.source_images, b.source_images)):
        assert all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) for x, y in zip(xs, ys))
    for x, y in ((a.input_ids, b.input_ids), (a.labels, b.labels)):
        assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y))


def test_rows_cross_a_worker_in_shared_memory_unchanged():
    loader = DataLoader(Rows(), batch_size=3, num_workers=1, collate_fn=pack)
    got = []
    for batch in loader:
        assert batch.buffer.is_shared()  # only a handle crossed the queue
        rows = unpack(batch)
        base = batch.buffer.numpy()
        lo, hi = byte_bounds(base)
        for p in rows:  # every array is a view of the shared buffer, aligned for its dtype
            for a in [x for item in p.audio for x in item.values()] + p.images + p.source_images + [p.input_ids]:
                if a.size:
                    assert lo <= byte_bounds(a)[0] and byte_bounds(a)[1] <= hi and a.flags.aligned
        got += rows
    assert len(got) == 6
    for i, p in enumerate(got):
        _same(p, _row(i))


def test_an_empty_batch_and_a_rejected_row_pack():
    rejected = Prepared(req=Request(row=0, key="bad"), chunk=0, error=("decode_failed", "x"))
    out = unpack(pack([rejected]))
    assert out[0].error == ("decode_failed", "x") and out[0].audio == [] and out[0].input_ids is None
    assert unpack(pack([])) == []
