"""What each page of the viewer shows, as plain values for its template (``templates/*.html``).

The templates only lay these values out: every text from the cache or its manifest reaches the
page through Jinja2's autoescape, every link is built here with :func:`href` (path segments
percent-encoded), and nothing here reads a file but through :class:`~.data.ViewedCache`.

A sample's media are addressed by key and position, never by path (:mod:`.app` serves them):
``/sample/KEY/audio/FIELD/K.wav``, ``/sample/KEY/codes/FIELD/K.png``,
``/sample/KEY/latents/FIELD/K/C.png``, ``/sample/KEY/image/K.png``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import numpy as np

from .. import fields as registry
from ..commands._common import SCALAR_COLUMNS, fmt_bytes, to_jsonable
from ..commands.samples import _dtype_name
from ..schema import WHOLE_MEMBER_DTYPES
from ..kinds import BF16_BITS, LATENTS, WAVEFORM
from ..tokens import IGNORE_INDEX
from .data import PAGE_SIZE, Page, Sample, View, ViewedCache
from .media import polyline, token_norms
from .tokens import WORKING_DIR_KEY, TokenText

#: what a cached audio item's ``direction`` is called on the page (Higgs-Audio's in/out tokens)
DIRECTIONS = {"in": "input", "out": "output"}
#: on-screen height of one codebook's row of the codes image (pixels), and the width the frames of
#: an item share (each frame 2 to 24 pixels wide; the page caps the width at the item's)
CODEBOOK_PX, CODES_WIDTH_PX = 12, 480
#: size of the image features' norm plot (pixels)
SPARK_W, SPARK_H = 640, 64


def href(*segments: Any, **query: Any) -> str:
    """A site path from ``segments`` (each percent-encoded whole: a key holding ``/`` or ``..``
    stays one segment) and a query string of the non-empty ``query`` values."""
    path = "/" + "/".join(quote(str(s), safe="") for s in segments)
    q = {k: v for k, v in query.items() if v not in (None, "", 0)}
    return path + ("?" + urlencode(q) if q else "")


def _seconds(v: Any) -> str:
    return "-" if v is None else f"{float(v):.2f} s"


def _shape(shape: Any) -> str:
    return " x ".join(str(int(d)) for d in shape) if shape else "()"


# ------------------------------------------------------------------------------------------- header

def header(vc: ViewedCache) -> dict[str, Any]:
    """The facts of the page header: the cache's name, source, samples, rejects and id, and who
    writes the cache right now (``writer``: said on every page; None when nobody does)."""
    src = vc.source.rstrip("/")
    return dict(name=src.rsplit("/", 1)[-1] or src, source=src, samples=len(vc), rejected=vc.rejects.num_rows,
                id=vc.id, writer=vc.writer())


# -------------------------------------------------------------------------------------------- index

def _encoder_line(enc: Any) -> str:
    """``name (Class)`` of an ``encoders`` entry (the class without its module)."""
    if not isinstance(enc, dict):
        return json.dumps(to_jsonable(enc), ensure_ascii=False) if enc is not None else "-"
    head = str(enc.get("name") or "")
    if enc.get("class"):
        cls = str(enc["class"]).rsplit(".", 1)[-1]
        head = f"{head} ({cls})" if head else cls
    return head or json.dumps(to_jsonable(enc), ensure_ascii=False)[:200]


def summary(vc: ViewedCache) -> list[dict[str, Any]]:
    """The manifest's encoders and preprocessing, in four cards: the cache, audio, images, text."""
    c, m = vc.facts, vc.manifest
    config = m.config if isinstance(m.config, dict) else {}
    encoders = m.encoders if isinstance(m.encoders, dict) else {}
    pre = encoders.get("preprocessing") if isinstance(encoders.get("preprocessing"), dict) else {}
    cards = [dict(title="Cache", rows=[
        ("source", vc.source), ("cache id", c.id), ("samples", f"{len(vc):,}"),
        ("shards", f"{len(m.shards or []):,}"), ("rejected", f"{vc.rejects.num_rows:,}"),
        ("created", m.created or "-"), ("fingerprint", (m.fingerprint or "-")[:24]),
        ("format version", m.format_version)])]
    audio: list[tuple[str, Any]] = []
    codec = c.codec
    if codec is not None:
        audio += [("codec", _encoder_line(encoders.get("audio_tokenizer"))),
                  ("codes", f"{codec.n_codebooks} codebooks x {codec.codebook_size}, {codec.frame_rate:g} frames/s"),
                  ("codec input", f"{codec.sample_rate:,} Hz" if codec.sample_rate else "-")]
        if codec.bandwidth is not None:
            audio.append(("bandwidth", f"{codec.bandwidth:g} kbps"))
    waves = m.waveforms if isinstance(m.waveforms, dict) else {}
    for name, info in waves.items():
        info = info if isinstance(info, dict) else {}
        rate, dirs = info.get("sample_rate"), info.get("directions")
        audio.append((f"waveform {name}", (f"{rate:,} Hz" if isinstance(rate, int) else "?") + " int16"
                      + (f", items {', '.join(DIRECTIONS.get(d, str(d)) for d in dirs)}" if isinstance(dirs, list) else "")))
    if not waves and m.sample_rate:
        audio.append(("sample rate", f"{m.sample_rate:,} Hz"))
    cards.append(dict(title="Audio", rows=audio or [("audio", "none: no codec ran")]))
    images: list[tuple[str, Any]] = []
    preset = c.image
    if preset is not None:
        images += [("image encoder", _encoder_line(encoders.get("image_encoder"))),
                   ("preset", f"{preset.size} px, {preset.resize}, rgb {preset.rgb}, pixels {preset.pixel_range}"),
                   ("latent channels", preset.latent_channels)]
    fe = c.feature_encoder
    if fe is not None:
        images.append(("image features", f"{fe.name}: {fe.tokens_per_image} tokens x {fe.hidden_size} per image"))
    cards.append(dict(title="Images", rows=images or [("images", "none: no image encoder ran")]))
    text = m.text
    tok_spec = config.get("text_tokenizer")
    cards.append(dict(title="Text", rows=[
        ("tokenizer", _encoder_line(encoders.get("text_tokenizer"))),
        ("loaded from", (tok_spec or {}).get("pretrained") or (tok_spec or {}).get("name") or "-"
         if isinstance(tok_spec, dict) else "-"),
        ("template", (text.template if text is not None else None) or config.get("chat_template") or "-"),
        ("label policy", config.get("label_policy") or "-"),
        ("vocab size", f"{c.vocab_size:,}" if c.vocab_size else "-"), ("pad id", c.pad_id),
        ("special tokens", len(text.special_token_ids) if text is not None else 0)],
        more=[(k, json.dumps(to_jsonable(v), ensure_ascii=False) if not isinstance(v, str) else v)
              for k, v in sorted(pre.items())], more_title="preprocessing (what the fingerprint covers)"))
    return cards


#: the grid's columns: (title, the index column it sorts by or None, css class)
GRID = (("#", None, "num"), ("key", "key", ""), ("text", None, "text"), ("media", None, "media"),
        ("duration", "duration_s", "num"), ("tokens", "n_text_tokens", "num"), ("trained", None, "num"),
        ("speaker", "speaker", ""), ("fields", None, "fields"))
#: size of one histogram (pixels)
HIST_W, HIST_H = 260, 72


def _share(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.0f} %"


def _sort_href(view: View, col: str) -> str:
    """The link of a sortable column's title: sorted by it ascending, or, when it is already, descending."""
    desc = view.sort == col and not view.desc
    return href(**{**view.params(), "sort": col, "desc": 1 if desc else None})


def _bars(h: dict[str, Any]) -> dict[str, Any]:
    """A histogram as SVG bars: ``[{x, y, w, h, title}]`` in a ``HIST_W x HIST_H`` box."""
    if not h["counts"]:
        return dict(h, bars=[], width=HIST_W, height=HIST_H)
    top = max(h["counts"]) or 1
    n = len(h["counts"])
    w = HIST_W / n
    unit = "" if h["name"] != "duration_s" else " s"
    fmt = (lambda v: f"{100 * v:.0f} %") if h["name"] == "trained_share" else (lambda v: f"{v:.4g}{unit}")
    bars = [dict(x=round(i * w, 2), w=round(max(w - 1, 1), 2), h=round((HIST_H - 2) * c / top, 2),
                 y=round(HIST_H - (HIST_H - 2) * c / top, 2),
                 title=f"{fmt(h['edges'][i])} to {fmt(h['edges'][i + 1])}: {c:,} sample(s)")
            for i, c in enumerate(h["counts"])]
    return dict(h, bars=bars, width=HIST_W, height=HIST_H, lo=fmt(h["edges"][0]), hi=fmt(h["edges"][-1]),
                median_text=fmt(h["median"]))


def index(vc: ViewedCache, page: Page, view: View, error: str | None, notice: str | None, rejects: Page,
          page_no: int, rejects_no: int, histograms: list[dict] | None) -> dict[str, Any]:
    """The context of ``index.html``: the manifest's cards, the histograms of the view, one page of
    its samples (the grid), one page of rejects."""
    rows = []
    for i, r in enumerate(page.rows):
        key, m = r["key"], r["media"]
        audio = href("sample", key, "audio", "audio", f"{m['audio']}.wav") if m["audio"] is not None else None
        rows.append(dict(
            position=page.start + i + 1, row=r["row"], key=key,
            href=href("sample", key, **view.params(), page=page_no if page_no > 1 else None),
            lines=r["lines"], audio=audio, audio_item=m["audio"],
            thumb=href("sample", key, "thumb.png") if m["image"] else None,
            duration=_seconds(r["duration_s"]) if r["duration_s"] else "-", tokens=r.get("n_text_tokens") or 0,
            trained=_share(r["trained_share"]), shard=r["shard"], speaker=r["speaker"] or "",
            fields=[(n, "\u00d7".join(str(int(d)) for d in s) if s else "()") for n, s in r["fields"]]))
    page_view = dict(rows=rows, start=page.start, total=page.total, number=page.number, pages=page.pages)
    params = view.params()
    columns = [dict(title=t, cls=c, href=_sort_href(view, col) if col else None,
                    sorted=("descending" if view.desc else "ascending") if col and view.sort == col else None)
               for t, col, c in GRID]
    return dict(
        title=header(vc)["name"], cache=header(vc), summary=summary(vc), page=page_view, view=view, error=error,
        notice=notice, columns=[c for c in SCALAR_COLUMNS], grid=columns, rejects=rejects,
        reject_rows=[dict(r, sources=[x for x in str(r.get("source") or "").split(";") if x]) for r in rejects.rows],
        reject_counts=vc.reject_counts(), histograms=[_bars(h) for h in histograms] if histograms else None,
        hidden=[(k, v) for k, v in params.items() if v is not None and k not in ("where", "q")],
        page_box=dict(name="page", anchor="", hidden=[(k, v) for k, v in params.items() if v is not None]),
        clear_href=href(), prev_href=href(**params, page=page_no - 1) if page_no > 1 else None,
        next_href=href(**params, page=page_no + 1) if page_no < page.pages else None,
        rejects_prev_href=href(**params, page=page_no, rejects=rejects_no - 1) + "#rejects" if rejects_no > 1 else None,
        rejects_next_href=href(**params, page=page_no, rejects=rejects_no + 1) + "#rejects"
        if rejects_no < rejects.pages else None)


# ------------------------------------------------------------------------------------------- sample

def fields_of_kind(s: Sample, kind) -> list[str]:
    """The sample's fields whose declared kind is ``kind`` (:mod:`shards.fields`), in member order."""
    return [name for name in s.arrays if (f := registry.lookup(name)) is not None and f.kind is kind]


def item_bounds(s: Sample, wave_field: str) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each item of waveform ``wave_field`` (its ``<field>_starts`` offsets;
    one item when there are none)."""
    pcm, starts = s.arrays[wave_field], s.arrays.get(f"{wave_field}_starts")
    if starts is None or len(starts) < 2:
        return [(0, len(pcm))]
    b = [int(x) for x in starts]
    return list(zip(b[:-1], b[1:]))


def tokens(s: Sample, text: TokenText) -> list[dict[str, Any]]:
    """One entry per ``input_ids`` token: text (or None: ids only), id, label, trained, special and
    which media item a placeholder stands for."""
    ids = s.arrays.get("input_ids")
    if ids is None:
        return []
    labels = s.arrays.get("labels")
    labels = labels if labels is not None and len(labels) == len(ids) else np.full(len(ids), IGNORE_INDEX)
    pieces = text.pieces(ids)
    out = []
    for i, (t, lab) in enumerate(zip(ids.tolist(), labels.tolist())):
        name = text.names.get(t)
        out.append(dict(id=t, label=lab, trained=lab != IGNORE_INDEX, special=text.is_special(t),
                        text=pieces[i] if pieces is not None else (name or str(t)), item=None, anchor=None))
    return out


def source_path(vc: ViewedCache, source: str) -> Path:
    """A media source as recorded in a sample's json: absolute, or relative to the folder of the
    manifest stage one read (``manifest.json`` ``source_manifest``; itself relative to the folder
    stage one ran in, ``working_dir``, where the cache records one)."""
    p = Path(source)
    sm = vc.manifest.source_manifest
    if p.is_absolute() or not sm:
        return p
    base = Path(sm).parent
    wd = vc.manifest.to_dict().get(WORKING_DIR_KEY)
    if not base.is_absolute() and isinstance(wd, str) and wd:
        base = Path(wd) / base
    return base / p


def audio(vc: ViewedCache, s: Sample) -> tuple[list[dict], str | None, list[dict]]:
    """The cached audio items (``json`` ``audio_items``, in order), with a player where the waveform
    is cached and the codes of each item; a note when the sample's items have no waveform; the other
    waveform fields (``audio_16k``...) with a player per item."""
    meta_items = s.meta.get("audio_items") if isinstance(s.meta.get("audio_items"), list) else []
    sr = int(s.row.get("sample_rate") or s.meta.get("sample_rate") or vc.manifest.sample_rate or 0)
    has_wave = "audio" in s.arrays and sr > 0
    bounds = item_bounds(s, "audio") if has_wave else []
    segs = s.arrays.get("audio_segments")
    codes = s.arrays.get("codes")
    n = max(len(meta_items), len(bounds))
    items, note = [], None
    if meta_items and not has_wave:
        note = ("no waveform cached: this cache was made without waveforms (or the sample lost them), so there is "
                "nothing to play; the codes are what the model trains on")
    for k in range(n):
        it = meta_items[k] if k < len(meta_items) and isinstance(meta_items[k], dict) else {}
        seg = segs[k].tolist() if segs is not None and k < len(segs) else None
        direction = DIRECTIONS.get(str(it.get("direction") or ""), str(it.get("direction") or "item"))
        facts = [("turn", it.get("turn", seg[1] if seg else "-")), ("speaker", it.get("speaker") or "-"),
                 ("offset", _seconds(it.get("offset_s") or 0.0))]
        entry = dict(k=k, direction=direction, facts=facts, source=str(it.get("source") or ""), src=None,
                     reason="no waveform cached for this item", codes_src=None, cached_duration=None,
                     trained=None)
        if has_wave and k < len(bounds):
            a, b = bounds[k]
            entry["cached_duration"] = f"{(b - a) / sr:.6f}"
            entry["facts"].append(("cached", f"{(b - a) / sr:.2f} s at {sr:,} Hz"))
            entry["src"] = href("sample", s.key, "audio", "audio", f"{k}.wav")
        if codes is not None and codes.ndim == 2:
            start, frames = (int(seg[3]), int(seg[4])) if seg else (0, codes.shape[1])
            if frames > 0:
                entry.update(codes_src=href("sample", s.key, "codes", "codes", f"{k}.png"),
                             codes_shape=f"{codes.shape[0]} x {frames}", codes_height=codes.shape[0] * CODEBOOK_PX,
                             codes_width=frames * max(2, min(24, CODES_WIDTH_PX // frames)),
                             codes_caption=f"codes: {codes.shape[0]} codebooks x {frames} frames "
                                           f"(frames {start}..{start + frames} of the sample)")
        items.append(entry)
    extra = []
    for name in fields_of_kind(s, WAVEFORM):
        if name == "audio":
            continue
        rate = _extra_rate(vc, name)
        extra.append(dict(field=name, note=f"{rate:,} Hz" if rate else "sample rate not recorded", items=[
            dict(k=k, src=href("sample", s.key, "audio", name, f"{k}.wav") if rate else None,
                 duration=f"{(b - a) / rate:.2f} s" if rate else f"{b - a} samples",
                 cached_duration=f"{(b - a) / rate:.6f}" if rate else None)
            for k, (a, b) in enumerate(item_bounds(s, name))]))
    extra = [w for w in extra if all(it["src"] for it in w["items"])]
    return items, note, extra


def _extra_rate(vc: ViewedCache, name: str) -> int | None:
    """The sample rate (Hz) of waveform field ``name`` as ``manifest.json`` records it (``waveforms``)."""
    waves = vc.manifest.waveforms if isinstance(vc.manifest.waveforms, dict) else {}
    info = waves.get(name)
    rate = info.get("sample_rate") if isinstance(info, dict) else None
    return int(rate) if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0 else None


def images(vc: ViewedCache, s: Sample, source_ok) -> list[dict]:
    """Each image of the conversation: as stage one saw it (when its source is reachable:
    ``source_ok(path) -> None or why not``), its latents channel by channel, its features' norms."""
    metas = s.meta.get("images") if isinstance(s.meta.get("images"), list) else []
    lat_fields = fields_of_kind(s, LATENTS)
    feat_fields = fields_of_kind(s, BF16_BITS)
    n = max([len(metas)] + [s.arrays[f].shape[1] for f in lat_fields if s.arrays[f].ndim == 4]
            + [s.arrays[f].shape[0] for f in feat_fields if s.arrays[f].ndim == 3])
    preset = vc.facts.image
    out = []
    for k in range(n):
        meta = metas[k] if k < len(metas) and isinstance(metas[k], dict) else {}
        source = str(meta.get("source") or "")
        why = source_ok(source_path(vc, source)) if source else "the sample's json names no source for it"
        entry = dict(k=k, source=source, src=None if why else href("sample", s.key, "image", f"{k}.png"),
                     reason=f"source not shown: {why}" if why else None,
                     caption=(f"as stage one gave it to the encoder: {preset.size} px, {preset.resize}, rgb {preset.rgb}"
                              if preset is not None else "as stage one decoded it"),
                     latents=[], features=None)
        for f in lat_fields:
            a = s.arrays[f]
            if a.ndim != 4 or k >= a.shape[1]:
                continue
            x = a[:, k].astype(np.float32)
            entry["latents"].append(dict(field=f, channels=[
                dict(c=c, src=href("sample", s.key, "latents", f, str(k), f"{c}.png")) for c in range(a.shape[0])],
                caption=f"{f}[:, {k}]: {a.shape[0]} channels x {a.shape[2]} x {a.shape[3]} cells, "
                        f"values {float(np.nanmin(x)):.3g} .. {float(np.nanmax(x)):.3g} "
                        f"(each channel on its own scale, blue < 0 < red)"))
        for f in feat_fields:
            a = s.arrays[f]
            if a.ndim != 3 or k >= a.shape[0]:
                continue
            norms = token_norms(BF16_BITS.from_storage(a[k:k + 1]))[0]
            entry["features"] = dict(
                field=f, width=SPARK_W, height=SPARK_H, points=polyline(norms, SPARK_W, SPARK_H),
                top=f"{float(norms.max()):.3g}", bottom=f"{float(norms.min()):.3g}",
                caption=f"[{k}]: {a.shape[1]} tokens x {a.shape[2]} hidden (bfloat16); L2 norm per token "
                        f"min {float(norms.min()):.3g}, mean {float(norms.mean()):.3g}, max {float(norms.max()):.3g}")
        out.append(entry)
    return out


def sample(vc: ViewedCache, s: Sample, text: TokenText, view: View, page_no: int | None, nav: dict | None,
           source_ok) -> dict[str, Any]:
    """The context of ``sample.html``: ``nav`` (:meth:`ViewedCache.neighbours`) gives next/previous
    in ``view``'s order, and the link back to the index page the sample was opened from."""
    toks = tokens(s, text)
    items, note, extra = audio(vc, s)
    _mark_placeholders(vc, toks, items)
    r = s.row
    facts = [("shard", r.get("shard"))]
    facts += [("duration", _seconds(r["duration_s"]))] if r.get("duration_s") else []
    facts += [("speaker", r["speaker"])] if r.get("speaker") else []
    facts += [("bytes", fmt_bytes(r.get("bytes"))), ("index row", f"{s.position + 1:,} of {len(vc):,}")]
    params = view.params()
    walk = None
    if nav is not None and nav["position"] is not None:
        walk = dict(position=nav["position"] + 1, total=nav["total"], filtered=not view.is_all,
                    prev=href("sample", nav["prev"], **params) if nav["prev"] is not None else None,
                    next=href("sample", nav["next"], **params) if nav["next"] is not None else None)
        page_no = nav["position"] // PAGE_SIZE + 1
    back = href(**params, page=page_no if page_no and page_no > 1 else None)
    return dict(
        title=s.key, cache=header(vc), s=s, back=back, walk=walk, facts=facts, tokens=toks,
        n_trained=sum(1 for t in toks if t["trained"]), has_text=text.has_text, token_note=text.how,
        audio=items, audio_note=note, extra_audio=extra, images=images(vc, s, source_ok),
        members=[dict(m, shape=_shape(m["shape"]) if m["dtype"] not in WHOLE_MEMBER_DTYPES else "-",
                      dtype=_dtype_name(m["dtype"])) for m in s.members],
        json_text=json.dumps(to_jsonable(s.meta), indent=2, ensure_ascii=False))


def _mark_placeholders(vc: ViewedCache, toks: list[dict], items: list[dict]) -> None:
    """Link each ``<|AUDIO|>`` / ``<|AUDIO_OUT|>`` token to the audio item it stands for (the k-th
    such token is item k: docs/format.md), and mark an item trained when its token carries a label."""
    from ..tokens import AUDIO_IN, AUDIO_OUT
    ids = {vc.facts.token_id(AUDIO_IN), vc.facts.token_id(AUDIO_OUT)} - {None}
    k = 0
    for t in toks:
        if t["id"] in ids:
            if k < len(items):
                t["item"] = f"audio item {k} ({items[k]['direction']})"
                t["anchor"] = f"#audio-{k}"
                items[k]["trained"] = t["trained"]
            k += 1


__all__ = ["href", "header", "summary", "index", "sample", "tokens", "audio", "images", "item_bounds",
           "fields_of_kind", "source_path", "DIRECTIONS", "GRID"]
