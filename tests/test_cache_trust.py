"""Issue 30 (slice b): the writer lock, the integrity root, one key per tar, reruns that follow the manifest.

Each test goes through the real entry points (the precompute command line, ``CacheLock``, the
loader, ``shardcache shards verify``) on files the test damages or rewrites itself.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DEMO, ROOT

AUDIO = "audio/spk-us-0001.flac"      # 2.3 s, relative to --root DEMO
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _argv(manifest, cache, tiny_models, *extra) -> list[str]:
    """``shardcache precompute`` arguments with the tiny models."""
    return ["--manifest", str(manifest), "--cache", str(cache), "--config", str(ROOT / "configs" / "precompute.yaml"),
            f"--audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}",
            f"--image_encoder.pretrained={tiny_models / 'wan-tiny'}",
            "--image_size=64", "--device=cpu", "--no_progress", "--root", str(DEMO), *extra]


def _precompute_here(capsys, manifest, cache, tiny_models, *extra) -> tuple[int, str, str]:
    """The command line's entry point in this process: exit status, stdout, stderr."""
    from precompute.cli import main
    capsys.readouterr()
    rc = main(_argv(manifest, cache, tiny_models, *extra))
    out, err = capsys.readouterr()
    return rc, out, err


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- the writer lock -----------------------------------------------------------------------------------

@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_kill_9_of_a_job_with_two_decode_workers_then_an_immediate_rerun(tiny_models, tmp_path, capsys, caplog):
    """Decode workers inherited the job's flock and outlived its kill -9 (parent pid 1): every rerun
    was refused naming the dead pid. Now the workers die with the job and the rerun takes over."""
    cache = tmp_path / "cache"
    manifest = _write_jsonl(tmp_path / "m.jsonl", [{"key": f"k{i}", "text": "Hello.", "audio": AUDIO} for i in range(400)])
    job = subprocess.Popen([sys.executable, "-m", "shardcache", "precompute",
                            *_argv(manifest, cache, tiny_models, "--num_workers=2")],
                           cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    workers: list[int] = []
    while time.monotonic() < deadline and job.poll() is None and len(workers) < 2:
        time.sleep(0.1)
        workers = _children(job.pid)
    assert len(workers) >= 2, f"no decode workers seen: {job.poll()}"
    time.sleep(1.0)                                                  # the workers decode
    job.send_signal(signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), "decode workers outlived their job"
    caplog.set_level("INFO", logger="precompute")
    small = _write_jsonl(tmp_path / "small.jsonl", [{"key": "k0", "text": "Hello.", "audio": AUDIO}])
    rc, out, err = _precompute_here(capsys, small, cache, tiny_models, "--num_workers=0")
    assert rc == 0, err[-2000:]
    assert "is being written by another precompute job" not in err
    assert f"pid {job.pid} " in caplog.text and "lock taken over" in caplog.text   # the dead job is named


def test_two_clean_runs_in_a_row_log_no_takeover(tmp_path, caplog):
    """After every clean run the next one logged "previous writer is gone; lock taken over"."""
    from precompute.lock import CacheLock
    cache = tmp_path / "cache"
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", f"from precompute.lock import CacheLock; "
                            f"CacheLock({str(cache)!r}).acquire().release()"], cwd=ROOT, env=ENV,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    caplog.set_level("INFO", logger="precompute")
    with CacheLock(cache):
        pass
    assert "taken over" not in caplog.text


def test_the_lock_is_not_inherited_by_a_forked_child(tmp_path):
    """A forked child of the holder (a decode worker) holds nothing once its parent is gone: while the
    child lives on, another process takes the lock."""
    from precompute.lock import CacheLock
    cache = tmp_path / "cache"
    code = (f"import os, sys, time\nfrom precompute.lock import CacheLock\nCacheLock({str(cache)!r}).acquire()\n"
            "pid = os.fork()\nif pid == 0:\n    time.sleep(60); os._exit(0)\n"
            "print(pid, flush=True)\nos._exit(0)\n")            # the holder dies at once, its child stays
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    child = int(holder.stdout.readline().strip())
    holder.wait()
    try:
        assert _alive(child)
        CacheLock(cache).acquire().release()
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_same_process_cannot_take_its_own_lock_twice(tmp_path):
    """Record locks never conflict within one process; the lock says so instead of sharing."""
    from precompute.lock import CacheLock, CacheLocked
    with CacheLock(tmp_path):
        with pytest.raises(CacheLocked, match="already being written by this process"):
            CacheLock(tmp_path).acquire()
    CacheLock(tmp_path).acquire().release()


# ---- the integrity root: index.parquet and manifest.json checked on open --------------------------------

@pytest.fixture(scope="module")
def small_cache(tmp_path_factory) -> Path:
    """A cache of 24 samples in the format stage one writes (no model needed)."""
    from test_train_support import make_cache
    return make_cache(tmp_path_factory.mktemp("small") / "c", n=24, seed=0)


@pytest.fixture()
def copy(small_cache, tmp_path) -> Path:
    import shutil
    c = tmp_path / "c"
    shutil.copytree(small_cache, c)
    return c


def _rewrite_index(cache: Path, edit) -> None:
    """Rewrite index.parquet with one value changed by ``edit(rows)`` (as a hand edit would)."""
    import pyarrow.parquet as pq
    from shards.index import read_index, rows_to_table
    rows = read_index(cache).to_pylist()
    edit(rows)
    pq.write_table(rows_to_table(rows), cache / "index.parquet")


def _verify_quick(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardcache", "shards", "verify", str(cache), "--no_progress"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)


def _set(member: str, key: str, value):
    def edit(rows):
        for m in rows[3]["members"]:
            if m["name"] == member:
                m[key] = value
                return
        raise AssertionError(f"no member {member}")
    return edit


@pytest.mark.parametrize("edit", [
    _set("input_ids.npy", "dtype", "int16"),                        # one dtype
    _set("input_ids.npy", "shape", [1]),                            # one shape
    _set("input_ids.npy", "name", "labels.npy"),                    # one member name
], ids=["dtype", "shape", "member-name"])
def test_one_edited_index_value_is_refused_by_open_quick_verify_and_the_loader(copy, edit):
    from loaders import ShardLoader
    from shards import ShardCorrupt, read_cache_id
    read_cache_id(copy)                                              # intact: opens
    assert _verify_quick(copy).returncode == 0
    _rewrite_index(copy, edit)
    with pytest.raises(ShardCorrupt, match=r"index.parquet does not match integrity.json.*`shardcache shards reindex"):
        read_cache_id(copy)
    r = _verify_quick(copy)
    assert r.returncode == 1 and "index.parquet does not match integrity.json" in r.stdout, r.stdout + r.stderr
    with pytest.raises(ShardCorrupt, match="index.parquet does not match"):
        ShardLoader(copy, batch_size=4, seed=0)


@pytest.mark.parametrize("name", ["index.parquet", "manifest.json"])
def test_eight_flipped_bits_are_caught(copy, name):
    """8 random bit flips in index.parquet gave other batches with every member checksum passing."""
    import random
    from shards import ShardCorrupt, read_cache_id
    p = copy / name
    data = bytearray(p.read_bytes())
    rng = random.Random(7)
    for _ in range(8):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    p.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match=f"{name} does not match integrity.json"):
        read_cache_id(copy)
    r = _verify_quick(copy)
    assert r.returncode == 1 and f"{name} does not match integrity.json" in r.stdout, r.stdout + r.stderr


def test_a_manifest_cache_id_edited_to_match_a_checkpoint_is_refused(copy, tmp_path):
    """The loader took the cache id from manifest.json without checking it: editing it made a resume
    from another cache's checkpoint pass."""
    from shards import ShardCorrupt, read_cache_id
    m = json.loads((copy / "manifest.json").read_text())
    m["cache_id"] = "0123456789abcdef"
    (copy / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
    with pytest.raises(ShardCorrupt, match="manifest.json does not match integrity.json"):
        read_cache_id(copy)
    (copy / "integrity.json").unlink()
    with pytest.raises(ShardCorrupt, match=r"integrity.json is missing.*`shardcache shards reindex"):
        read_cache_id(copy)
    r = subprocess.run([sys.executable, "-m", "shardcache", "shards", "reindex", str(copy), "--no_progress"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert read_cache_id(copy) == json.loads((copy / "manifest.json").read_text())["cache_id"] != "0123456789abcdef"


@pytest.mark.long  # make test-long; test_a_manifest_cache_id_edited_to_match_a_checkpoint_is_refused runs in make test
def test_add_field_drop_field_and_replace_give_new_ids(demo_cache, tmp_path):
    """add-field --replace kept the cache id, so a resume landed on the replaced field."""
    import shutil
    import plugin_fields  # noqa: F401 (declares the field 'mel')
    from precompute.add_field import add_field, drop_field
    from shards import read_cache_id
    cache = tmp_path / "c"
    shutil.copytree(demo_cache, cache)
    ids = [read_cache_id(cache)]
    add_field(cache, "mel", {"factory": "plugin_fields:make_mel", "kwargs": {"n_mels": 8}}, progress=False)
    ids.append(read_cache_id(cache))
    add_field(cache, "mel", {"factory": "plugin_fields:make_mel", "kwargs": {"n_mels": 4}}, replace=True,
              progress=False)
    ids.append(read_cache_id(cache))
    drop_field(cache, "mel")
    ids.append(read_cache_id(cache))
    assert len(set(ids[:3])) == 3 and ids[3] != ids[2], ids
    assert ids[3] == ids[0]                                         # the same samples and fields as before
    assert _verify_quick(cache).returncode == 0


# ---- a tar holding a key twice --------------------------------------------------------------------------

def _tar_with_a_key_twice(cache: Path, contiguous: bool) -> Path:
    """Rewrite the cache's first shard with the members of its first sample written again: right
    after them (the same member names twice in a row), or after the second sample."""
    import io
    import tarfile
    p = sorted(cache.glob("shard-*.tar"))[0]
    with tarfile.open(p) as tf:
        members = [(ti, tf.extractfile(ti).read()) for ti in tf.getmembers()]
    key0 = members[0][0].name.split(".")[0]
    first = [m for m in members if m[0].name.split(".")[0] == key0]
    n_first = len(first)
    at = n_first if contiguous else n_first + len([m for m in members[n_first:]
                                                    if m[0].name.split(".")[0] == members[n_first][0].name.split(".")[0]])
    out = members[:at] + [(ti, b"X" + data[1:] if ti.name.endswith(".json") else data) for ti, data in first] + members[at:]
    p.chmod(0o644)
    with open(p, "wb") as fh, tarfile.open(fileobj=fh, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for ti, data in out:
            tf.addfile(ti, io.BytesIO(data))
    return p


@pytest.mark.parametrize("contiguous", [True, False], ids=["same-names-in-a-row", "not-contiguous"])
def test_a_tar_holding_a_key_twice_is_refused_by_scan_verify_and_reindex(copy, contiguous):
    import webdataset as wds
    from shards import ShardCorrupt
    from shards.scan import scan_shard
    p = _tar_with_a_key_twice(copy, contiguous)
    if contiguous:                                                   # what webdataset itself says of this tar
        with pytest.raises(ValueError, match="duplicate file name"):
            list(wds.WebDataset(str(p), shardshuffle=False, empty_check=False))
    else:                                                            # ... or yields: one key, two samples
        keys = [s["__key__"] for s in wds.WebDataset(str(p), shardshuffle=False, empty_check=False)]
        assert keys.count("s0000") == 2
    with pytest.raises(ShardCorrupt, match="holds sample key 's0000' twice"):
        scan_shard(p)
    r = subprocess.run([sys.executable, "-m", "shardcache", "shards", "verify", str(copy), "--deep", "--no_progress"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "holds sample key 's0000' twice" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "shardcache", "shards", "reindex", str(copy), "--no_progress"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "twice" in r.stdout + r.stderr, r.stdout + r.stderr


# ---- reruns that follow the manifest --------------------------------------------------------------------

TEXTS = ["The train leaves at seven fifteen.", "Please close the window before it rains.",
         "A cup of tea fixes most things.", "Four.", "Five.", "Six."]
AUDIOS = ["audio/spk-us-0001.flac", "audio/spk-us-0002.wav", "audio/spk-gb-0003.flac"]


def _rows(n: int = 6) -> list[dict]:
    return [{"key": f"k{i}", "text": TEXTS[i % len(TEXTS)], "audio": str(DEMO / AUDIOS[i % 3])} for i in range(n)]


@pytest.fixture()
def rerun_cfg(tiny_config):
    """Chunks of 2 rows: 6 rows are 3 chunks, so a change redoes one chunk and keeps two."""
    import dataclasses
    return dataclasses.replace(tiny_config, samples_per_shard=2, image_encoder=None)


def _run(rows, cache, cfg, tmp_path, **kw):
    import dataclasses
    from precompute.job import run
    manifest = _write_jsonl(tmp_path / "m.jsonl", rows)
    return run(manifest, cache, dataclasses.replace(cfg, **kw) if kw else cfg, progress=False)[0]


def _cached(cache: Path) -> dict[str, tuple[str, str]]:
    """key -> (the sample's stored json text, the sample's sha256), read back through the reader."""
    from shards import ShardReader, read_cache_id
    read_cache_id(cache)                                             # index + manifest as the root says
    r = ShardReader(cache)
    shas = r.index.column("sha256").to_pylist()
    return {k: (json.dumps(r.get(i)["json"], sort_keys=True), shas[i]) for i, k in enumerate(r.keys)}


def _chunk_of(cache: Path, key: str) -> set[str]:
    """The keys that share ``key``'s shard."""
    from shards.index import read_index
    t = read_index(cache).to_pylist()
    shard = next(r["shard"] for r in t if r["key"] == key)
    return {r["key"] for r in t if r["shard"] == shard}


def test_rerun_with_a_corrected_transcript_re_encodes_that_row(rerun_cfg, tmp_path):
    """A corrected transcript exited 0 and kept the stale sample without a word."""
    cache = tmp_path / "c"
    rows = _rows()
    _run(rows, cache, rerun_cfg, tmp_path)
    before = _cached(cache)
    rows[3]["text"] = "Four, corrected."
    s = _run(rows, cache, rerun_cfg, tmp_path)
    after = _cached(cache)
    assert "Four, corrected." in after["k3"][0] and "Four, corrected." not in before["k3"][0]
    assert s.rerun == {"kept": 4, "reencoded": 1, "reencoded_with_chunk": 1, "removed": 0, "kept_removed": 0,
                       "added": 0}
    assert sorted(after) == sorted(before)
    for k in set(before) - _chunk_of(cache, "k3"):                   # the other chunks: the same bytes
        assert after[k][1] == before[k][1]
    again = _run(rows, cache, rerun_cfg, tmp_path)                   # nothing changed: nothing redone
    assert again.rerun["kept"] == 6 and again.kept == 0 and _cached(cache) == after


def test_rerun_removes_a_deleted_row_or_keeps_it_with_the_flag(rerun_cfg, tmp_path, caplog):
    """A deleted row stayed in the cache without a word."""
    cache = tmp_path / "c"
    rows = _rows()
    _run(rows, cache, rerun_cfg, tmp_path)
    caplog.set_level("INFO", logger="precompute")
    kept = _run(rows[:1] + rows[2:], cache, rerun_cfg, tmp_path, keep_removed_rows=True)
    assert kept.rerun["kept_removed"] == 1 and kept.rerun["removed"] == 0 and "k1" in _cached(cache)
    assert "kept 1 cached rows no longer in the manifest (keep_removed_rows: true)" in caplog.text
    s = _run(rows[:1] + rows[2:], cache, rerun_cfg, tmp_path)
    assert s.rerun["removed"] == 1 and s.rerun["kept"] == 4 and s.rerun["reencoded_with_chunk"] == 1
    assert sorted(_cached(cache)) == ["k0", "k2", "k3", "k4", "k5"]
    assert "rerun: kept 4, re-encoded 0 (+1 unchanged rows of their chunks), removed 1, added 0" in caplog.text


def test_rerun_with_a_corrected_media_path_or_a_replaced_file(rerun_cfg, tmp_path):
    """A corrected media path for an existing key encoded everything and then failed with "duplicate
    keys across shards" on this and every later run. A file replaced in place (same path) is seen too."""
    import shutil
    import soundfile as sf
    cache = tmp_path / "c"
    media = tmp_path / "media"
    media.mkdir()
    for a in AUDIOS:
        shutil.copy(DEMO / a, media / Path(a).name)
    rows = [dict(r, audio=str(media / Path(AUDIOS[i % 3]).name)) for i, r in enumerate(_rows())]
    _run(rows, cache, rerun_cfg, tmp_path)
    rows[2]["audio"] = str(media / "spk-us-0001.flac")               # the corrected path
    s = _run(rows, cache, rerun_cfg, tmp_path)
    got = {k: json.loads(v[0]) for k, v in _cached(cache).items()}
    assert got["k2"]["duration_s"] == pytest.approx(sf.info(media / "spk-us-0001.flac").duration, abs=0.05)
    assert s.rerun["reencoded"] == 1 and s.rerun["kept"] == 4
    # the same path, other bytes: spk-us-0002.wav (rows k1, k4) replaced by a copy of spk-gb-0003.flac's audio
    y, rate = sf.read(media / "spk-gb-0003.flac")
    sf.write(media / "spk-us-0002.wav", y, rate)
    s = _run(rows, cache, rerun_cfg, tmp_path)
    got = {k: json.loads(v[0]) for k, v in _cached(cache).items()}
    assert got["k1"]["duration_s"] == pytest.approx(len(y) / rate, abs=0.05)
    assert s.rerun["reencoded"] == 2, s.rerun
    assert sorted(got) == [f"k{i}" for i in range(6)]


def test_rerun_with_an_added_row_encodes_only_it(rerun_cfg, tmp_path):
    cache = tmp_path / "c"
    rows = _rows()
    _run(rows, cache, rerun_cfg, tmp_path)
    tars = {p.name: p.read_bytes() for p in cache.glob("shard-*.tar")}
    s = _run(rows + [{"key": "k6", "text": "Seven.", "audio": str(DEMO / AUDIOS[0])}], cache, rerun_cfg, tmp_path)
    assert s.kept == 1 and "Seven." in _cached(cache)["k6"][0]
    assert all((cache / n).read_bytes() == b for n, b in tars.items())
    assert s.rerun == {"kept": 6, "reencoded": 0, "reencoded_with_chunk": 0, "removed": 0, "kept_removed": 0,
                       "added": 1}


@pytest.mark.long  # make test-long; the other rerun tests of this file run in make test
def test_a_rerun_after_add_field_keeps_the_field(rerun_cfg, tmp_path, caplog):
    """An incremental run after add-field silently dropped the added field from the manifest."""
    import plugin_fields  # noqa: F401 (declares the field 'mel')
    from precompute.add_field import add_field
    from shards import ShardReader
    cache = tmp_path / "c"
    rows = _rows()
    _run(rows, cache, rerun_cfg, tmp_path)
    spec = {"factory": "plugin_fields:make_mel", "kwargs": {"n_mels": 8}}
    add_field(cache, "mel", spec, progress=False)
    rows[3]["text"] = "Four, corrected."
    caplog.set_level("INFO", logger="precompute")
    _run(rows + [{"key": "k6", "text": "Seven.", "audio": str(DEMO / AUDIOS[0])}], cache, rerun_cfg, tmp_path)
    man = json.loads((cache / "manifest.json").read_text())
    redone = sorted({r["shard"] for r in ShardReader(cache).index.to_pylist() if r["key"] in ("k2", "k3", "k6")})  # k2: in k3's chunk
    assert man["fields"]["mel"]["incomplete"] == redone                # kept, and says what it lacks
    assert "field 'mel' (added by add-field) has no sidecar for 3 new or re-encoded shard(s)" in caplog.text
    r = ShardReader(cache)
    assert r.get(r.keys.index("k0"))["mel"] is not None              # the kept chunks keep their sidecars
    assert _verify_quick(cache).returncode == 1                      # verify names the missing sidecars
    from loaders import ShardLoader
    with pytest.raises(ValueError, match=r"field 'mel' \(added by add-field\) has no sidecar for 3 shard"):
        ShardLoader(cache, 2, fields=("codes", "mel"))               # the loader refuses to read it
    ShardLoader(cache, 2, fields=("codes",)).close()                 # the rest of the cache reads
    r = subprocess.run([sys.executable, "-m", "shardcache", "shards", "reindex", str(cache), "--no_progress"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "field 'mel' (added by add-field) has no sidecar for 3 shard(s)" in r.stderr, r.stderr
    man = json.loads((cache / "manifest.json").read_text())
    assert man["fields"]["mel"]["incomplete"] == redone              # reindex keeps it as it was (it dropped it)
    assert ShardReader(cache).get(ShardReader(cache).keys.index("k0"))["mel"] is not None
    add_field(cache, "mel", spec, progress=False)                    # the same add-field completes it
    ShardLoader(cache, 2, fields=("codes", "mel")).close()
    man = json.loads((cache / "manifest.json").read_text())
    assert "incomplete" not in man["fields"]["mel"]
    r = ShardReader(cache)
    assert all(r.get(i)["mel"] is not None for i in range(len(r.keys)))
    assert _verify_quick(cache).returncode == 0


def test_an_index_that_hides_a_second_sample_under_one_key_is_refused_by_the_loader_and_quick_verify(copy):
    """What the old scanner wrote for a tar holding a key twice: an index with one of the two samples
    (verify --deep passed). The tar is built with the copy under a key of the same length, scanned,
    the copy's row dropped, then the copy renamed to the first key (the same offsets)."""
    import io
    import tarfile
    from loaders import ShardLoader
    from shards import ShardCorrupt, read_manifest
    from shards.index import read_index, rows_to_table, write_parquet_atomic, write_root
    from shards.scan import scan_shard
    p = sorted(copy.glob("shard-*.tar"))[0]
    with tarfile.open(p) as tf:
        members = [(ti, tf.extractfile(ti).read()) for ti in tf.getmembers()]
    n = sum(ti.name.split(".")[0] == "s0000" for ti, _ in members)

    def write(hidden_key):
        copies = []
        for ti, data in members[:n]:
            c = tarfile.TarInfo(hidden_key + ti.name[len("s0000"):])
            c.size, c.mtime, c.mode, c.uname, c.gname = ti.size, ti.mtime, ti.mode, ti.uname, ti.gname
            copies.append((c, data))
        p.chmod(0o644)
        with open(p, "wb") as fh, tarfile.open(fileobj=fh, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for ti, data in members[:n] + copies + members[n:]:
                tf.addfile(ti, io.BytesIO(data))

    write("s000x")
    rows = [r for r in scan_shard(p)[0] if r["key"] != "s000x"]
    write("s0000")                                                   # the same bytes but for the names
    index = read_index(copy).to_pylist()
    index = [r for r in index if r["shard"] != p.name] + rows
    write_parquet_atomic(rows_to_table(index), copy / "index.parquet")
    write_root(copy, read_manifest(copy)["cache_id"])                # as the old writer sealed it
    with pytest.raises(ShardCorrupt, match="bytes the index does not locate before member .*a key held twice"):
        ShardLoader(copy, batch_size=4, seed=0)
    r = _verify_quick(copy)
    assert r.returncode == 1 and "bytes the index does not locate" in r.stdout, r.stdout + r.stderr
