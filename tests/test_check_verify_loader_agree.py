"""Issue 41 item 6: ``shardcache check``, ``shards verify --deep`` and the loader agree.

Each tampering below is one the loader refuses (the test shows it does: building a ``ShardLoader``
and reading one epoch raises); ``check`` and ``verify --deep`` must refuse it too (exit status not
0, naming the problem). Before, ``check`` looked at none of the cache's own files (no integrity
root, no shard hash, no loader check) and exited 0 on tamperings the loader refuses; a forged
``rejects.parquet`` or sidecar part passed ``verify --deep``: the integrity root covered neither.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import DEMO


def run_here(capsys, argv: list[str]) -> tuple[int, str]:
    from shardcache.cli import main
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out + err


def loader_refuses(cache: Path) -> str | None:
    """The loader's refusal of ``cache`` (its message), or None when it reads a whole epoch: every
    sample, every field, with its strictest read checks (checksums and values)."""
    from loaders import Order, Reads, ShardLoader
    try:
        ld = ShardLoader(cache, batch_size=1, seed=0, fields=["input_ids", "labels", "codes", "audio", "audio_starts", "audio_segments"], order=Order(shuffle=False, drop_remainder=False), reads=Reads(checks="values"))
        n = sum(len(b["keys"]) for b in ld)
        ld.close()
    except Exception as e:  # noqa: BLE001 - what the loader raises is its refusal
        return f"{type(e).__name__}: {e}"
    assert n == 24
    return None


def _member(cache: Path, row: int, name: str) -> tuple[Path, dict]:
    from shards.index import read_index
    r = read_index(cache).to_pylist()[row]
    return cache / r["shard"], next(m for m in r["members"] if m["name"] == name)


def _rewrite_index(cache: Path, edit, root: bool) -> None:
    """Rewrite index.parquet with ``edit(rows)`` applied; ``root``: and write an integrity root that
    vouches for the edited index (a forger who rewrites both)."""
    import pyarrow.parquet as pq
    from shards.index import read_index, rows_to_table, write_root
    rows = read_index(cache).to_pylist()
    edit(rows)
    pq.write_table(rows_to_table(rows), cache / "index.parquet")
    if root:
        cid = json.loads((cache / "integrity.json").read_text())["cache_id"]
        write_root(cache, cid)


def edit_index(cache: Path) -> None:
    """One value of index.parquet edited (as a hand edit would)."""
    def edit(rows):
        rows[3]["n_frames"] += 1
    _rewrite_index(cache, edit, root=False)


def forge_index_and_root(cache: Path) -> None:
    """A member's shape edited in the index AND the root rewritten to vouch for it."""
    def edit(rows):
        m = next(m for m in rows[5]["members"] if m["name"] == "input_ids.npy")
        m["shape"] = [int(m["shape"][0]) + 1]
    _rewrite_index(cache, edit, root=True)


def delete_root(cache: Path) -> None:
    (cache / "integrity.json").unlink()


def edit_cache_id(cache: Path) -> None:
    m = json.loads((cache / "manifest.json").read_text())
    m["cache_id"] = "0123456789abcdef"
    (cache / "manifest.json").write_text(json.dumps(m, indent=2))


def flip_a_byte(cache: Path) -> None:
    """One byte of a sample's codes flipped inside its shard."""
    shard, m = _member(cache, 7, "codes.npy")
    with open(shard, "r+b") as f:
        f.seek(m["offset"] + 1)
        b = f.read(1)
        f.seek(m["offset"] + 1)
        f.write(bytes([b[0] ^ 0x10]))


def truncate_a_shard(cache: Path) -> None:
    shard, _ = _member(cache, 20, "codes.npy")
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 20 * 512)


def codes_out_of_range_reindexed(cache: Path) -> None:
    """A code past the codebook written into a shard, then `shards reindex` run: index, manifest and
    root all vouch for it; only the value check sees it."""
    from shards.cli import main
    shard, m = _member(cache, 10, "codes.npy")
    with open(shard, "r+b") as f:
        f.seek(m["offset"])
        f.write(np.array([32000], np.int16).tobytes())
    assert main(["reindex", str(cache), "--no_progress"]) == 0


TAMPERINGS = [edit_index, forge_index_and_root, delete_root, edit_cache_id, flip_a_byte, truncate_a_shard,
              codes_out_of_range_reindexed]


@pytest.fixture()
def cache(demo_cache, tmp_path) -> Path:
    c = tmp_path / "c"
    shutil.copytree(demo_cache, c)
    return c


def test_an_intact_cache_passes_all_three(cache, capsys):
    """(So a refusal below is the tampering's.)"""
    assert loader_refuses(cache) is None
    assert run_here(capsys, ["shards", "verify", str(cache), "--deep", "--no_progress"])[0] == 0
    rc, out = run_here(capsys, ["check", str(cache), "--manifest", str(DEMO / "samples.jsonl"), "--samples", "2"])
    assert rc == 0, out[-2000:]


@pytest.mark.parametrize("tamper", TAMPERINGS, ids=[t.__name__ for t in TAMPERINGS])
def test_what_the_loader_refuses_check_and_verify_refuse(cache, capsys, tamper):
    tamper(cache)
    why = loader_refuses(cache)
    assert why is not None, f"{tamper.__name__}: the loader reads it (not a tampering of this test)"
    rc, out = run_here(capsys, ["shards", "verify", str(cache), "--deep", "--no_progress"])
    assert rc == 1 and "FAILED" in out, f"verify --deep passed {tamper.__name__} the loader refuses ({why}): {out}"
    samples = "24" if tamper is codes_out_of_range_reindexed else "1"   # check reads the samples it picks
    rc, out = run_here(capsys, ["check", str(cache), "--manifest", str(DEMO / "samples.jsonl"), "--samples", samples])
    assert rc == 1, f"check passed {tamper.__name__} the loader refuses ({why}): {out[-2000:]}"
    assert "DAMAGED" in out or "the loader refuses to read it" in out, out[-2000:]


def test_a_forged_rejects_parquet_fails_verify(cache, capsys):
    """rejects.parquet rewritten (another reject list) passed verify --deep: the root did not cover it."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"key": ["x"], "source": ["s"], "reason": ["silent"], "detail": ["forged"]}),
                   cache / "rejects.parquet")
    for mode in ([], ["--deep"]):
        rc, out = run_here(capsys, ["shards", "verify", str(cache), "--no_progress", *mode])
        assert rc == 1 and "rejects.parquet does not match integrity.json" in out, out
    rc, out = run_here(capsys, ["check", str(cache), "--manifest", str(DEMO / "samples.jsonl"), "--samples", "1"])
    assert rc == 1 and "rejects.parquet" in out, out[-2000:]


def test_a_forged_sidecar_part_fails_verify(cache, capsys):
    """A sidecar part (what a re-merge attaches a field's members from) rewritten: verify names it."""
    import pyarrow.parquet as pq
    from precompute.add_field import add_field
    add_field(cache, "audio_16k", {"producer": "waveform", "sample_rate": 16000}, progress=False)
    assert run_here(capsys, ["shards", "verify", str(cache), "--deep", "--no_progress"])[0] == 0
    part = sorted((cache / "parts").glob("*.audio_16k.sidecar.parquet"))[0]
    t = pq.read_table(part)
    pq.write_table(t.slice(0, t.num_rows - 1).replace_schema_metadata(t.schema.metadata), part)
    rc, out = run_here(capsys, ["shards", "verify", str(cache), "--deep", "--no_progress"])
    assert rc == 1 and f"{part.name} does not match integrity.json" in out, out
