"""Third-party readers out of the box: HF ``datasets`` via the dataset card, Lhotse Shar export,
Megatron-Energon prepare. Each reader's tests skip when its package is not installed."""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shards.card import CARD_FILE, index_members, shard_patterns, write_dataset_card
from shards import read_index, read_manifest
from shards.reader import ShardReader


def _subset(real_mini: Path, tmp: Path, name: str, rows) -> Path:
    """A manifest of ``rows`` of ``real_mini/name`` next to links to real-mini's media."""
    recs = json.loads((real_mini / name).read_text())
    d = tmp / "manifest"
    d.mkdir(exist_ok=True)
    for sub in ("audio", "images"):
        if not (d / sub).exists():
            (d / sub).symlink_to(real_mini / sub)
    out = d / name
    out.write_text(json.dumps([recs[i] for i in rows]))
    return out


def _with_card(cache: Path) -> Path:
    # precompute's merge step writes the card once it calls write_dataset_card; until then (and to
    # be independent of it) write it here: the call is idempotent
    write_dataset_card(cache, read_manifest(cache), index_members(read_index(cache)))
    return cache


@pytest.fixture(scope="module")
def mixed_cache(real_mini, tiny_config, tmp_path_factory) -> Path:
    """ChatML TTS samples, 12 audio-only and the 8 with an image (latents on those only)."""
    from precompute.job import run
    tmp = tmp_path_factory.mktemp("readers")
    summary, _ = run(_subset(real_mini, tmp, "train_chatml_samples.json", [*range(12), *range(260, 268)]),
                     tmp / "cache", tiny_config, progress=False)
    assert summary.kept == 20 and summary.rejected == 0, summary.reasons
    return _with_card(tmp / "cache")


@pytest.fixture(scope="module")
def clone_cache(real_mini, tiny_config, tmp_path_factory) -> Path:
    """Voice-cloning conversations: two audio items per sample."""
    from precompute.job import run
    tmp = tmp_path_factory.mktemp("readers_clone")
    cfg = dataclasses.replace(tiny_config, image_encoder=None)
    summary, _ = run(_subset(real_mini, tmp, "chatml_voice_clone.json", range(4)), tmp / "cache", cfg,
                     progress=False)
    assert summary.kept == 4, summary.reasons
    return _with_card(tmp / "cache")


def _samples(cache: Path) -> dict[str, dict]:
    r = ShardReader(cache)
    return {r.keys[i]: {k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in r.get(i).items()}
            for i in range(len(r))}


def _same_json(a, b) -> bool:
    """Equal JSON values; floats to 1e-12 (datasets' Json() round-trips through pandas' ujson,
    whose parser is not correctly rounded: 0.540375 can come back as 0.5403749999999999)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-12)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# ----------------------------------------------------------------------------------- the card

def test_shard_patterns_match_main_shards_only():
    pats = shard_patterns(["shard-000000.tar", "shard-000001.tar", "shard-000000.codes_mimi.tar"])
    assert pats == ["shard-" + "[0-9]" * 6 + ".tar"]
    assert shard_patterns(["shard-r0001-000002.tar"]) == ["shard-r" + "[0-9]" * 4 + "-" + "[0-9]" * 6 + ".tar"]
    import fnmatch
    assert fnmatch.fnmatch("shard-000123.tar", pats[0])
    assert not fnmatch.fnmatch("shard-000123.codes_mimi.tar", pats[0])


def test_card_declares_every_member_with_its_dtype(mixed_cache):
    import yaml
    text = (mixed_cache / CARD_FILE).read_text()
    assert text.startswith("---\n")
    meta = yaml.safe_load(text.split("---\n")[1])
    feats = {f["name"]: f for f in meta["dataset_info"]["features"]}
    assert feats["json"]["dtype"] == "json"
    assert set(feats) == {"__key__", "__url__", "json", "tensors.npz", "latents.npy"}
    packed = {f["name"]: {k: v for k, v in f.items() if k != "name"} for f in feats["tensors.npz"]["struct"]}
    assert packed["codes"] == {"list": {"list": "int16"}}
    assert packed["input_ids"] == {"list": "int32"} and packed["audio"] == {"list": "int16"}
    assert packed["audio_segments"] == {"list": {"list": "int32"}}
    assert feats["latents.npy"] == {"name": "latents.npy", "list": {"list": {"list": {"list": "float16"}}}}
    assert meta["configs"][0]["data_files"][0]["split"] == "train"


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streaming"])
def test_hf_datasets_loads_every_field_of_every_sample(mixed_cache, tmp_path, streaming):
    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "cache"
    shutil.copytree(mixed_cache, cache)
    # a future sidecar tar must not be read as samples of the main split
    shutil.copy(cache / "shard-000000.tar", cache / "shard-000000.codes_mimi.tar")
    want = _samples(mixed_cache)
    assert sum("latents" in s for s in want.values()) == 8  # the test covers optional members
    ds = datasets.load_dataset(str(cache), split="train", streaming=streaming,
                               cache_dir=str(tmp_path / "hf"))
    rows = list(ds)
    assert sorted(r["__key__"] for r in rows) == sorted(want)
    for row in rows:
        w = want[row["__key__"]]
        got = {k: v for k, v in row.items() if not k.startswith("__") and v is not None}
        got.update({f"{k}.npy": v for k, v in got.pop("tensors.npz").items() if v is not None})
        assert {k[:-4] if k.endswith(".npy") else k for k in got} == set(w) - {"__key__"}, row["__key__"]
        for name, v in got.items():
            field = name[:-4] if name.endswith(".npy") else name
            if field == "json":
                assert _same_json(v, w["json"]), row["__key__"]
                continue
            a = np.asarray(v, dtype=w[field].dtype)
            assert a.shape == w[field].shape, (row["__key__"], name)
            np.testing.assert_array_equal(a, w[field], err_msg=f"{row['__key__']} {name}")
    # numpy format: arrays (integers come back as int64 in map-style datasets; values are equal)
    first = next(iter(ds.with_format("numpy")))
    np.testing.assert_array_equal(first["tensors.npz"]["codes"], want[first["__key__"]]["codes"])


# ----------------------------------------------------------------------------------- Lhotse

def _check_shar(cache: Path, shar: Path, manifest: dict) -> int:
    lhotse = pytest.importorskip("lhotse")
    want = _samples(cache)
    n = 0
    for cut in lhotse.CutSet.from_shar(in_dir=shar):
        s = want[cut.custom["key"]]
        sup = cut.supervisions[0]
        k = sup.custom["item"]
        st = s["audio_starts"]
        assert cut.sampling_rate == manifest["sample_rate"]
        audio = cut.load_audio()
        assert audio.shape == (1, st[k + 1] - st[k])
        # lossless 16-bit: exactly the cached int16 samples
        np.testing.assert_array_equal(np.rint(audio[0] * 32768).astype(np.int16), s["audio"][st[k]:st[k + 1]])
        c0, nf = s["audio_segments"][k, 3], s["audio_segments"][k, 4]
        codes = cut.codes.load()
        assert codes.dtype == np.int16 and cut.codes.frame_shift == pytest.approx(1 / manifest["frame_rate"])
        np.testing.assert_array_equal(codes.T, s["codes"][:, c0:c0 + nf])
        trimmed = cut.load_codes()  # lhotse's duration rule: round(duration / frame_shift) frames
        assert nf - 1 <= trimmed.shape[0] <= nf
        np.testing.assert_array_equal(trimmed, codes[:trimmed.shape[0]])
        item = s["json"]["audio_items"][k]
        assert sup.speaker == item["speaker"] and sup.text
        n += 1
    return n


def test_export_lhotse_roundtrip_single_audio(mixed_cache, tmp_path):
    pytest.importorskip("lhotse")
    from shards.cli import main
    assert main(["export-lhotse", str(mixed_cache), str(tmp_path / "shar"), "--shard_size", "8"]) == 0
    manifest = read_manifest(mixed_cache)
    assert _check_shar(mixed_cache, tmp_path / "shar", manifest) == 20
    assert sorted(p.name for p in (tmp_path / "shar").glob("codes.*.tar")) == [
        f"codes.{i:06d}.tar" for i in range(3)]
    import lhotse
    cuts = lhotse.CutSet.from_shar(in_dir=tmp_path / "shar")
    cut = next(c for c in cuts if c.id == "fsdd-george-0-0")  # one audio item: cut id = key
    assert cut.supervisions[0].text == "zero"  # the user turn the assistant audio speaks


def test_export_lhotse_roundtrip_two_items_per_sample(clone_cache, tmp_path):
    pytest.importorskip("lhotse")
    from shards.commands.export_lhotse import export_lhotse
    res = export_lhotse(clone_cache, tmp_path / "shar")
    assert res["cuts"] == 8 and res["samples"] == 4
    assert _check_shar(clone_cache, tmp_path / "shar", read_manifest(clone_cache)) == 8


def test_export_lhotse_refuses_a_non_empty_output(mixed_cache, tmp_path):
    pytest.importorskip("lhotse")
    from shards.cli import main
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("")
    assert main(["export-lhotse", str(mixed_cache), str(tmp_path / "x")]) == 2


# ----------------------------------------------------------------------------------- Energon

def test_energon_prepare_crude_webdataset(mixed_cache, tmp_path):
    energon = shutil.which("energon") or str(Path(sys.executable).parent / "energon")
    if not Path(energon).exists():
        pytest.skip("megatron-energon not installed")
    cache = tmp_path / "cache"
    shutil.copytree(mixed_cache, cache)
    p = subprocess.run([energon, "prepare", str(cache), "--non-interactive", "--split-parts",
                        r"train:shard-.*\.tar", "--sample-type", "CrudeWebdataset"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (cache / ".nv-meta" / "dataset.yaml").exists()
    assert "latents.npy" in p.stdout and "tensors.npz" in p.stdout
