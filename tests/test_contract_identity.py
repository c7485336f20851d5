"""Issue 42: the model's whole view of the cache is its contract, and every model has a spec.

Each mismatch an audit found training with exit 0 is refused here, with caches built by the real stage one
(``precompute.job.run``) from the tiny models of ``tools.testing``: ``shardcache train`` exits 2 with one
line starting ``ContractMismatch:`` that names the item, before any weight of the model loads (the test
replaces ``train.trainer.prepare_model``, the one place the model is built and its weights read, by a
function that fails the test): codes of a codec of other weights (same config, another seed), features
of a vision tower of other weights, latents at ``image_size`` 256 for a 512 preset, Cosmos latents for a
Wan preset, another label policy, another chat template, a checkpoint without tokenizer files, LoRA
adapters of another rank or alpha. The caches of other weights train with
``--model.allow_other_encoder_weights``, and the run records what it accepted.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT, _absolute
from shards import Cache

pytestmark = pytest.mark.slow   # stage one runs (a few seconds each), a few one-step trainings

WORLD = "llava_multiturn.json"
VOICE = "chatml_voice_clone.json"
IMAGE_SIZE = 64     #: the theworld caches' VAE input (the preset's 512: 4096 world tokens per image)


# ---- models and caches ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def M(higgs_models, tiny_models, tmp_path_factory) -> dict[str, Path]:
    """The tiny models by role: ``codec`` (the Higgs audio tokenizer, seed 0) and ``codec_other`` (the same
    config, seed 1), ``higgs`` (the LM and its tokenizer), ``gemma3`` / ``gemma3_other`` (seed 0 / 1: another
    vision tower, the same tokenizer), ``wan``, ``cosmos``."""
    from tools.testing import build
    out = tmp_path_factory.mktemp("identity-models")
    return {"codec": higgs_models / "higgs-audio-tokenizer-tiny", "higgs": higgs_models / "higgs-tiny",
            "codec_other": build("higgs-audio-tokenizer", out / "seed1", seed=1)[0],
            "gemma3": build("gemma3", out / "seed0")[0], "gemma3_other": build("gemma3", out / "seed1", seed=1)[0],
            "wan": tiny_models / "wan-tiny", "cosmos": build("cosmos", out / "seed0")[0]}


@pytest.fixture(scope="module")
def stage_one(real_mini, tmp_path_factory):
    """``make(kind, name, *overrides)``: a cache of real-mini records through stage one, ``kind`` ``higgs``
    (configs/precompute-tts.yaml, 2 voice-cloning records) or ``world`` (configs/precompute-theworld.yaml,
    1 LLaVA record at :data:`IMAGE_SIZE` px); built once per name."""
    from precompute.config import load_config
    from precompute.job import run
    out, made = tmp_path_factory.mktemp("identity-caches"), {}

    def make(kind: str, name: str, *overrides: str) -> Path:
        if name in made:
            return made[name]
        config, file, n = {"higgs": ("precompute-tts.yaml", VOICE, 2), "world": ("precompute-theworld.yaml", WORLD, 1)}[kind]
        recs = json.loads((real_mini / file).read_text())[:n]
        recs = [_absolute(r, real_mini) for r in recs] if kind == "higgs" else \
            [dict(r, image=str(real_mini / r["image"])) for r in recs]
        (out / f"{name}.json").write_text(json.dumps(recs))
        cfg = load_config(ROOT / "configs" / config, ["device=cpu", "num_workers=0", "allow_outside_root=true",
                                                     *overrides])
        summary, _ = run(out / f"{name}.json", out / name, cfg, progress=False)
        assert summary.kept == n, summary.reasons
        made[name] = out / name
        return made[name]
    return make


def _higgs_cache(stage_one, M, name: str, codec: str = "codec", *more: str) -> Path:
    return stage_one("higgs", name, f"audio_tokenizer.pretrained={M[codec]}", f"text_tokenizer.pretrained={M['higgs']}",
                     *more)


def _world_cache(stage_one, M, name: str, *more: str) -> Path:
    return stage_one("world", name, f"image_encoder.pretrained={M['wan']}", f"text_tokenizer.pretrained={M['gemma3']}",
                     f"image_features.pretrained={M['gemma3']}", f"image_size={IMAGE_SIZE}", *more)


# ---- shardcache train, in this process, with the model never built -------------------------------------

@pytest.fixture
def train(monkeypatch, capsys):
    """``train(cache, run_dir, *flags, build=False)`` -> ``(exit status, stderr)`` of ``shardcache train``
    run here. Unless ``build``, the model must never be built: ``train.trainer.prepare_model`` (where it is
    built and every weight of it read) ends the run with SystemExit(99), so exit 2 means refused before
    any weight loaded."""
    import train.trainer
    from train.cli import main
    real = train.trainer.prepare_model
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)

    def never(*a, **k):
        raise SystemExit(99)

    def go(cache: Path, run_dir: Path, *flags: str, build: bool = False) -> tuple[int, str]:
        monkeypatch.setattr(train.trainer, "prepare_model", real if build else never)
        capsys.readouterr()
        rc = main(["--config", "none", "--cache", str(cache), "--run_dir", str(run_dir), "--training.steps", "1",
                   "--checkpoint.every", "1", "--data.batch_size", "1", "--eval.enabled", "false",
                   "--metrics.progress=false", "--dist.threads", "1", *flags])
        return rc, capsys.readouterr().err
    return go


def _refused(rc: int, err: str) -> tuple[list[str], str]:
    """The items of the one ``ContractMismatch:`` line of a refused run (exit 2), and the line."""
    assert rc == 2, err[-2000:]
    line = [x for x in err.splitlines() if "error: ContractMismatch: " in x]
    assert len(line) == 1 and "Traceback" not in err, err[-2000:]
    return re.findall(r"(?:: |; )([\w.<>|]+): (?:the cache has|the adapter has) ", line[0]), line[0]


def _higgs(M, *more: str) -> list[str]:
    return ["--model.name", "higgs", "--model.kwargs", json.dumps({"lm": str(M["higgs"])}),
            "--model.audio_tokenizer", str(M["codec"]), *more]


def _world(M, **kw) -> list[str]:
    return ["--model.name", "theworld", "--model.kwargs", json.dumps({"lm": str(M["gemma3"]), "vae": str(M["wan"]), **kw})]


# ---- identity recorded at stage one ------------------------------------------------------------------------

def test_stage_one_records_each_encoders_identity(tiny_models, tmp_path, monkeypatch):
    """``describe()`` records the checkpoint's tensors as stored (the hash a recipe computes from the same
    checkpoint, whatever its sharding; another seed differs), where they were read (the absolute folder, no
    revision) and the numeric policy in effect (device type, dtype, ATen's CPU kernels, both TF32 switches,
    the float32 matmul precision, cuDNN's switches): flipping a switch changes the description, so the
    cache's fingerprint."""
    from precompute.encoders import load_audio_tokenizer
    from shardcache.weights import checkpoint_sha256
    from tools.testing import build
    codec = load_audio_tokenizer({"name": "dac", "pretrained": str(tiny_models / "dac-tiny")})
    d = codec.describe()
    assert d["checkpoint_sha256"] == checkpoint_sha256(tiny_models / "dac-tiny")
    assert d["loaded_from"] == {"pretrained": str((tiny_models / "dac-tiny").resolve()), "revision": None,
                                "subfolder": None, "files": ["model.safetensors"], "index": None}
    assert d["numerics"] == {"device": "cpu", "dtype": "float32", "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                             "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                             "tf32_cudnn": torch.backends.cudnn.allow_tf32,
                             "float32_matmul_precision": torch.get_float32_matmul_precision(),
                             "cudnn_enabled": torch.backends.cudnn.enabled, "cudnn_benchmark": torch.backends.cudnn.benchmark,
                             "cudnn_deterministic": torch.backends.cudnn.deterministic}
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", not torch.backends.cudnn.allow_tf32)
    assert codec.describe()["numerics"]["tf32_cudnn"] == torch.backends.cudnn.allow_tf32 != d["numerics"]["tf32_cudnn"]
    # the same tensors in two shards hash alike; another seed of the same config does not
    from transformers import DacModel
    DacModel.from_pretrained(str(tiny_models / "dac-tiny")).save_pretrained(str(tmp_path / "sharded"), max_shard_size="1MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert checkpoint_sha256(tmp_path / "sharded") == d["checkpoint_sha256"]
    other, _ = build("dac", tmp_path / "seed1", seed=1)
    assert checkpoint_sha256(other) != d["checkpoint_sha256"]


# ---- the encoders' weights -----------------------------------------------------------------------------------

def test_codes_of_a_codec_of_other_weights_are_refused_and_train_when_asked(stage_one, M, train, tmp_path):
    """A cache encoded by a Higgs audio tokenizer of the same config and other weights: refused naming
    ``codec.weights`` (and nothing else: name, rate, codebooks, bandwidth, dtype all agree) with both
    hashes; its own codec's cache fits; with --model.allow_other_encoder_weights it trains, and each
    checkpoint records the option and the item it accepted."""
    from shardcache.weights import checkpoint_sha256
    own, other = _higgs_cache(stage_one, M, "h-own"), _higgs_cache(stage_one, M, "h-other", "codec_other")
    mine, theirs = checkpoint_sha256(M["codec"]), checkpoint_sha256(M["codec_other"])
    assert Cache.open(other).codec.weights == theirs != mine
    items, line = _refused(*train(other, tmp_path / "a", *_higgs(M)))
    assert items == ["codec.weights"], line
    where = f"(read from {M['codec'].resolve()})"
    assert f"codec.weights: the cache has '{theirs}' (read from {M['codec_other'].resolve()}), the model needs '{mine}' " \
        f"{where}" in line
    assert "--model.allow_other_encoder_weights" in line
    assert train(own, tmp_path / "own", *_higgs(M), "--dry_run")[0] == 0
    rc, err = train(other, tmp_path / "b", *_higgs(M), "--model.allow_other_encoder_weights", "true", build=True)
    assert rc == 0, err[-3000:]
    cfg = json.loads((tmp_path / "b" / "step-1" / "config.json").read_text())
    assert cfg["model"]["allow_other_encoder_weights"] is True
    assert cfg["contract"] == {"waived": [{"item": "codec.weights", "cache": theirs, "model": mine}]}


def test_features_of_a_tower_of_other_weights_are_refused_and_train_when_asked(stage_one, M, train, tmp_path):
    """image_features from the vision tower of another Gemma 3 (same config and tokenizer, other weights):
    refused naming ``feature_encoder.weights``, the tower's hash taken from the recipe's own checkpoint; with
    the option it trains, recorded. Its checkpoints record the projection's architecture, so the same file
    given as ``projection_checkpoint`` is told from the other MLP (its keys cannot be): naming the other
    one is refused, naming none loads it as recorded."""
    from shardcache.weights import GEMMA3_VISION, checkpoint_sha256, under
    from train.recipes.theworld import ARCH_KEY, projection_architecture
    cache = _world_cache(stage_one, M, "w-other-tower", f"image_features.pretrained={M['gemma3_other']}")
    mine = checkpoint_sha256(M["gemma3"], select=under(*GEMMA3_VISION))
    theirs = checkpoint_sha256(M["gemma3_other"], select=under(*GEMMA3_VISION))
    assert Cache.open(cache).feature_encoder.weights == theirs != mine
    kw = {"image_size": IMAGE_SIZE, "projection_architecture": "mlp_no_final_gelu"}
    items, line = _refused(*train(cache, tmp_path / "a", *_world(M, **kw)))
    assert items == ["feature_encoder.weights"], line
    rc, err = train(cache, tmp_path / "b", *_world(M, **kw), "--model.allow_other_encoder_weights", "true", build=True)
    assert rc == 0, err[-3000:]
    cfg = json.loads((tmp_path / "b" / "step-1" / "config.json").read_text())
    assert cfg["contract"] == {"waived": [{"item": "feature_encoder.weights", "cache": theirs, "model": mine}]}
    weights = tmp_path / "b" / "step-1" / "model.safetensors"
    from safetensors import safe_open
    with safe_open(str(weights), "pt") as f:
        assert f.metadata()[ARCH_KEY] == "mlp_no_final_gelu"
    assert projection_architecture(weights) == ("mlp_no_final_gelu", "mlp")
    with pytest.raises(ValueError, match="projection_architecture is mlp, but .*header says projection_archi"):
        projection_architecture(weights, "mlp")


# ---- the whole image preset ------------------------------------------------------------------------------------

def test_latents_at_image_size_256_are_refused_for_the_512_preset(stage_one, M, train, tmp_path):
    cache = _world_cache(stage_one, M, "w-256", "image_size=256")
    items, line = _refused(*train(cache, tmp_path / "a", *_world(M)))
    assert items == ["image.size"], line
    assert "image.size: the cache has 256, the model needs 512" in line


def test_cosmos_latents_are_refused_for_the_wan_preset(stage_one, M, train, tmp_path):
    """Cosmos 1.0 latents (16 channels, like Wan's) for TheWorld's Wan preset: refused by the VAE's name
    (and its compute dtype: AutoencoderKLCosmos runs float32 on a CPU; and its weights, not the Wan VAE's)."""
    cache = _world_cache(stage_one, M, "w-cosmos", f"image_encoder={{name: cosmos, pretrained: {M['cosmos']}}}",
                         "encoder_dtype=float32")
    assert Cache.open(cache).image.latent_channels == 16
    items, line = _refused(*train(cache, tmp_path / "a", *_world(M, image_size=IMAGE_SIZE)))
    assert items == ["image.encoder", "image.dtype", "image.weights"], line
    assert "image.encoder: the cache has 'cosmos', the model needs 'wan'" in line


# ---- template and labels ----------------------------------------------------------------------------------------

def test_a_higgs_cache_of_another_label_policy_is_refused_where_its_labels_are_read(stage_one, M, train, tmp_path):
    """``labels: targets`` trains on the cached labels: another label policy is refused by name. The default
    ``labels: processor`` makes its labels from the ids as the processor does and never reads the cached ones
    (``HiggsBatch.fields_read``): the same cache fits."""
    cache = _higgs_cache(stage_one, M, "h-labels", "codec", "label_policy=all_but_world")
    targets = ["--model.kwargs", json.dumps({"lm": str(M["higgs"]), "labels": "targets"})]
    items, line = _refused(*train(cache, tmp_path / "a", *_higgs(M), *targets))
    assert items == ["label_policy"], line
    assert "label_policy: the cache has 'all_but_world', the model needs 'answers'" in line
    rc, err = train(cache, tmp_path / "b", *_higgs(M), "--dry_run")
    assert rc == 0, err


def test_a_theworld_cache_of_another_template_is_refused(stage_one, M, train, tmp_path):
    """The preset renders with TheWorld's collate (``theworld``); Gemma's own template (``auto``) writes one
    more newline after each image: refused by name, and accepted when the model says so."""
    cache = _world_cache(stage_one, M, "w-template", "chat_template=auto")
    items, line = _refused(*train(cache, tmp_path / "a", *_world(M, image_size=IMAGE_SIZE)))
    assert items == ["chat_template"], line
    assert "chat_template: the cache has 'tokenizer', the model needs 'theworld'" in line
    rc, err = train(cache, tmp_path / "b", *_world(M, image_size=IMAGE_SIZE, chat_template="tokenizer"), "--dry_run")
    assert rc == 0, err


# ---- the tokenizer always ----------------------------------------------------------------------------------------

def test_a_checkpoint_without_tokenizer_files_needs_its_tokenizer_named(stage_one, M, train, tmp_path):
    """Without tokenizer files the text tokenizer is never "any": refused naming ``text_tokenizer`` and
    what to give (``model.kwargs.tokenizer``); named, the cache fits."""
    bare = tmp_path / "higgs-no-tokenizer"
    bare.mkdir()
    for f in M["higgs"].iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (bare / f.name).symlink_to(f)
    cache = _higgs_cache(stage_one, M, "h-own")
    flags = ["--model.name", "higgs", "--model.audio_tokenizer", str(M["codec"]), "--model.kwargs"]
    items, line = _refused(*train(cache, tmp_path / "a", *flags, json.dumps({"lm": str(bare)})))
    assert items == ["text_tokenizer"], line
    assert "ships no tokenizer files" in line and "model.kwargs.tokenizer" in line
    rc, err = train(cache, tmp_path / "b", *flags, json.dumps({"lm": str(bare), "tokenizer": str(M["higgs"])}),
                    "--dry_run")
    assert rc == 0, err


# ---- adapters ------------------------------------------------------------------------------------------------------

def test_lora_adapters_of_another_rank_or_alpha_are_refused(demo_cache, train, tmp_path):
    """adapter.json records the LoRA options; --model.init_from and resuming compare them with the run's
    before any weight loads: another r (whose tensors would not fit) and another alpha at the same r (which
    would load and scale the adapters otherwise) are refused by name; the same options train."""
    ref = ["--model.kwargs", json.dumps({"d_model": 32, "n_layers": 1, "n_heads": 2}), "--lora.enabled", "true"]
    rc, err = train(demo_cache, tmp_path / "src", *ref, "--lora.r", "4", "--lora.alpha", "8", build=True)
    assert rc == 0, err[-3000:]
    src = tmp_path / "src" / "step-1"
    assert json.loads((src / "adapter.json").read_text())["lora"] == {
        "r": 4, "alpha": 8, "dropout": 0.0, "targets": ["qkv", "proj", "fc1", "fc2"]}
    init = ["--model.init_from", str(src)]
    items, line = _refused(*train(demo_cache, tmp_path / "r", *ref, *init, "--lora.r", "8", "--lora.alpha", "8"))
    assert items == ["lora.r"] and "lora.r: the adapter has 4, the run has 8" in line
    items, line = _refused(*train(demo_cache, tmp_path / "a", *ref, *init, "--lora.r", "4", "--lora.alpha", "16"))
    assert items == ["lora.alpha"] and "lora.alpha: the adapter has 8, the run has 16" in line
    assert _refused(*train(demo_cache, tmp_path / "d", *ref, *init, "--lora.r", "8", "--lora.alpha", "8",
                           "--dry_run"))[0] == ["lora.r"]
    items, _ = _refused(*train(demo_cache, tmp_path / "src", *ref, "--checkpoint.resume", "auto", "--lora.r", "2",
                               "--lora.alpha", "8", "--training.steps", "2"))
    assert items == ["lora.r"]
    rc, err = train(demo_cache, tmp_path / "ok", *ref, *init, "--lora.r", "4", "--lora.alpha", "8", build=True)
    assert rc == 0, err[-3000:]


# ---- every model has a spec ----------------------------------------------------------------------------------

def test_a_plain_factory_gets_a_spec_with_a_contract_the_user_fills(demo_cache, train, tmp_path):
    """``module:factory`` is wrapped once into the spec a recipe has: it reads every field, the generic
    LoRA, the trainer's groups, and an empty contract; ``--model.contract`` fills it (refused by name on a
    cache that does not meet it); a contract item it does not know is a bad option."""
    from train.spec import model_spec
    spec = model_spec("test_train_support:make_mean_codes")
    assert (spec.fields, spec.optional_fields, spec.default_checkpoint) == ((), (), None)
    assert spec.contract({}).items() == {}
    flags = ["--model.name", "test_train_support:make_mean_codes"]
    assert train(demo_cache, tmp_path / "a", *flags, "--dry_run")[0] == 0
    items, line = _refused(*train(demo_cache, tmp_path / "b", *flags, "--model.contract",
                                  json.dumps({"fields": ["codes"], "codec": {"name": "higgs", "n_codebooks": 8}})))
    assert items == ["codec.name"] and "the cache has 'dac', the model needs 'higgs'" in line
    rc, err = train(demo_cache, tmp_path / "c", *flags, "--model.contract", json.dumps({"codec": {"rate": 1}}))
    assert rc == 2 and "model.contract" in err and "codec.rate" in err


def test_each_recipe_sets_exactly_the_items_it_declares(M):
    """A recipe's ``contract_items`` (the generated contract table of docs/training.md) are the items its
    contract sets from the real (tiny) checkpoints: the docs cannot claim a check that is not made, nor
    miss one that is."""
    from train.models import run_contract
    from train.spec import model_spec
    kwargs = {"reference": {}, "tts": {"audio_out_token_id": 3}, "vlm": {},
              "higgs": {"lm": str(M["higgs"]), "labels": "targets"},   # (labels: processor reads no cached labels)
              "theworld": {"lm": str(M["gemma3"]), "vae": str(M["wan"])}}
    for name, kw in kwargs.items():
        spec = model_spec(name)
        got = run_contract(name, kw, str(M["codec"]) if name == "higgs" else "", spec=spec).items()
        assert set(got) == set(spec.builds.contract_items), (name, set(got) ^ set(spec.builds.contract_items))


def test_no_is_recipe_branch_and_no_import_cycle_dodged_in_train():
    """``grep -rn is_recipe train/`` is empty; no module of train/recipes, models, spec, lora, checkpoint,
    data, optim or trainer imports another train module inside a function (the cycle train/models <->
    train/recipes/base was held by 7 such imports)."""
    train = ROOT / "train"
    assert not [p for p in train.rglob("*.py") if "is_recipe" in p.read_text()]
    bad = []
    for p in [*train.joinpath("recipes").glob("*.py"), *(train / f"{m}.py" for m in (
            "models", "spec", "lora", "imports", "checkpoint", "data", "optim", "trainer"))]:
        for fn in (n for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("train")):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno} {fn.name}")
    assert not bad, bad
