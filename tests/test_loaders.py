"""Tests of stage two's loaders on small synthetic caches (built with shards.ShardWriter)."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest
import torch
import webdataset as wds

import shards
from shards import ShardReader, ShardWriter, UnsafeMember, merge_parts, scan_shard, shard_name
from shards.index import rows_to_table, REJECTS_SCHEMA
from shards.merge import write_cache_files

from loaders import (CODES_PAD_ID, TEXT_PAD_ID, Mix, MixedLoader, Order, Reads, ShardLoader, Workers, collate_fn,
                     padding_stats)
from shardcache.ranks import Ranks
from loaders.batching import BudgetPlan, FixedPlan
from loaders.order import epoch_order, rng_for

REPO = Path(__file__).resolve().parents[1]
LATENT = (4, 1, 2, 3)


def make_cache(root: Path, shard_sizes=(7, 13, 5), *, seed=0, image_every=3, frames=(3, 40),
               prefix="s", sr=16000, latent_shapes=(LATENT,), ncb=2, logvar=False) -> Path:
    """A cache of len(shard_sizes) shards; varying codes/audio/text lengths; every
    ``image_every``-th sample has latents (shape cycling through ``latent_shapes``), and
    ``latents_logvar`` of the same shape when ``logvar``."""
    rng = np.random.default_rng(seed)
    k = 0
    for s, n in enumerate(shard_sizes):
        with ShardWriter(root, shard_name(0, s)) as w:
            for _ in range(n):
                F = int(rng.integers(frames[0], frames[1] + 1))
                T = F * 40
                fields = {
                    "json": {"sample_rate": sr, "duration_s": T / sr, "speaker": f"spk{k % 3}",
                             "text": "x"},
                    "codes.npy": rng.integers(0, 1024, (ncb, F)).astype(np.int16),
                    "audio.npy": rng.integers(-32768, 32767, T).astype(np.int16),
                    "input_ids.npy": rng.integers(1, 500, int(rng.integers(1, 12))).astype(np.int32),
                }
                if image_every and k % image_every == 0:
                    shp = latent_shapes[(k // image_every) % len(latent_shapes)]
                    fields["latents.npy"] = rng.standard_normal(shp).astype(np.float16)
                    if logvar:
                        fields["latents_logvar.npy"] = (rng.standard_normal(shp) - 3).astype(np.float16)
                w.add(f"{prefix}{s}_{k:04d}", fields)
                k += 1
            w.commit()
    merge_parts(root, {"test": True})
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return make_cache(tmp_path_factory.mktemp("cache"))


def epoch_keys(loader, epoch=None):
    if epoch is not None:
        loader.set_epoch(epoch)
    return [list(b["keys"]) for b in loader]


def flat(batches):
    return [k for b in batches for k in b]


# --------------------------------------------------------------------------------------- collate
def test_collate_shapes_dtypes_pads_masks(cache):
    reader = ShardReader(cache)
    samples = [reader.get(i) for i in range(6)]
    b = collate_fn(samples)
    B = 6
    F = max(s["codes"].shape[1] for s in samples)
    T = max(s["audio"].shape[0] for s in samples)
    L = max(s["input_ids"].shape[0] for s in samples)
    assert b["keys"] == [s["__key__"] for s in samples] and b["sample_rate"] == 16000
    assert b["codes"].shape == (B, 2, F) and b["codes"].dtype == torch.int64
    assert b["audio"].shape == (B, T) and b["audio"].dtype == torch.float32
    assert b["input_ids"].shape == (B, L) and b["input_ids"].dtype == torch.int64
    assert b["latents"].shape == (B, *LATENT) and b["latents"].dtype == torch.float32
    assert b["has_image"].dtype == torch.bool
    assert b["latents_mask"].shape == (B, *LATENT[1:]) and b["latents_mask"].dtype == torch.bool
    assert torch.equal(b["latents_mask"], b["has_image"][:, None, None, None].expand(B, *LATENT[1:]))
    for lengths, mask in (("codes_lengths", "codes_mask"), ("audio_lengths", "audio_mask"),
                          ("input_lengths", "attention_mask")):
        assert b[lengths].dtype == torch.int64 and b[mask].dtype == torch.bool
    for j, s in enumerate(samples):
        f, t, l = s["codes"].shape[1], s["audio"].shape[0], s["input_ids"].shape[0]
        assert b["codes_lengths"][j] == f and b["audio_lengths"][j] == t and b["input_lengths"][j] == l
        assert torch.equal(b["codes"][j, :, :f], torch.from_numpy(s["codes"].astype(np.int64)))
        assert (b["codes"][j, :, f:] == CODES_PAD_ID).all()
        assert b["codes_mask"][j, :f].all() and not b["codes_mask"][j, f:].any()
        assert torch.equal(b["audio"][j, :t], torch.from_numpy(s["audio"].astype(np.float32) / 32768))
        assert (b["audio"][j, t:] == 0).all() and b["audio_mask"][j].sum() == t
        assert torch.equal(b["input_ids"][j, :l], torch.from_numpy(s["input_ids"].astype(np.int64)))
        assert (b["input_ids"][j, l:] == TEXT_PAD_ID).all() and b["attention_mask"][j].sum() == l
        if "latents" in s:
            assert b["has_image"][j]
            assert torch.equal(b["latents"][j], torch.from_numpy(s["latents"].astype(np.float32)))
        else:
            assert not b["has_image"][j] and (b["latents"][j] == 0).all()
    assert b["audio"].abs().max() <= 1.0
    only = collate_fn(samples, fields=("codes",))
    assert set(only) == {"keys", "sample_rate", "codes", "codes_lengths", "codes_mask"}


def test_loader_batch_equals_collate_fn(cache):
    loader = ShardLoader(cache, 4, seed=3)
    reader = ShardReader(cache)
    row = {k: i for i, k in enumerate(reader.keys)}
    for b in loader:
        ref = collate_fn([reader.get(row[k]) for k in b["keys"]], latent_shape=LATENT)
        assert set(ref) == set(b)
        for k, v in ref.items():
            assert torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k], k
    sub = next(iter(ShardLoader(cache, 4, fields=("input_ids", "latents"))))
    assert set(sub) == {"keys", "sample_rate", "input_ids", "input_lengths", "attention_mask", "latents",
                        "latents_mask", "has_image"}


def check_padded_latents(b, samples, names=("latents",)):
    """Every latent field of batch ``b`` holds each sample's array in its corner, 0.0 elsewhere;
    ``latents_mask`` is True exactly on the corner (T, H, W) and all False without an image."""
    B, C, T, H, W = b["latents"].shape if "latents" in b else b[names[0]].shape
    assert b["latents_mask"].shape == (B, T, H, W) and b["latents_mask"].dtype == torch.bool
    for j, s in enumerate(samples):
        ref = s.get(names[0])
        assert bool(b["has_image"][j]) == (ref is not None)
        if ref is None:
            assert not b["latents_mask"][j].any()
        else:
            c, t, h, w = ref.shape
            want = torch.zeros(T, H, W, dtype=torch.bool)
            want[:t, :h, :w] = True
            assert torch.equal(b["latents_mask"][j], want)
        for name in names:
            a = s.get(name)
            got = b[name][j]
            if a is None:
                assert (got == 0).all()
                continue
            c, t, h, w = a.shape
            assert torch.equal(got[:c, :t, :h, :w], torch.from_numpy(a.astype(np.float32)))
            rest = got.clone()
            rest[:c, :t, :h, :w] = 0
            assert (rest == 0).all(), name  # padding is exactly zero


def test_collate_pads_mixed_latent_shapes(tmp_path):
    wide, tall = (16, 1, 4, 6), (16, 1, 6, 4)
    c = make_cache(tmp_path / "c", (9,), image_every=1, latent_shapes=(wide, tall), logvar=True)
    reader = ShardReader(c)
    samples = [reader.get(i) for i in range(4)]
    assert {s["latents"].shape for s in samples} == {wide, tall}
    no_image = {k: v for k, v in samples[1].items() if not k.startswith("latents")}
    mixed = [samples[0], no_image, samples[1], samples[2], samples[3]]
    b = collate_fn(mixed)
    assert b["latents"].shape == (5, 16, 1, 6, 6) and b["latents"].dtype == torch.float32
    assert b["has_image"].tolist() == [True, False, True, True, True]
    assert b["latents_mask"].sum().item() == 4 * 24  # 24 real cells per image, none for no_image
    assert "latents_logvar" not in b  # only on request
    check_padded_latents(b, mixed)
    both = collate_fn(mixed, fields=("latents", "latents_logvar"))
    assert both["latents_logvar"].shape == both["latents"].shape
    check_padded_latents(both, mixed, names=("latents", "latents_logvar"))
    # equal shapes: the fast path, mask = has_image broadcast, nothing padded
    same = collate_fn([samples[0], no_image, samples[2]])
    assert same["latents"].shape == (3, *wide)
    check_padded_latents(same, [samples[0], no_image, samples[2]])
    # the loader (index offsets + mmap views) gives the same batches as collate_fn
    row = {k: i for i, k in enumerate(reader.keys)}
    loader = ShardLoader(c, 4, fields=("codes", "latents", "latents_logvar"), order=Order(shuffle=False))
    shapes = set()
    for lb in loader:
        ref = collate_fn([reader.get(row[k]) for k in lb["keys"]], fields=("codes", "latents", "latents_logvar"))
        assert set(ref) == set(lb)
        for k, v in ref.items():
            assert torch.equal(v, lb[k]) if isinstance(v, torch.Tensor) else v == lb[k], k
        shapes.add(tuple(lb["latents"].shape))
    assert shapes == {(4, 16, 1, 6, 6)}


def test_latents_logvar_only_on_request_and_required(tmp_path, cache):
    with_lv = make_cache(tmp_path / "lv", (5, 4), image_every=2, latent_shapes=(LATENT,), logvar=True)
    default = next(iter(ShardLoader(with_lv, 4, order=Order(shuffle=False))))
    assert "latents_logvar" not in default and "latents_mask" in default
    b = next(iter(ShardLoader(with_lv, 4, fields=("latents_logvar",), order=Order(shuffle=False))))
    assert set(b) == {"keys", "sample_rate", "latents_logvar", "latents_mask", "has_image"}
    reader = ShardReader(with_lv)
    samples = [reader.get(i) for i in range(4)]
    check_padded_latents(b, samples, names=("latents_logvar",))
    with pytest.raises(ValueError, match="store_posterior"):  # cache written without logvar
        ShardLoader(cache, 4, fields=("latents", "latents_logvar"))
    plain = ShardReader(cache)
    with pytest.raises(KeyError, match="latents_logvar"):
        collate_fn([plain.get(0)], fields=("latents", "latents_logvar"))
    with pytest.raises(ValueError, match="unknown fields"):
        collate_fn(samples, fields=("latents_var",))


def test_bucketed_demo_images_batch_together(tiny_config, tmp_path):
    """image_resize=bucket keeps aspect ratios: the demo photos give several latent shapes,
    and one ShardLoader batch holds all of them, zero-padded, with latents_mask."""
    import dataclasses
    from conftest import DEMO
    from precompute.job import run
    from shards import read_index
    cfg = dataclasses.replace(tiny_config, image_resize="bucket")
    run(DEMO / "samples.jsonl", tmp_path / "c", cfg, progress=False)
    rows = read_index(tmp_path / "c").to_pylist()
    shapes = {r["key"]: tuple(m["shape"]) for r in rows for m in r["members"] if m["name"] == "latents.npy"}
    assert len(set(shapes.values())) >= 2, shapes
    assert all(s[:2] == (16, 1) and 40 <= s[2] * 8 * s[3] * 8 / 64 <= 88 for s in shapes.values())
    loader = ShardLoader(tmp_path / "c", len(shapes), filters={"has_image": True}, order=Order(shuffle=False))
    b = next(iter(loader))
    assert b["has_image"].all() and len(b["keys"]) == len(shapes)
    C, T, H, W = (max(s[i] for s in shapes.values()) for i in range(4))
    assert b["latents"].shape == (len(shapes), C, T, H, W)
    reader = ShardReader(tmp_path / "c")
    row = {k: i for i, k in enumerate(reader.keys)}
    check_padded_latents(b, [reader.get(row[k]) for k in b["keys"]])


# ------------------------------------------------------------------------------ order and split
def test_epoch_order_is_shard_grouped_permutation():
    shard_of = np.repeat([0, 1, 2], [7, 13, 5])
    o = epoch_order(shard_of, 0, 0)
    assert sorted(o.tolist()) == list(range(25))
    runs = [k for k, _ in __import__("itertools").groupby(shard_of[o])]
    assert len(runs) == 3  # each shard read contiguously
    assert not np.array_equal(o, epoch_order(shard_of, 0, 1))
    assert np.array_equal(o, epoch_order(shard_of, 0, 0))
    assert np.array_equal(epoch_order(shard_of, 0, 0, shuffle=False), np.arange(25))
    w = epoch_order(shard_of, 0, 0, window=8)
    assert sorted(w.tolist()) == list(range(25)) and not np.array_equal(w, o)


def test_two_ranks_two_workers_see_each_sample_once(cache):
    # 3 shards of 7/13/5 samples, 2 ranks x 2 workers: fewer shards than ranks x workers.
    loaders = [ShardLoader(cache, 3, seed=1, ranks=Ranks(r, 2), workers=Workers(num_workers=2)) for r in range(2)]
    for epoch in (0, 1):
        per_rank = [epoch_keys(ld, epoch) for ld in loaders]
        assert len(per_rank[0]) == len(per_rank[1]) == len(loaders[0]) == len(loaders[1]) == 4
        assert all(len(b) == 3 for r in per_rank for b in r)
        seen = flat(per_rank[0]) + flat(per_rank[1])
        assert len(seen) == len(set(seen)) == 24  # 25 samples, G = 6, tail of 1 dropped
    for ld in loaders:
        ld.close()


def test_drop_remainder_false_wraps(cache):
    loaders = [ShardLoader(cache, 3, ranks=Ranks(r, 2), order=Order(drop_remainder=False)) for r in range(2)]
    per_rank = [epoch_keys(ld) for ld in loaders]
    assert len(per_rank[0]) == len(per_rank[1]) == 5
    seen = flat(per_rank[0]) + flat(per_rank[1])
    assert len(seen) == 30 and len(set(seen)) == 25


def test_fewer_shards_than_ranks_times_workers(tmp_path):
    c = make_cache(tmp_path / "one", (11,))
    loaders = [ShardLoader(c, 2, ranks=Ranks(r, 3), workers=Workers(num_workers=3)) for r in range(3)]
    per_rank = [epoch_keys(ld) for ld in loaders]
    assert [len(r) for r in per_rank] == [1, 1, 1]
    seen = flat(sum(per_rank, []))
    assert len(seen) == len(set(seen)) == 6
    for ld in loaders:
        ld.close()


def test_epochs_differ_and_seed_epoch_reproduce(cache):
    a, b = ShardLoader(cache, 4, seed=5), ShardLoader(cache, 4, seed=5)
    e0, e1 = epoch_keys(a, 0), epoch_keys(a, 1)
    assert e0 != e1 and sorted(flat(e0)) != [] and set(flat(e0)) != set() and len(e0) == len(e1) == 6
    assert epoch_keys(b, 1) == e1 and epoch_keys(b, 0) == e0
    assert epoch_keys(ShardLoader(cache, 4, seed=6)) != e0
    assert flat(epoch_keys(ShardLoader(cache, 4, order=Order(shuffle=False)))) == ShardReader(cache).keys[:24]


def test_order_independent_of_num_workers(cache):
    ref = [epoch_keys(ShardLoader(cache, 2, seed=2, ranks=Ranks(r, 2)), 1) for r in range(2)]
    for nw in (1, 2, 3):
        got = [epoch_keys(ShardLoader(cache, 2, seed=2, ranks=Ranks(r, 2), workers=Workers(num_workers=nw)), 1)
               for r in range(2)]
        assert got == ref, nw


def test_persistent_workers_follow_set_epoch_and_state(cache):
    ref = ShardLoader(cache, 3, seed=4)
    ld = ShardLoader(cache, 3, seed=4, workers=Workers(num_workers=2, prefetch_factor=4))
    for e in range(3):
        assert epoch_keys(ld, e) == epoch_keys(ref, e)
    # state counts what the consumer received, not what the workers prefetched
    ld.set_epoch(7)
    it = iter(ld)
    first = next(it)
    assert ld.state_dict()["cursor"] == 3 and ld.step == 1
    sd = ld.state_dict()
    next(it)
    ld.load_state_dict(sd)  # same loader, workers still holding prefetched batches
    rest = [b["keys"] for b in ld]
    full = epoch_keys(ref, 7)
    assert [first["keys"]] + rest == full
    ld.close()


# ----------------------------------------------------------------------------------------- resume
@pytest.mark.parametrize("nw_a,nw_b", [(0, 0), (2, 2), (0, 2), (2, 1)])
def test_resume_continues_identically(cache, nw_a, nw_b):
    full = epoch_keys(ShardLoader(cache, 2, seed=9), 2)
    for k in (1, 5, len(full) - 1, len(full)):
        a = ShardLoader(cache, 2, seed=9, workers=Workers(num_workers=nw_a))
        a.set_epoch(2)
        got = []
        for b in a:
            got.append(b["keys"])
            if len(got) == k:
                break
        sd = a.state_dict()
        assert sd["cursor"] == 2 * k and sd["epoch"] == 2
        b = ShardLoader(cache, 2, seed=9, workers=Workers(num_workers=nw_b))
        b.load_state_dict(sd)
        b.set_epoch(2)  # same epoch: keeps the cursor
        assert len(b) == len(full) and b.step == k
        with __import__("warnings").catch_warnings():
            __import__("warnings").simplefilter("ignore")
            rest = [x["keys"] for x in b]
        assert got + rest == full, k
        a.close()
        b.close()


def test_resume_world_2_to_1_same_global_batch(cache):
    two = [ShardLoader(cache, 3, seed=11, ranks=Ranks(r, 2)) for r in range(2)]
    one = ShardLoader(cache, 6, seed=11, ranks=Ranks(0, 1))
    steps2 = list(zip(*[epoch_keys(ld) for ld in two]))
    steps1 = epoch_keys(one)
    assert [a + b for a, b in steps2] == steps1  # same global samples per step, rank order
    two = [ShardLoader(cache, 3, seed=11, ranks=Ranks(r, 2)) for r in range(2)]
    it = [iter(ld) for ld in two]
    for _ in range(2):
        for i in it:
            next(i)
    sd0, sd1 = two[0].state_dict(), two[1].state_dict()
    assert sd0 == sd1 and sd0["cursor"] == 12 and sd0["world_size"] == 2
    resumed = ShardLoader(cache, 6, seed=11, ranks=Ranks(0, 1), workers=Workers(num_workers=2))
    resumed.load_state_dict(sd0)
    assert [b["keys"] for b in resumed] == steps1[2:]
    with pytest.raises(ValueError, match="global batch"):
        ShardLoader(cache, 4, seed=11, ranks=Ranks(0, 1)).load_state_dict(sd0)
    with pytest.raises(ValueError, match="seed"):
        ShardLoader(cache, 6, seed=12).load_state_dict(sd0)
    with pytest.raises(ValueError, match="num_samples"):
        ShardLoader(cache, 6, seed=11, filters={"has_image": False}).load_state_dict(sd0)
    with pytest.raises(ValueError, match="step boundary"):
        ShardLoader(cache, 6, seed=11).load_state_dict(dict(sd0, cursor=7))
    resumed.close()


# ------------------------------------------------------------------------------- unsafe members
def _write_tar(path: Path, samples: list[dict]) -> None:
    with wds.TarWriter(str(path), encoder=False, mtime=0.0) as w:
        for s in samples:
            w.write(s)


def _npy(a):
    from shards.writer import npy_bytes
    return npy_bytes(a)


def _index_tar(root: Path, name: str, rows: list[dict]) -> None:
    from shards.writing import MARKER
    (root / MARKER).write_text("")  # a cache assembled by hand: its folder is declared one (else never written)
    size = (root / name).stat().st_size
    write_cache_files(root, rows_to_table(rows), REJECTS_SCHEMA.empty_table(),
                      [dict(path=name, samples=len(rows), bytes=size, sha256="0" * 64)], {})


def test_pickle_member_is_refused(tmp_path):
    base = {"json": b'{"sample_rate": 16000, "duration_s": 0.1}',
            "codes.npy": _npy(np.zeros((2, 3), np.int16)), "audio.npy": _npy(np.zeros(120, np.int16)),
            "input_ids.npy": _npy(np.ones(2, np.int32))}
    # (a) KEY.pyd: indexed by scan_shard (its check misses a bare ".pyd" extension), refused by us
    root = tmp_path / "pyd"
    root.mkdir()
    name = shard_name(0, 0)
    _write_tar(root / name, [dict(base, __key__="good"), dict(base, __key__="evil", pyd=b"\x80\x04.")])
    try:
        rows, _, _ = scan_shard(root / name)
    except UnsafeMember as e:  # once shards fixes its check
        assert "evil" in str(e)
    else:
        _index_tar(root, name, rows)
        with pytest.raises(UnsafeMember) as e:
            ShardLoader(root, 1)
        assert name in str(e.value) and "'evil'" in str(e.value) and "unpickling" in str(e.value)
    # (b) KEY.x.pkl: scan_shard itself refuses it; an index that lists it anyway is refused too
    root = tmp_path / "pkl"
    root.mkdir()
    _write_tar(root / name, [dict(base, __key__="good"), dict(base, __key__="evil", **{"x.pkl": b"\x80\x04."})])
    with pytest.raises(UnsafeMember, match="evil"):
        scan_shard(root / name)
    _write_tar(root / "clean.tar", [dict(base, __key__="good"), dict(base, __key__="evil")])
    rows, _, _ = scan_shard(root / "clean.tar", shard_name=name)
    rows[1]["members"].append(dict(name="x.pkl", offset=0, size=4, dtype="bytes", shape=[]))
    _index_tar(root, name, rows)
    with pytest.raises(UnsafeMember) as e:
        ShardLoader(root, 1)
    assert name in str(e.value) and "'evil'" in str(e.value)


def test_missing_or_truncated_shard_is_reported(tmp_path):
    c = make_cache(tmp_path / "c", (4, 4))
    victim = sorted(c.glob("shard-*.tar"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(shards.ShardCorrupt, match=victim.name):
        ShardLoader(c, 2)
    victim.unlink()
    with pytest.raises(shards.ShardCorrupt, match="missing"):
        ShardLoader(c, 2)


# -------------------------------------------------------------------------------------- filters
def test_filters_on_index_columns(cache):
    reader = ShardReader(cache)
    dur = dict(zip(reader.keys, reader.index.column("duration_s").to_pylist()))
    lo, hi = 0.03, 0.07
    ld = ShardLoader(cache, 1, filters={"duration_s": (lo, hi)}, order=Order(shuffle=False))
    keys = flat(epoch_keys(ld))
    assert keys == [k for k in reader.keys if lo <= dur[k] <= hi] and keys
    img = flat(epoch_keys(ShardLoader(cache, 1, filters={"has_image": True})))
    assert len(img) == 9
    for b in ShardLoader(cache, 3, filters={"has_image": True}):
        assert b["has_image"].all()
    spk = flat(epoch_keys(ShardLoader(cache, 1, filters={"speaker": ["spk0", "spk2"], "has_image": False})))
    assert spk and all(int(k.split("_")[1]) % 3 == 2 for k in spk)  # spk0 samples all have images
    nf = dict(zip(reader.keys, reader.index.column("n_frames").to_pylist()))
    call = flat(epoch_keys(ShardLoader(cache, 1, filters=lambda t: pc.greater(t["n_frames"], 20))))
    assert sorted(call) == sorted(k for k in reader.keys if nf[k] > 20)
    with pytest.raises(ValueError, match="unknown index column"):
        ShardLoader(cache, 1, filters={"nope": 1})
    with pytest.raises(ValueError, match="no sample left"):
        ShardLoader(cache, 1, filters={"duration_s": (100, None)})
    with pytest.raises(ValueError, match="no step"):
        ShardLoader(cache, 30)


# ------------------------------------------------------------------------------------ bucketing
def test_budget_batching_reduces_padding_and_splits_evenly(tmp_path):
    c = make_cache(tmp_path / "c", (60, 50, 70), frames=(5, 200), image_every=0)
    frames = ShardReader(c).index.column("n_frames").to_numpy()
    order = epoch_order(np.repeat([0, 1, 2], [60, 50, 70]), 0, 0)
    fixed = padding_stats(FixedPlan(order, 2, 8), frames)
    budget_plan = BudgetPlan(order, frames, 2, 8 * 100, 64, 96, rng_for(0, 0, 1))
    budget = padding_stats(budget_plan, frames)
    assert budget["ratio"] < 1.25 < 1.5 < fixed["ratio"], (budget, fixed)
    for _, _, ids in budget_plan.batches():
        assert len(ids) * frames[ids].max() <= 800
    # through the loader: 2 ranks, equal steps, every kept batch within budget, each sample once
    lds = [ShardLoader(c, 64, seed=1, ranks=Ranks(r, 2), order=Order(max_frames=800)) for r in range(2)]
    seen = []
    for ld in lds:
        n = 0
        for b in ld:
            n += 1
            B, _, F = b["codes"].shape
            assert B * F <= 800
            seen += b["keys"]
        assert n == len(ld)
    assert len(lds[0]) == len(lds[1]) and len(seen) == len(set(seen)) > 150
    # resume in budget mode: world 2 -> 1 (every 2-rank step boundary is a 1-rank one)
    lds = [ShardLoader(c, 64, seed=1, ranks=Ranks(r, 2), order=Order(max_frames=800)) for r in range(2)]
    it = [iter(ld) for ld in lds]
    for _ in range(3):
        for i in it:
            next(i)
    one = ShardLoader(c, 64, seed=1, ranks=Ranks(0, 1), order=Order(max_frames=800))
    full = epoch_keys(one)
    one2 = ShardLoader(c, 64, seed=1, ranks=Ranks(0, 1), order=Order(max_frames=800), workers=Workers(num_workers=2))
    one2.load_state_dict(lds[0].state_dict())
    assert epoch_keys(one2) == full[6:]
    with pytest.raises(ValueError, match="max_frames"):
        ShardLoader(c, 64, seed=1, ranks=Ranks(0, 1), order=Order(max_frames=900)).load_state_dict(lds[0].state_dict())
    one2.close()


# --------------------------------------------------------------------------------------- mixing
def test_mixing_ratio_and_determinism(tmp_path):
    a = make_cache(tmp_path / "a", (30, 40), prefix="a", seed=1)
    b = make_cache(tmp_path / "b", (25,), prefix="b", seed=2)
    kw = dict(mix=Mix(weights={"speech": 0.7, "other": 0.3}, samples_per_epoch=200), seed=3)
    m = MixedLoader({"speech": a, "other": b}, 10, **kw)
    assert len(m) == 20
    counts, seqs = Counter(), []
    for batch in m:
        counts.update(batch["source"])
        seqs.append(batch["keys"])
        assert all(k.startswith("a" if s == "speech" else "b") for k, s in zip(batch["keys"], batch["source"]))
    assert counts == {"speech": 140, "other": 60}
    m2 = MixedLoader({"speech": a, "other": b}, 10, **kw, workers=Workers(num_workers=2))
    assert epoch_keys(m2) == seqs
    seqs1 = epoch_keys(m2, 1)
    assert seqs1 != seqs
    # 60 "other" per epoch from 25 samples: passes repeat with new orders, each sample 2-3 times
    per = Counter(k for s in seqs for k in s if k.startswith("b"))
    assert set(per.values()) <= {2, 3} and len(per) == 25
    # default epoch size: no source repeats within an epoch
    d = MixedLoader({"speech": a, "other": b}, 5, mix=Mix(weights=[0.7, 0.3]))
    keys = flat(epoch_keys(d))
    assert len(keys) == len(set(keys))
    # resume mid-epoch
    m3 = MixedLoader({"speech": a, "other": b}, 10, **kw)
    m3.set_epoch(1)
    it = iter(m3)
    head = [next(it)["keys"] for _ in range(4)]
    m4 = MixedLoader({"speech": a, "other": b}, 10, **kw)
    m4.load_state_dict(m3.state_dict())
    assert head + [x["keys"] for x in m4] == seqs1
    m2.close()


# ------------------------------------------------------------------------------- import boundary
def test_import_boundary_no_decoders():
    code = ("import loaders, sys; bad = {'librosa','soundfile','PIL','diffusers'} & set(sys.modules); "
            "assert not bad, bad; assert loaders.ShardLoader")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


# ---------------------------------------------------------------------------- real processes (DDP)
def _ddp_worker(rank: int, world: int, cache: str, port: int, out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        ld = ShardLoader(cache, 3, seed=7, ranks=Ranks(rank, world), workers=Workers(num_workers=1))
        result = []
        for epoch in (0, 1):
            ld.set_epoch(epoch)
            n = 0
            keys = []
            for b in ld:
                n += 1
                keys += b["keys"]
            counts = [None] * world
            dist.all_gather_object(counts, (n, keys))
            result.append(counts)
        ld.close()
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
@pytest.mark.long  # make test-long; test_loader_ranks' torchrun run covers two gloo ranks in make test
def test_ddp_gloo_two_processes(cache, tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "ddp.pt")
    torch.multiprocessing.spawn(_ddp_worker, args=(2, str(cache), port, out), nprocs=2, join=True)
    result = torch.load(out, weights_only=False)
    orders = []
    for counts in result:
        (n0, k0), (n1, k1) = counts
        assert n0 == n1 == 4
        assert len(k0 + k1) == len(set(k0 + k1)) == 24
        orders.append(k0 + k1)
    assert orders[0] != orders[1]
    ref = [ShardLoader(cache, 3, seed=7, ranks=Ranks(r, 2)) for r in range(2)]
    assert flat(epoch_keys(ref[0])) + flat(epoch_keys(ref[1])) == orders[0]


def test_spawn_context_workers(cache):
    ref = epoch_keys(ShardLoader(cache, 4, seed=8), 3)
    ld = ShardLoader(cache, 4, seed=8, workers=Workers(num_workers=1, multiprocessing_context="spawn"))
    assert epoch_keys(ld, 3) == ref
    ld.close()


def test_epoch_end_state_and_errors(cache):
    import json
    ld = ShardLoader(cache, 5, seed=1)
    keys0 = epoch_keys(ld)
    sd = json.loads(json.dumps(ld.state_dict()))  # plain JSON types
    assert sd["cursor"] == 25 and sd["epoch"] == 0 and set(sd) >= {"epoch", "cursor", "seed", "world_size",
                                                                 "global_batch_size"}
    ld.set_epoch(0)  # same epoch: cursor kept (so set_epoch may follow load_state_dict)
    assert ld.step == 5
    assert epoch_keys(ld) == []  # a finished epoch chosen by set_epoch yields nothing
    assert epoch_keys(ld, 1) != keys0 and ld.step == 5
    fresh = ShardLoader(cache, 5, seed=1)
    fresh.load_state_dict(sd)
    assert fresh.step == len(fresh) == 5
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="global_rank"):
        ShardLoader(cache, 2, ranks=Ranks(2, 2))
    with pytest.raises(ValueError, match="unknown fields"):
        ShardLoader(cache, 2, fields=("codes", "video"))


def test_compact_batches_keep_the_cache_dtypes(tmp_path):
    """compact=True: int16 audio and float16 latents, equal to the float32 batches after conversion."""
    from loaders import AUDIO_SCALE
    cache = tmp_path / "c"
    rng = np.random.default_rng(0)
    with ShardWriter(cache, shard_name(0, 0)) as w:
        for i in range(6):
            fields = {"json": {"text": "t", "sample_rate": 16000, "duration_s": 0.1},
                      "codes.npy": rng.integers(0, 1024, (8, 5 + i)).astype(np.int16),
                      "audio.npy": rng.integers(-30000, 30000, 1600 + 10 * i).astype(np.int16),
                      "input_ids.npy": np.arange(3 + i, dtype=np.int32)}
            if i % 2:
                fields["latents.npy"] = rng.standard_normal((16, 1, 4, 4)).astype(np.float16)
            w.add(f"s{i}", fields)
        w.commit()
    merge_parts(cache, {})
    full = ShardLoader(cache, 3, order=Order(shuffle=False))
    small = ShardLoader(cache, 3, order=Order(shuffle=False), reads=Reads(compact=True))
    full.set_epoch(0)
    small.set_epoch(0)
    for a, b in zip(full, small):
        assert b["audio"].dtype == torch.int16 and b["latents"].dtype == torch.float16
        assert torch.equal(b["audio"].float() * AUDIO_SCALE, a["audio"])
        assert torch.equal(b["latents"].float(), a["latents"])
        assert torch.equal(a["codes"], b["codes"]) and torch.equal(a["audio_mask"], b["audio_mask"])


@pytest.mark.parametrize("n_shards", [1, 5, 2048, 2049, 70_000])
def test_epoch_order_is_its_definition(n_shards):
    """epoch_order is the stable lexsort of (a random float per sample, the shard's permuted rank) and,
    with a window, of (another random float, the window) -- computed here with np.lexsort from the same
    generator draws, shards of uneven sizes, index rows not grouped by shard, repeated floats."""
    rng = np.random.default_rng(n_shards)
    n = max(3 * n_shards, 5000)
    shard_of = rng.integers(0, n_shards, n)
    shard_of[:n_shards] = np.arange(n_shards)  # every shard held
    for window in (0, 64):
        draws = np.random.default_rng([7, 2, 0])
        rank = np.empty(n_shards, dtype=np.int64)
        rank[draws.permutation(n_shards)] = np.arange(n_shards)
        want = np.lexsort((draws.random(n), rank[shard_of]))
        if window:
            want = want[np.lexsort((draws.random(n), np.arange(n) // window))]
        assert np.array_equal(epoch_order(shard_of, 7, 2, window=window), want), (n_shards, window)
