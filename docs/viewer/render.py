"""Render docs/viewer/*.png (the README's and docs/viewer.md's screenshots) with Playwright and the
system's Chromium, from the demo cache and, with real-mini, the viewer tests' two caches::

    make precompute                                   # cache/demo
    .venv/bin/python docs/viewer/render.py            # viewer-index.png, viewer-demo.png
    SHARDCACHE_REAL_MINI=../shared/data/real-mini .venv/bin/python docs/viewer/render.py --real-mini
                                                      # + viewer-audio.png, viewer-image.png

Each page is served by an in-process viewer on 127.0.0.1 (a fresh side-table folder in a temporary
directory) and shot at 1280 px wide, the whole page up to ``--max_height`` pixels, saved with 256 colours.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "viewer"
CHROMIUM = os.environ.get("SHARDCACHE_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def serve(cache: Path):
    from shards.viewer.app import App
    from shards.viewer.data import ViewedCache
    from shards.viewer.server import ViewerServer
    app = App(ViewedCache(cache))
    app.vc.text.wait(120)
    app.token_text.wait(120)
    srv = ViewerServer(app, "127.0.0.1", 0, quiet=True)
    srv.start()
    return srv


def shoot(browser, url: str, path: Path, max_height: int, scroll_to: str | None = None) -> None:
    ctx = browser.new_context(viewport={"width": 1280, "height": max_height})  # lazy images of the shot load
    page = ctx.new_page()
    page.goto(url)
    page.wait_for_load_state("networkidle")
    page.evaluate("""() => {
        const shown = [...document.images].filter(i => i.getBoundingClientRect().top < innerHeight);
        const loaded = shown.map(i => i.complete ? 0 : new Promise(r => { i.onload = r; i.onerror = r; }));
        return Promise.race([new Promise(r => setTimeout(r, 10000)), Promise.all(loaded)]);
    }""")
    height = min(max_height, page.evaluate("document.documentElement.scrollHeight"))
    clip_y = page.evaluate(f"document.querySelector({scroll_to!r}).getBoundingClientRect().top + scrollY") if scroll_to else 0
    page.screenshot(path=str(path), clip={"x": 0, "y": clip_y, "width": 1280, "height": height}, full_page=True)
    ctx.close()
    from PIL import Image  # 256 colours, no dithering: a third of the bytes, the same picture to the eye
    Image.open(path).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT,
                                             dither=Image.Dither.NONE).save(path, optimize=True)
    print(f"wrote {path.relative_to(ROOT)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", type=Path, default=ROOT / "cache" / "demo", help="the demo cache (make precompute)")
    ap.add_argument("--real-mini", action="store_true", help="also the voice-cloning and LLaVA pages (needs real-mini)")
    ap.add_argument("--max_height", type=int, default=1150)
    args = ap.parse_args(argv)
    from playwright.sync_api import sync_playwright
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SHARDCACHE_VIEWER_CACHE"] = tmp
        servers = [serve(args.demo)]
        pages = [(servers[0].url, OUT / "viewer-index.png", None),
                 (servers[0].url + "sample/img-astronaut", OUT / "viewer-demo.png", None)]
        if args.real_mini:
            sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
            from viewer_caches import llava, voice_clone
            real = Path(os.environ.get("SHARDCACHE_REAL_MINI", ROOT.parent / "shared" / "data" / "real-mini"))
            tts = serve(voice_clone(real, Path(tmp) / "models", Path(tmp) / "tts"))
            vlm = serve(llava(real, Path(tmp) / "models", Path(tmp) / "vlm"))
            servers += [tts, vlm]
            import pyarrow.parquet as pq
            key = lambda c: pq.read_table(c / "index.parquet", columns=["key"]).column("key")[1].as_py()  # noqa: E731
            pages += [(tts.url + "sample/" + key(Path(tmp) / "tts"), OUT / "viewer-audio.png", None),
                      (vlm.url + "sample/" + key(Path(tmp) / "vlm"), OUT / "viewer-image.png", None)]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            for url, path, anchor in pages:
                shoot(browser, url, path, args.max_height, anchor)
            browser.close()
        for s in servers:
            s.shutdown()
            s.server_close()
            s.app.vc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
