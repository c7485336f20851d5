"""Issue 49: a fault is not a row. Processes of a real stage-one job (the demo manifest, the tiny models) are
killed mid-job: a codec process, a decode worker, the shard writer process, and the job itself with SIGTERM.
Each time the job either encodes every row anyway (a codec process is restarted) or exits non-zero naming the
process and the signal; no reject is written for the fault; ``/dev/shm`` and the cache folder hold nothing of
the job afterwards (no temporary file, the lock released); and the next run of the same command completes the
cache to the bytes of an uninterrupted run."""
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

pytestmark = [pytest.mark.xdist_group("faults"), pytest.mark.skipif(not Path("/proc/self/task").exists(),
                                                                    reason="needs Linux /proc")]

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
#: the command line with a stand-in set first (the only way into a constant of a process the test starts)
STAND_IN = "import sys; {}; from precompute.cli import main; sys.exit(main(sys.argv[1:]))"


def _args(cache: Path, tiny_models: Path, *extra: str) -> list[str]:
    return ["--manifest", str(DEMO / "samples.jsonl"), "--cache", str(cache),
            "--config", str(ROOT / "configs" / "precompute.yaml"),
            f"--audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}",
            f"--image_encoder.pretrained={tiny_models / 'wan-tiny'}", "--image_size=64", "--device=cpu",
            "--no_progress", "--samples_per_shard=8", *extra]


def _start(cache: Path, tiny_models: Path, *extra: str, stand_in: str | None = None) -> subprocess.Popen:
    head = [sys.executable, "-c", STAND_IN.format(stand_in)] if stand_in else \
        [sys.executable, "-m", "shardcache", "precompute"]
    return subprocess.Popen(head + _args(cache, tiny_models, *extra), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _layout(cache: Path) -> tuple:
    """Every byte a job wrote that a rerun must reproduce: sample key -> sha256, shard -> sha256, the rejects."""
    import pyarrow.parquet as pq
    m = json.loads((cache / "manifest.json").read_text())
    index = pq.read_table(cache / "index.parquet", columns=["key", "sha256"]).to_pylist()
    rejects = pq.read_table(cache / "rejects.parquet").to_pylist()
    return ({r["key"]: r["sha256"] for r in index}, {s["path"]: s["sha256"] for s in m["shards"]},
            sorted((r["key"], r["reason"], r["detail"]) for r in rejects))


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory) -> tuple:
    """The demo, precomputed once without interruption by the same command line."""
    out = tmp_path_factory.mktemp("faults-ref") / "c"
    p = _start(out, tiny_models)
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log[-3000:]
    return _layout(out)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _tree(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        for c in _children(todo.pop()):
            seen.append(c)
            todo.append(c)
    return seen


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait(what, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None, f"the job ended first: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _committed(cache: Path, n: int = 1):
    return lambda: len(list((cache / "parts").glob("*.index.parquet"))) >= n


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _shm_holders() -> dict[str, set[int]]:
    """``/dev/shm`` NAME -> the live processes that map it or hold it open (one pass over ``/proc``)."""
    out: dict[str, set[int]] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        names = set()
        try:
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    names.add(line.split("/dev/shm/", 1)[1].split()[0])
            for fd in (proc / "fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("/dev/shm/"):
                    names.add(target[len("/dev/shm/"):])
        except OSError:
            continue
        for name in names:
            out.setdefault(name, set()).add(int(proc.name))
    return out


class _ShmWatch:
    """The ``/dev/shm`` entries made while a job runs, and whose they are. Made before the job starts, it looks
    every 0.1 s (:func:`_shm_holders`) at who holds each new entry: the job's processes (this process and the
    processes started since, its children and theirs: a job run here or one started as a child) or only others
    (a test in another xdist worker, another user of the machine, making and dropping their own).
    :meth:`left` (after the job) is the new entries nobody holds now, except those only others were seen holding."""

    def __init__(self):
        import threading
        self.before = _shm()
        self._older = set(_tree(os.getpid()))  # this process's children from earlier tests (a pool, loky workers)
        self.ours: set[str] = set()
        self.others: set[str] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _look(self) -> None:
        mine = {os.getpid()} | (set(_tree(os.getpid())) - self._older)
        for name, pids in _shm_holders().items():
            if name not in self.before:
                (self.ours if pids & mine else self.others).add(name)
        for name in _shm() - self.before:  # joblib's folders name their maker (stage one uses no joblib)
            if name.startswith("joblib_memmapping_folder_") and int(name.split("_")[3]) not in mine:
                self.others.add(name)

    def _watch(self) -> None:
        while not self._done.wait(0.1):
            self._look()

    def left(self) -> set[str]:
        self._done.set()
        self._thread.join()
        self._look()
        held = _shm_holders()
        return {n for n in _shm() - self.before if n not in held and (n in self.ours or n not in self.others)}


def _new_children(older: set[int]) -> list[int]:
    """This process's children that are not in ``older`` (those from earlier tests of this xdist worker)."""
    return [p for p in _children(os.getpid()) if p not in older]


def _check_clean(cache: Path, shm: _ShmWatch, pids: list[int]) -> None:
    """Nothing of the ended job is left: no process of ``pids``, no /dev/shm entry of the job nobody holds
    (:class:`_ShmWatch`, made before the job), no temporary file in the cache folder, the writer lock released
    (its file emptied), no reject that is not a reject of the uninterrupted run (checked after the rerun)."""
    from shards.lock import holder
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if _alive(p)], \
        f"processes of the job outlived it: {[(p, _cmdline(p)[:100]) for p in pids if _alive(p)]}"
    left = shm.left()
    assert not left, f"/dev/shm entries left behind: {left}"
    tmp = sorted(p.name for p in list(cache.glob("*.tmp")) + list((cache / "parts").glob("*.tmp")))
    assert not tmp, f"temporary files left in the cache folder: {tmp}"
    assert holder(cache) is None
    assert (cache / "parts" / "writer.lock").read_text() == "", "the lock was not released (its holder is still named)"
    assert not (cache / "index.parquet").exists()  # the job did not finish: nothing was published
    # what is left is exactly the committed chunks: each index part (the commit marker) with its rejects part
    # and its tar (a chunk whose every row was rejected has none), the job's record, the (empty) lock file
    stems = {p.name[:-len(".index.parquet")] for p in (cache / "parts").glob("*.index.parquet")}
    assert {p.name for p in (cache / "parts").iterdir()} == {"job.json", "writer.lock"} | \
        {f"{s}.{part}.parquet" for s in stems for part in ("index", "rejects")}
    top = {p.name for p in cache.iterdir()} - {".shardcache", "parts"}
    assert {n[:-len(".tar")] for n in top} <= stems and all(n.endswith(".tar") for n in top), top


def _rerun_completes(cache: Path, tiny_models: Path, reference: tuple, *extra: str, stand_in: str | None = None):
    p = _start(cache, tiny_models, *extra, stand_in=stand_in)
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log[-3000:]
    assert _layout(cache) == reference  # every row, the same bytes, the rejects of an uninterrupted run only
    return log


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_sigterm_in_process_unwinds_the_job runs in make test
def test_sigterm_unwinds_the_job_and_the_rerun_completes(tiny_models, reference, tmp_path):
    """SIGTERM (SLURM's, torchrun's way to end a job) killed the job where it stood: the writer lock kept its
    holder, the chunk in progress its temporary file. Now the job unwinds: exit 143, every process gone, the
    lock released, the unfinished chunk dropped; the rerun completes the cache."""
    cache, before = tmp_path / "c", _ShmWatch()
    job = _start(cache, tiny_models, "--num_workers=2")
    _wait(_committed(cache), job)
    _wait(lambda: list(cache.glob("*.tar.tmp")), job)  # mid-chunk
    pids = _tree(job.pid)
    job.send_signal(signal.SIGTERM)
    log, _ = job.communicate(timeout=120)
    assert job.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert "stopped by SIGTERM" in log and "run the same command again to complete it" in log
    _check_clean(cache, before, pids)
    _rerun_completes(cache, tiny_models, reference, "--num_workers=2")


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_a_killed_writer_process_in_process_fails_the_job runs in make test
def test_a_killed_writer_process_fails_the_job_naming_it(tiny_models, reference, tmp_path):
    """On an accelerator the shard writer runs in a process of its own (here put there by a stand-in for
    :func:`precompute.job.writer_process`). Killed, it left its chunk's ``.tmp`` in the cache and the job hung
    or failed with a bare RuntimeError; now it fails with exit 1 naming the writer process, its pid and the
    signal, the temporary file removed, and the rerun completes the cache."""
    cache, before, busy = tmp_path / "c", _ShmWatch(), tmp_path / "busy"
    stand_in = "import precompute.job as j; j.writer_process = lambda device: True"
    # the writer process held mid-chunk at its 12th sample (the first chunk of 8 committed) until it is killed: the demo
    # writes faster than a test can look for the chunk in progress
    hold = (f"; import time, shards.writer as W; n = [0]; add = W.ShardWriter.add; W.ShardWriter.add = "
            f"lambda self, *a: (n.__setitem__(0, n[0] + 1), n[0] == 12 and (open({str(busy)!r}, 'w').write('1'), "
            "time.sleep(600)), add(self, *a))[-1]")
    job = _start(cache, tiny_models, "--num_workers=0", stand_in=stand_in + hold)
    _wait(lambda: busy.exists(), job)
    _wait(_committed(cache), job)
    _wait(lambda: list(cache.glob("*.tar.tmp")), job)  # the writer is mid-chunk
    writers = [p for p in _children(job.pid) if _cmdline(p) == _cmdline(job.pid)]  # (forked: the same command)
    assert len(writers) == 1, [(p, _cmdline(p)[:80]) for p in _children(job.pid)]
    pids = _tree(job.pid)
    os.kill(writers[0], signal.SIGKILL)
    log, _ = job.communicate(timeout=120)
    assert job.returncode == 1, log[-3000:]
    assert f"error: shard writer process (pid {writers[0]}) was killed by signal SIGKILL (9)" in log, log[-3000:]
    _check_clean(cache, before, pids)
    _rerun_completes(cache, tiny_models, reference, "--num_workers=0", stand_in=stand_in)


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_sigterm_in_process_unwinds_the_job runs (and stops) decode workers in make test
def test_a_killed_decode_worker_fails_the_job_naming_it(tiny_models, reference, tmp_path):
    """A decode worker killed mid-job: exit 1 naming the worker, its pid and the signal; the rerun completes. The
    worker is killed while it decodes a row: a stand-in holds the decoding of the manifest's last row (the decode
    workers are forked, so they run it) until it is killed; a worker killed once its rows were all delivered
    costs the job nothing, and the demo's rows decode faster than the first chunk commits."""
    cache, before, busy = tmp_path / "c", _ShmWatch(), tmp_path / "busy"
    last = len((DEMO / "samples.jsonl").read_text().splitlines()) - 1
    stand_in = ("import os, time, precompute.chunks as C; get = C.RowsDataset.__getitem__; "
                f"C.RowsDataset.__getitem__ = lambda self, item: (item[0].row == {last} and (open({str(busy)!r}, "
                "'w').write(str(os.getpid())), time.sleep(600))) or get(self, item)")
    job = _start(cache, tiny_models, "--num_workers=2", stand_in=stand_in)
    _wait(lambda: busy.exists() and busy.read_text(), job)
    workers = _children(job.pid)
    assert len(workers) == 2, [(p, _cmdline(p)[:80]) for p in workers]
    victim = int(busy.read_text())
    assert victim in workers
    pids = _tree(job.pid)
    os.kill(victim, signal.SIGKILL)
    log, _ = job.communicate(timeout=120)
    assert job.returncode == 1, log[-3000:]
    assert f"error: decode worker 0 (pid {victim}) was killed by signal SIGKILL (9)" in log or \
        f"error: decode worker 1 (pid {victim}) was killed by signal SIGKILL (9)" in log, log[-3000:]
    _check_clean(cache, before, pids)
    _rerun_completes(cache, tiny_models, reference, "--num_workers=2")


def _codec_processes(job: subprocess.Popen) -> list[int]:
    return [p for p in _children(job.pid) if "multiprocessing.spawn" in _cmdline(p)]


@pytest.mark.slow
@pytest.mark.long  # make test-long (two codec processes each load the codec); test_a_codec_pool_restarts_a_killed_process runs in make test
def test_a_killed_codec_process_is_restarted_and_every_row_encoded(tiny_models, reference, tmp_path):
    """A codec process killed mid-job turned the rows in flight into ``encode_failed`` rejects ("the codec
    process ended (EOFError)") and the job exited 0, the cache short of those rows for good. Now a fresh process
    takes its place, the calls it had not answered are sent again, and the job writes the bytes of an
    uninterrupted run (the codes do not depend on the process that computes them)."""
    cache = tmp_path / "c"
    job = _start(cache, tiny_models, "--audio_tokenizer.processes=2", "--num_workers=0")
    _wait(_committed(cache), job)
    victim = _codec_processes(job)[0]
    os.kill(victim, signal.SIGKILL)
    log, _ = job.communicate(timeout=300)
    assert job.returncode == 0, log[-3000:]
    assert f"(pid {victim}) was killed by signal SIGKILL (9); starting a fresh one in its place" in log, log[-3000:]
    assert _layout(cache) == reference


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_a_codec_pool_restarts_a_killed_process (past its restarts too) runs in make test
def test_a_codec_process_killed_past_its_restarts_fails_the_job_and_the_rerun_completes(tiny_models, reference,
                                                                                       tmp_path):
    """No restart left (a stand-in sets ``RESTARTS = 0``): exit 1 naming the codec process, its pid and the
    signal; nothing written for the rows in flight; the rerun completes the cache."""
    cache, before = tmp_path / "c", _ShmWatch()
    stand_in = "import precompute.encoders.processes as P; P.RESTARTS = 0"
    job = _start(cache, tiny_models, "--audio_tokenizer.processes=2", "--num_workers=0", stand_in=stand_in)
    _wait(_committed(cache), job)
    victim = _codec_processes(job)[0]
    pids = _tree(job.pid)
    os.kill(victim, signal.SIGKILL)
    log, _ = job.communicate(timeout=300)
    assert job.returncode == 1, log[-3000:]
    assert f"error: codec process 1 of 2 (pid {victim}) was killed by signal SIGKILL (9)" in log, log[-3000:]
    _check_clean(cache, before, pids)
    _rerun_completes(cache, tiny_models, reference, "--audio_tokenizer.processes=2", "--num_workers=0")


# ---- the same in this process (make test): no interpreter and model loading per run --------------------------

def _when(condition, then, timeout: float = 300) -> "threading.Thread":
    """A thread that calls ``then()`` once ``condition()`` holds (polled every 5 ms, for ``timeout`` seconds)."""
    import threading

    def run():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                then()
                return
            time.sleep(0.005)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _watch(cache: Path, then) -> "threading.Thread":
    """A thread that calls ``then()`` once the job committed a chunk and is writing the next one."""
    return _when(lambda: _committed(cache)() and list(cache.glob("*.tar.tmp")), then)


def _writer_processes(monkeypatch) -> list:
    """The job's shard writer in a process of its own (as on an accelerator); returns the list each
    :class:`precompute.writer.ChunkWriter` made is appended to (its ``_worker``: that process)."""
    from precompute import job as J
    from precompute import writer as W
    writers: list = []
    init = W.ChunkWriter.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        writers.append(self)
    monkeypatch.setattr(W.ChunkWriter, "__init__", spy)
    monkeypatch.setattr(J, "writer_process", lambda device: True)
    return writers


def test_sigterm_in_process_unwinds_the_job(tiny_models, tiny_config, demo_cache, tmp_path, capsys):
    """The cheap form of :func:`test_sigterm_unwinds_the_job_and_the_rerun_completes`: the command line's entry
    point in this process, SIGTERM sent to it with two decode workers running: exit 143, the workers gone, no
    shared memory left, the lock released, the chunk in progress dropped; the rerun writes the demo's bytes."""
    from precompute.cli import main
    from precompute.job import run
    cache, before = tmp_path / "c", _ShmWatch()
    pids: list[int] = []
    older = set(_children(os.getpid()))  # (earlier tests' processes: a pool, loky workers)

    def stop():
        pids.extend(_new_children(older))  # the job's: its decode workers
        os.kill(os.getpid(), signal.SIGTERM)
    watcher = _watch(cache, stop)
    handler = signal.getsignal(signal.SIGTERM)
    rc = main(_args(cache, tiny_models, "--num_workers=2", "--allow_outside_root=true"))
    watcher.join()
    err = capsys.readouterr().err
    assert rc == 143, err[-3000:]
    assert "stopped by SIGTERM" in err and "run the same command again to complete it" in err
    assert signal.getsignal(signal.SIGTERM) == handler  # the caller's handler again
    _check_clean(cache, before, pids)
    run(DEMO / "samples.jsonl", cache, tiny_config, progress=False)
    assert _layout(cache) == _layout(demo_cache)


def test_a_sigterm_a_c_callback_swallows_still_stops_the_job(tiny_models, tmp_path, capsys, monkeypatch):
    """SIGTERM's :class:`precompute.faults.Stopped` is raised wherever the main thread is, and there it can be
    swallowed: soundfile reads a file object through cffi callbacks, and an exception raised inside one is printed
    and dropped (the read gets 0 bytes). The job then went on to the end (exit 0; a second SIGTERM was ignored as
    "already stopping"). Now it stops at its next row anyway: exit 143, nothing of the row being read written
    (every committed row and reject is an uninterrupted run's), the rerun writes an uninterrupted run's bytes. The
    SIGTERM is sent from inside soundfile's read of a file (decoding in this process, ``num_workers=0``) once a
    chunk was committed."""
    import io

    import pyarrow.parquet as pq

    from precompute import audio as A
    from precompute.cli import main
    from precompute.faults import Stopped
    rows, _ = _edited(tmp_path)
    fresh, cache = tmp_path / "fresh", tmp_path / "c"
    assert main(_audio_args(rows, fresh, tiny_models)) == 0
    want, _, want_rejects = _layout(fresh)
    sent: list[str] = []
    swallowed: list[BaseException] = []

    class SignalsOnRead(io.BufferedReader):
        def readinto(self, b):
            if not sent and _committed(cache)():
                sent.append(self.name)
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside soundfile's callback
            return super().readinto(b)
    real = A._open
    monkeypatch.setattr(A, "_open", lambda source, label: SignalsOnRead(real(source, label).detach()))
    hook = sys.unraisablehook
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_value) if isinstance(
        u.exc_value, Stopped) else hook(u))
    capsys.readouterr()
    before = _ShmWatch()
    rc = main(_audio_args(rows, cache, tiny_models))
    err = capsys.readouterr().err
    assert sent and swallowed, (sent, swallowed)  # the Stopped was raised in the callback and dropped there
    assert rc == 143, err[-3000:]
    assert "stopped by SIGTERM" in err and "run the same command again to complete it" in err
    _check_clean(cache, before, [])
    parts = sorted((cache / "parts").glob("*.index.parquet"))
    assert parts
    for part in parts:  # what was committed is the uninterrupted run's, row for row (none read while dropped)
        for r in pq.read_table(part, columns=["key", "sha256"]).to_pylist():
            assert want[r["key"]] == r["sha256"], r["key"]
        for r in pq.read_table(part.with_name(part.name.replace(".index.", ".rejects."))).to_pylist():
            assert (r["key"], r["reason"], r["detail"]) in want_rejects, r
    monkeypatch.undo()
    assert main(_audio_args(rows, cache, tiny_models)) == 0
    assert _layout(cache) == _layout(fresh)


def test_a_killed_writer_process_in_process_fails_the_job(tiny_config, demo_cache, tmp_path, monkeypatch):
    """The cheap form of :func:`test_a_killed_writer_process_fails_the_job_naming_it`: the shard writer in a
    process of its own (as on an accelerator), killed mid-chunk: :class:`precompute.faults.ProcessDied` naming it,
    its pid and the signal; its temporary file removed; the rerun writes the demo's bytes."""
    from precompute import job as J
    from precompute.faults import ProcessDied
    writers = _writer_processes(monkeypatch)
    cache, before = tmp_path / "c", _ShmWatch()
    pids: list[int] = []

    def kill():
        pids.append(writers[0]._worker.pid)
        os.kill(pids[0], signal.SIGKILL)
    watcher = _watch(cache, kill)
    with pytest.raises(ProcessDied) as got:
        J.run(DEMO / "samples.jsonl", cache, tiny_config, progress=False)
    watcher.join()
    assert str(got.value).startswith(f"shard writer process (pid {pids[0]}) was killed by signal SIGKILL (9)")
    assert got.value.signal == "SIGKILL"
    _check_clean(cache, before, pids)
    monkeypatch.undo()
    J.run(DEMO / "samples.jsonl", cache, tiny_config, progress=False)
    assert _layout(cache) == _layout(demo_cache)


def test_a_writer_process_killed_between_its_tar_and_its_commit_leaves_no_tar(tiny_config, demo_cache, tmp_path,
                                                                              monkeypatch):
    """The shard writer process commits a chunk in two steps: the tar renamed into place, then the chunk's parts
    (the index part last: the commit marker). Killed between them, it left a ``shard-NNNNNN.tar`` of a chunk that
    was never committed: the folder held more shards than the index parts said. Now the job removes it with the
    ``.tmp`` files (ProcessDied naming the writer), and the rerun writes the demo's bytes. The kill is the writer's
    own, at its second chunk's parts (a stand-in for :func:`shards.index.write_parts`, inherited as it forks)."""
    from precompute import job as J
    from precompute.faults import ProcessDied
    from shards import writer as SW
    real, calls = SW.write_parts, []

    def write_parts(out_dir, stem, *a, **k):
        calls.append(stem)
        if len(calls) == 2:  # in the writer process: its second chunk's tar is in place
            assert (Path(out_dir) / f"{stem}.tar").is_file()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(out_dir, stem, *a, **k)
    monkeypatch.setattr(SW, "write_parts", write_parts)
    monkeypatch.setattr(J, "writer_process", lambda device: True)
    cache, before = tmp_path / "c", _ShmWatch()
    with pytest.raises(ProcessDied) as got:
        J.run(DEMO / "samples.jsonl", cache, tiny_config, progress=False)
    assert str(got.value).startswith("shard writer process (pid ") and got.value.signal == "SIGKILL", str(got.value)
    assert not calls  # (this process wrote no part: the writer process did)
    _check_clean(cache, before, [])  # no shard without its index part
    assert len(list((cache / "parts").glob("*.index.parquet"))) == 1
    monkeypatch.undo()
    J.run(DEMO / "samples.jsonl", cache, tiny_config, progress=False)
    assert _layout(cache) == _layout(demo_cache)


def test_a_codec_pool_restarts_a_killed_process(tiny_models, monkeypatch, caplog):
    """A codec process killed with calls in flight: a fresh process takes its place and answers them, with the
    codes the codec computes in this process; past its restarts, waiting raises ProcessDied naming the process,
    its pid and the signal, never codes or a row's error."""
    import numpy as np

    from precompute.encoders import load_audio_tokenizer
    from precompute.encoders import processes as P
    from precompute.faults import InfrastructureFault, ProcessDied
    here = load_audio_tokenizer({"name": "dac", "pretrained": str(tiny_models / "dac-tiny")})
    codec = load_audio_tokenizer({"name": "dac", "pretrained": str(tiny_models / "dac-tiny"), "processes": 2})
    rng = np.random.default_rng(0)
    clips = [rng.uniform(-0.5, 0.5, n).astype(np.float32) for n in (24000, 9600, 30000, 4800)]
    want = here.encode(clips)
    try:
        caplog.set_level("WARNING", logger="precompute")
        assert all(np.array_equal(a, b) for a, b in zip(codec.encode(clips[:2]), want[:2]))  # the pool is up
        victim = codec._pool.workers[0].process.pid
        os.kill(victim, signal.SIGKILL)
        got = codec.encode(clips)  # calls to the dead process and to the live one
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        assert f"(pid {victim}) was killed by signal SIGKILL (9); starting a fresh one" in caplog.text
        monkeypatch.setattr(codec._pool, "restarts_left", 0)
        victim = codec._pool.workers[1].process.pid
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ProcessDied, match=rf"codec process 2 of 2 \(pid {victim}\) was killed by signal SIGKILL") as e:
            codec.encode(clips)
        assert isinstance(e.value, InfrastructureFault) and e.value.signal == "SIGKILL"
    finally:
        codec.close()
    assert P.RESTARTS >= 1


def test_a_rerun_retries_a_row_an_older_version_rejected_for_a_dead_codec_process(tiny_config, demo_cache,
                                                                                   tmp_path, monkeypatch, caplog):
    """An older version wrote a codec process killed mid-job as ``encode_failed`` rejects (``RuntimeError: the
    codec process ended (EOFError)``, made here by a stand-in codec that says so for one row), and every rerun
    kept that chunk: ``kept 16, re-encoded 0``, the cache one row short for good. Now the rerun encodes the
    chunk again and the cache is the demo's, every row."""
    from precompute.encoders.capabilities import Pending
    from precompute.job import run
    from precompute.producers import codes as C
    from shards import read_rejects
    victim, submit = "spk-gb-0004", C.CodesProducer.submit

    def old_version(self, samples, timer):  # what an older version made of a codec process killed mid-job
        pend = submit(self, samples, timer)
        return Pending(lambda: [RuntimeError("the codec process ended (EOFError)") if s.req.key == victim else r
                                for s, r in zip(samples, pend.result())])
    monkeypatch.setattr(C.CodesProducer, "submit", old_version)
    cache = tmp_path / "c"
    run(DEMO / "samples.jsonl", cache, tiny_config, progress=False)
    assert {(r["key"], r["detail"]) for r in read_rejects(cache).to_pylist() if r["key"] == victim} == \
        {(victim, "RuntimeError: the codec process ended (EOFError)")}
    monkeypatch.undo()
    caplog.set_level("INFO", logger="precompute")
    summary, _ = run(DEMO / "samples.jsonl", cache, tiny_config, progress=False)
    assert "1 row(s) an older version rejected for an infrastructure fault" in caplog.text
    assert (summary.rerun["kept"], summary.rerun["reencoded_with_chunk"]) == (32 - 8, 8)  # its chunk again
    assert _layout(cache) == _layout(demo_cache)


def test_after_a_killed_first_job_every_tool_advises_the_rerun_and_reindex_refuses(tiny_models, tiny_config,
                                                                                  demo_cache, tmp_path, capsys):
    """After a first job killed mid-way, ``shards verify`` advised ``shards reindex``; following it gave a cache
    of the committed chunks alone (12 of 24 samples here) that then passed verify. Now verify, the loader and
    reindex say the job did not finish and that the same precompute command completes it; reindex refuses (its
    ``--partial`` says what it leaves out); following the advice (after ``reindex --partial`` too) gives the demo's
    cache, every row, the same bytes."""
    from loaders import ShardLoader
    from precompute.job import run
    from shards.cli import main as shards
    cache = tmp_path / "c"
    job = _start(cache, tiny_models, "--num_workers=0", "--allow_outside_root=true")
    _wait(_committed(cache, 2), job)
    job.kill()
    job.wait()
    capsys.readouterr()
    assert shards(["verify", str(cache)]) == 2
    err = capsys.readouterr().err
    assert "stage one started this cache and has not finished it (2 chunk(s) committed" in err, err
    assert "run the same `shardcache precompute` command again" in err and "would publish those" in err
    with pytest.raises(FileNotFoundError, match="run the same `shardcache precompute` command again"):
        ShardLoader(cache, 4)
    assert shards(["reindex", str(cache), "--no_progress"]) == 2
    assert "Refused: nothing written" in capsys.readouterr().err
    assert not (cache / "index.parquet").exists()
    partial = tmp_path / "partial"
    import shutil
    shutil.copytree(cache, partial)
    assert shards(["reindex", str(partial), "--no_progress"]) == 2
    assert shards(["reindex", str(partial), "--no_progress", "--partial"]) == 0
    assert "the rows stage one had not encoded are not in the cache" in capsys.readouterr().err
    run(DEMO / "samples.jsonl", cache, tiny_config, progress=False)  # the advice followed
    assert _layout(cache) == _layout(demo_cache)
    run(DEMO / "samples.jsonl", partial, tiny_config, progress=False)  # reindex --partial, then the advice
    assert _layout(partial) == _layout(demo_cache)


# ---- out of memory while decoding ------------------------------------------------------------------------------

def _out_of_memory_on(monkeypatch, name: str) -> None:
    """Decoding any audio file called ``name`` raises ``MemoryError`` (what numpy raises when the host cannot give
    an array), in this process and in the decode workers it forks."""
    from precompute import prepare
    decode = prepare.load_audio_windows

    def short_of_memory(source, *a, **k):
        if isinstance(source, (str, os.PathLike)) and Path(source).name == name:
            raise MemoryError("Unable to allocate 2.00 MiB for an array with shape (262144,) and data type float64")
        return decode(source, *a, **k)
    monkeypatch.setattr(prepare, "load_audio_windows", short_of_memory)


@pytest.mark.parametrize("workers", [2, 0])
def test_out_of_memory_decoding_a_row_within_the_limits_fails_the_job(tiny_config, demo_cache, tmp_path,
                                                                      monkeypatch, workers):
    """A MemoryError while decoding was a row fault: ``unreadable_audio`` rejects, one per row, as many as the host
    was short of memory for, and exit 0. A row within the configured limits cannot need more than they allow, so
    now the job stops on the first (DeviceFault, host memory) naming the decode worker and the row; nothing is
    rejected for it; the rerun writes the demo's bytes."""
    import dataclasses

    from precompute.faults import DeviceFault
    from precompute.job import run
    _out_of_memory_on(monkeypatch, "spk-gb-0003.flac")
    cache, before = tmp_path / "c", _ShmWatch()
    with pytest.raises(DeviceFault) as got:
        run(DEMO / "samples.jsonl", cache, dataclasses.replace(tiny_config, num_workers=workers), progress=False)
    where = r"decode worker \d" if workers else "the decoding process"
    assert __import__("re").match(rf"{where} \(pid \d+\) ran out of host memory decoding row 'spk-gb-0003' \(.*"
                                  r"spk-gb-0003\.flac\), a row within the configured limits \(max_duration 30 s",
                                  str(got.value)), str(got.value)
    assert "MemoryError: Unable to allocate" in str(got.value)
    _check_clean(cache, before, [])
    monkeypatch.undo()
    run(DEMO / "samples.jsonl", cache, tiny_config, progress=False)
    assert _layout(cache) == _layout(demo_cache)


def test_out_of_memory_on_a_row_whose_header_asks_for_more_than_the_limits_is_its_reject(tiny_config, tmp_path,
                                                                                      monkeypatch):
    """The limits bound seconds and pixels, not the width of a frame: a file whose header declares more channels
    than a row within the limits decodes (a broken or hostile header) is the row's fault when its decode runs out
    of memory: a reject naming the header, and the job goes on."""
    import json

    import numpy as np
    import soundfile as sf

    from precompute.job import run
    from precompute.prepare import MAX_CHANNELS
    from shards import read_index, read_rejects
    wide = tmp_path / "wide.wav"
    sf.write(wide, np.zeros((2400, MAX_CHANNELS + 1), np.int16), 24000, subtype="PCM_16")
    rows = [{"key": "wide", "text": "A file of many channels.", "audio": str(wide)},
            {"key": "fine", "text": "The train leaves at seven fifteen.", "audio": str(DEMO / "audio" / "spk-us-0001.flac")}]
    manifest = tmp_path / "rows.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _out_of_memory_on(monkeypatch, "wide.wav")
    summary, _ = run(manifest, tmp_path / "c", tiny_config, progress=False)
    assert read_index(tmp_path / "c").column("key").to_pylist() == ["fine"]
    (r,) = read_rejects(tmp_path / "c").to_pylist()
    assert (r["key"], r["reason"]) == ("wide", "unreadable_audio")
    assert r["detail"].startswith("MemoryError: Unable to allocate") and \
        f"its header declares frames of 24000 Hz x {MAX_CHANNELS + 1} channels, more than the 384000 Hz x " \
        f"{MAX_CHANNELS} channels a row within the limits decodes" in r["detail"], r["detail"]


# ---- a rerun killed mid-way ------------------------------------------------------------------------------------

def _audio_args(manifest: Path, cache: Path, tiny_models: Path, *extra: str) -> list[str]:
    return ["--manifest", str(manifest), "--root", str(DEMO), "--cache", str(cache),
            "--config", str(ROOT / "configs" / "precompute.yaml"), "--image_encoder=null",
            f"--audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}", "--device=cpu", "--num_workers=0",
            "--no_progress", "--samples_per_shard=4", *extra]


def _edited(tmp_path: Path) -> tuple[Path, Path]:
    """The demo's rows without an image, and the same with the text of every row changed (every chunk stale for a
    rerun: it drops them all, then encodes them again one by one)."""
    lines = [line for line in (DEMO / "samples.jsonl").read_text().splitlines() if '"image"' not in line]
    first, edited = tmp_path / "first.jsonl", tmp_path / "edited.jsonl"
    first.write_text("".join(line + "\n" for line in lines))
    def edit(i: int, line: str) -> str:
        try:
            return json.dumps(dict(json.loads(line), text=f"Edited row {i}."))
        except ValueError:  # (the demo's malformed row stays as it is)
            return line
    edit = [edit(i, line) for i, line in enumerate(lines)]
    edited.write_text("".join(line + "\n" for line in edit))
    return first, edited


def test_after_a_killed_rerun_every_tool_advises_the_rerun_and_says_what_reindex_loses(tiny_models, tmp_path,
                                                                                      capsys):
    """A rerun that changes chunks removes integrity.json, drops the stale chunks and encodes them again. Killed in
    between, verify and the loader advised ``shards reindex`` (or rerun), and reindex published the cache without
    the rows of the dropped chunks. Now every tool says the rerun stopped and that the same precompute command
    completes it, and how many samples reindex would leave out; reindex refuses (``--partial`` says the same);
    following the advice, or ``reindex --partial`` and then the advice, gives the bytes of a fresh run."""
    import shutil

    import pyarrow.parquet as pq

    from loaders import ShardLoader
    from precompute.cli import main
    from shards.cli import main as shards
    first, edited = _edited(tmp_path)
    fresh = tmp_path / "fresh"
    assert main(_audio_args(edited, fresh, tiny_models)) == 0
    cache = tmp_path / "c"
    assert main(_audio_args(first, cache, tiny_models)) == 0
    old = pq.read_table(cache / "index.parquet", columns=["key", "shard"]).to_pylist()
    old_shards = {s["path"] for s in json.loads((cache / "manifest.json").read_text())["shards"]}

    watcher = _when(lambda: not (cache / "integrity.json").exists() and list(cache.glob("*.tar.tmp")),
                     lambda: os.kill(os.getpid(), signal.SIGTERM))
    assert main(_audio_args(edited, cache, tiny_models)) == 143  # the rerun, stopped mid-chunk
    watcher.join()
    capsys.readouterr()
    # what the folder says, counted here: the old index's rows whose shard is gone, the rows committed now
    gone = old_shards - {p.name for p in cache.glob("*.tar")}
    lost = sum(r["shard"] in gone for r in old)
    now = sum(pq.read_metadata(p).num_rows for p in (cache / "parts").glob("*.index.parquet"))
    assert gone and lost  # (a stale chunk was dropped and not written again yet)
    advice = ("a rerun of stage one stopped before it finished this cache", "run the same `shardcache precompute` "
              "command again", f"would publish those {now} sample(s) alone, leaving out the {lost} sample(s) of the "
              f"{len(gone)} dropped shard(s)")
    assert shards(["verify", str(cache)]) == 2
    err = capsys.readouterr().err
    assert all(a in err for a in advice) and "reindex (or rerun" not in err, err
    with pytest.raises(Exception) as got:
        ShardLoader(cache, 4)
    assert all(a in str(got.value) for a in advice), str(got.value)
    assert shards(["reindex", str(cache), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert "Refused: nothing written" in err and all(a in err for a in advice), err
    partial = tmp_path / "partial"
    shutil.copytree(cache, partial)
    assert shards(["reindex", str(partial), "--no_progress", "--partial"]) == 0
    assert advice[2].replace(str(cache), str(partial)) in capsys.readouterr().err
    assert main(_audio_args(edited, cache, tiny_models)) == 0  # the advice followed
    assert _layout(cache) == _layout(fresh)
    assert main(_audio_args(edited, partial, tiny_models)) == 0  # reindex --partial, then the advice
    assert _layout(partial) == _layout(fresh)


# ---- a full disk -----------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted at ``tmp_path/disk`` (a file system that fills up for real); the test skips, saying why,
    where it cannot be mounted (not root, no CAP_SYS_ADMIN). Yields ``(folder, grow)``: ``grow()`` gives it 64 MiB."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that fills up for real) needs root")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(disk)], capture_output=True,
                         text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {got.stderr.strip() or got.returncode}")

    def grow():
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    try:
        yield disk, grow
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_full_disk_while_writing_fails_the_job_and_the_rerun_completes(small_disk, tiny_models, tmp_path, capsys):
    """The disk fills up while the shard writer writes a chunk (a 1 MiB tmpfs, 2 MB of shards): a StorageFault, exit
    1 naming it; nothing rejected for it, no temporary file left, the lock released; once there is room, the same
    command completes the cache to the bytes of a run that had room all along."""
    from precompute.cli import main
    disk, grow = small_disk
    first, _ = _edited(tmp_path)
    roomy = tmp_path / "roomy"
    assert main(_audio_args(first, roomy, tiny_models)) == 0
    capsys.readouterr()
    cache, before = disk / "c", _ShmWatch()
    assert main(_audio_args(first, cache, tiny_models)) == 1
    err = capsys.readouterr().err
    assert "error: shard writer: OSError: [Errno 28] No space left on device" in err, err[-3000:]
    assert "run the same command again to complete it" in err
    _check_clean(cache, before, [])
    assert list((cache / "parts").glob("*.index.parquet"))  # (it had committed chunks before the disk was full)
    grow()
    assert main(_audio_args(first, cache, tiny_models)) == 0
    assert _layout(cache) == _layout(roomy)
