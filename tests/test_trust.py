"""Issue 22: a cache is never silently wrong, a row never stops a job, a resume never lands on other data.

Each test reproduces one failure of the issue through the real entry points: a NUL in a key (the
whole job exited 1), caps per sample (too_large), ``--sample_rate 1e11`` (an empty cache with exit
0), a YAML alias bomb in ``model.kwargs`` (the training CLI hung), media paths outside ``--root``, a
missing or badly typed ``manifest.json`` at training time (IndexError), two precompute processes on
one cache, a resume on another cache with the same number of samples, and the ChatML ``recipient``
that was dropped (issue 20 item 6).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from conftest import DEMO, ROOT
from shards import ManifestError, ShardCorrupt, ShardReader, read_manifest

AUDIO = "audio/spk-us-0001.flac"      # 2.3 s, relative to --root DEMO
IMAGE = "images/coffee.jpg"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _argv(manifest, cache, tiny_models, *extra, root=DEMO) -> list[str]:
    """``shardcache precompute`` arguments with the tiny models."""
    return ["--manifest", str(manifest), "--cache", str(cache), "--config", str(ROOT / "configs" / "precompute.yaml"),
            f"--audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}",
            f"--image_encoder.pretrained={tiny_models / 'wan-tiny'}",
            "--image_size=64", "--device=cpu", "--num_workers=0", "--no_progress",
            *(["--root", str(root)] if root else []), *extra]


def _precompute(manifest, cache, tiny_models, *extra, root=DEMO, timeout=600):
    """The command line in a process of its own."""
    cmd = [sys.executable, "-m", "shardcache", "precompute", *_argv(manifest, cache, tiny_models, *extra, root=root)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def _precompute_here(capsys, manifest, cache, tiny_models, *extra, root=DEMO) -> tuple[int, str, str]:
    """The command line's entry point (``precompute.cli.main``) in this process: its exit status,
    stdout and stderr (no interpreter start-up to pay)."""
    from precompute.cli import main
    capsys.readouterr()
    rc = main(_argv(manifest, cache, tiny_models, *extra, root=root))
    out, err = capsys.readouterr()
    return rc, out, err


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _rejects(cache: Path) -> dict[str, dict]:
    return {r["key"]: r for r in pq.read_table(cache / "rejects.parquet").to_pylist()}


def _turn(role, content, **kw):
    return {"role": role, "content": content, **kw}


# ---- any row, any bytes, never an abort; caps; recipient -------------------------------------------

def test_nul_key_caps_and_recipient_through_the_cli(tiny_models, tmp_path, capsys):
    """A key holding a NUL ended the job with exit 1 (`member 'bad' has no KEY.ext name`) on every
    run. Now it is one malformed_row naming the key; the job and a rerun exit 0. The caps per sample
    reject with too_large naming the option; the ChatML recipient is in the sample's conversation."""
    audio_item = {"type": "audio", "audio_url": AUDIO}
    rows = [
        {"key": "good", "text": "Hello there.", "audio": AUDIO},
        '{"key": "bad\\u0000key", "text": "Hello there.", "audio": "' + AUDIO + '"}',      # a JSON NUL escape
        '{"key": "lone", "text": "Hello \\ud800 there.", "audio": "' + AUDIO + '"}',       # a lone surrogate
        {"key": "long-text", "text": "x" * 500, "audio": AUDIO},                           # > max_text_tokens
        {"messages": [_turn("user", "Say it."), _turn("assistant", audio_item, recipient="narrator")],
         "misc": {"key": "recipient"}},
        {"messages": [_turn("user", "many"), _turn("assistant", [audio_item] * 10_000)],   # > max_audio_items
         "misc": {"key": "ten-thousand-items"}},
        {"messages": [_turn("user", "long"), _turn("assistant", [dict(audio_item, duration=2.0)] * 4)],
         "misc": {"key": "given-seconds"}},                                                # 8 s given > 5 s
        {"messages": [_turn("user", "long"), _turn("assistant", [audio_item] * 3)],
         "misc": {"key": "decoded-seconds"}},                                              # 3 x 2.3 s decoded
        {"id": "two-images", "image": [IMAGE, IMAGE],
         "conversations": [{"from": "human", "value": "<image><image>Same?"}, {"from": "gpt", "value": "Yes."}]},
    ]
    manifest = _write_jsonl(tmp_path / "m.jsonl", rows)
    caps = ["--max_text_tokens", "300", "--max_total_duration_s", "5", "--max_images", "1"]
    rc, out, err = _precompute_here(capsys, manifest, tmp_path / "cache", tiny_models, *caps)
    assert rc == 0, err[-3000:]
    rejects = _rejects(tmp_path / "cache")
    assert rejects["row-1"]["reason"] == "malformed_row"
    assert "key" in rejects["row-1"]["detail"] and "control character '\\x00'" in rejects["row-1"]["detail"]
    assert rejects["lone"]["reason"] == "malformed_row" and "text: not valid Unicode" in rejects["lone"]["detail"]
    for key, option in [("long-text", "max_text_tokens"), ("ten-thousand-items", "max_audio_items"),
                        ("given-seconds", "max_total_duration_s"), ("decoded-seconds", "max_total_duration_s"),
                        ("two-images", "max_images")]:
        assert rejects[key]["reason"] == "too_large", rejects[key]
        assert option in rejects[key]["detail"], rejects[key]
    reader = ShardReader(tmp_path / "cache")
    assert sorted(reader.keys) == ["good", "recipient"]
    turns = reader.get(reader.keys.index("recipient"))["json"]["conversation"]["turns"]
    assert [t.get("recipient") for t in turns] == [None, "narrator"]
    # the rerun: nothing left to encode, exit 0 again, the same cache
    rc, out, err = _precompute_here(capsys, manifest, tmp_path / "cache", tiny_models, *caps)
    assert rc == 0, err[-3000:]
    assert "nothing to encode: the cache holds all 9 rows" in out
    assert sorted(ShardReader(tmp_path / "cache").keys) == ["good", "recipient"]


def test_chatml_recipient_is_kept_with_its_turn(tmp_path):
    """Issue 20 item 6: the recipient of a ChatML message was dropped silently."""
    from precompute.manifests import read_requests as read_rows
    (tmp_path / "a.wav").write_bytes(b"")
    rec = {"messages": [_turn("system", "s"), _turn("user", "hi", recipient="narrator"),
                        _turn("assistant", {"type": "audio", "audio_url": "a.wav"}, recipient="")],
           "misc": {"key": "r"}}
    _write_jsonl(tmp_path / "m.jsonl", [rec])
    conv = read_rows(tmp_path / "m.jsonl")[0].conversation
    assert [t.get("recipient") for t in conv.to_json()["turns"]] == [None, "narrator", ""]
    assert "recipient" not in conv.to_json()["turns"][0]       # no key where the message had none


def _nested(depth: int) -> list:
    v: list = []
    for _ in range(depth):
        v = [v]
    return v


def test_rows_are_checked_field_by_field(tmp_path):
    """Values that cannot be written safely are named by field at the row (no job needed)."""
    from precompute.manifests import read_requests as read_rows
    (tmp_path / "a.wav").write_bytes(b"")
    rows = [
        {"key": "k" * 201, "text": "t", "audio": "a.wav"},
        {"key": "ok-1", "text": "t", "audio": "a.wav", "offset": 10**400},
        {"messages": [_turn("user", "hi")], "start_index": 1e999, "misc": {"key": "inf-start"}},
        {"messages": [_turn("user", "hi"), _turn("assistant", "x")], "misc": {"key": "nan-misc", "v": float("nan")}},
        {"messages": [_turn("user", "hi"), _turn("assistant", "x")], "misc": {"key": "deep", "v": _nested(40)}},
        {"id": "role-list", "conversations": [{"from": ["human"], "value": "x"}]},
        {"messages": [_turn("user", "hi", recipient=["a"]), _turn("assistant", "x")], "misc": {"key": "bad-recipient"}},
        {"key": "ok-2", "text": "t", "audio": "a.wav"},
    ]
    lines = [json.dumps(r, allow_nan=True) for r in rows] + ["[" * 100_000 + "]" * 100_000]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    got = read_rows(tmp_path / "m.jsonl")
    errors = [(r.error or ("", ""))[1] for r in got]
    assert "key: key of 201 bytes, longer than 200" in errors[0]
    assert "offset: expected a number of seconds" in errors[1]
    assert "start_index: expected an integer" in errors[2]
    assert "misc.v: nan is not a finite number" in errors[3]
    assert "nested deeper than 32 levels" in errors[4]
    assert "conversations[0].from" in errors[5]
    assert "messages[0].recipient: expected text" in errors[6]
    assert got[7].error is None and got[7].key == "ok-2"
    assert "line 9" in errors[8] and got[8].error[0] == "malformed_row"


@pytest.mark.parametrize("first", ["[1, 2]", "[" * 100_000 + "]" * 100_000, "{not json"],
                         ids=["array", "deep", "not-json"])
def test_a_bad_first_line_of_jsonl_is_one_bad_row(tmp_path, first):
    """Found by make test-long: a JSONL manifest whose first line was a JSON array was read as one JSON
    list (the whole job failed: "Extra data"), a deeply nested first line raised RecursionError."""
    from precompute.manifests import read_requests as read_rows
    (tmp_path / "a.wav").write_bytes(b"")
    (tmp_path / "m.jsonl").write_text(first + "\n" + json.dumps({"key": "ok", "text": "t", "audio": "a.wav"}) + "\n")
    bad, good = read_rows(tmp_path / "m.jsonl")
    assert bad.error[0] == "malformed_row" and good.error is None and good.key == "ok"


def test_a_number_out_of_bounds_exits_2_before_any_work(tmp_path):
    """--sample_rate 100000000000 gave an empty cache with exit 0 (every row MemoryError)."""
    out = tmp_path / "cache"
    cmd = [sys.executable, "-m", "shardcache", "precompute", "--manifest", str(DEMO / "samples.jsonl"),
           "--cache", str(out), "--sample_rate", "100000000000", "--max_audio_items=0",
           "--extra_fields={audio_a16k: {producer: waveform, sample_rate: 1000000}}"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2, r.stderr
    assert "error: sample_rate: expected an integer > 0 and <= 384000, got 100000000000" in r.stderr
    assert "error: max_audio_items: expected an integer > 0 and <= 1000000, got 0" in r.stderr
    assert "error: extra_fields.audio_a16k.sample_rate: expected an integer > 0 and <= 384000" in r.stderr
    assert not out.exists()
    r = subprocess.run([sys.executable, "-m", "shardcache", "train", "--cache", str(out), "--data.batch_size", "1000000000",
                        "--print_config"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "data.batch_size: expected an integer > 0 and <= 1000000" in r.stderr, r.stderr


def test_every_number_of_both_configs_is_bounded():
    """No numeric option is left without a lower and an upper bound in its type (a typo like 1e11 must exit 2):
    every int or float of an annotation is a bounded() type, jsonargparse's restricted number type."""
    import operator
    import typing
    from precompute.add_field import AddFieldOptions
    from precompute.config import PrecomputeConfig
    from shardcache import config as S
    from train.config import TrainConfig
    for cls in (PrecomputeConfig, TrainConfig, AddFieldOptions):
        for path, (tp, f) in S.options(cls).items():
            for part in typing.get_args(tp) or (tp,):
                if part in (int, float):
                    raise AssertionError(f"{cls.__name__}.{path} is an unbounded {part.__name__}")
                if hasattr(part, "_restrictions"):
                    ops = {op for op, _ in part._restrictions}
                    assert ops & {operator.le, operator.lt} and ops & {operator.gt, operator.ge}, (cls, path)


# ---- YAML with limits -------------------------------------------------------------------------------

def _bomb(levels: int = 9, prefix: str = "    ") -> str:
    lines = [f'{prefix}a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"{prefix}a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_yaml_alias_bomb_in_model_kwargs_is_refused_fast(tmp_path):
    """A billion-laughs YAML inside model.kwargs hung the training CLI; now exit 2 naming it, in
    the config file, in a flag value, and in add-field's --config."""
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text("model:\n  name: reference\n  kwargs:\n" + _bomb())
    r = subprocess.run([sys.executable, "-m", "shardcache", "train", "--config", str(cfg), "--cache", str(tmp_path),
                        "--print_config"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2, r.stderr
    assert f"--config {cfg}: refused: its aliases expand to more than 100000 values" in r.stderr
    flag = "{" + ", ".join(_bomb(prefix="").splitlines()) + "}"
    r = subprocess.run([sys.executable, "-m", "shardcache", "train", "--model.kwargs", flag, "--cache", str(tmp_path),
                        "--print_config"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "model.kwargs: refused: its aliases expand" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "shardcache", "add-field", str(tmp_path / "no-cache"), "--field",
                        "codes_x", "--config", str(cfg)], cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "refused: its aliases expand" in r.stderr, r.stderr  # a bad option: exit 2


def test_yaml_limits_keep_ordinary_configs():
    from shardcache.yaml_limits import YAMLRefused, load_yaml
    text = "base: &b {lr: 1.0e-3, steps: 10}\nrun1: {<<: *b, steps: 20}\nrun2: *b\n"
    assert load_yaml(text, "x") == {"base": {"lr": 1e-3, "steps": 10}, "run1": {"lr": 1e-3, "steps": 20},
                                    "run2": {"lr": 1e-3, "steps": 10}}
    assert len(load_yaml(_bomb(levels=5, prefix=""), "x")["a4"]) == 9   # 9**5 = 59049 values: allowed
    with pytest.raises(YAMLRefused, match="x: refused: its aliases expand"):
        load_yaml(_bomb(levels=6, prefix=""), "x")
    with pytest.raises(YAMLRefused, match="recursive alias"):
        load_yaml("a: &a [1, *a]\n", "x")
    with pytest.raises(YAMLRefused, match="more than the 1048576 a config may have"):
        load_yaml("a: " + "x" * (1 << 20) + "\n", "x")
    with pytest.raises(YAMLRefused, match="nested too deeply"):
        load_yaml("[" * 50_000 + "]" * 50_000, "x")


# ---- paths stay inside --root -------------------------------------------------------------------------

def test_paths_outside_the_root_are_rejected_naming_the_field(tmp_path):
    from precompute.manifests import read_requests as read_rows
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    for d in (root, outside):
        shutil.copy(DEMO / AUDIO, d / "a.flac")
        shutil.copy(DEMO / IMAGE, d / "i.jpg")
    (root / "link-in.flac").symlink_to(root / "a.flac")
    (root / "link-out.flac").symlink_to(outside / "a.flac")
    (root / "dir-out").symlink_to(outside)
    rows = [
        {"key": "plain", "text": "t", "audio": "a.flac"},
        {"key": "abs-inside", "text": "t", "audio": str(root / "sub" / ".." / "a.flac")},
        {"key": "link-in", "text": "t", "audio": "link-in.flac"},
        {"key": "dotdot", "text": "t", "audio": "../elsewhere/a.flac"},
        {"key": "absolute", "text": "t", "audio": str(outside / "a.flac")},
        {"key": "link-out", "text": "t", "audio": "link-out.flac"},
        {"key": "dir-link", "text": "t", "audio": "dir-out/a.flac"},
        {"messages": [_turn("user", "x"), _turn("assistant", {"type": "audio", "audio_url": "../elsewhere/a.flac"})],
         "misc": {"key": "chatml"}},
        {"id": "llava", "image": "dir-out/i.jpg", "conversations": [{"from": "human", "value": "<image>?"},
                                                                    {"from": "gpt", "value": "A cup."}]},
    ]
    manifest = _write_jsonl(root / "m.jsonl", rows)
    got = {r.key if r.error is None else r.error[1].split(":")[0]: r for r in read_rows(manifest)}
    assert {k for k, r in got.items() if r.error is None} == {"plain", "abs-inside", "link-in"}
    fields = {"row 3": "audio", "row 4": "audio", "row 5": "audio", "row 6": "audio",
              "row 7": "messages[1].content.audio_url", "row 8": "image"}
    for row, field in fields.items():
        reason, detail = got[row].error
        assert reason == "malformed_row" and detail.startswith(f"{row}: {field}: "), detail
        assert "outside the media root" in detail and "allow_outside_root: true" in detail, detail
    assert "through a symlink" in got["row 5"].error[1]
    everything = read_rows(manifest, allow_outside_root=True)
    assert all(r.error is None for r in everything)
    assert everything[3].conversation.audio[0].source == str(root / "../elsewhere/a.flac")
    # --root a folder holding both: the absolute path elsewhere is inside it
    assert read_rows(manifest, root=tmp_path)[4].error is None
    # --root a symlink to the folder: the same rows are inside and outside as before
    (tmp_path / "root-link").symlink_to(root)
    via_link = read_rows(manifest, root=tmp_path / "root-link")
    assert [r.error is None for r in via_link] == [r.error is None for r in got.values()]


def test_a_manifest_whose_every_path_is_outside_stops_naming_root(tmp_path):
    """Every row outside the root means the root is wrong: exit 1 before loading a model, not an empty cache."""
    manifest = _write_jsonl(tmp_path / "m.jsonl", [{"key": "a", "text": "t", "audio": str(DEMO / AUDIO)}])
    r = subprocess.run([sys.executable, "-m", "shardcache", "precompute", "--manifest", str(manifest),
                        "--cache", str(tmp_path / "c")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=ENV)
    assert r.returncode == 1, r.stderr
    assert "every row names media outside the manifest's folder" in r.stderr
    assert "pass --root DIR" in r.stderr and "Loading weights" not in r.stderr


# ---- one writer per cache ------------------------------------------------------------------------------

@pytest.mark.long  # make test-long; tests/test_one_writer.py covers one writer per cache in make test
def test_two_precompute_processes_on_one_cache(tiny_models, tmp_path, capsys):
    """Two processes on one cache both encoded everything and one could fail with FileNotFoundError
    on a .tmp. Now the second (this process, through the CLI's entry point) stops at once naming the
    first (host, pid); the first finishes."""
    cache = tmp_path / "cache"
    manifest = _write_jsonl(tmp_path / "m.jsonl", [{"key": f"k{i}", "text": "Hello.", "audio": AUDIO} for i in range(2)])
    first = subprocess.Popen([sys.executable, "-m", "shardcache", "precompute",
                              *_argv(manifest, cache, tiny_models)], cwd=ROOT, env=ENV, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lock = cache / "parts" / "writer.lock"
    deadline = time.monotonic() + 300
    holder: dict = {}
    while time.monotonic() < deadline and holder.get("pid") != first.pid and first.poll() is None:
        time.sleep(0.05)
        try:
            holder = json.loads(lock.read_text() or "{}")
        except (OSError, ValueError):
            pass
    assert holder.get("pid") == first.pid, "the first job never took the lock"
    rc, out, err = _precompute_here(capsys, manifest, cache, tiny_models)
    stdout, stderr = first.communicate(timeout=600)
    assert rc == 2, err[-2000:]                       # refused before writing anything (issue 41: exit 2)
    assert f"is being written by another shardcache command (precompute on host {holder['host']}, pid {first.pid} " \
        in err, err
    assert "lock file" in err and str(lock) in err
    assert first.returncode == 0, stderr[-2000:]
    assert "kept 2," in stdout


def test_a_dead_writers_lock_is_taken_over(tmp_path, caplog):
    """A holder killed with SIGKILL leaves its lock file; the next writer takes the lock over."""
    from precompute.lock import CacheLock, CacheLocked
    cache = tmp_path / "cache"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from precompute.lock import CacheLock; "
                               f"CacheLock({str(cache)!r}).acquire(); print('held', flush=True); time.sleep(600)"],
                              cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(CacheLocked, match=f"pid {holder.pid} "):
        CacheLock(cache).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((cache / "parts" / "writer.lock").read_text())["pid"] == holder.pid   # the stale file stays
    caplog.set_level("INFO", logger="precompute")
    with CacheLock(cache):
        assert f"pid {holder.pid} " in caplog.text and "lock taken over" in caplog.text
        # read by another process: a second descriptor closed here would drop this process's record lock
        lock_text = subprocess.run(["cat", str(cache / "parts" / "writer.lock")], capture_output=True, text=True).stdout
        assert json.loads(lock_text)["pid"] == os.getpid()
        other = subprocess.run([sys.executable, "-c", f"from precompute.lock import CacheLock; "
                                f"CacheLock({str(cache)!r}).acquire()"], cwd=ROOT, env=ENV, capture_output=True,
                               text=True)
        assert other.returncode == 1 and f"pid {os.getpid()} " in other.stderr, other.stderr
    CacheLock(cache).acquire().release()                                              # released on exit


# ---- manifest.json at training time -------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_caches(tmp_path_factory):
    """Two caches with the same number of samples (24) and different contents."""
    from test_train_support import make_cache
    base = tmp_path_factory.mktemp("caches")
    return make_cache(base / "a", n=24, seed=0), make_cache(base / "b", n=24, seed=1)


def _cfg(cache, out, **kw):
    from test_train_support import REAL_LOADER, TINY_MODEL
    from test_train_support import from_dict
    base = dict(cache=str(cache), out=str(out), loader=REAL_LOADER, model_kwargs=TINY_MODEL, batch_size=4,
                steps=4, warmup_steps=0, lr=1e-3, ckpt_every=4, progress=False, threads=1, log_every=1,
                validation=False)
    base.update(kw)
    return from_dict(base)


@pytest.fixture()
def _single_process(monkeypatch):
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("damage,names", [
    ("delete", ["manifest.json is missing"]),
    ("types", ["manifest.json: n_codebooks: expected an integer >= 1, got 'nine'",
               "latent_channels: expected an integer >= 1, got -16",
               "text.special_token_ids.<|AUDIO|>: expected an integer >= 0, got 'x'"]),
    ("not-json", ["manifest.json: not valid JSON"]),
])
def test_a_missing_or_damaged_manifest_is_named_at_training(two_caches, tmp_path, damage, names, _single_process):
    """A deleted or badly typed manifest.json gave IndexError / negative dimensions deep in the model."""
    from train.trainer import run
    cache = tmp_path / "c"
    shutil.copytree(two_caches[0], cache)
    m = cache / "manifest.json"
    if damage == "delete":
        m.unlink()
    elif damage == "types":
        d = json.loads(m.read_text())
        d.update(n_codebooks="nine", latent_channels=-16)
        d["text"]["special_token_ids"] = {"<|AUDIO|>": "x"}
        m.write_text(json.dumps(d))
    else:
        m.write_text("{not json")
    with pytest.raises(Exception) as e:
        run(_cfg(cache, tmp_path / "run"))
    assert isinstance(e.value, ManifestError) or "manifest.json" in str(e.value), repr(e.value)
    for text in names:
        assert text in str(e.value), str(e.value)


# ---- cache identity ----------------------------------------------------------------------------------

def test_cache_id_is_recorded_and_kept_by_a_remerge_and_reindex(two_caches, tmp_path):
    from shards import cache_id, merge_parts, read_cache_id, read_index
    a, b = two_caches
    ida, idb = read_manifest(a)["cache_id"], read_manifest(b)["cache_id"]
    assert ida != idb and len(ida) == 16
    assert cache_id(read_index(a)) == ida                                   # what the manifest records
    c = tmp_path / "c"
    shutil.copytree(a, c)
    d = read_manifest(c)
    merge_parts(c, {k: v for k, v in d.items() if k not in ("cache_id", "counts", "shards", "created")})
    assert read_manifest(c)["cache_id"] == ida
    r = subprocess.run([sys.executable, "-m", "shardcache", "shards", "reindex", str(c), "--no_progress"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stderr
    assert read_manifest(c)["cache_id"] == ida
    assert read_cache_id(c) == ida                                          # checked against integrity.json
    del d["cache_id"]                                                       # an edited manifest is refused
    (c / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ShardCorrupt, match="manifest.json does not match integrity.json"):
        read_cache_id(c)


def test_loader_state_refuses_another_cache(two_caches):
    from loaders import ShardLoader
    a, b = two_caches
    la, lb = ShardLoader(a, batch_size=4, seed=0), ShardLoader(b, batch_size=4, seed=0)
    next(iter(la))
    sd = la.state_dict()
    assert sd["cache_id"] == read_manifest(a)["cache_id"] == la.cache_id
    with pytest.raises(ValueError, match=f"recorded on the cache with id {la.cache_id}, this loader reads the "
                                         f"cache with id {lb.cache_id}"):
        lb.load_state_dict(sd)
    lb.load_state_dict({k: v for k, v in sd.items() if k != "cache_id"})    # on purpose: by position
    assert lb.step == 1
    from loaders import Mix, MixedLoader
    mixed = MixedLoader({"a": a, "b": b}, batch_size=4, mix=Mix(weights={"a": 1, "b": 1}))
    assert mixed.state_dict()["cache_id"] == f"{la.cache_id}+{lb.cache_id}"
    swapped = MixedLoader({"a": b, "b": a}, batch_size=4, mix=Mix(weights={"a": 1, "b": 1}))
    with pytest.raises(ValueError, match="recorded on the cache with id"):
        swapped.load_state_dict(mixed.state_dict())


def test_resume_on_another_cache_is_refused_and_allowed_with_the_flag(two_caches, tmp_path, _single_process):
    """Train 4 steps on A, resume with --cache B (same number of samples) and --checkpoint.resume auto:
    it went on with no warning. Now refused naming both ids; --checkpoint.allow_other_cache resumes."""
    from train.trainer import run
    a, b = two_caches
    out = tmp_path / "run"
    assert run(_cfg(a, out)) == 0
    ida, idb = read_manifest(a)["cache_id"], read_manifest(b)["cache_id"]
    st = torch.load(out / "step-4" / "trainer.pt", weights_only=True)
    assert st["cache_id"] == ida and all(s["cache_id"] == ida for s in st["loaders"])
    with pytest.raises(ValueError) as e:
        run(_cfg(b, out, steps=8, resume="auto"))
    msg = str(e.value)
    assert f"cache {a} (cache id {ida})" in msg and f"--data.cache {b} has cache id {idb}" in msg, msg
    assert "--checkpoint.allow_other_cache" in msg
    assert [p.name for p in sorted(out.glob("step-*"))] == ["step-4"]       # nothing trained, nothing written
    assert run(_cfg(b, out, steps=8, resume="auto", **{"checkpoint": {"allow_other_cache": True}})) == 0
    st = torch.load(out / "step-8" / "trainer.pt", weights_only=True)
    assert st["step"] == 8 and st["cache_id"] == idb
    assert run(_cfg(a, tmp_path / "run2", steps=4)) == 0                     # the same cache resumes as before
    assert run(_cfg(a, tmp_path / "run2", steps=6, resume="auto")) == 0
    st = torch.load(tmp_path / "run2" / "step-6" / "trainer.pt", weights_only=True)
    del st["cache_id"]                                                      # a checkpoint that records no cache id
    torch.save(st, tmp_path / "run2" / "step-6" / "trainer.pt")
    with pytest.raises(ValueError, match=r"\(cache id None\); --data.cache .* has cache id"):
        run(_cfg(a, tmp_path / "run2", steps=8, resume=str(tmp_path / "run2" / "step-6")))
