"""Issue 30 (slice b): the writer lock, the integrity root, one key per tar, reruns that follow the manifest.

Each test goes through the real entry points (the precompute command line, ``CacheLock``, the
loader, ``shards verify``) on files the test damages or rewrites itself.
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
            "--set", f"audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}",
            "--set", f"image_encoder.pretrained={tiny_models / 'wan-tiny'}",
            "--set", "image_size=64", "--set", "device=cpu", "--no-progress", "--root", str(DEMO), *extra]


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
                            *_argv(manifest, cache, tiny_models, "--set", "num_workers=2")],
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
    rc, out, err = _precompute_here(capsys, small, cache, tiny_models, "--set", "num_workers=0")
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
