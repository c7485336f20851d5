"""Issue 41 items 3 and 4: one writer at a time for every command that writes a cache, and a cache
folder that is owned (a marker written first, no symlink inside it followed, no file of another tool
overwritten).

Each test goes through the real entry points (``shardcache.cli.main``, the commands' subprocesses,
``shards.ShardWriter``) and judges the result by the files on disk (their bytes before and after),
the exit status and what the loader reads.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import DEMO, ROOT

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def snapshot(folder: Path) -> dict[str, str]:
    """``{relative path: sha256 (or "-> target" for a symlink)}`` of every file under ``folder``."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for f in files:
            p = Path(dirpath) / f
            rel = str(p.relative_to(folder))
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def precompute_argv(manifest: Path, cache: Path, tiny_models: Path, *extra: str) -> list[str]:
    return ["precompute", "--manifest", str(manifest), "--cache", str(cache),
            "--config", str(ROOT / "configs" / "precompute.yaml"),
            f"--audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}",
            f"--image_encoder.pretrained={tiny_models / 'wan-tiny'}",
            "--image_size=64", "--device=cpu", "--num_workers=0", "--no_progress", "--root", str(DEMO), *extra]


def run_here(capsys, argv: list[str]) -> tuple[int, str, str]:
    """``shardcache ARGV`` in this process: exit status, stdout, stderr."""
    from shardcache.cli import main
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rows(n: int, start: int = 0) -> list[dict]:
    audio = sorted(p.name for p in (DEMO / "audio").glob("*.flac"))
    return [{"key": f"k{i}", "text": f"Row {i}.", "audio": f"audio/{audio[i % len(audio)]}"}
            for i in range(start, start + n)]


class Holder:
    """Another process holding the writer lock of ``cache`` as command ``command`` (a CacheWriter)."""

    def __init__(self, cache: Path, command: str = "test holder"):
        code = ("import sys, time\nfrom shards.writing import CacheWriter\n"
                f"w = CacheWriter({str(cache)!r}, {command!r}); w.__enter__()\n"
                "print('held', flush=True)\ntime.sleep(600)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        assert line == "held", self.proc.stderr.read()
        self.pid = self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wait_for_holder(cache: Path, proc: subprocess.Popen, timeout: float = 600) -> dict:
    """The lock file's holder once it names ``proc`` (the command took the lock)."""
    lock = cache / "parts" / "writer.lock"
    deadline = time.monotonic() + timeout
    holder: dict = {}
    while time.monotonic() < deadline and holder.get("pid") != proc.pid and proc.poll() is None:
        time.sleep(0.02)
        try:
            holder = json.loads(lock.read_text() or "{}")
        except (OSError, ValueError):
            pass
    assert holder.get("pid") == proc.pid, f"{proc.args[:4]} never took the lock: {proc.poll()}"
    return holder


def samples_read(cache: Path) -> list[str]:
    """Every key the loader reads in one epoch (no drop, no shuffle) of the fields stage one wrote."""
    from loaders import Order, ShardLoader
    ld = ShardLoader(cache, batch_size=1, seed=0, fields=["input_ids", "labels", "codes", "audio"], order=Order(shuffle=False, drop_remainder=False))
    keys = [k for b in ld for k in b["keys"]]
    ld.close()
    return keys


# ---- fixtures ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_models) -> tuple[Path, Path]:
    """A cache of 8 rows in 2 chunks of 4 (real stage one, tiny models) with a field added by add-field
    (``audio_16k``), and its manifest."""
    from precompute.add_field import add_field
    from shardcache.cli import main
    d = tmp_path_factory.mktemp("one-writer")
    manifest = write_jsonl(d / "m.jsonl", rows(8))
    cache = d / "cache"
    assert main(precompute_argv(manifest, cache, tiny_models, "--samples_per_shard=4")) == 0
    add_field(cache, "audio_16k", {"producer": "waveform", "sample_rate": 16000}, progress=False)
    return cache, manifest


@pytest.fixture()
def cache(base, tmp_path) -> Path:
    c = tmp_path / "cache"
    shutil.copytree(base[0], c, symlinks=True)
    return c


# ---- every command, while another process holds the lock --------------------------------------------------

def _examples(cache: Path, manifest: Path, tiny_models: Path, tmp: Path) -> dict[str, list[str]]:
    """One invocation of every command that would do real work on ``cache`` (a writer would write)."""
    train = ["--config", str(ROOT / "configs" / "train-demo.yaml"), "--cache", str(cache), "--training.steps", "1"]
    c = str(cache)
    return {
        "precompute": precompute_argv(manifest, cache, tiny_models, "--samples_per_shard=4")[1:],
        "add-field": [c, "--field", "audio_8k", "--producer", "waveform", "--options", '{"sample_rate": 8000}',
                      "--no_progress"],
        "drop-field": [c, "audio_16k"],
        "check": [c, "--manifest", str(manifest), "--root", str(DEMO), "--samples", "1"],
        "train": train + ["--run_dir", str(tmp / "run")],
        "find-batch-size": train + ["--max_batch_size", "2", "--steps", "1"],
        "shards ls": [c], "shards info": [c], "shards rejects": [c], "shards head": [c, "-n", "1"],
        "shards show": [c, "k0"], "shards export-audio": [c, "k0", str(tmp / "k0.wav")],
        "shards query": [c, "--where", "duration_s > 0", "--count"], "shards stats": [c],
        "shards verify": [c, "--deep"], "shards reindex": [c],
        "shards export-lhotse": [c, str(tmp / "shar")],
        "shards view": [c, "--port", "0"],
    }


def _all_commands() -> set[str]:
    """Every command of the command line: ``shardcache``'s and ``shardcache shards``'s subcommands."""
    from shardcache.cli import COMMANDS
    from shards.cli import build_parser
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    return (set(COMMANDS) - {"shards"}) | {f"shards {name}" for name in subs.choices}


@pytest.mark.long
def test_every_command_refuses_or_leaves_the_cache_alone_while_another_writes_it(cache, base, tiny_models,
                                                                                  tmp_path, capsys):
    """Walks every command of the command line (a new command without an example here fails): while
    another process holds the cache's writer lock, each either exits 2 naming that process before
    writing anything, or leaves every byte of the cache as it was. The commands that write a cache
    (precompute, add-field, drop-field, shards reindex) must refuse, and so must the commands that read a cache
    whole (check, verify, view: what they would show is half-written). Before, add-field, drop-field
    and reindex took no lock and wrote beside a running job."""
    examples = _examples(cache, base[1], tiny_models, tmp_path)
    assert set(examples) == _all_commands(), "give every command an example invocation"
    writers = {"precompute", "add-field", "drop-field", "shards reindex"}
    holder = Holder(cache, "precompute")
    try:
        for name, args in sorted(examples.items()):
            before = snapshot(cache)
            rc, out, err = run_here(capsys, name.split() + args)
            after = snapshot(cache)
            refused = rc == 2 and f"pid {holder.pid} " in err
            assert after == before, f"{name} changed the cache while another command wrote it (exit {rc}): " \
                                    f"{sorted(k for k in set(after) | set(before) if after.get(k) != before.get(k))}"
            if name in writers or name in ("shards verify", "check", "shards view"):
                assert refused, f"{name}: exit {rc}, expected 2 naming the holder: {err[-800:]}"
            else:
                assert rc in (0, 2), f"{name}: exit {rc}: {err[-800:]}"
    finally:
        holder.stop()


def test_the_commands_that_write_a_cache_refuse_while_another_writes_it(cache, base, tiny_models, tmp_path, capsys):
    """The cheap part of the walk above (no training run): each command that writes a cache exits 2
    naming the other writer, and no byte of the cache changes. Before: add-field, drop-field and
    shards reindex took no lock and wrote (exit 0)."""
    examples = _examples(cache, base[1], tiny_models, tmp_path)
    holder = Holder(cache, "precompute")
    try:
        for name in ("precompute", "add-field", "drop-field", "shards reindex"):
            before = snapshot(cache)
            rc, out, err = run_here(capsys, name.split() + examples[name])
            assert snapshot(cache) == before, name
            assert rc == 2, f"{name}: exit {rc}: {err[-1500:]}"
            assert f"being written by another shardcache command (precompute on host" in err and \
                f"pid {holder.pid} " in err, err
    finally:
        holder.stop()


def test_every_declared_writer_takes_the_lock(cache):
    """Every function declared with ``shards.writing.writes_cache`` refuses while another process
    holds the lock, before its first line (nothing on disk changes)."""
    import inspect
    from shards.lock import CacheLocked
    from shards.writing import WRITERS
    import precompute.add_field  # noqa: F401  (declares add-field and drop-field)
    import shards.commands.reindex  # noqa: F401
    assert {"add-field", "drop-field", "shards reindex"} <= set(WRITERS)
    holder = Holder(cache)
    try:
        for name, fn in WRITERS.items():
            params = inspect.signature(fn).parameters
            before = snapshot(cache)
            # (the other arguments are never looked at: the lock is taken before the first line)
            args = {p: None for p in params if params[p].default is inspect.Parameter.empty}
            args[fn.cache_arg] = cache
            with pytest.raises(CacheLocked, match=f"pid {holder.pid} "):
                fn(**args)
            assert snapshot(cache) == before, name
    finally:
        holder.stop()


def test_a_library_write_outside_any_command_is_refused_too(cache):
    """A ShardWriter (or merge_parts) used directly, outside any command, takes the lock for its
    write: while a command writes the cache it is refused and writes nothing."""
    import numpy as np
    from shards import ShardWriter
    from shards.lock import CacheLocked
    holder = Holder(cache)
    try:
        before = snapshot(cache)
        w = ShardWriter(cache, "shard-000009.tar")
        with pytest.raises(CacheLocked, match=f"pid {holder.pid} "):
            w.add("x", {"json": {}, "input_ids.npy": np.zeros(2, np.int32)})
        assert snapshot(cache) == before
    finally:
        holder.stop()
    w = ShardWriter(cache, "shard-000009.tar")   # the lock is free again: the same write goes through
    w.add("x", {"json": {}, "input_ids.npy": np.zeros(2, np.int32)})
    assert w.commit()["samples"] == 1


# ---- concurrency: two commands at once -------------------------------------------------------------------

@pytest.mark.slow
def test_two_add_fields_at_once(cache, capsys):
    """Two add-fields on one cache both exited 0 and one field was missing from the manifest. Now the
    second is refused (exit 2, naming the first) and the first's field is complete; the same command
    run again afterwards adds its field too."""
    first = subprocess.Popen([sys.executable, "-m", "shardcache", "add-field", str(cache), "--field", "audio_8k",
                              "--producer", "waveform", "--options", '{"sample_rate": 8000}', "--no_progress"],
                             cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_holder(cache, first)
    second = ["add-field", str(cache), "--field", "audio_12k", "--producer", "waveform", "--options",
              '{"sample_rate": 12000}', "--no_progress"]
    rc, out, err = run_here(capsys, second)
    out1, err1 = first.communicate(timeout=600)
    assert first.returncode == 0, err1[-2000:]
    assert rc == 2 and f"pid {first.pid} " in err and "add-field on host" in err, (rc, err[-2000:])
    fields = json.loads((cache / "manifest.json").read_text())["fields"]
    assert {"audio_16k", "audio_8k"} <= set(fields) and "audio_12k" not in fields
    assert run_here(capsys, second)[0] == 0
    fields = json.loads((cache / "manifest.json").read_text())["fields"]
    assert {"audio_16k", "audio_8k", "audio_12k"} <= set(fields)
    rc, out, err = run_here(capsys, ["shards", "verify", str(cache), "--deep", "--no_progress"])
    assert rc == 0, out + err
    from loaders import Order, ShardLoader
    ld = ShardLoader(cache, batch_size=1, fields=["audio_8k", "audio_12k"], order=Order(shuffle=False, drop_remainder=False))
    assert sum(len(b["keys"]) for b in ld) == 8
    ld.close()


@pytest.mark.slow
def test_reindex_during_a_rerun(cache, base, tiny_models, tmp_path, capsys):
    """The loader's error during a rerun advised `shards reindex`, which took no lock: run during the
    rerun it indexed the shards there at that moment, and the loader then read 4 of 8 samples, exit 0.
    Now reindex is refused (exit 2, naming the rerun), the loader's message says a command is writing
    the cache instead of advising reindex, and after the rerun the loader reads all 8."""
    from shards import ShardCorrupt, read_cache_id
    changed = rows(8)
    changed[1]["text"] = "Changed text."                                  # chunk 0 is stale: encoded again
    manifest = write_jsonl(tmp_path / "m2.jsonl", changed)
    job = subprocess.Popen([sys.executable, "-m", "shardcache", *precompute_argv(manifest, cache, tiny_models,
                                                                                 "--samples_per_shard=4")],
                           cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_holder(cache, job)
    rc, out, err = run_here(capsys, ["shards", "reindex", str(cache), "--no_progress"])
    assert rc == 2 and f"pid {job.pid} " in err and "precompute on host" in err, (rc, out, err)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and (cache / "integrity.json").exists() and job.poll() is None:
        time.sleep(0.02)                                                   # the rerun drops the stale chunk
    if job.poll() is None:
        with pytest.raises(ShardCorrupt, match="being written right now by precompute") as e:
            read_cache_id(cache)
        assert "shards reindex" not in str(e.value)                       # (advised while nobody writes)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-2000:]
    assert sorted(samples_read(cache)) == sorted(f"k{i}" for i in range(8))


@pytest.mark.slow
def test_precompute_and_drop_field(cache, base, tiny_models, tmp_path, capsys):
    """drop-field while a rerun writes the cache is refused (exit 2, naming it); the rerun ends with
    a cache whose every field and sample is there (verify --deep passes); drop-field afterwards works."""
    more = write_jsonl(tmp_path / "m3.jsonl", rows(12))                       # 4 new rows: a new chunk
    job = subprocess.Popen([sys.executable, "-m", "shardcache", *precompute_argv(more, cache, tiny_models,
                                                                                 "--samples_per_shard=4")],
                           cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_holder(cache, job)
    rc, out, err = run_here(capsys, ["drop-field", str(cache), "audio_16k"])
    assert rc == 2 and f"pid {job.pid} " in err, (rc, err)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-2000:]
    man = json.loads((cache / "manifest.json").read_text())
    assert man["counts"]["samples"] == 12 and "audio_16k" in man["fields"]
    assert man["fields"]["audio_16k"].get("incomplete")                       # the new chunk has no sidecar yet
    assert run_here(capsys, ["drop-field", str(cache), "audio_16k"])[0] == 0
    rc, out, err = run_here(capsys, ["shards", "verify", str(cache), "--deep", "--no_progress"])
    assert rc == 0, out + err
    assert sorted(samples_read(cache)) == sorted(f"k{i}" for i in range(12))


# ---- the cache folder is owned -----------------------------------------------------------------------------

def test_a_folder_of_another_tools_files_is_not_written(tiny_models, tmp_path, capsys):
    """A --cache folder holding another tool's files got 3 of its 4 files overwritten, exit 0. Now it
    is refused before anything is written (exit 2, naming its files); an empty folder is fine."""
    folder = tmp_path / "theirs"
    folder.mkdir()
    for name, text in {"README.md": "their notes", "index.parquet": "their index", "manifest.json": '{"theirs": 1}',
                       "data.bin": "theirs"}.items():
        (folder / name).write_text(text)
    before = snapshot(folder)
    manifest = write_jsonl(tmp_path / "m.jsonl", rows(2))
    rc, out, err = run_here(capsys, precompute_argv(manifest, folder, tiny_models))
    assert rc == 2, err[-2000:]
    assert "holds files shardcache did not write (README.md, data.bin, index.parquet, manifest.json)" in err, err
    assert snapshot(folder) == before
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = run_here(capsys, precompute_argv(manifest, empty, tiny_models))
    assert rc == 0, err[-2000:]
    assert (empty / ".shardcache").is_file() and "kept 2" in out


def test_a_writer_lock_symlink_never_truncates_a_file_outside(cache, tiny_models, tmp_path, capsys):
    """A writer.lock planted as a symlink made the job truncate (and overwrite) the file it pointed
    to. Now the job refuses naming the lock file, and the file outside is untouched."""
    outside = tmp_path / "precious.txt"
    outside.write_text("do not touch\n" * 100)
    lock = cache / "parts" / "writer.lock"
    lock.unlink()
    lock.symlink_to(outside)
    manifest = write_jsonl(tmp_path / "m.jsonl", rows(8))
    rc, out, err = run_here(capsys, precompute_argv(manifest, cache, tiny_models, "--samples_per_shard=4"))
    assert rc != 0 and "writer.lock is a symlink" in err, err[-2000:]
    assert outside.read_text() == "do not touch\n" * 100


def test_a_tmp_shard_symlink_never_overwrites_another_file(cache, tiny_models, tmp_path, capsys):
    """A `.tmp` shard planted as a symlink made the job write the shard into the file it pointed to
    (and rename the link into the cache). Now the job refuses naming the .tmp, nothing is written
    through it, and a second file outside stays as it was."""
    outside = tmp_path / "other.bin"
    outside.write_bytes(b"\x01" * 4096)
    for n in range(2, 12):
        (cache / f"shard-{n:06d}.tar.tmp").symlink_to(outside)
    manifest = write_jsonl(tmp_path / "m.jsonl", rows(12))                   # 4 new rows: a new chunk
    rc, out, err = run_here(capsys, precompute_argv(manifest, cache, tiny_models, "--samples_per_shard=4"))
    assert rc != 0, out
    assert ".tar.tmp is a symlink" in err and str(outside) in err, err[-2000:]
    assert outside.read_bytes() == b"\x01" * 4096
    assert not any((cache / f"shard-{n:06d}.tar").is_symlink() for n in range(2, 12))


def test_an_export_is_never_written_into_a_cache(cache, capsys):
    """`shards export-audio` writes a file the user names: named inside the cache folder (here its own
    index) it overwrote a cache file outside any writing session. Now it is refused (exit 2)."""
    before = snapshot(cache)
    for target in (cache / "index.parquet.wav", cache / "parts" / "x.wav"):
        rc, out, err = run_here(capsys, ["shards", "export-audio", str(cache), "k0", str(target)])
        assert rc == 2 and "inside the cache folder" in err, err
    assert snapshot(cache) == before
