"""``shardcache add-field`` / ``drop-field``: sidecar fields next to untouched shards."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("add_field")  # one worker builds the module's fixtures


ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _precompute(manifest: Path, out: Path, dac: Path) -> None:
    from precompute.config import load_config
    from precompute.job import run
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        f"audio_tokenizer.pretrained={dac}", "image_encoder=null", "samples_per_shard=8",
        "num_workers=0", "device=cpu"])
    run(manifest, out, cfg, progress=False)


@pytest.fixture(scope="module")
def mimi_models(tiny_models) -> Path:
    return tiny_models


@pytest.fixture(scope="module")
def base_cache(demo_cache) -> Path:
    """The session's demo cache (3 shards of 8 rows; add-field reads only its stored audio)."""
    return demo_cache


@pytest.fixture(scope="module")
def added_cache(tmp_path_factory, base_cache, mimi_models) -> tuple[Path, dict[str, str]]:
    """``base_cache`` with ``codes_mimi`` added once (tests copy it), and the main shards' sha256."""
    out = tmp_path_factory.mktemp("added") / "c"
    shutil.copytree(base_cache, out)
    before = {p.name: _sha(p) for p in out.glob("shard-??????.tar")}
    r = _add(out, mimi_models)
    assert r.returncode == 0, r.stderr
    return out, before


def _add(cache: Path, models: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardcache", "add-field", str(cache), "--field", "codes_mimi",
                           "--audio_tokenizer", "mimi", "--pretrained", str(models / "mimi-tiny"),
                           "--no_progress", *extra], cwd=ROOT, capture_output=True, text=True)


def _verify(cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardcache", "shards", "verify", str(cache), "--no_progress", *extra],
                          cwd=ROOT, capture_output=True, text=True)


@pytest.fixture()
def cache(base_cache, tmp_path) -> Path:
    c = tmp_path / "c"
    shutil.copytree(base_cache, c)
    return c


@pytest.fixture()
def added(added_cache, tmp_path) -> tuple[Path, dict[str, str]]:
    c = tmp_path / "added"
    shutil.copytree(added_cache[0], c)
    return c, added_cache[1]


def _check_added(cache: Path, before: dict[str, str]) -> None:
    from loaders import Order, Reads, ShardLoader, Workers
    from shards import ShardReader
    # every byte of the original shards unchanged
    assert {p.name: _sha(p) for p in cache.glob("shard-??????.tar")} == before
    m = json.loads((cache / "manifest.json").read_text())
    fi = m["fields"]["codes_mimi"]
    assert m["format_version"] == 1 and fi["sidecar"] and len(fi["fingerprint"]) == 64
    assert sorted(s["shard"] for s in fi["shards"]) == sorted(before)
    assert [s["path"] for s in m["shards"]] == sorted(before)  # main shard entries as they were
    # sidecar tars: one member per key of the main shard, in its order
    for s in fi["shards"]:
        side = [n.split(".")[0] for n in tarfile.open(cache / s["path"]).getnames()]
        main = list(dict.fromkeys(n.split(".")[0] for n in tarfile.open(cache / s["shard"]).getnames()))
        assert side == main
    r = ShardReader(cache)
    s = r.get(0)
    assert s["codes_mimi"].dtype == np.int16 and s["codes_mimi"].ndim == 2
    # every sidecar member entry records the XXH3-64 of its bytes (computed here from the file)
    import xxhash
    sums = 0
    for members in r.index.column("members").to_pylist():
        for m in members:
            if m.get("file"):
                with open(cache / m["file"], "rb") as f:
                    f.seek(m["offset"])
                    assert m["xxh3"] == xxhash.xxh3_64_intdigest(f.read(m["size"])), m
                sums += 1
    assert sums >= 8  # the rows with audio (image-only rows have no codes_mimi)
    loader = ShardLoader(cache, 4, order=Order(shuffle=False), workers=Workers(num_workers=0), reads=Reads(verify_reads=True))
    b = next(iter(loader))
    assert {"codes", "codes_mimi", "codes_mimi_lengths", "codes_mimi_mask"} <= set(b)
    assert b["codes_mimi"].shape[1] == fi["n_codebooks"]
    pad = ~b["codes_mimi_mask"]
    assert (b["codes_mimi"].permute(0, 2, 1)[pad] == -100).all()
    assert _verify(cache).returncode == 0
    assert _verify(cache, "--deep").returncode == 0


def test_add_field_keeps_shards_and_loads(added, mimi_models):
    cache, before = added
    _check_added(cache, before)
    # rerun: every sidecar is committed, nothing is rewritten
    side = {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*.codes_mimi.tar")}
    assert _add(cache, mimi_models).returncode == 0
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*.codes_mimi.tar")} == side


@pytest.mark.long  # make test-long; test_add_field_keeps_shards_and_loads covers add-field in make test
def test_resume_after_interruption(added, mimi_models):
    cache, before = added
    # simulate a crash after one sidecar: drop the merge and one committed sidecar
    from precompute.add_field import drop_field
    first = sorted(cache.glob("parts/*.codes_mimi.sidecar.parquet"))[0]
    keep = first.read_bytes()
    tar = cache / first.name.replace(".sidecar.parquet", ".tar")
    tar_bytes = tar.read_bytes()
    drop_field(cache, "codes_mimi")
    assert not list(cache.glob("shard-*.codes_mimi.tar"))
    tar.write_bytes(tar_bytes)
    first.write_bytes(keep)
    r = _add(cache, mimi_models)
    assert r.returncode == 0, r.stderr
    _check_added(cache, before)


def test_verify_catches_misaligned_sidecar(added):
    cache, _ = added
    m = json.loads((cache / "manifest.json").read_text())
    entry = m["fields"]["codes_mimi"]["shards"][0]
    p = cache / entry["path"]
    with tarfile.open(p) as tf:
        members = [(ti, tf.extractfile(ti).read()) for ti in tf.getmembers()]
    members = members[1:] + members[:1]  # same bytes, keys out of order
    p.chmod(0o644)
    with open(p, "wb") as fh, tarfile.open(fileobj=fh, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data))
    r = _verify(cache)
    assert r.returncode == 1 and "misaligned" in r.stdout and entry["path"] in r.stdout
    # even with the manifest hash updated to match, --deep finds the misalignment
    entry["bytes"], entry["sha256"] = p.stat().st_size, _sha(p)
    (cache / "manifest.json").write_text(json.dumps(m))
    r = _verify(cache, "--deep")
    assert r.returncode == 1 and "misaligned" in r.stdout


def test_drop_field_restores_cache(added, base_cache):
    cache, shards_before = added
    index_before = (base_cache / "index.parquet").read_bytes()
    r = subprocess.run([sys.executable, "-m", "shardcache", "drop-field", str(cache), "codes_mimi"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not list(cache.glob("shard-*.codes_mimi.tar")) and not list(cache.glob("parts/*.sidecar.parquet"))
    m = json.loads((cache / "manifest.json").read_text())
    assert "fields" not in m and m["format_version"] == 1
    assert {p.name: _sha(p) for p in cache.glob("shard-??????.tar")} == shards_before
    import pyarrow.parquet as pq
    import io as _io
    assert pq.read_table(_io.BytesIO(index_before)).to_pylist() == pq.read_table(cache / "index.parquet").to_pylist()
    assert _verify(cache, "--deep").returncode == 0


def test_reindex_keeps_sidecar_field(added):
    cache, _ = added
    r = subprocess.run([sys.executable, "-m", "shardcache", "shards", "reindex", str(cache), "--no_progress", "-j", "1"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from shards import ShardReader
    assert "codes_mimi" in ShardReader(cache).get(0)
    assert _verify(cache, "--deep").returncode == 0


def test_unknown_field_refused(cache, mimi_models):
    r = subprocess.run([sys.executable, "-m", "shardcache", "add-field", str(cache), "--field", "codes",
                        "--audio_tokenizer", "mimi", "--pretrained", str(mimi_models / "mimi-tiny")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "cannot be added" in r.stderr


@pytest.mark.long  # make test-long; test_add_field_keeps_shards_and_loads covers add-field in make test
def test_real_mini_add_codes_mimi(real_mini, mimi_models, tmp_path):
    cache = tmp_path / "rm"
    _precompute(real_mini / "samples_with_corrupt.jsonl", cache, mimi_models / "dac-tiny")
    before = {p.name: _sha(p) for p in cache.glob("shard-??????.tar")}
    r = _add(cache, mimi_models)
    assert r.returncode == 0, r.stderr
    _check_added(cache, before)


def test_add_field_config_is_a_file_or_the_mapping_itself(tmp_path):
    """``--config`` names a precompute config holding an audio_tokenizer mapping, or is that mapping as YAML
    text; anything else is refused naming the option (no model is loaded by producer_spec)."""
    from precompute.add_field import AddFieldOptions, producer_spec
    from shardcache.config import ConfigError
    want = {"producer": "codes", "audio_tokenizer": {"name": "mimi", "pretrained": "/m/mimi-tiny"}}
    f = tmp_path / "precompute.yaml"
    f.write_text("sample_rate: 24000\naudio_tokenizer:\n  name: mimi\n  pretrained: /m/mimi-tiny\n")
    assert producer_spec(AddFieldOptions(field="codes_mimi", config=str(f))) == want
    assert producer_spec(AddFieldOptions(field="codes_mimi", config="{name: mimi, pretrained: /m/mimi-tiny}")) == want
    for bad in ("no/such/file.yaml", "[1, 2]", "{a: [}"):
        with pytest.raises(ConfigError, match=r"config: expected a YAML file .* got .*no such file, nor a mapping"):
            producer_spec(AddFieldOptions(field="codes_mimi", config=bad))
