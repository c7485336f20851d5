"""``shardcache train`` for the real jobs: the Higgs-Audio command line (aliases), a manifest given
where a cache belongs, the held-out validation split, optimizer groups under the schedule, epochs,
and the loop on an image-text cache without codes or audio (a plug-in model declaring its fields).
"""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from test_train_support import PY, REPO, Captured, base_env, read_metrics
from test_train_support import from_dict
from train.cli import build_parser, parse_args
from train.data import HeldOut, held_out_mask, resolve_fields, total_steps
from train.metrics import GradNormWarning
from train.optim import lr_at, make_optimizer, make_scheduler
from train.recipes.base import Recipe
from shards import Cache
from shards.cache import Contract
from train.trainer import Callbacks, run

HIGGS = ("--model_path {lm} --audio_tokenizer_path {tok} --train_data_file {cache} --output_dir {out} "
         "--save_steps 5000 --disable_evaluation --per_device_train_batch_size 2 --learning_rate 5e-5 "
         "--num_train_epochs 3 --logging_steps 50 --warmup_steps 500 --bf16 --use_lora")
VOCAB, IMG_TOKEN, LATENT_C = 64, 5, 4




@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


# ---- the Higgs-Audio command line ------------------------------------------------------------------

def test_higgs_command_line_maps_onto_our_options(tmp_path):
    """The multi-node launch line, as written (less `torchrun ... -m shardcache train`), over configs/train.yaml
    (model: reference and its model_kwargs: dropped, they belong to the file's model)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    argv = HIGGS.format(lm="/ckpt/higgs-audio-v2", tok="/ckpt/higgs-audio-tokenizer", cache=cache,
                        out=tmp_path / "run").split()
    cfg, _ = parse_args(["--config", str(REPO / "configs" / "train.yaml"), *argv])
    assert cfg.model.name == "higgs"                            # --model_path without --model
    assert cfg.model.kwargs == {"lm": "/ckpt/higgs-audio-v2"}   # the file's reference kwargs dropped
    assert cfg.model.audio_tokenizer == "/ckpt/higgs-audio-tokenizer"
    assert cfg.data.cache == str(cache) and cfg.job.dir == str(tmp_path / "run")
    assert cfg.checkpoint.every == 5000 and cfg.eval.enabled is False
    assert cfg.data.batch_size == 2 and cfg.optim.lr == 5e-5 and cfg.training.epochs == 3.0
    assert cfg.metrics.every == 50 and cfg.schedule.warmup_steps == 500
    assert cfg.training.precision == "bf16" and cfg.lora.enabled is True
    assert cfg.data.fields == ("auto",)
    assert cfg.schedule.min_lr_ratio == 0.1  # a ratio: 5e-5 decays to 5e-6, not to an absolute min_lr
    # --model.name wins over the higgs default; --model.kwargs JSON and --model_path combine
    cfg, _ = parse_args(["--config", "none", "--model.name", "vlm", "--model_path", "/ckpt/lm",
                         "--model.kwargs", '{"freeze_lm": true}'])
    assert cfg.model.name == "vlm" and cfg.model.kwargs == {"freeze_lm": True, "lm": "/ckpt/lm"}
    with pytest.raises(ValueError, match="reference model loads no LM"):
        parse_args(["--config", "none", "--model.name", "reference", "--model_path", "/ckpt/lm"])
    # the translation is the Higgs recipe's own (train.recipes.higgs_argv): the generic parser has no such names
    from shardcache import config as S
    from train.config import TrainConfig
    with pytest.raises(ValueError, match="train_data_file: unknown option"):
        S.parse(build_parser(), TrainConfig, ["--config", "none", "--train_data_file", str(cache)], "")


def test_manifest_file_as_train_data_file_exits_2_with_the_precompute_command(tmp_path):
    manifest = tmp_path / "train_chatml.json"
    manifest.write_text("[]\n")
    r = subprocess.run([PY, "-m", "shardcache", "train", "--config", "none", "--train_data_file", str(manifest),
                        "--output_dir", str(tmp_path / "run")], cwd=REPO, env=base_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"shardcache precompute --manifest {manifest}" in r.stderr
    assert "configs/precompute-tts.yaml" in r.stderr and "--train_data_file DIR" in r.stderr


# ---- held-out validation split -----------------------------------------------------------------------

def test_held_out_split_is_disjoint_complete_sized_and_stable():
    keys = [f"spk{i % 7}_utt{i:05d}" for i in range(4000)]
    table = __import__("pyarrow").table({"key": keys})
    val = HeldOut(0.02, "val")(table)
    train = HeldOut(0.02, "train")(table)
    assert not (val & train).any() and (val | train).all()      # disjoint, union = every key
    assert abs(val.mean() - 0.02) < 0.006                       # binomial sd 0.0022
    # stable: a key's membership is its own (any subset, order, run; the split sees no rank or seed)
    rng = np.random.default_rng(0)
    sub = rng.permutation(len(keys))[:1000]
    again = held_out_mask([keys[i] for i in sub], 0.02)
    assert (again == val[sub]).all()
    assert (held_out_mask(keys, 0.02) == val).all()
    # small caches: >= 1 key held out from 20 samples on, none below
    assert held_out_mask(keys[:19], 0.02).sum() == 0
    assert held_out_mask(keys[:20], 0.02).sum() >= 1
    assert held_out_mask(keys, 0.0).sum() == 0


def _image_text_cache(root: Path, n: int = 40, n_shards: int = 2) -> Path:
    """A conversation-style cache without codes or audio: input_ids, labels, latents on every other sample."""
    from shards import ShardWriter, merge_parts, shard_name

    rng = np.random.default_rng(1)
    per = -(-n // n_shards)
    i = 0
    for s in range(n_shards):
        with ShardWriter(root, shard_name(0, s)) as w:
            for _ in range(min(per, n - i)):
                L = int(rng.integers(6, 14))
                ids = rng.integers(6, VOCAB, L).astype(np.int32)
                labels = ids.copy()
                labels[: L // 2] = -100
                fields = {"json": {"text": f"caption {i}"}, "input_ids.npy": ids, "labels.npy": labels}
                if i % 2 == 0:
                    ids[1] = IMG_TOKEN
                    labels[1] = -100
                    fields["latents.npy"] = rng.standard_normal((LATENT_C, 1, 2, 2)).astype(np.float16)
                w.add(f"img{i:04d}", fields)
                i += 1
            w.commit()
    merge_parts(root, {"text": {"vocab_size": VOCAB, "pad_id": 0, "special_token_ids": {"<image>": IMG_TOKEN}},
                       "text_vocab_size": VOCAB, "text_pad_id": 0, "latent_channels": LATENT_C})
    return root


@pytest.fixture(scope="module")
def image_cache(tmp_path_factory) -> Path:
    return _image_text_cache(tmp_path_factory.mktemp("imgtext") / "c")


def test_held_out_keys_through_the_loader_for_any_world_size(image_cache):
    """ShardLoader with the HeldOut filters: train and validation keys are disjoint, together every
    key, and each world size's ranks together see the same validation keys."""
    from loaders import Order, ShardLoader
    from shardcache.ranks import Ranks
    from shards import read_index

    all_keys = set(read_index(image_cache).column("key").to_pylist())

    def keys_of(part: str, world: int) -> set[str]:
        seen: set[str] = set()
        for rank in range(world):
            ld = ShardLoader(image_cache, 2, fields=("input_ids",), filters=HeldOut(0.2, part), ranks=Ranks(rank, world), order=Order(drop_remainder=False))
            ld.set_epoch(0)
            for b in ld:
                seen.update(b["keys"])
        return seen

    val1, val2, val3 = keys_of("val", 1), keys_of("val", 2), keys_of("val", 3)
    train1, train2 = keys_of("train", 1), keys_of("train", 2)
    assert val1 and val1 == val2 == val3
    assert train1 == train2 and not (train1 & val1) and train1 | val1 == all_keys
    assert val1 == {k for k, m in zip(sorted(all_keys), held_out_mask(sorted(all_keys), 0.2)) if m}


# ---- optimizer groups and the schedule ---------------------------------------------------------------

class TwoLR(Recipe):  # declares its optimizer groups: a recipe
    fields = ("input_ids",)

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def optimizer_groups(self, lr: float, weight_decay: float) -> list[dict]:
        return [{"params": list(self.body.parameters()), "lr": lr, "weight_decay": weight_decay, "name": "lm"},
                {"params": list(self.head.parameters()), "lr": 10 * lr, "weight_decay": 0.0, "name": "head"}]


def test_optimizer_groups_follow_the_schedule_factor():
    cfg = from_dict(dict(lr=2e-3, min_lr_ratio=0.1, warmup_steps=4, steps=20, schedule="cosine"))
    opt = make_optimizer(TwoLR(), cfg, torch.device("cpu"))
    sched = make_scheduler(opt, cfg, 20)
    assert [g["initial_lr"] for g in opt.param_groups] == [2e-3, 2e-2]
    assert [g["name"] for g in opt.param_groups] == ["lm", "head"]
    for step in range(31):  # LambdaLR: the lr of optimizer step `step` after `step` scheduler steps
        factor = lr_at(step, cfg) / cfg.optim.lr
        assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * factor, rel=1e-12)
        assert opt.param_groups[1]["lr"] == pytest.approx(2e-2 * factor, rel=1e-12)
        opt.step()
        sched.step()
    assert sched.state_dict()["lr_lambdas"][0] == {"name": "cosine", "warmup": 4, "steps": 20,
                                                   "min_ratio": pytest.approx(0.1), "power": 1.0}
    # a hook that leaves a trainable parameter out is refused
    bad = TwoLR()
    bad.optimizer_groups = lambda lr, wd: [{"params": list(bad.body.parameters())}]
    with pytest.raises(ValueError, match="exactly one group"):
        make_optimizer(bad, cfg, torch.device("cpu"))


def test_epochs_set_the_length():
    assert total_steps(from_dict(dict(steps=77)), 10) == 77
    assert total_steps(from_dict(dict(steps=77, epochs=3)), 10) == 30
    assert total_steps(from_dict(dict(epochs=0.28)), 25) == 7     # 0.28 * 25 = 7.000000000000001
    assert total_steps(from_dict(dict(epochs=0.25)), 10) == 3


def test_grad_norm_warning():
    """Norms 5, 13000, NaN, 900, 16000 in windows of one step (log every step), then one window
    of all five: a warning per window with a norm over the limit, naming the window's max."""
    from train.metrics import StepStats
    with Captured() as cap:
        watch = GradNormWarning(1000.0, 1.0, True)
        for step, norm in enumerate([5.0, 13000.0, float("nan"), 900.0, 16000.0], 1):
            st = StepStats(torch.device("cpu"))
            st.add_step(torch.tensor(norm), torch.tensor(norm != norm), 1000.0)
            rec, health = st.read(__import__("train.dist", fromlist=["D"]).DistInfo())
            watch(step, step, rec["grad_norm_max"], health["over_warn"])
        st = StepStats(torch.device("cpu"))
        for norm in [5.0, 13000.0, float("nan"), 900.0, 16000.0]:
            st.add_step(torch.tensor(norm), torch.tensor(norm != norm), 1000.0)
        rec, health = st.read(__import__("train.dist", fromlist=["D"]).DistInfo())
        watch(1, 5, rec["grad_norm_max"], health["over_warn"])
    warned = [m for m in cap.messages if "grad_norm_warn" in m]
    assert len(warned) == 3 and warned[0].startswith("step 2: grad norm 1.3e+04")
    assert warned[2].startswith("steps 1-5: grad norm 1.6e+04") and "2 step(s) over" in warned[2]


# ---- the loop on an image-text cache (no codes, no audio) --------------------------------------------

SEEN: dict[str, list[str]] = {"train": [], "eval": []}


class TinyImageText(Recipe):
    """A plug-in recipe (``--model test_train_recipes_cli:TinyImageText``) that needs no codes: next-token
    loss on input_ids/labels with the image latents mixed in; two optimizer groups with their own lrs."""

    fields = ("input_ids", "labels", "latents")

    @classmethod
    def contract(cls, kwargs):
        return Contract("TinyImageText", fields=cls.fields)

    @classmethod
    def from_cache(cls, cache, kwargs, **_):
        return cls(cache.vocab_size, cache.latent_channels, **kwargs)

    def __init__(self, vocab_size: int, latent_channels: int, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)
        self.proj = nn.Linear(latent_channels, d)
        self.head = nn.Linear(d, vocab_size)

    def optimizer_groups(self, lr: float, weight_decay: float) -> list[dict]:
        return [{"params": list(self.emb.parameters()) + list(self.head.parameters()), "lr": lr, "name": "lm"},
                {"params": list(self.proj.parameters()), "lr": 3 * lr, "weight_decay": 0.0, "name": "proj"}]

    def forward(self, batch):
        assert not {"codes", "audio"} & set(batch), sorted(batch)
        SEEN["train" if self.training else "eval"].extend(batch["keys"])
        h = self.emb(batch["input_ids"])
        if batch["latents"].numel():  # (B, 0, ...) when no sample of the batch has an image
            img = batch["latents"].float().mean((2, 3, 4)) * batch["has_image"][:, None]
            h = h + self.proj(img)[:, None]
        logits = self.head(h)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                               ignore_index=-100)
        return {"loss": loss, "text_loss": loss.detach()}


def make_tiny(vocab_size: int = VOCAB, latent_channels: int = LATENT_C):
    """The same model from a plain factory (it declares nothing: the loader reads every field)."""
    return TinyImageText(vocab_size, latent_channels)


def test_loop_on_an_image_text_cache_without_codes(image_cache, tmp_path):
    from shards import read_index

    SEEN["train"].clear()
    SEEN["eval"].clear()
    out = tmp_path / "run"
    cfg = from_dict(dict(cache=str(image_cache), out=str(out), model="test_train_recipes_cli:TinyImageText",
                         batch_size=4, epochs=2, warmup_steps=2, lr=1e-2, min_lr_ratio=0.1, val_fraction=0.2,
                         ckpt_every=1000, progress=False, threads=1, log_every=1))
    assert resolve_fields(cfg) == ("input_ids", "labels", "latents")  # the recipe's declared fields
    assert resolve_fields(from_dict(dict(cache=str(image_cache), model="test_train_recipes_cli:make_tiny"))) is None
    lrs: list[tuple[float, float]] = []
    norms: list[dict[str, float]] = []
    state = {}

    def on_setup(trainer):
        state["opt"] = trainer.optimizer

    def on_micro_step(step, micro):  # before the optimizer step: the lr this step runs with, pre-clip grads
        lrs.append(tuple(g["lr"] for g in state["opt"].param_groups))
        norms.append({g["name"]: torch.cat([p.grad.flatten() for p in g["params"]]).norm().item()
                      for g in state["opt"].param_groups})

    with Captured() as cap:
        assert run(cfg, Callbacks(on_setup=on_setup, on_micro_step=on_micro_step)) == 0
    keys = sorted(read_index(image_cache).column("key").to_pylist())
    held = {k for k, m in zip(keys, held_out_mask(keys, 0.2)) if m}
    n_train = len(keys) - len(held)
    recs = read_metrics(out)
    assert len(recs) == math.ceil(2 * (n_train // 4))                 # epochs x steps per epoch
    assert all(r["tokens_per_s"] > 0 and r["samples_per_s"] > 0 and "text_loss" in r for r in recs)
    # lr and pre-clip grad norm per optimizer group: the projection at its own 3x rate is logged as
    # such; `lr` is that of the biggest group (lm)
    for r, (lr_lm, lr_proj), n in zip(recs, lrs, norms):
        assert (r["lr/lm"], r["lr/proj"], r["lr"]) == (pytest.approx(lr_lm), pytest.approx(lr_proj), pytest.approx(lr_lm))
        assert r["lr/proj"] == pytest.approx(3 * r["lr/lm"])
        assert (r["grad_norm/lm"], r["grad_norm/proj"]) == (pytest.approx(n["lm"], rel=1e-5),
                                                          pytest.approx(n["proj"], rel=1e-5))
    assert recs[-1]["epoch"] >= 1
    # held-out keys were validated on and never trained on
    assert held and set(SEEN["eval"]) == held and not held & set(SEEN["train"])
    val = read_metrics(out, "val")
    assert [r["step"] for r in val] == [len(recs)] and val[0]["val_samples"] >= len(held)
    # both groups followed the schedule, 3x apart
    assert all(b == pytest.approx(3 * a, rel=1e-9) for a, b in lrs)
    n = len(recs)  # the schedule spans the epochs' steps: warmup, then cosine down to min_lr at step n
    want = [lr_at(s, from_dict(dict(lr=1e-2, min_lr_ratio=0.1, warmup_steps=2, steps=n))) for s in range(n)]
    assert [a for a, _ in lrs] == pytest.approx(want, rel=1e-12)  # the lr each step ran with
    assert lrs[0][0] == pytest.approx(5e-3) and 1e-3 < lrs[-1][0] < 1.2e-3
    text = cap.text
    assert f"{len(held)} of {len(keys)} samples" in text and "% trainable" in text
    assert f"{len(recs)} steps = 2 epochs" in text
    st = torch.load(out / f"step-{len(recs)}" / "trainer.pt", weights_only=True)
    assert st["lr_scheduler"]["lr_lambdas"][0]["steps"] == len(recs) and st["config"]["training"]["epochs"] == 2.0


def test_disable_evaluation_holds_nothing_out(image_cache, tmp_path):
    SEEN["train"].clear()
    SEEN["eval"].clear()
    cfg = from_dict(dict(cache=str(image_cache), out=str(tmp_path / "run"), model="test_train_recipes_cli:TinyImageText",
                         batch_size=4, steps=10, warmup_steps=0, lr=1e-2, val_fraction=0.2, validation=False,
                         ckpt_every=1000, progress=False, threads=1))
    assert run(cfg) == 0
    assert SEEN["eval"] == [] and read_metrics(tmp_path / "run", "val") == []
    assert len(set(SEEN["train"])) == 40                               # 10 steps x 4 = every sample once


# ---- the Higgs-Audio command, end to end on a tiny conversation cache (--model.name higgs) -----------------

def _bytes_fingerprint() -> str:
    from precompute.encoders.text import ByteTokenizer
    return ByteTokenizer().describe()["vocab_sha256"]


#: the fingerprint of the byte tokenizer (``precompute.encoders.text.ByteTokenizer``) whose ids :func:`_tts_cache` holds
BYTES_TOKENIZER = _bytes_fingerprint()


def _tts_cache(root: Path, n: int = 24, Q: int = 3, CB: int = 16) -> Path:
    """Conversation samples by the contract: system/user text, one assistant <|AUDIO_OUT|> item each
    (codes (Q, F), one audio_segments row), labels on the assistant turn; the byte tokenizer's ids."""
    from shards import ShardWriter, merge_parts, shard_name

    AO_BOS, A_OUT, A_EOS, EOT = 267, 268, 266, 262
    rng = np.random.default_rng(2)
    with ShardWriter(root, shard_name(0, 0)) as w:
        for i in range(n):
            user = list(rng.integers(3, 259, int(rng.integers(3, 8))))
            F_ = int(rng.integers(4, 9))
            ids = [259, *user, EOT, AO_BOS, A_OUT, A_EOS, EOT]
            labels = [-100] * (len(user) + 2) + [AO_BOS, -100, A_EOS, EOT]
            w.add(f"conv{i:03d}", {
                "json": {"text": "x"},
                "input_ids.npy": np.array(ids, dtype=np.int32), "labels.npy": np.array(labels, dtype=np.int32),
                "codes.npy": rng.integers(0, CB, (Q, F_)).astype(np.int16),
                "audio_segments.npy": np.array([[0, 1, 1, 0, F_, -1]], dtype=np.int32)})
        w.commit()
    specials = {"<|AUDIO|>": 265, "<|AUDIO_OUT|>": A_OUT, "<|audio_bos|>": 264, "<|audio_out_bos|>": AO_BOS,
                "<|audio_eos|>": A_EOS, "<|eot_id|>": EOT, "<image>": 269}
    merge_parts(root, {"text": {"vocab_size": 272, "pad_id": 0, "special_token_ids": specials},
                       "text_vocab_size": 272, "text_pad_id": 0, "n_codebooks": Q, "codebook_size": CB,
                       # Higgs' codec (what --model.name higgs requires): 24 kHz, 25 frames/s, Q x log2(CB) bits a frame
                       "codec_sample_rate": 24000, "frame_rate": 25.0,
                       "encoders": {"audio_tokenizer": {"name": "higgs", "bandwidth": Q * math.log2(CB) * 25 / 1000},
                                    "text_tokenizer": {"name": "bytes", "vocab_sha256": BYTES_TOKENIZER}},
                       "config": {"audio_tokenizer": {"name": "higgs", "pretrained": "/ckpt/tokenizer-A"}}})
    return root


@pytest.mark.slow
def test_higgs_command_trains_the_higgs_recipe(higgs_caches, higgs_models, tmp_path, monkeypatch):
    """The launch line as written, --model_path a (tiny random) higgs_audio_v2 checkpoint on a cache of its
    own tokenizer: the higgs recipe, LoRA adapters only. --audio_tokenizer_path names the audio tokenizer
    the model was trained with: a checkpoint of other weights is refused (exit 2, ``codec.weights``) before
    any weight loads; the one the cache's codes came from trains."""
    pytest.importorskip("peft")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    torch.manual_seed(0)
    cache, _ = higgs_caches["voice_clone"]
    n = len(Cache.open(cache))
    out = tmp_path / "run"
    argv = HIGGS.format(lm=higgs_models / "higgs-tiny", tok=higgs_models / "higgs-audio-tokenizer-tiny", cache=cache,
                        out=out).split()
    argv[argv.index("--num_train_epochs") + 1] = "2"
    from train.cli import main
    wrong = [a if a != str(higgs_models / "higgs-audio-tokenizer-tiny") else str(higgs_models / "higgs-tiny")
             for a in argv]
    assert main(["--config", "none", "--metrics.progress=false", "--dist.threads", "1", *wrong]) == 2
    with Captured() as cap:
        assert main(["--config", "none", "--metrics.progress=false", "--dist.threads", "1", *argv]) == 0
    recs = read_metrics(out)
    # 2 epochs x n samples / batch 2 (--disable_evaluation: none held out); logging_steps 50: the last
    steps = 2 * (n // 2)
    assert [r["step"] for r in recs] == [steps] and read_metrics(out, "val") == []
    assert all(math.isfinite(r["loss"]) for r in recs)
    assert "fields: ['input_ids', 'labels', 'codes', 'audio_segments']" in cap.text
    ck = out / f"step-{steps}"
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["model"]["name"] == "higgs" and cfg["lora"]["enabled"] and cfg["training"]["precision"] == "bf16"
    assert cfg["model"]["audio_tokenizer"] == str(higgs_models / "higgs-audio-tokenizer-tiny")
    assert cfg["model_config"]["model_type"] == "higgs_audio_v2"
    assert (ck / "adapter.safetensors").exists() and not (ck / "model.safetensors").exists()
    groups = torch.load(ck / "optimizer.pt", weights_only=True)["param_groups"]
    assert {g["name"] for g in groups} == {"lm"} and all(g["initial_lr"] == 5e-5 for g in groups)
