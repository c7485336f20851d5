"""Issue 49: a process that HANGS is an infrastructure fault too. With the stall deadline ``stall_timeout_s`` (an
operational option, default 600 s), a codec process, a decode worker or the shard writer that makes no progress
for that long is killed and handled as a died process: a codec process is restarted and its calls sent again; a
decode worker or the writer fails the job naming it and that it hung. Work on the encoder thread that hangs (a
plug-in encoder that never returns) fails the job too. Each time: no reject is written for the hang, nothing of the
job is left behind, and the next run of the same command completes the cache to the bytes of an uninterrupted run.

The hangs are real: a plug-in codec that sleeps while a file exists (``tests/plugin_stall_codec.py``), and
processes of the job stopped with ``SIGSTOP`` (a process that no longer runs, as one stuck in a kernel call or a
dead NFS mount is)."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DEMO, ROOT
from test_faults import ENV, _check_clean, _layout, _ShmWatch, _watch, _when, _writer_processes

pytestmark = [pytest.mark.xdist_group("faults"), pytest.mark.skipif(not Path("/proc/self/task").exists(),
                                                                    reason="needs Linux /proc")]

#: the deadline of these tests: far above any pause of the tiny models' job, far below the default
STALL_S = 3.0


@pytest.fixture(scope="module")
def audio_rows(tmp_path_factory) -> Path:
    """The demo's rows without an image (25, a few of them bad: their rejects are the job's own)."""
    out = tmp_path_factory.mktemp("stall-rows") / "audio.jsonl"
    out.write_text("".join(line + "\n" for line in (DEMO / "samples.jsonl").read_text().splitlines()
                           if '"image"' not in line))
    return out


@pytest.fixture(scope="module")
def cfg(tiny_config):
    """The tiny models' config, audio only, chunks of 4 rows."""
    return dataclasses.replace(tiny_config, image_encoder=None, samples_per_shard=4)


@pytest.fixture(scope="module")
def reference(cfg, audio_rows, tmp_path_factory) -> tuple:
    from precompute.job import run
    out = tmp_path_factory.mktemp("stall-ref") / "c"
    run(audio_rows, out, cfg, root=DEMO, progress=False)
    return _layout(out)


# ---- a plug-in codec that never returns ------------------------------------------------------------------------

def _plugin_args(cache: Path, rows: Path, hang: Path, *extra: str) -> list[str]:
    return ["--manifest", str(rows), "--root", str(DEMO), "--cache", str(cache),
            "--config", str(ROOT / "configs" / "precompute.yaml"), "--image_encoder=null",
            f"--audio_tokenizer={{factory: 'plugin_stall_codec:make', kwargs: {{hang_while: '{hang}', over_s: 2.5}}}}",
            "--device=cpu", "--num_workers=0", "--no_progress", "--samples_per_shard=4", *extra]


@pytest.fixture(scope="module")
def plugin_reference(audio_rows, tmp_path_factory) -> tuple:
    """The audio rows through the stall plug-in, its hang file absent: what every run of it must end with."""
    from precompute.cli import main
    base = tmp_path_factory.mktemp("stall-plugin")
    assert main(_plugin_args(base / "c", audio_rows, base / "hang")) == 0
    return base / "hang", _layout(base / "c")


def test_a_plugin_codec_that_hangs_fails_the_job_naming_it(plugin_reference, audio_rows, tmp_path, capsys):
    """A plug-in codec that never returns from one call hung the job for good (no deadline on an encoder's call).
    Now the job stops after ``stall_timeout_s`` with exit 1 naming the encoder thread, what it was computing and the
    deadline; nothing is rejected for it, nothing is left behind, and the same command (the codec fixed) completes
    the cache."""
    from precompute.cli import main
    hang, want = plugin_reference
    cache, before = tmp_path / "c", _ShmWatch()
    hang.write_text("")
    try:
        rc = main(_plugin_args(cache, audio_rows, hang, f"--stall_timeout_s={STALL_S}"))
    finally:
        hang.unlink()  # (the hung call returns now, into a job that has ended)
    err = capsys.readouterr().err
    assert rc == 1, err[-3000:]
    assert f"error: encoder thread hung: computing codes for " in err, err[-3000:]
    assert f"no progress for {STALL_S:g} s (stall_timeout_s); a thread cannot be killed: the job stops" in err
    assert "run the same command again to complete it" in err
    _check_clean(cache, before, [])
    assert main(_plugin_args(cache, audio_rows, hang, f"--stall_timeout_s={STALL_S}")) == 0
    assert _layout(cache) == want  # every row, the rejects of an uninterrupted run only


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_a_plugin_codec_that_hangs_fails_the_job_naming_it runs in make test
def test_a_plugin_codec_that_hangs_forever_ends_the_command(plugin_reference, audio_rows, tmp_path):
    """The command line itself, the plug-in asleep for good (its file never removed while the job runs): the process
    exits 1 with the fault rather than hang, though its encoder thread never returns."""
    hang, want = plugin_reference
    cache, before = tmp_path / "c", _ShmWatch()
    hang.write_text("")
    try:
        p = subprocess.run([sys.executable, "-m", "shardcache", "precompute",
                            *_plugin_args(cache, audio_rows, hang, f"--stall_timeout_s={STALL_S}")], cwd=ROOT,
                           env=dict(ENV, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}"), capture_output=True, text=True,
                           timeout=300)
    finally:
        hang.unlink()
    assert p.returncode == 1, p.stderr[-3000:]
    assert "error: encoder thread hung: computing codes for " in p.stderr
    _check_clean(cache, before, [])
    p = subprocess.run([sys.executable, "-m", "shardcache", "precompute", *_plugin_args(cache, audio_rows, hang)],
                       cwd=ROOT, env=dict(ENV, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}"), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert _layout(cache) == want


# ---- processes of the job stopped (SIGSTOP) ---------------------------------------------------------------------

@pytest.mark.slow  # (three codec processes loaded, two deadlines waited out)
def test_a_codec_process_that_hangs_is_replaced_and_past_its_restarts_fails(tiny_models, monkeypatch, caplog):
    """A codec process that stops answering (SIGSTOP) kept the job waiting for good. Now, under a deadline, it is
    killed once it answered none of its calls for that long, a fresh one answers them with the codes the codec
    computes in this process, and past the restarts waiting raises ProcessHung naming the process and the hang."""
    import numpy as np
    import torch

    from precompute.encoders import load_audio_tokenizer
    from precompute.encoders.processes import CodecPool
    from precompute.faults import InfrastructureFault, ProcessHung, Watch
    here = load_audio_tokenizer({"name": "dac", "pretrained": str(tiny_models / "dac-tiny")})
    x = np.random.default_rng(1).uniform(-0.5, 0.5, (2, 1, 24000)).astype(np.float32)
    with torch.inference_mode():
        want = here._encode_batch(torch.from_numpy(x)).numpy()
    t = time.monotonic()
    pool = CodecPool(here._recipe, 1)
    # the deadline covers loading the codec in a fresh process (a spawned interpreter: seconds on a busy machine)
    stall = max(STALL_S, round(2 * (time.monotonic() - t) + 1))
    watch = Watch(stall)
    caplog.set_level("WARNING", logger="precompute")
    try:
        with watch.on_this_thread():
            assert np.array_equal(pool.submit(x).numpy(), want)
            victim = pool.workers[0].process.pid
            os.kill(victim, signal.SIGSTOP)
            calls = [pool.submit(x), pool.submit(x[:1])]
            assert np.array_equal(calls[0].numpy(), want) and np.array_equal(calls[1].numpy(), want[:1])
            assert f"codec process 1 of 1 (pid {victim}) hung: 2 codec call(s) unanswered, no progress for " \
                   f"{stall:g} s (stall_timeout_s); killed with SIGKILL; starting a fresh one in its place and " \
                   "sending it the 2 call(s)" in caplog.text, caplog.text
            assert watch.idle_s() < stall  # the pool dealt with it: the thread's own deadline was never near
            monkeypatch.setattr(pool, "restarts_left", 0)
            victim = pool.workers[0].process.pid
            os.kill(victim, signal.SIGSTOP)
            with pytest.raises(ProcessHung, match=rf"codec process 1 of 1 \(pid {victim}\) hung: 1 codec call\(s\) "
                                                  "unanswered") as e:
                pool.submit(x).numpy()
            assert isinstance(e.value, InfrastructureFault) and e.value.signal == "SIGKILL"
            assert "restarted 1 time(s) already" in str(e.value)
    finally:
        pool.close()


def test_a_decode_worker_that_hangs_fails_the_job_naming_it_and_the_row(cfg, audio_rows, reference, tmp_path,
                                                                         monkeypatch):
    """A decode worker stopped on a row (SIGSTOP) left the job waiting for it for good (the loader had no timeout).
    Now the job fails once it waited ``stall_timeout_s``: ProcessHung naming the worker, its pid and the row it was
    decoding, the worker killed; nothing left behind; the rerun writes the bytes of an uninterrupted run."""
    from precompute import faults as F
    from precompute.faults import ProcessHung
    from precompute.job import run
    tables: list = []
    init = F.WorkerPids.__init__

    def spy(self, n):
        init(self, n)
        tables.append(self)
    monkeypatch.setattr(F.WorkerPids, "__init__", spy)
    import json
    cache, before = tmp_path / "c", _ShmWatch()
    stopped: dict = {}
    rows: dict[int, dict] = {}  # manifest position -> the row, for the rows naming a file that exists
    for p, line in enumerate(audio_rows.read_text().splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("audio"), str) and (DEMO / rec["audio"]).is_file():
            rows[p] = rec

    def busy():
        if not tables:
            return False
        t = tables[0]
        for i, (pid, item) in enumerate(zip(t.table.tolist(), t.rows.tolist())):
            if pid and item in rows:
                os.kill(pid, signal.SIGSTOP)
                if int(t.rows[i]) == item:  # stopped on that row
                    stopped.update(worker=i, pid=pid, item=item, pids=[p for p in t.table.tolist() if p])
                    return True
                os.kill(pid, signal.SIGCONT)
        return False
    watcher = _when(busy, lambda: None)
    with pytest.raises(ProcessHung) as got:
        run(audio_rows, cache, dataclasses.replace(cfg, num_workers=2, stall_timeout_s=STALL_S), root=DEMO,
            progress=False)
    watcher.join()
    row = rows[stopped["item"]]  # (the table holds the row's manifest position)
    assert str(got.value).startswith(
        f"decode worker {stopped['worker']} (pid {stopped['pid']}) hung: decoding row {row['key']!r} "
        f"({DEMO / row['audio']}), no progress for {STALL_S:g} s (stall_timeout_s); killed with SIGKILL"), str(got.value)
    _check_clean(cache, before, stopped["pids"])
    monkeypatch.undo()
    run(audio_rows, cache, cfg, root=DEMO, progress=False)
    assert _layout(cache) == reference


def test_a_writer_process_that_hangs_fails_the_job(cfg, audio_rows, reference, tmp_path, monkeypatch):
    """The shard writer in a process of its own (as on an accelerator), stopped mid-chunk (SIGSTOP): the job waited for
    its commit for good. Now ProcessHung names it, its pid and the deadline; it is killed, its temporary files
    removed; the rerun writes the bytes of an uninterrupted run."""
    from precompute import job as J
    from precompute.faults import ProcessHung
    writers = _writer_processes(monkeypatch)
    cache, before = tmp_path / "c", _ShmWatch()
    pids: list[int] = []

    def stop():
        pids.append(writers[0]._worker.pid)
        os.kill(pids[0], signal.SIGSTOP)
    watcher = _watch(cache, stop)
    with pytest.raises(ProcessHung) as got:
        J.run(audio_rows, cache, dataclasses.replace(cfg, stall_timeout_s=STALL_S), root=DEMO, progress=False)
    watcher.join()
    assert str(got.value).startswith(f"shard writer process (pid {pids[0]}) hung: "), str(got.value)
    assert f"no progress for {STALL_S:g} s (stall_timeout_s); killed with SIGKILL; the chunk it was writing is " \
           "dropped" in str(got.value)
    assert got.value.signal == "SIGKILL"
    _check_clean(cache, before, pids)
    monkeypatch.undo()
    J.run(audio_rows, cache, cfg, root=DEMO, progress=False)
    assert _layout(cache) == reference


@pytest.mark.parametrize("on_row", [True, False], ids=["on a row", "between rows"])
def test_a_wait_for_a_batch_the_loaders_timeout_cannot_end_is_a_hang_of_the_worker(on_row):
    """The decode loader's ``timeout`` bounds its wait for a batch's message, not the taking of the batch's shared
    memory from the worker that sent it (a file descriptor read from that worker): with the worker stopped just
    then, the job waited for good (seen once in test_a_decode_worker_that_hangs_fails_the_job_naming_it_and_the_row).
    Now a watchdog kills the worker once it is past the deadline on one row (or, between rows, once the wait took
    twice the deadline), the wait ends with an error, and the job's error is the hang naming the worker. Here the
    wait is a read from a live child process standing for the worker, which only its death ends."""
    from precompute.faults import ProcessHung, WorkerPids
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE)
    pids = WorkerPids(1)
    pids.table[0] = worker.pid
    if on_row:
        pids.rows[0], pids.since[0] = 7, time.monotonic()

    def batches():
        yield ["the first batch"]
        if not worker.stdout.read(1):  # (blocks until the worker is gone)
            raise EOFError("the worker's connection closed")
    got: dict = {}

    def consume():
        try:
            got["batches"] = list(pids.receive(batches(), 0.5, lambda p: f"row {p}"))
        except BaseException as e:  # noqa: BLE001 - what the job would raise
            got["error"] = e
    t = threading.Thread(target=consume, daemon=True)
    t.start()
    t.join(120)
    if t.is_alive():
        worker.kill()
        pytest.fail("the wait was not ended: the job would hang for good")
    assert worker.wait() == -signal.SIGKILL
    e = got["error"]
    assert isinstance(e, ProcessHung) and isinstance(e.__cause__, EOFError), repr(e)
    want = (f"decode worker 0 (pid {worker.pid}) hung: decoding row 7, no progress for 0.5 s" if on_row else
            f"decode workers 0 hung: none delivered the next batch and none was decoding a row, no progress for "
            f"0.5 s (stall_timeout_s); killed with SIGKILL; pids {worker.pid}")
    assert str(e).startswith(want), str(e)


def test_decoding_in_the_job_process_has_no_deadline():
    """With no decode worker the rows are decoded by the waiting thread itself: a slow batch and then its own error
    is that error (a row's, a bug's), never a hang."""
    from precompute.faults import WorkerPids

    def batches():
        yield ["the first batch"]
        time.sleep(0.6)  # three times the deadline
        raise ValueError("the decoder's own error")
    got = WorkerPids(0).receive(batches(), 0.2, lambda p: f"row {p}")
    assert next(got) == ["the first batch"]
    with pytest.raises(ValueError, match="the decoder's own error"):
        next(got)


def test_the_stall_deadline_is_declared_with_its_bounds(capsys, tmp_path, monkeypatch):
    """``stall_timeout_s`` is an operational option (no byte of a cache depends on it) with a default generous for a
    real codec on a slow CPU and bounds checked before anything runs (exit 2 naming it)."""
    from precompute import cli
    from precompute.config import PrecomputeConfig, load_config
    from shardcache.config import effect_of, options
    assert load_config(None).stall_timeout_s == 600.0
    assert effect_of(options(PrecomputeConfig)["stall_timeout_s"][1]).kind == "operational"
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("the job started"))
    for bad in ("0", "-1", ".nan", "1e9"):
        rc = cli.main(["--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "c"),
                       f"--stall_timeout_s={bad}"])
        err = capsys.readouterr().err
        assert rc == 2 and "stall_timeout_s" in err, (bad, err)
    assert not (tmp_path / "c").exists()
