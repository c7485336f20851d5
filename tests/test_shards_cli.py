"""The ``shards`` CLI on a small cache built with ShardWriter + merge_parts."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shards
from shards.cli import main
from shards.schema import shard_name

FINGERPRINT = "fp-0123456789abcdef"
ENCODERS = {"codec": {"name": "test-codec", "codebooks": 8}, "vae": {"name": "cosmos-test"}}
#: key -> (shard number, duration_s, sample_rate, speaker, has_image, text)
SAMPLES = {
    "utt-a": (0, 1.0, 16000, "alice", False, "a short one"),
    "utt-b": (0, 2.5, 16000, "bob", True, "a photo of a cat"),
    "utt-c": (0, 6.0, 24000, "alice", True, "a long caption about a rocket launch"),
    "utt-d": (1, 7.5, 16000, "carol", False, "the longest speech sample here"),
    "utt-e": (1, 0.5, 24000, "bob", True, "tiny"),
}


def make_arrays(key: str) -> dict:
    shard_no, dur, sr, speaker, has_image, text = SAMPLES[key]
    rng = np.random.default_rng(sum(map(ord, key)))
    frames = int(round(dur * 25))
    fields = {
        "json": {"text": text, "speaker": speaker, "sample_rate": sr, "duration_s": dur},
        "codes.npy": rng.integers(0, 1024, size=(8, frames)).astype(np.int16),
        "audio.npy": rng.integers(-20000, 20000, size=int(dur * sr)).astype(np.int16),
        "input_ids.npy": rng.integers(0, 32000, size=2 * len(text.split())).astype(np.int32),
    }
    if has_image:
        offsets = (np.arange(16) * 0.1).reshape(16, 1, 1, 1)
        fields["latents.npy"] = (rng.normal(size=(16, 1, 8, 8)) * 0.5 + offsets).astype(np.float16)
    return fields


def build_cache(out: Path) -> Path:
    for n in (0, 1):
        w = shards.ShardWriter(out, shard_name(0, n))
        for key, spec in SAMPLES.items():
            if spec[0] == n:
                w.add(key, make_arrays(key))
        if n == 0:
            w.reject("utt-bad", "audio/bad.wav", "unreadable_audio", "not a RIFF file")
        w.commit()
    shards.merge_parts(out, {"encoders": ENCODERS, "fingerprint": FINGERPRINT,
                             "config": {"max_duration_s": 30}})
    return out


@pytest.fixture(scope="module")
def clean_cache(tmp_path_factory) -> Path:
    return build_cache(tmp_path_factory.mktemp("cache") / "out")


@pytest.fixture
def cache(clean_cache, tmp_path) -> Path:
    """A private copy that a test may damage."""
    return Path(shutil.copytree(clean_cache, tmp_path / "cache"))


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def run_json_failing(capsys, *argv):
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    return report


def member(cache: Path, key: str, name: str) -> tuple[str, dict]:
    """``(shard, member entry)`` of one sample's member, from the index."""
    row = [r for r in shards.read_index(cache).to_pylist() if r["key"] == key][0]
    return row["shard"], [m for m in row["members"] if m["name"] == name][0]


# ------------------------------------------------------------------------------ usage, help

def test_help_and_usage_errors(capsys, tmp_path):
    assert run(capsys, "--help")[0] == 0
    for cmd in ("ls", "info", "head", "show", "query", "stats", "verify", "export-audio",
                "rejects", "reindex"):
        code, out, _ = run(capsys, cmd, "--help")
        assert code == 0 and "usage: shardcache shards " + cmd in out
    assert run(capsys)[0] == 2  # no command
    code, _, err = run(capsys, "info")  # missing DIR: argparse usage error
    assert code == 2 and "DIR" in err
    missing = tmp_path / "no-such-cache"
    code, _, err = run(capsys, "info", missing)
    assert code == 2 and str(missing) in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "query", tmp_path / "empty", "--where", "has_image")
    assert code == 2 and "not a shardcache cache" in err


def test_subprocess_python_m_shards(clean_cache):
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-m", "shardcache", "shards", "info", str(clean_cache)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "samples:" in r.stdout and FINGERPRINT in r.stdout and "\x1b[" not in r.stdout


# ------------------------------------------------------------------------- ls, info, rejects

def test_ls(capsys, clean_cache):
    code, out, _ = run(capsys, "ls", clean_cache)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["shard", "samples", "size", "sha256"]
    assert lines[1].split()[:2] == ["shard-r0000-000000.tar", "3"]
    assert lines[2].split()[:2] == ["shard-r0000-000001.tar", "2"]
    data = run_json(capsys, "ls", clean_cache)
    manifest = shards.read_manifest(clean_cache)
    assert data["source"] == "manifest" and data["total"]["samples"] == 5
    assert [e["sha256"] for e in data["shards"]] == [s["sha256"] for s in manifest["shards"]]
    # shard paths or a glob: counted from the tar headers
    data = run_json(capsys, "ls", str(clean_cache / "shard-r0000-*.tar"))
    assert data["source"] == "tars"
    assert [(Path(e["path"]).name, e["samples"]) for e in data["shards"]] == [
        ("shard-r0000-000000.tar", 3), ("shard-r0000-000001.tar", 2)]
    assert [e["bytes"] for e in data["shards"]] == [s["bytes"] for s in manifest["shards"]]
    code, _, err = run(capsys, "ls", str(clean_cache / "shard-r9999-*.tar"))
    assert code == 2 and "no files match" in err


def test_ls_truncated_tar(capsys, cache):
    p = cache / "shard-r0000-000001.tar"
    p.write_bytes(p.read_bytes()[:150_000])
    code, out, _ = run(capsys, "ls", p, cache / "shard-r0000-000000.tar")
    assert code == 1 and "truncated" in out and "1 unreadable" in out


def test_info(capsys, clean_cache):
    info = run_json(capsys, "info", clean_cache)
    assert info["samples"] == 5 and info["shards"] == 2 and info["images"] == 3
    assert info["sample_rates"] == {"16000": 3, "24000": 2}
    assert info["audio_hours"] == pytest.approx(sum(s[1] for s in SAMPLES.values()) / 3600)
    assert info["bytes"] == sum(p.stat().st_size for p in clean_cache.glob("shard-*.tar"))
    assert info["encoders"] == ENCODERS and info["fingerprint"] == FINGERPRINT
    assert info["rejected"] == 1 and info["rejects_by_reason"] == {"unreadable_audio": 1}
    assert info["speakers"] == 3 and info["warnings"] == []
    code, out, _ = run(capsys, "info", clean_cache)
    assert code == 0
    for text in ("samples:", "16000 Hz (3), 24000 Hz (2)", FINGERPRINT, "encoder codec",
                 "test-codec", "unreadable_audio", "images:"):
        assert text in out


def test_rejects(capsys, clean_cache):
    data = run_json(capsys, "rejects", clean_cache)
    assert data["total"] == 1 and data["by_reason"] == {"unreadable_audio": 1}
    assert data["rows"] == [dict(key="utt-bad", source="audio/bad.wav", reason="unreadable_audio",
                                 detail="not a RIFF file")]
    code, out, _ = run(capsys, "rejects", clean_cache, "--reason", "unreadable_audio")
    assert code == 0 and "utt-bad" in out and "not a RIFF file" in out
    assert run_json(capsys, "rejects", clean_cache, "--reason", "too_short")["rows"] == []
    code, _, err = run(capsys, "rejects", clean_cache, "--reason", "no_such_reason")
    assert code == 2 and "unknown reason" in err


# ----------------------------------------------------------------------------- head, show

def test_head_and_show(capsys, clean_cache):
    samples = run_json(capsys, "head", clean_cache, "-n", "2")
    assert [s["key"] for s in samples] == ["utt-a", "utt-b"]
    b = samples[1]
    arrays = make_arrays("utt-b")
    assert b["text"] == SAMPLES["utt-b"][5] and b["json"]["speaker"] == "bob"
    assert b["fields"]["n_frames"] == arrays["codes.npy"].shape[1] and b["fields"]["has_image"]
    members = {m["name"]: m for m in b["members"]}
    assert set(members) == {"json", "tensors.npz", "codes.npy", "audio.npy", "input_ids.npy", "latents.npy"}
    assert members["codes.npy"]["member"] == "tensors.npz" and members["latents.npy"]["member"] is None
    lat = arrays["latents.npy"].astype(np.float64)
    m = members["latents.npy"]
    assert m["shape"] == [16, 1, 8, 8] and m["dtype"] == "<f2" and m["bytes"] == lat.size * 2
    assert (m["min"], m["max"]) == (lat.min(), lat.max())
    assert m["mean"] == pytest.approx(lat.mean()) and m["std"] == pytest.approx(lat.std())
    codes = members["codes.npy"]
    assert codes["shape"] == [8, arrays["codes.npy"].shape[1]] and codes["dtype"] == "<i2"
    assert (codes["min"], codes["max"]) == (arrays["codes.npy"].min(), arrays["codes.npy"].max())
    assert "mean" not in codes

    code, out, _ = run(capsys, "show", clean_cache, "utt-c")
    assert code == 0
    for text in ("utt-c", "shard-r0000-000000.tar", "latents.npy", "(16, 1, 8, 8)", "float16",
                 "codes.npy", "int16", "text: " + SAMPLES["utt-c"][5], '"speaker": "alice"'):
        assert text in out
    assert [s["key"] for s in run_json(capsys, "show", clean_cache, "utt-e", "utt-a")] == ["utt-e", "utt-a"]
    code, _, err = run(capsys, "show", clean_cache, "utt-zzz")
    assert code == 1 and "utt-zzz" in err
    assert run_json(capsys, "head", clean_cache, "-n", "0") == []
    assert len(run_json(capsys, "head", clean_cache, "-n", "99")) == 5


def test_export_audio(capsys, clean_cache, tmp_path):
    import soundfile as sf
    out_wav = tmp_path / "utt-c.wav"
    code, out, _ = run(capsys, "export-audio", clean_cache, "utt-c", out_wav)
    assert code == 0 and str(out_wav) in out
    data, sr = sf.read(out_wav, dtype="int16")
    assert sr == 24000 and sf.info(out_wav).subtype == "PCM_16"
    np.testing.assert_array_equal(data, make_arrays("utt-c")["audio.npy"])
    code, _, err = run(capsys, "export-audio", clean_cache, "nope", tmp_path / "x.wav")
    assert code == 1 and "nope" in err
    code, _, err = run(capsys, "export-audio", clean_cache, "utt-c", tmp_path / "missing-dir" / "x.wav")
    assert code == 2 and "missing-dir" in err


# ---------------------------------------------------------------------------------- query

@pytest.mark.parametrize("expr, keys", [
    ("duration_s > 5 AND has_image", ["utt-c"]),
    ("speaker = 'bob'", ["utt-b", "utt-e"]),
    ("speaker != 'bob' AND NOT has_image", ["utt-a", "utt-d"]),
    ("not has_image and duration_s < 2", ["utt-a"]),
    ("duration_s > 1 AND duration_s <= 6", ["utt-b", "utt-c"]),
    ("(speaker = 'alice' OR speaker = 'carol') AND n_frames >= 150", ["utt-c", "utt-d"]),
    ("sample_rate IN (24000) OR key = 'utt-a'", ["utt-a", "utt-c", "utt-e"]),
    ("speaker NOT IN ('alice', 'bob')", ["utt-d"]),
    ("has_image = false", ["utt-a", "utt-d"]),
    ("n_text_tokens > n_codebooks", ["utt-b", "utt-c", "utt-d"]),
    ("-1 < duration_s AND shard = 'shard-r0000-000001.tar'", ["utt-d", "utt-e"]),
    ("key LIKE 'utt-_' AND duration_s BETWEEN 2 AND 6", ["utt-b", "utt-c"]),
    ("duration_s > 100", []),
])
def test_query(capsys, clean_cache, expr, keys):
    data = run_json(capsys, "query", clean_cache, "--where", expr)
    assert sorted(r["key"] for r in data["rows"]) == keys and data["count"] == len(keys)
    assert all(set(r) == {"key", "shard", "duration_s", "n_frames", "has_image", "speaker"}
               for r in data["rows"])
    code, out, _ = run(capsys, "query", clean_cache, "--where", expr, "--count")
    assert code == 0 and out.strip() == str(len(keys))


def test_query_output_options(capsys, clean_cache):
    code, out, _ = run(capsys, "query", clean_cache, "--where", "duration_s > 5 and has_image")
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["key", "shard", "duration_s", "n_frames", "has_image", "speaker"]
    assert [r.split()[0] for r in rows] == ["utt-c"]
    data = run_json(capsys, "query", clean_cache, "--where", "has_image", "--columns", "key,duration_s",
                    "--sort", "duration_s", "--desc", "--limit", "2")
    assert data == {"count": 3, "rows": [{"key": "utt-c", "duration_s": 6.0},
                                         {"key": "utt-b", "duration_s": 2.5}]}
    code, _, err = run(capsys, "query", clean_cache, "--where", "has_image", "--columns", "key,members")
    assert code == 2 and "members" in err
    assert run_json(capsys, "query", clean_cache)["count"] == 5  # no condition: every row


# where a message is DuckDB's own, each version's wording is accepted (duckdb 1.3, the floor, and 2.x)
@pytest.mark.parametrize("expr, message", [
    ("duration_s > 1; DROP TABLE x", ("more than one statement", "Expected a single SELECT statement")),
    ("key IN (SELECT column0 FROM read_csv('/etc/passwd'))", "disabled"),
    ("key IN (SELECT * FROM read_text('PWNED'))", "disabled"),
    ("durration_s > 1", "duration_s"),
    ("1 < duration_s <= 6", ("Chained comparisons", 'syntax error at or near "<="')),
    ("speaker = 3 AND duration_s + 'x' > 1", "--where"),
    ("duration_s >", "--where"),
    ("(" * 500 + "has_image" + ")" * 500, ""),
])
def test_query_rejects_unsafe_or_invalid(capsys, clean_cache, tmp_path, monkeypatch, expr, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "query", clean_cache, "--where", expr)
    if expr.startswith("((("):  # deep nesting: either answered or refused, never a crash
        assert code in (0, 2)
        return
    messages = (message,) if isinstance(message, str) else message
    assert code == 2 and any(m in err for m in messages) and out == "", (code, err)
    assert not (tmp_path / "PWNED").exists()


# ---------------------------------------------------------------------------------- stats

def test_stats_and_plot(capsys, clean_cache, tmp_path):
    from PIL import Image
    png = tmp_path / "stats.png"
    data = run_json(capsys, "stats", clean_cache, "--plot", png)
    durations = np.array([s[1] for s in SAMPLES.values()])
    d = data["distributions"]["duration_s"]
    assert d["count"] == 5 and d["mean"] == pytest.approx(durations.mean())
    assert d["p50"] == pytest.approx(np.median(durations)) and d["max"] == 7.5 and d["min"] == 0.5
    frames = [make_arrays(k)["codes.npy"].shape[1] for k in SAMPLES]
    assert data["distributions"]["n_frames"]["mean"] == pytest.approx(np.mean(frames))
    tokens = [make_arrays(k)["input_ids.npy"].shape[0] for k in SAMPLES]
    assert data["distributions"]["n_text_tokens"]["p95"] == pytest.approx(np.percentile(tokens, 95))
    lat = np.stack([make_arrays(k)["latents.npy"].astype(np.float64) for k in SAMPLES if SAMPLES[k][4]])
    per_channel = lat.transpose(1, 0, 2, 3, 4).reshape(16, -1)
    chans = data["latents"]["channels"]
    assert data["latents"]["samples_read"] == 3 and len(chans) == 16
    np.testing.assert_allclose([c["mean"] for c in chans], per_channel.mean(1), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose([c["std"] for c in chans], per_channel.std(1), rtol=1e-9)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as im:
        im.load()
        assert im.format == "PNG" and im.size[0] >= 800 and im.size[1] >= 500

    code, out, _ = run(capsys, "stats", clean_cache, "--max_samples", "1")
    assert code == 0 and "duration (s)" in out and "1 of 3 image samples" in out
    sub = run_json(capsys, "stats", clean_cache, "--where", "not has_image")
    assert sub["samples"] == 2 and sub["latents"]["image_samples"] == 0
    code, _, err = run(capsys, "stats", clean_cache, "--plot", tmp_path / "nodir" / "x.png")
    assert code == 2 and "nodir" in err


# --------------------------------------------------------------------------------- verify

def test_verify_clean(capsys, clean_cache):
    for extra in ([], ["--deep"]):
        code, out, _ = run(capsys, "verify", clean_cache, *extra)
        assert code == 0 and out.startswith("OK: 2 shard(s), 5 sample(s)"), out
    report = run_json(capsys, "verify", clean_cache, "--deep")
    assert report["ok"] and report["problems"] == [] and report["samples_checked"] == 5
    # shard paths / a glob: each tar scanned, decoded and compared with its directory's manifest
    code, out, _ = run(capsys, "verify", str(clean_cache / "shard-r*-*.tar"), "--deep")
    assert code == 0 and "OK: 2 shard(s)" in out


@pytest.mark.parametrize("deep", [False, True])
def test_verify_flipped_tensor_byte(capsys, cache, deep):
    shard, m = member(cache, "utt-b", "latents.npy")
    path = cache / shard
    data = bytearray(path.read_bytes())
    data[m["offset"] + m["size"] // 2] ^= 0x40
    path.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", cache, *(["--deep"] if deep else []))
    assert code == 1
    line = [ln for ln in out.splitlines() if "'utt-b'" in ln]
    assert line and shard in line[0] and "sha256 mismatch" in line[0], out
    assert "FAILED" in out
    report = run_json_failing(capsys, "verify", cache, "--deep")
    assert {(p["shard"], p["sample"]) for p in report["problems"]} == {(shard, None), (shard, "utt-b")}


@pytest.mark.parametrize("deep", [False, True])
def test_verify_truncated_tar(capsys, cache, deep):
    path = cache / "shard-r0000-000001.tar"
    path.write_bytes(path.read_bytes()[:150_000])  # cuts into utt-d's audio; utt-e is lost
    code, out, _ = run(capsys, "verify", cache, *(["--deep"] if deep else []))
    assert code == 1
    assert "shard-r0000-000001.tar: size 150000 bytes" in out
    assert "shard-r0000-000001.tar: sample 'utt-d':" in out and "truncated" in out
    assert "sample 'utt-e'" in out
    assert "shard-r0000-000000.tar" not in out  # the intact shard is not blamed


def test_verify_missing_shard(capsys, cache):
    (cache / "shard-r0000-000000.tar").unlink()
    code, out, _ = run(capsys, "verify", cache)
    assert code == 1
    assert "shard-r0000-000000.tar: missing" in out and "'utt-a'" in out


def test_verify_extra_shard(capsys, cache):
    shutil.copy(cache / "shard-r0000-000001.tar", cache / "shard-r0001-000000.tar")
    code, out, _ = run(capsys, "verify", cache)
    assert code == 1 and "shard-r0001-000000.tar: extra shard" in out
    report = run_json_failing(capsys, "verify", cache)
    assert [p["shard"] for p in report["problems"]] == ["shard-r0001-000000.tar"]


def test_verify_index_disagrees_with_tar(capsys, cache):
    """An index row whose member offset is wrong: quick verify finds the index changed since it was
    written (integrity.json); --deep (which compares rows) names the row."""
    from shards.index import rows_to_table, write_parquet_atomic
    rows = shards.read_index(cache).to_pylist()
    rows[0]["members"][0]["offset"] += 512
    write_parquet_atomic(rows_to_table(rows), cache / "index.parquet")
    code, out, _ = run(capsys, "verify", cache)
    assert code == 1 and "index.parquet does not match integrity.json" in out
    code, out, _ = run(capsys, "verify", cache, "--deep")
    name = rows[0]["members"][0]["name"]
    assert code == 1 and f"sample 'utt-a': member {name}: offset" in out


def test_verify_tmp_leftover_and_strict(capsys, cache):
    (cache / "shard-r0000-000002.tar.tmp").write_bytes(b"partial")
    code, out, _ = run(capsys, "verify", cache)
    assert code == 0 and "shard-r0000-000002.tar.tmp" in out and "warning" in out
    code, out, _ = run(capsys, "verify", cache, "--strict")
    assert code == 1 and "FAILED" in out


def test_verify_shard_paths_against_manifest(capsys, cache):
    """Given tar paths, a changed tar is still caught through its directory's manifest/index."""
    shard, m = member(cache, "utt-e", "codes.npy")
    data = bytearray((cache / shard).read_bytes())
    data[m["offset"]] ^= 0x01
    (cache / shard).write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", cache / shard)
    assert code == 1 and f"{shard}: sample 'utt-e': sha256 mismatch" in out


# -------------------------------------------------------------------------------- reindex

def test_reindex_reproduces_index(capsys, cache):
    before = shards.read_index(cache).to_pylist()
    rejects = shards.read_rejects(cache).to_pylist()
    manifest = shards.read_manifest(cache)
    (cache / "index.parquet").unlink()
    for part in (cache / "parts").glob("*.index.parquet"):
        part.unlink()
    code, out, _ = run(capsys, "reindex", cache)
    assert code == 0 and "samples:" in out
    assert shards.read_index(cache).to_pylist() == before
    after = shards.read_manifest(cache)
    for k in ("encoders", "fingerprint", "config", "shards", "counts", "format_version"):
        assert after[k] == manifest[k], k
    assert shards.read_rejects(cache).to_pylist() == rejects and len(rejects) == 1
    # the rebuilt parts merge to the same cache files
    assert sorted(p.name for p in (cache / "parts").glob("*.index.parquet")) == [
        "shard-r0000-000000.index.parquet", "shard-r0000-000001.index.parquet"]
    shards.merge_parts(cache, {k: manifest[k] for k in ("encoders", "fingerprint", "config")})
    assert shards.read_index(cache).to_pylist() == before
    assert run(capsys, "verify", cache, "--deep")[0] == 0


def test_reindex_after_removing_a_shard(capsys, cache):
    (cache / "shard-r0000-000000.tar").unlink()
    assert run(capsys, "verify", cache)[0] == 1
    dry = run_json(capsys, "reindex", cache, "--dry_run")
    assert dry["index_change"] == dict(before=5, after=2, added=0, removed=3, changed=0)
    assert (cache / "parts" / "shard-r0000-000000.index.parquet").exists()
    report = run_json(capsys, "reindex", cache)
    assert report["samples"] == 2 and len(report["stale_parts_removed"]) == 1
    assert not (cache / "parts" / "shard-r0000-000000.index.parquet").exists()
    assert sorted(shards.read_index(cache).column("key").to_pylist()) == ["utt-d", "utt-e"]
    assert shards.read_rejects(cache).num_rows == 1  # existing rejects are kept
    assert run(capsys, "verify", cache, "--deep")[0] == 0


def test_reindex_refuses_corrupt_tar(capsys, cache):
    index_before = (cache / "index.parquet").read_bytes()
    path = cache / "shard-r0000-000001.tar"
    path.write_bytes(path.read_bytes()[:150_000])
    code, out, _ = run(capsys, "reindex", cache)
    assert code == 1 and "shard-r0000-000001.tar" in out and "nothing was written" in out
    assert (cache / "index.parquet").read_bytes() == index_before


# --------------------------------------------------------------------------- rich output

def test_rich_output_on_a_terminal(capsys, clean_cache, monkeypatch, tmp_path):
    from shards.commands import _common
    monkeypatch.setattr(_common, "stdout_is_tty", lambda: True)
    for argv in (["ls", clean_cache], ["info", clean_cache], ["show", clean_cache, "utt-b"],
                 ["query", clean_cache, "--where", "has_image"], ["stats", clean_cache],
                 ["rejects", clean_cache], ["verify", clean_cache]):
        code, out, err = run(capsys, *argv)
        assert code == 0, (argv, err)
        assert out.strip(), argv
    code, out, _ = run(capsys, "query", clean_cache, "--where", "has_image")
    assert "┃ key" in out and "utt-c" in out and "3 matching row(s)" in out
    # --json is never decorated, before or after the command
    assert json.loads(run(capsys, "info", clean_cache, "--json")[1])["samples"] == 5
    assert json.loads(run(capsys, "--json", "ls", clean_cache)[1])["total"]["shards"] == 2


def test_help_query_example_works_as_written(clean_cache, capsys):
    """The ``query`` example of ``shardcache shards --help``, run as written on a cache (``cache/``
    replaced by its path): exit 0 and the count the samples table gives (duration > 5 s with an image)."""
    import shlex

    from shards.cli import EPILOG
    lines = [ln.strip() for ln in EPILOG.splitlines() if ln.strip().startswith("shardcache shards query ")]
    assert lines
    want = sum(1 for _, dur, _, _, img, _ in SAMPLES.values() if dur > 5 and img)
    for line in lines:
        argv = [str(clean_cache) if a == "cache/" else a for a in shlex.split(line)[2:]]
        assert main(argv) == 0, line
        assert capsys.readouterr().out.strip() == str(want), line
