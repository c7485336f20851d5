"""Multi-process tests of ``train`` on CPU: gloo, 2 processes, one thread each, timeouts everywhere.

Three launchers, each for what it can observe:

* ``torch.multiprocessing`` (spawn) workers that call :func:`train.trainer.run` with callbacks: the
  global batch of 8 as 1 x 8 (in this process), 2 x 4 and 2 x 2 x accum 2 -> equal parameters,
  identical parameters on both ranks after every step, all-reduces (counted by a DDP comm hook)
  only on the final micro-step, the DDP settings and the fused AdamW in use, nothing written by
  rank 1 (an audit hook records its file writes);
* ``shardcache train`` once per rank with the torchrun environment and no launcher in between:
  SIGUSR1 to one rank -> both save at the same step and exit with the requeue code; a rank that
  raises (``tests/train_with_callbacks.py`` injects the failure) -> the other exits long before the
  process-group timeout;
* ``torchrun --nproc_per_node=2 -m shardcache train``: the resume after that stop, which must reproduce the
  uninterrupted 2 x 4 run's loss sequence bit for bit.

The data come from ``loaders.ShardLoader``. The 2-node simulation (4 ranks) is in test_train_multinode.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_train_support import (REAL_LOADER, REPO, TESTS, TINY_MODEL, base_env, free_port, launch, load_params,
                                make_cache, read_metrics, train_args, wait_all, write_audit)

pytestmark = [pytest.mark.ddp, pytest.mark.xdist_group("train_ddp")]  # one worker builds the module's fixtures

LOADER = REAL_LOADER
SLOW = "{}"  # (test_train_support.SlowLoader sleeps 0.25 s per batch)
STEPS = 8            # 24 samples / global batch 8 = 3 steps per epoch: crosses two epoch boundaries
TIMEOUT = 120        # seconds for any multi-process run (a hang fails the test)
# float32 on CPU, 8 AdamW steps at lr 1e-3: the three splits sum the same per-sample gradients in a
# different order (rounding ~1e-7 relative); AdamW's normalisation keeps the drift near that size.
ATOL, RTOL = 2e-6, 1e-5


def common(cache: Path, out: Path) -> dict:
    return dict(cache=str(cache), out=str(out), loader=LOADER, model_kwargs=TINY_MODEL, steps=STEPS,
                warmup_steps=2, lr=1e-3, latent_loss="mse", progress=False, threads=1, keep=3,
                ckpt_every=1, pg_timeout_min=2.0, val_fraction=0, log_every=1)


# ---- spawned workers with callbacks ----------------------------------------------------------------

def _worker(rank: int, world: int, port: int, cfg: dict, result_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from test_train_support import from_dict
    from train.trainer import Callbacks, run

    root = os.path.realpath(cfg["out"])
    writes: list[str] = []


    sys.addaudithook(write_audit(root, writes))  # every write this process makes under OUT
    calls = [0]
    micro_log: list[tuple[int, int, int]] = []
    hashes: list[str] = []
    state: dict = {}
    setup: dict = {}

    def counting_hook(process_group, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(process_group, bucket)

    def on_setup(trainer):
        state["raw"] = trainer.raw
        ddp = trainer.model
        if isinstance(ddp, DDP):
            ddp.register_comm_hook(None, counting_hook)
            setup.update(ddp=True, gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                         static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters,
                         sync_buffers=bool(getattr(ddp, "broadcast_buffers", False) or
                                           getattr(ddp, "forward_sync_buffers", False)),
                         bucket_cap_mb=ddp.bucket_bytes_cap / 2**20)
        setup["fused"] = bool(trainer.optimizer.defaults.get("fused"))

    def on_micro_step(step, micro):
        micro_log.append((step, micro, calls[0]))

    def on_step(step, rec):
        h = hashlib.sha256()
        for p in state["raw"].parameters():
            h.update(p.detach().numpy().tobytes())
        hashes.append(h.hexdigest())

    code = run(from_dict(cfg), Callbacks(on_setup=on_setup, on_micro_step=on_micro_step, on_step=on_step))
    Path(result_dir, f"rank{rank}.json").write_text(json.dumps(
        {"code": code, "hashes": hashes, "micro": micro_log, "writes": writes, "setup": setup}))


def spawn(world: int, cfg: dict, result_dir: Path) -> list[dict]:
    import torch.multiprocessing as mp

    result_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(_worker, args=(world, free_port(), cfg, str(result_dir)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"spawned ranks still running after {TIMEOUT}s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return make_cache(tmp_path_factory.mktemp("ddp") / "cache", n=24, n_shards=3)


@pytest.fixture(scope="module")
def runs(cache, tmp_path_factory) -> dict:
    """A global batch of 8 three ways; every run saves a checkpoint per step and keeps 3."""
    base = tmp_path_factory.mktemp("runs")
    out: dict = {}
    # 1 x 8 in this process (no process group)
    from test_train_support import from_dict
    from train.trainer import run
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    threads = torch.get_num_threads()
    try:
        assert run(from_dict({**common(cache, base / "1x8"), "batch_size": 8})) == 0
    finally:
        os.environ.update(saved)
        torch.set_num_threads(threads)
    out["1x8"] = {"out": base / "1x8"}
    for name, kw in (("2x4", dict(batch_size=4)), ("2x2a2", dict(batch_size=2, grad_accum=2))):
        cfg = {**common(cache, base / name), **kw}
        out[name] = {"out": base / name, "ranks": spawn(2, cfg, base / f"{name}-results")}
    return out


def test_splits_of_the_global_batch_reach_equal_parameters(runs):
    ref = load_params(runs["1x8"]["out"] / f"step-{STEPS}")
    for name in ("2x4", "2x2a2"):
        assert [r["code"] for r in runs[name]["ranks"]] == [0, 0]
        other = load_params(runs[name]["out"] / f"step-{STEPS}")
        assert ref.keys() == other.keys()
        worst = max((ref[k] - other[k]).abs().max().item() for k in ref)
        print(f"1x8 vs {name}: max |diff| {worst:.3g}")
        for k in ref:
            assert torch.allclose(ref[k], other[k], atol=ATOL, rtol=RTOL), \
                f"{name} {k}: max diff {(ref[k] - other[k]).abs().max():.3g}"
    # and the loss curves agree to the same tolerance
    l1 = [r["loss"] for r in read_metrics(runs["1x8"]["out"])]
    for name in ("2x4", "2x2a2"):
        ln = [r["loss"] for r in read_metrics(runs[name]["out"])]
        assert len(ln) == STEPS and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(l1, ln)), (l1, ln)


def test_parameters_identical_on_every_rank_after_every_step(runs):
    for name in ("2x4", "2x2a2"):
        r0, r1 = runs[name]["ranks"]
        assert len(r0["hashes"]) == STEPS and r0["hashes"] == r1["hashes"], name
        assert len(set(r0["hashes"])) == STEPS  # and they do change every step


def test_ddp_settings_and_fused_adamw(runs):
    """The wrapper the ranks trained through: no buffer broadcast in forward, bucket-view gradients,
    static_graph off (it breaks no_sync), the configured bucket size; the fused AdamW (auto, where
    this torch supports it: CPU since 2.4)."""
    from train.optim import fused_adamw_supported
    for name in ("2x4", "2x2a2"):
        for rank in runs[name]["ranks"]:
            st = rank["setup"]
            assert st["ddp"] and st["gradient_as_bucket_view"] is True and st["static_graph"] is False
            assert st["sync_buffers"] is False and st["find_unused_parameters"] is False
            assert st["bucket_cap_mb"] == pytest.approx(25)
            assert st["fused"] is fused_adamw_supported(torch.device("cpu"))


def test_allreduce_only_on_the_final_micro_step(runs):
    for name, accum in (("2x4", 1), ("2x2a2", 2)):
        for rank in runs[name]["ranks"]:
            micro = rank["micro"]
            assert len(micro) == STEPS * accum
            before = 0
            for step, m, calls in micro:
                if m < accum - 1:
                    assert calls == before, f"{name}: all-reduce during no_sync micro-step {m} of step {step}"
                else:
                    assert calls > before, f"{name}: no all-reduce on the final micro-step of step {step}"
                before = calls


def test_only_global_rank_0_writes(runs):
    for name in ("2x4", "2x2a2"):
        r0, r1 = runs[name]["ranks"]
        assert r1["writes"] == [], r1["writes"][:5]
        assert any("metrics.jsonl" in w for w in r0["writes"]) and any("step-" in w for w in r0["writes"])
        out = runs[name]["out"]
        assert [r["step"] for r in read_metrics(out)] == list(range(1, STEPS + 1))  # one line per step
        assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"step-{s}" for s in (6, 7, 8)]
        assert not list(out.glob("*.tmp"))
        st = torch.load(out / "step-8" / "trainer.pt", weights_only=True)
        assert len(st["loaders"]) == 2 and len(st["rng"]) == 2 and st["world_size"] == 2
        assert not torch.equal(st["rng"][0]["torch"], st["rng"][1]["torch"])  # each rank's own RNG


def _stop_steps(outputs: list[str]) -> list[int]:
    found = []
    for text in outputs:
        m = re.search(r"checkpoint saved at step (\d+); exiting with (\d+)", text)
        found.append(int(m.group(1)) if m else -1)
    return found


@pytest.mark.long  # make test-long; test_elastic_resume_of_a_two_rank_checkpoint_on_one_rank covers resume in make test
def test_stop_request_then_torchrun_resume_is_bitwise(cache, runs, tmp_path):
    """SIGUSR1 to rank 1 only: both ranks save at the same step and exit 3; then a torchrun resume
    (--resume auto) reproduces the uninterrupted 2 x 4 run's losses exactly."""
    out = tmp_path / "run"
    opts = {k: v for k, v in common(cache, out).items() if k not in ("cache", "out", "progress", "model_kwargs")}
    opts.update(batch_size=4, model_kwargs=json.dumps(TINY_MODEL), loader_kwargs="{}")
    # with a process group the stop request is agreed on at log steps: every step here
    slow = dict(opts, loader="test_train_support:SlowLoader", loader_kwargs=SLOW)
    procs = launch(2, train_args(cache, out, **slow), REPO)
    t0 = time.monotonic()
    while len(read_metrics(out)) < 2 and time.monotonic() - t0 < TIMEOUT and procs[1].poll() is None:
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGUSR1)
    codes, outs = wait_all(procs, TIMEOUT)
    assert codes == [3, 3], outs
    steps = _stop_steps(outs)
    k = steps[0]
    assert steps == [k, k] and 2 <= k < STEPS, steps
    assert "SIGUSR1" in outs[1] and "another rank requested a stop" in outs[0]
    assert sorted(p.name for p in out.iterdir() if p.is_dir())[-1] == f"step-{k}"
    assert json.loads((out / "REQUEUE").read_text())["step"] == k
    assert not list(out.glob("*.tmp")) and not (out / "STOP").exists()

    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun)] if torchrun.exists() else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "shardcache", "train",
            *train_args(cache, out, **dict(opts, resume="auto"))]
    r = subprocess.run(cmd, cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"resumed from {out / f'step-{k}'} at step {k}" in r.stdout + r.stderr
    resumed = [x["loss"] for x in read_metrics(out)]
    reference = [x["loss"] for x in read_metrics(runs["2x4"]["out"])]
    assert [x["step"] for x in read_metrics(out)] == list(range(1, STEPS + 1))
    assert resumed == reference  # bitwise: floats from JSON round-trip exactly
    a, b = load_params(out / f"step-{STEPS}"), load_params(runs["2x4"]["out"] / f"step-{STEPS}")
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not (out / "REQUEUE").exists()


@pytest.mark.parametrize("fail_rank", [1, pytest.param(0, marks=pytest.mark.long)])
def test_a_failing_rank_makes_the_other_exit(cache, tmp_path, fail_rank):
    """Rank ``fail_rank`` raises before step 2; the other rank is then blocked in a collective and
    must exit non-zero quickly: the process-group timeout is 10 minutes, the test allows 60 s."""
    out = tmp_path / "run"
    opts = dict(loader=LOADER, batch_size=4, steps=50, pg_timeout_min=10)
    script = [str(TESTS / "train_with_callbacks.py"), "--fail-at-step", "2", "--fail-rank", str(fail_rank), "--"]
    t0 = time.monotonic()
    codes, outs = wait_all(launch(2, train_args(cache, out, **opts), REPO, script=script), 60)
    elapsed = time.monotonic() - t0
    assert None not in codes, f"a rank hung: codes {codes}\n{outs}"
    assert codes[fail_rank] == 1 and codes[1 - fail_rank] != 0, codes
    assert f"injected failure after step 2 on rank {fail_rank}" in outs[fail_rank]
    assert elapsed < 60


def test_elastic_resume_of_a_two_rank_checkpoint_on_one_rank(runs, tmp_path):
    """A 2 x 4 checkpoint resumed by 1 x 8 (same global batch): the loader continues from the same
    global position, so the last steps match the 2-rank run to float tolerance."""
    from test_train_support import from_dict
    from train.trainer import run

    src = runs["2x4"]["out"]
    out = tmp_path / "elastic"
    threads = torch.get_num_threads()
    try:
        code = run(from_dict({**common(Path(json.loads((src / "step-6" / "config.json").read_text())["data"]["cache"]), out),
                              "batch_size": 8, "resume": str(src / "step-6")}))
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    got = [r["loss"] for r in read_metrics(out)]
    want = [r["loss"] for r in read_metrics(src)][6:]
    assert [r["step"] for r in read_metrics(out)] == [7, 8]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)
