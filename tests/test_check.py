"""``shardcache check``: samples re-derived from the source files with the recorded encoders equal the
cache; codes made by another codec (another seed of the same architecture) are caught, naming the key
and the field."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo" / "samples.jsonl"


def _check(cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardcache", "check", str(cache), "--manifest", str(DEMO),
                           "--samples", "6", *extra], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.long  # make test-long; test_a_changed_array_is_named and test_stage_one's test_check_uses_the_recorded_call run check in make test
def test_fresh_cache_passes(demo_cache):
    r = _check(demo_cache)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fingerprint matches" in r.stdout and "OK: every array of 6 sample(s) matches" in r.stdout


@pytest.mark.long  # make test-long; test_a_changed_array_is_named covers a named difference in make test
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
    assert r.returncode == 2 and f"{empty}: not a shardcache cache" in r.stderr, r.stderr


@pytest.mark.long  # make test-long; test_stage_one's test_check_uses_the_recorded_call (a changed record is named) runs in make test
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


def _outside_root_cache(tmp_path: Path, tiny_config) -> tuple[Path, Path]:
    """4 demo rows (3 readable) in a manifest of another folder naming their media by absolute path (outside the
    manifest's folder), precomputed with ``allow_outside_root: true`` (tiny_config has it)."""
    import json

    from precompute.job import run
    rows = [json.loads(x) for x in DEMO.read_text().splitlines()[:4]]
    for r in rows:
        r["audio"] = str(DEMO.parent / r["audio"])
    manifest = tmp_path / "elsewhere" / "rows.jsonl"
    manifest.parent.mkdir()
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"
    summary, _ = run(manifest, cache, tiny_config, progress=False)
    assert summary.kept == 3  # (one demo file is unreadable on purpose)
    return cache, manifest


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_fresh_cache_passes covers check in make test
def test_check_reads_the_manifest_as_precompute_did_and_says_n_of_m(tmp_path, tiny_config):
    """A cache made with allow_outside_root: check reads its rows with that option (not: every row
    refused, 0 compared, OK), says how many it compared of how many, and still catches damaged codes;
    with a manifest none of whose rows is in the cache it fails instead of printing OK."""
    import shutil

    import numpy as np

    from shards import read_index
    cache, manifest = _outside_root_cache(tmp_path, tiny_config)
    cmd = [sys.executable, "-m", "shardcache", "check", str(cache), "--manifest", str(manifest), "--samples", "2"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "re-derived 2 of 3 cached sample(s)" in r.stdout and "OK: every array of 2 sample(s)" in r.stdout
    # damaged codes in every sample are caught
    bad = tmp_path / "bad"
    shutil.copytree(cache, bad)
    for row in read_index(bad).to_pylist():
        m = next(x for x in row["members"] if x["name"] == "codes.npy")
        (bad / row["shard"]).chmod(0o644)
        with open(bad / row["shard"], "r+b") as f:
            f.seek(m["offset"])
            old = np.frombuffer(f.read(2), np.int16)
            f.seek(m["offset"])
            f.write((old ^ 1).tobytes())
    r = subprocess.run([*cmd[:4], str(bad), *cmd[5:7], "--samples", "3"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and r.stdout.count(": codes: ") == 3, r.stdout + r.stderr
    # a manifest that holds none of the cache's keys: nothing compared is a failure, not OK
    other = tmp_path / "other.jsonl"
    other.write_text(DEMO.read_text().splitlines()[10] + "\n")
    r = subprocess.run([*cmd[:6], str(other)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and "re-derived 0 of 3" in r.stdout and "OK" not in r.stdout, r.stdout + r.stderr
