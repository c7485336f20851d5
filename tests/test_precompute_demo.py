"""Stage one end to end on the bundled demo data (real espeak-ng speech, scikit-image photos)."""
from __future__ import annotations

import io
import json
import math
import tarfile

import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from pathlib import Path

from shards import ShardReader, read_index, read_manifest, read_rejects
from shards.schema import TENSOR_DTYPES

from conftest import DEMO


def _expected():
    good = []
    for line in (DEMO / "samples.jsonl").read_text().splitlines():
        try:
            good.append(json.loads(line))
        except ValueError:
            pass
    bad = json.loads((DEMO / "expected_rejects.json").read_text())
    return good, bad


def test_keeps_every_good_sample_and_rejects_every_bad_one(demo_cache):
    rows, bad = _expected()
    bad_keys = {b["key"] for b in bad}
    good_keys = {r["key"] for r in rows if r["key"] not in bad_keys or
                 any(b["key"] == r["key"] and b["reason"] == "duplicate_key" for b in bad)}
    index = read_index(demo_cache)
    assert set(index.column("key").to_pylist()) == good_keys
    rejects = read_rejects(demo_cache).to_pylist()
    got = {(r["key"], r["reason"]) for r in rejects}
    assert got == {(b["key"], b["reason"]) for b in bad}
    assert all(r["detail"] for r in rejects)


def test_cache_files_and_manifest(demo_cache):
    for name in ("index.parquet", "rejects.parquet", "manifest.json"):
        assert (demo_cache / name).is_file()
    m = read_manifest(demo_cache)
    assert m["format_version"] == 1
    assert m["n_codebooks"] == 8 and m["codebook_size"] == 1024 and m["frame_rate"] == 25.0
    assert m["encoders"]["audio_tokenizer"]["class"].endswith("DacTokenizer")
    assert m["encoders"]["image_encoder"]["class"].endswith("WanVAEEncoder")
    assert len(m["encoders"]["audio_tokenizer"]["weights_sha256"]) == 64
    assert m["counts"]["samples"] == read_index(demo_cache).num_rows
    assert not list(demo_cache.glob("*.tmp"))
    for s in m["shards"]:
        assert (demo_cache / s["path"]).stat().st_size == s["bytes"]


def test_tensors_have_recorded_shapes_and_contract(demo_cache):
    m = read_manifest(demo_cache)
    reader = ShardReader(demo_cache)
    n_image = 0
    for i in range(len(reader)):
        s = reader.get(i)
        meta = s["json"]
        assert meta["text"].strip()
        n = s["audio"].shape[0]
        assert s["audio"].dtype == np.int16 and n == round(meta["duration_s"] * m["sample_rate"]) or \
            abs(n - meta["duration_s"] * m["sample_rate"]) <= 2
        assert s["codes"].shape == (8, math.ceil(n / 960)) and s["codes"].dtype == np.int16
        assert 0 <= s["codes"].min() and s["codes"].max() < 1024
        assert s["input_ids"].dtype == np.int32 and s["input_ids"].ndim == 1
        assert s["labels"].shape == s["input_ids"].shape and s["labels"].dtype == np.int32
        assert s["audio_segments"].tolist() == [[0, 1, 1, 0, s["codes"].shape[1], 0 if meta["speaker"] else -1]]
        assert s["audio_starts"].tolist() == [0, n]
        if "latents" in s:
            n_image += 1
            assert s["latents"].shape == (16, 1, 8, 8) and s["latents"].dtype == np.float16
            assert np.isfinite(s["latents"]).all()
    assert n_image == 6  # photo + spoken caption rows (the truncated JPEG row is rejected)


def test_shards_open_with_upstream_webdataset_and_tarfile(demo_cache):
    index = read_index(demo_cache).to_pylist()
    by_key = {r["key"]: r for r in index}
    shards = sorted(str(p) for p in demo_cache.glob("shard-*.tar"))
    seen = 0
    for sample in wds.WebDataset(shards, shardshuffle=False).decode():
        row = by_key[sample["__key__"]]
        for member in row["members"]:
            if member["name"] in TENSOR_DTYPES:  # packed arrays come back inside tensors.npz
                arr = (sample[member["member"]][member["name"][:-4]] if member["member"]
                       else sample[member["name"]])
                assert arr.dtype == np.dtype(member["dtype"]) and list(arr.shape) == member["shape"]
        assert sample["json"]["text"]
        seen += 1
    assert seen == len(index)
    checked = 0
    for shard in shards:
        with tarfile.open(shard) as tf:
            for info in tf:
                data = tf.extractfile(info).read()
                key, ext = info.name.split(".", 1)
                if ext.endswith(".npy"):
                    arrays = {ext: np.load(io.BytesIO(data), allow_pickle=False)}
                elif ext.endswith(".npz"):
                    arrays = {f"{k}.npy": v for k, v in np.load(io.BytesIO(data), allow_pickle=False).items()}
                else:
                    continue
                for name, arr in arrays.items():  # the index offsets locate the same arrays
                    member = next(m for m in by_key[key]["members"] if m["name"] == name)
                    assert list(arr.shape) == member["shape"]
                    raw = open(shard, "rb").read()[member["offset"]:member["offset"] + member["size"]]
                    assert np.array_equal(np.frombuffer(raw, dtype=member["dtype"]).reshape(arr.shape), arr)
                    checked += 1
    assert checked == sum(m["name"] in TENSOR_DTYPES for r in index for m in r["members"])


class OpenatTrace:
    """``strace -f -e trace=openat -p <this process>`` while the block runs: every file this process
    opens, by Python or by a C library (libsndfile), at the OS level. ``opens(part)``: successful
    openat calls per path containing ``part``. Raises pytest.skip where strace is missing or may
    not attach (ptrace restrictions, e.g. Yama ptrace_scope or a container without CAP_SYS_PTRACE)."""

    def __init__(self, log):
        self.log = log

    def _wait_for(self, marker, timeout=20.0):
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            open(marker, "w").close()
            if self.log.exists() and str(marker) in self.log.read_text():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.1)
        return False

    def __enter__(self):
        import os
        import shutil
        import subprocess
        if shutil.which("strace") is None:
            pytest.skip("strace is not installed (apt-get install strace)")
        self.proc = subprocess.Popen(["strace", "-f", "-qq", "-e", "trace=openat", "-o", str(self.log), "-p",
                                      str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not self._wait_for(self.log.with_name("strace-start")):
            self.proc.kill()
            pytest.skip(f"strace cannot attach here: {self.proc.communicate()[1].strip()[:200]}")
        return self

    def __exit__(self, *exc):
        import signal
        self._wait_for(self.log.with_name("strace-end"))
        self.proc.send_signal(signal.SIGINT)  # detach
        self.proc.wait(timeout=30)

    def opens(self, part: str) -> dict[str, int]:
        import re
        out: dict[str, int] = {}
        for line in self.log.read_text().splitlines():  # (threads: "openat(..., "PATH", ... <unfinished ...>")
            m = re.search(r'openat\([^,]+, "([^"]*' + re.escape(part) + r'[^"]*)"', line)
            if m and "= -1 " not in line:
                out[m.group(1)] = out.get(m.group(1), 0) + 1
        return out


def test_each_audio_file_opened_exactly_once(tiny_config, tmp_path):
    """Counted at the OS level (strace attached to this process during the job: Python's open and
    libsndfile's ``sf_open`` alike): each audio file is opened once. The demo's speech rows (WAV,
    FLAC, an empty and a broken file; no images: tracing slows every syscall). Skipped where
    strace is missing or cannot attach."""
    import dataclasses
    from precompute.job import run
    rows = [json.loads(ln) for ln in (DEMO / "samples.jsonl").read_text().splitlines()[:12]]
    rows = [dict(r, audio=str(DEMO / r["audio"])) for r in rows if "image" not in r]
    manifest = tmp_path / "speech.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dataclasses.replace(tiny_config, image_encoder=None)
    from precompute.encode import load_encoders
    load_encoders(cfg, "cpu")  # imports (transformers, librosa) before tracing: thousands of syscalls
    import librosa  # noqa: F401
    with OpenatTrace(tmp_path / "strace.log") as trace:
        summary, _ = run(manifest, tmp_path / "c", cfg, progress=False)
    opened = trace.opens("/data/demo/audio/")
    present = {r["audio"] for r in rows if Path(r["audio"]).is_file() and Path(r["audio"]).stat().st_size}
    assert summary.kept >= 6 and present and set(opened) >= present, sorted(present - set(opened))
    assert max(opened.values()) == 1, {k: v for k, v in opened.items() if v > 1}


def test_rejects_parquet_columns(demo_cache):
    t = pq.read_table(demo_cache / "rejects.parquet")
    assert t.column_names == ["key", "source", "reason", "detail"]
    missing = [r for r in t.to_pylist() if r["reason"] == "missing_file"]
    assert missing and missing[0]["source"].endswith(".wav")


def test_summary_counts_encoder_time(tiny_config, tmp_path):
    from precompute.job import run
    summary, manifest = run(DEMO / "samples.jsonl", tmp_path / "c", tiny_config, progress=False)
    assert summary.kept == manifest["counts"]["samples"] and summary.rejected == manifest["counts"]["rejected"]
    assert 0 < summary.encoder_busy <= 1
    again, _ = run(DEMO / "samples.jsonl", tmp_path / "c", tiny_config, progress=False)
    assert again.kept == 0 and again.skipped_rows == summary.kept + summary.rejected


def test_decode_worker_processes_give_the_same_cache(tiny_config, demo_cache, tmp_path):
    import dataclasses
    from precompute.job import resolve_workers, run
    assert resolve_workers("auto", "cpu") == 0 and resolve_workers(3, "cpu") == 3
    summary, _ = run(DEMO / "samples.jsonl", tmp_path / "c", dataclasses.replace(tiny_config, num_workers=2),
                     progress=False)
    assert summary.decode_workers == 2  # what the job ran, recorded
    pick = lambda c: dict(zip(*read_index(c).select(["key", "sha256"]).to_pydict().values()))  # noqa: E731
    assert pick(tmp_path / "c") == pick(demo_cache)
