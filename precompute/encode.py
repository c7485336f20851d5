"""Encode decoded conversations into the tensors of one cached sample (see :mod:`shards.schema`).

The fields of a sample come from the job's producers (:mod:`precompute.producers`), run in order
over one encoder batch (so each encoder is called batched; a failing input costs only its own row,
``encode_failed``): ``input_ids``/``labels``, ``audio`` + ``audio_starts``, ``codes`` +
``audio_segments``, ``latents`` (+ ``latents_logvar``), then the ``extra_fields`` (e.g. a waveform
at another rate). Every value is checked here, once, with its field's kind
(:meth:`shards.kinds.FieldKind.value_check`: codes in ``[0, codebook_size)``, ids in
``[0, vocab_size)``, latents finite and inside float16's range) and cast to the field's storage
dtype; a sample that breaks a check is rejected ``encode_failed`` naming the field. The ``json``
member (the conversation, its audio items and images, sample rate, durations) is built here too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shards import fields as registry
from shards import schema
from shards.manifest import CacheManifest, FieldInfo, TextInfo

from . import producers as P
from .config import PrecomputeConfig
from .encoders import fingerprint, load_audio_tokenizer, load_image_encoder, load_text_tokenizer
from .prepare import Prepared

log = logging.getLogger("precompute")


@dataclass
class Encoders:
    """The frozen models of one job (see precompute.encoders); ``audio``/``image`` may be None."""

    audio: Any
    image: Any
    text: Any

    def describe(self) -> dict[str, Any]:
        """``describe()`` of each encoder (``{"name": None}`` for an encoder the job does not use)."""
        none = {"name": None}
        return {"audio_tokenizer": self.audio.describe() if self.audio is not None else none,
                "image_encoder": self.image.describe() if self.image is not None else none,
                "text_tokenizer": self.text.describe()}


@dataclass
class Summary:
    """What one rank did: counts, timings, reasons."""

    kept: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    audio_seconds: float = 0.0
    setup_s: float = 0.0   # manifest, encoder loading, fingerprint, resume scan
    wall_s: float = 0.0    # decode + encode + write, from the first batch to the last commit
    encoder_s: float = 0.0
    decode_workers: int = 0  # decode processes the job ran (num_workers, or what auto chose)
    skipped_rows: int = 0
    shards_written: int = 0
    rerun: dict[str, int] = field(default_factory=dict)  # precompute.rerun.RerunPlan.counts()

    @property
    def encoder_busy(self) -> float:
        """Fraction of the processing wall time (``wall_s``) spent inside encoder calls."""
        return self.encoder_s / self.wall_s if self.wall_s > 0 else 0.0


def load_encoders(cfg: PrecomputeConfig, device: str, dtype: str | None = None) -> Encoders:
    """Load the configured encoders; ``audio_tokenizer: null`` / ``image_encoder: null`` load nothing.

    ``dtype`` (default ``cfg.encoder_dtype``) is given to the built-in codec and VAE unless their
    spec sets ``dtype`` itself, and ``cfg.image_pixel_range`` to the built-in VAE as ``input_range``
    unless its spec sets one; plug-in factories get their own ``kwargs`` only.
    """
    from .encoders.image import PIXEL_RANGES
    dtype = dtype or cfg.encoder_dtype

    def spec(s: dict, **default: Any) -> dict:
        if "factory" in s:
            return s
        return default | (s if "dtype" in s or dtype == "float32" else dict(s, dtype=dtype))

    image_spec = spec(cfg.image_encoder, input_range=PIXEL_RANGES[cfg.image_pixel_range]) if cfg.image_encoder else None
    return Encoders(
        audio=load_audio_tokenizer(spec(cfg.audio_tokenizer), device=device) if cfg.audio_tokenizer else None,
        image=load_image_encoder(image_spec, device=device) if image_spec else None,
        text=load_text_tokenizer(cfg.text_tokenizer))


def job_producers(cfg: PrecomputeConfig, enc: Encoders, template: str, device: str = "cpu"
                  ) -> tuple[list[P.Producer], dict[str, P.Producer]]:
    """The producers of a job, in the order they run (see :mod:`precompute.producers`), and those
    of its ``extra_fields`` by field name (also at the end of the list)."""
    out: list[P.Producer] = [P.TextProducer(enc.text, template), P.WaveformProducer("audio", cfg.sample_rate)]
    out.append(P.CodesProducer(enc.audio) if enc.audio is not None else P.SegmentsProducer())
    if enc.image is not None:
        out.append(P.LatentsProducer(enc.image, cfg.store_posterior, info=P.latents_info(cfg, enc.image)))
    extra = {}
    if cfg.image_features:  # the VLM's own image encoder (Gemma 3), only when the config asks for it
        extra["image_features"] = P.load_producer({"producer": "image_features", "image_rgb": cfg.image_rgb,
                                                   **cfg.image_features}, "image_features", device)
    extra |= {name: P.load_producer(spec, name, device) for name, spec in (cfg.extra_fields or {}).items()}
    return out + list(extra.values()), extra


def job_tokens(cfg: PrecomputeConfig, extra: dict[str, P.Producer]):
    """The job's :class:`precompute.chat.ChatTokens`: the config's, plus the image sequence of an
    ``image_features`` producer (Gemma 3: its processor's ``full_image_sequence``, whose placeholder
    must be the config's ``image_token``). Raises ``ValueError`` when they disagree."""
    from . import chat
    tokens = chat.ChatTokens.of(cfg)
    p = extra.get("image_features")
    enc = getattr(p, "encoder", None)
    if enc is None or not getattr(enc, "image_sequence", None):
        return tokens
    if enc.boi_token != tokens.image:
        raise ValueError(f"image_features: {cfg.image_features.get('pretrained')}'s processor expands "
                         f"{enc.boi_token!r}, but image_token is {tokens.image!r}; set image_token: {enc.boi_token}")
    inner = tuple(t for t in (enc.image_token, enc.eoi_token) if t)
    return chat.ChatTokens(tokens.image, tokens.world, enc.image_sequence, inner)


def job_rates(producers: list[P.Producer]) -> tuple[int, ...]:
    """Every rate (Hz) the job's producers read audio at (each is resampled once from the decoded window)."""
    return tuple(dict.fromkeys(r for p in producers for r in sorted(p.rates())))


def job_info(producers: list[P.Producer], extra: dict[str, P.Producer], text: Any) -> CacheManifest:
    """What ``manifest.json`` records about the job's fields: the built-in producers' facts at the
    top level (codec sizes, latent channels), each extra field's in ``fields`` (its producer's
    description and facts), the text vocabulary. Also what the value checks read while writing."""
    info: dict[str, Any] = {}
    for p in producers:
        if not isinstance(p, P.WaveformProducer) and p not in extra.values():
            info.update(p.manifest_info())
    man = CacheManifest.from_dict(info)
    man.text = TextInfo(vocab_size=int(text.vocab_size), pad_id=int(text.pad_id))
    for name, p in extra.items():
        man.fields[name] = FieldInfo.from_dict({"fingerprint": fingerprint(p.describe(), preprocessing={"field": name}),
                                                "encoder": p.describe(),
                                                "sidecar": False, "kind": registry.get(name).kind.name,
                                                "members": list(p.outputs), **p.manifest_info()})
    return man


def value_checks(producers: list[P.Producer], info: CacheManifest) -> dict[str, tuple]:
    """field -> the check of its kind in this job (see :meth:`shards.kinds.FieldKind.value_check`)."""
    out = {}
    for p in producers:
        for name in p.outputs:
            f = registry.get(name)
            check = f.kind.value_check(f, info)
            if check is not None:
                out[name] = check
    return out


@dataclass
class Pipeline:
    """Everything encoding a manifest row needs, built once per job (:meth:`build`): the encoders,
    the resolved chat template, the producers (and those of ``extra_fields``), the audio rates they
    read, the value checks, and the job's fingerprint. ``shardcache precompute`` runs it over the
    manifest; ``shardcache check`` over a few rows to compare with a cache."""

    cfg: PrecomputeConfig
    device: str
    enc: Encoders
    template: str
    tokens: Any
    added: dict[str, int]
    producers: list
    extra: dict
    rates: tuple[int, ...]
    info: CacheManifest
    checks: dict[str, tuple]
    fingerprint: str
    describe: dict[str, Any]
    source_images: bool = False  #: a producer gives decoded images to a model's own processor

    @classmethod
    def build(cls, cfg: PrecomputeConfig, device: str, requests: list | None = None) -> "Pipeline":
        """Load the encoders on ``device`` and derive the rest (hashes every weight once). With the
        job's ``requests``, the special tokens their conversations need are checked first (added to
        the text tokenizer when ``add_missing_tokens``; :func:`precompute.chat.ensure_tokens`), so
        the fingerprint describes the tokenizer the job renders with."""
        from . import chat
        enc = load_encoders(cfg, device)
        template = chat.resolve_template(cfg.chat_template, enc.text)
        producers, extra = job_producers(cfg, enc, template, device)
        tokens = job_tokens(cfg, extra)
        added: dict[str, int] = {}  # tokens the job needs and the tokenizer lacked
        convs = [r.conversation for r in requests or [] if r.conversation is not None]
        if convs:
            added = chat.ensure_tokens(enc.text, chat.needed_kinds(convs), tokens, cfg.add_missing_tokens)
            if added:
                log.info("added %s to the text tokenizer (vocab_size %d): resize the LM's embeddings", added,
                         enc.text.vocab_size)
        info = job_info(producers, extra, enc.text)
        encoders = enc.describe()
        preprocessing = cfg.preprocessing()
        if extra:  # the producers' own identity, beside the extra_fields options (precompute.identity)
            preprocessing["extra_field_producers"] = {name: p.describe() for name, p in extra.items()}
        return cls(cfg, device, enc, template, tokens, added, producers, extra, job_rates(producers), info,
                   value_checks(producers, info), fingerprint(*encoders.values(), preprocessing=preprocessing),
                   encoders | {"preprocessing": preprocessing},
                   any(hasattr(p, "image_sequence") for p in producers))

    @property
    def image_multiple(self) -> int:
        """Pixels per latent cell of the image encoder (8 without one: images are then rejected anyway)."""
        return int(self.enc.image.spatial_factor) if self.enc.image is not None else 8

    def prepare(self, req: Any, chunk: int = 0) -> Prepared:
        """Decode one manifest row (see :func:`precompute.prepare.prepare`)."""
        from .prepare import prepare
        return prepare(req, chunk, self.cfg, self.rates, self.enc.text, self.template, self.image_multiple,
                       self.tokens, self.source_images)

    def encode(self, batch: list[Prepared], summary: "Summary") -> list[tuple[str, dict | None, tuple | None]]:
        """:func:`encode_batch` with this pipeline's producers and checks."""
        return encode_batch(batch, self.producers, self.checks, self.cfg, summary, self.device)


def _meta(p: Prepared, cfg: PrecomputeConfig, frame_rate: float | None) -> dict[str, Any]:
    req, conv = p.req, p.req.conversation
    speakers = list(dict.fromkeys(a.speaker for a in conv.audio if a.speaker))
    meta = {"text": conv.text, "speaker": req.speaker, "conversation": conv.to_json(),
            "audio_items": [{"source": a.source, "offset_s": a.offset_s, "duration_s": round(d, 6),
                             "direction": a.direction, "turn": a.turn, "speaker": a.speaker,
                             "orig_sample_rate": sr}
                            for a, d, sr in zip(conv.audio, p.durations, p.orig_sample_rates)],
            "images": [{"source": im.source, "turn": im.turn} for im in conv.images],
            "speakers": speakers, "sources": conv.sources,
            "sample_rate": cfg.sample_rate if conv.audio else 0, "duration_s": round(p.duration_s, 6),
            "row": req.row} | req.meta
    if conv.audio and frame_rate is not None:
        meta["frame_rate"] = float(frame_rate)
    return meta


def to_members(arrays: dict[str, Any], checks: dict[str, tuple]) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """``{field: array}`` -> ``{"FIELD.npy": array in the storage dtype}``, or ``(None, why)`` for the
    first array whose values break its field's check (see :func:`value_checks`)."""
    members = {}
    for name, value in arrays.items():
        f = registry.get(name)
        a = np.asarray(value)
        why = f.kind.value_problem(a, checks.get(name))
        if why is not None:
            return None, f"{name}: {why}"
        members[f.suffix] = a.astype(f.dtype, copy=False)
    return members, None


def encode_batch(batch: list[Prepared], producers: list[P.Producer], checks: dict[str, tuple],
                 cfg: PrecomputeConfig, summary: Summary, device: str) -> list[tuple[str, dict | None, tuple | None]]:
    """Run the producers over the good rows of a batch; return ``(key, members, reject)`` per row,
    in input order (``members`` maps member names to values as :class:`shards.ShardWriter` takes
    them). Rows are rejected ``encode_failed`` when a producer fails on one of their items, a value
    breaks its field's check (e.g. latents non-finite or beyond float16), or a row has an image but
    the job has no image encoder (``image_encoder: null``)."""
    timer = P.Timer(device)
    ok = [p for p in batch if p.error is None and not (p.req.conversation.images and not _has_images(producers))]
    results: dict[int, dict[str, Any] | Exception] = {id(p): {} for p in ok}
    for prod in producers:
        live = [p for p in ok if not isinstance(results[id(p)], Exception)]
        for p, r in zip(live, prod.produce(live, timer)):
            if isinstance(r, Exception):
                results[id(p)] = r
            else:
                results[id(p)].update(r)
    summary.encoder_s += timer.seconds
    frame_rate = next((p.manifest_info().get("frame_rate") for p in producers
                       if isinstance(p, P.CodesProducer) and "audio_segments" in p.outputs), None)
    out = []
    for p in batch:
        key = p.req.key
        if p.error is not None:
            out.append((key, None, (key, p.req.source, p.error[0], p.error[1])))
            continue
        r = results.get(id(p))
        if r is None:
            out.append((key, None, (key, p.req.source, schema.ENCODE_FAILED,
                                    f"row has {len(p.req.conversation.images)} image(s) but the job has no image "
                                    "encoder (image_encoder: null)")))
            continue
        if isinstance(r, Exception):
            out.append((key, None, (key, p.req.source, schema.ENCODE_FAILED, f"{type(r).__name__}: {r}")))
            continue
        members, why = to_members(r, checks)
        if why is not None:
            out.append((key, None, (key, p.req.source, schema.ENCODE_FAILED, why)))
            continue
        out.append((key, {"json": _meta(p, cfg, frame_rate), **members}, None))
    return out


def _has_images(producers: list[P.Producer]) -> bool:
    return any(p.needs_images for p in producers)
