"""Issue 41 item 5: bad input is a named reject or exit 2, never a guess.

NaN windows, repeated JSON keys, repeated CSV headers, byte-order marks inside a manifest, keys that
are equal after Unicode normalisation, a FIFO or a device given as a config or manifest path, and a
job whose every row is rejected. Each case goes through the manifest reader stage one uses
(:func:`precompute.manifests.read_requests`) or the command line, and is judged by the reject
reason and detail, or the exit status and message.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DEMO, ROOT

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
AUDIO = str(DEMO / "audio" / "spk-us-0001.flac")     # 2.15 s


def read(path: Path, **kw):
    from precompute.manifests import read_requests
    return read_requests(path, root=DEMO, allow_outside_root=True, **kw)


def wrote_nothing(cache: Path) -> bool:
    """No shard, index or manifest in ``cache`` (its folder, marker and lock file may be there)."""
    return not list(cache.glob("*.tar")) and not (cache / "index.parquet").exists() \
        and not (cache / "manifest.json").exists()


def by_key(requests) -> dict:
    return {r.key: r for r in requests}


# ---- windows --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["offset", "duration"])
@pytest.mark.parametrize("shape", ["jsonl", "parquet", "chatml"])
def test_a_nan_window_is_rejected_not_read_as_the_whole_clip(tmp_path, field, shape):
    """A NaN offset/duration was read as "absent": the row was kept as the whole clip. Now it is a
    malformed_row naming the field (inf already was)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    good = {"key": "good", "text": "Fine.", "audio": AUDIO, field: 0.5}
    bad = {"key": "bad", "text": "Not fine.", "audio": AUDIO, field: float("nan")}
    if shape == "jsonl":
        path = tmp_path / "m.jsonl"
        path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")      # json writes NaN as NaN
        assert "NaN" in path.read_text()
    elif shape == "parquet":
        path = tmp_path / "m.parquet"
        pq.write_table(pa.Table.from_pylist([good, bad]), path)
    else:
        path = tmp_path / "m.jsonl"
        recs = [{"misc": {"key": r["key"]}, "messages": [
            {"role": "user", "content": r["text"]},
            {"role": "assistant", "content": {"type": "audio", "audio_url": AUDIO, field: r[field]}}]}
            for r in (good, bad)]
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = by_key(read(path))
    assert got["good"].error is None
    reason, detail = got["bad"].error
    assert reason == "malformed_row" and field in detail and "nan" in detail.lower(), detail


def test_a_nan_start_index_is_rejected(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"misc": {"key": "k"}, "start_index": float("nan"), "messages": [
        {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}) + "\n")
    [r] = read(path)
    assert r.error[0] == "malformed_row" and "start_index" in r.error[1], r.error


# ---- repeated and look-alike keys ----------------------------------------------------------------------------

def test_a_json_row_with_a_repeated_key_is_rejected_naming_it(tmp_path):
    """{"audio": A, "audio": B} kept the last value silently. Now the row is a malformed_row naming
    the key, in JSON lines, in a JSON list and nested in a ChatML message; the other rows are kept."""
    lines = ['{"key": "ok", "text": "Fine.", "audio": "%s"}' % AUDIO,
             '{"key": "twice", "text": "Which?", "audio": "%s", "audio": "other.flac"}' % AUDIO,
             '{"misc": {"key": "nested"}, "messages": [{"role": "user", "content": "Hi."}, '
             '{"role": "assistant", "role": "user", "content": {"type": "audio", "audio_url": "%s"}}]}' % AUDIO]
    for name, text in (("m.jsonl", "\n".join(lines) + "\n"), ("m.json", "[" + ",\n".join(lines) + "]")):
        path = tmp_path / name
        path.write_text(text)
        got = read(path)
        assert [r.error is None for r in got] == [True, False, False], [(r.key, r.error) for r in got]
        assert got[0].key == "ok"
        assert all(r.error[0] == "malformed_row" for r in got[1:])
        assert "repeated key 'audio'" in got[1].error[1] and "repeated key 'role'" in got[2].error[1]


def test_json_keys_equal_after_nfc_are_rejected(tmp_path):
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"key": "k", "text": "x", "audio": AUDIO, composed: 1, decomposed: 2}) + "\n")
    [r] = read(path)
    assert r.error[0] == "malformed_row" and "NFC" in r.error[1], r.error


def test_row_keys_equal_after_nfc_are_one_key(tmp_path):
    """Two rows keyed "café" (composed) and "café" (decomposed) were two samples whose keys look the
    same. Now the second is a duplicate_key reject naming both."""
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"key": k, "text": "x", "audio": AUDIO}) + "\n" for k in (composed, decomposed)))
    first, second = read(path)
    assert first.error is None and first.key == composed
    assert second.error[0] == "duplicate_key" and "NFC" in second.error[1], second.error


@pytest.mark.parametrize("header", ["key,audio,text,audio", "key,\u00e1udio,text,a\u0301udio"], ids=["same", "nfc"])
def test_a_csv_header_naming_a_column_twice_exits_2(tmp_path, header):
    """A CSV header naming `audio` twice was read (the last column won). Now the manifest is refused
    (exit 2 before any model loads) naming the column; also for names equal after NFC."""
    from precompute.manifests import ManifestUnreadable
    path = tmp_path / "m.csv"
    path.write_text(header + "\n" + f"k1,{AUDIO},Hello,{AUDIO}\n")
    with pytest.raises(ManifestUnreadable, match="names the column .* twice"):
        read(path)
    r = subprocess.run([sys.executable, "-m", "shardcache", "precompute", "--manifest", str(path), "--cache",
                        str(tmp_path / "c"), "--no_progress"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and "twice" in r.stderr, r.stderr[-1500:]
    assert wrote_nothing(tmp_path / "c")


def test_a_parquet_manifest_naming_a_column_twice_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from precompute.manifests import ManifestUnreadable
    t = pa.Table.from_arrays([pa.array(["k"]), pa.array([AUDIO]), pa.array(["x"]), pa.array([AUDIO])],
                             names=["key", "audio", "text", "audio"])
    pq.write_table(t, tmp_path / "m.parquet")
    with pytest.raises(ManifestUnreadable, match="'audio' twice"):
        read(tmp_path / "m.parquet")


# ---- byte-order marks inside a file ----------------------------------------------------------------------

def test_a_bom_inside_a_manifest_is_named(tmp_path):
    """Two manifests joined with their byte-order marks: the second file's first row began with an
    invisible U+FEFF. In JSON lines that row is a reject naming the BOM; in CSV the row whose first
    cell (its key) starts with one is a reject too (it was kept under a key that looks like another's);
    a key holding a BOM anywhere is refused; a header cell holding one refuses the file."""
    from precompute.manifests import ManifestUnreadable
    bom = "\ufeff"
    row = lambda k: json.dumps({"key": k, "text": "x", "audio": AUDIO}) + "\n"  # noqa: E731
    path = tmp_path / "m.jsonl"
    path.write_text(bom + row("a") + bom + row("b") + row("c" + bom))
    got = read(path)
    assert got[0].error is None and got[0].key == "a"                        # the file's own BOM: its encoding
    assert got[1].error[0] == "malformed_row" and "byte-order mark" in got[1].error[1], got[1].error
    assert got[2].error[0] == "malformed_row" and "byte-order mark" in got[2].error[1], got[2].error
    csv_path = tmp_path / "m.csv"
    csv_path.write_text(f"{bom}key,audio,text\nk1,{AUDIO},x\n{bom}k1,{AUDIO},y\n")
    a, b = read(csv_path)
    assert a.error is None and a.key == "k1"
    assert b.error[0] == "malformed_row" and "byte-order mark" in b.error[1], b.error
    (tmp_path / "h.csv").write_text(f"key,{bom}audio,text\nk1,{AUDIO},x\n")
    with pytest.raises(ManifestUnreadable, match="byte-order mark"):
        read(tmp_path / "h.csv")


# ---- a FIFO or a device where a file belongs ------------------------------------------------------------

def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardcache", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
@pytest.mark.long  # make test-long (every command); test_manifest_parsing's and test_media_root's FIFO refusals run in make test
def test_a_fifo_or_device_as_a_config_or_manifest_exits_2(tmp_path, demo_cache):
    """A FIFO given as --config hung the command (reading a named pipe waits for a writer). Now every
    command that reads a config or manifest path exits 2 at once, naming the option and what it is."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"key": "k", "text": "x", "audio": AUDIO}) + "\n")
    cache = str(tmp_path / "c")
    cases = {
        "precompute --config": ["precompute", "--manifest", str(manifest), "--cache", cache, "--config", str(fifo)],
        "precompute $SHARDCACHE_PRECOMPUTE_CONFIG": None,
        "precompute --config /dev/zero": ["precompute", "--manifest", str(manifest), "--cache", cache,
                                          "--config", "/dev/zero"],
        "precompute --manifest": ["precompute", "--manifest", str(fifo), "--cache", cache, "--config", "none"],
        "train --config": ["train", "--config", str(fifo), "--cache", str(demo_cache)],
        "train --model FILE": ["train", "--config", "none", "--cache", str(demo_cache), "--model", str(fifo)],
        "find-batch-size --config": ["find-batch-size", "--config", str(fifo), "--cache", str(demo_cache)],
        "add-field --config": ["add-field", str(demo_cache), "--field", "codes_mimi", "--config", str(fifo)],
        "check --manifest": ["check", str(demo_cache), "--manifest", str(fifo)],
    }
    for name, args in cases.items():
        if args is None:
            r = subprocess.run([sys.executable, "-m", "shardcache", "precompute", "--manifest", str(manifest), "--cache",
                                cache], cwd=ROOT, env=dict(ENV, SHARDCACHE_PRECOMPUTE_CONFIG=str(fifo)),
                               capture_output=True, text=True, timeout=120)
        else:
            r = _run(args)                                       # (a hang is a TimeoutExpired: the test fails)
        what = "character device" if "/dev/zero" in name else "FIFO"
        assert r.returncode == 2, f"{name}: exit {r.returncode}: {r.stderr[-1500:]}"
        option = name.split()[1] if name.split()[1].startswith("--") else "--config"
        assert what in r.stderr and (option in r.stderr or "manifest" in r.stderr), f"{name}: {r.stderr[-1500:]}"
    assert wrote_nothing(Path(cache))


# ---- a job whose every row is rejected ---------------------------------------------------------------------

def test_a_job_whose_cache_ends_with_0_samples_exits_1_naming_the_reasons(tiny_models, tmp_path, capsys):
    """Every row rejected gave a 0-sample cache and exit 0. Now the job exits 1, naming the reject
    reasons with their counts (rejects.parquet names each row)."""
    from precompute.cli import main
    manifest = tmp_path / "m.jsonl"
    rows = [{"key": f"gone{i}", "text": "x", "audio": f"audio/missing-{i}.flac"} for i in range(3)]
    rows.append({"key": "short", "text": "x", "audio": "audio/spk-us-0001.flac", "duration": 0.01})
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    rc = main(["--manifest", str(manifest), "--cache", str(tmp_path / "c"), "--config",
               str(ROOT / "configs" / "precompute.yaml"), f"--audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}",
               f"--image_encoder.pretrained={tiny_models / 'wan-tiny'}", "--device=cpu", "--num_workers=0",
               "--no_progress", "--root", str(DEMO)])
    out, err = capsys.readouterr()
    assert rc == 1, out + err[-1500:]
    assert "holds 0 samples" in err and "missing_file (3)" in err and "too_short (1)" in err, err[-1500:]
