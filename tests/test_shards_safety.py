"""Format safety: compact reproducible tars, safe shard paths, format version, damage caught while reading."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shards
from shards.cli import main
from shards.errors import ShardCorrupt, UnsafePath, UnsupportedFormat
from shards import check_format_version, read_index, read_manifest, safe_shard_path
from shards.kinds import Finite, InRange
from shards.reader import ShardReader, value_checks_from_manifest
from shards.schema import FORMAT_VERSION, INDEX_FILE, MANIFEST_FILE, shard_name

ROOT = Path(__file__).resolve().parents[1]
SHARD0 = shard_name(0, 0)


def arrays(i: int, audio_len: int = 4000, image: bool = True) -> dict:
    rng = np.random.default_rng(i)
    fields = {
        "json": {"text": f"sample {i}", "speaker": f"spk{i % 3}", "sample_rate": 16000,
                 "duration_s": audio_len / 16000},
        "codes.npy": rng.integers(0, 1024, size=(4, 20 + i)).astype(np.int16),
        "audio.npy": rng.integers(-20000, 20000, size=audio_len).astype(np.int16),
        "input_ids.npy": rng.integers(3, 259, size=5 + i).astype(np.int32),
    }
    if image:
        fields["latents.npy"] = rng.normal(size=(16, 1, 4, 4)).astype(np.float16)
    return fields


def build(out: Path, per_shard=(4, 4), audio_len: int = 4000, edit=None) -> Path:
    """A cache of ``sum(per_shard)`` samples ``s000``...; ``edit(key, fields)`` may damage some."""
    i = 0
    for n, count in enumerate(per_shard):
        w = shards.ShardWriter(out, shard_name(0, n))
        for _ in range(count):
            key, fields = f"s{i:03d}", arrays(i, audio_len, image=i % 2 == 0)
            if edit is not None:
                edit(key, fields)
            w.add(key, fields)
            i += 1
        w.commit()
    shards.merge_parts(out, {"codebook_size": 1024, "text_vocab_size": 259, "n_codebooks": 4})
    return out


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("safety") / "cache")


@pytest.fixture
def cache(clean, tmp_path) -> Path:
    return Path(shutil.copytree(clean, tmp_path / "cache", symlinks=True))


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def set_shard_names(cache: Path, mapping: dict[str, str]) -> None:
    """Rewrite index.parquet (bypassing the writer's checks) with shard names renamed, and the integrity
    root with it (a forger who rewrites both: the shard-name gate behind the root is what is tested)."""
    from shards.index import write_root
    t = read_index(cache)
    names = [mapping.get(s, s) for s in t.column("shard").to_pylist()]
    t = t.set_column(t.schema.get_field_index("shard"), "shard", pa.array(names, pa.string()))
    pq.write_table(t, cache / INDEX_FILE)
    write_root(cache, read_manifest(cache)["cache_id"])


def set_manifest(cache: Path, **fields) -> None:
    m = json.loads((cache / MANIFEST_FILE).read_text())  # raw: it may hold a version read_manifest refuses
    m.update(fields)
    (cache / MANIFEST_FILE).write_text(json.dumps(m))


# ----------------------------------------------------------------------------- 1. no PAX headers

def test_shards_have_no_pax_headers_and_no_wasted_bytes(tmp_path):
    def write(out):
        w = shards.ShardWriter(out, SHARD0)
        for i in range(6):  # audio.npy ~360 KB
            w.add(f"k{i}", arrays(i, audio_len=180_000))
        w.commit()
        return out / SHARD0

    a, b = write(tmp_path / "a"), write(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()  # reproducible
    with tarfile.open(a) as tf:
        infos = tf.getmembers()
        assert not tf.pax_headers
    assert infos and all(i.isfile() and "PaxHeader" not in i.name for i in infos)
    assert all(type(i.mtime) is int and i.mtime == 0 and not i.pax_headers for i in infos)
    assert b"PaxHeader" not in a.read_bytes()
    payload = sum(i.size for i in infos)
    assert a.stat().st_size < 1.02 * payload, (a.stat().st_size, payload)
    rows, _, _ = shards.scan_shard(a)
    assert [r["key"] for r in rows] == [f"k{i}" for i in range(6)]


def test_long_or_non_ascii_names_still_round_trip(tmp_path):
    """Only a member whose name ustar cannot hold gets a pax header; readers see the right name."""
    key = "caf\u00e9-" + "x" * 120
    w = shards.ShardWriter(tmp_path, SHARD0)
    w.add("plain", arrays(1))
    w.add(key, arrays(2))
    w.commit()
    with tarfile.open(tmp_path / SHARD0) as tf:
        names = [i.name for i in tf.getmembers()]
    assert f"{key}.tensors.npz" in names and "plain.json" in names
    shards.merge_parts(tmp_path, {})
    r = ShardReader(tmp_path, verify_reads=True)
    assert r.get(r.keys.index(key))["codes"].shape == (4, 22)
    import webdataset as wds  # upstream reads the tar too
    got = {s["__key__"]: s for s in wds.WebDataset([str(tmp_path / SHARD0)], shardshuffle=False).decode()}
    assert set(got) == {"plain", key}
    assert np.array_equal(got[key]["tensors.npz"]["codes"], arrays(2)["codes.npy"])
    assert got["plain"]["json"]["text"] == "sample 1"


# ---------------------------------------------------------------------------- 2. safe shard paths

@pytest.mark.parametrize("bad", ["/tmp/x/secret.bin", "../x.tar", "sub/../../x.tar", "sub/x.tar",
                                 "..", ""])
def test_unsafe_shard_names_in_index_are_refused(capsys, cache, bad):
    set_shard_names(cache, {SHARD0: bad})
    with pytest.raises(UnsafePath) as e:
        ShardReader(cache)
    assert str(cache) in str(e.value) and repr(bad) in str(e.value)
    assert isinstance(e.value, ShardCorrupt)
    key = read_index(cache).column("key")[0].as_py()
    for argv in (("show", cache, key), ("head", cache), ("export-audio", cache, key, cache / "o.wav"),
                 ("info", cache), ("verify", cache), ("verify", cache, "--deep")):
        code, out, err = cli(capsys, *argv)
        assert code == 1, argv
        assert repr(bad) in out + err and "refusing" in out + err, (argv, out, err)


def test_unsafe_shard_names_in_manifest_are_refused(capsys, cache):
    m = read_manifest(cache)
    m["shards"][0]["path"] = "../../etc/passwd"
    (cache / MANIFEST_FILE).write_text(json.dumps(m))
    from shards.index import write_root  # sealed as if written so: the name gate behind the root is tested
    write_root(cache, m["cache_id"])
    for argv in (("ls", cache), ("info", cache), ("verify", cache)):
        code, out, err = cli(capsys, *argv)
        assert code == 1 and "'../../etc/passwd'" in out + err and "'..'" in out + err, (argv, out, err)


def test_symlink_out_of_the_cache_is_refused(capsys, cache, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(cache / SHARD0, outside / "file")
    (cache / SHARD0).symlink_to(outside / "file")
    with pytest.raises(UnsafePath, match="symlink"):
        ShardReader(cache)
    with pytest.raises(UnsafePath, match="outside the cache"):
        safe_shard_path(cache, SHARD0)
    for argv in (("show", cache, "s000"), ("verify", cache), ("verify", cache, "--deep"),
                 ("reindex", cache)):
        code, out, err = cli(capsys, *argv)
        assert code == 1 and "symlink" in out + err and SHARD0 in out + err, (argv, out, err)
    # a symlink that stays inside the cache directory is fine
    (cache / SHARD0).unlink()
    (cache / "store").mkdir()
    shutil.move(outside / "file", cache / "store" / SHARD0)
    (cache / SHARD0).symlink_to(Path("store") / SHARD0)
    assert ShardReader(cache, verify_reads=True).get(0)["__key__"] == "s000"
    assert cli(capsys, "verify", cache, "--deep")[0] == 0


def test_writer_refuses_unsafe_names(tmp_path):
    w = shards.ShardWriter(tmp_path, SHARD0)
    w.add("a", arrays(0))
    w.commit()
    t = pq.read_table(tmp_path / "parts" / f"{SHARD0[:-4]}.index.parquet")
    t = t.set_column(1, "shard", pa.array(["../evil.tar"] * t.num_rows, pa.string()))
    with pytest.raises(UnsafePath, match="evil"):
        shards.merge.write_cache_files(tmp_path, t, shards.index.REJECTS_SCHEMA.empty_table(), [], {})


# ---------------------------------------------------------------------------- 3. format version

def test_format_version(capsys, cache):
    assert check_format_version({}, cache) == 1
    assert check_format_version({"format_version": FORMAT_VERSION}, cache) == FORMAT_VERSION
    for bad in ("2", 1.0, True, None, 0, [1]):
        with pytest.raises(UnsupportedFormat, match="not a format version"):
            check_format_version({"format_version": bad}, cache)
    newer = FORMAT_VERSION + 1
    set_manifest(cache, format_version=newer)
    with pytest.raises(UnsupportedFormat) as e:
        ShardReader(cache)
    assert f"format_version {newer}" in str(e.value) and "upgrade shardcache" in str(e.value)
    assert str(cache) in str(e.value)
    for argv in (("info", cache), ("show", cache, "s000"), ("verify", cache), ("ls", cache),
                 ("query", cache, "--where", "has_image"), ("reindex", cache), ("stats", cache)):
        code, out, err = cli(capsys, *argv)
        assert code == 1 and "upgrade shardcache" in err, (argv, out, err)
    set_manifest(cache, format_version=1)
    assert ShardReader(cache).get(0)["__key__"] == "s000"
    (cache / MANIFEST_FILE).unlink()
    assert ShardReader(cache).format_version == 1


# ------------------------------------------------------------------------- 4a. shrinking shards

TRUNCATE_SCRIPT = """
import os, sys
import numpy as np
from shards import ShardReader, ShardCorrupt
cache, mode = sys.argv[1], sys.argv[2]
r = ShardReader(cache)
rows = np.flatnonzero(r.shard_of == 0)
for a in r.views("audio", rows):
    int(a.sum())
path = os.path.join(cache, r.shard_names[0])
os.truncate(path, 1024)
try:
    if mode == "views":
        arrays = r.views("audio", rows[::-1])
    else:
        arrays = [r.get(int(rows[-1]))["audio"]]
    print("NOT CAUGHT", sum(int(a.sum()) for a in arrays))
except ShardCorrupt as e:
    print("CAUGHT", e)
"""


@pytest.mark.parametrize("mode", ["views", "get"])
def test_shard_truncated_while_reading_raises_not_sigbus(cache, mode):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", TRUNCATE_SCRIPT, str(cache), mode], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)  # -7: SIGBUS
    assert r.stdout.startswith("CAUGHT"), r.stdout
    assert SHARD0 in r.stdout and "changed size during reading" in r.stdout
    assert "now 1024 bytes" in r.stdout and "'s003'" in r.stdout


def test_grown_shard_is_fine(cache):
    r = ShardReader(cache)
    rows = np.arange(r.n)
    before = [np.array(a) for a in r.views("codes", rows)]
    with open(cache / SHARD0, "ab") as f:
        f.write(b"\0" * 4096)
    assert all((a == b).all() for a, b in zip(before, r.views("codes", rows)))


# ----------------------------------------------------------------------------- 4b. value checks

def test_code_out_of_range_is_caught(tmp_path):
    def edit(key, fields):
        if key == "s005":
            fields["codes.npy"][2, 7] = 32767
    c = build(tmp_path / "c", edit=edit)
    checks = value_checks_from_manifest(read_manifest(c))
    assert checks["codes"] == InRange(0, 1024) and checks["latents"] == Finite(65504.0)
    r = ShardReader(c, value_checks=checks)
    ok = np.arange(5)
    assert len(r.views("codes", ok)) == 5
    with pytest.raises(ShardCorrupt) as e:
        r.views("codes", np.arange(r.n))
    msg = str(e.value)
    assert "'s005'" in msg and "32767" in msg and "[0, 1024)" in msg and shard_name(0, 1) in msg
    with pytest.raises(ShardCorrupt, match="s005.*32767"):
        r.get(5)
    assert ShardReader(c).get(5)["codes"].max() == 32767  # no checks asked: read as stored


def test_non_finite_latents_are_caught(tmp_path):
    def edit(key, fields):
        if key == "s002":
            fields["latents.npy"][3, 0, 1, 1] = np.nan
        if key == "s004":
            fields["latents.npy"][0, 0, 0, 0] = np.inf
    c = build(tmp_path / "c", edit=edit)
    r = ShardReader(c, value_checks=value_checks_from_manifest(read_manifest(c)))
    assert sum(a is not None for a in r.views("latents", np.array([0, 1, 3]))) == 1
    with pytest.raises(ShardCorrupt, match="'s002'.*latents has 1 non-finite"):
        r.views("latents", np.arange(r.n))
    with pytest.raises(ShardCorrupt, match="'s004'.*non-finite"):
        r.get(4)


def test_value_checks_argument_is_validated(clean):
    for bad in ({"codes": (5, 5)}, {"codes": (0.0, 1)}, {"codes": "positive"}, {"codes.npy": (0, 4)}):
        with pytest.raises(ValueError, match="value_checks"):
            ShardReader(clean, value_checks=bad)


# ----------------------------------------------------------------------------- 4c. verify_reads

def test_verify_reads(cache):
    r = ShardReader(cache, verify_reads=True)
    for f in ("codes", "audio", "input_ids", "latents"):
        r.views(f, np.arange(r.n))
    for i in range(r.n):
        r.get(i)
    r.verify_rows(np.arange(r.n))
    r.close()
    # flip one byte of s006's audio payload, in place (same size, same offsets)
    shard, m = next((row["shard"], m) for row in read_index(cache).to_pylist() if row["key"] == "s006"
                    for m in row["members"] if m["name"] == "audio.npy")
    with open(cache / shard, "r+b") as f:
        f.seek(m["offset"] + 10)
        b = f.read(1)
        f.seek(m["offset"] + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    r = ShardReader(cache, verify_reads=True, checksums=False)  # the sha256 check alone
    r.views("codes", np.arange(5))  # other samples: fine
    with pytest.raises(ShardCorrupt, match="'s006'.*sha256 mismatch"):
        r.views("codes", np.arange(r.n))  # codes untouched, but the sample's bytes changed
    with pytest.raises(ShardCorrupt, match="'s006'.*sha256 mismatch"):
        r.get(6)
    # the member checksums (on by default) name the member that changed
    with pytest.raises(ShardCorrupt, match="'s006' member audio.npy: checksum mismatch"):
        ShardReader(cache).get(6)
    assert ShardReader(cache, checksums=False).get(6)["__key__"] == "s006"  # nothing checked


def test_pickled_reader_keeps_checks(clean):
    import pickle
    r = ShardReader(clean, value_checks={"codes": (0, 1024)}, verify_reads=True)
    r.field("codes")
    r.drop_index()
    r2 = pickle.loads(pickle.dumps(r))
    assert len(r2.views("codes", np.arange(r2.n))) == r2.n
    assert r2.value_checks == {"codes": InRange(0, 1024)} and r2.verify_reads


LOADER_TRUNCATE_SCRIPT = """
import os, sys
from shards import ShardCorrupt
from loaders import Order, ShardLoader, Workers
cache, workers = sys.argv[1], int(sys.argv[2])
loader = ShardLoader(cache, batch_size=1, order=Order(shuffle=False),
                     workers=Workers(num_workers=workers, prefetch_factor=1, persistent_workers=False))
it = iter(loader)
first = next(it)
shard = sorted(p for p in os.listdir(cache) if p.endswith(".tar"))[-1]
os.truncate(os.path.join(cache, shard), 1024)   # the epoch's last shard shrinks mid-epoch
try:
    n = sum(1 for _ in it)
    print("NOT CAUGHT", n)
except ShardCorrupt as e:
    print("CAUGHT", e)
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_epoch_with_a_shard_truncated_mid_epoch_raises_shard_corrupt(cache, workers):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", LOADER_TRUNCATE_SCRIPT, str(cache), str(workers)], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])  # -7 would be SIGBUS
    assert r.stdout.startswith("CAUGHT"), r.stdout
    # named: the shard and the sample (seen by the per-batch stat: "size changed"; by a short read:
    # "the file ends at byte")
    assert "shard-r0000-000001.tar" in r.stdout and "sample '" in r.stdout, r.stdout
    assert "its size changed from" in r.stdout or "truncated shard" in r.stdout, r.stdout
