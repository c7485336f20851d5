"""Issue 49 item 5: one writer per cache wherever it lives. A cache in object storage is locked at its location
(an object created only if absent: S3's ``If-None-Match: *``, which moto's server on 127.0.0.1 honours), not in
the local staging folder: a second job is refused naming the first, whatever its staging folder."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from conftest import DEMO, ROOT  # noqa: E402
from test_remote import CREDS, S3  # noqa: E402

pytestmark = pytest.mark.xdist_group("remote_writer")


@pytest.fixture(scope="module")
def s3():
    old = {k: os.environ.get(k) for k in CREDS}
    os.environ.update(CREDS)
    server = S3()
    yield server
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _argv(url: str, staging, s3, tiny_models, *extra) -> list[str]:
    return ["--manifest", str(DEMO / "samples.jsonl"), "--cache", url, "--config", str(ROOT / "configs" / "precompute.yaml"),
            f"--audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}", f"--image_encoder.pretrained={tiny_models / 'wan-tiny'}",
            "--image_size=64", "--device=cpu", "--num_workers=0", "--samples_per_shard=8", "--no_progress",
            "--storage_options", json.dumps(s3.options), "--staging", str(staging), *extra]


def test_two_jobs_with_different_staging_folders_cannot_both_write_one_bucket_cache(s3, tiny_models, demo_cache,
                                                                                    tmp_path, capsys):
    """Both jobs exited 0 and the last writer won: the lock covered each one's staging folder only. Now the
    second is refused (exit 2) naming the first (its host, pid and staging folder) and writes nothing; once the
    first has ended, the same command runs and finds every chunk committed."""
    from precompute.cli import main
    from shards import read_index
    s3.fs.mkdir("one-writer")
    url, lock = "s3://one-writer/demo", "one-writer/demo/parts/writer.lock"
    first = subprocess.Popen([sys.executable, "-m", "shardcache", "precompute",
                              *_argv(url, tmp_path / "staging-a", s3, tiny_models)],
                             cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not s3.fs.exists(lock):
        assert first.poll() is None, first.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
        s3.fs.invalidate_cache()
    holder = json.loads(s3.fs.cat_file(lock))
    assert holder["pid"] == first.pid and holder["command"] == "precompute"
    capsys.readouterr()
    rc = main(_argv(url, tmp_path / "staging-b", s3, tiny_models))
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    assert f"pid {first.pid} " in err and f"{socket.gethostname()}:{tmp_path / 'staging-a'}" in err
    assert f"lock object {url}/parts/writer.lock" in err
    assert not list((tmp_path / "staging-b").glob("**/shard-*"))  # nothing was written from the second job
    log, _ = first.communicate(timeout=600)
    assert first.returncode == 0, log[-3000:]
    s3.fs.invalidate_cache()
    assert not s3.fs.exists(lock)  # released with the job
    capsys.readouterr()
    assert main(_argv(url, tmp_path / "staging-b", s3, tiny_models)) == 0
    assert "nothing to encode: the cache holds all 32 rows" in capsys.readouterr().out  # the first job wrote them
    got = tmp_path / "got"
    s3.fs.get("one-writer/demo/", str(got), recursive=True)
    assert sorted(read_index(got).column("key").to_pylist()) == sorted(read_index(demo_cache).column("key").to_pylist())


def test_a_remote_lock_is_taken_over_only_from_a_writer_that_is_gone(s3, caplog):
    """A lock object left by a writer that died is taken over (its pid gone from this host, or no heartbeat for
    longer than STALE_S from anywhere); a live holder's is refused naming it; a holder whose lock was taken over
    stops before its next upload; release deletes the object."""
    from shards.lock import STALE_S, CacheLocked, RemoteLock
    from shards.storage import RemoteFolder
    s3.fs.mkdir("stale-locks")
    key = "stale-locks/c/parts/writer.lock"

    def folder():
        return RemoteFolder("s3://stale-locks/c", s3.options)

    def plant(**holder):
        s3.fs.pipe_file(key, json.dumps(holder).encode())

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    caplog.set_level(logging.INFO, logger="precompute")
    plant(host=socket.gethostname(), pid=dead.pid, command="precompute", since=time.time(), heartbeat=time.time())
    lock = RemoteLock(folder(), "precompute").acquire()
    assert f"pid {dead.pid} is gone from this host); lock taken over" in caplog.text
    assert json.loads(s3.fs.cat_file(key))["pid"] == os.getpid()
    with pytest.raises(CacheLocked, match=f"pid {os.getpid()} "):
        RemoteLock(folder(), "precompute").acquire()  # the holder lives
    lock.release()
    assert not s3.fs.exists(key)
    plant(host="elsewhere", pid=1, command="precompute", since=time.time(), heartbeat=time.time())
    with pytest.raises(CacheLocked, match="host elsewhere, pid 1 "):
        RemoteLock(folder(), "precompute").acquire()  # another host, a fresh heartbeat: refused
    plant(host="elsewhere", pid=1, command="precompute", since=0, heartbeat=time.time() - STALE_S - 5)
    lock = RemoteLock(folder(), "precompute").acquire()  # no heartbeat for longer than STALE_S: taken over
    assert "no heartbeat for" in caplog.text
    plant(host="elsewhere", pid=2, command="precompute", since=time.time(), heartbeat=time.time(), token="theirs")
    lock._beat_once()
    with pytest.raises(CacheLocked, match="taken over by precompute on host elsewhere, pid 2"):
        lock.check()
    lock.release()
    assert json.loads(s3.fs.cat_file(key))["pid"] == 2  # another writer's lock is never deleted
