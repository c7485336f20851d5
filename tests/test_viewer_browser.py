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
         "--autoplay-policy=no-user-gesture-required",
         # a DNS name that resolves to 127.0.0.1 (what a rebinding attack makes of its own domain)
         "--host-resolver-rules=MAP rebind.test 127.0.0.1"]
#: one SQL condition that would scan for days: a subquery over 10**15 generated rows
ENDLESS = "(SELECT count(*) FROM range(1000000000000000)) > 0"
#: seconds the module's servers let a filter condition run
QUERY_TIMEOUT_S = 2
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

from viewer_caches import viewer_cache_dir  # noqa: F401,E402 (autouse: the viewer's cache folder per module)


@pytest.fixture(scope="module")
def caches(real_mini, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("viewer")
    return {"tts": voice_clone(real_mini, root / "models", root / "tts"),
            "vlm": llava(real_mini, root / "models", root / "vlm")}


@pytest.fixture(scope="module")
def running(caches):
    """One server per cache for the module (name -> ViewerServer; its ``app``)."""
    from shards.viewer.app import App
    from shards.viewer.data import ViewedCache
    from shards.viewer.server import ViewerServer
    running = {}
    for name, path in caches.items():
        srv = ViewerServer(App(ViewedCache(path, query_timeout_s=QUERY_TIMEOUT_S)), "127.0.0.1", 0, quiet=True)
        srv.start()
        running[name] = srv
    yield running
    for srv in running.values():
        srv.shutdown()
        srv.server_close()
        srv.app.vc.close()


@pytest.fixture(scope="module")
def servers(running):
    return {name: srv.url for name, srv in running.items()}


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


# ------------------------------------------------------------------------ another origin's page

EVIL = """<!doctype html><html><head><title>evil</title></head><body><pre id="out"></pre><script>
const V = %(viewer)s, KEY = %(key)s;
function load(tag, src) {
  return new Promise(done => {
    const el = document.createElement(tag);
    el.onload = () => done("loaded"); el.onloadedmetadata = () => done("loaded"); el.onerror = () => done("error");
    if (tag === "audio") el.preload = "auto";
    el.src = src; document.body.appendChild(el); setTimeout(() => done("no answer"), 8000);
  });
}
(async () => {
  const out = {};
  try { const r = await fetch(V + "/"); out.fetch = "read " + (await r.text()).length + " bytes"; } catch (e) { out.fetch = "blocked"; }
  try { const r = await fetch(V + "/", {mode: "no-cors"}); out.no_cors = r.type + " " + r.status; } catch (e) { out.no_cors = "blocked"; }
  out.img_key = await load("img", V + "/sample/" + KEY + "/codes/codes/0.png");
  out.img_nokey = await load("img", V + "/sample/no-such-key/codes/codes/0.png");
  out.audio_key = await load("audio", V + "/sample/" + KEY + "/audio/audio/0.wav");
  out.audio_nokey = await load("audio", V + "/sample/no-such-key/audio/audio/0.wav");
  out.icon = await load("img", V + "/favicon.ico");
  document.getElementById("out").textContent = JSON.stringify(out); document.title = "done";
})();
</script></body></html>"""


@pytest.fixture
def evil_site(servers, caches):
    """A page served from another origin (another port of 127.0.0.1) that tries to read the viewer."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    page = EVIL % {"viewer": json.dumps(servers["tts"].rstrip("/")), "key": json.dumps(index_keys(caches["tts"])[1])}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = page.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/"
    srv.shutdown()
    srv.server_close()


def test_a_page_of_another_origin_learns_nothing_from_the_viewer(page, running, evil_site, caches, monkeypatch):
    """fetch (CORS and no-cors), <img> and <audio> of a key that exists and one that does not: each is
    refused by the viewer (403) and what the page sees is the same for both; a rebinding DNS name
    (rebind.test -> 127.0.0.1, same-origin for the browser) gets 403 with nothing of the cache."""
    app = running["tts"].app
    seen = []
    respond = app.respond

    def recording(method, target, headers=None, gone=None):
        r = respond(method, target, headers, gone)
        seen.append((target, (headers or {}).get("Sec-Fetch-Site"), r.status))
        return r

    monkeypatch.setattr(app, "respond", recording)
    page.goto(evil_site)
    page.wait_for_function("document.title === 'done'", timeout=60_000)
    got = json.loads(page.locator("#out").inner_text())
    assert got["fetch"] == got["no_cors"] == "blocked", got  # no-cors too: CORP same-origin
    assert got["img_key"] == got["img_nokey"] == "error", got
    assert got["audio_key"] == got["audio_nokey"] == "error", got
    assert got["icon"] == "error", got
    assert seen and all(status == 403 and site == "same-site" for _, site, status in seen), seen
    # DNS rebinding: the browser thinks it talks to rebind.test; the viewer sees Host: rebind.test
    port = urlsplit(running["tts"].url).port
    seen.clear()
    r = page.goto(f"http://rebind.test:{port}/")
    assert r.status == 403
    text = page.content()
    assert not any(k in text for k in index_keys(caches["tts"])) and "cache_id" not in text
    assert seen and seen[0][0] == "/" and all(status == 403 for _, _, status in seen), seen
    # the viewer itself, opened by the user: served (and its icon too)
    assert page.goto(running["tts"].url).status == 200
    assert page.goto(running["tts"].url + "favicon.ico").status == 200


def test_an_endless_filter_returns_a_timeout_error_and_the_server_idles(page, running, servers):
    import time
    for srv in running.values():  # the background work of the module's servers is over
        srv.app.vc.text.wait(120)
        srv.app.token_text.wait(120)
    r = page.goto(servers["tts"] + "?where=" + quote(ENDLESS))
    assert r.status == 400
    assert f"stopped after {QUERY_TIMEOUT_S} s" in page.locator(".error").inner_text()
    cpu = time.process_time()
    time.sleep(1.5)
    used = time.process_time() - cpu
    assert used < 0.3, f"{used:.2f} s of CPU in 1.5 s after the deadline: the condition still runs"
    assert page.goto(servers["tts"]).status == 200


# --------------------------------------------------------------------------------- the grid

def own_lines(meta: dict) -> list[str]:
    """What each grid row shows, from the sample's json as the test reads it: per turn
    ``role: first line of its text`` (a turn of media only: its media)."""
    out = []
    for turn in meta["conversation"]["turns"]:
        texts = [p["text"] for p in turn["parts"] if p.get("type") == "text"]
        if texts:
            first = next(line for line in "\n".join(texts).splitlines() if line.strip()).strip()
            out.append(f"{turn['role']}: {first}")
        else:
            out.append(f"{turn['role']}: " + " ".join(f"[{p['type']} {p['item']}]" for p in turn["parts"]))
    return out


@pytest.mark.parametrize("name", ["tts", "vlm"])
def test_the_grid_shows_each_samples_text_and_its_player_or_thumbnail(page, caches, servers, name):
    page.goto(servers[name])
    rows = page.locator("table.grid tbody tr")
    keys = index_keys(caches[name])
    assert rows.count() == len(keys)
    for i, key in enumerate(keys):
        arrays, meta = stored(caches[name], key)
        row = rows.nth(i)
        lines = row.locator("td.text .line").all_text_contents()
        want = own_lines(meta)
        assert len(lines) == len(want), (key, lines)
        for got, exp in zip(lines, want):
            assert got == exp or (got.endswith("…") and exp.startswith(got[:-1])), (key, got, exp)
        if name == "tts":  # a small player of the last audio item (the target), playing its cached clip
            player = row.locator("audio.mini")
            assert player.count() == 1
            k = len(meta["audio_items"]) - 1
            assert player.get_attribute("src").endswith(f"/audio/audio/{k}.wav")
            starts = arrays["audio_starts"]
            sr = json.loads((caches[name] / "manifest.json").read_text())["sample_rate"]
            player.evaluate("e => { e.preload = 'auto'; e.load(); }")  # preload="none" in the grid: nothing before a click
            got = player.evaluate(PLAY)
            assert got["error"] is None and got["duration"] == pytest.approx((starts[k + 1] - starts[k]) / sr, abs=2e-3)
        else:  # a thumbnail of the image
            thumb = row.locator("img.thumb")
            thumb.scroll_into_view_if_needed()
            page.wait_for_function("e => e.complete && e.naturalWidth > 0", arg=thumb.element_handle(), timeout=30_000)
            assert row.locator("audio").count() == 0


def _own_order(cache: Path, column: str, desc: bool = False, where: str | None = None) -> list[str]:
    """The keys sorted by ``column`` (ties in index order), computed here with DuckDB over index.parquet."""
    import duckdb
    q = (f"SELECT key FROM (SELECT *, row_number() OVER () AS i FROM read_parquet('{cache / 'index.parquet'}')) "
         + (f"WHERE {where} " if where else "") + f"ORDER BY {column} {'DESC' if desc else 'ASC'}, i")
    return [r[0] for r in duckdb.sql(q).fetchall()]


def test_sorting_and_text_search_give_the_rows_the_index_says(page, caches, servers, running):
    cache = caches["tts"]
    page.goto(servers["tts"])
    page.click("table.grid th a.sort:text('duration')")
    page.wait_for_load_state("load")  # the sorted page whole before its keys are read (a loaded machine)
    assert page.locator("a.key").all_inner_texts() == _own_order(cache, "duration_s")
    page.click("table.grid th a.sort:text('duration')")
    page.wait_for_load_state("load")  # the sorted page whole before its keys are read (a loaded machine)
    assert page.locator("a.key").all_inner_texts() == _own_order(cache, "duration_s", desc=True)
    page.click("table.grid th a.sort:text('key')")
    page.wait_for_load_state("load")  # the sorted page whole before its keys are read (a loaded machine)
    assert page.locator("a.key").all_inner_texts() == _own_order(cache, "key")
    # search: the samples whose conversation holds the text, case-insensitively (read from the tars here)
    running["tts"].app.vc.text.wait(120)
    keys = index_keys(cache)
    texts = {k: "\n".join(p.get("text", "") for t in stored(cache, k)[1]["conversation"]["turns"]
                          for p in t["parts"] if p.get("type") == "text").lower() for k in keys}
    word = next(w for w in texts[keys[2]].split() if len(w) > 4 and w.isalpha())
    for q in ("PwNeD", word.upper(), "no such words at all"):
        page.goto(servers["tts"])
        page.fill("input[name=q]", q)
        page.click("form.filter button")
        page.wait_for_load_state("networkidle")
        want = [k for k in _own_order(cache, "key") if q.lower() in texts[k]]
        assert page.locator("a.key").all_inner_texts() == want, q
    assert page.locator("a.key").count() == 0  # the last one matches nothing


def test_next_and_previous_walk_the_views_order(page, caches, servers):
    cache = caches["vlm"]
    where = "n_text_tokens > 0"
    order = _own_order(cache, "n_text_tokens", desc=True, where=where)
    page.goto(servers["vlm"] + "?" + f"where={quote(where)}&sort=n_text_tokens&desc=1")
    assert page.locator("a.key").all_inner_texts() == order, page.locator("main").inner_text()[:800]
    page.locator("a.key").first.click()
    walked = [page.locator("h1.key").inner_text()]
    while page.locator("a.next").count():
        page.click("a.next")
        walked.append(page.locator("h1.key").inner_text())
    assert walked == order
    assert page.locator(".walk .where").inner_text() == f"{len(order)} of {len(order)} in this view"
    back = [walked[-1]]
    while page.locator("a.prev").count():
        page.click("a.prev")
        back.append(page.locator("h1.key").inner_text())
    assert back == order[::-1]
    page.click("nav.crumbs a >> nth=0")  # back to the index page of that view
    assert page.locator("a.key").all_inner_texts() == order


def _long_rejects(folder: Path) -> Path:
    """A one-sample cache whose rejects name two long sources each (what a voice-cloning row that
    names a reference and a target clip under a deep data folder gives) and a long key and detail."""
    from shards.merge import merge_parts
    from shards.schema import shard_name
    from shards.writer import ShardWriter
    deep = "/mnt/datasets/speech/" + "/".join(f"corpus-part-{i:02d}-of-a-long-folder-name" for i in range(4))
    with ShardWriter(folder, shard_name(0, 0)) as w:
        w.add("kept", {"json": {"text": "kept"}, "input_ids.npy": np.arange(1, 9, dtype=np.int32)})
        for i in range(3):
            w.reject(f"clone-{'x' * 60}-{i}", f"{deep}/reference_{i}_{'r' * 40}.wav;{deep}/target_{i}_{'t' * 40}.wav",
                     "unreadable_audio", f"audio item 1: target_{i}.wav: not readable audio: Format not recognised " * 3)
        w.commit()
    merge_parts(folder, {})
    return folder


def test_the_rejects_never_overflow_sideways_at_1366_px(browser, caches, servers, tmp_path):
    from shards.viewer.app import App
    from shards.viewer.data import ViewedCache
    from shards.viewer.server import ViewerServer
    rejects = pq.read_table(caches["tts"] / "rejects.parquet").to_pylist()
    assert any(";" in r["source"] for r in rejects), "the test cache has a reject with two sources"
    cache = _long_rejects(tmp_path / "long")
    long = pq.read_table(cache / "rejects.parquet").to_pylist()
    srv = ViewerServer(App(ViewedCache(cache)), "127.0.0.1", 0, quiet=True)
    srv.start()
    ctx = browser.new_context(viewport={"width": 1366, "height": 900})
    try:
        pg = ctx.new_page()
        for url, rows in ((servers["tts"], rejects), (srv.url, long)):
            pg.goto(url + "#rejects")
            widths = pg.evaluate("""() => {
                const t = document.querySelector('#rejects table'), d = document.documentElement;
                const s = document.querySelector('#rejects');
                return [d.scrollWidth, d.clientWidth, t.scrollWidth, t.clientWidth, s.scrollWidth, s.clientWidth];
            }""")
            assert widths[0] <= widths[1] and widths[2] <= widths[3] + 1 and widths[4] <= widths[5] + 1, (url, widths)
            cells = pg.locator("#rejects td.path").all_inner_texts()
            for cell, r in zip(cells, rows):  # each source on a line of its own, whole
                assert cell.splitlines() == r["source"].split(";")
    finally:
        ctx.close()
        srv.shutdown()
        srv.server_close()
        srv.app.vc.close()


def test_the_first_sample_page_of_a_fresh_server_answers_without_waiting_on_model_libraries(page, caches):
    """A fresh server's first index page and first sample page, timed here: the sample page takes at
    most a few index pages' time (its tokenizer loads in the background from the start, with the
    ``tokenizers`` library: no transformers, no torch)."""
    import time
    from shards.viewer.app import App
    from shards.viewer.data import ViewedCache
    from shards.viewer.server import ViewerServer
    srv = ViewerServer(App(ViewedCache(caches["tts"])), "127.0.0.1", 0, quiet=True)
    srv.start()
    try:
        t = time.perf_counter()
        assert page.goto(srv.url).status == 200
        index_s = time.perf_counter() - t
        t = time.perf_counter()
        assert page.goto(srv.url + "sample/" + quote(index_keys(caches["tts"])[0], safe="")).status == 200
        sample_s = time.perf_counter() - t
        print(f"fresh server: first index page {index_s:.3f} s, first sample page {sample_s:.3f} s "
              f"(ratio {sample_s / index_s:.1f})")
        assert sample_s < max(2.0, 10 * index_s), (index_s, sample_s)
        assert "text by the cache's tokenizer" in page.locator(".legend").inner_text()
    finally:
        srv.shutdown()
        srv.server_close()
        srv.app.vc.close()


NETWORK_BLOCKED = """
import os, socket
_log, _connect, _resolve = os.environ["NETLOG"], socket.socket.connect, socket.getaddrinfo
LOCAL = ("127.0.0.1", "::1", "localhost")
def _refuse(what):
    with open(_log, "a") as f:
        f.write(repr(what) + "\\n")
    raise OSError(f"network blocked: {what}")
def connect(self, address, *a):
    host = address[0] if isinstance(address, tuple) else str(address)
    return _connect(self, address, *a) if host in LOCAL else _refuse(address)
def getaddrinfo(host, *a, **k):
    return _resolve(host, *a, **k) if host in LOCAL or host is None else _refuse(host)
socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo
"""


def test_with_the_network_blocked_and_viewed_from_another_folder_the_page_shows_decoded_text(page, tmp_path):
    """The cache records its tokenizer relative to the folder stage one ran in (and that folder); the
    viewer runs elsewhere, every connection but loopback refused and recorded: the page's tokens are
    the tokenizer's own decoding, and nothing tried to go online."""
    import subprocess
    import sys
    import time
    from transformers import AutoTokenizer
    from viewer_caches import TEXTS, relative_tokenizer
    cache = relative_tokenizer(tmp_path / "models", tmp_path / "cache")
    own = AutoTokenizer.from_pretrained(str(tmp_path / "models" / "higgs-text-tokenizer-tiny"))
    elsewhere, log = tmp_path / "elsewhere", tmp_path / "network.log"
    elsewhere.mkdir()
    log.write_text("")
    code = NETWORK_BLOCKED + ("\nimport sys\nfrom shardcache.cli import main\n"
                              "sys.exit(main(['shards', 'view', sys.argv[1], '--port', '0', '--quiet']))")
    env = {**os.environ, "NETLOG": str(log)}
    env.pop("HF_HUB_OFFLINE", None)  # the command sets it itself
    p = subprocess.Popen([sys.executable, "-c", code, str(cache)], cwd=elsewhere, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        p.stdout.readline()
        url = p.stdout.readline().split()[0]
        deadline = time.monotonic() + 120
        for i, text in enumerate(TEXTS):
            ids = stored(cache, f"text-{i}")[0]["input_ids"]
            while True:
                assert page.goto(url + f"sample/text-{i}").status == 200
                if "still loading" not in page.locator(".legend").inner_text() or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert page.locator(".tokens").text_content() == own.decode(
                ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
            assert page.locator(".tokens [data-label]").count() == len(ids)
        assert "fingerprint matches" in page.locator(".legend").inner_text()
        assert log.read_text() == ""
    finally:
        p.terminate()
        p.communicate(timeout=30)
