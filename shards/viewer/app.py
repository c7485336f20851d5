"""Routes a request to a response (:class:`App`); no sockets here (:mod:`.server` serves it, tests
call :meth:`App.respond` directly).

Routes (GET or HEAD; any other method is 405, nothing is ever written)::

    /                                       the index: ?where=SQL&q=TEXT&sort=COL&desc=1&page=N&rejects=N
    /sample/KEY                             one sample (the same query: next/previous walk that view)
    /sample/KEY/audio/FIELD/K.wav           item K of waveform FIELD, as stored (16-bit PCM WAV)
    /sample/KEY/codes/FIELD/K.png           the codes of audio item K (codebooks x frames)
    /sample/KEY/latents/FIELD/K/C.png       channel C of image K's latents
    /sample/KEY/image/K.png                 image K from its source, as stage one resized it
    /sample/KEY/thumb.png                   a small picture of image 0 (its source, else its latents)
    /static/NAME                            the stylesheet and the icon (a fixed list of names)
    /favicon.ico                            the icon

Before any route, :func:`.guard.refusal` refuses (403) a request from another site or origin, or
with a ``Host`` that is not the viewer's. Path segments are percent-decoded one by one; a segment
``.`` or ``..``, a backslash or a NUL, an unknown route, a key the index does not hold, a field the
sample does not hold (or not of the route's kind) and an item out of range are all 404. Files are
never named by a request: a key is looked up in the index, and everything served for it is read by
:class:`~.data.ViewedCache` or derived from what it read; a source image is read only at the path
the sample's own json records, and decoded as an image (never sent as bytes).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

from .. import fields as registry
from ..commands._common import UsageError
from ..commands.query import QueryCancelled
from ..errors import ShardcacheError
from ..kinds import CODES, LATENTS, WAVEFORM
from . import images as imaging
from . import media, pages
from .data import PAGE_SIZE, Page, Sample, TextNotReady, View, ViewedCache
from .guard import SECURITY_HEADERS, refusal
from .tokens import TokenTextLoader

#: the files of ``static/`` the viewer serves, with their content types
STATIC = {"style.css": "text/css; charset=utf-8", "favicon.svg": "image/svg+xml"}
HTML = "text/html; charset=utf-8"
#: seconds a sample page waits for the tokenizer's background load before it shows ids (and says so)
TOKENIZER_WAIT_S = 1.0


@dataclass
class Response:
    """``status`` (HTTP code), ``body`` (bytes), ``content_type``, extra ``headers``."""

    status: int
    body: bytes
    content_type: str = HTML
    headers: dict[str, str] = field(default_factory=dict)


class NotFoundError(Exception):
    """The request names nothing the viewer serves (answered 404 with the reason)."""


class App:
    """The viewer of one :class:`~.data.ViewedCache` (see the module docstring). The cache's text
    tokenizer starts loading in the background now (:class:`~.tokens.TokenTextLoader`).

    Args:
        vc: the cache.
        allowed_hosts: the ``Host`` names answered (:func:`.guard.allowed_names`; the server sets
            them); None: no ``Host`` is checked (the app called directly, no socket).
    """

    def __init__(self, vc: ViewedCache, allowed_hosts: frozenset[str] | None = None):
        import jinja2

        self.vc = vc
        self.allowed_hosts = allowed_hosts
        self.env = jinja2.Environment(loader=jinja2.PackageLoader("shards.viewer", "templates"),
                                      autoescape=True, undefined=jinja2.StrictUndefined,
                                      trim_blocks=True, lstrip_blocks=True)
        self.token_text = TokenTextLoader(vc.manifest)
        self._pre: dict | None = None
        self._pre_error: str | None = None
        self._lock = threading.Lock()

    # -- entry point ---------------------------------------------------------------------------------
    def respond(self, method: str, target: str, headers: dict[str, str] | None = None,
                gone: Callable[[], threading.Event] | None = None) -> Response:
        """The response to ``method target`` (``target``: the request line's path and query).
        ``gone()``: an event set when the client leaves (:class:`.server.ClientWatch`), asked for
        only by a request that runs a filter condition."""
        try:
            return self._respond(method, target, headers, gone)
        finally:
            self.vc.serving.set()  # the first page is out: the background work may start

    def _respond(self, method: str, target: str, headers: dict[str, str] | None, gone) -> Response:
        h = {k.lower(): v for k, v in (headers or {}).items()}
        why = refusal(h, self.allowed_hosts)
        if why is not None:  # a bare page: nothing of the cache (its name, id, size) goes to another origin
            return Response(403, f"403 Forbidden: {why}\n".encode(), "text/plain; charset=utf-8")
        if method not in ("GET", "HEAD"):
            return self._error(405, "Method Not Allowed", f"{method}: the viewer only reads (GET)",
                               {"Allow": "GET, HEAD"})
        try:
            parts = urlsplit(target)
            segments = self._segments(parts.path)
            query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
            return self._route(segments, query, gone)
        except NotFoundError as e:
            return self._error(404, "Not Found", str(e))
        except QueryCancelled:  # nobody reads this: the client is gone
            return self._error(503, "Client Gone", "the request was given up by its client")
        except ShardcacheError as e:  # damaged shard bytes, an unsafe name: said, not served
            return self._error(500, "Cache Error", str(e))
        except OSError as e:  # a remote cache's download that failed, a shard that went away
            return self._error(502 if self.vc.remote is not None else 500, "Read Error", f"{type(e).__name__}: {e}")

    @staticmethod
    def _segments(path: str) -> list[str]:
        if "\\" in path or not path.startswith("/"):
            raise NotFoundError("not a path of this viewer")
        segments = [unquote(s) for s in path[1:].split("/")]
        if segments == [""]:
            return []
        if any(s in ("", ".", "..") or "\0" in s for s in segments):
            raise NotFoundError("not a path of this viewer")
        return segments

    def _route(self, seg: list[str], query: dict[str, str], gone) -> Response:
        if not seg:
            return self.index(query, gone)
        if seg == ["favicon.ico"]:
            seg = ["static", "favicon.svg"]
        if seg[0] == "static" and len(seg) == 2 and seg[1] in STATIC:
            body = (resources.files("shards.viewer") / "static" / seg[1]).read_bytes()
            return Response(200, body, STATIC[seg[1]])
        if seg[0] == "sample" and len(seg) >= 2:
            s = self.vc.sample(seg[1])
            if s is None:
                raise NotFoundError(f"no sample {seg[1]!r} in {self.vc.source}'s index")
            rest = seg[2:]
            if not rest:
                return self.sample(s, query, gone)
            kind, args = rest[0], rest[1:]
            if kind == "audio" and len(args) == 2:
                return self.audio(s, args[0], _number(args[1], ".wav"))
            if kind == "codes" and len(args) == 2:
                return self.codes(s, args[0], _number(args[1], ".png"))
            if kind == "latents" and len(args) == 3:
                return self.latents(s, args[0], _number(args[1], ""), _number(args[2], ".png"))
            if kind == "image" and len(args) == 1:
                return self.image(s, _number(args[0], ".png"))
            if kind == "thumb.png" and not args:
                return self.thumb(s)
        raise NotFoundError("no such page")

    # -- pages ---------------------------------------------------------------------------------------
    def render(self, template: str, status: int = 200, **context: Any) -> Response:
        return Response(status, self.env.get_template(template).render(**context).encode())

    def index(self, query: dict[str, str], gone) -> Response:
        page_no, rejects_no = _page_no(query.get("page")), _page_no(query.get("rejects"))
        error, notice, status, hist = None, None, 200, None
        try:
            view = View.of(query)
        except UsageError as e:
            view, error, status = View(where=(query.get("where") or "").strip()), str(e), 400
        event = gone() if gone is not None and view.where else None
        page = Page([], 0, 0, PAGE_SIZE)
        if error is None:
            try:
                page = self.vc.page((page_no - 1) * PAGE_SIZE, PAGE_SIZE, view, event)
                if not page.rows and page_no > page.pages:  # past the end: the last page
                    page_no = page.pages
                    page = self.vc.page((page_no - 1) * PAGE_SIZE, PAGE_SIZE, view, event)
                hist = self.vc.histograms(view, event) if self.vc.index.ready else None
            except UsageError as e:
                error, status = str(e), 400
            except TextNotReady as e:
                notice = str(e)
        rejects = self.vc.rejects_page((rejects_no - 1) * PAGE_SIZE, PAGE_SIZE)
        if not rejects.rows and rejects_no > rejects.pages:
            rejects_no = rejects.pages
            rejects = self.vc.rejects_page((rejects_no - 1) * PAGE_SIZE, PAGE_SIZE)
        ctx = pages.index(self.vc, page, view, error, notice, rejects, page_no, rejects_no, hist)
        return self.render("index.html", status, **ctx)

    def sample(self, s: Sample, query: dict[str, str], gone) -> Response:
        page_no = _page_no(query.get("page")) if query.get("page") else None
        nav = None
        try:
            view = View.of(query)
            nav = self.vc.neighbours(s.key, view, gone() if gone is not None and view.where else None)
        except (UsageError, TextNotReady):  # a view that cannot be walked: the page without next/previous
            view = View()
        ctx = pages.sample(self.vc, s, self.token_text.get(TOKENIZER_WAIT_S), view=view, page_no=page_no, nav=nav,
                           source_ok=self.source_problem)
        return self.render("sample.html", **ctx)

    def _error(self, status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> Response:
        try:
            body = self.env.get_template("error.html").render(
                title=f"{status} {reason}", cache=pages.header(self.vc), status=status, reason=reason,
                message=message).encode()
        except Exception:  # noqa: BLE001 - an error page must not fail in turn
            body = f"{status} {reason}".encode()
        return Response(status, body, HTML, dict(headers or {}))

    # -- media ---------------------------------------------------------------------------------------
    def _field(self, s: Sample, name: str, kind) -> Any:
        f = registry.lookup(name)
        if f is None or f.kind is not kind or name not in s.arrays:
            raise NotFoundError(f"sample {s.key!r} has no {kind.name} field {name!r}")
        return s.arrays[name]

    def audio(self, s: Sample, name: str, k: int) -> Response:
        pcm = self._field(s, name, WAVEFORM)
        bounds = pages.item_bounds(s, name)
        if k >= len(bounds):
            raise NotFoundError(f"sample {s.key!r}: {name} has {len(bounds)} item(s), no item {k}")
        rate = int(s.row.get("sample_rate") or 0) if name == "audio" else (pages._extra_rate(self.vc, name) or 0)
        if rate <= 0:
            raise NotFoundError(f"sample {s.key!r}: the sample rate of {name} is not recorded")
        a, b = bounds[k]
        return Response(200, media.wav(pcm[a:b], rate), "audio/wav")

    def codes(self, s: Sample, name: str, k: int) -> Response:
        codes = self._field(s, name, CODES)
        segs = s.arrays.get("audio_segments") if name == "codes" else None
        if segs is not None and len(segs):
            if k >= len(segs):
                raise NotFoundError(f"sample {s.key!r} has {len(segs)} audio item(s), no item {k}")
            start, frames = int(segs[k][3]), int(segs[k][4])
            part = codes[:, start:start + frames]
        elif k == 0:
            part = codes
        else:
            raise NotFoundError(f"sample {s.key!r}: {name} has one item")
        if part.size == 0:
            raise NotFoundError(f"sample {s.key!r}: audio item {k} has no code frames")
        size = self.vc.manifest.codebook_size_of(name)
        return Response(200, media.codes_png(part, size), "image/png")

    def latents(self, s: Sample, name: str, k: int, c: int) -> Response:
        lat = self._field(s, name, LATENTS)
        if lat.ndim != 4 or k >= lat.shape[1] or c >= lat.shape[0]:
            raise NotFoundError(f"sample {s.key!r}: {name} {tuple(lat.shape)} has no image {k} channel {c}")
        return Response(200, media.channel_png(lat[c, k]), "image/png")

    def _source(self, s: Sample, k: int):
        """Image ``k`` of sample ``s`` from its source, as stage one resized it (uint8 RGB)."""
        metas = s.meta.get("images") if isinstance(s.meta.get("images"), list) else []
        if k >= len(metas) or not isinstance(metas[k], dict) or not metas[k].get("source"):
            raise NotFoundError(f"sample {s.key!r} has no image {k} with a source")
        path = pages.source_path(self.vc, str(metas[k]["source"]))
        why = self.source_problem(path)
        if why:
            raise NotFoundError(f"image {k} of {s.key!r}: {why}")
        try:
            return imaging.source_image(path, self._preprocessing())
        except imaging.ImageProblem as e:  # the source changed into something unreadable
            raise NotFoundError(f"image {k} of {s.key!r}: {e}") from None

    def image(self, s: Sample, k: int) -> Response:
        return Response(200, media.rgb_png(self._source(s, k)), "image/png")

    def thumb(self, s: Sample) -> Response:
        """Image 0 from its source, small; where the source is not reachable, channel 0 of its latents."""
        try:
            return Response(200, imaging.thumbnail_png(self._source(s, 0)), "image/png")
        except NotFoundError:
            lat = next((s.arrays[f] for f in pages.fields_of_kind(s, LATENTS) if s.arrays[f].ndim == 4), None)
            if lat is None or not lat.shape[1]:
                raise
            return Response(200, media.channel_png(lat[0, 0]), "image/png")

    def _preprocessing(self) -> dict:
        """The image preprocessing the cache records (:func:`.images.preprocessing`), read once."""
        with self._lock:
            if self._pre is None and self._pre_error is None:
                try:
                    self._pre = imaging.preprocessing(self.vc.manifest.config)
                except imaging.ImageProblem as e:
                    self._pre_error = str(e)
            if self._pre is None:
                raise NotFoundError(self._pre_error)
            return self._pre

    def source_problem(self, path: os.PathLike | str) -> str | None:
        """None when a source image can be shown, else why not (not reachable from here, or the
        preprocessing is not recorded)."""
        if not os.path.isfile(path):
            return f"{path} is not reachable from this machine"
        try:
            self._preprocessing()
        except NotFoundError as e:
            return str(e)
        return None


def _number(segment: str, suffix: str) -> int:
    """``"3.wav"`` -> 3 (``suffix`` ``.wav``): a non-negative decimal integer, else :class:`NotFoundError`."""
    body = segment[: len(segment) - len(suffix)] if suffix and segment.endswith(suffix) else (segment if not suffix else "")
    if not body.isascii() or not body.isdigit() or len(body) > 9:
        raise NotFoundError(f"{segment!r} is not an item of this viewer")
    return int(body)


def _page_no(value: str | None) -> int:
    """A page number from the query (1-based; anything else is 1)."""
    return int(value) if value and value.isascii() and value.isdigit() and 0 < len(value) < 10 and int(value) > 0 else 1


__all__ = ["App", "Response", "NotFoundError", "STATIC", "SECURITY_HEADERS", "TOKENIZER_WAIT_S"]
