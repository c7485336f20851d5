"""A new field of a new kind is one declaration plus one producer (tests/plugin_fields.py): stage one
writes it, add-field adds it to an existing cache, verify checks it, the loader collates it with its
mask, the device move widens it, and a model trains on it; nothing in loaders/, train/ or
shards/commands/ names it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import librosa
import numpy as np
import pytest
import soundfile as sf
import torch

import plugin_fields  # noqa: F401 (registers the field in this process)
from test_train_support import base_env

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
N_MELS = 8
ENV = base_env({"SHARDCACHE_PLUGINS": "plugin_fields"})


def expected_mel(source: str) -> np.ndarray:
    """Log-mel of a source file computed here from scratch: soundfile decode, channel mean, soxr to
    16 kHz, librosa mel power, log(1e-5 + p), frames = ceil(samples / 160)."""
    y, sr = sf.read(source, dtype="float32", always_2d=True)
    y = librosa.resample(y.mean(axis=1), orig_sr=sr, target_sr=16000, res_type="soxr_hq")
    m = librosa.feature.melspectrogram(y=y, sr=16000, n_fft=400, hop_length=160, n_mels=N_MELS)
    return np.log(1e-5 + m[:, :-(-len(y) // 160)])


@pytest.fixture(scope="module")
def mel_cache(tmp_path_factory, tiny_config) -> Path:
    from precompute.config import load_config
    from precompute.job import run
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        f"audio_tokenizer.pretrained={tiny_config.audio_tokenizer['pretrained']}", "image_encoder=null",
        "samples_per_shard=8", "num_workers=0", "device=cpu",
        f"extra_fields={{mel: {{factory: 'plugin_fields:make_mel', kwargs: {{n_mels: {N_MELS}}}}}}}"])
    out = tmp_path_factory.mktemp("mel") / "c"
    summary, manifest = run(DEMO / "samples.jsonl", out, cfg, progress=False)
    assert summary.kept > 8
    return out


def test_the_kinds_own_value_check_is_declared_once_and_applied_by_readers(tmp_path):
    """The plug-in kind declares a check of its own (plugin_fields.LogFloor, in that one module):
    the manifest's checks carry it and a reader refuses a value breaking it, naming the sample;
    no whitelist or dispatch elsewhere has to learn it."""
    from shards import ShardCorrupt, ShardReader, ShardWriter, merge_parts
    from shards.reader import read_manifest, value_checks_from_manifest
    from shards.schema import shard_name
    good = np.full((N_MELS, 4), -3.0, np.float16)
    bad = good.copy()
    bad[2, 1] = -40.0
    with ShardWriter(tmp_path, shard_name(0, 0)) as w:
        for key, mel in (("a", good), ("b", bad)):
            w.add(key, {"json": {"text": key, "sample_rate": 16000, "duration_s": 0.1}, "mel.npy": mel})
        w.commit()
    merge_parts(tmp_path, {})
    checks = value_checks_from_manifest(read_manifest(tmp_path))
    assert checks["mel"] == plugin_fields.LogFloor(plugin_fields.MEL_FLOOR)
    r = ShardReader(tmp_path, value_checks=checks)
    assert np.array_equal(r.get(r.keys.index("a"))["mel"], good)
    with pytest.raises(ShardCorrupt, match=r"'b'.*mel value -40 below the log-mel floor -11.52"):
        r.get(r.keys.index("b"))
    assert np.array_equal(ShardReader(tmp_path).get(r.keys.index("b"))["mel"], bad)  # unchecked: as stored


def test_precompute_writes_the_new_field(mel_cache):
    from shards import ShardReader
    man = json.loads((mel_cache / "manifest.json").read_text())
    assert man["fields"]["mel"]["kind"] == "frame_features" and not man["fields"]["mel"]["sidecar"]
    r = ShardReader(mel_cache)
    checked = 0
    for i in range(len(r)):
        s = r.get(i)
        (item,) = s["json"]["audio_items"]
        want = expected_mel(item["source"])
        assert s["mel"].dtype == np.float16 and s["mel"].shape == want.shape
        np.testing.assert_allclose(s["mel"].astype(np.float32), want, rtol=2e-3, atol=2e-2)
        checked += 1
    assert checked == len(r) > 8


def test_add_field_adds_it_to_an_existing_cache(demo_cache, mel_cache, tmp_path):
    from shards import ShardReader
    cache = tmp_path / "c"
    shutil.copytree(demo_cache, cache)
    r = subprocess.run([sys.executable, "-m", "shardcache", "add-field", str(cache), "--field", "mel",
                        "--producer", "plugin_fields:make_mel", "--options", json.dumps({"n_mels": N_MELS}),
                        "--no_progress"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in cache.glob("shard-*.mel.tar"))
    man = json.loads((cache / "manifest.json").read_text())
    assert man["fields"]["mel"]["sidecar"] and man["fields"]["mel"]["kind"] == "frame_features"
    added, stage_one = ShardReader(cache), ShardReader(mel_cache)
    pos = {k: i for i, k in enumerate(stage_one.keys)}
    n = 0
    for i, key in enumerate(added.keys):
        if key not in pos:
            continue  # image-only rows of the demo cache have no audio
        a, b = added.get(i).get("mel"), stage_one.get(pos[key])["mel"]
        if b is None:
            continue
        # from the stored 24 kHz int16 audio instead of the source file: the same features up to
        # the resampling path (log domain: compare where the mel power is not tiny)
        assert a.shape == b.shape
        big = b > -5
        assert np.median(np.abs(a[big].astype(np.float32) - b[big].astype(np.float32))) < 0.05
        n += 1
    assert n > 8
    v = subprocess.run([sys.executable, "-m", "shardcache", "shards", "verify", str(cache), "--deep", "--no_progress"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr


def test_verify_checks_its_values_with_its_kind(mel_cache, tmp_path):
    """A NaN written into a mel member: ``verify --deep`` names the sample and the field."""
    from shards import ShardCorrupt, ShardReader, read_index
    cache = tmp_path / "c"
    shutil.copytree(mel_cache, cache)
    idx = read_index(cache).to_pylist()
    row = idx[0]
    m = next(x for x in row["members"] if x["name"] == "mel.npy")
    shard = cache / row["shard"]
    shard.chmod(0o644)
    with open(shard, "r+b") as f:
        f.seek(m["offset"])
        f.write(np.array([np.nan], np.float16).tobytes())
    v = subprocess.run([sys.executable, "-m", "shardcache", "shards", "verify", str(cache), "--deep", "--no_progress"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert v.returncode == 1
    assert row["key"] in v.stdout and "mel" in v.stdout and "non-finite" in v.stdout, v.stdout + v.stderr
    assert ShardReader(cache, checksums=False).get(0)["mel"].dtype == np.float16  # read as stored
    with pytest.raises(ShardCorrupt, match=f"'{row['key']}' member mel.npy: checksum mismatch"):
        ShardReader(cache).get(0)  # the member checksum (on by default) names the damaged member


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_collates_it_with_its_mask_and_the_device_widens_it(mel_cache, num_workers):
    from loaders import Reads, ShardLoader, Workers
    from loaders.device import to_device
    from shards import ShardReader
    reader = ShardReader(mel_cache)
    by_key = {k: reader.get(i)["mel"] for i, k in enumerate(reader.keys)}
    ld = ShardLoader(mel_cache, 4, fields=("mel", "input_ids"), seed=1, workers=Workers(num_workers=num_workers), reads=Reads(compact=True))
    batches = list(ld)
    ld.close()
    assert batches
    for b in batches:
        mel, lengths, mask = b["mel"], b["mel_lengths"], b["mel_mask"]
        assert mel.dtype == torch.float16 and mel.shape[1] == N_MELS and mask.shape == (mel.shape[0], mel.shape[2])
        dev = to_device(b, "cpu")
        assert dev["mel"].dtype == torch.float32 and dev["input_ids"].dtype == torch.int64
        for j, key in enumerate(b["keys"]):
            want = torch.from_numpy(by_key[key].astype(np.float32))
            n = want.shape[1]
            assert int(lengths[j]) == n and mask[j, :n].all() and not mask[j, n:].any()
            assert torch.equal(dev["mel"][j, :, :n], want)
            assert (dev["mel"][j, :, n:] == 0).all()


def test_a_model_trains_on_it(mel_cache, tmp_path, monkeypatch):
    from test_train_support import from_dict
    from train.trainer import Callbacks, run
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    seen = {}
    cfg = from_dict(dict(cache=str(mel_cache), out=str(tmp_path / "run"), model="plugin_fields:MelModel",
                         model_kwargs={"n_mels": N_MELS}, batch_size=4, steps=30, warmup_steps=2, lr=3e-2,
                         ckpt_every=1000, progress=False, threads=1, log_every=1, val_fraction=0.0))
    assert run(cfg, Callbacks(on_setup=lambda t: seen.setdefault("model", t.raw))) == 0
    assert seen["model"].seen_dtypes == {torch.float32}
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if r.get("split", "train") == "train" and "loss" in r]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
