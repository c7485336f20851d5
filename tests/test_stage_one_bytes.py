"""Stage one writes the same bytes as before it streamed its manifest (issue 48): every shard's members in
order, each member's sha256 and every reject, for the demo and the six real-mini manifests, against
``tests/golden/stage_one_outputs.json`` (recorded from the code of commit 983c043 by tests/stage_one_golden.py;
numpy stand-in encoders, so the bytes are the pipeline's: decoding, keys, chunks, json, rejects)."""
from __future__ import annotations

import json

import pytest

import stage_one_golden as G

pytestmark = pytest.mark.xdist_group("stage_one_bytes")


def _compare(name: str, got: dict, want: dict) -> None:
    assert got["shards"] == want["shards"], f"{name}: shards or member order differ"
    bad = sorted(k for k in want["members"] if got["members"].get(k) != want["members"][k])
    assert not bad, f"{name}: {len(bad)} member(s) differ, e.g. {bad[:3]}"
    assert got["rejects"] == want["rejects"], f"{name}: rejects differ"


def test_demo_and_real_mini_write_the_recorded_bytes():
    """The demo always; real-mini's manifests where the corpus is there (SHARDCACHE_REAL_MINI)."""
    want = json.loads(G.GOLDEN.read_text())
    names = [n for n, m in G.MANIFESTS.items() if m.exists()]
    assert "demo" in names
    got = G.run_all(names)
    assert set(got) == set(names)
    for name in names:
        _compare(name, got[name], want[name])
