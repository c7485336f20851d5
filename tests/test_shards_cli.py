"""The ``shards`` CLI on a small cache built with ShardWriter + merge_parts."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shards
from shards.cli import main
from shards.schema import shard_name

FINGERPRINT = "fp-0123456789abcdef"
ENCODERS = {"codec": {"name": "test-codec", "codebooks": 8}, "vae": {"name": "cosmos-test"}}
#: key -> (shard number, duration_s, sample_rate, speaker, has_image, text)
SAMPLES = {
    "utt-a": (0, 1.0, 16000, "alice", False, "a short one"),
    "utt-b": (0, 2.5, 16000, "bob", True, "a photo of a cat"),
    "utt-c": (0, 6.0, 24000, "alice", True, "a long caption about a rocket launch"),
    "utt-d": (1, 7.5, 16000, "carol", False, "the longest speech sample here"),
    "utt-e": (1, 0.5, 24000, "bob", True, "tiny"),
}


def make_arrays(key: str) -> dict:
    shard_no, dur, sr, speaker, has_image, text = SAMPLES[key]
    rng = np.random.default_rng(sum(map(ord, key)))
    frames = int(round(dur * 25))
    fields = {
        "json": {"text": text, "speaker": speaker, "sample_rate": sr, "duration_s": dur},
        "codes.npy": rng.integers(0, 1024, size=(8, frames)).astype(np.int16),
        "audio.npy": rng.integers(-20000, 20000, size=int(dur * sr)).astype(np.int16),
        "text_ids.npy": rng.integers(0, 32000, size=2 * len(text.split())).astype(np.int32),
    }
    if has_image:
        offsets = (np.arange(16) * 0.1).reshape(16, 1, 1, 1)
        fields["latents.npy"] = (rng.normal(size=(16, 1, 8, 8)) * 0.5 + offsets).astype(np.float16)
    return fields


def build_cache(out: Path) -> Path:
    for n in (0, 1):
        w = shards.ShardWriter(out, shard_name(0, n))
        for key, spec in SAMPLES.items():
            if spec[0] == n:
                w.add(key, make_arrays(key))
        if n == 0:
            w.reject("utt-bad", "audio/bad.wav", "unreadable_audio", "not a RIFF file")
        w.commit()
    shards.merge_parts(out, {"encoders": ENCODERS, "fingerprint": FINGERPRINT,
                             "config": {"max_duration_s": 30}})
    return out


@pytest.fixture(scope="module")
def clean_cache(tmp_path_factory) -> Path:
    return build_cache(tmp_path_factory.mktemp("cache") / "out")


@pytest.fixture
def cache(clean_cache, tmp_path) -> Path:
    """A private copy that a test may damage."""
    return Path(shutil.copytree(clean_cache, tmp_path / "cache"))


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def run_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def member(cache: Path, key: str, name: str) -> dict:
    row = [r for r in shards.read_index(cache).to_pylist() if r["key"] == key][0]
    return row["shard"], [m for m in row["members"] if m["name"] == name][0]
