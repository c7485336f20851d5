"""Trainer features that must fail their test when removed, on CPU, through the real loader.

Each test names what it catches: autocast (the dtype of a matmul inside forward), activation
checkpointing (blocks recomputed during backward), fp16 with a GradScaler (the loss falls, the
scale is saved), host syncs only on log steps, the fused AdamW (selection, on-device skip), the
``torch.compile`` path, runs that fail loudly (all-NaN -> exit 1, damaged newest checkpoint ->
the previous one, named), the ``--profile`` report, and the environment the code sets.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from test_train_support import _single_process, cache  # noqa: F401 (fixtures)
from test_train_support import REAL_LOADER, TINY_MODEL, Captured, load_params, read_metrics
from test_train_support import from_dict
from train.trainer import Callbacks, run


def cfg_for(cache: Path, out: Path, **kw):
    base = dict(cache=str(cache), out=str(out), loader=REAL_LOADER, model_kwargs=TINY_MODEL, batch_size=4,
                steps=2, warmup_steps=0, lr=1e-3, ckpt_every=1000, progress=False, threads=1, log_every=1,
                validation=False)
    base.update(kw)
    return from_dict(base)




# ---- precision ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                             ("fp32", torch.float32), ("auto", torch.float32)])
def test_autocast_runs_the_forward_matmuls_in_the_configured_dtype(cache, tmp_path, precision, dtype):
    """The output dtype of a Linear inside the model's forward during a training step (autocast
    casts matmuls; the weights stay float32). auto on CPU = fp32."""
    seen = []

    def on_setup(trainer):
        trainer.raw.blocks[0].fc1.register_forward_hook(
            lambda m, i, o: seen.append((m.training, o.dtype, m.weight.dtype)))
        seen.append(("scaler", trainer.precision.scaler is not None))

    assert run(cfg_for(cache, tmp_path / "run", steps=1, precision=precision), Callbacks(on_setup=on_setup)) == 0
    assert seen[0] == ("scaler", precision == "fp16")                 # a GradScaler with fp16 only
    assert seen[1:] and all(s == (True, dtype, torch.float32) for s in seen[1:]), seen


def test_fp16_with_grad_scaler_trains_the_reference_model_on_cpu(cache, tmp_path):
    """fp16 autocast + torch.amp.GradScaler("cpu") (torch >= 2.3): the loss falls over 24 steps,
    the scaler's state is in the checkpoint."""
    from train.precision import fp16_supported
    if not fp16_supported(torch.device("cpu")):
        pytest.skip(f"torch {torch.__version__} has no CPU float16 autocast with a GradScaler")
    out = tmp_path / "run"
    assert run(cfg_for(cache, out, steps=24, lr=3e-3, precision="fp16", ckpt_every=24)) == 0
    losses = [r["loss"] for r in read_metrics(out)]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    print(f"fp16 loss {first:.4f} -> {last:.4f} (ratio {last / first:.3f})")
    assert last < 0.9 * first, losses
    st = torch.load(out / "step-24" / "trainer.pt", weights_only=True)
    assert st["scaler"]["scale"] > 0 and st["scaler"]["_growth_tracker"] >= 0
    assert st["config"]["training"]["precision"] == "fp16"


def test_precision_auto_picks_bf16_or_fp16_on_cuda(monkeypatch):
    from train import precision as P
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert P.resolve("auto", torch.device("cuda", 0)) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert P.resolve("auto", torch.device("cuda", 0)) == "fp16"
    assert P.resolve("auto", torch.device("cpu")) == "fp32" and P.resolve("bf16", torch.device("cpu")) == "bf16"


# ---- activation checkpointing ----------------------------------------------------------------------------

def test_activation_checkpointing_recomputes_the_blocks_in_backward(cache):
    """model.activation_checkpointing: every block's forward runs again during backward (what
    trades compute for memory), and the gradients are the ones without it."""
    from test_train_support import collate
    from shards import ShardReader
    from shards import Cache
    from train.trainer import prepare_model

    r = ShardReader(cache)
    batch = collate([r.get(i) for i in range(6)], ("codes", "input_ids", "labels", "latents"))
    grads, recomputed = [], []
    for ac in (False, True):
        cfg = cfg_for(cache, Path("unused"), activation_checkpointing=ac)
        model = prepare_model(cfg, Cache.open(cache), torch.device("cpu"))
        phase = {"now": "forward"}
        calls = {"forward": 0, "backward": 0}
        for blk in model.blocks:  # (a hook on the block itself does not fire on recompute; on its layers it does)
            blk.fc1.register_forward_hook(lambda *a: calls.__setitem__(phase["now"], calls[phase["now"]] + 1))
        loss = model(batch)["loss"]
        phase["now"] = "backward"
        loss.backward()
        assert calls["forward"] == len(model.blocks)
        recomputed.append(calls["backward"])
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert recomputed == [0, len(model.blocks)]
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


# ---- host syncs ----------------------------------------------------------------------------------------

SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


@pytest.mark.parametrize("debug", [False, True])
def test_no_host_sync_between_log_steps(cache, tmp_path, monkeypatch, debug):
    """Reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool()``, ``float()``...)
    is a GPU sync; the training loop does it only on log steps (metrics.every 4 here). Counted by
    patching those methods, leaving out calls made on the host side of the data path (loaders,
    shards): on a GPU run they touch CPU tensors only."""
    counts = {"n": 0}

    def counting(name):
        real = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            f = sys._getframe(1)
            data_side = False
            while f is not None:
                mod = f.f_globals.get("__name__", "")
                if mod.startswith(("loaders", "shards")):
                    data_side = True
                    break
                f = f.f_back
            if not data_side:
                counts["n"] += 1
            return real(self, *a, **k)
        return wrapper

    at_step: dict[int, int] = {}

    def on_setup(trainer):
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, counting(name))

    def on_step(step, rec):
        at_step[step] = counts["n"]

    cfg = cfg_for(cache, tmp_path / "run", steps=8, log_every=4, grad_norm_warn=1e-6, fused="auto",
                  metrics={"debug": debug})
    assert run(cfg, Callbacks(on_setup=on_setup, on_step=on_step)) == 0
    assert ("latents_mean" in read_metrics(tmp_path / "run")[0]) == debug
    per_step = {s: at_step[s] - at_step.get(s - 1, 0) for s in at_step if s > 1}
    assert per_step[4] > 0 and per_step[8] > 0            # the log steps read the record back
    assert [per_step[s] for s in (2, 3, 5, 6, 7)] == [0] * 5, per_step


def test_debug_metrics_hold_the_batches_latent_statistics(cache, tmp_path):
    """metrics.debug: latents_mean/std/min/max of each record equal the batch's latents over their
    real cells (latents_mask), computed here from the batch the model received (one step a record)."""
    seen = []

    def on_setup(trainer):
        real = trainer.raw.forward

        def forward(batch):
            seen.append((batch["latents"].detach().float().clone(), batch["latents_mask"].clone()))
            return real(batch)
        trainer.raw.forward = forward

    cfg = cfg_for(cache, tmp_path / "run", steps=3, log_every=1, metrics={"debug": True})
    assert run(cfg, Callbacks(on_setup=on_setup)) == 0
    recs = read_metrics(tmp_path / "run")
    assert len(recs) == len(seen) == 3
    for r, (lat, mask) in zip(recs, seen):
        x = lat.permute(0, 2, 3, 4, 1)[mask].double()                    # (real cells, C)
        if x.numel() == 0:
            continue
        want = {"latents_mean": x.mean(), "latents_std": x.std(unbiased=False), "latents_min": x.min(),
                "latents_max": x.max()}
        for k, v in want.items():
            assert r[k] == pytest.approx(v.item(), rel=1e-4, abs=1e-5), k


# ---- fused AdamW -----------------------------------------------------------------------------------------

def test_fused_adamw_selection(monkeypatch):
    from train import optim
    from train.spec import factory_spec
    model = torch.nn.Linear(3, 3)
    spec = factory_spec("torch.nn:Linear", torch.nn.Linear)   # a plain module: the trainer's groups
    cpu = torch.device("cpu")
    if not optim.fused_adamw_supported(cpu):
        pytest.skip("this torch has no fused AdamW on CPU")
    assert optim.make_optimizer(model, from_dict({"fused": "auto"}), cpu, spec).defaults["fused"] is True
    assert optim.make_optimizer(model, from_dict({"fused": "on"}), cpu, spec).defaults["fused"] is True
    assert not optim.make_optimizer(model, from_dict({"fused": "off"}), cpu, spec).defaults["fused"]
    monkeypatch.setattr(optim, "fused_adamw_supported", lambda device: False)
    assert not optim.make_optimizer(model, from_dict({"fused": "auto"}), cpu, spec).defaults["fused"]


# ---- torch.compile -----------------------------------------------------------------------------------------

def test_compile_path_trains_the_compiled_module_and_saves_plain_names(cache, tmp_path, monkeypatch):
    """model.compile: the module that trains is torch.compile's (the "eager" backend here: no C++
    toolchain or minutes of inductor on a 2-core CI machine), forward goes through dynamo, and
    the checkpoint holds the model's own parameter names (no ``_orig_mod.``)."""
    import torch._dynamo
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real(m, backend="eager"))
    torch._dynamo.reset()
    frames = {}

    def on_setup(trainer):
        frames["compiled"] = type(trainer.model).__name__
        frames["before"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    out = tmp_path / "run"
    assert run(cfg_for(cache, out, compile=True, steps=2, ckpt_every=2), Callbacks(on_setup=on_setup)) == 0
    assert frames["compiled"] == "OptimizedModule"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > frames["before"]
    from train.models import ReferenceModel
    assert set(load_params(out / "step-2")) == set(ReferenceModel(**TINY_MODEL).state_dict())
    torch._dynamo.reset()


# ---- failing loudly ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps,limit", [(12, 3), (2, 20)])
def test_all_nan_run_exits_1_without_a_checkpoint(cache, tmp_path, capsys, steps, limit):
    """Every step non-finite: exit 1 with a message naming the step and the count, after
    ``nonfinite_limit`` steps in a row (checked on log steps: every 2 here), or at the end of a
    run shorter than the limit; no checkpoint written; metrics.jsonl is strict JSON (null)."""
    from train.cli import main
    out = tmp_path / "run"
    rc = main(["--config", "none", "--cache", str(cache), "--run_dir", str(out), "--model.name",
               "test_train_support:make_mean_codes", "--model.kwargs", json.dumps({"nan_at_calls": list(range(1, 99))}),
               "--training.steps", str(steps), "--metrics.every", "2", "--checkpoint.every", "100",
               "--metrics.progress=false", "--dist.threads", "1", "--training.nonfinite_limit", str(limit),
               "--eval.enabled=false"])
    err = capsys.readouterr().err
    assert rc == 1, err
    stop = min(limit, steps)
    stop += stop % 2  # the next log step
    assert f"step {stop}: {stop} consecutive steps with a non-finite loss" in err and "Traceback" not in err
    assert not list(out.glob("step-*"))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(ln, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for ln in lines]
    assert [r["step"] for r in recs] == list(range(2, stop + 1, 2))
    assert all(r["loss"] is None and r["skipped_steps"] == r["step"] for r in recs)


@pytest.mark.parametrize("damage", ["truncate model.safetensors", "truncate trainer.pt"])
def test_damaged_newest_checkpoint_is_named_and_the_previous_one_used(cache, tmp_path, damage):
    out = tmp_path / "run"
    assert run(cfg_for(cache, out, steps=4, ckpt_every=2, keep=3)) == 0
    name = damage.split()[1]
    f = out / "step-4" / name
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with Captured() as cap:
        assert run(cfg_for(cache, out, steps=5, ckpt_every=2, keep=3, resume="auto")) == 0
    warned = [m for m in cap.messages if " is damaged" in m]
    assert warned and str(f.parent) in warned[0] and name in warned[0], cap.text
    assert f"resumed from {out / 'step-2'} at step 2" in cap.text
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]  # steps 3-4 redone, once each


# ---- profile report ------------------------------------------------------------------------------------------

def test_profile_writes_a_trace_and_a_report(cache, tmp_path):
    out = tmp_path / "run"
    assert run(cfg_for(cache, out, steps=4, profile=True, profile_wait=1, profile_warmup=1, profile_active=2)) == 0
    assert list((out / "profile").glob("trace-rank0-*.json"))
    text = (out / "profile" / "report.md").read_text()
    assert "# Profile of steps 3-4" in text and "## Top operators by self host time" in text
    rows = {ln.split("|")[1].strip(): ln.split("|")[2:-1] for ln in text.splitlines()
            if ln.startswith("| ") and ln.split("|")[1].strip() in
            ("data_wait", "forward", "backward", "optimizer", "communication")}
    assert set(rows) == {"data_wait", "forward", "backward", "optimizer", "communication"}
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        assert float(rows[phase][0]) > 0, (phase, text)  # host ms (total) of each phase is measured
    assert "aten::" in text


# ---- the environment the code sets ----------------------------------------------------------------------------

def test_environment_variables_set_by_the_code_are_logged(cache, tmp_path, monkeypatch):
    from train import dist as D
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "mine")
    monkeypatch.setattr(D, "ENV_SET", {})
    with Captured() as cap:
        assert run(cfg_for(cache, tmp_path / "run", steps=1)) == 0
    line = next(m for m in cap.messages if m.startswith("environment"))
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in line and "PYTORCH_CUDA_ALLOC_CONF" not in line
