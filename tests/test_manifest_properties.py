"""Property test (hypothesis, issue 30 "Done when"): whatever the keys and the cell text of a manifest,
every row is either kept under a key of its own with its own media and text, or rejected with a
reason; nothing else happens.

Each example is a manifest (JSONL, CSV or TSV, written with ``json``/``csv`` as a user's tools
would) of rows drawing keys that collide once made safe (``a.b``, ``a_b``, ``a/b``, ``a b``), literal
keys equal to another row's collision suffix, keys at the length limit that collide, dotted and
unicode keys, missing keys (segments of one recording told apart only by offset/duration), and
text holding quotes, separators, line breaks and unicode. The real stage-one job
(:func:`precompute.job.run`, tiny random DAC, no image encoder: the cheapest config of
``tests/test_hostile_rows.py``) encodes it. Independently of the manifest reader, a clean run of
every media window (one per key, plain JSONL) gives the reference codes; the test then asserts:

* the cache's keys are distinct, valid (:func:`shards.schema.key_problem`) and each sample's tar
  member set is whole;
* every kept sample is one manifest row (its ``row``), holds that row's text, and that row's media:
  its codes equal the reference codes of the row's own window, its duration the window's length
  read with soundfile;
* a kept row's key is the row's key made safe, or that plus a hash suffix (``original_key`` holds
  the row's key), or the identity hash of a keyless row;
* every row that is not kept is named by a reject with a known reason: a ``duplicate_key`` only for
  a key (or keyless identity) an earlier row has, an ``empty_text`` only for blank text;
* the counts add up (kept + rejected = rows).

Examples: 10 in ``make test`` (about 10 s); ``make test-long`` (``HYPOTHESIS_PROFILE=long``) runs the
long profile's number.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from conftest import DEMO, ROOT  # noqa: E402
from shards import ShardReader, read_rejects, schema  # noqa: E402

#: the media windows rows draw from: (file, offset s, duration s or None); the last three are
#: segments of one recording that only offset/duration tell apart
WINDOWS = [("a.flac", 0.0, None), ("b.wav", 0.0, None), ("c.flac", 0.0, None),
           ("long.flac", 0.0, 0.5), ("long.flac", 0.5, 0.5), ("long.flac", 1.0, None)]
SOURCES = {"a.flac": "spk-us-0001.flac", "b.wav": "spk-us-0002.wav", "c.flac": "spk-gb-0003.flac",
           "long.flac": "img-camera.flac"}
COLUMNS = ("key", "text", "audio", "offset", "duration")
#: the example count: the profile's under ``make test-long``, else a few (each runs the job)
EXAMPLES = {} if os.environ.get("HYPOTHESIS_PROFILE") == "long" else {"max_examples": 10}


def _suffix(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()[:8]


# ---- keys and text ------------------------------------------------------------------------------------

COLLIDING = ["a", "a.b", "a_b", "a/b", "a b", "A", "x.y.z", "x_y_z", "x/y.z"]
SUFFIXED = [f"{schema.safe_key(k)}-{_suffix(k)}" for k in ("a.b", "a/b", "a b", "x.y.z", "x/y.z")]
LONG = ["k" * (schema.MAX_KEY_BYTES - 2) + sep + "x" for sep in "._/ "] + \
       ["\u00e9" * 99 + sep + "y" for sep in "._"]
unicode_key = st.text(st.characters(categories=("L", "N", "P", "S", "Zs"), exclude_characters="\x85\u2028\u2029"),
                      min_size=1, max_size=12)
keys = st.one_of(st.none(), st.sampled_from(COLLIDING + SUFFIXED + LONG), unicode_key, st.just(""), st.just("  "))
cell_text = st.text(st.one_of(st.sampled_from(list('",\t\n\r\' ;|\\')), st.characters(
    categories=("L", "N", "P", "S", "Zs"), exclude_characters="\x85\u2028\u2029")), max_size=30)


@st.composite
def manifests(draw) -> dict:
    fmt = draw(st.sampled_from(["jsonl", "csv", "tsv"]))
    rows = []
    for _ in range(draw(st.integers(1, 7))):
        w = draw(st.integers(0, len(WINDOWS) - 1))
        rows.append({"key": draw(keys), "text": draw(cell_text), "window": w})
    if draw(st.booleans()) and rows:  # the same row again: a duplicate (keyed or keyless)
        rows.append(dict(draw(st.sampled_from(rows))))
    return {"fmt": fmt, "rows": rows}


def write_manifest(folder: Path, m: dict) -> Path:
    recs = []
    for r in m["rows"]:
        src, offset, duration = WINDOWS[r["window"]]
        rec = {"key": r["key"], "text": r["text"], "audio": f"audio/{src}", "offset": offset, "duration": duration}
        recs.append({k: v for k, v in rec.items() if v is not None})
    if m["fmt"] == "jsonl":
        path = folder / "m.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
        return path
    path = folder / f"m.{m['fmt']}"
    buf = io.StringIO(newline="")
    w = csv.writer(buf, dialect="excel-tab" if m["fmt"] == "tsv" else "excel")
    w.writerow(COLUMNS)
    for r in recs:
        w.writerow(["" if r.get(c) is None else str(r[c]) for c in COLUMNS])
    path.write_bytes(buf.getvalue().encode("utf-8"))
    return path


def _expected_text(m: dict, r: dict) -> str:
    """The row's text as the manifest holds it (a CSV cell is the text; an empty cell is no text)."""
    return r["text"].strip()


# ---- the job ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    """The media root, the cheapest job config (tiny DAC, no image encoder), its encoders (loaded
    once) and the reference samples: one clean run with one plain key per window."""
    import soundfile as sf
    from precompute.config import load_config
    from precompute.job import load_encoders
    base = tmp_path_factory.mktemp("props")
    root = base / "root"
    (root / "audio").mkdir(parents=True)
    for name, src in SOURCES.items():
        shutil.copy(DEMO / "audio" / src, root / "audio" / name)
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        f"audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}", "image_encoder=null",
        "samples_per_shard=4", "num_workers=0", "device=cpu"])
    enc = load_encoders(cfg, "cpu")
    clean = root / "clean.jsonl"
    clean.write_text("".join(json.dumps({"key": f"w{i}", "text": "reference", "audio": f"audio/{s}", "offset": o,
                                         **({"duration": d} if d is not None else {})}) + "\n"
                             for i, (s, o, d) in enumerate(WINDOWS)))
    ref = run_job(clean, base / "clean-cache", cfg, enc, root)["kept"]
    assert sorted(ref) == [f"w{i}" for i in range(len(WINDOWS))]
    lengths = []
    for s, o, d in WINDOWS:  # each window's length, read with soundfile (not with the job's decoder)
        info = sf.info(str(root / "audio" / s))
        lengths.append(d if d is not None else info.frames / info.samplerate - o)
    return {"root": root, "cfg": cfg, "enc": enc, "codes": [ref[f"w{i}"]["codes"] for i in range(len(WINDOWS))],
            "lengths": lengths}


def run_job(manifest: Path, cache: Path, cfg, enc, root: Path) -> dict:
    from precompute import job
    with mock.patch.object(job, "load_encoders", lambda *a, **k: enc):
        job.run(manifest, cache, cfg, root=root, progress=False)
    kept = {}
    if (cache / "index.parquet").exists():
        reader = ShardReader(cache)
        assert len(reader.keys) == len(set(reader.keys)), "a key twice in the index"
        kept = {k: reader.get(i) for i, k in enumerate(reader.keys)}
    return {"kept": kept, "rejects": read_rejects(cache).to_pylist()}


def check(m: dict, result: dict, setup: dict) -> None:
    kept, rejects = result["kept"], result["rejects"]
    rows = [dict(r, key=None) if m["fmt"] != "jsonl" and r["key"] == "" else r for r in m["rows"]]  # an empty cell
    assert len(kept) + len(rejects) == len(rows), (sorted(kept), rejects)
    for r in rejects:
        assert r["reason"] in schema.REASONS and r["detail"], r
    by_row = {}
    for key, s in kept.items():
        assert schema.key_problem(key) is None and key == schema.safe_key(key), key
        i = s["json"]["row"]
        assert i not in by_row, f"row {i} kept twice"
        by_row[i] = key
        row = rows[i]
        # its own text and its own media
        turns = s["json"]["conversation"]["turns"]
        assert [p["text"] for p in turns[0]["parts"] if p["type"] == "text"] == [_expected_text(m, row)], (i, turns)
        np.testing.assert_array_equal(s["codes"], setup["codes"][row["window"]], err_msg=f"row {i}: another's media")
        assert abs(s["json"]["duration_s"] - setup["lengths"][row["window"]]) < 1e-3, (i, s["json"]["duration_s"])
        # its key: the row's key made safe, or that with a hash suffix, or a keyless row's hash
        raw = row["key"]
        if raw is None:
            assert key.startswith("h") and len(key) == 17, key
        else:
            safe = schema.safe_key(raw)
            assert key == safe or (safe.startswith(key.rsplit("-", 1)[0]) and len(key.rsplit("-", 1)[1]) == 8), (raw, key)
            assert s["json"].get("original_key", key) == raw
    seen_keys: set = set()
    for i, row in enumerate(rows):
        identity = (row["key"], None) if row["key"] is not None else (None, row["window"], row["text"].strip())
        if i in by_row:
            seen_keys.add(identity)
            continue
        mine = [r for r in rejects if r["detail"].startswith(f"row {i}:")]
        assert len(mine) == 1, (i, row, rejects)
        reason = mine[0]["reason"]
        if reason == schema.DUPLICATE_KEY:
            assert identity in seen_keys, (i, row, mine)
        elif reason == schema.EMPTY_TEXT:
            assert not row["text"].strip(), (i, row)
        else:
            assert reason == schema.MALFORMED_ROW and (row["key"] is not None and not row["key"].strip()), (i, row, mine)
        seen_keys.add(identity)


#: the issue's three reproductions, run every time: a literal key equal to another row's collision
#: suffix (two samples under one key in one tar), two 200-byte keys that collide (the job died with a
#: traceback), keyless segments of one recording (all but one were duplicate_key rejects)
ISSUE_CASES = [
    {"fmt": "jsonl", "rows": [{"key": SUFFIXED[0], "text": "one", "window": 0}, {"key": "a_b", "text": "two", "window": 1},
                              {"key": "a.b", "text": "three", "window": 2}]},
    {"fmt": "csv", "rows": [{"key": "a_b", "text": "one", "window": 0}, {"key": "a.b", "text": "two", "window": 1},
                            {"key": SUFFIXED[0], "text": "three", "window": 2}]},
    {"fmt": "jsonl", "rows": [{"key": LONG[0], "text": "one", "window": 0}, {"key": LONG[1], "text": "two", "window": 1},
                              {"key": LONG[2], "text": "three", "window": 2}]},
    {"fmt": "tsv", "rows": [{"key": None, "text": "first", "window": 3}, {"key": None, "text": "second", "window": 4},
                            {"key": None, "text": "third", "window": 5}]},
]


@settings(**EXAMPLES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
          deadline=None)
@given(m=manifests())
def test_every_row_is_kept_under_its_own_key_with_its_own_media_or_rejected(setup, m):
    folder = Path(tempfile.mkdtemp(dir=setup["root"], prefix="ex-"))
    try:
        result = run_job(write_manifest(folder, m), folder / "cache", setup["cfg"], setup["enc"], setup["root"])
        check(m, result, setup)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("m", ISSUE_CASES, ids=["suffix-literal-first", "suffix-literal-last", "long-keys",
                                                "keyless-segments"])
def test_the_issues_key_failures_through_the_job(setup, m):
    folder = Path(tempfile.mkdtemp(dir=setup["root"], prefix="case-"))
    try:
        result = run_job(write_manifest(folder, m), folder / "cache", setup["cfg"], setup["enc"], setup["root"])
        check(m, result, setup)
        assert len(result["kept"]) == len(m["rows"])  # none of these rows is a reject
    finally:
        shutil.rmtree(folder, ignore_errors=True)
