"""Single-process tests of ``train``: config, schedule, models, checkpoints, the loop on CPU.

Loop tests read a cache written by the real format code through the real ``loaders.ShardLoader``
(compact int16 audio / float16 latents of two sizes with ``latents_mask``, ``input_ids``/``labels``):
the batch contract the trainer sees in production. Precision, activation checkpointing, host
syncs, failures and the profiler report are in ``test_train_features.py``.
"""
from __future__ import annotations

import math

import json
import logging
import subprocess
from pathlib import Path

import pytest
import torch

from test_train_support import _single_process, cache  # noqa: F401 (fixtures)
from test_train_support import (PY, REAL_LOADER, REPO, TINY_MODEL, base_env, collate, load_params, read_metrics)
from train import checkpoint as C
from train import dist as D
from test_train_support import from_dict
from train.cli import build_parser, parse_args
from train.config import TrainConfig
from train.metrics import Metrics
from train.optim import lr_at
from train.trainer import Callbacks, run
from shards import Cache
from train.models import ReferenceModel, build_model, count_params


def load_yaml(path):
    """A YAML config file -> a validated config."""
    return parse_args(["--config", str(path)])[0]


def cfg_for(cache: Path, out: Path, **kw) -> TrainConfig:
    base = dict(cache=str(cache), out=str(out), loader=REAL_LOADER, model_kwargs=TINY_MODEL, batch_size=4,
                steps=4, warmup_steps=2, lr=1e-3, ckpt_every=1000, progress=False, threads=1, log_every=1)
    base.update(kw)
    return from_dict(base)


# ---- import boundary -------------------------------------------------------------------------------

def test_train_never_imports_decoders_or_diffusers(tmp_path):
    """A fresh interpreter that imports every train module, builds the reference model, applies
    LoRA (peft pulls transformers) and runs a step has not loaded librosa/soundfile/PIL/diffusers."""
    code = (
        "import sys, torch\n"
        "import train, train.cli, train.trainer, train.data, train.optim, train.precision, train.profiling\n"
        "import train.config, train.dist, train.models, train.checkpoint, train.metrics\n"
        "import train.batch_size, shardcache.cli\n"
        "import loaders\n"
        + "from train.models import ReferenceModel, apply_lora, model_spec\n"
        "m = apply_lora(ReferenceModel(d_model=16, n_layers=1, n_heads=2), 2, 4, 0.0, ('qkv',), "
        "spec=model_spec('reference'))\n"
        "bad = [n for n in ('librosa', 'soundfile', 'PIL', 'diffusers') if sys.modules.get(n) is not None]\n"
        "print('BAD', bad)\n"
    )
    r = subprocess.run([PY, "-c", code], cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "BAD []" in r.stdout, r.stdout


# ---- config ----------------------------------------------------------------------------------------

def test_config_precedence_yaml_then_cli(tmp_path):
    y = tmp_path / "t.yaml"
    y.write_text("training: {steps: 7}\ndata: {batch_size: 3}\nmodel: {kwargs: {d_model: 64, n_layers: 1}}\n"
                 "lora: {enabled: true}\noptim: {lr: 3e-4}\n")
    cfg = load_yaml(y)
    assert (cfg.training.steps, cfg.data.batch_size, cfg.lora.enabled, cfg.optim.lr) == (7, 3, True, 3e-4)
    cfg, _ = parse_args(["--config", str(y), "--training.steps", "9", "--model.kwargs", '{"d_model": 32}',
                         "--lora.enabled=false", "--data.fields", "[codes, input_ids]", "--optim.lr", "1e-3"])
    assert cfg.training.steps == 9 and cfg.data.batch_size == 3 and cfg.lora.enabled is False
    assert cfg.optim.lr == 1e-3
    assert cfg.model.kwargs == {"d_model": 32}  # the whole mapping replaces the file's (jsonargparse)
    assert cfg.data.fields == ("codes", "input_ids")
    cfg, _ = parse_args(["--config", str(y), "--model.kwargs.lm", "/ckpt/x", "--model.kwargs.freeze_lm", "true",
                         "--model.kwargs.r", "[1, 2]"])  # one key each: merged into the file's
    assert cfg.model.kwargs == {"d_model": 64, "n_layers": 1, "lm": "/ckpt/x", "freeze_lm": True, "r": [1, 2]}
    # --KEY=VALUE, one key of a mapping, the short flags; flags in their order
    cfg, _ = parse_args(["--config", str(y), "--optim.lr=2e-3", "--training.steps=11",
                         "--training.steps", "12", "--model.kwargs.n_layers=2", "--optim.weight_decay", "0",
                         "--cache", "/c", "--run_dir", "/r"])
    assert (cfg.training.steps, cfg.data.batch_size, cfg.optim.lr, cfg.optim.weight_decay) == (12, 3, 2e-3, 0.0)
    assert cfg.model.kwargs == {"d_model": 64, "n_layers": 2} and (cfg.data.cache, cfg.job.dir) == ("/c", "/r")
    with pytest.raises(ValueError, match="stepz: unknown option"):
        from_dict({"training": {"stepz": 1}})
    with pytest.raises(ValueError, match="schedule.name"):
        from_dict({"schedule": {"name": "step"}})
    # the flat names before sections are gone
    y.write_text("steps: 7\n")
    with pytest.raises(ValueError, match="steps: unknown option"):
        load_yaml(y)
    # every option is a documented flag (--help_all), under its section
    helptext = build_parser().format_help()
    from shardcache.config import options
    for path, (_, f) in options(TrainConfig).items():
        assert f"--{path} " in helptext, path
    assert "requeue" in helptext


def test_config_errors_name_every_bad_option_and_exit_2(tmp_path):
    from shardcache.config import ConfigError
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", "none", "--data.batch_size", "0", "--schedule.name=step",
                    "--training.precision", "fp8"])
    assert [k for k, _ in e.value.problems] == ["data.batch_size", "schedule.name", "training.precision"]
    with pytest.raises(ConfigError) as e:  # a value of the wrong type: named as the command line is read
        parse_args(["--config", "none", "--optim.lr", "fast"])
    assert e.value.lines() == ["optim.lr: expected a number >= 0 and <= 100, got 'fast'"]
    with pytest.raises(ConfigError, match="optim.lrr: unknown option"):
        parse_args(["--config", "none", "--optim.lrr=1"])
    # no file is read unless named: not configs/train.yaml of the working directory
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "train.yaml").write_text("training: {steps: 5}\n")
    import os
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        cfg, ns = parse_args([])
        assert cfg.training.steps == TrainConfig().training.steps and ns.config_file is None
        os.environ["SHARDCACHE_TRAIN_CONFIG"] = "configs/train.yaml"
        cfg, ns = parse_args([])
        assert cfg.training.steps == 5 and ns.config_source == "$SHARDCACHE_TRAIN_CONFIG"
    finally:
        os.environ.pop("SHARDCACHE_TRAIN_CONFIG", None)
        os.chdir(cwd)


def test_repo_yaml_loads():
    cfg = load_yaml(REPO / "configs" / "train.yaml")
    assert cfg.checkpoint.keep == 3 and cfg.job.requeue_exit_code == 3 and cfg.dist.pg_timeout_min == 30
    for name in ("train-demo", "train-tts", "train-vlm", "train-theworld"):
        load_yaml(REPO / "configs" / f"{name}.yaml")


def test_eval_is_staggered_off_checkpoint_steps():
    """The rule of eval.every (documented in its option): never in a checkpoint step, except the last
    step and checkpoint.every 1; unstaggered it is the plain multiples."""
    from train.trainer import eval_due

    def evals(steps, every, ckpt, stagger=True):
        return [s for s in range(1, steps + 1) if eval_due(s, steps, every, ckpt, stagger)]

    assert evals(2500, 500, 1000) == [500, 1001, 1500, 2001, 2500]          # the option's example
    assert evals(10, 0, 4) == [5, 9, 10]                                    # 0 = every checkpoint.every steps
    assert evals(10, 0, 4, stagger=False) == [4, 8, 10]                     # what it was before
    assert evals(6, 2, 1) == [2, 4, 6]                                      # every step a checkpoint
    for steps, every, ckpt in [(100, 7, 21), (60, 3, 6), (50, 5, 5), (40, 4, 10), (30, 1, 3)]:
        ev = evals(steps, every, ckpt)
        ck = {s for s in range(1, steps + 1) if s % ckpt == 0}
        assert not (set(ev) & ck) - {steps}, (every, ckpt)
        # every multiple of `every` is evaluated, at it or right after its checkpoint
        assert all(m in ev or m + 1 in ev or m == steps for m in range(every, steps + 1, every))


def test_grad_norms_and_clipping_equal_clip_grad_norm():
    """train.optim's per-group norms + clip give what torch's clip_grad_norm_ gives, mixed dtypes too."""
    from train.optim import clip_grads_, grad_norms
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(4)] + [torch.nn.Parameter(torch.randn(5).bfloat16())]
    unused = torch.nn.Parameter(torch.randn(2))                       # no gradient: counts 0
    grads = [torch.randn_like(p) * 3 for p in params]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r, g in zip(params, ref, grads):
        p.grad, r.grad = g.clone(), g.clone()
    groups = [params[:2], params[2:] + [unused], [unused]]
    norms = grad_norms(groups, torch.device("cpu"))
    for got, ps in zip(norms.tolist(), groups):
        want = torch.cat([p.grad.float().flatten() for p in ps if p.grad is not None] or [torch.zeros(1)]).norm()
        half = any(p.dtype == torch.bfloat16 for p in ps)  # a bf16 tensor's norm is computed in bf16, as torch does
        assert got == pytest.approx(want.item(), rel=4e-3 if half else 1e-5)
    total = torch.linalg.vector_norm(norms)
    want_total = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert total.item() == pytest.approx(want_total.item(), rel=1e-6)
    clip_grads_(params, 1.0, total)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)
    before = [p.grad.clone() for p in params]
    clip_grads_(params, float("inf"), total)                          # grad_clip 0: untouched
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))


def test_lr_schedule():
    cfg = from_dict(dict(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, steps=14, schedule="cosine"))
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.55)
    assert lr_at(14, cfg) == pytest.approx(0.1) and lr_at(100, cfg) == pytest.approx(0.1)
    lin = from_dict(dict(lr=1.0, min_lr_ratio=0.0, warmup_steps=0, steps=10, schedule="linear"))
    assert lr_at(5, lin) == pytest.approx(0.5)
    poly = from_dict({"optim": {"lr": 2.0}, "schedule": {"name": "polynomial", "power": 2.0, "warmup_steps": 2,
                                                          "min_lr_ratio": 0.0}, "training": {"steps": 12}})
    assert lr_at(1, poly) == pytest.approx(2.0) and lr_at(7, poly) == pytest.approx(2.0 * 0.5 ** 2)
    const = from_dict({"schedule": {"name": "constant", "warmup_steps": 2}, "optim": {"lr": 0.5}})
    assert [lr_at(s, const) for s in (0, 1, 50, 999)] == [0.25, 0.5, 0.5, 0.5]


# ---- models ----------------------------------------------------------------------------------------

def _batch(cache: Path, keys=range(6)):
    from shards import ShardReader
    r = ShardReader(cache)
    return collate([r.get(i) for i in keys], ("codes", "input_ids", "labels", "latents"))


def test_cache_sizes_from_manifest(cache):
    c = Cache.open(cache)
    assert (c.codec.n_codebooks, c.codec.codebook_size, c.vocab_size, c.latent_channels) == (8, 1024, 259, 16)
    from loaders import CODES_PAD_ID
    from train.models import IGNORE_INDEX
    assert CODES_PAD_ID == IGNORE_INDEX == -100


@pytest.mark.parametrize("latent_loss", ["none", "cosine", "mse"])
def test_reference_model_uses_every_modality(cache, latent_loss):
    torch.manual_seed(0)
    m = build_model("reference", TINY_MODEL, Cache.open(cache), latent_loss=latent_loss)
    batch = _batch(cache)
    assert batch["has_image"].any() and not batch["has_image"].all()
    out = m(batch)
    assert set(out) >= {"loss", "codes_loss"} and torch.isfinite(out["loss"])
    assert ("latent_loss" in out) == (latent_loss != "none")
    out["loss"].backward()
    no_grad = [n for n, p in m.named_parameters() if p.grad is None]
    assert no_grad == []  # no unused parameter: DDP needs no find_unused_parameters
    assert m.text_emb.weight.grad.abs().sum() > 0 and m.latent_proj.weight.grad.abs().sum() > 0
    assert all(h.weight.grad.abs().sum() > 0 for h in m.heads)  # one head per codebook, all trained


def test_reference_model_padding_and_causality(cache):
    """The batch loss is the mean of per-sample losses (padding ignored), and the logits of frame t
    depend on codes before t only."""
    torch.manual_seed(0)
    m = ReferenceModel(**TINY_MODEL).eval()
    lengths = _batch(cache, range(6))["codes_lengths"]
    short, long_ = int(lengths.argmin()), int(lengths.argmax())
    with torch.no_grad():
        l_short = m(_batch(cache, [short]))["codes_loss"]
        l_long = m(_batch(cache, [long_]))["codes_loss"]
        assert torch.allclose(m(_batch(cache, [short, long_]))["codes_loss"], (l_short + l_long) / 2, atol=1e-5)
        seen = []
        hook = m.heads[0].register_forward_hook(lambda mod, inp, out: seen.append(out))
        b = _batch(cache, [long_])
        m(b)
        b["codes"][0, :, 2] = (b["codes"][0, :, 2] + 1) % 1024
        m(b)
        hook.remove()
    a, c = seen
    assert torch.equal(a[:, :3], c[:, :3])          # frames 0..2 never see frame 2's codes
    assert not torch.allclose(a[:, 3], c[:, 3])      # frame 3's input is frame 2's codes


def test_plugin_factory_and_lora(cache):
    m = build_model("test_train_support:make_mean_codes", {}, cache)
    assert m.logits.shape == (8, 1024)
    assert torch.isfinite(m(_batch(cache)))
    with pytest.raises(ValueError, match="module:factory"):
        build_model("nocolon", {}, cache)
    from train.models import apply_lora, model_spec
    ref = ReferenceModel(**TINY_MODEL)
    total = count_params(ref)[1]
    lora = apply_lora(ref, 4, 8, 0.0, ("qkv", "fc1"), spec=model_spec("reference"))
    trainable, total2 = count_params(lora)
    assert 0 < trainable < total2 and total2 > total
    assert all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)


# ---- padded latents (aspect-ratio buckets): latents_mask -------------------------------------------

def _image_batch(sizes, pad_hw, mask: bool = True) -> dict:
    """One sample per entry of ``sizes``: real latents of (h, w) (None = no image), the same values
    whatever the padding, zero-padded to ``pad_hw``; codes and text do not depend on the padding."""
    g = torch.Generator().manual_seed(0)
    B = len(sizes)
    codes = torch.randint(0, 1024, (B, 8, 6), generator=g)
    codes[-1, :, 4:] = -100
    text = torch.randint(3, 259, (B, 5), generator=g)
    text[0, 3:] = 0
    lat = torch.zeros(B, 16, 1, *pad_hw)
    lmask = torch.zeros(B, 1, *pad_hw, dtype=torch.bool)
    for i, hw in enumerate(sizes):
        if hw is not None:
            h, w = hw
            lat[i, :, :, :h, :w] = torch.randn(16, 1, h, w, generator=torch.Generator().manual_seed(100 + i))
            lmask[i, :, :h, :w] = True
    batch = {"codes": codes, "codes_mask": codes[:, 0] != -100, "input_ids": text, "attention_mask": text != 0,
             "latents": lat, "has_image": torch.tensor([hw is not None for hw in sizes])}
    if mask:
        batch["latents_mask"] = lmask
    return batch


@pytest.mark.parametrize("latent_loss", ["none", "cosine", "mse"])
def test_latents_mask_loss_independent_of_padding(latent_loss):
    """Sample A (5x6 latents: odd, so partly padded patches), B (8x8) and C (no image), padded to
    8x8, 12x12 and 9x11 (not multiples of the patch): the same losses; A alone padded to 12x12 with
    the mask has the loss of A unpadded without one (the behaviour without latents_mask)."""
    torch.manual_seed(0)
    m = ReferenceModel(**TINY_MODEL, latent_loss=latent_loss).eval()
    keys = ["loss", "codes_loss"] + (["latent_loss"] if latent_loss != "none" else [])
    with torch.no_grad():
        outs = [m(_image_batch([(5, 6), (8, 8), None], pad)) for pad in [(8, 8), (12, 12), (9, 11)]]
        for o in outs[1:]:
            for k in keys:
                assert torch.allclose(o[k], outs[0][k], atol=1e-5, rtol=1e-5), k
        alone_unpadded = m(_image_batch([(5, 6)], (5, 6), mask=False))  # the old path: no mask
        for pad in [(5, 6), (8, 8), (12, 12)]:
            o = m(_image_batch([(5, 6)], pad))
            for k in keys:
                assert torch.allclose(o[k], alone_unpadded[k], atol=1e-5, rtol=1e-5), (k, pad)
        # without the mask the padding would count: that is what latents_mask is for
        no_mask = m(_image_batch([(5, 6), (8, 8), None], (12, 12), mask=False))
        assert not torch.allclose(no_mask["loss"], outs[0]["loss"], atol=1e-5)
        with pytest.raises(ValueError, match="latents_mask"):
            b = _image_batch([(5, 6)], (8, 8))
            b["latents_mask"] = b["latents_mask"][..., :4]
            m(b)


@pytest.mark.parametrize("latent_loss", ["none", "mse"])
def test_latents_mask_padding_gets_no_gradient(latent_loss):
    grads = {}
    for pad in [(8, 8), (12, 12)]:
        torch.manual_seed(0)
        m = ReferenceModel(**TINY_MODEL, latent_loss=latent_loss)
        b = _image_batch([(5, 6), (8, 8), None], pad)
        b["latents"].requires_grad_(True)
        m(b)["loss"].backward()
        g = b["latents"].grad
        # A is 5x6: its 2x2 patches cover rows 0..5 (row 5 is padding inside a real patch, which
        # is part of that patch's input) and columns 0..5; no cell beyond gets any gradient
        assert (g[0, :, :, :6, :6] != 0).all()
        assert g[0, :, :, 6:].abs().sum() == 0 and g[0, :, :, :, 6:].abs().sum() == 0
        assert (g[1, :, :, :8, :8] != 0).all()
        assert g[1, :, :, 8:].abs().sum() == 0 and g[1, :, :, :, 8:].abs().sum() == 0
        assert g[2].abs().sum() == 0                               # no image: no gradient at all
        grads[pad] = {n: p.grad.clone() for n, p in m.named_parameters()}
    for n, g8 in grads[(8, 8)].items():          # the parameters' gradients ignore the padding too
        assert torch.allclose(grads[(12, 12)][n], g8, atol=1e-6, rtol=1e-5), n


# ---- metrics ---------------------------------------------------------------------------------------

def test_step_stats_read_gives_every_quantity_under_its_name():
    """Extras (sorted or not), optimizer groups and latent statistics each land under their own name,
    with the values computed here directly (means over micro-steps, last step's group norms)."""
    from train.metrics import StepStats
    st = StepStats(torch.device("cpu"), skipped=2, groups=("proj", "lm"))
    st.add_micro(torch.tensor(2.0), {"z_loss": torch.tensor(1.0), "a_loss": torch.tensor(10.0)}, 5, 2)
    st.add_micro(torch.tensor(4.0), {"z_loss": torch.tensor(3.0), "a_loss": torch.tensor(30.0)}, 7, 2)
    st.add_step(torch.tensor(5.0), torch.tensor(False), 4.0, torch.tensor([3.0, 4.0]))
    lat = torch.tensor([1.0, 2.0, 3.0, 6.0]).reshape(1, 1, 1, 2, 2)
    st.add_latents(lat, torch.tensor([[[[True, True], [True, False]]]]))     # 6.0 masked out
    rec, health = st.read(D.DistInfo())
    assert rec["loss"] == 3.0 and rec["z_loss"] == 2.0 and rec["a_loss"] == 20.0
    assert rec["grad_norm/proj"] == 3.0 and rec["grad_norm/lm"] == 4.0 and rec["grad_norm"] == 5.0
    assert rec["skipped_steps"] == 2 and health == {"over_warn": 1, "streak": 0}
    assert rec["latents_mean"] == 2.0 and rec["latents_min"] == 1.0 and rec["latents_max"] == 3.0
    assert rec["latents_std"] == pytest.approx(math.sqrt(((1 - 2) ** 2 + 0 + (3 - 2) ** 2) / 3))
    assert rec["tokens_per_s"] > 0 and rec["samples_per_s"] > 0


@pytest.fixture
def train_log(caplog, monkeypatch):
    """caplog for the ``train`` logger (an in-process run's setup_logging turns propagation off)."""
    monkeypatch.setattr(logging.getLogger("train"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="train"):
        yield caplog


def _drops(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "throughput dropped" in r.getMessage()]


def test_throughput_drop_warning(tmp_path, train_log):
    steady = Metrics(tmp_path / "steady", True, 100, progress=False, throughput_warn=0.5)
    steady.open(0)
    for step in range(1, 61):  # +-30 % jitter stays above half the running average
        steady.log({"step": step, "loss": 1.0, "samples_per_s": 100.0 + 30 * ((-1) ** step),
                    "data_wait": 0.01})
    steady.close()
    assert _drops(train_log) == []

    m = Metrics(tmp_path / "drop", True, 100, progress=False, throughput_warn=0.5)
    m.open(0)
    for step in range(1, 21):
        m.log({"step": step, "loss": 1.0, "samples_per_s": 100.0, "data_wait": 0.01})
    assert _drops(train_log) == []
    m.log({"step": 21, "loss": 1.0, "samples_per_s": 20.0, "data_wait": 0.9})
    msgs = _drops(train_log)
    assert len(msgs) == 1 and "step 21" in msgs[0] and "20.0 samples/s" in msgs[0] and "100.0" in msgs[0]
    assert "data_wait=0.90" in msgs[0]
    for step in range(22, 30):  # still slow: not repeated within 50 steps
        m.log({"step": step, "loss": 1.0, "samples_per_s": 20.0, "data_wait": 0.9})
    m.log({"step": 30, "split": "val", "val_loss": 1.0})  # validation records never count
    m.close()
    assert len(_drops(train_log)) == 1
    assert len((tmp_path / "drop" / "metrics.jsonl").read_text().splitlines()) == 30


# ---- checkpoints -----------------------------------------------------------------------------------

class _Loader:
    def __init__(self):
        self.sd = {"epoch": 0, "cursor": 0}

    def state_dict(self):
        return dict(self.sd)

    def load_state_dict(self, sd):
        self.sd = dict(sd)


def test_checkpoint_atomic_keep_k_and_resume_auto(tmp_path):
    info = D.DistInfo()
    model = ReferenceModel(**TINY_MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = _Loader()
    (tmp_path / "step-99.tmp").mkdir()        # a crashed save: never read, removed by the next save
    (tmp_path / "step-98").mkdir()            # incomplete (no files): never read
    assert C.resolve_resume("auto", tmp_path) is None
    for step in range(1, 6):
        model(_fake_batch())["loss"].backward()
        opt.step()
        loader.sd["cursor"] = step * 4
        C.save(tmp_path, step, model=model, state={"optimizer": opt.state_dict(), "train_state": {"step": step}},
               loader_state=loader.state_dict(), info=info, config={"seed": 0}, keep=3)
    after_save = (torch.rand(3), __import__("numpy").random.rand(2), __import__("random").random())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-3", "step-4", "step-5", "step-98"], names
    assert C.resolve_resume("auto", tmp_path).name == "step-5"
    # everything but the weights loads with weights_only=True
    st = torch.load(tmp_path / "step-5" / "trainer.pt", weights_only=True)
    assert st["step"] == 5 and st["loaders"] == [{"epoch": 0, "cursor": 20}] and len(st["rng"]) == 1
    assert json.loads((tmp_path / "step-5" / "config.json").read_text()) == {"seed": 0}
    # round trip: weights, optimizer, loader, RNG
    model2 = ReferenceModel(**{**TINY_MODEL})
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    torch.manual_seed(123)
    C.load_model(model2, tmp_path / "step-5")
    got = C.read_state(tmp_path / "step-5", info)
    opt2.load_state_dict(got["optimizer"])
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), n
    assert got["loader"] == {"epoch": 0, "cursor": 20} and got["train_state"] == {"step": 5}
    assert opt2.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    again = (torch.rand(3), __import__("numpy").random.rand(2), __import__("random").random())
    assert torch.equal(after_save[0], again[0]) and (after_save[1] == again[1]).all()
    assert after_save[2] == again[2]  # torch, numpy and python RNG streams continue where they were


def _fake_batch():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 1024, (2, 8, 5), generator=g)
    codes[1, :, 3:] = -100
    return {"codes": codes, "input_ids": torch.randint(1, 259, (2, 4), generator=g),
            "latents": torch.randn(2, 16, 1, 4, 4, generator=g), "has_image": torch.tensor([True, False])}


# ---- the loop in one process -----------------------------------------------------------------------

def test_run_writes_metrics_checkpoints_and_validation(cache, tmp_path):
    out = tmp_path / "run"
    seen = {}

    def on_micro_step(step, micro):
        pass

    def on_setup(trainer):  # the batch contract of the real loader reaches the model
        real = trainer.raw.forward

        def forward(batch):
            seen.setdefault("dtypes", {k: v.dtype for k, v in batch.items() if isinstance(v, torch.Tensor)})
            return real(batch)
        trainer.raw.forward = forward

    cfg = cfg_for(cache, out, steps=5, ckpt_every=2, keep=2, eval_every=2, eval_batches=2,
                  latent_loss="cosine", log_every=1)
    assert run(cfg, Callbacks(on_setup=on_setup, on_micro_step=on_micro_step)) == 0
    assert seen["dtypes"]["latents"] == torch.float32 and seen["dtypes"]["latents_mask"] == torch.bool
    assert seen["dtypes"]["input_ids"] == torch.int64 and "attention_mask" in seen["dtypes"]
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    for k in ("loss", "lr", "grad_norm", "grad_norm_max", "samples_per_s", "tokens_per_s", "data_wait",
              "peak_mem_mb", "codes_loss", "latent_loss", "skipped_steps", "step_time_s", "lr/decay", "lr/no_decay",
              "grad_norm/decay", "grad_norm/no_decay"):
        assert k in recs[0], k
    for r in recs:  # the global norm is the L2 norm of the groups' norms
        assert math.hypot(r["grad_norm/decay"], r["grad_norm/no_decay"]) == pytest.approx(r["grad_norm"], rel=1e-5)
    assert "latents_mean" not in recs[0]                       # debug metrics only with metrics.debug
    assert all(0 <= r["data_wait"] <= 1 for r in recs)
    val = read_metrics(out, "val")
    # 1 of 24 keys held out; the validation loader wraps around to fill its batch of 4. eval.every 2 and
    # checkpoint.every 2: staggered, validation runs the step after each checkpoint (3), and at the end (5)
    assert [r["step"] for r in val] == [3, 5] and val[0]["val_samples"] == 4
    assert val[0]["val_loss"] != val[1]["val_loss"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["step-4", "step-5"]
    assert not list(out.glob("*.tmp"))
    st = torch.load(out / "step-5" / "trainer.pt", weights_only=True)
    assert st["config"]["training"]["steps"] == 5 and st["config"]["model"]["latent_loss"] == "cosine"
    assert st["lr_scheduler"]["last_epoch"] == 5 and st["train_state"]["step"] == 5


def test_log_every_averages_the_window(cache, tmp_path):
    """metrics.every 3: records at steps 3, 6 and the last; the loss of a record is the mean of its
    window's step losses (compared with a run that logs every step)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert run(cfg_for(cache, a, steps=7, log_every=1)) == 0
    assert run(cfg_for(cache, b, steps=7, log_every=3)) == 0
    every = [r["loss"] for r in read_metrics(a)]
    recs = read_metrics(b)
    assert [r["step"] for r in recs] == [3, 6, 7]
    for r, window in zip(recs, (every[0:3], every[3:6], every[6:7])):
        assert r["loss"] == pytest.approx(sum(window) / len(window), rel=1e-6)


def test_grad_accumulation_matches_full_batch(cache, tmp_path):
    """1 x B and B/2 x accum 2 in one process reach the same parameters (per-sample loss means)."""
    a = cfg_for(cache, tmp_path / "a", batch_size=4, grad_accum=1, steps=3)
    b = cfg_for(cache, tmp_path / "b", batch_size=2, grad_accum=2, steps=3)
    assert run(a) == 0 and run(b) == 0
    pa, pb = load_params(tmp_path / "a" / "step-3"), load_params(tmp_path / "b" / "step-3")
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=2e-5, rtol=1e-4), k


@pytest.mark.parametrize("fused", ["on", "off"])
def test_non_finite_step_is_skipped(cache, tmp_path, fused):
    """A NaN loss at step 2: the step is skipped (on the device with the fused AdamW, on the host
    otherwise), counted, logged as null, and AdamW's state does not move."""
    out = tmp_path / "run"
    cfg = cfg_for(cache, out, steps=4, model="test_train_support:make_mean_codes", fused=fused,
                  model_kwargs={"nan_at_calls": [2]}, ckpt_every=1, keep=4, warmup_steps=0, validation=False)
    assert run(cfg) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line, parse_constant=lambda c: pytest.fail(f"not JSON: {c}")) for line in lines]
    recs = [r for r in recs if "split" not in r]
    assert [r["skipped_steps"] for r in recs] == [0, 1, 1, 1]
    assert recs[1]["loss"] is None and recs[1]["grad_norm"] is None  # null, not NaN
    p1, p2 = load_params(out / "step-1"), load_params(out / "step-2")
    assert torch.equal(p1["logits"], p2["logits"])  # the NaN step changed nothing
    o1 = torch.load(out / "step-1" / "optimizer.pt", weights_only=True)["state"][0]
    o2 = torch.load(out / "step-2" / "optimizer.pt", weights_only=True)["state"][0]
    assert float(o1["step"]) == float(o2["step"]) == 1.0 and torch.equal(o1["exp_avg"], o2["exp_avg"])
    assert torch.isfinite(load_params(out / "step-4")["logits"]).all()


def test_stop_file_saves_and_returns_requeue_code(cache, tmp_path):
    out = tmp_path / "run"
    stop_file = tmp_path / "STOP"
    stop_file.write_text("stale")  # from an earlier job: removed at start, not obeyed

    def on_step(step, rec):
        if step == 2:
            stop_file.touch()

    cfg = cfg_for(cache, out, steps=50, stop_file=str(stop_file), requeue_exit_code=7)
    assert run(cfg, Callbacks(on_step=on_step)) == 7
    assert [p.name for p in out.iterdir() if p.is_dir()] == ["step-2"]
    assert not stop_file.exists()  # consumed, so a requeued job does not stop at once
    assert json.loads((out / "REQUEUE").read_text())["step"] == 2
    cfg = cfg_for(cache, out, steps=4, resume="auto")
    assert run(cfg) == 0 and not (out / "REQUEUE").exists()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]


@pytest.mark.parametrize("prefetch", ["off", "on"])
def test_resume_bitwise_with_real_loader(cache, tmp_path, prefetch):
    """Real ShardLoader, one process: stop at step 3, resume, same loss sequence bit for bit
    (across an epoch boundary: 24 samples - 1 held out / batch 4 = 5 steps per epoch). With
    ``prefetch_to_device: on`` the loader is one batch ahead of the step (as on CUDA): the checkpoint
    must hold the position of the batch last trained on, not the loader's."""
    kw = {"steps": 8, "latent_loss": "mse", "ckpt_every": 3, "data.prefetch_to_device": prefetch}
    assert run(cfg_for(cache, tmp_path / "a", **kw)) == 0
    assert run(cfg_for(cache, tmp_path / "b", stop_at_step=3, **kw)) == 3
    assert run(cfg_for(cache, tmp_path / "b", resume="auto", **kw)) == 0
    la = [r["loss"] for r in read_metrics(tmp_path / "a")]
    lb = [r["loss"] for r in read_metrics(tmp_path / "b")]
    assert len(la) == 8 and la == lb
    pa, pb = load_params(tmp_path / "a" / "step-8"), load_params(tmp_path / "b" / "step-8")
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


def test_plugin_loader(cache, tmp_path):
    """--data.loader module:class: any class with the ShardLoader API."""
    out = tmp_path / "run"
    assert run(cfg_for(cache, out, loader="test_train_support:FakeLoader", steps=3)) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def test_cli_help_and_bad_option():
    r = subprocess.run([PY, "-m", "shardcache", "train", "--help"], cwd=REPO, env=base_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--training.steps" in r.stdout and "torchrun" in r.stdout
    r = subprocess.run([PY, "-m", "shardcache", "train", "--config", "none", "--schedule.name", "nope"], cwd=REPO,
                       env=base_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "schedule.name: expected one of" in r.stderr
    assert "Traceback" not in r.stderr


def test_to_device_widens_compact_fields_exactly():
    from loaders.collate import AUDIO_SCALE
    from train.data import to_device
    audio = torch.tensor([[-32768, 0, 16384, 32767]], dtype=torch.int16)
    latents = torch.randn(1, 16, 1, 2, 2).half()
    out = to_device({"audio": audio, "latents": latents, "codes": torch.zeros(1, 8, 3, dtype=torch.long),
                     "keys": ["k"]}, torch.device("cpu"))
    assert out["audio"].dtype == torch.float32 and out["latents"].dtype == torch.float32
    assert torch.equal(out["audio"], audio.float() * float(AUDIO_SCALE))
    assert torch.equal(out["latents"].half(), latents) and out["codes"].dtype == torch.long
    assert out["keys"] == ["k"]
