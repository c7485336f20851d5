"""Manifest readers: JSONL, ChatML, LLaVA, CSV, Parquet; keys, paths, bad rows."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from precompute.manifests import detect_format, read_requests
from shards import schema

from conftest import DEMO


def test_jsonl_demo_rows_and_errors():
    reqs = read_requests(DEMO / "samples.jsonl")
    assert detect_format(DEMO / "samples.jsonl") == "jsonl"
    lines = (DEMO / "samples.jsonl").read_text().splitlines()
    assert len(reqs) == len(lines)
    good = [r for r in reqs if r.error is None]
    assert all(a.source.startswith(str(DEMO)) for r in good for a in r.conversation.audio)
    errors = {r.error[0] for r in reqs if r.error}
    assert {schema.MALFORMED_ROW, schema.DUPLICATE_KEY, schema.EMPTY_TEXT} <= errors
    malformed = next(r for r in reqs if r.error and r.error[0] == schema.MALFORMED_ROW)
    assert malformed.key.startswith("line-")


def test_root_overrides_manifest_folder(tmp_path):
    (tmp_path / "m.jsonl").write_text(json.dumps({"key": "a", "text": "t", "audio": "x.wav"}) + "\n")
    assert read_requests(tmp_path / "m.jsonl", root="/data")[0].conversation.audio[0].source == "/data/x.wav"


def test_chatml_real_mini(real_mini):
    path = real_mini / "train_chatml_samples.json"
    assert detect_format(path) == "chatml"
    reqs = read_requests(path)
    assert len(reqs) == len(json.loads(path.read_text()))
    first = reqs[0]
    conv = first.conversation
    assert first.key == "fsdd-george-0-0" and first.speaker == "george"
    assert [t.role for t in conv.turns] == ["system", "user", "assistant"]
    assert conv.turns[1].parts[0].text == "zero"
    assert conv.audio[0].source == str(real_mini / "audio/fsdd/0_george_0.wav")
    assert conv.audio[0].direction == "out" and conv.audio[0].turn == 2
    with_image = [r for r in reqs if r.has_image]
    assert len(with_image) == 8 and all(r.has_audio for r in with_image)
    assert all(r.error is None for r in reqs)


def test_chatml_offset_duration_and_hash_key(tmp_path):
    rec = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]},
                        {"role": "assistant", "content": [{"type": "audio", "audio_url": "a.wav",
                                                           "offset": 1.5, "duration": 2.0}]}]}
    (tmp_path / "c.jsonl").write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    a, b = read_requests(tmp_path / "c.jsonl")
    item = a.conversation.audio[0]
    assert item.offset_s == 1.5 and item.duration_s == 2.0 and a.text == "hello"
    assert a.key.startswith("h") and len(a.key) == 17
    assert b.error[0] == schema.DUPLICATE_KEY  # same sources -> same stable key


def test_llava_real_mini(real_mini):
    reqs = read_requests(real_mini / "llava_captions.json")
    assert reqs and all(r.has_image and not r.has_audio and r.text for r in reqs)
    assert reqs[0].key == "astronaut" and "astronaut" in reqs[0].text
    conv = reqs[0].conversation
    assert [p.type for p in conv.turns[0].parts] == ["image", "text"]  # "<image>\n..." -> image first


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_tables_with_column_mapping(tmp_path, kind):
    rows = [{"id": "k1", "transcript": "one", "path": "a.wav", "spk": "s"},
            {"id": "k.2", "transcript": "two", "path": "b.flac", "spk": "s"}]
    path = tmp_path / f"m.{kind}"
    if kind == "csv":
        path.write_text("id,transcript,path,spk\n" + "\n".join(",".join(r.values()) for r in rows) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    reqs = read_requests(path, columns={"key": "id", "text": "transcript", "audio": "path", "speaker": "spk"})
    assert [r.key for r in reqs] == ["k1", "k_2"]  # dots are not allowed in WebDataset keys
    assert reqs[1].meta["original_key"] == "k.2"
    assert reqs[1].conversation.audio[0].source == str(tmp_path / "b.flac")
    assert reqs[0].speaker == "s" and reqs[0].text == "one"


def test_missing_manifest_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_requests(tmp_path / "nope.jsonl")
