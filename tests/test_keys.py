"""Key assignment (issue 30 item 1): every kept row gets its own key, within the length limit."""
from __future__ import annotations

import hashlib
import json

from precompute.manifests import read_requests
from shards import schema


def _write(tmp_path, rows, name="m.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _kept(reqs):
    return [r for r in reqs if r.error is None]


def test_literal_key_equal_to_a_suffixed_key_does_not_collide(tmp_path):
    # "a_b-" + sha256("a.b")[:8] is what "a.b" gets when "a_b" is taken; a row that literally has
    # that key, written before them, must not end up under the same key
    literal = "a_b-" + hashlib.sha256(b"a.b").hexdigest()[:8]
    rows = [{"key": literal, "text": "one", "audio": "1.wav"}, {"key": "a_b", "text": "two", "audio": "2.wav"},
            {"key": "a.b", "text": "three", "audio": "3.wav"}]
    reqs = read_requests(_write(tmp_path, rows))
    keys = [r.key for r in _kept(reqs)]
    assert len(keys) == 3 and len(set(keys)) == 3, keys
    assert keys[0] == literal and keys[1] == "a_b"  # literal keys keep their names
    assert reqs[2].meta["original_key"] == "a.b"


def test_literal_key_after_the_suffixed_one_does_not_collide(tmp_path):
    literal = "a_b-" + hashlib.sha256(b"a.b").hexdigest()[:8]
    rows = [{"key": "a_b", "text": "one", "audio": "1.wav"}, {"key": "a.b", "text": "two", "audio": "2.wav"},
            {"key": literal, "text": "three", "audio": "3.wav"}]
    reqs = read_requests(_write(tmp_path, rows))
    keys = [r.key for r in _kept(reqs)]
    assert len(keys) == 3 and len(set(keys)) == 3, keys
    assert keys[2] == literal  # the literal key is never displaced by a suffix


def test_long_colliding_keys_stay_within_the_limit(tmp_path):
    base = "k" * (schema.MAX_KEY_BYTES - 2)
    rows = [{"key": base + "_x", "text": "one", "audio": "1.wav"}, {"key": base + ".x", "text": "two", "audio": "2.wav"},
            {"key": base + "/x", "text": "three", "audio": "3.wav"},
            {"key": "\u00e9" * 99 + "_y", "text": "four", "audio": "4.wav"},
            {"key": "\u00e9" * 99 + ".y", "text": "five", "audio": "5.wav"}]
    reqs = read_requests(_write(tmp_path, rows))
    keys = [r.key for r in _kept(reqs)]
    assert len(keys) == 5 and len(set(keys)) == 5, keys
    for k in keys:
        assert schema.key_problem(k) is None, k
        assert k == schema.safe_key(k)


def test_keyless_segments_of_one_recording_get_distinct_keys(tmp_path):
    rows = [{"text": "first", "audio": "long.wav", "offset": 0.0, "duration": 2.0},
            {"text": "second", "audio": "long.wav", "offset": 2.0, "duration": 2.0},
            {"text": "third", "audio": "long.wav", "offset": 4.0},
            {"text": "same window, other text", "audio": "long.wav", "offset": 4.0}]
    reqs = read_requests(_write(tmp_path, rows))
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    assert len({r.key for r in reqs}) == 4
    again = read_requests(_write(tmp_path, rows, "again.jsonl"))
    assert [r.key for r in again] == [r.key for r in reqs]  # stable


def test_keyless_same_row_twice_is_a_duplicate(tmp_path):
    row = {"text": "first", "audio": "long.wav", "offset": 1.0, "duration": 2.0}
    a, b = read_requests(_write(tmp_path, [row, row]))
    assert a.error is None and a.key.startswith("h") and len(a.key) == 17
    assert b.error[0] == schema.DUPLICATE_KEY


def test_keyless_chatml_segments_get_distinct_keys(tmp_path):
    def rec(offset):
        return {"messages": [{"role": "user", "content": "say it"},
                             {"role": "assistant", "content": {"type": "audio", "audio_url": "a.wav",
                                                               "offset": offset, "duration": 1.0}}]}
    reqs = read_requests(_write(tmp_path, [rec(0.0), rec(1.0), rec(2.0)]))
    assert all(r.error is None for r in reqs) and len({r.key for r in reqs}) == 3
