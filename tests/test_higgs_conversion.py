"""docs/higgs-audio.md section 1: the conversion recipe, run as the docs write it, offline, against a local
stand-in of Boson's checkpoint in a pre-populated Hugging Face cache.

The conversion script (``convert_higgs_audio_v2_to_hf.py``) ships in neither the ``transformers`` wheel
nor its sdist: the tests take it from ``$HIGGS_CONVERT_SCRIPT`` (the file of your installed version's
GitHub tag) and skip, saying so, without it. Nothing is fetched: every hub read is offline
(``HF_HUB_OFFLINE=1``) from a temporary ``HF_HUB_CACHE``.

The hub cache holds, at the revisions the docs name, ``bosonai/higgs-audio-v2-generation-3B-base`` (a
stand-in in Boson's layout: ``model_type: higgs_audio``, sharded safetensors with Boson's key names, the
text tokenizer files) and ``eustlb/higgs-audio-v2-tokenizer`` (``refs/main``: the tiny random
``HiggsAudioV2TokenizerModel``).

- ``test_documented_conversion_to_a_reloadable_checkpoint`` (end to end): the stand-in is written by
  Boson's own code (``boson_multimodal`` 0.1.1 in its venv, conftest's ``boson_python``: skipped where
  that venv is not built; ``tests/boson_check.py checkpoint``): a tiny
  ``HiggsAudioModel`` with the sizes of ``models/higgs-tiny``, its text embedding and text head split into
  Boson's ``PartiallyFrozenEmbedding``/``PartiallyFrozenLinear`` (``freeze_llm``/``freeze_text_head``) and
  its audio head wrapped in ``PartiallyFrozenLinear`` (0.1.1 has no method for that one; the script
  merges it), every weight random, ``save_pretrained`` in 6 shards. The script always builds
  ``HiggsAudioV2Config(codebook_size=1026)`` with the 3B defaults, so its run gets a ``sitecustomize``
  (on the ``PYTHONPATH`` of that one process) that replaces ``transformers.HiggsAudioV2Config`` by a
  subclass whose defaults are the tiny model's sizes (vocabulary, hidden, intermediate, layers, heads,
  head dim) and, because the 3B ids (128001, 128016, ...) lie outside a 320-token vocabulary, the tiny
  tokenizer's special-token ids; same ``model_type``, nothing else changed; the script and the
  documented command are run unchanged. Asserted: the three documented lines run; the written
  checkpoint holds exactly the weights the test computes from Boson's files by Boson's rules (frozen
  rows then trainable rows for the embedding and both heads, ``audio_codebook_embeddings`` ->
  ``model.embed_audio_tokens.embed_audio_tokens``, ``model.`` before the LM's own weights, the heads at
  the top), with those values; ``HiggsAudioV2ForConditionalGeneration.from_pretrained`` reloads them,
  every parameter accounted for (none left at its random initialisation), and
  ``HiggsAudioV2Processor.from_pretrained`` loads the processor; shardcache's ``--model.name higgs`` builds
  from the converted directory (its contract against a cache of the tiny models, then its own load
  path, which gives those weights) and trains one step, while the unconverted stand-in is refused with
  the conversion advice.
- ``test_documented_conversion_with_the_real_3b_config``: the script as is, with its real 3B config, on
  a hand-written stand-in holding only small tensors of real shape (norms) and keys the script drops:
  it reads everything at the documented ids and revisions, and stops only at ``save_pretrained`` on the
  weights the stand-in lacks; the keys it holds land on ``transformers``' names with their values.

Not covered: the released weights, the real 3B shapes end to end, the network download itself.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import transformers

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "higgs-audio.md"
SCRIPT_IN_TREE = "src/transformers/models/higgs_audio_v2/convert_higgs_audio_v2_to_hf.py"
MODEL_REPO = "bosonai/higgs-audio-v2-generation-3B-base"
TOKENIZER_REPO = "eustlb/higgs-audio-v2-tokenizer"
HIDDEN = 3072                   # HiggsAudioV2Config()'s hidden_size: the shape the script's model expects
#: the HiggsAudioV2Config fields the sitecustomize gives the tiny model's values (sizes, then token ids)
TINY_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim")
TINY_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "audio_token_id", "audio_bos_token_id",
            "audio_delay_token_id")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def conversion_script() -> Path:
    """``$HIGGS_CONVERT_SCRIPT``, or skip."""
    given = os.environ.get("HIGGS_CONVERT_SCRIPT")
    if not given:
        pytest.skip(f"convert_higgs_audio_v2_to_hf.py ships in neither the wheel nor the sdist of transformers "
                    f"{transformers.__version__}: set HIGGS_CONVERT_SCRIPT to the file ({SCRIPT_IN_TREE}) of your "
                    f"installed version's GitHub tag (v{transformers.__version__})")
    assert Path(given).is_file(), f"HIGGS_CONVERT_SCRIPT={given} is not a file"
    return Path(given)


def _documented_commands() -> list[str]:
    """The commands of section 1's bash block, line continuations joined."""
    text = DOCS.read_text()
    section = text.split("## 1.", 1)[1].split("\n## 2.", 1)[0]
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "convert_higgs_audio_v2_to_hf.py" in b]
    assert len(blocks) == 1, "docs/higgs-audio.md section 1 has no bash block with the conversion command"
    joined = re.sub(r"\\\s*\n\s*", " ", blocks[0])
    commands = [line.strip() for line in joined.splitlines() if line.strip()]
    assert [c.split()[0] for c in commands] == ["hf", "hf", "python"], commands
    return commands


def _snapshot(hub: Path, repo: str, revision: str, ref: str | None = None) -> Path:
    d = hub / ("models--" + repo.replace("/", "--"))
    snap = d / "snapshots" / revision
    snap.mkdir(parents=True)
    if ref:
        (d / "refs").mkdir()
        (d / "refs" / ref).write_text(revision)
    return snap


def _documented_revision(commands: list[str]) -> str:
    """The model revision the docs download (the script's ``--input_revision`` default must match it)."""
    dl = [c for c in commands if MODEL_REPO in c and c.startswith("hf download")]
    assert dl, f"the docs do not download {MODEL_REPO}"
    return shlex.split(dl[0])[shlex.split(dl[0]).index("--revision") + 1]


@pytest.fixture
def hub_cache(tmp_path, higgs_models):
    """``(hub cache, env, empty snapshot of Boson's repo)``: the tiny audio tokenizer as
    ``eustlb/higgs-audio-v2-tokenizer@main``; the model snapshot, at the documented revision, holds the
    text tokenizer files only (each test writes its stand-in's weights and config)."""
    hub = tmp_path / "hub"
    snap = _snapshot(hub, MODEL_REPO, _documented_revision(_documented_commands()))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(higgs_models / "higgs-tiny" / name, snap / name)
    tok = _snapshot(hub, TOKENIZER_REPO, "0" * 40, ref="main")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(higgs_models / "higgs-audio-tokenizer-tiny" / name, tok / name)
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               PATH=os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))))
    env.pop("HF_HOME", None)
    return hub, env, snap


def _argv(command: str, script: Path, out: Path) -> list[str]:
    """A documented command as it runs here: ``python`` is this interpreter, the script the given file,
    ``/ckpt/higgs-v2`` a temporary directory; nothing else changed."""
    argv = shlex.split(command)
    if argv[:2] == ["python", "convert_higgs_audio_v2_to_hf.py"]:
        argv[:2] = [sys.executable, str(script)]
    return [str(out) if a == "/ckpt/higgs-v2" else a for a in argv]


def _run_documented(script: Path, hub: Path, env: dict, out: Path) -> subprocess.CompletedProcess:
    """The two downloads (each must find its snapshot in ``hub``), then the conversion's result."""
    commands = _documented_commands()
    for command in commands[:2]:
        r = subprocess.run(_argv(command, script, out), env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{command}\n{r.stdout}\n{r.stderr}"
        assert str(hub) in r.stdout, r.stdout
    return subprocess.run(_argv(commands[2], script, out), env=env, capture_output=True, text=True, timeout=300)


# -- end to end, on a stand-in written by Boson's code -----------------------------------------------------

SITECUSTOMIZE = '''"""Written by tests/test_higgs_conversion.py: transformers.HiggsAudioV2Config with the tiny model's
sizes (and the token ids its 320-token vocabulary needs) as defaults. Only those defaults change."""
import transformers

_TINY = {tiny!r}
_Real = transformers.HiggsAudioV2Config


class HiggsAudioV2Config(_Real):
    def __init__(self, **kwargs):
        super().__init__(**{{**_TINY, **kwargs}})


transformers.HiggsAudioV2Config = HiggsAudioV2Config
'''


def _boson_spec(tiny: dict, tokenizer_dir: Path) -> dict:
    """Boson's ``HiggsAudioConfig`` of the tiny transformers model (``tests/boson_check.py checkpoint``).

    Correspondences: the LM's sizes sit in Boson's ``text_config`` (a Llama config); every transformers
    decoder layer has the audio FFN and norms, Boson's ``dual_ffn_fast_forward`` layers listed in
    ``audio_dual_ffn_layers`` have them (``audio_mlp`` is a ``LlamaMLP`` of ``text_config``); Boson's
    ``audio_codebook_size`` counts the codes without the stream BOS/EOS it adds (1024 + 2 = the script's
    ``codebook_size`` 1026); ``audio_out_token_idx``/``audio_out_bos_token_id`` are transformers'
    ``audio_token_id``/``audio_bos_token_id``; no Whisper tower (``skip_audio_tower``), as the 3B model."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tiny["codebook_size"] == 1026 and tiny["audio_stream_bos_id"] == 1024
    text = {k: tiny[k] for k in TINY_SIZES + ("rms_norm_eps",)}
    return {"config": {
        "text_config": {"model_type": "llama", **text}, "audio_adapter_type": "dual_ffn_fast_forward",
        "audio_dual_ffn_layers": list(range(tiny["num_hidden_layers"])), "use_audio_out_self_attention": False,
        "audio_decoder_proj_num_layers": 0, "skip_audio_tower": True, "encode_whisper_embed": False,
        "use_delay_pattern": True, "audio_num_codebooks": tiny["num_codebooks"],
        "audio_codebook_size": tiny["audio_stream_bos_id"], "audio_stream_bos_id": tiny["audio_stream_bos_id"],
        "audio_stream_eos_id": tiny["audio_stream_eos_id"], "audio_out_token_idx": tiny["audio_token_id"],
        "audio_out_bos_token_id": tiny["audio_bos_token_id"], "pad_token_id": tiny["pad_token_id"],
        "audio_in_token_idx": tok.convert_tokens_to_ids("<|AUDIO|>"),
        "audio_eos_token_id": tok.convert_tokens_to_ids("<|audio_eos|>")},
        # the frozen rows: the base vocabulary (the tiny tokenizer's special tokens start at its BOS);
        # the audio head: its first half of the codebooks
        "freeze_until": tiny["bos_token_id"], "freeze_audio_head_until": tiny["codebook_size"] * 4,
        "max_shard_size": "300KB"}


def _boson_rules(boson: dict) -> dict:
    """The converted state dict, computed here from Boson's tensors: each split module is its frozen rows
    followed by its trainable rows (Boson's ``PartiallyFrozen*.to_unsplit``); the LM's weights get
    ``model.``, the audio codebook embedding becomes ``model.embed_audio_tokens.embed_audio_tokens``, the
    heads leave ``audio_decoder_proj``."""
    import torch
    b = dict(boson)
    want = {}
    for split, name in (("embed_tokens.embedding_{}.weight", "model.embed_tokens.weight"),
                        ("audio_decoder_proj.text_lm_head.linear_{}.weight", "text_lm_head.weight"),
                        ("audio_decoder_proj.audio_lm_head.linear_{}.weight", "audio_lm_head.weight")):
        want[name] = torch.cat([b.pop(split.format("frozen")), b.pop(split.format("trainable"))], dim=0)
    want["model.embed_audio_tokens.embed_audio_tokens.weight"] = b.pop("audio_codebook_embeddings.weight")
    for key, tensor in b.items():
        assert key.startswith("layers.") or key == "norm.weight", key
        want["model." + key] = tensor
    return want


def _same_weights(got: dict, want: dict, what: str) -> None:
    import torch
    assert set(got) == set(want), (f"{what}: missing {sorted(set(want) - set(got))}, "
                                   f"extra {sorted(set(got) - set(want))}")
    differ = [k for k in want if got[k].shape != want[k].shape or not torch.equal(got[k].cpu(), want[k])]
    assert not differ, f"{what}: not Boson's values: {differ}"


def test_documented_conversion_to_a_reloadable_checkpoint(conversion_script, boson_python, hub_cache, higgs_models,
                                                          higgs_caches, tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, HiggsAudioV2ForConditionalGeneration

    hub, env, snap = hub_cache
    tiny = json.loads((higgs_models / "higgs-tiny" / "config.json").read_text())
    # the stand-in, by Boson's code, with Boson's key names
    (tmp_path / "spec.json").write_text(json.dumps(_boson_spec(tiny, higgs_models / "higgs-tiny")))
    r = subprocess.run([boson_python, str(ROOT / "tests" / "boson_check.py"), "checkpoint", str(snap),
                        str(tmp_path / "spec.json")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    boson = {}
    for f in sorted(snap.glob("*.safetensors")):
        boson.update(load_file(str(f)))
    assert set(boson) == set(json.loads(r.stdout.strip().splitlines()[-1]))
    assert len(list(snap.glob("model-*-of-*.safetensors"))) > 1
    assert {"embed_tokens.embedding_frozen.weight", "audio_decoder_proj.text_lm_head.linear_trainable.weight",
            "audio_decoder_proj.audio_lm_head.linear_frozen.weight"} <= set(boson)    # the split is on
    assert json.loads((snap / "config.json").read_text())["model_type"] == "higgs_audio"

    # the documented commands, unchanged; the script's config class has the tiny sizes
    site = tmp_path / "site"
    site.mkdir()
    sizes = {k: tiny[k] for k in TINY_SIZES + TINY_IDS}
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(tiny=sizes))
    env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p))
    out = tmp_path / "higgs-v2"
    r = _run_documented(conversion_script, hub, env, out)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    assert f"Model and processor saved to {out}" in r.stdout, log
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "higgs_audio_v2" and config["codebook_size"] == 1026
    assert {k: config[k] for k in sizes} == sizes, "the sitecustomize did not reach the script"

    # written: exactly Boson's weights under Boson's rules
    want = _boson_rules(boson)
    written = {}
    for f in sorted(out.glob("*.safetensors")):
        written.update(load_file(str(f)))
    _same_weights(written, want, "written checkpoint")

    # reloaded: every parameter is one of them (none left randomly initialised)
    model, info = HiggsAudioV2ForConditionalGeneration.from_pretrained(out, use_text_head=True,
                                                                       output_loading_info=True)
    assert not any(info.values()), info
    _same_weights(dict(model.named_parameters()), want, "reloaded model")
    plain = HiggsAudioV2ForConditionalGeneration.from_pretrained(out)          # the docs' load: no text head
    assert plain.text_lm_head is None
    _same_weights(dict(plain.named_parameters()), {k: v for k, v in want.items() if k != "text_lm_head.weight"},
                  "reloaded model without its text head")
    assert torch.equal(model.model.embed_audio_tokens.audio_tokens_offsets, torch.arange(8) * 1026)
    # the processor (its audio tokenizer is read from the hub cache by id: a process with the same env)
    check = ("from transformers import HiggsAudioV2Processor as P\n"
             f"p = P.from_pretrained({str(out)!r})\n"
             "print(type(p.audio_tokenizer).__name__, p.audio_token, len(p.tokenizer), bool(p.chat_template))")
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    n_tokens = len(AutoTokenizer.from_pretrained(higgs_models / "higgs-tiny"))
    assert r.stdout.split()[-4:] == ["HiggsAudioV2TokenizerModel", "<|AUDIO_OUT|>", str(n_tokens), "True"], r.stdout

    # shardcache's --model.name higgs: the converted directory is its checkpoint (contract against a cache of the
    # tiny models, its own load path: Boson's weights); Boson's own directory is refused with the advice
    from test_train_support import Captured
    from test_train_support import config_from_dict as from_dict
    from train.models import build_model
    from train.trainer import run
    cache, _ = higgs_caches["voice_clone"]
    recipe = build_model("higgs", {"lm": str(out)}, cache)
    _same_weights(dict(recipe.lm.named_parameters()), want, "the recipe's model")
    with pytest.raises(ValueError, match="Boson's own format.*convert_higgs_audio_v2_to_hf"):
        build_model("higgs", {"lm": str(snap)}, cache)
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cfg = from_dict({"data": {"cache": str(cache), "batch_size": 2},
                     "model": {"name": "higgs", "kwargs": {"lm": str(out)}}, "training": {"steps": 1},
                     "job": {"dir": str(tmp_path / "run")}, "metrics": {"progress": False}, "dist": {"threads": 1}})
    with Captured() as log:
        assert run(cfg) == 0
    done = re.search(r"done: step 1 of 1 .*last loss ([^;]+);", log.text)
    assert done and float(done[1]) < float("inf"), log.text[-2000:]                       # a finite loss


# -- the real 3B config ------------------------------------------------------------------------------------

def test_documented_conversion_with_the_real_3b_config(conversion_script, hub_cache, tmp_path):
    import torch
    from safetensors.torch import save_file

    hub, env, snap = hub_cache
    (snap / "config.json").write_text(json.dumps({"model_type": "higgs_audio", "architectures": ["HiggsAudioModel"]}))
    g = torch.Generator().manual_seed(0)
    weights = {"norm.weight": torch.rand(HIDDEN, generator=g),                   # Boson's names
               "layers.0.input_layernorm.weight": torch.rand(HIDDEN, generator=g),
               "layers.1.post_attention_layernorm.weight": torch.rand(HIDDEN, generator=g),
               "audio_codebook_weights": torch.ones(8),                          # dropped by the script
               "layers.0.self_attn.rotary_emb.inv_freq": torch.ones(64)}
    save_file(dict(list(weights.items())[:2]), str(snap / "model-00001-of-00002.safetensors"))
    save_file(dict(list(weights.items())[2:]), str(snap / "model-00002-of-00002.safetensors"))
    out = tmp_path / "higgs-v2"
    r = _run_documented(conversion_script, hub, env, out)
    log = r.stdout + r.stderr
    # everything read from the cache at the documented ids and revisions, then the model built
    assert "Model converted successfully." in r.stdout, log
    assert "Processor created successfully." in r.stdout, log
    # ... and it stops only when writing weights the stand-in does not hold (the 3B model's other tensors)
    assert r.returncode != 0 and "Cannot copy out of meta tensor" in log, log
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "higgs_audio_v2" and config["codebook_size"] == 1026
    assert config["hidden_size"] == HIDDEN

    # Boson's keys land on transformers' names with their values (the script's own functions, same cache)
    check = f"""
import importlib.util, sys, torch
from safetensors.torch import load_file
spec = importlib.util.spec_from_file_location("conv", {str(conversion_script)!r})
conv = importlib.util.module_from_spec(spec); spec.loader.exec_module(conv)
model = conv.convert_model({MODEL_REPO!r}, revision={_documented_revision(_documented_commands())!r})
sd = model.state_dict()
want = {{}}
for f in sorted(__import__("glob").glob({str(snap)!r} + "/*.safetensors")):
    want.update(load_file(f))
assert torch.equal(sd["model.norm.weight"], want["norm.weight"])
assert torch.equal(sd["model.layers.0.input_layernorm.weight"], want["layers.0.input_layernorm.weight"])
assert torch.equal(sd["model.layers.1.post_attention_layernorm.weight"], want["layers.1.post_attention_layernorm.weight"])
assert sd["model.layers.0.self_attn.q_proj.weight"].is_meta
print("keys ok")
"""
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "keys ok" in r.stdout, r.stdout + r.stderr
