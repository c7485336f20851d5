"""Property test (hypothesis, issue 41 item 2): a rerun on an edited manifest gives the cache a fresh run on
that manifest gives, row for row; with ``keep_removed_rows`` plus exactly the rows removed since.

Each example is a manifest (JSONL) of rows with their own keys (``r0``...; a pair that collides once made
safe, ``a.b`` / ``a_b``; a key repeated: a ``duplicate_key``) and rows without one (told apart by their
window and text), some broken (a media file that does not exist: ``unreadable_audio``; an offset that is
not a number: ``malformed_row``), then a few edits, each followed by a rerun on the same cache: reorder,
insert a row, delete one, fix a broken one, edit a text, change a filter option (``max_duration``: the
clips over 1 s are then rejected), nothing at all; each rerun with ``keep_removed_rows`` on or off.

After every rerun, independently of the rerun's bookkeeping, a fresh run of the same config on the edited
manifest (another cache) is the reference:

* the rerun cache's samples, by key, hold the same arrays and the same json (but ``row``, the row's number
  in the manifest the sample was encoded from) as the fresh run's, plus, with ``keep_removed_rows``, exactly
  the samples of the rows no longer in the manifest that the cache held before (unless a row of the manifest
  now takes the key), byte for byte;
* its rejects (key, reason) are the fresh run's (with ``keep_removed_rows``: at least those);
* no key is in the cache twice (the index, and one tar member set per key);
* a rerun with nothing edited re-encodes nothing.

The real stage-one job runs with null encoders (no codec, no VAE: the stored waveforms, text ids and json are
what tell the rows apart; a codec's bytes follow the same bookkeeping), so an example takes a few seconds.
``make test`` runs a few examples and the issue's cases; ``make test-long`` (``HYPOTHESIS_PROFILE=long``) the
long profile's.
"""
from __future__ import annotations

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

#: media windows: (file, offset s, duration s or None); the full files are over 1 s, the segments 0.5 s
WINDOWS = [("a.flac", 0.0, None), ("b.wav", 0.0, None), ("long.flac", 0.0, 0.5), ("long.flac", 0.5, 0.5)]
SOURCES = {"a.flac": "spk-us-0001.flac", "b.wav": "spk-us-0002.wav", "long.flac": "img-camera.flac"}
KEYS = [f"r{i}" for i in range(8)] + ["a.b", "a_b"]
#: reasons decided while the manifest is read (such a row claims no sample key)
READ_REASONS = {schema.MALFORMED_ROW, schema.DUPLICATE_KEY, schema.EMPTY_TEXT}
#: examples: the long profile's under ``make test-long``, else a few (each runs the job 3 to 7 times)
EXAMPLES = {} if os.environ.get("HYPOTHESIS_PROFILE") == "long" else {"max_examples": 6}

row_st = st.fixed_dictionaries({
    "key": st.one_of(st.sampled_from(KEYS), st.none()),
    "text": st.sampled_from(["one", "two", "three", "a longer line of text"]),
    "window": st.integers(0, len(WINDOWS) - 1),
    "broken": st.sampled_from([None, None, None, "missing", "offset"]),
})
OPS = ["reorder", "insert", "delete", "fix", "edit", "filter", "nothing"]


@st.composite
def histories(draw) -> dict:
    rows = draw(st.lists(row_st, min_size=2, max_size=6))
    steps = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(OPS))
        arg = {"reorder": lambda: draw(st.permutations(range(64))), "insert": lambda: (draw(st.integers(0, 64)),
               draw(row_st)), "delete": lambda: draw(st.integers(0, 64)), "fix": lambda: draw(st.integers(0, 64)),
               "edit": lambda: (draw(st.integers(0, 64)), draw(st.sampled_from(["edited", "one", "fixed text"]))),
               "filter": lambda: None, "nothing": lambda: None}[op]()
        steps.append((op, arg, draw(st.booleans())))  # the edit, its argument, keep_removed_rows
    return {"rows": rows, "steps": steps}


def apply(op: str, arg, rows: list[dict], short: bool) -> tuple[list[dict], bool]:
    """The manifest and ``max_duration`` short-or-not after one edit."""
    rows = [dict(r) for r in rows]
    if op == "reorder":
        order = [i for i in arg if i < len(rows)]
        rows = [rows[i] for i in order]
    elif op == "insert":
        rows.insert(arg[0] % (len(rows) + 1), dict(arg[1]))
    elif op == "delete" and len(rows) > 1:
        rows.pop(arg % len(rows))
    elif op == "fix":
        broken = [r for r in rows if r["broken"]]
        if broken:
            broken[arg % len(broken)]["broken"] = None
    elif op == "edit" and rows:
        rows[arg[0] % len(rows)]["text"] = arg[1]
    elif op == "filter":
        short = not short
    return rows, short


def write_manifest(path: Path, rows: list[dict]) -> Path:
    lines = []
    for r in rows:
        src, offset, duration = WINDOWS[r["window"]]
        rec = {"text": r["text"], "audio": "audio/missing.flac" if r["broken"] == "missing" else f"audio/{src}",
               "offset": "abc" if r["broken"] == "offset" else offset}
        if r["key"] is not None:
            rec["key"] = r["key"]
        if duration is not None:
            rec["duration"] = duration
        lines.append(json.dumps(rec) + "\n")
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The media root, the job config (null encoders, chunks of 2 rows) and its encoders."""
    from precompute.config import load_config
    from precompute.job import load_encoders
    root = tmp_path_factory.mktemp("rerun-props")
    (root / "audio").mkdir()
    for name, src in SOURCES.items():
        shutil.copy(DEMO / "audio" / src, root / "audio" / name)
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        "audio_tokenizer=null", "image_encoder=null", "samples_per_shard=2", "num_workers=0", "device=cpu"])
    return {"root": root, "cfg": cfg, "enc": load_encoders(cfg, "cpu")}


def run_job(manifest: Path, cache: Path, cfg, enc, root: Path):
    from precompute import job
    with mock.patch.object(job, "load_encoders", lambda *a, **k: enc):
        return job.run(manifest, cache, cfg, root=root, progress=False)[0]


def read(cache: Path) -> tuple[dict[str, dict], set[tuple[str, str]]]:
    """key -> {"json" (without ``row``), arrays...}; {(key, reason)} of the rejects. A key twice fails."""
    samples = {}
    if (cache / "index.parquet").exists():
        reader = ShardReader(cache)
        assert len(reader.keys) == len(set(reader.keys)), f"a key twice in the index: {sorted(reader.keys)}"
        for i, k in enumerate(reader.keys):
            s = dict(reader.get(i))
            s["json"] = {j: v for j, v in s["json"].items() if j != "row"}
            samples[k] = s
    return samples, {(r["key"], r["reason"]) for r in read_rejects(cache).to_pylist()}


def same(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    return all(a[k] == b[k] if k == "json" else np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def row_identity(r: dict) -> tuple:
    return ("key", r["key"]) if r["key"] is not None else ("window", r["window"], r["text"])


def check_history(setup: dict, h: dict) -> None:
    """Run the history ``h`` (rows, then edits each with a rerun) and check every rerun against a fresh run."""
    import dataclasses
    work = Path(tempfile.mkdtemp(dir=setup["root"], prefix="ex-"))
    try:
        cache, rows, short = work / "cache", h["rows"], False
        cfg0 = setup["cfg"]
        run_job(write_manifest(work / "m0.jsonl", rows), cache, cfg0, setup["enc"], setup["root"])
        before, _ = read(cache)
        ident = _identities(cache, rows)  # sample key -> the manifest row it is (kept across reruns)
        for n, (op, arg, keep) in enumerate(h["steps"], 1):
            rows, short = apply(op, arg, rows, short)
            cfg = dataclasses.replace(cfg0, keep_removed_rows=keep, max_duration=1.0 if short else 30.0)
            manifest = write_manifest(work / f"m{n}.jsonl", rows)
            summary = run_job(manifest, cache, cfg, setup["enc"], setup["root"])
            fresh_dir = work / f"fresh{n}"
            run_job(manifest, fresh_dir, cfg, setup["enc"], setup["root"])
            got, got_rejects = read(cache)
            want, want_rejects = read(fresh_dir)
            now = {row_identity(r) for r in rows}
            removed_before = {k for k in before if ident.get(k) not in now}
            claimed = set(want) | {k for k, reason in want_rejects if reason not in READ_REASONS}
            extra = {k: before[k] for k in removed_before if keep and k not in claimed}
            where = (n, op, keep)
            assert set(got) == set(want) | set(extra), (where, sorted(got), sorted(want), sorted(extra))
            for k in want:
                assert same(got[k], want[k]), (where, k)
            for k in extra:
                assert same(got[k], before[k]), (where, k)
            if keep:
                assert want_rejects <= got_rejects, (where, want_rejects - got_rejects)
            else:
                assert got_rejects == want_rejects, (where, got_rejects ^ want_rejects)
            if op == "nothing" and (keep or not removed_before):  # nothing edited: nothing encoded
                assert summary.kept == summary.rejected == 0, (where, summary)
            ident = {k: ident[k] for k in extra} | _identities(fresh_dir, rows)
            before = got
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _identities(cache: Path, rows: list[dict]) -> dict[str, tuple]:
    """Sample key -> the identity of the manifest row it was encoded from (its json ``row`` in ``rows``)."""
    if not (cache / "index.parquet").exists():
        return {}
    reader = ShardReader(cache)
    return {k: row_identity(rows[reader.get(i)["json"]["row"]]) for i, k in enumerate(reader.keys)}


@settings(**EXAMPLES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], deadline=None)
@given(h=histories())
def test_a_rerun_equals_a_fresh_run_on_the_edited_manifest(setup, h):
    check_history(setup, h)


#: the issue's reproductions, run every time: a fixed reject then two more reruns ("duplicate keys across
#: shards" on every later rerun), a removed row kept across reruns while rows before it are inserted and
#: removed (it was in the cache twice, or gone), a removed row whose key another row took (that row was in
#: the cache twice under the assigned-key identity), a filter option changed between runs (the old rows kept)
CASES = {
    "fixed-reject-then-reruns": {
        "rows": [{"key": "a.b", "text": "one", "window": 0, "broken": "offset"},
                 {"key": "a_b", "text": "two", "window": 1, "broken": None},
                 {"key": "r1", "text": "three", "window": 2, "broken": None}],
        "steps": [("fix", 0, False), ("nothing", None, False), ("reorder", list(range(64))[::-1], False)]},
    "keep-removed-across-reruns": {
        "rows": [{"key": f"r{i}", "text": "one", "window": i % 4, "broken": None} for i in range(5)],
        "steps": [("delete", 2, True), ("insert", (0, {"key": None, "text": "new", "window": 3, "broken": None}), True),
                  ("delete", 0, True), ("edit", (1, "edited"), True), ("nothing", None, False)]},
    "collision-keep-removed": {  # a.b took a_b's key; a.b removed: a_b must not be in the cache twice
        "rows": [{"key": "a.b", "text": "one", "window": 0, "broken": None},
                 {"key": "a_b", "text": "two", "window": 1, "broken": None},
                 {"key": "r1", "text": "three", "window": 2, "broken": None}],
        "steps": [("delete", 0, True), ("nothing", None, True), ("insert", (0, {"key": "a.b", "text": "one",
                                                                                "window": 0, "broken": None}), True)]},
    "filter-changed": {
        "rows": [{"key": f"r{i}", "text": "one", "window": i % 4, "broken": None} for i in range(4)],
        "steps": [("filter", None, False), ("filter", None, True)]},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_issue_cases(setup, name):
    check_history(setup, CASES[name])
