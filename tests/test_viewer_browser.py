"""``shardcache shards view`` in a real browser: the system's headless Chromium driven by Playwright
against real caches made here from real-mini (tests/viewer_caches.py: a Higgs-Audio voice-cloning
cache and a LLaVA / TheWorld image cache, each with a reject and a hostile conversation).

What a page shows is compared with what the tests read themselves from the cache's files (the tar
members with ``tarfile`` + ``np.load(allow_pickle=False)``, the Parquet files with pyarrow), never
with the viewer's own output. One browser and one server per cache for the whole module.

Needs ``/usr/bin/chromium`` (``make browser``: ``apt-get install chromium``; or
``$SHARDCACHE_CHROMIUM``) and the ``playwright`` package (the ``[dev]`` extra); skips saying so
otherwise.
"""
from __future__ import annotations

import http.client
import io
import json
import os
import tarfile
from pathlib import Path
from urllib.parse import quote, urlsplit

import numpy as np
import pyarrow.parquet as pq
import pytest

from viewer_caches import HOSTILE, llava, voice_clone

CHROMIUM = os.environ.get("SHARDCACHE_CHROMIUM", "/usr/bin/chromium")
#: as docs/viewer.md and the machine notes say: headless, no sandbox (root), no GPU, nothing from the
#: network (background services and their lookups are refused on a closed network), audio may start
#: without a click; Playwright adds a fresh empty profile (--user-data-dir) per launch
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required"]
HOW = "`make browser` (apt-get install chromium) and `pip install -e .[dev]` (playwright)"
#: one worker of `make test` (pytest-xdist --dist loadgroup) makes the caches and runs the browser
pytestmark = pytest.mark.xdist_group("viewer-browser")

if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM}: {HOW}, or set SHARDCACHE_CHROMIUM", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason=f"the playwright package is not installed: {HOW}")

IGNORE = -100
#: waits for an <audio> element's metadata, plays it muted for a moment, and reports what the browser saw
PLAY = """async (el) => {
  if (el.readyState < 1) await new Promise((ok, bad) => {
    el.addEventListener('loadedmetadata', ok, {once: true});
    el.addEventListener('error', () => bad(new Error('media error ' + (el.error && el.error.code))), {once: true});
  });
  const duration = el.duration;
  el.muted = true;
  await el.play();
  await new Promise(r => setTimeout(r, 250));
  return {duration, currentTime: el.currentTime, paused: el.paused, error: el.error && el.error.code};
}"""


# ------------------------------------------------------------------------------- the caches' own bytes

def index_keys(cache: Path) -> list[str]:
    return pq.read_table(cache / "index.parquet", columns=["key"]).column("key").to_pylist()


def stored(cache: Path, key: str) -> tuple[dict, dict]:
    """``(arrays, json)`` of sample ``key``, read from its shard with tarfile + np.load (no project code)."""
    shard = pq.read_table(cache / "index.parquet", columns=["key", "shard"]).to_pandas().set_index("key").loc[key, "shard"]
    arrays, meta = {}, {}
    with tarfile.open(cache / shard) as tar:
        for m in tar.getmembers():
            base, _, ext = m.name.partition(".")
            if base != key:
                continue
            data = tar.extractfile(m).read()
            if ext == "json":
                meta = json.loads(data)
            elif ext == "tensors.npz":
                with np.load(io.BytesIO(data), allow_pickle=False) as z:
                    arrays.update({k: z[k] for k in z.files})
            elif ext.endswith(".npy"):
                arrays[ext[:-4]] = np.load(io.BytesIO(data), allow_pickle=False)
    return arrays, meta


# ---------------------------------------------------------------------------------------- fixtures

@pytest.fixture(autouse=True, scope="module")
def _viewer_cache(tmp_path_factory):
    """The viewer's own cache folder (the side table of text) under this module's tmp folder."""
    old = os.environ.get("SHARDCACHE_VIEWER_CACHE")
    os.environ["SHARDCACHE_VIEWER_CACHE"] = str(tmp_path_factory.mktemp("viewer-cache"))
    yield
    if old is None:
        os.environ.pop("SHARDCACHE_VIEWER_CACHE", None)
    else:
        os.environ["SHARDCACHE_VIEWER_CACHE"] = old


@pytest.fixture(scope="module")
def caches(real_mini, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("viewer")
    return {"tts": voice_clone(real_mini, root / "models", root / "tts"),
            "vlm": llava(real_mini, root / "models", root / "vlm")}


@pytest.fixture(scope="module")
def servers(caches):
    from shards.viewer.app import App
    from shards.viewer.data import ViewedCache
    from shards.viewer.server import ViewerServer
    running = {}
    for name, path in caches.items():
        srv = ViewerServer(App(ViewedCache(path)), "127.0.0.1", 0, quiet=True)
        srv.start()
        running[name] = srv
    yield {name: srv.url for name, srv in running.items()}
    for srv in running.values():
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.errors = errors
    yield pg
    ctx.close()


def open_sample(page, url: str, key: str):
    r = page.goto(url + "sample/" + quote(key, safe=""))
    assert r.status == 200, key
    page.wait_for_load_state("networkidle")
    return page


# ------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("name", ["tts", "vlm"])
def test_the_index_lists_every_key_and_every_reject(page, caches, servers, name):
    r = page.goto(servers[name])
    assert r.status == 200
    assert page.locator("a.key").all_inner_texts() == index_keys(caches[name])
    rejects = pq.read_table(caches[name] / "rejects.parquet").to_pylist()
    assert rejects, "each test cache has a reject"
    body = page.locator("#rejects").inner_text()
    for rej in rejects:
        assert rej["key"] in body and rej["reason"] in body and rej["detail"] in body
        assert rej["source"].split(";")[-1] in body
    cards = page.locator("section.cards").inner_text()
    man = json.loads((caches[name] / "manifest.json").read_text())
    assert man["cache_id"] in cards and man["text"]["template"] in cards


def test_the_filter_takes_the_sql_of_shards_query(page, caches, servers):
    keys = index_keys(caches["tts"])
    page.goto(servers["tts"])
    page.fill("input[name=where]", f"key = '{keys[1]}' OR n_text_tokens > 1000000")
    page.click("form.filter button")
    page.wait_for_load_state("networkidle")
    assert page.locator("a.key").all_inner_texts() == [keys[1]]
    page.fill("input[name=where]", "no_such_column > 1")
    page.click("form.filter button")
    assert "no_such_column" in page.locator(".error").inner_text()
    assert page.locator("a.key").count() == 0


def own_tokenizer(cache: Path):
    """The cache's text tokenizer loaded here with transformers from the path its manifest records, with
    the tokens stage one added (``text.added_tokens``, TheWorld's world markers) added the same way."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer
    man = json.loads((cache / "manifest.json").read_text())
    tok = AutoTokenizer.from_pretrained(man["config"]["text_tokenizer"]["pretrained"])
    added = man["text"].get("added_tokens") or {}
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in sorted(added, key=added.get)],
                   special_tokens=True)
    assert all(tok.convert_tokens_to_ids(t) == i for t, i in added.items())
    return tok


@pytest.mark.parametrize("name", ["tts", "vlm"])
def test_one_element_per_token_carrying_its_label(page, caches, servers, name):
    tok = own_tokenizer(caches[name])
    for key in index_keys(caches[name]):
        arrays, _ = stored(caches[name], key)
        ids, labels = arrays["input_ids"], arrays["labels"]
        open_sample(page, servers[name], key)
        # the conversation as the tokenizer's own text: the tokens' texts joined are its decoding of the ids
        assert page.locator(".tokens").text_content() == tok.decode(
            ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        tokens = page.locator(".tokens [data-label]")
        assert tokens.count() == len(ids) == page.locator("[data-label]").count()
        assert [int(x) for x in tokens.evaluate_all("els => els.map(e => e.dataset.label)")] == labels.tolist()
        assert [int(x) for x in tokens.evaluate_all("els => els.map(e => e.dataset.id)")] == ids.tolist()
        trained = page.locator(".tokens [data-label]:not([data-label='-100'])")
        assert trained.count() == int((labels != IGNORE).sum()) > 0
        # trained tokens are marked where a person sees it: another background than untrained ones
        look = "e => getComputedStyle(e).backgroundColor"
        untrained = page.locator(".tokens [data-label='-100']:not(.sp)").first
        assert trained.first.evaluate(look) != untrained.evaluate(look)


def test_every_cached_audio_item_plays_for_its_cached_duration(page, caches, servers):
    cache = caches["tts"]
    sr = json.loads((cache / "manifest.json").read_text())["sample_rate"]
    for key in index_keys(cache):
        arrays, meta = stored(cache, key)
        starts = arrays["audio_starts"].tolist()
        open_sample(page, servers["tts"], key)
        players = page.locator("#audio audio")
        assert players.count() == len(starts) - 1 == len(meta["audio_items"]) == 2
        heads = page.locator("#audio .item .badge.input, #audio .item .badge.output").all_text_contents()
        assert heads == [{"in": "input", "out": "output"}[it["direction"]] for it in meta["audio_items"]]
        for k in range(players.count()):
            got = players.nth(k).evaluate(PLAY)
            assert got["error"] is None and not got["paused"] and got["currentTime"] > 0, got
            assert got["duration"] == pytest.approx((starts[k + 1] - starts[k]) / sr, abs=2e-3), (key, k)
        # the reference is not trained, the target is (voice cloning's start_index)
        assert page.locator("#audio .badge.trained").count() == 1
        assert page.locator("#audio .badge.context").count() == 1
    assert not page.errors


@pytest.mark.parametrize("name", ["tts", "vlm"])
def test_images_load(page, caches, servers, name):
    for key in index_keys(caches[name]):
        arrays, meta = stored(caches[name], key)
        open_sample(page, servers[name], key)
        imgs = page.locator("main img")
        sizes = imgs.evaluate_all("els => els.map(e => [e.complete, e.naturalWidth, e.naturalHeight, e.alt])")
        assert sizes and all(ok and w > 0 and h > 0 for ok, w, h, _ in sizes), sizes
        if name == "tts":  # a codes image per audio item, codebooks x frames
            assert page.locator("figure.codes img").count() == len(meta["audio_items"])
        else:  # the source image, and every latent channel of it
            lat = arrays["latents"]
            assert page.locator("figure.seen img").count() == lat.shape[1] == len(meta["images"])
            assert page.locator("figure.latents img").count() == lat.shape[0] * lat.shape[1]
            seen = page.locator("figure.seen img").first.evaluate("e => [e.naturalWidth, e.naturalHeight]")
            size = json.loads((caches[name] / "manifest.json").read_text())["config"]["image_size"]
            assert seen == [size, size]  # after the recorded resize (stretch to image_size)
            n_tokens = arrays["image_features"].shape[1]
            assert f"{n_tokens} tokens" in page.locator(".features").inner_text()


@pytest.mark.parametrize("name", ["tts", "vlm"])
def test_a_hostile_text_stays_text(page, caches, servers, name):
    key = index_keys(caches[name])[0]
    _, meta = stored(caches[name], key)
    assert HOSTILE in json.dumps(meta["conversation"], ensure_ascii=False).replace('\\"', '"')
    open_sample(page, servers[name], key)
    assert page.title() == f"{key} · shardcache"  # the script did not run, the onerror did not fire
    # no element came from the text: no script, no <img src=x>, nothing inside a token or the JSON
    assert page.locator("script, img[src='x'], .tokens [data-label] *, pre.json *").count() == 0
    assert "<script>document.title" in page.locator(".tokens").inner_text()
    assert "<script>document.title" in page.locator("pre.json").inner_text()
    assert not page.errors


def test_traversal_urls_get_404(page, caches, servers):
    url = servers["tts"]
    key = index_keys(caches["tts"])[0]
    for path in ("/manifest.json", "/index.parquet", "/shard-000000.tar", "/static/..%2F..%2Fcache.py",
                 "/sample/..%2Fmanifest.json", "/sample/%2e%2e/manifest.json",
                 f"/sample/{key}/audio/audio/..%2F..%2Findex.parquet", f"/sample/{key}/audio/..%2Faudio/0.wav",
                 "/static/%2e%2e/app.py", "/sample/" + quote(str(caches["tts"] / "manifest.json"), safe="")):
        r = page.goto(url.rstrip("/") + path)
        assert r.status == 404, path
    # the raw request line too (a browser resolves /../ before sending it)
    u = urlsplit(url)
    for raw in ("/../manifest.json", "/static/../../shards/viewer/app.py", f"/sample/{key}/../../index.parquet",
                "/sample/..\\manifest.json"):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        conn.request("GET", raw)
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        assert resp.status == 404, raw
        assert b"cache_id" not in body and b"PAR1" not in body
