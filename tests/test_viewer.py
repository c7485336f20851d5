"""``shardcache shards view`` without a browser: a cache of 100,000 samples served page by page,
a remote cache in S3 (moto's server on 127.0.0.1), the core install's message, what the server
refuses, and the text of each token. The browser half: tests/test_viewer_browser.py."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("jinja2")
pytest.importorskip("duckdb")
pytest.importorskip("matplotlib")

from shards.index import INDEX_SCHEMA, REJECTS_SCHEMA  # noqa: E402
from shards.merge import write_cache_files  # noqa: E402
from shards.schema import shard_name  # noqa: E402
from shards.viewer.app import App  # noqa: E402
from shards.viewer.data import PAGE_SIZE, ViewedCache  # noqa: E402
from shards.writer import ShardWriter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEYS_PAGE = b'class="key"'


from viewer_caches import viewer_cache_dir  # noqa: F401,E402 (autouse: the viewer's cache folder per module)


def page_keys(html: bytes) -> list[str]:
    """The sample keys an index page links, in order (from its <a class="key"> elements)."""
    import re
    return re.findall(r'<a class="key" href="[^"]*">([^<]*)</a>', html.decode())


def small_cache(root: Path) -> Path:
    from test_loaders import make_cache
    return make_cache(root, (5, 4), image_every=3)


# ----------------------------------------------------------------------------- 100,000 samples

def synthetic_index(n: int) -> pa.Table:
    """``n`` index rows naming shards that do not exist: reading any sample would fail."""
    member_type = INDEX_SCHEMA.field("members").type
    one = [{"name": "input_ids.npy", "offset": 1024, "size": 40, "dtype": "<i4", "shape": [10], "file": None,
            "member": "tensors.npz", "xxh3": 1},
           {"name": "codes.npy", "offset": 2048, "size": 400, "dtype": "<i2", "shape": [8, 25], "file": None,
            "member": "tensors.npz", "xxh3": 2}]
    values = pa.array(one, member_type.value_type).take(pa.array(np.tile([0, 1], n)))
    members = pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * n + 1, 2, dtype=np.int32)), values, type=member_type)
    cols = {"key": pa.array([f"s{i:06d}" for i in range(n)]),
            "shard": pa.array([shard_name(0, i // 1000) for i in range(n)]),
            "duration_s": pa.array(np.linspace(0.5, 20.0, n)), "sample_rate": pa.array(np.full(n, 24000, np.int32)),
            "speaker": pa.array([f"spk{i % 7}" for i in range(n)]), "bytes": pa.array(np.full(n, 4096)),
            "sha256": pa.array(["0" * 64] * n), "members": members}
    for f in INDEX_SCHEMA:
        if f.name not in cols:
            cols[f.name] = pa.array(np.zeros(n, bool if pa.types.is_boolean(f.type) else np.int64)).cast(f.type)
    return pa.table({f.name: cols[f.name] for f in INDEX_SCHEMA}, schema=INDEX_SCHEMA)


@pytest.fixture(scope="module")
def big_cache(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("big")
    index = synthetic_index(100_000)
    shards = [{"path": s, "samples": 1000, "bytes": 4096000, "sha256": "0" * 64}
              for s in sorted(set(index.column("shard").to_pylist()))]
    write_cache_files(out, index, REJECTS_SCHEMA.empty_table(), shards,
                      {"text": {"vocab_size": 300, "pad_id": 0, "special_token_ids": {}}})
    return out


def test_a_cache_of_100000_samples_is_served_a_page_at_a_time(big_cache):
    """Any page of the index, filtered or not, is served without reading a sample (the shards do not
    exist) and without turning the index into Python objects: a page allocates less than converting a
    tenth of the index's rows does (measured here, in the same process)."""
    app = App(ViewedCache(big_cache))
    app.respond("GET", "/", {})  # templates compiled, DuckDB imported: not what a page costs
    app.vc.index.scalars()
    app.vc.text.wait()  # the side table's build (another thread) allocates too: done before measuring
    app.respond("GET", "/", {})
    app.respond("GET", "/?where=sample_rate%20%3D%201", {})
    tracemalloc.start()
    try:
        pages = {path: app.respond("GET", path, {}) for path in
                 ("/", "/?page=2000", "/?page=1234", "/?where=duration_s%20%3E%2019.9&page=2")}
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        pq.read_table(big_cache / "index.parquet", columns=["key", "members"]).slice(0, 10_000).to_pylist()  # a tenth
        tenth = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all(r.status == 200 for r in pages.values())
    assert page_keys(pages["/"].body) == [f"s{i:06d}" for i in range(PAGE_SIZE)]
    assert page_keys(pages["/?page=2000"].body) == [f"s{i:06d}" for i in range(99_950, 100_000)]
    assert page_keys(pages["/?page=1234"].body) == [f"s{i:06d}" for i in range(61_650, 61_700)]
    durations = np.linspace(0.5, 20.0, 100_000)
    matching = [f"s{i:06d}" for i in np.flatnonzero(durations > 19.9)]
    assert page_keys(pages["/?where=duration_s%20%3E%2019.9&page=2"].body) == matching[PAGE_SIZE:2 * PAGE_SIZE]
    assert f"{len(matching):,} of 100,000 match".encode() in pages["/?where=duration_s%20%3E%2019.9&page=2"].body
    assert peak < tenth, (peak, tenth)


# ------------------------------------------------------------------------------------- remote

def test_a_remote_cache_is_viewed_through_the_loaders_download(tmp_path, monkeypatch):
    """The index from the metadata alone; a sample page downloads its shard (only it), and serves the
    bytes the local cache serves."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from test_remote import CREDS, S3
    monkeypatch.setenv("SHARDCACHE_LOCAL_CACHE", str(tmp_path / "local-cache"))
    local = small_cache(tmp_path / "local")
    old = {k: os.environ.get(k) for k in CREDS}
    os.environ.update(CREDS)
    s3 = S3()
    try:
        url = s3.upload(local, "s3://view-bucket/cache")
        remote = ViewedCache(url, storage_options=s3.options, local_dir=tmp_path / "view")
        here = App(ViewedCache(local))
        there = App(remote)
        index = there.respond("GET", "/", {})
        keys = pq.read_table(local / "index.parquet", columns=["key"]).column("key").to_pylist()
        assert index.status == 200 and page_keys(index.body) == keys
        assert not list((tmp_path / "view").glob("shard-*.tar"))  # nothing but the metadata yet
        key = keys[-1]
        for path in (f"/sample/{key}", f"/sample/{key}/audio/audio/0.wav", f"/sample/{key}/codes/codes/0.png"):
            a, b = here.respond("GET", path, {}), there.respond("GET", path, {})
            assert a.status == b.status == 200, path
            if not path.endswith(key):
                assert a.body == b.body
        shard = pq.read_table(local / "index.parquet").to_pylist()[-1]["shard"]
        assert [p.name for p in (tmp_path / "view").glob("shard-*.tar")] == [shard]  # only the sample's shard
        remote.close()
    finally:
        s3.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ------------------------------------------------------------------------------ what is refused

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("duckdb", "matplotlib", "jinja2"):
            raise ImportError(f"not installed: {name}")
sys.meta_path.insert(0, Block())
from shardcache.cli import main
sys.exit(main(["shards", "view", sys.argv[1], "--port", "0"]))
"""


def test_without_the_inspect_extra_the_command_exits_2_naming_it(tmp_path):
    cache = small_cache(tmp_path / "c")
    r = subprocess.run([sys.executable, "-c", BLOCK, str(cache)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert 'pip install "shardcache[inspect]"' in r.stderr
    assert "jinja2" in r.stderr and "duckdb" in r.stderr and "matplotlib" in r.stderr


def test_the_command_serves_on_127_0_0_1_prints_the_url_and_stops_on_ctrl_c(tmp_path):
    cache = small_cache(tmp_path / "c")
    p = subprocess.Popen([sys.executable, "-m", "shardcache", "shards", "view", str(cache), "--port", "0", "--quiet"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        first = p.stdout.readline()
        url_line = p.stdout.readline().strip()
        assert "9 samples" in first, first + p.stderr.read() if p.poll() is not None else first
        url = url_line.split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/")
        host, port = url[len("http://"):-1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/")
        r = conn.getresponse()
        assert r.status == 200 and KEYS_PAGE in r.read()
        # what the server refuses: writes, another Host (DNS rebinding), and it says what pages may load
        for method in ("POST", "PUT", "DELETE"):
            c = http.client.HTTPConnection(host, int(port), timeout=30)
            c.request(method, "/", body=b"x")
            r = c.getresponse()
            r.read()
            c.close()
            assert r.status == 405 and r.getheader("Allow") == "GET, HEAD"
        conn.request("GET", "/", headers={"Host": f"evil.example:{port}"})
        r = conn.getresponse()
        r.read()
        assert r.status == 403
        conn.request("HEAD", "/static/style.css")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b"" and "script-src" not in r.getheader("Content-Security-Policy")
        assert "default-src 'none'" in r.getheader("Content-Security-Policy")
        conn.close()
    finally:
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert "stopped" in out


def test_another_host_is_served_only_when_asked_and_warned_about(tmp_path, monkeypatch, capsys):
    """``--host`` names the address; any but a loopback one is warned about (no socket is opened here)."""
    import shards.viewer.server as server
    from shards.cli import main

    cache = small_cache(tmp_path / "c")
    seen = []

    class Fake:
        def __init__(self, app, host, port, quiet=False, allow_hosts=()):
            seen.append((host, port))
            self.server_address, self.url = (host, 8123), f"http://{host}:8123/"

        def serve_forever(self):
            raise KeyboardInterrupt

        def server_close(self):
            pass

    monkeypatch.setattr(server, "ViewerServer", Fake)
    assert main(["view", str(cache), "--host", "10.1.2.3", "--port", "8123"]) == 0
    out, err = capsys.readouterr()
    assert seen == [("10.1.2.3", 8123)] and "http://10.1.2.3:8123/" in out
    assert "warning" in err and "10.1.2.3" in err and "anyone who can reach this machine" in err
    assert main(["view", str(cache)]) == 0
    out, err = capsys.readouterr()
    assert seen[-1] == ("127.0.0.1", 8000) and "warning" not in err
    assert main(["view", str(tmp_path / "nothing")]) == 2
    assert "no such directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- content

def test_a_sample_without_a_cached_waveform_says_so_instead_of_a_player(tmp_path):
    rng = np.random.default_rng(0)
    items = [{"source": "/data/ref.wav", "offset_s": 0.0, "duration_s": 1.0, "direction": "out", "turn": 2,
              "speaker": "a"}, {"source": "/data/tgt.wav", "offset_s": 0.0, "duration_s": 1.2, "direction": "out",
                                "turn": 4, "speaker": "a"}]
    with ShardWriter(tmp_path, shard_name(0, 0)) as w:
        w.add("nowave", {"json": {"sample_rate": 24000, "duration_s": 2.2, "audio_items": items},
                         "codes.npy": rng.integers(0, 1024, (8, 55)).astype(np.int16),
                         "audio_segments.npy": np.array([[0, 2, 1, 0, 25, 0], [1, 4, 1, 25, 30, 0]], np.int32),
                         "input_ids.npy": np.arange(1, 20, dtype=np.int32),
                         "labels.npy": np.r_[np.full(15, -100), np.arange(16, 20)].astype(np.int32)})
        w.commit()
    from shards.merge import merge_parts
    merge_parts(tmp_path, {})
    app = App(ViewedCache(tmp_path))
    html = app.respond("GET", "/sample/nowave", {}).body.decode()
    assert "<audio" not in html and "no waveform cached" in html
    assert html.count('class="item ') == 2 and html.count("figure class=\"codes\"") == 2
    assert html.count("data-label=") == 19 and html.count('data-label="-100"') == 15
    assert app.respond("GET", "/sample/nowave/audio/audio/0.wav", {}).status == 404
    png = app.respond("GET", "/sample/nowave/codes/codes/1.png", {})
    assert png.status == 200 and png.content_type == "image/png"
    from matplotlib.image import imread
    import io
    assert imread(io.BytesIO(png.body)).shape[:2] == (8, 30)  # item 1: 8 codebooks x its 30 frames


def test_each_token_text_is_what_the_tokenizer_adds(tmp_path):
    """Joined, the pieces are the tokenizer's own decoding of the ids (byte tokenizer: a character split
    over several byte tokens; a BPE tokenizer's leading spaces), one piece per id."""
    from precompute.encoders import load_text_tokenizer
    from shards.manifest import CacheManifest
    from shards.viewer.tokens import load_token_text
    from tools.testing import build

    text = "Grüße, 日本語 and emoji 🎧 <|AUDIO_OUT|> done"
    byte_tok = load_text_tokenizer({"name": "bytes"})
    man = CacheManifest.from_dict({"config": {"text_tokenizer": {"name": "bytes"}},
                                   "encoders": {"text_tokenizer": byte_tok.describe()},
                                   "text": {"special_token_ids": {"<|AUDIO_OUT|>": byte_tok.token_to_id("<|AUDIO_OUT|>")}}})
    tt = load_token_text(man)
    ids = byte_tok.encode(text).tolist()
    pieces = tt.pieces(ids)
    assert len(pieces) == len(ids) and tt.has_text
    assert "".join(pieces) == "<bos>" + text + "<eos>"
    assert pieces[ids.index(byte_tok.token_to_id("<|AUDIO_OUT|>"))] == "<|AUDIO_OUT|>"
    assert "" in pieces  # the first bytes of a multi-byte character carry no text of their own

    path, _ = build("tokenizer", tmp_path / "models")
    hf = load_text_tokenizer({"name": "hf", "pretrained": str(path)})
    man = CacheManifest.from_dict({"config": {"text_tokenizer": {"name": "hf", "pretrained": str(path)}},
                                   "encoders": {"text_tokenizer": hf.describe()}, "text": {"special_token_ids": {}}})
    tt = load_token_text(man)
    ids = hf.encode("the quick brown fox <|AUDIO_OUT|> said héllo", add_special_tokens=False).tolist()
    pieces = tt.pieces(ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == hf.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # another tokenizer at the recorded path: ids only, and the page says why
    man = CacheManifest.from_dict({"config": {"text_tokenizer": {"name": "hf", "pretrained": str(path)}},
                                   "encoders": {"text_tokenizer": {"vocab_sha256": "f" * 64}}})
    tt = load_token_text(man)
    assert not tt.has_text and tt.pieces(ids) is None and "not the one this cache was made with" in tt.how
    gone = CacheManifest.from_dict({"config": {"text_tokenizer": {"name": "hf", "pretrained": str(tmp_path / "gone")}}})
    assert f"{tmp_path / 'gone'} is not a folder on this machine" in load_token_text(gone).how


def test_the_index_filter_is_shards_query(tmp_path):
    from shards.commands.query import select
    cache = small_cache(tmp_path / "c")
    app = App(ViewedCache(cache))
    where = "speaker = 'spk1' OR has_image"
    r = app.respond("GET", "/?where=" + __import__("urllib.parse").parse.quote(where), {})
    assert r.status == 200
    assert page_keys(r.body) == select(cache, where, ["key"]).column("key").to_pylist()
    bad = app.respond("GET", "/?where=speaker%20%3D%3D%3D%201", {})
    assert bad.status == 400 and b"--where" in bad.body and page_keys(bad.body) == []
    evil = app.respond("GET", "/?where=" + __import__("urllib.parse").parse.quote("1=1); COPY (SELECT 1) TO '/tmp/x"), {})
    assert evil.status == 400 and not Path("/tmp/x").exists()


def test_every_route_of_a_missing_thing_is_404(tmp_path):
    cache = small_cache(tmp_path / "c")
    app = App(ViewedCache(cache))
    key = pq.read_table(cache / "index.parquet", columns=["key"]).column("key")[0].as_py()
    for path in ("/nothing", "/sample/nokey", f"/sample/{key}/audio/audio/7.wav", f"/sample/{key}/audio/codes/0.wav",
                 f"/sample/{key}/audio/audio/-1.wav", f"/sample/{key}/audio/audio/0.mp3",
                 f"/sample/{key}/latents/latents/0/99.png", f"/sample/{key}/image/0.png", "/static/nothing.css",
                 "/sample/" + "%2e%2e", "/static/%2e%2e%2fapp.py", "/sample/a%00b", f"/sample/{key}/json"):
        assert app.respond("GET", path, {}).status == 404, path
    assert app.respond("GET", f"/sample/{key}/audio/audio/0.wav", {}).status == 200
    assert app.respond("DELETE", f"/sample/{key}", {}).status == 405


def test_the_viewer_writes_nothing(tmp_path):
    cache = small_cache(tmp_path / "c")
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in cache.rglob("*")}
    app = App(ViewedCache(cache))
    keys = pq.read_table(cache / "index.parquet", columns=["key"]).column("key").to_pylist()
    for path in ["/", "/?where=has_image"] + [f"/sample/{k}" for k in keys]:
        assert app.respond("GET", path, {}).status == 200
    time.sleep(0.01)
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in cache.rglob("*")} == before
    assert json.loads((cache / "manifest.json").read_text())["cache_id"] == app.vc.id


def test_a_damaged_sample_is_a_page_naming_shard_key_and_member(tmp_path):
    """The viewer reads as the loaders do, checksums checked: a flipped byte in a sample's codes is an
    error page naming the shard, the key and the member, never a player or an image of wrong values."""
    cache = small_cache(tmp_path / "c")
    row = pq.read_table(cache / "index.parquet").to_pylist()[2]
    codes = next(m for m in row["members"] if m["name"] == "codes.npy")
    with open(cache / row["shard"], "r+b") as f:
        f.seek(codes["offset"])
        b = f.read(1)
        f.seek(codes["offset"])
        f.write(bytes([b[0] ^ 0x01]))
    app = App(ViewedCache(cache))
    for path in (f"/sample/{row['key']}", f"/sample/{row['key']}/codes/codes/0.png"):
        r = app.respond("GET", path, {})
        assert r.status == 500, path
        text = r.body.decode()
        assert row["shard"] in text and row["key"] in text and "codes.npy" in text and "checksum mismatch" in text
    other = pq.read_table(cache / "index.parquet").to_pylist()[0]["key"]
    assert app.respond("GET", f"/sample/{other}", {}).status == 200


# ------------------------------------------------------------------------- what the viewer loads

def test_the_first_page_reads_no_column_of_the_index(big_cache, monkeypatch):
    """The first page of a cache comes from the Parquet footer and its first rows: with the background
    read of the scalar columns switched off, it is served, right, and no column has been read."""
    from shards.viewer.rows import IndexFile
    monkeypatch.setattr(IndexFile, "scalars_in_background", lambda self: None)
    vc = ViewedCache(big_cache, background=False)
    r = App(vc).respond("GET", "/", {})
    assert r.status == 200 and page_keys(r.body) == [f"s{i:06d}" for i in range(PAGE_SIZE)]
    assert b"100,000" in r.body and vc.index._scalars is None and len(vc) == 100_000


STAGES = ("precompute", "loaders", "train")
MODEL_LIBRARIES = ("transformers", "torch", "diffusers")


def test_the_viewer_imports_nothing_of_the_stages(demo_cache):
    """Its source names none (the remote mirror is :mod:`shards.mirror`), and serving every kind
    of page and media of the demo (images from their sources included) imports none, nor a model library."""
    import ast
    for path in sorted((ROOT / "shards" / "viewer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for n in names:
                if n.split(".")[0] in STAGES:
                    raise AssertionError(f"shards/viewer/{path.name} imports {n}")
    code = """
import sys, json
from shards.viewer.data import ViewedCache
from shards.viewer.app import App
import pyarrow.parquet as pq
vc = ViewedCache(sys.argv[1]); app = App(vc)
rows = pq.read_table(sys.argv[1] + "/index.parquet", columns=["key", "has_image"]).to_pylist()
img = next(r["key"] for r in rows if r["has_image"])
paths = ["/", "/?where=has_image", "/?sort=duration_s&desc=1", f"/sample/{img}", f"/sample/{img}/image/0.png",
         f"/sample/{img}/thumb.png", f"/sample/{img}/latents/latents/0/0.png", f"/sample/{img}/codes/codes/0.png",
         f"/sample/{img}/audio/audio/0.wav", "/favicon.ico"]
vc.text.wait(); app.token_text.wait()
statuses = [app.respond("GET", p, {}).status for p in paths + ["/?q=coffee"]]
print(json.dumps([statuses, sorted({m.split(".")[0] for m in sys.modules})]))
"""
    r = subprocess.run([sys.executable, "-c", code, str(demo_cache)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "SHARDCACHE_VIEWER_CACHE": os.environ["SHARDCACHE_VIEWER_CACHE"]})
    assert r.returncode == 0, r.stderr
    statuses, modules = json.loads(r.stdout.strip().splitlines()[-1])
    assert statuses == [200] * len(statuses)
    assert not set(modules) & set(STAGES + MODEL_LIBRARIES), sorted(set(modules) & set(STAGES + MODEL_LIBRARIES))


def test_the_first_page_imports_neither_duckdb_nor_matplotlib(demo_cache):
    """What the index page needs is imported at start, nothing more (a filter imports DuckDB, an image
    matplotlib, when one is asked for)."""
    code = """
import sys, json
from shards.viewer.data import ViewedCache
from shards.viewer.app import App
app = App(ViewedCache(sys.argv[1]))
status = app.respond("GET", "/", {}).status
print(json.dumps([status, sorted({m.split(".")[0] for m in sys.modules} & {"duckdb", "matplotlib", "transformers", "torch", "PIL"})]))
"""
    r = subprocess.run([sys.executable, "-c", code, str(demo_cache)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [200, []]


# ------------------------------------------------------------------------------ the tokenizer

def blocked_network(monkeypatch) -> list:
    """Refuse (and record) every connection this process tries to make to anything but loopback."""
    attempts = []
    import socket
    real = socket.socket.connect

    def connect(self, address, *a):
        host = address[0] if isinstance(address, tuple) else str(address)
        if host not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError(f"network blocked by the test: {address}")
        return real(self, address, *a)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: attempts.append(host) or (_ for _ in ()).throw(
        OSError(f"network blocked by the test: {host}")))
    return attempts


def test_a_relative_tokenizer_path_is_found_under_the_folder_stage_one_ran_in_offline(tmp_path, monkeypatch):
    """The cache records ``pretrained: models/higgs-text-tokenizer-tiny`` (relative to where stage one
    ran) and that folder (``working_dir``): viewed from another folder with the network blocked, the
    text is the tokenizer's own decoding. Without ``working_dir``: ids, and the page says why; a hub
    id: the local Hugging Face cache, never the hub."""
    import huggingface_hub.constants
    from transformers import AutoTokenizer
    from viewer_caches import TEXTS, relative_tokenizer
    from shards.viewer.tokens import load_token_text

    with_wd = relative_tokenizer(tmp_path / "models", tmp_path / "with-wd")
    without = relative_tokenizer(tmp_path / "models", tmp_path / "without-wd", working_dir=False)
    folder = tmp_path / "models" / "higgs-text-tokenizer-tiny"
    own = AutoTokenizer.from_pretrained(str(folder))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    attempts = blocked_network(monkeypatch)
    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))

    app = App(ViewedCache(with_wd))
    assert app.token_text.wait(120)
    tt = app.token_text.get()
    assert tt.has_text and str(folder) in tt.how and "fingerprint matches" in tt.how
    for i, text in enumerate(TEXTS):
        ids = app.vc.sample(f"text-{i}").arrays["input_ids"]
        assert "".join(tt.pieces(ids)) == own.decode(ids.tolist(), skip_special_tokens=False,
                                                      clean_up_tokenization_spaces=False)
        assert text.split()[1] in app.respond("GET", f"/sample/text-{i}", {}).body.decode()

    tt = load_token_text(ViewedCache(without, background=False).manifest)
    assert not tt.has_text and "working_dir" in tt.how and "models/higgs-text-tokenizer-tiny" in tt.how
    assert "not in the local Hugging Face cache" in tt.how

    # the same name as a hub id, in a local hub cache (the layout huggingface_hub writes)
    snap = hub / "models--models--higgs-text-tokenizer-tiny" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in folder.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0" * 40)
    tt = load_token_text(ViewedCache(without, background=False).manifest)
    assert tt.has_text and "local Hugging Face cache" in tt.how
    assert attempts == []


def test_a_sample_page_asked_for_before_the_tokenizer_is_loaded_shows_ids_and_says_so(tmp_path, monkeypatch):
    """No page waits on the tokenizer's load (it runs in the background from the start)."""
    import threading
    from viewer_caches import relative_tokenizer
    import shards.viewer.tokens as tokens
    cache = relative_tokenizer(tmp_path / "models", tmp_path / "c")
    gate = threading.Event()
    real = tokens.load_token_text
    monkeypatch.setattr(tokens, "load_token_text", lambda m: gate.wait() and real(m))
    monkeypatch.setattr("shards.viewer.app.TOKENIZER_WAIT_S", 0.05)
    app = App(ViewedCache(cache))
    got = []
    t = threading.Thread(target=lambda: got.append(app.respond("GET", "/sample/text-0", {}).body.decode()), daemon=True)
    t.start()
    t.join(30)
    gate.set()
    assert got, "the sample page waited for the tokenizer"
    html = got[0]
    assert "still loading" in html and html.count("data-label=") > 0
    assert app.token_text.wait(60)
    assert "still loading" not in app.respond("GET", "/sample/text-0", {}).body.decode()


# ----------------------------------------------------------------------------------- images

def _odd_images(folder: Path) -> list[Path]:
    """Images whose decoding has a step of its own: alpha, a palette with transparency, 16-bit grey,
    an EXIF orientation."""
    from PIL import Image
    rng = np.random.default_rng(0)
    folder.mkdir()
    out = []
    rgba = Image.fromarray(rng.integers(0, 256, (50, 70, 4), dtype=np.uint8), "RGBA")
    rgba.save(folder / "rgba.png")
    rgba.convert("P").save(folder / "palette.png", transparency=3)
    Image.fromarray(rng.integers(0, 65536, (40, 90), dtype=np.uint16)).save(folder / "grey16.png")
    im = Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8), "RGB")
    exif = im.getexif()
    exif[0x0112] = 6  # rotated 90 degrees
    im.save(folder / "rotated.jpg", exif=exif)
    out += [folder / n for n in ("rgba.png", "palette.png", "grey16.png", "rotated.jpg")]
    return out


def test_a_source_image_is_what_stage_one_gave_the_encoder(tmp_path):
    """The viewer's reading of a source image (its own file checks and decode, then stage one's pixel rules,
    :mod:`shards.pixels`) equals stage one's ``load_image`` pixel for pixel, for every resize and RGB mode, on
    the demo's images and on odd ones (16-bit, palette, alpha, EXIF-rotated)."""
    from precompute.images import load_image
    from shards.pixels import RESIZE_MODES, RGB_MODES
    from shards.viewer.images import source_image
    paths = sorted(p for p in (ROOT / "data" / "demo" / "images").iterdir() if "bad" not in p.name)
    paths += _odd_images(tmp_path / "odd")
    for path in paths:
        for mode in RESIZE_MODES:
            for rgb in RGB_MODES:
                pre = dict(size=64, mode=mode, rgb=rgb, max_pixels=64_000_000)
                want = load_image(path, 64, mode=mode, rgb=rgb)
                got = source_image(path, pre)
                assert got.dtype == np.uint8 and np.array_equal(got, want), (path.name, mode, rgb)


def test_the_side_table_of_text_is_kept_outside_the_cache(demo_cache, tmp_path, monkeypatch):
    """Kept in the viewer's own folder (read back by the next viewer); pointed into the cache folder, it
    stays in memory and nothing is written there."""
    monkeypatch.setenv("SHARDCACHE_VIEWER_CACHE", str(tmp_path / "mine"))
    vc = ViewedCache(demo_cache)
    assert vc.text.wait(120)
    kept = list((tmp_path / "mine").glob("text-*.parquet"))
    assert len(kept) == 1 and vc.id in kept[0].name
    assert pq.read_table(kept[0]).column("key").to_pylist() == \
        pq.read_table(demo_cache / "index.parquet", columns=["key"]).column("key").to_pylist()
    before = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in demo_cache.rglob("*")}
    monkeypatch.setenv("SHARDCACHE_VIEWER_CACHE", str(demo_cache / "parts"))
    vc = ViewedCache(demo_cache)
    assert vc.text.wait(120) and vc.text.path is None
    assert {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in demo_cache.rglob("*")} == before


def test_make_view_with_its_port_taken_says_PORT(tmp_path):
    """The Makefile's own variable, not the command's option, in make's message."""
    import socket
    if not (ROOT / ".venv" / ".installed-inspect").exists():
        pytest.skip("make view needs the checkout's .venv (make setup)")
    cache = small_cache(tmp_path / "c")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
        r = subprocess.run(["make", "-s", "view", f"PORT={port}", f"OUT={cache}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert f"port {port} is taken" in r.stderr and "PORT=" in r.stderr and "--port" not in r.stderr, r.stderr
