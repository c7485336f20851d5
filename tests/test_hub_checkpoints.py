"""Issue 47: real checkpoints as users have them, hashed as the loading library loads them, refused by name.

Every checkpoint here is a tiny model ``save_pretrained`` into a folder, then laid out as the hub cache holds
it (:mod:`tools.testing.hub_cache`: blobs named by their etag, relative links from ``snapshots/<commit>/``,
``refs/main``; checked against ``huggingface_hub``'s own cache API first) and read with ``HF_HUB_OFFLINE=1``
through its hub id, as a user's first run reads ``google/gemma-3-4b-it``: the Higgs codec and LM, the Gemma 3
model (its tower for stage one's features), the Wan VAE in the ``vae/`` subfolder of a pipeline, a tokenizer.
Expected hashes are computed here from the files' tensors (:func:`_tensor_sha256`), which file a library
loaded from the values it loaded.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, _absolute
from shards import Cache, ContractMismatch
from tools.testing import build
from tools.testing.hub_cache import blob_of, offline, put, repo_folder

VOICE, WORLD = "chatml_voice_clone.json", "llava_multiturn.json"
IMAGE_SIZE = 64


def _tensor_sha256(files: list[Path]) -> str:
    """The definition of a checkpoint's identity, computed here: for each tensor of the files in name order,
    ``name|dtype|shape|`` and its raw bytes (safetensors files, read with ``safetensors.torch.load_file``)."""
    from safetensors.torch import load_file
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=False)
    return dst


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    """An empty hub cache of this module's (``HF_HUB_CACHE``)."""
    return tmp_path_factory.mktemp("hub")


@pytest.fixture
def offline_hub(hub):
    with offline(hub):
        yield hub


# ---- the fixture is the library's layout ------------------------------------------------------------------

def test_the_fixture_is_the_layout_huggingface_hub_writes(tiny_models, hub):
    """Blobs named by their etag (sha256 of an LFS file's bytes, the git blob sha1 of a small text file),
    relative links ``../../blobs/<etag>`` (one ``../`` more in a subfolder), ``refs/main`` holding the commit:
    ``scan_cache_dir`` reports the repo, revision, ref and files without a warning, ``try_to_load_from_cache``,
    ``hf_hub_download`` (offline) and ``snapshot_download(local_files_only=True)`` find them, and
    ``from_pretrained`` loads the model by its hub id."""
    from huggingface_hub import hf_hub_download, scan_cache_dir, snapshot_download, try_to_load_from_cache
    from transformers import DacModel
    snap = put(tiny_models / "dac-tiny", "org/dac", hub)
    put(tiny_models / "wan-tiny", "org/pipeline", hub, under="vae")
    commit = snap.name
    repo = repo_folder(hub, "org/dac")
    assert re.fullmatch(r"[0-9a-f]{40}", commit) and (repo / "refs" / "main").read_text() == commit
    weights = (tiny_models / "dac-tiny" / "model.safetensors").read_bytes()
    config = (tiny_models / "dac-tiny" / "config.json").read_bytes()
    sha1 = hashlib.sha1(b"blob %d\0" % len(config) + config).hexdigest()     # git hash-object
    assert os.readlink(snap / "model.safetensors") == f"../../blobs/{hashlib.sha256(weights).hexdigest()}"
    assert os.readlink(snap / "config.json") == f"../../blobs/{sha1}"
    vae = repo_folder(hub, "org/pipeline") / "snapshots"
    (vsnap,) = vae.iterdir()
    assert os.readlink(vsnap / "vae" / "config.json").startswith("../../../blobs/")
    info = scan_cache_dir(hub)
    assert not info.warnings
    got = {r.repo_id: r for r in info.repos}
    (rev,) = got["org/dac"].revisions
    assert rev.commit_hash == commit and rev.refs == frozenset({"main"})
    assert {f.file_name for f in rev.files} == {"config.json", "model.safetensors"}
    assert {f.file_path.parent.name for f in rev.files} == {commit}
    with offline(hub):
        assert try_to_load_from_cache("org/dac", "model.safetensors") == str(snap / "model.safetensors")
        assert hf_hub_download("org/dac", "config.json") == str(snap / "config.json")
        assert hf_hub_download("org/pipeline", "config.json", subfolder="vae") == str(vsnap / "vae" / "config.json")
        assert snapshot_download("org/dac", local_files_only=True) == str(snap)
        model = DacModel.from_pretrained("org/dac")
    assert model.config.n_codebooks == 8


# ---- which files, read how ----------------------------------------------------------------------------------

def test_a_hub_id_its_snapshot_and_an_annexed_file_hash_as_the_folder(tiny_models, hub, tmp_path, offline_hub):
    """A hub id (its blobs have no suffix), its snapshot folder given as a path, and a folder whose
    ``model.safetensors`` links to a suffix-less file (git-annex, DVC): each read from the file's own header
    and hashed as the plain folder; ``loaded_from`` names the hub id and the snapshot commit, else the
    folder. (Before: ``torch.load(mmap=True)`` of the blob, ``RuntimeError``.)"""
    from shardcache.weights import checkpoint, checkpoint_sha256, file_format, loaded_files
    want = _tensor_sha256([tiny_models / "dac-tiny" / "model.safetensors"])
    snap = put(tiny_models / "dac-tiny", "org/dac", hub)
    assert file_format(blob_of(snap, "model.safetensors")) == "safetensors"
    annexed = tmp_path / "annexed"
    (annexed / ".git" / "annex").mkdir(parents=True)
    shutil.copy(tiny_models / "dac-tiny" / "config.json", annexed)
    key = annexed / ".git" / "annex" / ("SHA256-s1--" + "a" * 64)   # a content key: no suffix
    shutil.copy(tiny_models / "dac-tiny" / "model.safetensors", key)
    (annexed / "model.safetensors").symlink_to(os.path.relpath(key, annexed))
    for ref in ("org/dac", str(snap), str(annexed), str(tiny_models / "dac-tiny")):
        assert checkpoint_sha256(ref) == want, ref
    assert loaded_files(checkpoint("org/dac"), "transformers").source() == {
        "pretrained": "org/dac", "revision": snap.name, "subfolder": None, "files": ["model.safetensors"], "index": None}
    assert loaded_files(checkpoint(str(annexed)), "transformers").source()["pretrained"] == str(annexed)


def _dac_both(tiny_models: Path, out: Path) -> dict[str, Path]:
    """``single`` (the tiny DAC), ``sharded`` (the same config, every value + 1, in shards of 300 KB) and
    ``both`` (``single`` saved again with ``max_shard_size`` into a copy of itself: the old single file stays)."""
    from transformers import DacModel
    single = tiny_models / "dac-tiny"
    model = DacModel.from_pretrained(str(single))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.save_pretrained(str(out / "sharded"), max_shard_size="300KB")
    both = _copy(single, out / "both")
    model.save_pretrained(str(both), max_shard_size="300KB")
    assert (both / "model.safetensors").exists() and (both / "model.safetensors.index.json").exists()
    return {"single": single, "sharded": out / "sharded", "both": both}


def _wan_both(tiny_models: Path, out: Path) -> dict[str, Path]:
    """As :func:`_dac_both` for the tiny Wan VAE (diffusers), each in a pipeline's ``vae/`` folder."""
    from diffusers import AutoencoderKLWan
    single = _copy(tiny_models / "wan-tiny", out / "single" / "vae")
    vae = AutoencoderKLWan.from_pretrained(str(single))
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(1.0)
    vae.save_pretrained(str(out / "sharded" / "vae"), max_shard_size="50KB")
    both = _copy(single, out / "both" / "vae")
    vae.save_pretrained(str(both), max_shard_size="50KB")
    assert (both / "diffusion_pytorch_model.safetensors").exists()
    assert (both / "diffusion_pytorch_model.safetensors.index.json").exists()
    return {k: out / k for k in ("single", "sharded", "both")}


def _shards(folder: Path, single: str) -> list[Path]:
    index = json.loads((folder / (single + ".index.json")).read_text())
    return [folder / f for f in sorted(set(index["weight_map"].values()))]


def test_the_files_hashed_are_the_files_transformers_loads(tiny_models, hub, tmp_path, offline_hub):
    """A folder holding a single file and an index of shards of other values (``save_pretrained`` with
    ``max_shard_size`` into an existing folder): ``transformers`` loads the single file (the values
    ``from_pretrained`` loaded say which); the hash names exactly it, in the folder and through the hub cache.
    Sharded and single saves of the same tensors hash alike; one changed value differs. (Before: the index
    always won, so the hash named tensors transformers never loads.) diffusers, which decides the other way:
    :func:`test_the_files_hashed_are_the_files_diffusers_loads`."""
    from transformers import DacModel

    from shardcache.weights import checkpoint, checkpoint_sha256, loaded_files
    dac = _dac_both(tiny_models, tmp_path / "dac")
    stale, new = _tensor_sha256([dac["single"] / "model.safetensors"]), _tensor_sha256(_shards(dac["sharded"], "model.safetensors"))
    assert stale != new
    loaded = DacModel.from_pretrained(str(dac["both"])).state_dict()
    first = next(iter(DacModel.from_pretrained(str(dac["single"])).state_dict().items()))
    assert torch.equal(loaded[first[0]], first[1])                   # transformers loaded the single file
    put(dac["both"], "org/dac-both", hub)
    for ref in (dac["both"], "org/dac-both"):
        assert checkpoint_sha256(ref) == stale
        assert [n for n, _ in loaded_files(checkpoint(str(ref)), "transformers").files] == ["model.safetensors"]
    assert checkpoint_sha256(dac["sharded"]) == new
    from safetensors.torch import load_file, save_file
    one = load_file(str(dac["single"] / "model.safetensors"))
    name = sorted(one)[0]
    one[name] = one[name].clone()
    one[name].view(-1)[0] += 1
    (tmp_path / "changed").mkdir()
    save_file(one, str(tmp_path / "changed" / "model.safetensors"))
    assert checkpoint_sha256(tmp_path / "changed") not in (stale, new)


@pytest.mark.slow
def test_the_files_hashed_are_the_files_diffusers_loads(tiny_models, hub, tmp_path, offline_hub):
    """As :func:`test_the_files_hashed_are_the_files_transformers_loads` for the Wan VAE in a pipeline's
    ``vae/`` folder: ``diffusers`` loads the shards of the index, not the single file beside it; the hash names
    exactly those, in the folder and through the hub cache, decided in this process (stage one) and in a
    child process (a training process, which never imports ``diffusers``) alike."""
    from diffusers import AutoencoderKLWan

    from shardcache.weights import checkpoint, checkpoint_sha256, loaded_files
    wan = _wan_both(tiny_models, tmp_path / "wan")
    stale = _tensor_sha256([wan["single"] / "vae" / "diffusion_pytorch_model.safetensors"])
    new = _tensor_sha256(_shards(wan["sharded"] / "vae", "diffusion_pytorch_model.safetensors"))
    got = AutoencoderKLWan.from_pretrained(str(wan["both"]), subfolder="vae").state_dict()
    want = AutoencoderKLWan.from_pretrained(str(wan["sharded"]), subfolder="vae").state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)          # diffusers loaded the shards
    put(wan["both"], "org/wan-both", hub)
    for ref in (wan["both"], "org/wan-both"):
        for isolated in (False, True):
            assert checkpoint_sha256(ref, "vae", library="diffusers", isolated=isolated) == new
        files = loaded_files(checkpoint(str(ref), "vae"), "diffusers").files
        assert [n for n, _ in files] == [f"vae/{p.name}" for p in _shards(wan["sharded"] / "vae",
                                                                         "diffusion_pytorch_model.safetensors")]
    assert checkpoint_sha256(wan["single"], "vae", library="diffusers") == stale


def test_what_cannot_be_read_is_refused_by_name(tiny_models, hub, tmp_path, offline_hub):
    """A shard an index names that is missing (``file X listed in Y is missing``, never a hash of the rest),
    an index that does not parse, a truncated blob, a blob removed from the cache (a broken link), a file of
    no weight format: each a :class:`~shardcache.weights.CheckpointUnreadable` naming the file and why."""
    from shardcache.weights import CheckpointUnreadable, checkpoint_sha256
    dac = _dac_both(tiny_models, tmp_path / "dac")
    shards = _shards(dac["sharded"], "model.safetensors")
    gone = _copy(dac["sharded"], tmp_path / "gone")
    (gone / shards[1].name).unlink()
    with pytest.raises(CheckpointUnreadable, match=f"file {shards[1].name} listed in model.safetensors.index.json "
                                                   "is missing"):
        checkpoint_sha256(gone)
    bad = _copy(dac["sharded"], tmp_path / "bad-index")
    (bad / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(CheckpointUnreadable, match=r"model.safetensors.index.json of .*: not a shard index"):
        checkpoint_sha256(bad)
    snap = put(tiny_models / "dac-tiny", "org/truncated", hub)
    blob = blob_of(snap, "model.safetensors")
    blob.write_bytes(blob.read_bytes()[:-1000])
    with pytest.raises(CheckpointUnreadable, match=rf"model.safetensors \({re.escape(str(blob))}\): a corrupt or "
                                                   "truncated safetensors file"):
        checkpoint_sha256("org/truncated")
    snap = put(tiny_models / "dac-tiny", "org/removed", hub)
    blob_of(snap, "model.safetensors").unlink()
    with pytest.raises(CheckpointUnreadable, match="links to ../../blobs/[0-9a-f]{64}, which does not exist"):
        checkpoint_sha256("org/removed")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointUnreadable, match="neither a safetensors nor a torch weight file"):
        checkpoint_sha256(junk)
    with pytest.raises(CheckpointUnreadable, match="org/absent holds none of the weight files transformers loads"):
        checkpoint_sha256("org/absent")


# ---- stage one and training on hub ids ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hub_models(higgs_models, tiny_models, hub, tmp_path_factory) -> dict[str, Path]:
    """The tiny models laid out in :func:`hub` (``org/higgs``, ``org/higgs-audio-tokenizer``, ``org/gemma3``,
    ``org/cosmos`` with the Wan VAE in ``vae/`` and a ``model_index.json`` as a pipeline has, ``org/tokenizer``)
    and as folders: ``{name: folder}``."""
    out = tmp_path_factory.mktemp("hub-models")
    gemma3, _ = build("gemma3", out)
    pipeline = out / "cosmos"
    _copy(tiny_models / "wan-tiny", pipeline / "vae")
    (pipeline / "model_index.json").write_text(json.dumps({"_class_name": "Cosmos2VideoToWorldPipeline",
                                                          "vae": ["diffusers", "AutoencoderKLWan"]}))
    folders = {"higgs": higgs_models / "higgs-tiny", "higgs-audio-tokenizer": higgs_models / "higgs-audio-tokenizer-tiny",
               "gemma3": gemma3, "cosmos": pipeline, "tokenizer": tiny_models / "tokenizer-tiny"}
    for name, folder in folders.items():
        put(folder, f"org/{name}", hub)
    return folders


def _records(real_mini: Path, kind: str, n: int) -> list[dict]:
    recs = json.loads((real_mini / (VOICE if kind == "higgs" else WORLD)).read_text())[:n]
    return [_absolute(r, real_mini) for r in recs] if kind == "higgs" else \
        [dict(r, image=str(real_mini / r["image"])) for r in recs]


@pytest.fixture(scope="module")
def stage_one(real_mini, tmp_path_factory):
    """``make(kind, name, *overrides)``: ``(cache, summary)`` of real-mini records through stage one in this
    process: ``higgs`` (configs/precompute-tts.yaml, 2 voice-cloning records) or ``world``
    (configs/precompute-theworld.yaml, 1 LLaVA record at 64 px); each name made once."""
    from precompute.config import load_config
    from precompute.job import run
    out, made = tmp_path_factory.mktemp("hub-caches"), {}

    def make(kind: str, name: str, *overrides: str) -> Path:
        if name not in made:
            n = 2 if kind == "higgs" else 1
            (out / f"{name}.json").write_text(json.dumps(_records(real_mini, kind, n)))
            config = {"higgs": "precompute-tts.yaml", "world": "precompute-theworld.yaml"}[kind]
            cfg = load_config(ROOT / "configs" / config, ["device=cpu", "num_workers=0", "allow_outside_root=true",
                                                         *(["image_size=64"] if kind == "world" else []), *overrides])
            summary, _ = run(out / f"{name}.json", out / name, cfg, progress=False)
            assert summary.kept == n, summary.reasons
            made[name] = out / name
        return made[name]
    return make


@pytest.fixture
def train(monkeypatch, capsys):
    """``train(cache, run_dir, *flags, build=False)`` -> ``(exit status, stderr)`` of ``shardcache train`` in
    this process; unless ``build`` the model is never built (``train.trainer.prepare_model``, where its weights
    load, ends the run with exit 99): exit 2 is a refusal before any weight loaded."""
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
    assert rc == 2, err[-2000:]
    line = [x for x in err.splitlines() if "error: ContractMismatch: " in x]
    assert len(line) == 1 and "Traceback" not in err, err[-2000:]
    return re.findall(r"(?:: |; )([\w.<>|]+): the cache has ", line[0]), line[0]


def _fingerprint(cache: Path) -> str:
    return json.loads((cache / "manifest.json").read_text())["fingerprint"]


def _loaded_from(cache: Path, encoder: str) -> dict:
    m = json.loads((cache / "manifest.json").read_text())
    enc = m["fields"]["image_features"]["encoder"]["encoder"] if encoder == "image_features" else m["encoders"][encoder]
    return enc["loaded_from"]


@pytest.mark.slow
def test_higgs_stage_one_and_training_on_hub_ids(stage_one, hub_models, hub, train, tmp_path, offline_hub):
    """configs/precompute-tts.yaml with the codec and the text tokenizer given as hub ids: stage one records
    each one's hub id and snapshot commit, and writes the cache the same job with the local folders writes
    (same fingerprint: the hashes decide, not where the files were read); ``shardcache train --model.name
    higgs`` with the LM and its audio tokenizer as hub ids trains a step on it."""
    hub_cache = stage_one("higgs", "h-hub", "audio_tokenizer.pretrained=org/higgs-audio-tokenizer",
                          "text_tokenizer.pretrained=org/higgs")
    local = stage_one("higgs", "h-local", f"audio_tokenizer.pretrained={hub_models['higgs-audio-tokenizer']}",
                      f"text_tokenizer.pretrained={hub_models['higgs']}")
    assert _fingerprint(hub_cache) == _fingerprint(local)
    commit = repo_folder(hub, "org/higgs-audio-tokenizer").joinpath("refs", "main").read_text()
    assert _loaded_from(hub_cache, "audio_tokenizer") == {"pretrained": "org/higgs-audio-tokenizer", "revision": commit,
                                                          "subfolder": None, "files": ["model.safetensors"], "index": None}
    assert _loaded_from(local, "audio_tokenizer")["pretrained"] == str(hub_models["higgs-audio-tokenizer"])
    assert _loaded_from(hub_cache, "text_tokenizer") == {
        "pretrained": "org/higgs", "revision": repo_folder(hub, "org/higgs").joinpath("refs", "main").read_text(),
        "subfolder": None}
    flags = ["--model.name", "higgs", "--model.kwargs", json.dumps({"lm": "org/higgs"}),
             "--model.audio_tokenizer", "org/higgs-audio-tokenizer"]
    rc, err = train(hub_cache, tmp_path / "run", *flags, build=True)
    assert rc == 0, err[-3000:]
    assert (tmp_path / "run" / "step-1" / "model.safetensors").exists()


@pytest.mark.slow
def test_theworld_stage_one_and_training_on_hub_ids(stage_one, hub_models, hub, train, tmp_path, offline_hub):
    """configs/precompute-theworld.yaml with the Wan VAE as the ``vae`` subfolder of a pipeline's hub id and
    Gemma 3 (tokenizer, vision tower) as a hub id: the VAE's ``loaded_from`` names the repo, commit and
    subfolder, the tower's the Gemma repo; the same fingerprint as with the local folders; ``shardcache train
    --model.name theworld`` on hub ids (its VAE's weights decided by diffusers in a child process) trains a step.
    TheWorld's default VAE (the Cosmos-Predict2 pipeline) is hashed like a named one: not in the hub cache,
    the cache is refused naming ``model.kwargs.vae``; in it with the cache's weights, accepted; with other
    weights, refused naming both. (Before: the default VAE was compared with nothing.)"""
    spec = ["image_encoder={name: wan, pretrained: org/cosmos, subfolder: vae}", "text_tokenizer.pretrained=org/gemma3",
            "image_features.pretrained=org/gemma3"]
    hub_cache = stage_one("world", "w-hub", *spec)
    local = stage_one("world", "w-local", f"image_encoder.pretrained={hub_models['cosmos']}",
                      f"text_tokenizer.pretrained={hub_models['gemma3']}", f"image_features.pretrained={hub_models['gemma3']}")
    assert _fingerprint(hub_cache) == _fingerprint(local)
    cosmos = repo_folder(hub, "org/cosmos").joinpath("refs", "main").read_text()
    assert _loaded_from(hub_cache, "image_encoder") == {
        "pretrained": "org/cosmos", "revision": cosmos, "subfolder": "vae",
        "files": ["vae/diffusion_pytorch_model.safetensors"], "index": None}
    assert _loaded_from(local, "image_encoder")["subfolder"] == "vae"   # found in the folder, as stage one does
    assert _loaded_from(hub_cache, "image_features")["pretrained"] == "org/gemma3"
    kw = {"lm": "org/gemma3", "image_size": IMAGE_SIZE}
    rc, err = train(hub_cache, tmp_path / "run", "--model.name", "theworld", "--model.kwargs",
                    json.dumps({**kw, "vae": "org/cosmos"}), "--lora.enabled", "false", build=True)
    assert rc == 0, err[-3000:]
    from train.recipes.theworld import DEFAULT_VAE
    items, line = _refused(*train(hub_cache, tmp_path / "a", "--model.name", "theworld", "--model.kwargs",
                                  json.dumps(kw)))
    assert items == ["image.weights"] and "model.kwargs.vae" in line and DEFAULT_VAE in line
    put(hub_models["cosmos"], DEFAULT_VAE, hub)
    rc, err = train(hub_cache, tmp_path / "b", "--model.name", "theworld", "--model.kwargs", json.dumps(kw), "--dry_run")
    assert rc == 0, err
    other = tmp_path / "other-pipeline"
    build("wan", other / "w", seed=1)
    _copy(other / "w" / "wan-tiny", other / "p" / "vae")
    commit = put(other / "p", DEFAULT_VAE, hub).name                  # a new revision of the default, other weights
    items, line = _refused(*train(hub_cache, tmp_path / "c", "--model.name", "theworld", "--model.kwargs",
                                  json.dumps(kw)))
    assert items == ["image.weights"], line
    assert f"(read from org/cosmos@{cosmos} vae/)" in line and f"(read from {DEFAULT_VAE}@{commit} vae/)" in line


@pytest.mark.slow
def test_two_revisions_with_other_weights_are_refused_naming_both(stage_one, hub_models, hub, train, tmp_path,
                                                                  offline_hub):
    """The codec's repo gets a new revision with other weights (refs/main moves): a cache encoded at the old one
    is refused by ``codec.weights``, the line naming both commits; the run that names the old commit's
    snapshot folder (its files, as a path) fits."""
    higgs_models = hub_models["higgs-audio-tokenizer"].parent
    first = put(higgs_models / "higgs-audio-tokenizer-tiny", "org/codec", hub)
    cache = stage_one("higgs", "h-rev", "audio_tokenizer.pretrained=org/codec", "text_tokenizer.pretrained=org/higgs")
    other, _ = build("higgs-audio-tokenizer", tmp_path / "seed1", seed=1)
    second = put(other, "org/codec", hub)
    assert (repo_folder(hub, "org/codec") / "refs" / "main").read_text() == second.name != first.name
    flags = ["--model.name", "higgs", "--model.kwargs", json.dumps({"lm": "org/higgs"})]
    items, line = _refused(*train(cache, tmp_path / "a", *flags, "--model.audio_tokenizer", "org/codec"))
    assert items == ["codec.weights"], line
    assert f"(read from org/codec@{first.name})" in line and f"(read from org/codec@{second.name})" in line
    rc, err = train(cache, tmp_path / "b", *flags, "--model.audio_tokenizer", str(first), "--dry_run")
    assert rc == 0, err


@pytest.mark.slow
def test_unreadable_checkpoints_exit_2_at_stage_one_and_at_the_contract(demo_cache, tiny_models, hub_models, hub,
                                                                        tmp_path, train, offline_hub, capsys):
    """A truncated blob of the codec: ``shardcache precompute`` exits 2 before its weights load, naming the
    file and its blob; the same checkpoint as ``--model.audio_tokenizer`` of a run: ``shardcache train`` and
    ``--dry_run`` exit 2 naming it, no traceback. (Before: exit 1 with ``RuntimeError: mmap can only be used
    with files saved with torch.save`` at stage one, a traceback at the contract.)"""
    from precompute.cli import main
    snap = put(tiny_models / "dac-tiny", "org/broken", hub)
    blob = blob_of(snap, "model.safetensors")
    blob.write_bytes(blob.read_bytes()[:100])
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(x + "\n" for x in (ROOT / "data" / "demo" / "samples.jsonl").read_text().splitlines()[:1]))
    (tmp_path / "audio").symlink_to(ROOT / "data" / "demo" / "audio")
    capsys.readouterr()
    rc = main(["--manifest", str(rows), "--cache", str(tmp_path / "c"), "--config", str(ROOT / "configs" / "precompute.yaml"),
               "--audio_tokenizer.pretrained", "org/broken", "--image_encoder.pretrained", str(tiny_models / "wan-tiny"),
               "--device", "cpu", "--num_workers", "0", "--allow_outside_root", "true", "--no_progress"])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert f"model.safetensors ({blob})" in err and "corrupt or truncated" in err and "Traceback" not in err
    flags = ["--model.name", "higgs", "--model.kwargs", json.dumps({"lm": "org/higgs"}),
             "--model.audio_tokenizer", "org/broken"]
    for extra in ((), ("--dry_run",)):
        rc, err = train(demo_cache, tmp_path / "run", *flags, *extra)
        assert rc == 2 and f"model.safetensors ({blob})" in err and "Traceback" not in err, err[-2000:]


# ---- the contract covers what shapes the tensors ---------------------------------------------------------------

@pytest.mark.slow
def test_gemma_features_of_another_image_processor_are_refused(stage_one, hub_models, train, tmp_path):
    """Features of the same tower through a processor config with another ``image_mean`` (what TheWorld's
    processor would never feed): refused naming ``feature_encoder.image_processor`` (and nothing else: the
    tower's weights, tokenizer and template are the model's); the model's own processor's cache fits.
    (Before: the recorded ``image_processor`` was compared by nothing: exit 0.)"""
    edited = _copy(hub_models["gemma3"], tmp_path / "gemma3-clip-mean")
    cfg = json.loads((edited / "processor_config.json").read_text())
    cfg["image_processor"]["image_mean"] = [0.48145466, 0.4578275, 0.40821073]
    (edited / "processor_config.json").write_text(json.dumps(cfg))
    cache = stage_one("world", "w-mean", f"image_encoder.pretrained={hub_models['cosmos']}",
                      f"text_tokenizer.pretrained={hub_models['gemma3']}", f"image_features.pretrained={edited}")
    kw = {"lm": str(hub_models["gemma3"]), "vae": str(hub_models["cosmos"]), "image_size": IMAGE_SIZE}
    items, line = _refused(*train(cache, tmp_path / "a", "--model.name", "theworld", "--model.kwargs", json.dumps(kw)))
    assert items == ["feature_encoder.image_processor"], line
    assert "0.48145466" in line
    own = stage_one("world", "w-own", f"image_encoder.pretrained={hub_models['cosmos']}",
                    f"text_tokenizer.pretrained={hub_models['gemma3']}", f"image_features.pretrained={hub_models['gemma3']}")
    rc, err = train(own, tmp_path / "b", "--model.name", "theworld", "--model.kwargs", json.dumps(kw), "--dry_run")
    assert rc == 0, err


@pytest.mark.slow
def test_a_chat_template_edited_in_the_checkpoint_is_refused(stage_one, hub_models, train, tmp_path):
    """The model's checkpoint with its Gemma chat template edited (the vocabulary unchanged, so the tokenizer's
    fingerprint is equal): a cache rendered with the checkpoint's template (``theworld``, ``tokenizer``) holds
    ids the model's template would not produce: refused naming ``chat_template_sha256``.
    (Before: exit 0.)"""
    edited = _copy(hub_models["gemma3"], tmp_path / "gemma3-template")
    jinja = edited / "chat_template.jinja"
    jinja.write_text(jinja.read_text().replace("<start_of_turn>", "<start_of_turn> "))
    cache = stage_one("world", "w-own", f"image_encoder.pretrained={hub_models['cosmos']}",
                      f"text_tokenizer.pretrained={hub_models['gemma3']}", f"image_features.pretrained={hub_models['gemma3']}")
    kw = {"lm": str(edited), "vae": str(hub_models["cosmos"]), "image_size": IMAGE_SIZE}
    items, line = _refused(*train(cache, tmp_path / "a", "--model.name", "theworld", "--model.kwargs", json.dumps(kw)))
    assert items == ["chat_template_sha256"], line


@pytest.mark.slow
def test_the_boson_dataset_refuses_what_the_trainer_refuses(stage_one, hub_models, train, tmp_path):
    """``HiggsChatMLDataset`` (Boson's collator reads the cached labels) checks the model's contract before a
    sample is read: a cache of a codec of other weights and one of another label policy are refused with
    exactly the items ``shardcache train --model.name higgs`` (``labels: targets``) refuses; its own cache
    is served. (Before: it checked nothing.)"""
    from types import SimpleNamespace

    from loaders.higgs import HiggsChatMLDataset
    other, _ = build("higgs-audio-tokenizer", tmp_path / "seed1", seed=1)
    model = {"checkpoint": str(hub_models["higgs"]), "audio_tokenizer": str(hub_models["higgs-audio-tokenizer"])}
    text = f"text_tokenizer.pretrained={hub_models['higgs']}"
    caches = {"codec": stage_one("higgs", "h-other-codec", f"audio_tokenizer.pretrained={other}", text),
              "labels": stage_one("higgs", "h-policy", f"audio_tokenizer.pretrained={hub_models['higgs-audio-tokenizer']}",
                                  text, "label_policy=all_but_world")}
    flags = ["--model.name", "higgs", "--model.kwargs", json.dumps({"lm": model["checkpoint"], "labels": "targets"}),
             "--model.audio_tokenizer", model["audio_tokenizer"]]
    for name, cache in caches.items():
        with pytest.raises(ContractMismatch) as e:
            HiggsChatMLDataset(cache, **model, sample_class=SimpleNamespace)
        items, _ = _refused(*train(cache, tmp_path / name, *flags))
        assert [m[0] for m in e.value.mismatches] == items == [{"codec": "codec.weights", "labels": "label_policy"}[name]]
    own = stage_one("higgs", "h-own", f"audio_tokenizer.pretrained={hub_models['higgs-audio-tokenizer']}", text)
    ds = HiggsChatMLDataset(own, **model, sample_class=SimpleNamespace)
    assert len(ds) == 2 and ds[0].audio_ids_concat.shape[0] == 8
    with pytest.raises(ValueError, match="name the model's checkpoint"):
        HiggsChatMLDataset(own, sample_class=SimpleNamespace)


# ---- numerics ---------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_rerun_under_other_cpu_kernels_is_refused(tiny_models, tmp_path):
    """ATen's CPU kernels shape the floats (``ATEN_CPU_CAPABILITY=default`` makes other Wan latents): each
    encoder records them (``numerics.cpu_capability``, with the device type, dtype, TF32 and cuDNN switches),
    so a rerun of a cache under other kernels is refused by its fingerprint, naming them; the same rerun
    under the same kernels is a resume."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(x + "\n" for x in (ROOT / "data" / "demo" / "samples.jsonl").read_text().splitlines()[:2]))
    (tmp_path / "audio").symlink_to(ROOT / "data" / "demo" / "audio")
    (tmp_path / "images").symlink_to(ROOT / "data" / "demo" / "images")
    cmd = [sys.executable, "-m", "shardcache", "precompute", "--manifest", str(rows), "--cache", str(tmp_path / "c"),
           "--config", str(ROOT / "configs" / "precompute.yaml"), "--image_size", "64",
           "--audio_tokenizer.pretrained", str(tiny_models / "dac-tiny"),
           "--image_encoder.pretrained", str(tiny_models / "wan-tiny"), "--device", "cpu", "--num_workers", "0",
           "--allow_outside_root", "true", "--no_progress"]
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}

    def go(**extra):
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**env, **extra}, timeout=600)
    r = go()
    assert r.returncode == 0, r.stderr[-2000:]
    have = json.loads((tmp_path / "c" / "manifest.json").read_text())["encoders"]["image_encoder"]["numerics"]
    assert have["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and have["device"] == "cpu"
    if have["cpu_capability"] == "DEFAULT":
        pytest.skip("this CPU runs ATen's default kernels already")
    r = go(ATEN_CPU_CAPABILITY="default")
    assert r.returncode == 1 and "was written with fingerprint" in r.stderr, r.stderr[-2000:]
    assert "audio_tokenizer.numerics.cpu_capability" in r.stderr and "image_encoder.numerics.cpu_capability" in r.stderr
    r = go()
    assert r.returncode == 0, r.stderr[-2000:]
