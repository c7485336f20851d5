"""``shardcache check``: samples re-derived from the source files with the recorded encoders equal the
cache; codes made by another codec (another seed of the same architecture) are caught, naming the key
and the field."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo" / "samples.jsonl"


def _check(cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardcache", "check", str(cache), "--manifest", str(DEMO),
                           "--samples", "6", *extra], cwd=ROOT, capture_output=True, text=True)


def test_fresh_cache_passes(demo_cache):
    r = _check(demo_cache)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fingerprint matches" in r.stdout and "OK: every array of 6 sample(s) matches" in r.stdout


def test_codes_of_another_codec_seed_are_named(demo_cache, tmp_path):
    from tools.testing import build
    other, _ = build("dac", tmp_path / "models", "tiny", seed=1)  # same architecture, other weights
    r = _check(demo_cache, "--set", f"audio_tokenizer.pretrained={other}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "fingerprint DIFFERS" in r.stdout
    lines = [x for x in r.stdout.splitlines() if x.startswith("MISMATCH")]
    assert lines and all(": codes: " in x for x in lines), r.stdout  # only the codes differ
    from shards import ShardReader
    keys = set(ShardReader(demo_cache).keys)
    assert {x.split()[1].rstrip(":") for x in lines} <= keys


def test_bad_arguments_exit_2(demo_cache, tmp_path):
    r = _check(demo_cache, "--set", "no_such_option=1")
    assert r.returncode == 2 and "no_such_option" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = subprocess.run([sys.executable, "-m", "shardcache", "check", str(empty), "--manifest", str(DEMO)],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "config" in r.stderr


def test_a_changed_array_is_named(demo_cache, tmp_path):
    """Bytes of cached arrays changed (values still valid; latents in one sample, input_ids in
    another): check names each of those samples and fields, and no other (one run for both)."""
    import shutil

    import numpy as np

    from shards import read_index
    cache = tmp_path / "c"
    shutil.copytree(demo_cache, cache)
    rows = read_index(cache).to_pylist()
    changed = {}
    for corrupt in ("latents", "input_ids"):
        row = next(r for r in rows if r["key"] not in changed
                   and any(m["name"] == f"{corrupt}.npy" for m in r["members"]))
        m = next(x for x in row["members"] if x["name"] == f"{corrupt}.npy")
        shard = cache / row["shard"]
        shard.chmod(0o644)
        with open(shard, "r+b") as f:
            f.seek(m["offset"])
            old = np.frombuffer(f.read(4), np.dtype(m["dtype"]))
            f.seek(m["offset"])
            new = (old.astype(np.float32) * 4 + 3).astype(m["dtype"]) if old.dtype.kind == "f" else old ^ 1
            f.write(new.tobytes())
        changed[row["key"]] = corrupt
    r = _check(cache, "--samples", "100")
    assert r.returncode == 1, r.stdout + r.stderr
    named = {x.split()[1].rstrip(":"): x.split(": ")[1] for x in r.stdout.splitlines() if x.startswith("MISMATCH")}
    assert named == changed, r.stdout + r.stderr
