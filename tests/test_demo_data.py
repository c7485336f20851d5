"""Checks on the committed demo data in data/demo (made by scripts/make_demo_data.py).

These read the files as committed; they do not run espeak-ng or regenerate anything.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

sf = pytest.importorskip("soundfile")
Image = pytest.importorskip("PIL.Image")

from shards import schema  # noqa: E402

DEMO = Path(__file__).resolve().parent.parent / "data" / "demo"
MAX_BYTES = 3 * 1000 * 1000
KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")

pytestmark = pytest.mark.skipif(not (DEMO / "samples.jsonl").exists(),
                                reason="data/demo not generated (python scripts/make_demo_data.py)")


def _lines() -> list[str]:
    return (DEMO / "samples.jsonl").read_text(encoding="utf-8").splitlines()


def _rejects() -> list[dict]:
    return json.loads((DEMO / "expected_rejects.json").read_text(encoding="utf-8"))


def _parsed() -> tuple[list[tuple[int, dict]], list[int]]:
    """(lineno, row) for every line that parses, and the line numbers that do not (1-based)."""
    rows, bad = [], []
    for n, line in enumerate(_lines(), 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            bad.append(n)
            continue
        assert isinstance(obj, dict), f"line {n} is not a JSON object"
        rows.append((n, obj))
    return rows, bad


def _split() -> tuple[list[dict], list[tuple[dict, str, int]]]:
    """Good rows, and (row, expected reason, line number) for bad rows that parse."""
    rejects = _rejects()
    reason_by_key = {r["key"]: r["reason"] for r in rejects if r["reason"] != schema.DUPLICATE_KEY}
    dup_keys = {r["key"] for r in rejects if r["reason"] == schema.DUPLICATE_KEY}
    rows, _ = _parsed()
    good, bad, seen = [], [], set()
    for n, row in rows:
        key = row["key"]
        if key in seen:
            assert key in dup_keys, f"key {key!r} repeats but is not listed as duplicate_key"
            bad.append((row, schema.DUPLICATE_KEY, n))
        elif key in reason_by_key:
            bad.append((row, reason_by_key[key], n))
        else:
            good.append(row)
        seen.add(key)
    return good, bad


def test_folder_under_3mb():
    total = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    assert 0 < total < MAX_BYTES, total


def test_readme_present():
    text = (DEMO / "README.md").read_text(encoding="utf-8")
    assert "make_demo_data.py" in text and "CC0" in text


def test_manifest_parses_except_the_malformed_line():
    _, bad_lines = _parsed()
    malformed = [r for r in _rejects() if r["reason"] == schema.MALFORMED_ROW]
    assert len(malformed) == 1
    assert [f"line-{n}" for n in bad_lines] == [malformed[0]["key"]]


def test_rows_have_required_fields_and_safe_keys():
    rows, _ = _parsed()
    for n, row in rows:
        for field in ("key", "text", "audio", "speaker"):
            assert field in row, f"line {n} lacks {field}"
        assert KEY_RE.match(row["key"]), row["key"]
        assert schema.safe_key(row["key"]) == row["key"]
        assert not Path(row["audio"]).is_absolute()
        if "image" in row:
            assert not Path(row["image"]).is_absolute()


def test_expected_rejects_well_formed():
    rejects = _rejects()
    rows, _ = _parsed()
    keys = {row["key"] for _, row in rows}
    n_lines = len(_lines())
    for r in rejects:
        assert set(r) == {"key", "audio", "image", "reason"}, r
        assert r["reason"] in schema.REASONS, r
        if r["reason"] == schema.MALFORMED_ROW:
            m = re.fullmatch(r"line-(\d+)", r["key"])
            assert m and 1 <= int(m.group(1)) <= n_lines, r
        else:
            assert r["key"] in keys, r
    reasons = {r["reason"] for r in rejects}
    assert {schema.MISSING_FILE, schema.UNREADABLE_AUDIO, schema.IMAGE_TRUNCATED,
            schema.EMPTY_TEXT, schema.DUPLICATE_KEY, schema.MALFORMED_ROW} <= reasons


def test_bad_rows_are_mixed_in():
    _, bad_lines = _parsed()
    _, bad = _split()
    linenos = sorted([n for _, _, n in bad] + bad_lines)
    assert len(linenos) == len(_rejects())
    n_lines = len(_lines())
    # not all bunched at the start or the end
    assert linenos[0] < n_lines // 3 and linenos[-1] < n_lines


def test_good_audio_opens_with_frames():
    good, _ = _split()
    assert len(good) >= 20
    for row in good:
        info = sf.info(str(DEMO / row["audio"]))
        assert info.frames > 0, row
        data, sr = sf.read(str(DEMO / row["audio"]), frames=1024, always_2d=True)
        assert data.shape[0] > 0 and sr == info.samplerate


def test_audio_variety():
    good, _ = _split()
    infos = [sf.info(str(DEMO / row["audio"])) for row in good]
    assert any(i.channels == 2 for i in infos), "no stereo clip"
    assert any(i.samplerate >= 44100 for i in infos), "no clip at >= 44.1 kHz"
    assert {i.samplerate for i in infos} <= {16000, 22050, 24000, 44100, 48000}
    assert {i.format for i in infos} == {"WAV", "FLAC"}
    for i in infos:
        assert 1.0 <= i.duration <= 4.0, (i.name, i.duration)


def test_good_images_open():
    good, _ = _split()
    image_rows = [row for row in good if "image" in row]
    assert len(image_rows) >= 4
    modes = set()
    for row in image_rows:
        with Image.open(DEMO / row["image"]) as im:
            im.load()
            assert max(im.size) <= 512, (row["image"], im.size)
            modes.add(im.mode)
    assert "L" in modes, "no grayscale image"


def test_bad_rows_fail_for_their_stated_reason():
    _, bad = _split()
    for row, reason, _ in bad:
        audio = DEMO / row["audio"]
        if reason == schema.MISSING_FILE:
            assert not audio.exists(), row
        elif reason == schema.UNREADABLE_AUDIO:
            assert audio.exists(), row
            with pytest.raises(Exception):
                sf.info(str(audio))
        elif reason == schema.IMAGE_TRUNCATED:
            assert sf.info(str(audio)).frames > 0
            with pytest.raises(OSError, match="truncated"):
                with Image.open(DEMO / row["image"]) as im:
                    im.load()
        elif reason == schema.EMPTY_TEXT:
            assert not row["text"].strip()
            assert sf.info(str(audio)).frames > 0
        elif reason == schema.DUPLICATE_KEY:
            assert sf.info(str(audio)).frames > 0
        else:
            pytest.fail(f"unexpected reason {reason!r} for {row}")
