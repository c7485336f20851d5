"""Issue 47: real checkpoints as users have them, hashed as the loading library loads them, refused by name.

Every checkpoint here is a tiny model ``save_pretrained`` into a folder, then laid out as the hub cache holds
it (:mod:`tools.testing.hub_cache`: blobs named by their etag, relative links from ``snapshots/<commit>/``,
``refs/main`` and other refs, ``.no_exist/`` markers; checked against ``huggingface_hub``'s own cache API first)
and read with ``HF_HUB_OFFLINE=1`` through its hub id, the cache found through ``HF_HOME`` or ``HF_HUB_CACHE``,
as a user's first run reads ``google/gemma-3-4b-it``: the Higgs codec and LM, the Gemma 3 model (its tower for
stage one's features), the Wan VAE in the ``vae/`` subfolder of a pipeline, a tokenizer; at ``main`` or another
revision (a commit by hash or tag). Expected hashes are computed here from the files' tensors (:func:`_sha_of`),
which file a library loaded from the values it loaded (:func:`_same_values`): single, sharded and ``.bin``
saves, ``config.json``'s ``transformers_weights``, diffusers' root-first rule, the revision chosen.
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


def _sha_of(tensors: dict[str, torch.Tensor]) -> str:
    """The definition of a checkpoint's identity, computed here: for each tensor in name order,
    ``name|dtype|shape|`` and its raw bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of safetensors ``files`` (``safetensors.torch.load_file``)."""
    from safetensors.torch import load_file
    tensors = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _tensor_sha256(files: list[Path]) -> str:
    """:func:`_sha_of` the tensors of safetensors ``files``."""
    return _sha_of(_tensors(files))


def _same_values(loaded: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """Whether a module's ``state_dict`` (as ``from_pretrained`` loaded it) holds exactly ``want``'s values under
    ``want``'s names (the files' names: weight-norm parametrisations keep them in the state dict)."""
    return set(want) <= set(loaded) and all(torch.equal(loaded[k].float(), want[k].float()) for k in want)


def _plus_one(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Other weights of the same names, shapes and dtypes: every value + 1."""
    return {k: v + 1 for k, v in tensors.items()}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=False)
    return dst


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """This module's Hugging Face home (``HF_HOME``); its hub cache is :func:`hub`, ``HF_HOME/hub``."""
    return tmp_path_factory.mktemp("hf-home")


@pytest.fixture(scope="module")
def hub(hf_home) -> Path:
    """This module's hub cache, empty at first: ``HF_HOME/hub`` of :func:`hf_home`, which the tests reach either
    way: as ``HF_HUB_CACHE`` (:func:`offline_hub`) or through ``HF_HOME`` (:func:`offline_home`)."""
    (hf_home / "hub").mkdir()
    return hf_home / "hub"


@pytest.fixture
def offline_hub(hub):
    """Offline, the hub cache named by ``HF_HUB_CACHE``."""
    with offline(hub):
        yield hub


@pytest.fixture
def offline_home(hf_home):
    """Offline, the hub cache found through ``HF_HOME`` (``HF_HUB_CACHE`` unset), as a user's default setup."""
    with offline(home=hf_home) as hub:
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
        "pretrained": "org/dac", "revision": snap.name, "requested": "main", "subfolder": None,
        "files": ["model.safetensors"], "index": None}
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


def test_offline_through_hf_home_is_what_a_child_process_derives(tiny_models, hub, hf_home, tmp_path):
    """``offline(home=...)``: ``HF_HOME`` set and ``HF_HUB_CACHE`` unset, so a child process's ``huggingface_hub``
    derives the cache as ``$HF_HOME/hub`` and reads a hub id from it offline; this process too (its constants).
    Restored after: ``HF_HUB_CACHE`` as it was."""
    from shardcache.weights import checkpoint_sha256
    snap = put(tiny_models / "dac-tiny", "org/dac-home", hub)
    before = os.environ.get("HF_HUB_CACHE")
    code = ("import os; from huggingface_hub import constants, hf_hub_download; "
            "print(constants.HF_HUB_CACHE); print(hf_hub_download('org/dac-home', 'config.json')); "
            "print(os.environ.get('HF_HUB_CACHE'))")
    with offline(home=hf_home) as got:
        assert got == hub and os.environ["HF_HOME"] == str(hf_home) and "HF_HUB_CACHE" not in os.environ
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert checkpoint_sha256("org/dac-home") == _tensor_sha256([tiny_models / "dac-tiny" / "model.safetensors"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:3] == [str(hub), str(snap / "config.json"), "None"]
    assert os.environ.get("HF_HUB_CACHE") == before


# ---- revisions ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def revisions(tiny_models, hub, tmp_path_factory) -> dict[str, dict]:
    """Repos of two revisions in :func:`hub`: ``refs/main`` at commit ``a`` (a tiny model), and commit ``b`` (the
    same model, every value + 1; a tokenizer with one more token), reached by its hash or its tag ``v1``:
    ``org/dac-rev`` (transformers), ``org/wan-rev`` (a pipeline: the VAE in ``vae/``, diffusers),
    ``org/tok-rev`` (a tokenizer). ``{repo: {"a": folder, "b": folder, "a_commit": ..., "b_commit": ...}}``."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("revisions")
    dac_b = _copy(tiny_models / "dac-tiny", out / "dac-b")
    save_file(_plus_one(_tensors([dac_b / "model.safetensors"])), str(dac_b / "model.safetensors"))
    wan_a = _copy(tiny_models / "wan-tiny", out / "wan-a" / "vae").parent
    wan_b = _copy(tiny_models / "wan-tiny", out / "wan-b" / "vae")
    weights = wan_b / "diffusion_pytorch_model.safetensors"
    save_file(_plus_one(_tensors([weights])), str(weights))
    tok = AutoTokenizer.from_pretrained(str(tiny_models / "tokenizer-tiny"))
    tok.add_tokens(["<only_in_v1>"])
    tok.save_pretrained(str(out / "tok-b"))
    got = {}
    for repo, a, b in (("org/dac-rev", tiny_models / "dac-tiny", dac_b), ("org/wan-rev", wan_a, wan_b.parent),
                       ("org/tok-rev", tiny_models / "tokenizer-tiny", out / "tok-b")):
        absent = ("config.json",) if repo == "org/tok-rev" else ()   # what AutoTokenizer looked for, online
        got[repo] = {"a": a, "b": b, "a_commit": put(a, repo, hub, absent=absent).name,
                     "b_commit": put(b, repo, hub, revision="v1", absent=absent).name}
    return got


def test_the_revision_chosen_is_the_one_hashed_and_loaded(revisions, hub, offline_hub):
    """Two revisions of a repo (refs/main, and a commit reached by hash or tag): ``revision`` None or ``main``
    hashes and loads main's files, the commit or its tag the other commit's; the values ``from_pretrained(...,
    revision=...)`` loaded are the tensors hashed, for transformers and diffusers (in this process and in a
    child) alike; ``loaded_from`` names the commit read and the revision asked for. (Before: ``revision`` reached
    neither the identity code nor ``from_pretrained``: every revision hashed and loaded main.)"""
    from diffusers import AutoencoderKLWan
    from huggingface_hub import scan_cache_dir
    from transformers import DacModel

    from shardcache.weights import checkpoint, checkpoint_sha256, loaded_files
    dac, wan = revisions["org/dac-rev"], revisions["org/wan-rev"]
    (repo,) = [r for r in scan_cache_dir(hub).repos if r.repo_id == "org/dac-rev"]
    assert {(r.commit_hash, r.refs) for r in repo.revisions} == {(dac["a_commit"], frozenset({"main"})),
                                                                 (dac["b_commit"], frozenset({"v1"}))}
    files = {k: _tensors([dac[k] / "model.safetensors"]) for k in "ab"}
    vae = {k: _tensors([wan[k] / "vae" / "diffusion_pytorch_model.safetensors"]) for k in "ab"}
    assert _sha_of(files["a"]) != _sha_of(files["b"])
    for rev, k in ((None, "a"), ("main", "a"), (dac["a_commit"], "a"), (dac["b_commit"], "b"), ("v1", "b")):
        assert checkpoint_sha256("org/dac-rev", revision=rev) == _sha_of(files[k]), rev
        assert _same_values(DacModel.from_pretrained("org/dac-rev", revision=rev).state_dict(), files[k]), rev
        src = loaded_files(checkpoint("org/dac-rev", revision=rev), "transformers").source()
        assert (src["revision"], src["requested"]) == (dac[f"{k}_commit"], rev or "main")
    for rev, k, isolated in ((None, "a", False), ("v1", "b", False), ("v1", "b", True), (wan["a_commit"], "a", True)):
        assert checkpoint_sha256("org/wan-rev", "vae", library="diffusers", revision=rev,
                                 isolated=isolated) == _sha_of(vae[k]), (rev, isolated)
    got = AutoencoderKLWan.from_pretrained("org/wan-rev", subfolder="vae", revision="v1").state_dict()
    assert _same_values(got, vae["b"]) and not _same_values(got, vae["a"])


def test_a_revision_with_a_folder_or_not_in_the_cache_is_refused(revisions, tmp_path, offline_hub):
    """A revision given with a local folder: refused naming the option, the folder and why (transformers and
    diffusers would ignore it, loading the folder's files: the run would record a revision it never read); a
    revision the hub cache does not hold: refused naming it and the refs it holds; diffusers' deprecated variant
    revisions (``fp16``), which load another file than the revision's: refused. Each exits 2 at the command
    line (:class:`~shardcache.weights.CheckpointUnreadable`)."""
    from transformers import DacModel

    from shardcache.weights import CheckpointMissing, CheckpointUnreadable, LocalRevision, checkpoint_sha256
    folder = revisions["org/dac-rev"]["a"]
    loaded = DacModel.from_pretrained(str(folder), revision="v1").state_dict()   # transformers: ignored, silently
    assert _same_values(loaded, _tensors([folder / "model.safetensors"]))
    with pytest.raises(LocalRevision, match=rf"audio_tokenizer.revision 'v1' is set, but {re.escape(str(folder))} is "
                                            "a local folder, which has no revisions"):
        checkpoint_sha256(folder, revision="v1", what="audio_tokenizer.revision")
    assert issubclass(LocalRevision, CheckpointUnreadable) and LocalRevision.exit_code == 2
    from precompute.config import load_config
    from precompute.validate import check_config   # stage one's config check: before any encoder loads
    problems = check_config(load_config(None, [f"audio_tokenizer={{name: dac, pretrained: {folder}, revision: v1}}",
                                               f"image_features={{name: gemma3, pretrained: {folder}, revision: v1}}"]))
    assert [k for k, _ in problems] == ["audio_tokenizer.revision", "image_features.revision"], problems
    assert all("is a local folder, which has no revisions" in m for _, m in problems)
    with pytest.raises(CheckpointMissing, match=r"revision v2 is not in the hub cache .*its refs: main, v1"):
        checkpoint_sha256("org/dac-rev", revision="v2")
    with pytest.raises(CheckpointMissing, match=f"revision {'0' * 40} is not in the hub cache"):
        checkpoint_sha256("org/dac-rev", revision="0" * 40)
    with pytest.raises(CheckpointUnreadable, match="revision 'fp16' is diffusers' deprecated spelling of a weights "
                                                   "variant"):   # diffusers would load diffusion_pytorch_model.fp16.*
        checkpoint_sha256("org/wan-rev", "vae", library="diffusers", revision="fp16")


def test_each_encoder_loads_and_records_the_revision(revisions, tmp_path, offline_hub):
    """``revision`` of the audio tokenizer, image encoder and text tokenizer specs reaches ``from_pretrained``
    and the identity alike: ``describe()``'s ``checkpoint_sha256`` and ``weights_sha256`` (of the module as
    loaded) are those of the revision's files, ``loaded_from`` names its commit and the revision asked for;
    the text tokenizer loaded is the revision's (one more token); with a local folder each is refused."""
    from precompute.encoders import load_audio_tokenizer, load_image_encoder, load_text_tokenizer
    from shardcache.weights import LocalRevision
    dac, wan, tok = revisions["org/dac-rev"], revisions["org/wan-rev"], revisions["org/tok-rev"]
    at = load_audio_tokenizer({"name": "dac", "pretrained": "org/dac-rev", "revision": "v1"}).describe()
    want = load_audio_tokenizer({"name": "dac", "pretrained": str(dac["b"])}).describe()
    assert at["checkpoint_sha256"] == _tensor_sha256([dac["b"] / "model.safetensors"]) == want["checkpoint_sha256"]
    assert at["weights_sha256"] == want["weights_sha256"]
    assert at["loaded_from"] | {"files": None} == {"pretrained": "org/dac-rev", "revision": dac["b_commit"],
                                                  "requested": "v1", "subfolder": None, "files": None, "index": None}
    main = load_audio_tokenizer({"name": "dac", "pretrained": "org/dac-rev"}).describe()
    assert main["weights_sha256"] != at["weights_sha256"] and main["loaded_from"]["revision"] == dac["a_commit"]
    ie = load_image_encoder({"name": "wan", "pretrained": "org/wan-rev", "subfolder": "vae",
                             "revision": wan["b_commit"]}).describe()
    want = load_image_encoder({"name": "wan", "pretrained": str(wan["b"]), "subfolder": "vae"}).describe()
    assert (ie["checkpoint_sha256"], ie["weights_sha256"]) == (want["checkpoint_sha256"], want["weights_sha256"])
    assert ie["loaded_from"]["revision"] == ie["loaded_from"]["requested"] == wan["b_commit"]
    tt = load_text_tokenizer({"name": "hf", "pretrained": "org/tok-rev", "revision": "v1"})
    assert tt.token_to_id("<only_in_v1>") is not None
    assert load_text_tokenizer({"name": "hf", "pretrained": "org/tok-rev"}).token_to_id("<only_in_v1>") is None
    assert tt.describe()["loaded_from"] == {"pretrained": "org/tok-rev", "revision": tok["b_commit"], "requested": "v1",
                                            "subfolder": None}
    for load, spec in ((load_audio_tokenizer, {"name": "dac", "pretrained": str(dac["a"])}),
                       (load_image_encoder, {"name": "wan", "pretrained": str(wan["a"]), "subfolder": "vae"}),
                       (load_text_tokenizer, {"name": "hf", "pretrained": str(tok["a"])})):
        with pytest.raises(ValueError, match=r"\.revision: revision 'v1' is set, but .* is a local folder, which has "
                                             "no revisions"):   # the spec's rule (the config check lists it)
            load(dict(spec, revision="v1"))
    from precompute.encoders.audio import DacTokenizer
    from precompute.encoders.image import IMAGE_ENCODERS
    from precompute.encoders.text import HFTokenizer
    for call in (lambda: DacTokenizer.from_pretrained(str(dac["a"]), revision="v1"),
                 lambda: IMAGE_ENCODERS["wan"].from_pretrained(str(wan["a"]), subfolder="vae", revision="v1"),
                 lambda: HFTokenizer.from_pretrained(str(tok["a"]), revision="v1")):
        with pytest.raises(LocalRevision, match="is a local folder, which has no revisions"):   # the classes: exit 2
            call()


def test_the_recipes_load_and_compare_the_revision(revisions, tiny_models, hub, tmp_path, offline_hub):
    """The recipes' ``model.kwargs.revision`` (the LM: its tokenizer in the contract, its weights when built),
    ``tokenizer_revision``, ``vae_revision`` and ``--model.audio_tokenizer_revision``: the contract's values are
    those of the revision's files (tokenizer fingerprint, VAE and codec weights, each naming its commit), the LM
    built holds the revision's weights; a revision with a local folder, or one without the checkpoint it
    belongs to, is refused by name."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from shardcache.weights import CheckpointUnreadable, LocalRevision
    from shards.tokens import vocab_sha256
    from train.models import ContractUnknown, run_contract
    from train.recipes.theworld import vae_weights
    from train.recipes.tts import TTSModel
    lm_a = _copy(tiny_models / "lm-tiny", tmp_path / "lm-a")        # an LM that ships its tokenizer
    for f in (tiny_models / "tokenizer-tiny").iterdir():
        shutil.copy(f, lm_a)
    lm_b = _copy(lm_a, tmp_path / "lm-b")
    shard = lm_b / "model.safetensors"
    save_file(_plus_one(_tensors([shard])), str(shard))
    tok = AutoTokenizer.from_pretrained(str(lm_a))
    tok.add_tokens(["<only_in_v1>"])
    tok.save_pretrained(str(lm_b))
    b = put(lm_b, "org/lm-rev", hub, revision="v1").name
    put(lm_a, "org/lm-rev", hub)
    fingerprints = {k: vocab_sha256(AutoTokenizer.from_pretrained(str(f))) for k, f in (("a", lm_a), ("b", lm_b))}
    for kw, k in (({}, "a"), ({"revision": "v1"}, "b"), ({"tokenizer": "org/lm-rev", "tokenizer_revision": b}, "b")):
        items = dict(run_contract("tts", {"lm": "org/lm-rev", **kw}).items())
        assert items["text_tokenizer"] == fingerprints[k], kw
        assert (f"org/lm-rev@{b}" in items["text_tokenizer"].source) == (k == "b")
    model = TTSModel(audio_out_token_id=5, lm="org/lm-rev", revision="v1")
    assert _same_values(model.lm.state_dict(), _tensors([shard]))
    dac = revisions["org/dac-rev"]
    got = dict(run_contract("reference", {}, "org/dac-rev", audio_tokenizer_revision="v1").items())["codec.weights"]
    assert got == _tensor_sha256([dac["b"] / "model.safetensors"]) and got.source == f"org/dac-rev@{dac['b_commit']}"
    wan = revisions["org/wan-rev"]
    assert vae_weights("org/wan-rev", revision="v1") == _tensor_sha256([wan["b"] / "vae" /
                                                                        "diffusion_pytorch_model.safetensors"])
    assert vae_weights("org/wan-rev") == _tensor_sha256([wan["a"] / "vae" / "diffusion_pytorch_model.safetensors"])
    with pytest.raises(LocalRevision, match="model.kwargs.revision 'v1' is set"):
        run_contract("tts", {"lm": str(lm_a), "revision": "v1"})
    with pytest.raises(LocalRevision, match="model.kwargs.vae_revision 'v1' is set"):
        vae_weights(str(wan["a"]), revision="v1")
    with pytest.raises(LocalRevision, match="--model.audio_tokenizer_revision 'v1' is set"):
        run_contract("reference", {}, str(dac["a"]), audio_tokenizer_revision="v1")
    with pytest.raises(ContractUnknown, match="tokenizer_revision 'v1' without model.kwargs.tokenizer"):
        run_contract("tts", {"lm": "org/lm-rev", "tokenizer_revision": "v1"})
    with pytest.raises(ContractUnknown, match="--model.audio_tokenizer_revision 'v1' without --model.audio_tokenizer"):
        run_contract("reference", {}, "", audio_tokenizer_revision="v1")
    assert issubclass(LocalRevision, CheckpointUnreadable)


# ---- weight formats and the libraries' own rules -----------------------------------------------------------------

def _save_bin(tensors: dict[str, torch.Tensor], folder: Path, name: str, shards: int = 1) -> list[Path]:
    """``tensors`` as ``torch.save`` zip files (what ``save_pretrained(safe_serialization=False)`` writes):
    ``name`` alone, or ``shards`` files ``<stem>-0000i-of-0000n.bin`` and ``<name>.index.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        torch.save(tensors, folder / name)
        return [folder / name]
    keys, stem = sorted(tensors), name.removesuffix(".bin")
    parts = [keys[i::shards] for i in range(shards)]
    files = [folder / f"{stem}-{i + 1:05d}-of-{shards:05d}.bin" for i in range(shards)]
    for f, part in zip(files, parts):
        torch.save({k: tensors[k] for k in part}, f)
    (folder / f"{name}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: f.name for f, part in zip(files, parts) for k in part}}))
    return files


def test_bin_weights_hash_as_their_safetensors_save(tiny_models, hub, tmp_path, offline_hub):
    """``pytorch_model.bin`` (a ``torch.save`` zip file), its sharded form with ``pytorch_model.bin.index.json``,
    in a folder and through the hub cache (a blob without a suffix, read by its header), and diffusers'
    ``diffusion_pytorch_model.bin``: each loaded by ``from_pretrained`` with the values hashed, and hashed as the
    safetensors save of the same tensors (the hash is over tensors, not bytes). A folder holding both a
    ``.bin`` and ``model.safetensors`` of other values hashes the safetensors file, which transformers loads."""
    from diffusers import AutoencoderKLWan
    from transformers import DacModel

    from shardcache.weights import checkpoint, checkpoint_sha256, file_format, loaded_files
    dac = _tensors([tiny_models / "dac-tiny" / "model.safetensors"])
    want = _sha_of(dac)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for folder, n in ((single, 1), (sharded, 3)):
        _save_bin(dac, folder, "pytorch_model.bin", n)
        shutil.copy(tiny_models / "dac-tiny" / "config.json", folder)
        assert _same_values(DacModel.from_pretrained(str(folder)).state_dict(), dac)
        snap = put(folder, f"org/bin-{folder.name}", hub)
        for ref in (folder, f"org/bin-{folder.name}"):
            assert checkpoint_sha256(ref) == want, ref
        first = loaded_files(checkpoint(f"org/bin-{folder.name}"), "transformers").files[0]
        assert file_format(blob_of(snap, first[0])) == "torch-zip" and "." not in blob_of(snap, first[0]).name
    assert [n for n, _ in loaded_files(checkpoint(str(sharded)), "transformers").files] == [
        f"pytorch_model-0000{i}-of-00003.bin" for i in (1, 2, 3)]
    both = _copy(single, tmp_path / "both")
    from safetensors.torch import save_file
    save_file(_plus_one(dac), str(both / "model.safetensors"))
    assert _same_values(DacModel.from_pretrained(str(both)).state_dict(), _plus_one(dac))
    assert checkpoint_sha256(both) == _sha_of(_plus_one(dac))
    vae = AutoencoderKLWan.from_pretrained(str(tiny_models / "wan-tiny"))
    vae.save_pretrained(str(tmp_path / "wan-bin" / "vae"), safe_serialization=False)
    assert [p.name for p in (tmp_path / "wan-bin" / "vae").glob("*.bin")] == ["diffusion_pytorch_model.bin"]
    wan = _tensors([tiny_models / "wan-tiny" / "diffusion_pytorch_model.safetensors"])
    assert _same_values(AutoencoderKLWan.from_pretrained(str(tmp_path / "wan-bin"), subfolder="vae").state_dict(), wan)
    assert checkpoint_sha256(tmp_path / "wan-bin", "vae", library="diffusers") == _sha_of(wan)


def test_the_file_config_json_names_is_the_one_hashed(tiny_models, hub, tmp_path, offline_hub):
    """``config.json``'s ``transformers_weights`` names the one file transformers loads (here beside a
    ``model.safetensors`` of other values): it is loaded (the values say so) and hashed, in a folder and through
    the hub cache; a name transformers refuses (not safetensors, outside the checkpoint) is refused by name."""
    from safetensors.torch import save_file
    from transformers import DacModel

    from shardcache.weights import CheckpointUnreadable, checkpoint_sha256
    folder = _copy(tiny_models / "dac-tiny", tmp_path / "explicit")
    other = _plus_one(_tensors([folder / "model.safetensors"]))
    save_file(other, str(folder / "chosen.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, transformers_weights="chosen.safetensors")))
    assert _same_values(DacModel.from_pretrained(str(folder)).state_dict(), other)
    put(folder, "org/explicit", hub)
    for ref in (folder, "org/explicit"):
        assert checkpoint_sha256(ref) == _sha_of(other), ref
    for named, why in (("pytorch_model.bin", "neither a safetensors file nor a safetensors index"),
                       ("../chosen.safetensors", "not a file inside the checkpoint")):
        (folder / "config.json").write_text(json.dumps(dict(cfg, transformers_weights=named)))
        with pytest.raises(ValueError):
            DacModel.from_pretrained(str(folder))
        with pytest.raises(CheckpointUnreadable, match=rf"transformers_weights '{re.escape(named)}' is {why}"):
            checkpoint_sha256(folder)


def test_diffusers_reads_a_folder_root_before_its_subfolder(tiny_models, hub, tmp_path, offline_hub):
    """A local pipeline folder with the VAE's weights both at its root and in ``vae/`` (other values): diffusers'
    ``_get_model_file`` takes the root's file for ``subfolder="vae"`` (the values loaded say so) and that is the
    file hashed, here and in a child process; the same files as a hub id load (and hash) ``vae/``'s, as
    ``hf_hub_download(subfolder=...)`` reads them."""
    from diffusers import AutoencoderKLWan
    from safetensors.torch import save_file

    from shardcache.weights import checkpoint, checkpoint_sha256, loaded_files
    folder = tmp_path / "pipeline"
    _copy(tiny_models / "wan-tiny", folder / "vae")
    inner = _tensors([folder / "vae" / "diffusion_pytorch_model.safetensors"])
    save_file(_plus_one(inner), str(folder / "diffusion_pytorch_model.safetensors"))
    got = AutoencoderKLWan.from_pretrained(str(folder), subfolder="vae").state_dict()
    assert _same_values(got, _plus_one(inner))
    for isolated in (False, True):
        assert checkpoint_sha256(folder, "vae", library="diffusers", isolated=isolated) == _sha_of(_plus_one(inner))
    assert [n for n, _ in loaded_files(checkpoint(folder, "vae"), "diffusers").files] == [
        "vae/diffusion_pytorch_model.safetensors"]   # (listed by its name; the path is the root's)
    assert loaded_files(checkpoint(folder, "vae"), "diffusers").files[0][1] == folder / "diffusion_pytorch_model.safetensors"
    put(folder, "org/root-first", hub)
    assert _same_values(AutoencoderKLWan.from_pretrained("org/root-first", subfolder="vae").state_dict(), inner)
    assert checkpoint_sha256("org/root-first", "vae", library="diffusers") == _sha_of(inner)


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
def test_higgs_stage_one_and_training_on_hub_ids(stage_one, hub_models, hub, train, tmp_path, offline_home):
    """configs/precompute-tts.yaml with the codec and the text tokenizer given as hub ids, the hub cache found
    through ``HF_HOME`` (``$HF_HOME/hub``, ``HF_HUB_CACHE`` unset) with ``HF_HUB_OFFLINE=1``, as a user's default
    setup: stage one records each one's hub id and snapshot commit, and writes the cache the same job with the
    local folders writes (same fingerprint: the hashes decide, not where the files were read); ``shardcache
    train --model.name higgs`` with the LM and its audio tokenizer as hub ids trains a step on it, and a
    ``shardcache train --dry_run`` process started with that environment finds them by the same ids."""
    hub_cache = stage_one("higgs", "h-hub", "audio_tokenizer.pretrained=org/higgs-audio-tokenizer",
                          "text_tokenizer.pretrained=org/higgs")
    local = stage_one("higgs", "h-local", f"audio_tokenizer.pretrained={hub_models['higgs-audio-tokenizer']}",
                      f"text_tokenizer.pretrained={hub_models['higgs']}")
    assert _fingerprint(hub_cache) == _fingerprint(local)
    commit = repo_folder(hub, "org/higgs-audio-tokenizer").joinpath("refs", "main").read_text()
    assert _loaded_from(hub_cache, "audio_tokenizer") == {"pretrained": "org/higgs-audio-tokenizer", "revision": commit,
                                                          "requested": "main", "subfolder": None,
                                                          "files": ["model.safetensors"], "index": None}
    assert _loaded_from(local, "audio_tokenizer")["pretrained"] == str(hub_models["higgs-audio-tokenizer"])
    assert _loaded_from(hub_cache, "text_tokenizer") == {
        "pretrained": "org/higgs", "revision": repo_folder(hub, "org/higgs").joinpath("refs", "main").read_text(),
        "requested": "main", "subfolder": None}
    flags = ["--model.name", "higgs", "--model.kwargs", json.dumps({"lm": "org/higgs"}),
             "--model.audio_tokenizer", "org/higgs-audio-tokenizer"]
    rc, err = train(hub_cache, tmp_path / "run", *flags, build=True)
    assert rc == 0, err[-3000:]
    assert (tmp_path / "run" / "step-1" / "model.safetensors").exists()
    assert "HF_HUB_CACHE" not in os.environ and os.environ["HF_HOME"] == str(hub.parent)
    r = subprocess.run([sys.executable, "-m", "shardcache", "train", "--config", "none", "--cache", str(hub_cache),
                        "--run_dir", str(tmp_path / "child"), "--data.batch_size", "1", *flags, "--dry_run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "nothing was loaded" in r.stdout, r.stderr[-3000:]


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
        "pretrained": "org/cosmos", "revision": cosmos, "requested": "main", "subfolder": "vae",
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
    snapshot folder (its files, as a path), or the hub id at that commit (``--model.audio_tokenizer_revision``),
    fits; ``HiggsChatMLDataset`` refuses and accepts the same (its ``audio_tokenizer_revision``)."""
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
    rc, err = train(cache, tmp_path / "c", *flags, "--model.audio_tokenizer", "org/codec",
                    "--model.audio_tokenizer_revision", first.name, "--dry_run")
    assert rc == 0, err
    from types import SimpleNamespace

    from loaders.higgs import HiggsChatMLDataset   # Boson's entry refuses and accepts alike
    with pytest.raises(ContractMismatch) as e:
        HiggsChatMLDataset(cache, "org/higgs", audio_tokenizer="org/codec", sample_class=SimpleNamespace)
    assert [m[0] for m in e.value.mismatches] == ["codec.weights"]
    assert len(HiggsChatMLDataset(cache, "org/higgs", audio_tokenizer="org/codec", audio_tokenizer_revision=first.name,
                                  sample_class=SimpleNamespace)) == 2


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


# ---- revisions end to end ---------------------------------------------------------------------------------------

def _demo_rows(tmp_path: Path, n: int = 2) -> Path:
    """The first ``n`` rows of the demo manifest, with its audio and images beside them."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(x + "\n" for x in (ROOT / "data" / "demo" / "samples.jsonl").read_text().splitlines()[:n]))
    for d in ("audio", "images"):
        if not (tmp_path / d).exists():
            (tmp_path / d).symlink_to(ROOT / "data" / "demo" / d)
    return rows


@pytest.mark.slow
def test_stage_one_at_a_revision_reruns_by_its_hashes_and_trains_against_it(revisions, train, tmp_path, offline_hub):
    """configs/precompute.yaml with the codec and the VAE at revision ``v1`` of their hub ids: the cache holds
    that revision's identity (``checkpoint_sha256`` of its files; ``loaded_from`` its commit and ``v1``). A rerun
    naming the same commit by its hash is a resume (``revision`` is an identity option: the hashes decide),
    nothing encoded again and no byte changed; a rerun at ``main`` (other weights) is refused by the fingerprint,
    naming the codec's hashes. ``shardcache train --model.audio_tokenizer`` of the hub id fits the cache with
    ``--model.audio_tokenizer_revision v1`` and is refused without it, naming both commits."""
    from precompute.config import load_config
    from precompute.job import run
    from shards.errors import FingerprintMismatch
    dac, wan = revisions["org/dac-rev"], revisions["org/wan-rev"]
    rows, cache = _demo_rows(tmp_path), tmp_path / "cache"

    def stage_one(codec_rev: str | None, vae_rev: str | None = "v1"):
        def spec(rev):
            return f", revision: '{rev}'" if rev else ""
        cfg = load_config(ROOT / "configs" / "precompute.yaml", [
            "device=cpu", "num_workers=0", "allow_outside_root=true", "image_size=64",
            "audio_tokenizer={name: dac, pretrained: org/dac-rev" + spec(codec_rev) + "}",
            "image_encoder={name: wan, pretrained: org/wan-rev, subfolder: vae" + spec(vae_rev) + "}"])
        return run(rows, cache, cfg, root=tmp_path, progress=False)[0]
    first = stage_one("v1")
    assert first.kept == 2, first.reasons
    man = json.loads((cache / "manifest.json").read_text())
    codec, vae = man["encoders"]["audio_tokenizer"], man["encoders"]["image_encoder"]
    assert codec["checkpoint_sha256"] == _tensor_sha256([dac["b"] / "model.safetensors"])
    assert (codec["loaded_from"]["revision"], codec["loaded_from"]["requested"]) == (dac["b_commit"], "v1")
    assert vae["checkpoint_sha256"] == _tensor_sha256([wan["b"] / "vae" / "diffusion_pytorch_model.safetensors"])
    before = {p.name: p.read_bytes() for p in cache.glob("*.tar")}
    again = stage_one(dac["b_commit"], wan["b_commit"])
    assert again.rerun["reencoded"] == again.rerun["added"] == 0 and again.kept == 0, again.rerun
    assert {p.name: p.read_bytes() for p in cache.glob("*.tar")} == before
    with pytest.raises(FingerprintMismatch, match="audio_tokenizer.checkpoint_sha256"):
        stage_one(None)
    assert {p.name: p.read_bytes() for p in cache.glob("*.tar")} == before
    rc, err = train(cache, tmp_path / "a", "--model.audio_tokenizer", "org/dac-rev", "--model.audio_tokenizer_revision",
                    "v1", "--dry_run")
    assert rc == 0, err[-2000:]
    items, line = _refused(*train(cache, tmp_path / "b", "--model.audio_tokenizer", "org/dac-rev"))
    assert items == ["codec.weights"], line
    assert f"(read from org/dac-rev@{dac['b_commit']})" in line and f"(read from org/dac-rev@{dac['a_commit']})" in line


@pytest.fixture(scope="module")
def mimi_revisions(tiny_models, hub, tmp_path_factory) -> dict:
    """``org/mimi-rev``: main at the tiny Mimi codec, ``v1`` at it with every value + 1."""
    from safetensors.torch import save_file
    b = _copy(tiny_models / "mimi-tiny", tmp_path_factory.mktemp("mimi") / "mimi-b")
    save_file(_plus_one(_tensors([b / "model.safetensors"])), str(b / "model.safetensors"))
    return {"a": tiny_models / "mimi-tiny", "b": b, "a_commit": put(tiny_models / "mimi-tiny", "org/mimi-rev", hub).name,
            "b_commit": put(b, "org/mimi-rev", hub, revision="v1").name}


def _fields(cache: Path) -> dict[str, bytes]:
    """The cache's shards, sidecars and parts by name, and each field's fingerprint (what a refused or an
    identity rerun must leave as it was; the manifest's other records are rewritten by a run)."""
    files = {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*"))
             if p.is_file() and (p.suffix == ".tar" or p.parent.name == "parts") and p.name != "writer.lock"}
    fields = json.loads((cache / "manifest.json").read_text()).get("fields") or {}
    return files | {f"fingerprint of {k}": v["fingerprint"].encode() for k, v in fields.items()}


@pytest.mark.slow
def test_add_field_at_a_revision_is_identity(demo_cache, mimi_revisions, tmp_path, offline_hub, capsys):
    """``shardcache add-field --pretrained HUB_ID --revision v1``: the field's codec is that revision's (its
    hashes and ``loaded_from``); run again with the same commit named by its hash, nothing changes (an identity
    option: the hashes decide); at ``main`` (other weights) it is refused, the cache untouched; ``--revision``
    with a local folder is refused naming it (a bad codec spec: exit 1, as add-field's other spec errors). (Covers the add-field walk's ``revision`` rows:
    tests/test_option_effects.py.)"""
    from precompute.add_field import AddFieldOptions, FieldError, add_field, main_add, producer_spec
    m = mimi_revisions
    cache = _copy(demo_cache, tmp_path / "cache")

    def spec(revision=None, pretrained="org/mimi-rev"):
        return producer_spec(AddFieldOptions(field="codes_mimi", audio_tokenizer="mimi", pretrained=pretrained,
                                             revision=revision))
    assert spec("v1")["audio_tokenizer"] == {"name": "mimi", "pretrained": "org/mimi-rev", "revision": "v1"}
    add_field(cache, "codes_mimi", spec("v1"), progress=False)
    enc = json.loads((cache / "manifest.json").read_text())["fields"]["codes_mimi"]["encoder"]
    assert enc["checkpoint_sha256"] == _tensor_sha256([m["b"] / "model.safetensors"])
    assert (enc["loaded_from"]["revision"], enc["loaded_from"]["requested"]) == (m["b_commit"], "v1")
    before = _fields(cache)
    add_field(cache, "codes_mimi", spec(m["b_commit"]), progress=False)
    assert _fields(cache) == before
    with pytest.raises(FieldError, match="exists with fingerprint"):
        add_field(cache, "codes_mimi", spec(None), progress=False)
    assert _fields(cache) == before
    capsys.readouterr()
    rc = main_add([str(cache), "--field", "codes_mimi", "--audio_tokenizer", "mimi", "--pretrained", str(m["a"]),
                   "--revision", "v1", "--no_progress", "true"])
    err = capsys.readouterr().err
    assert rc == 1 and "audio_tokenizer.revision: revision 'v1' is set" in err, err[-2000:]   # a bad spec (as any)
    assert "is a local folder, which has no revisions" in err and "Traceback" not in err, err[-2000:]
    assert _fields(cache) == before


@pytest.mark.slow
def test_add_field_under_other_cpu_kernels_is_refused_or_encoded_again(demo_cache, tiny_models, tmp_path):
    """``shardcache add-field`` run again under ATen's default CPU kernels (``ATEN_CPU_CAPABILITY=default``, other
    floats) than the field was encoded under: the codec's ``numerics.cpu_capability`` differs, so the field's
    fingerprint does: refused, the cache untouched; with ``--replace`` encoded again, the field then recording
    ``DEFAULT``; under the recorded kernels the rerun changes nothing."""
    from precompute.add_field import main_add
    cache = _copy(demo_cache, tmp_path / "cache")
    args = [str(cache), "--field", "codes_mimi", "--audio_tokenizer", "mimi", "--pretrained",
            str(tiny_models / "mimi-tiny"), "--no_progress", "true"]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}   # read when torch starts: another process

    def under_default_kernels(*extra):
        return subprocess.run([sys.executable, "-m", "shardcache", "add-field", *args, *extra], cwd=ROOT,
                              capture_output=True, text=True, env=env, timeout=600)

    def numerics():
        field = json.loads((cache / "manifest.json").read_text())["fields"]["codes_mimi"]
        return field["fingerprint"], field["encoder"]["numerics"]["cpu_capability"]
    assert main_add(args) == 0                  # this process's kernels
    fp, have = numerics()
    assert have == torch.backends.cpu.get_cpu_capability()
    if have == "DEFAULT":
        pytest.skip("this CPU runs ATen's default kernels already")
    before = _fields(cache)
    r = under_default_kernels()
    assert r.returncode == 1 and "exists with fingerprint" in r.stderr, r.stderr[-2000:]
    assert _fields(cache) == before
    assert main_add(args) == 0 and _fields(cache) == before
    r = under_default_kernels("--replace", "true")
    assert r.returncode == 0, r.stderr[-2000:]
    new_fp, now = numerics()
    assert now == "DEFAULT" and new_fp != fp


@pytest.mark.slow
def test_the_gemma_tower_and_theworld_read_the_revision(hub_models, hub, tmp_path, offline_hub):
    """``image_features.revision`` and the ``theworld`` recipe's ``model.kwargs.revision`` of a Gemma 3 hub id
    whose ``v1`` has other vision tower weights and another processor ``image_mean``: the encoder loads ``v1``'s
    tower (its ``weights_sha256`` is that of the ``v1`` folder loaded) and processor, records their identity
    (``checkpoint_sha256`` of ``v1``'s tower tensors, ``pixel_options``, ``loaded_from``), and the recipe's
    contract compares exactly those (``feature_encoder.weights`` / ``.image_processor``); ``main``'s otherwise."""
    from safetensors.torch import save_file

    from precompute.producers.image_features import Gemma3VisionEncoder
    from train.models import run_contract
    main_folder = hub_models["gemma3"]
    v1 = _copy(main_folder, tmp_path / "gemma3-v1")
    (weights,) = v1.glob("*.safetensors")
    tensors = _tensors([weights])
    tower = re.compile(r"(?:^|\.)((?:vision_tower|multi_modal_projector)\..*)$")   # named from the part on
    save_file({k: v + 1 if tower.search(k) else v for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})
    cfg = json.loads((v1 / "processor_config.json").read_text())
    cfg["image_processor"]["image_mean"] = [0.25, 0.5, 0.75]
    (v1 / "processor_config.json").write_text(json.dumps(cfg))
    commit = put(v1, "org/gemma3", hub, revision="v1").name

    def tower_sha(folder: Path) -> str:
        return _sha_of({m.group(1): v for k, v in _tensors(list(folder.glob("*.safetensors"))).items()
                        if (m := tower.search(k))})
    got = Gemma3VisionEncoder("org/gemma3", revision="v1").describe()
    assert got["checkpoint_sha256"] == tower_sha(v1) != tower_sha(main_folder)
    assert got["weights_sha256"] == Gemma3VisionEncoder(str(v1)).describe()["weights_sha256"]
    assert got["pixel_options"]["image_mean"] == [0.25, 0.5, 0.75]
    assert (got["loaded_from"]["revision"], got["loaded_from"]["requested"]) == (commit, "v1")
    kw = {"lm": "org/gemma3", "vae": str(hub_models["cosmos"]), "image_size": IMAGE_SIZE}
    for extra, sha, mean in (({"revision": "v1"}, tower_sha(v1), [0.25, 0.5, 0.75]), ({}, tower_sha(main_folder), None)):
        items = dict(run_contract("theworld", {**kw, **extra}).items())
        assert items["feature_encoder.weights"] == sha, extra
        assert (items["feature_encoder.image_processor"]["image_mean"] == mean) == bool(extra), extra


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
    from precompute.cli import main
    args = ["precompute", "--manifest", str(rows), "--cache", str(tmp_path / "c"),
            "--config", str(ROOT / "configs" / "precompute.yaml"), "--image_size", "64",
            "--audio_tokenizer.pretrained", str(tiny_models / "dac-tiny"),
            "--image_encoder.pretrained", str(tiny_models / "wan-tiny"), "--device", "cpu", "--num_workers", "0",
            "--allow_outside_root", "true", "--no_progress"]
    assert main(args[1:]) == 0                  # this process's kernels
    have = json.loads((tmp_path / "c" / "manifest.json").read_text())["encoders"]["image_encoder"]["numerics"]
    assert have["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and have["device"] == "cpu"
    if have["cpu_capability"] == "DEFAULT":
        pytest.skip("this CPU runs ATen's default kernels already")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}   # read when torch starts: another process
    r = subprocess.run([sys.executable, "-m", "shardcache", *args], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 1 and "was written with fingerprint" in r.stderr, r.stderr[-2000:]
    assert "audio_tokenizer.numerics.cpu_capability" in r.stderr and "image_encoder.numerics.cpu_capability" in r.stderr
    assert main(args[1:]) == 0
