"""docs/higgs-audio.md section 1: the conversion recipe, run as the docs write it, offline, against a local
stand-in of Boson's checkpoint in a pre-populated Hugging Face cache.

The conversion script (``convert_higgs_audio_v2_to_hf.py``) is not in the ``transformers`` wheel, and its
sdist on PyPI does not ship it either (checked for 5.24.0). It is taken, in this order, from
``$HIGGS_CONVERT_SCRIPT`` (a copy of the file of your installed version's tag), the sdist of the installed
version (``pip download --no-binary :all:``), or GitHub's raw file at tag ``v<version>``; the test skips,
naming what it tried, when none gives it.

The hub cache (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``) holds, at the revisions the docs name:
- ``bosonai/higgs-audio-v2-generation-3B-base``: Boson's layout (``config.json`` with ``model_type:
  higgs_audio``, a sharded safetensors file with Boson's key names, the text tokenizer files). The script
  builds the full 3B config (``HiggsAudioV2Config(codebook_size=1026)``) on the meta device and assigns
  what the files hold, so the stand-in holds only tensors of the real shapes that are small (norms) plus
  keys the script drops; every other weight stays on ``meta``.
- ``eustlb/higgs-audio-v2-tokenizer`` (``refs/main``): the tiny random ``HiggsAudioV2TokenizerModel``.

What is asserted: each documented ``hf download`` finds its snapshot; the documented conversion command
reads the model's safetensors, its text tokenizer and the audio tokenizer at the documented revisions
("Model converted successfully.", "Processor created successfully."), and stops only at
``save_pretrained``, on the weights the stand-in lacks; Boson's keys land on the transformers names with
their values. Not covered: the merge of Boson's partially frozen embedding/heads (full-size tensors),
writing and reloading the converted 3B model, the network download itself.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest

import transformers

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "higgs-audio.md"
SCRIPT_IN_TREE = "src/transformers/models/higgs_audio_v2/convert_higgs_audio_v2_to_hf.py"
MODEL_REPO = "bosonai/higgs-audio-v2-generation-3B-base"
TOKENIZER_REPO = "eustlb/higgs-audio-v2-tokenizer"
HIDDEN = 3072                   # HiggsAudioV2Config()'s hidden_size: the shape the script's model expects

pytestmark = pytest.mark.slow


def _from_sdist(version: str, cache: Path) -> tuple[Path | None, str]:
    sdist = cache / f"transformers-{version}.tar.gz"
    if not sdist.exists():
        r = subprocess.run([sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary",
                            ":all:", "--no-deps", "-d", str(cache)],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0 or not sdist.exists():
            return None, f"pip download of the sdist failed ({r.stderr.strip().splitlines()[-1:]})"
    member = f"transformers-{version}/{SCRIPT_IN_TREE}"
    with tarfile.open(sdist) as tar:
        try:
            data = tar.extractfile(member).read()
        except KeyError:
            return None, f"the sdist {sdist.name} does not ship {SCRIPT_IN_TREE}"
    out = cache / "convert_higgs_audio_v2_to_hf.py"
    out.write_bytes(data)
    return out, ""


def _from_github(version: str, cache: Path) -> tuple[Path | None, str]:
    url = f"https://raw.githubusercontent.com/huggingface/transformers/v{version}/{SCRIPT_IN_TREE}"
    try:
        data = urllib.request.urlopen(url, timeout=15).read()
    except OSError as e:
        return None, f"{url}: {e}"
    out = cache / "convert_higgs_audio_v2_to_hf.py"
    out.write_bytes(data)
    return out, ""


@pytest.fixture(scope="session")
def conversion_script(tmp_path_factory) -> Path:
    """The installed ``transformers``' conversion script, fetched once per session (or skip, saying why)."""
    given = os.environ.get("HIGGS_CONVERT_SCRIPT")
    if given:
        assert Path(given).is_file(), f"HIGGS_CONVERT_SCRIPT={given} is not a file"
        return Path(given)
    cache = tmp_path_factory.mktemp("transformers-src")
    tried = []
    for source in (_from_sdist, _from_github):
        try:
            path, why = source(transformers.__version__, cache)
        except (OSError, subprocess.TimeoutExpired) as e:
            path, why = None, f"{source.__name__}: {e}"
        if path is not None:
            return path
        tried.append(why)
    pytest.skip("convert_higgs_audio_v2_to_hf.py of transformers " + transformers.__version__
                + " not obtained: " + "; ".join(tried) + " (set HIGGS_CONVERT_SCRIPT to a copy of the file)")


def _documented_commands() -> list[str]:
    """The commands of section 1's bash block, line continuations joined."""
    text = DOCS.read_text()
    section = text.split("## 1.", 1)[1].split("\n## 2.", 1)[0]
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "convert_higgs_audio_v2_to_hf.py" in b]
    assert len(blocks) == 1, "docs/higgs-audio.md section 1 has no bash block with the conversion command"
    joined = re.sub(r"\\\s*\n\s*", " ", blocks[0])
    return [line.strip() for line in joined.splitlines() if line.strip()]


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
def boson_hub(tmp_path, higgs_models):
    """A Hugging Face hub cache holding a stand-in of Boson's checkpoint and the tiny audio tokenizer."""
    import torch
    from safetensors.torch import save_file

    hub = tmp_path / "hub"
    snap = _snapshot(hub, MODEL_REPO, _documented_revision(_documented_commands()))
    (snap / "config.json").write_text(json.dumps({"model_type": "higgs_audio", "architectures": ["HiggsAudioModel"]}))
    g = torch.Generator().manual_seed(0)
    weights = {"norm.weight": torch.rand(HIDDEN, generator=g),                   # Boson's names
               "layers.0.input_layernorm.weight": torch.rand(HIDDEN, generator=g),
               "layers.1.post_attention_layernorm.weight": torch.rand(HIDDEN, generator=g),
               "audio_codebook_weights": torch.ones(8),                          # dropped by the script
               "layers.0.self_attn.rotary_emb.inv_freq": torch.ones(64)}
    save_file(dict(list(weights.items())[:2]), str(snap / "model-00001-of-00002.safetensors"))
    save_file(dict(list(weights.items())[2:]), str(snap / "model-00002-of-00002.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(higgs_models / "higgs-tiny" / name, snap / name)
    tok = _snapshot(hub, TOKENIZER_REPO, "0" * 40, ref="main")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(higgs_models / "higgs-audio-tokenizer-tiny" / name, tok / name)
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               PATH=os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", ""))))
    env.pop("HF_HOME", None)
    return hub, env, weights


def _argv(command: str, script: Path, out: Path) -> list[str]:
    """A documented command as it runs here: ``python`` is this interpreter, the script the fetched file,
    ``/ckpt/higgs-v2`` a temporary directory; nothing else changed."""
    argv = shlex.split(command)
    if argv[:2] == ["python", "convert_higgs_audio_v2_to_hf.py"]:
        argv[:2] = [sys.executable, str(script)]
    return [str(out) if a == "/ckpt/higgs-v2" else a for a in argv]


def test_documented_conversion_runs_offline_on_a_local_stand_in(conversion_script, boson_hub, tmp_path):
    hub, env, weights = boson_hub
    out = tmp_path / "higgs-v2"
    commands = _documented_commands()
    assert [c.split()[0] for c in commands] == ["hf", "hf", "python"], commands
    for command in commands[:2]:
        r = subprocess.run(_argv(command, conversion_script, out), env=env, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, f"{command}\n{r.stdout}\n{r.stderr}"
        assert str(hub) in r.stdout, r.stdout
    r = subprocess.run(_argv(commands[2], conversion_script, out), env=env, capture_output=True, text=True,
                       timeout=300)
    log = r.stdout + r.stderr
    # everything read from the cache at the documented ids and revisions, then the model built
    assert "Model converted successfully." in r.stdout, log
    assert "Processor created successfully." in r.stdout, log
    # ... and it stops only when writing weights the stand-in does not hold (the 3B model's other tensors)
    assert r.returncode != 0 and "Cannot copy out of meta tensor" in log, log
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "higgs_audio_v2" and config["codebook_size"] == 1026

    # Boson's keys land on transformers' names with their values (the script's own functions, same cache)
    check = f"""
import importlib.util, sys, torch
from safetensors.torch import load_file
spec = importlib.util.spec_from_file_location("conv", {str(conversion_script)!r})
conv = importlib.util.module_from_spec(spec); spec.loader.exec_module(conv)
model = conv.convert_model({MODEL_REPO!r}, revision={_documented_revision(commands)!r})
sd = model.state_dict()
want = {{}}
for f in sorted(__import__("glob").glob({str(hub)!r} + "/models--*3B-base/snapshots/*/*.safetensors")):
    want.update(load_file(f))
assert torch.equal(sd["model.norm.weight"], want["norm.weight"])
assert torch.equal(sd["model.layers.0.input_layernorm.weight"], want["layers.0.input_layernorm.weight"])
assert torch.equal(sd["model.layers.1.post_attention_layernorm.weight"], want["layers.1.post_attention_layernorm.weight"])
assert sd["model.layers.0.self_attn.q_proj.weight"].is_meta
print("keys ok")
"""
    r = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "keys ok" in r.stdout, r.stdout + r.stderr
