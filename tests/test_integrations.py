"""The examples of docs/integrations.md, run as written on 2 CPU processes (torchrun, gloo): each is
stopped after 6 batches (mid-epoch: 16 samples, global batch 4, so in epoch 1), then resumed from its
checkpoint up to 8; every rank must have trained on the keys of an uninterrupted ShardLoader, step for
step, and every epoch must have trained on each sample of the cache exactly once across the ranks (the
keys each rank recorded, checked against the index, not against the loader). Variants derived from the
examples: HF ``Trainer`` with ``as_dataloader()`` and without workers or accumulation; Lightning and
accelerate given what re-shards a rank's plan, which must stop before any step trains, with a message
naming ``ShardLoader`` and the fix. Issue 32 items 2-3, issue 40 item 3."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from loaders import ShardLoader, Workers
from shardcache.ranks import Ranks
from test_train_support import REPO, base_env, free_port, make_cache

pytestmark = [pytest.mark.ddp, pytest.mark.slow, pytest.mark.xdist_group("integrations")]  # one worker builds the module's fixtures
DOC = REPO / "docs" / "integrations.md"
TIMEOUT = 300
N, BATCH, WORLD = 16, 2, 2
STEPS_PER_EPOCH = N // (BATCH * WORLD)
STOP, STEPS = 6, 8  # the first run stops in the middle of epoch 1; the resumed one ends with it
needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="lightning is not installed")
SHARD_LOADER = 'ShardLoader(cache, batch_size=2, seed=0, fields=("input_ids", "labels"))'


def examples() -> dict[str, str]:
    """``{file name: code}`` of the doc's python blocks that start with ``# example: NAME``."""
    blocks = re.findall(r"```python\n(# example: (\S+)\n.*?)```", DOC.read_text(), flags=re.S)
    return {name: code for code, name in blocks}


def variant(name: str, old: str, new: str) -> str:
    """The doc's example ``name`` with ``old`` (which it must hold once) replaced by ``new``."""
    code = examples()[name]
    assert code.count(old) == 1, f"{name} no longer holds {old!r}"
    return code.replace(old, new)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return make_cache(tmp_path_factory.mktemp("integrations") / "cache", n=N, n_shards=2)


def reference(cache: Path, rank: int) -> list[list[str]]:
    """The keys of an uninterrupted run: the loader iterated epoch after epoch, ``STEPS`` batches."""
    ld = ShardLoader(cache, BATCH, seed=0, fields=("input_ids", "labels"), ranks=Ranks(rank, WORLD))
    out = []
    while len(out) < STEPS:
        out += [b["keys"] for b in ld]
    return out[:STEPS]


def torchrun(script: Path, cache: Path, run: Path, steps: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script), str(cache), str(run), str(steps)]
    return subprocess.run(cmd, cwd=script.parent, env=base_env({"PYTHONWARNINGS": "ignore"}), capture_output=True,
                          text=True, timeout=TIMEOUT)


def recorded(run: Path) -> list[list[list[str]]]:
    """Per rank, the keys of every batch it trained on (``keys-<rank>.jsonl``, one line a batch)."""
    return [[json.loads(line) for line in (run / f"keys-{r}.jsonl").read_text().splitlines()]
            for r in range(WORLD)]


def assert_every_epoch_covers_the_cache_once(cache: Path, seen: list[list[list[str]]]) -> None:
    """Each epoch of the recorded run (``STEPS_PER_EPOCH`` batches a rank) trained on every sample of
    the index exactly once across the ranks: a re-sharded plan (each rank on every other batch of its
    share) or a resume that repeats or skips batches fails here even where both runs agree."""
    keys = pq.read_table(cache / "index.parquet", columns=["key"]).column("key").to_pylist()
    assert len(set(keys)) == N
    for e in range(STEPS // STEPS_PER_EPOCH):
        steps = slice(e * STEPS_PER_EPOCH, (e + 1) * STEPS_PER_EPOCH)
        trained = Counter(k for rank in seen for batch in rank[steps] for k in batch)
        assert trained == Counter(keys), (f"epoch {e}: missing {sorted(set(keys) - set(trained))}, "
                                          f"repeated {sorted(k for k, n in trained.items() if n > 1)}")


def run_code(name: str, code: str, cache: Path, tmp_path: Path) -> None:
    script = tmp_path / name
    script.write_text(code)
    run = tmp_path / "run"
    run.mkdir()
    for steps in (STOP, STEPS):
        r = torchrun(script, cache, run, steps)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        if steps == STOP:
            assert [len(rank) for rank in recorded(run)] == [STOP] * WORLD
    seen = recorded(run)
    assert_every_epoch_covers_the_cache_once(cache, seen)
    for rank in range(WORLD):
        assert seen[rank] == reference(cache, rank), f"rank {rank}"


def run_example(name: str, cache: Path, tmp_path: Path) -> None:
    run_code(name, examples()[name], cache, tmp_path)


def assert_refused_before_a_step(code: str, cache: Path, tmp_path: Path, *needles: str) -> str:
    """Run ``code`` once: it must fail, name ``ShardLoader`` and each of ``needles`` in its output, and
    no rank may have trained on a batch."""
    script = tmp_path / "wrong.py"
    script.write_text(code)
    run = tmp_path / "run"
    run.mkdir()
    r = torchrun(script, cache, run, STEPS)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert not [p.name for p in run.glob("keys-*.jsonl") if p.read_text().strip()], "a step trained first"
    for needle in ("ShardLoader",) + needles:
        assert needle in out, f"{needle!r} not in:\n{out[-3000:]}"
    return out


def test_the_doc_holds_every_example():
    assert set(examples()) == {"plain_loop.py", "hf_trainer.py", "accelerate_loop.py", "accelerate_dataloader.py",
                               "lightning_fit.py", "dcp_slot.py"}


@pytest.mark.long  # make test-long; test_end_to_end's torchrun run and tests/test_loaders.py cover the plain loop in make test
def test_plain_loop(cache, tmp_path):
    run_example("plain_loop.py", cache, tmp_path)


@pytest.mark.long  # make test-long; test_skip_first_batches_on_the_loader_reads_the_uninterrupted_batches (HF's resume path on the loader) runs in make test
def test_hf_trainer_returning_the_loader_resumes_exactly_with_workers_and_accumulation(cache, tmp_path):
    """`get_train_dataloader` returns the ShardLoader itself (2 workers, gradient accumulation 2):
    `resume_from_checkpoint` skips the trained half of epoch 1 through accelerate's
    `skip_first_batches` on the loader's DataLoader form (it crashed: no attribute 'drop_last')."""
    code = examples()["hf_trainer.py"]
    assert "workers=Workers(num_workers=2)" in code and "gradient_accumulation_steps=2" in code
    run_example("hf_trainer.py", cache, tmp_path)


@pytest.mark.long
def test_hf_trainer_with_as_dataloader_and_no_workers_resumes_exactly(cache, tmp_path):
    code = variant("hf_trainer.py", ', fields=("input_ids", "labels"), workers=Workers(num_workers=2))',
                   ', fields=("input_ids", "labels")).as_dataloader()')
    code = code.replace("steps // 2, gradient_accumulation_steps=2, save_steps=3", "steps, save_steps=6")
    code = code.replace("checkpoint-3", "checkpoint-6")
    run_code("hf_trainer_as_dataloader.py", code, cache, tmp_path)


@pytest.mark.long  # make test-long; test_accelerate_prepare_of_as_dataloader_gives_each_rank_its_plan runs in make test
def test_accelerate_prepare_returns_the_loader_and_register_for_checkpointing(cache, tmp_path):
    run_example("accelerate_loop.py", cache, tmp_path)


@pytest.mark.long  # make test-long; test_a_dataloader_around_the_loader_is_refused_at_its_first_item runs in make test
def test_accelerate_prepare_of_as_dataloader_gives_each_rank_its_plan(cache, tmp_path):
    """accelerate used to re-shard `as_dataloader()` (each rank on every other batch, half of each epoch
    never seen, exit 0): the coverage check fails on that."""
    run_example("accelerate_dataloader.py", cache, tmp_path)


@pytest.mark.long
def test_accelerate_given_a_dataloader_around_the_loader_refuses_before_a_step(cache, tmp_path):
    code = variant("accelerate_loop.py", f"loader = {SHARD_LOADER}",
                   f"loader = torch.utils.data.DataLoader({SHARD_LOADER})")
    assert_refused_before_a_step(code, cache, tmp_path, "is not a dataset of samples", "as_dataloader()")


@needs_lightning
@pytest.mark.long  # make test-long; test_lightnings_distributed_sampler_injection_is_refused_naming_the_fix runs in make test
def test_lightning_fit_with_ckpt_path(cache, tmp_path):
    run_example("lightning_fit.py", cache, tmp_path)


@needs_lightning
@pytest.mark.long
@pytest.mark.parametrize("wrap", ["as_dataloader", "DataLoader"])
def test_lightning_given_a_dataloader_form_refuses_before_a_step(cache, tmp_path, wrap):
    """Under DDP Lightning rebuilds `as_dataloader()`'s batch sampler with its DistributedSampler (its
    own TypeError said nothing of the fix), and `DataLoader(loader)` failed with 'not subscriptable'.
    (In `make test`: the same Lightning calls in one process, below.)"""
    new = f"{SHARD_LOADER}.as_dataloader()" if wrap == "as_dataloader" else f"torch.utils.data.DataLoader({SHARD_LOADER})"
    code = variant("lightning_fit.py", f"return {SHARD_LOADER}", f"return {new}")
    assert_refused_before_a_step(code, cache, tmp_path, "return the ShardLoader itself from train_dataloader")


@needs_lightning
@pytest.mark.long
def test_lightning_without_its_sampler_injection_resumes_as_dataloader_exactly(cache, tmp_path):
    """With `use_distributed_sampler=False` Lightning leaves `as_dataloader()` as it is: each rank its
    plan, and the form's state_dict (Lightning checkpoints stateful loaders) resumes mid-epoch exactly."""
    code = variant("lightning_fit.py", f"return {SHARD_LOADER}", f"return {SHARD_LOADER}.as_dataloader()")
    code = code.replace('strategy="ddp",', 'strategy="ddp", use_distributed_sampler=False,')
    assert "use_distributed_sampler=False" in code
    run_code("lightning_as_dataloader.py", code, cache, tmp_path)


@pytest.mark.long  # make test-long; test_as_dataloader_state_dict_resumes_mid_epoch... runs in make test
def test_torchtitan_slot_through_distributed_checkpoint(cache, tmp_path):
    run_example("dcp_slot.py", cache, tmp_path)


# ------------------------------------------------------------------------------- in one process

def test_skip_first_batches_on_the_loader_reads_the_uninterrupted_batches(cache, monkeypatch):
    """accelerate's `skip_first_batches` (what HF Trainer calls on resume) rebuilds a DataLoader from
    the loader's DataLoader form: steps 2.. of the epoch set on its sampler, nothing read for the
    skipped ones, with the loader's workers."""
    from accelerate import skip_first_batches
    from loaders.steps import StepBatches
    ref = ShardLoader(cache, BATCH, seed=0, fields=("input_ids", "labels"), ranks=Ranks(1, WORLD))
    ref.set_epoch(1)
    want = [b["keys"] for b in ref][2:]
    reads = []
    get = StepBatches.__getitem__
    monkeypatch.setattr(StepBatches, "__getitem__", lambda self, i: reads.append(tuple(i)) or get(self, i))
    for workers in (0, 2):
        ld = ShardLoader(cache, BATCH, seed=0, fields=("input_ids", "labels"), ranks=Ranks(1, WORLD), workers=Workers(num_workers=workers))
        dl = skip_first_batches(ld, 2)
        assert isinstance(dl, torch.utils.data.DataLoader) and dl.num_workers == workers
        dl.batch_sampler.batch_sampler.set_epoch(1)  # what Trainer._run_epoch does after the skip
        assert [b["keys"] for b in dl] == want, f"num_workers={workers}"
        ld.close()
    assert reads == [(1, s) for s in range(2, STEPS_PER_EPOCH)]  # in this process: num_workers=0 only


def test_as_dataloader_goes_on_to_the_next_epoch_like_the_loader(cache):
    ld = ShardLoader(cache, BATCH, seed=0, fields=("input_ids", "labels"), ranks=Ranks(0, WORLD))
    dl = ShardLoader(cache, BATCH, seed=0, fields=("input_ids", "labels"), ranks=Ranks(0, WORLD)).as_dataloader()
    for _ in range(3):
        assert [b["keys"] for b in dl] == [b["keys"] for b in ld]
    dl.set_epoch(1)
    ld.set_epoch(1)
    assert [b["keys"] for b in dl] == [b["keys"] for b in ld]


def test_a_dataloader_around_the_loader_is_refused_at_its_first_item(cache):
    ld = ShardLoader(cache, BATCH, seed=0, fields=("input_ids", "labels"), ranks=Ranks(0, 1))
    with pytest.raises(TypeError, match="ShardLoader is not a dataset of samples.*as_dataloader"):
        next(iter(torch.utils.data.DataLoader(ld)))


@needs_lightning
def test_lightnings_distributed_sampler_injection_is_refused_naming_the_fix(cache):
    """What Lightning does to a training DataLoader under DDP (`use_distributed_sampler`, the default):
    a DistributedSampler over its dataset, then `_update_dataloader` rebuilds the loader with it. For
    `as_dataloader()` that is refused with the fix named (Lightning's own TypeError did not name it);
    the ShardLoader itself is no DataLoader, and Lightning leaves it as it is."""
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DistributedSampler
    ld = ShardLoader(cache, BATCH, seed=0, fields=("input_ids", "labels"), ranks=Ranks(0, WORLD))
    dl = ld.as_dataloader()
    with pytest.raises(TypeError, match="ShardLoader.*return the ShardLoader itself from train_dataloader"):
        _update_dataloader(dl, DistributedSampler(dl.dataset, num_replicas=WORLD, rank=0))
    assert not isinstance(ld, torch.utils.data.DataLoader)


def test_as_dataloader_state_dict_resumes_mid_epoch_and_refuses_another_loaders_state(cache):
    """The DataLoader form is stateful as the ShardLoader is (Lightning and accelerate's
    register_for_checkpointing save it): stopped after 2 batches of epoch 0 and resumed in a new
    loader, it yields the rest of epoch 0, then epoch 1."""
    def make(seed=0, workers=0):
        return ShardLoader(cache, BATCH, seed=seed, fields=("input_ids", "labels"), ranks=Ranks(1, WORLD)).as_dataloader(num_workers=workers)

    ref = ShardLoader(cache, BATCH, seed=0, fields=("input_ids", "labels"), ranks=Ranks(1, WORLD))
    want = [[b["keys"] for b in ref] for _ in range(2)]
    dl = make()
    it = iter(dl)
    assert [next(it)["keys"] for _ in range(2)] == want[0][:2]
    sd = dl.state_dict()
    assert (sd["epoch"], sd["step"]) == (0, 2) and json.loads(json.dumps(sd)) == sd
    for workers in (0, 2):
        again = make(workers=workers)
        again.load_state_dict(sd)
        assert [b["keys"] for b in again] == want[0][2:]
        assert [b["keys"] for b in again] == want[1]
    with pytest.raises(ValueError, match="seed=0 there, 1 here"):
        make(seed=1).load_state_dict(sd)
