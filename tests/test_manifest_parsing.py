"""Manifest parsing never joins nor splits rows (issue 30 item 5): CSV/TSV quoting, encodings, JSON
list records, non-regular media paths, rejects under the row's own key."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from precompute.config import PrecomputeConfig
from precompute.manifests import FORMATS, detect_format, read_requests
from shards import schema
from shards.errors import CorruptSample

from conftest import ROOT


def _audio(req):
    return [a.source for a in req.conversation.audio]


# ---- CSV / TSV quoting ----------------------------------------------------------------------------

def test_tsv_quote_opening_a_field_does_not_join_rows(tmp_path):
    path = tmp_path / "m.tsv"
    path.write_text('key\ttext\taudio\n'
                    'k1\t"Hi there\ta.wav\n'
                    'k2\tsecond\tb.wav\n'
                    'k3\tthird "quoted" word\tc.wav\n')
    reqs = read_requests(path)
    good = {r.key: r for r in reqs if r.error is None}
    assert set(good) == {"k2", "k3"}, [(r.key, r.error) for r in reqs]
    assert good["k2"].text == "second" and _audio(good["k2"]) == [str(tmp_path / "b.wav")]
    assert good["k3"].text == 'third "quoted" word' and _audio(good["k3"]) == [str(tmp_path / "c.wav")]
    bad = [r for r in reqs if r.error is not None]
    assert len(bad) == 1 and bad[0].error[0] == schema.MALFORMED_ROW
    assert "line 2" in bad[0].error[1] and bad[0].key == "k1", bad[0]


def test_csv_unclosed_quote_at_the_end_rejects_its_line_only(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text('key,text,audio\nk1,one,a.wav\nk2,"Hi,b.wav\nk3,three,c.wav\n')
    reqs = read_requests(path)
    good = {r.key: r for r in reqs if r.error is None}
    assert set(good) == {"k1", "k3"} and good["k3"].text == "three"
    assert _audio(good["k3"]) == [str(tmp_path / "c.wav")]
    bad = [r for r in reqs if r.error is not None]
    assert len(bad) == 1 and "line 3" in bad[0].error[1], bad[0].error


def test_csv_quoted_field_spanning_lines_that_read_as_rows_is_a_reject(tmp_path):
    # the quote opened on line 2 closes before a comma on line 4: valid CSV, but line 3 is a whole row
    path = tmp_path / "m.csv"
    path.write_text('key,text,audio\nk1,"Hello,a.wav\nk2,world,b.wav\nk3,x",c.wav\n')
    reqs = read_requests(path)
    good = {r.key: r for r in reqs if r.error is None}
    assert "k1" not in good and good["k2"].text == "world" and _audio(good["k2"]) == [str(tmp_path / "b.wav")]
    assert all(r.key in ("k2", "k3") for r in good.values())
    assert any(r.error and "line 2" in r.error[1] for r in reqs)


def test_csv_quotes_separators_and_newlines_inside_fields_are_kept(tmp_path):
    import csv
    texts = ['He said "hi", then left.', "two\nlines, with a comma", '"quoted"', "tab\there", "cr\r\nlf",
             "three\nlines, a \"quote\"\nand more"]
    for dialect, name in (("excel", "m.csv"), ("excel-tab", "m.tsv")):
        path = tmp_path / name
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f, dialect=dialect)
            w.writerow(["key", "text", "audio"])
            for i, t in enumerate(texts):
                w.writerow([f"k{i}", t, f"a{i}.wav"])
        reqs = read_requests(path)
        assert [r.error for r in reqs] == [None] * len(texts)
        assert [r.text for r in reqs] == [t.strip() for t in texts]
        assert [_audio(r) for r in reqs] == [[str(tmp_path / f"a{i}.wav")] for i in range(len(texts))]


def test_csv_more_cells_on_a_joined_record_rereads_the_lines(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text('key,text,audio\nk1,"x,a.wav\nk2,y,b.wav\nk3,"z,c.wav,extra\n')
    reqs = read_requests(path)
    good = {r.key for r in reqs if r.error is None}
    assert "k2" in good and "k1" not in good


# ---- encodings ----------------------------------------------------------------------------------

ROWS = [{"key": "caf\u00e9", "text": "na\u00efve \u2603 \U0001f600", "audio": "a.wav"},
        {"key": "k2", "text": "zwei", "audio": "b.wav"}]


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le-bom", "utf-16-be-bom", "utf-32"])
@pytest.mark.parametrize("kind", ["jsonl", "json", "csv"])
def test_manifest_with_a_bom_is_decoded(tmp_path, encoding, kind):
    if kind == "jsonl":
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ROWS)
    elif kind == "json":
        text = json.dumps(ROWS, ensure_ascii=False, indent=1)
    else:
        text = "key,text,audio\n" + "".join(f"{r['key']},{r['text']},{r['audio']}\n" for r in ROWS)
    if encoding.endswith("-bom"):
        codec = encoding[:-4]
        data = ("\ufeff" + text).encode(codec)
    else:
        data = text.encode(encoding)
    path = tmp_path / f"m.{kind}"
    path.write_bytes(data)
    reqs = read_requests(path)
    assert [(r.key, r.text, r.error) for r in reqs] == [("caf\u00e9", ROWS[0]["text"], None), ("k2", "zwei", None)]


@pytest.mark.parametrize("codec", ["utf-16-le", "utf-16-be", "utf-32-le"])
def test_utf16_without_bom_is_refused_by_name(tmp_path, codec):
    path = tmp_path / "m.jsonl"
    path.write_bytes("".join(json.dumps(r) + "\n" for r in ROWS).encode(codec))
    with pytest.raises(ValueError, match=codec.upper().replace("-LE", "").replace("-BE", "")):
        read_requests(path)


def test_cli_refuses_a_utf16_manifest_without_bom_with_exit_2(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes("".join(json.dumps(r) + "\n" for r in ROWS).encode("utf-16-le"))
    r = subprocess.run([sys.executable, "-m", "shardcache", "precompute", "--manifest", str(path), "--cache", str(tmp_path / "c"),
                        "--config", "none", "--no_progress", "--device=cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "UTF-16" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "c" / "index.parquet").exists()


# ---- JSON list records ----------------------------------------------------------------------------

def test_json_list_record_that_cannot_be_parsed_is_a_reject_naming_it(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    recs = ['{"key": "good-1", "text": "one", "audio": "a.wav"}',
            '{"key": "deep", "text": "x", "audio": "a.wav", "misc": ' + deep + '}',
            '{"text": "y", "audio": "a.wav", "n": ' + "9" * 5000 + '}',
            '{"key": "tricky, \\"[{", "text": "brackets ] } in a string", "audio": "b.wav"}',
            '{"misc": {"key": "huge"}, "messages": [], "n": ' + "1" * 5000 + '}',
            '{"key": "good-2", "text": "two", "audio": "c.wav"}']
    path = tmp_path / "m.json"
    path.write_text("[\n" + ",\n".join(recs) + "\n]\n")
    reqs = read_requests(path)
    assert len(reqs) == len(recs)
    good = {r.key: r for r in reqs if r.error is None}
    assert set(good) == {"good-1", "tricky,_\"[{", "good-2"}, [(r.key, r.error) for r in reqs]
    assert good["good-2"].text == "two" and _audio(good["good-2"]) == [str(tmp_path / "c.wav")]
    bad = {r.key: r.error for r in reqs if r.error is not None}
    assert bad["deep"][0] == schema.MALFORMED_ROW and "record 1" in bad["deep"][1]
    assert bad["huge"][0] == schema.MALFORMED_ROW and "record 4" in bad["huge"][1]
    assert any("record 2" in e[1] for e in bad.values())  # no key: named by its index


def test_json_list_that_is_not_a_list_still_refuses_the_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('[{"key": "a", "text": "t", "audio": "a.wav"}')  # no closing bracket
    with pytest.raises(ValueError, match="m.json"):
        read_requests(path)


# ---- rejects under the row's own key ------------------------------------------------------------

def test_malformed_chatml_row_is_rejected_under_its_misc_key(tmp_path):
    recs = [{"messages": [{"role": "robot", "content": "x"}], "misc": {"key": "my-row"}},
            {"messages": "not a list", "key": "other.row"},
            {"messages": [{"role": "robot", "content": "x"}], "misc": {"key": "bad\x00key"}}]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    reqs = read_requests(path)
    assert [r.key for r in reqs] == ["my-row", "other_row", "row-2"]
    assert all(r.error[0] == schema.MALFORMED_ROW for r in reqs)


# ---- non-regular media paths --------------------------------------------------------------------

def test_non_regular_media_paths_are_named(tmp_path):
    from precompute.audio import load_audio
    from precompute.images import decode_image
    (tmp_path / "dir.wav").mkdir()
    os.mkfifo(tmp_path / "fifo.wav")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock.wav"))
    try:
        for name, what in (("dir.wav", "directory"), ("fifo.wav", "FIFO"), ("sock.wav", "socket")):
            with pytest.raises(CorruptSample) as e:
                load_audio(tmp_path / name, (16000,))
            assert what in str(e.value) and "does not exist" not in str(e.value)
            with pytest.raises(CorruptSample) as e:
                decode_image(tmp_path / name)
            assert what in str(e.value) and "does not exist" not in str(e.value)
        with pytest.raises(CorruptSample, match="does not exist") as e:
            load_audio(tmp_path / "none.wav", (16000,))
        assert e.value.reason == schema.MISSING_FILE
    finally:
        sock.close()


# ---- formats in one table -------------------------------------------------------------------------

def test_manifest_formats_are_one_table(tmp_path):
    import typing
    choices = typing.get_args(typing.get_type_hints(PrecomputeConfig)["manifest_format"])[0]  # Literal[...] | None
    assert typing.get_args(choices) == tuple(FORMATS)
    for name, fmt in FORMATS.items():
        assert fmt.name == name and fmt.doc
    (tmp_path / "m.tsv").write_text("key\ttext\taudio\nk\tt\ta.wav\n")
    assert detect_format(tmp_path / "m.tsv") == "csv"
