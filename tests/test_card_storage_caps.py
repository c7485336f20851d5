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
        assert meta["dataset_info"]["config_name"] == config["config_name"]  # the features apply to it
        names.append(config["config_name"])
    assert names[0] != names[1]


def test_hf_datasets_gives_each_cache_its_own_samples(two_caches, tmp_path):
    datasets = pytest.importorskip("datasets")
    hf = tmp_path / "hf"  # one datasets cache for both, as a user's ~/.cache/huggingface is
    for cache in two_caches:
        ds = datasets.load_dataset(str(cache), split="train", cache_dir=str(hf))
        assert sorted(ds["__key__"]) == sorted(ShardReader(cache).keys), cache
        assert isinstance(ds[0]["json"], dict)  # the card's declared Json() feature, not an inferred struct


# ---- file:// URLs ----------------------------------------------------------------------------------

def _file_url(path: Path) -> str:
    from urllib.parse import quote
    return "file://" + quote(str(path.resolve()))


def test_local_path_reads_file_urls():
    from shards.storage import is_url, local_path
    assert local_path("file:///tmp/a%20b/c") == Path("/tmp/a b/c")
    assert local_path("file://localhost/tmp/x") == Path("/tmp/x")
    assert local_path("/tmp/x") == Path("/tmp/x") and local_path(Path("rel")) == Path("rel")
    assert not is_url("file:///tmp/x") and is_url("s3://b/x")
    with pytest.raises(ValueError, match="other.host"):
        local_path("file://other.host/tmp/x")


def test_file_urls_work_wherever_a_path_does(two_caches, tmp_path, tiny_config):
    import dataclasses
    import subprocess
    import sys
    from conftest import ROOT
    from loaders import Order, ShardLoader, Workers
    from precompute.job import run
    cache = two_caches[0]
    spaced = tmp_path / "a cache"
    import shutil
    shutil.copytree(cache, spaced)
    for where in (cache, spaced):
        url = _file_url(where)
        assert ShardReader(url).keys == ShardReader(cache).keys
        assert read_cache_id(url) == read_cache_id(cache)
        loader = ShardLoader(url, batch_size=1, order=Order(shuffle=False, drop_remainder=False), workers=Workers(num_workers=0))
        assert sorted(k for b in loader for k in b["keys"]) == sorted(ShardReader(cache).keys)
    url = _file_url(spaced)  # the command line: one process, each command's path handling in-process
    code = ("import sys; from shards.cli import main; "
            "sys.exit(max(main([c, sys.argv[1]]) or 0 for c in ('info', 'verify', 'ls', 'stats')))")
    r = subprocess.run([sys.executable, "-c", code, url], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.stdout[-500:], r.stderr[-1500:])
    cfg = dataclasses.replace(tiny_config, image_encoder=None)
    out = tmp_path / "new cache"
    summary, _ = run(_manifest(tmp_path / "m", range(0, 2)), _file_url(out), cfg, progress=False)
    assert summary.kept == 2 and sorted(ShardReader(out).keys) == sorted(r["key"] for r in _good_rows()[:2])


# ---- per-row caps from the headers, before decoding ------------------------------------------------

def _many_items_row(tmp_path: Path, n: int, **item) -> "object":
    from precompute.manifests import read_requests
    audio = {"type": "audio", "audio_url": str(DEMO / "audio" / "spk-us-0001.flac"), **item}  # 2.154 s
    rec = {"messages": [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": [audio] * n}],
           "misc": {"key": "many"}}
    (tmp_path / "m.jsonl").write_text(json.dumps(rec) + "\n")
    (req,) = read_requests(tmp_path / "m.jsonl", allow_outside_root=True)
    assert req.error is None
    return req


@pytest.fixture(scope="module")
def text_tokenizer(tiny_models):
    from precompute.encoders import load_text_tokenizer
    return load_text_tokenizer({"name": "hf", "pretrained": str(tiny_models / "tokenizer-tiny")})


def _prepare(req, cfg, tok):
    from precompute import chat
    from precompute import prepare as P
    return P.Preparer(P.DecodeOptions.of(cfg), ((16000, frozenset({"in", "out"})),), tok, "llama3",
                      chat.ChatTokens.of(cfg))(req, 0)


def test_total_duration_cap_is_applied_from_headers_before_decoding(tmp_path, monkeypatch, text_tokenizer):
    import dataclasses
    from precompute import prepare as P
    from precompute.config import PrecomputeConfig
    from shards import schema
    soundfile = pytest.importorskip("soundfile")
    seconds = soundfile.info(str(DEMO / "audio" / "spk-us-0001.flac")).duration  # read independently
    cfg = dataclasses.replace(PrecomputeConfig(), max_total_duration_s=100.0, max_audio_items=256)
    calls = []
    real = P.load_audio_windows
    monkeypatch.setattr(P, "load_audio_windows", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    n = int(100.0 // seconds) + 1  # one item more than fits: ~47 items of 2.15 s
    out = _prepare(_many_items_row(tmp_path, 200), cfg, text_tokenizer)
    assert out.error is not None and out.error[0] == schema.TOO_LARGE, out.error
    assert "max_total_duration_s" in out.error[1]
    assert calls == [], "decoded before the cap was applied"
    out = _prepare(_many_items_row(tmp_path, n - 1), cfg, text_tokenizer)  # within the cap: decoded, kept
    assert out.error is None and len(out.audio) == n - 1 and calls == [n - 1]
    # windows past the header's end count what is there: offset 2 s leaves 0.154 s per item
    calls.clear()
    out = _prepare(_many_items_row(tmp_path, 200, offset=2.0), cfg, text_tokenizer)
    assert out.error is None and calls == [200], out.error


def test_lengths_no_header_gives_stop_decoding_at_the_cap(tmp_path, monkeypatch, text_tokenizer):
    """Inline raw_audio has no file header to read: decoding stops at the first item past the cap."""
    import base64
    import dataclasses
    from precompute import prepare as P
    from precompute.config import PrecomputeConfig
    from precompute.manifests import read_requests
    from shards import schema
    raw = base64.b64encode((DEMO / "audio" / "spk-us-0001.flac").read_bytes()).decode()  # 2.154 s
    rec = {"messages": [{"role": "user", "content": "Say it."},
                        {"role": "assistant", "content": [{"type": "audio", "raw_audio": raw}] * 10}],
           "misc": {"key": "inline"}}
    (tmp_path / "m.jsonl").write_text(json.dumps(rec) + "\n")
    (req,) = read_requests(tmp_path / "m.jsonl")
    calls = []
    real = P.load_audio_windows
    monkeypatch.setattr(P, "load_audio_windows", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = dataclasses.replace(PrecomputeConfig(), max_total_duration_s=5.0)
    out = _prepare(req, cfg, text_tokenizer)
    assert out.error[0] == schema.TOO_LARGE and "max_total_duration_s" in out.error[1]
    assert len(calls) == 3  # 3 x 2.154 s > 5 s: the other 7 items are never decoded
