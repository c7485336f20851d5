"""DataLoader workers hand batches over through reusable shared-memory slots (loaders.shm): the
values equal the one-process loader's, a slot is never rewritten while any tensor of its batch
(or a detached copy, or a numpy view of one) is alive, and slots dropped unread are reclaimed."""
from __future__ import annotations

import gc

import pytest
import torch

from loaders import Reads, ShardLoader, Workers
from loaders import shm as shm_mod
from test_loaders import make_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("workers"), (9, 14, 6), image_every=2,
                      latent_shapes=((4, 1, 2, 3), (4, 1, 3, 2)))


def reference(cache, epoch, **kw) -> list[dict]:
    ld = ShardLoader(cache, 3, seed=3, **kw, workers=Workers(num_workers=0))
    ld.set_epoch(epoch)
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in ld]


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k], v), (want["keys"], k)
        else:
            assert got[k] == v, k


class Counting:
    """Counts batches that came through a slot (SlotBatch.unpack) during the block."""

    def __init__(self, monkeypatch):
        self.n = 0
        orig = shm_mod.SlotBatch.unpack

        def unpack(msg):
            self.n += 1
            return orig(msg)
        monkeypatch.setattr(shm_mod.SlotBatch, "unpack", unpack)


@pytest.mark.parametrize("compact", [False, True])
def test_batches_held_by_the_consumer_are_never_overwritten(cache, monkeypatch, compact):
    """Keep every batch of two epochs alive (more than all slots): the held ones must keep their
    values while workers go on, falling back to one-off blocks when every slot is busy."""
    counted = Counting(monkeypatch)
    want = reference(cache, 0, reads=Reads(compact=compact)) + reference(cache, 1, reads=Reads(compact=compact))
    ld = ShardLoader(cache, 3, seed=3, workers=Workers(num_workers=2, prefetch_factor=2), reads=Reads(compact=compact))
    held = []
    for e in (0, 1):
        ld.set_epoch(e)
        held += list(ld)
    assert len(held) == len(want) == 18
    for got, w in zip(held, want):
        assert_same(got, w)
    assert counted.n > 0  # the slot path ran
    ld.close()


def test_slots_are_reused_and_views_keep_them_alive(cache, monkeypatch):
    """Dropping each batch at once: every batch after warm-up comes through a slot (none falls back),
    and the receiver maps at most workers x slots storages. A detached tensor or a numpy view kept
    from a batch keeps its slot busy: its values never change."""
    counted = Counting(monkeypatch)
    want = reference(cache, 0)
    ld = ShardLoader(cache, 3, seed=3, workers=Workers(num_workers=2, prefetch_factor=2))
    ld.set_epoch(0)
    kept = []
    for i, b in enumerate(ld):
        assert_same(b, want[i])
        if i % 3 == 0:  # only a detached copy and a numpy view survive the batch dict
            kept.append((i, b["codes"].detach(), b["audio"].numpy()))
        del b
        gc.collect()
    assert counted.n == len(want) == 9
    maps = ld._receiver._maps
    assert 0 < len(maps) <= 2 * (2 + 2)
    for i, codes, audio in kept:
        assert torch.equal(codes, want[i]["codes"])
        assert torch.equal(torch.from_numpy(audio), want[i]["audio"])
    ld.close()


def test_slot_storages_travel_once_not_every_epoch(cache, monkeypatch):
    """A slot's storage (a file descriptor through a socket, mapped again by the receiver) goes with
    the first batch the receiver gets from that slot, and never again while it keeps it mapped
    (messages dropped unread, storage included, and the batches after them: the next test)."""
    sent = []
    orig = shm_mod.SlotBatch.unpack

    def unpack(msg):
        sent.append(msg.storage is not None)
        return orig(msg)
    monkeypatch.setattr(shm_mod.SlotBatch, "unpack", unpack)
    ld = ShardLoader(cache, 3, seed=3, workers=Workers(num_workers=2, prefetch_factor=2))
    per_epoch = []
    for e in range(4):
        ld.set_epoch(e)
        sent.clear()
        for b in ld:
            del b
        per_epoch.append(sum(sent))
    # each of the 2 x (2 + 2) slots' storage once at most, whichever epoch first used the slot (sent
    # again every epoch, as before, this was 4 x 5 or more)
    assert per_epoch[0] > 0 and sum(per_epoch) <= 2 * (2 + 2), per_epoch
    ld.close()


def test_iterations_abandoned_mid_epoch_do_not_leak_slots(cache, monkeypatch):
    """Breaking out after one batch, again and again (an eval limited to N batches does), must not
    leave slots busy for ever: a later full epoch still comes through the slots."""
    ld = ShardLoader(cache, 3, seed=3, workers=Workers(num_workers=2, prefetch_factor=2))
    for e in range(6):
        ld.set_epoch(e)
        next(iter(ld))
    gc.collect()
    counted = Counting(monkeypatch)
    ld.set_epoch(6)
    want = reference(cache, 6)
    for i, b in enumerate(ld):
        assert_same(b, want[i])
        del b
        gc.collect()
    assert counted.n == len(want), (counted.n, ld._receiver.flags)
    ld.close()


def test_pinned_batches_equal_and_release_the_slot(cache):
    if not torch.cuda.is_available():
        pytest.skip("pin_memory needs CUDA")
    want = reference(cache, 0)
    ld = ShardLoader(cache, 3, seed=3, workers=Workers(num_workers=2), reads=Reads(pin_memory=True))
    ld.set_epoch(0)
    for i, b in enumerate(ld):
        assert all(v.is_pinned() for v in b.values() if isinstance(v, torch.Tensor))
        assert_same(b, want[i])
    ld.close()


class AddTotal:
    """A picklable batch transform: the sum of each sample's codes as a new key."""

    def __call__(self, batch):
        batch["codes_total"] = batch["codes"].clamp_min(0).sum(dim=(1, 2))
        return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_transform_runs_on_every_batch_where_it_is_read(cache, num_workers):
    want = reference(cache, 0)
    ld = ShardLoader(cache, 3, seed=3, transform=AddTotal(), workers=Workers(num_workers=num_workers))
    got = list(ld)
    ld.close()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g["codes_total"], w["codes"].clamp_min(0).sum(dim=(1, 2)))
        assert torch.equal(g["codes"], w["codes"])


_FORKSERVER_PROBE = """
import sys
from multiprocessing import forkserver

import loaders.context
from loaders import Reads, ShardLoader, Workers

if sys.argv[2] == "off":
    loaders.context.FORKSERVER_PRELOAD = ()
forkserver._forkserver._preload_modules = ["__main__", "json"]  # what a user may have set
ld = ShardLoader(sys.argv[1], 2, workers=Workers(num_workers=2, multiprocessing_context="forkserver"),
                 reads=Reads(pin_memory=False))
batch = next(iter(ld))
pid = forkserver._forkserver._forkserver_pid
maps = open(f"/proc/{pid}/maps").read()
print("torch in server:", "libtorch" in maps)
print("preload:", forkserver._forkserver._preload_modules)
print("keys:", len(batch["keys"]))
ld.close()
"""


@pytest.mark.parametrize("preload", ["on", "off"])
def test_forkserver_workers_fork_from_a_server_that_imported_the_loaders(cache, preload):
    """With the forkserver (the context when CUDA is initialised) each worker is forked from a server
    that has imported torch and the loaders, not made to import them itself (2.3-9.5 s per loader
    measured); the user's own preload list is kept. A fresh process: the forkserver is one per process."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", _FORKSERVER_PROBE, str(cache), preload], cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "keys: 2" in r.stdout
    if preload == "on":
        assert "torch in server: True" in r.stdout and "preload: ['__main__', 'json', 'loaders']" in r.stdout
    else:  # the probe sees the difference: without the preload the server never maps libtorch
        assert "torch in server: False" in r.stdout
