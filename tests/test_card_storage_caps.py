"""Issue 30 item 7: a dataset card unique to its cache (mode 0644), ``file://`` URLs wherever a
path works, per-row caps applied from file headers before any decoding."""
from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from conftest import DEMO
from shards import read_cache_id
from shards.card import CARD_FILE
from shards.reader import ShardReader


def _good_rows() -> list[dict]:
    """The demo's good speech-only rows (``expected_rejects.json`` names the bad ones)."""
    bad = {r["key"] for r in json.loads((DEMO / "expected_rejects.json").read_text())}
    recs = []
    for line in (DEMO / "samples.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec["key"] not in bad and "image" not in rec and rec["key"] not in {r["key"] for r in recs}:
            recs.append(rec)
    return recs


def _manifest(folder: Path, rows: range) -> Path:
    recs = [_good_rows()[i] for i in rows]
    for r in recs:
        r["audio"] = str(DEMO / r["audio"])
        r.pop("image", None)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture(scope="module")
def two_caches(tiny_config, tmp_path_factory):
    """Two caches of different rows in folders of the same name (``a/cache``, ``b/cache``)."""
    import dataclasses
    from precompute.job import run
    tmp = tmp_path_factory.mktemp("cards")
    cfg = dataclasses.replace(tiny_config, image_encoder=None)
    out = []
    for name, rows in (("a", range(0, 3)), ("b", range(3, 6))):
        cache = tmp / name / "cache"
        summary, _ = run(_manifest(tmp / name, rows), cache, cfg, progress=False)
        assert summary.kept == 3, summary.reasons
        out.append(cache)
    return out


def test_card_config_is_unique_to_the_cache_and_world_readable(two_caches):
    import yaml
    names = []
    for cache in two_caches:
        path = cache / CARD_FILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        meta = yaml.safe_load(path.read_text().split("---\n")[1])
        (config,) = meta["configs"]
        assert read_cache_id(cache) in config["config_name"] and config.get("default") is True
        names.append(config["config_name"])
    assert names[0] != names[1]


def test_hf_datasets_gives_each_cache_its_own_samples(two_caches, tmp_path):
    datasets = pytest.importorskip("datasets")
    hf = tmp_path / "hf"  # one datasets cache for both, as a user's ~/.cache/huggingface is
    for cache in two_caches:
        ds = datasets.load_dataset(str(cache), split="train", cache_dir=str(hf))
        assert sorted(ds["__key__"]) == sorted(ShardReader(cache).keys), cache
