"""Encode decoded conversations into the tensors of one cached sample (see :mod:`shards.schema`).

The fields of a sample come from the job's producers (:mod:`precompute.producers`), run over one
encoder batch (so each encoder is called batched; a failing input costs only its own row,
``encode_failed``): ``input_ids``/``labels``, ``audio`` + ``audio_starts``, ``codes`` +
``audio_segments``, ``latents`` (+ ``latents_logvar``), then the ``extra_fields`` (e.g. a waveform
at another rate). A batch is encoded in three steps, so that the encoders run off the main thread
(:mod:`precompute.executor`) while the main thread does everything else:

1. :func:`start`: the producers that run an encoder are queued on the encoder thread
   (:func:`device_work`); the host-only producers (text, waveforms, segments) run at once;
2. the encoder thread queues each encoder's calls (:meth:`precompute.producers.Producer.submit`)
   and waits once for them all (one device-to-host copy per call, one wait per batch on a GPU);
3. :func:`finish`: every value is checked here, once, with its field's kind
   (:meth:`shards.kinds.FieldKind.value_check`: codes in ``[0, codebook_size)``, ids in
   ``[0, vocab_size)``, latents finite and inside float16's range) and cast to the field's storage
   dtype; a sample that breaks a check is rejected ``encode_failed`` naming the field. Before the kind's
   check, each value is checked against the field's declaration (:func:`declared_problem`: its rank, a dtype
   its storage dtype holds exactly), so a plug-in's float codes with a NaN are a reject, not a crash.
   An infrastructure fault a producer met (:mod:`precompute.faults`) is raised, never a reject. The ``json``
   member (the conversation, its audio items and images, sample rate, durations, and what
   producers add to it: the codec calls of a batched codec) is built here too.

:func:`encode_batch` runs the three steps in the calling thread (``shardcache check``, benchmarks).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from shards import fields as registry
from shards import schema
from shards.manifest import CacheManifest, FieldInfo, TextInfo

from . import producers as P
from .config import PrecomputeConfig
from .encoders import fingerprint, load_audio_tokenizer, load_image_encoder, load_text_tokenizer
from .encoders.capabilities import Capabilities, Declares, capabilities_of
from .faults import current_watch, reraise_infrastructure
from .prepare import Prepared

log = logging.getLogger("precompute")


@dataclass
class Encoders:
    """The frozen models of one job (see precompute.encoders); ``audio``/``image`` may be None.
    ``device``: the job's device (where a plug-in that declares nothing runs)."""

    audio: Any
    image: Any
    text: Any
    device: str = "cpu"

    def describe(self) -> dict[str, Any]:
        """``describe()`` of each encoder (``{"name": None}`` for an encoder the job does not use)."""
        none = {"name": None}
        return {"audio_tokenizer": self.audio.describe() if self.audio is not None else none,
                "image_encoder": self.image.describe() if self.image is not None else none,
                "text_tokenizer": self.text.describe()}

    def close(self) -> None:
        """Release what the encoders hold beyond themselves (:meth:`precompute.encoders.capabilities.Declares.close`:
        a codec's processes); a plug-in that declares nothing holds nothing of ours."""
        for enc in (self.audio, self.image, self.text):
            if isinstance(enc, Declares):
                enc.close()

    @property
    def capabilities(self) -> dict[str, Capabilities]:
        """What each media encoder declares (:func:`precompute.encoders.capabilities.capabilities_of`)."""
        return {name: capabilities_of(enc, self.device) for name, enc in
                (("audio_tokenizer", self.audio), ("image_encoder", self.image)) if enc is not None}


@dataclass
class Summary:
    """What one rank did: counts, timings, reasons.

    Where the processing time went (seconds over the loop, ``wall_s``): the encoder thread's
    ``encoder_s`` (busy: queueing its calls and waiting for them), of which ``encoder_host_s``
    queueing (Python, kernel launches) and, on CUDA, ``encoder_device_s`` between events around each
    batch; the main thread's ``receive_s`` (waiting for decoded rows), ``host_s`` (host-only
    producers, checks, the json member), ``collect_wait_s`` (waiting for the encoder thread) and
    ``writer_wait_s`` (waiting for room in the shard writer's queue)."""

    kept: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    audio_seconds: float = 0.0
    setup_s: float = 0.0   # manifest, encoder loading, fingerprint, resume scan
    wall_s: float = 0.0    # decode + encode + write, from the first batch to the last commit
    encoder_s: float = 0.0
    encoder_host_s: float = 0.0
    encoder_device_s: float = 0.0
    receive_s: float = 0.0
    host_s: float = 0.0
    collect_wait_s: float = 0.0
    writer_wait_s: float = 0.0
    decode_workers: int = 0  # decode processes the job ran (num_workers, or what auto chose)
    skipped_rows: int = 0
    shards_written: int = 0
    rerun: dict[str, int] = field(default_factory=dict)  # precompute.rerun.RerunPlan.counts()

    @property
    def encoder_busy(self) -> float:
        """Fraction of the processing wall time (``wall_s``) spent inside encoder calls."""
        return self.encoder_s / self.wall_s if self.wall_s > 0 else 0.0

    def split(self) -> dict[str, float]:
        """The timings above, rounded (seconds)."""
        return {k: round(v, 4) for k, v in dataclasses.asdict(self).items() if k in (
            "wall_s", "encoder_s", "encoder_host_s", "encoder_device_s", "receive_s", "host_s", "collect_wait_s",
            "writer_wait_s")}


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
        text=load_text_tokenizer(cfg.text_tokenizer), device=str(device))


def job_producers(cfg: PrecomputeConfig, enc: Encoders, template: str, device: str = "cpu"
                  ) -> tuple[list[P.Producer], dict[str, P.Producer]]:
    """The producers of a job, in the order they run (see :mod:`precompute.producers`), and those
    of its ``extra_fields`` by field name (also at the end of the list)."""
    out: list[P.Producer] = [P.TextProducer(enc.text, template), P.WaveformProducer("audio", cfg.sample_rate)]
    out.append(P.CodesProducer(enc.audio, device=device) if enc.audio is not None else P.SegmentsProducer())
    if enc.image is not None:
        out.append(P.LatentsProducer(enc.image, cfg.store_posterior, info=P.latents_info(cfg, enc.image), device=device))
    extra = {}
    if cfg.image_features:  # the VLM's own image encoder (Gemma 3), only when the config asks for it
        extra["image_features"] = P.load_producer({"producer": "image_features", "image_rgb": cfg.image_rgb,
                                                   **cfg.image_features}, "image_features", device)
    extra |= {name: P.load_producer(spec, name, device) for name, spec in (cfg.extra_fields or {}).items()}
    return out + list(extra.values()), extra


def job_tokens(cfg: PrecomputeConfig, producers: list[P.Producer]):
    """The job's :class:`precompute.chat.ChatTokens`: the config's, plus the image sequence a producer
    declares (:attr:`precompute.producers.Producer.image_tokens`; Gemma 3: its processor's
    ``full_image_sequence``, whose placeholder must be the config's ``image_token``). Raises
    ``ValueError`` when they disagree or two producers declare one."""
    from . import chat
    tokens = chat.ChatTokens.of(cfg)
    declared = [(p, p.image_tokens) for p in producers if p.image_tokens is not None]
    if not declared:
        return tokens
    if len(declared) > 1:
        raise ValueError(f"{len(declared)} producers ({', '.join(p.name for p, _ in declared)}) each expand the "
                         "image placeholder; one image sequence per job")
    p, seq = declared[0]
    if seq.placeholder != tokens.image:
        raise ValueError(f"{p.name}: its processor expands {seq.placeholder!r}, but image_token is {tokens.image!r}; "
                         f"set image_token: {seq.placeholder}")
    return chat.ChatTokens(tokens.image, tokens.world, seq.sequence, seq.inner)


def job_rates(producers: list[P.Producer]) -> tuple[tuple[int, frozenset[str]], ...]:
    """Every rate (Hz) the job's producers read audio at, with the item directions read at it (each
    item is resampled once from the decoded window to each of its rates, and only to those)."""
    out: dict[int, frozenset[str]] = {}
    for p in producers:
        for r in sorted(p.rates()):
            out[r] = out.get(r, frozenset()) | frozenset(p.directions)
    return tuple(out.items())


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


def _meta(p: Prepared, sample_rate: int, frame_rate: float | None) -> dict[str, Any]:
    req, conv = p.req, p.req.conversation
    speakers = list(dict.fromkeys(a.speaker for a in conv.audio if a.speaker))
    meta = {"text": conv.text, "speaker": req.speaker, "conversation": conv.to_json(),
            "audio_items": [{"source": a.source, "offset_s": a.offset_s, "duration_s": round(d, 6),
                             "direction": a.direction, "turn": a.turn, "speaker": a.speaker,
                             "orig_sample_rate": sr}
                            for a, d, sr in zip(conv.audio, p.durations, p.orig_sample_rates)],
            "images": [{"source": im.source, "turn": im.turn} for im in conv.images],
            "speakers": speakers, "sources": conv.sources,
            "sample_rate": sample_rate if conv.audio else 0, "duration_s": round(p.duration_s, 6),
            "row": req.row} | req.meta
    if conv.audio and frame_rate is not None:
        meta["frame_rate"] = float(frame_rate)
    return meta


def to_members(arrays: dict[str, Any], checks: dict[str, tuple]) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """``{field: array}`` -> ``{"FIELD.npy": array in the storage dtype}``, or ``(None, why)`` for the
    first array whose values break its field's check (see :func:`value_checks`). A producer's
    :data:`precompute.producers.base.JSON` entry is not an array and is left out."""
    members = {}
    for name, value in arrays.items():
        if name == P.JSON:
            continue
        f = registry.get(name)
        a = np.asarray(value)
        why = declared_problem(a, f) or f.kind.value_problem(a, checks.get(name))
        if why is not None:
            return None, f"{name}: {why}"
        members[f.suffix] = a.astype(f.dtype, copy=False)
    return members, None


def declared_problem(a: np.ndarray, f: Any) -> str | None:
    """Why array ``a`` cannot be stored as field ``f`` (a :class:`shards.fields.Field`) at all, before its
    kind's value check runs: another rank than the field's ``ndim``, values its storage dtype does not hold
    exactly (floats for an integer field, integers past its range, a non-numeric array). None: it can."""
    store = np.dtype(f.dtype)
    if a.ndim != f.ndim:
        return f"a {a.ndim}-D array of shape {tuple(a.shape)}, the field holds {f.ndim}-D arrays"
    if a.dtype.kind not in "biuf":
        return f"{a.dtype} values, the field stores {store}"
    if store.kind in "iu":
        if a.dtype.kind == "f":
            return f"{a.dtype} values, the field stores integers ({store})"
        if a.size and a.dtype.kind in "iu" and not np.can_cast(a.dtype, store):
            info, lo, hi = np.iinfo(store), int(a.min()), int(a.max())
            if lo < info.min or hi > info.max:
                return f"value {lo if lo < info.min else hi} outside {store}'s range [{info.min}, {info.max}]"
    return None


@dataclass
class Work:
    """One encoder batch between :func:`start` and :func:`finish`: the rows, those to encode
    (``ok``), the host-only producers' results (in producer order) and the encoder thread's future."""

    batch: list[Prepared]
    ok: list[Prepared]
    host: list[tuple[P.Producer, list]]
    future: Future

    def done(self) -> bool:
        return self.future.done()


def device_work(producers: list[P.Producer], rows: list, timer: P.Timer) -> Callable[[], list]:
    """Queue the encoder producers' work on ``rows`` (:meth:`precompute.producers.Producer.submit`, in
    producer order); return the callable that waits for it all and gives ``[(producer, results)]``.
    Runs on the encoder thread (:class:`precompute.executor.EncoderThread` calls both)."""
    watch = current_watch()  # the encoder thread's (a hang names the producer at work)

    def at(p: P.Producer) -> None:
        if watch is not None and rows:
            watch.doing = f"computing {p.name} for {len(rows)} row(s) from {rows[0].key!r}"
    pending = []
    for p in producers:
        if not p.host_only:
            at(p)
            pending.append((p, p.submit(rows, timer)))

    def wait() -> list:
        out = []
        for p, pend in pending:
            at(p)
            out.append((p, pend.result()))
        return out
    return wait


def _encodable(p: Prepared, producers: list[P.Producer]) -> bool:
    return p.error is None and not (p.req.conversation.images and not any(x.needs_images for x in producers))


def start(batch: list[Prepared], producers: list[P.Producer], submit: Callable[..., Future],
          timer: P.Timer | None = None) -> Work:
    """Step 1 (module docstring): ``submit(device_work, producers, rows, timer)`` (the encoder thread's
    ``submit``) for the rows to encode, then the host-only producers here."""
    ok = [p for p in batch if _encodable(p, producers)]
    timer = timer or P.Timer()
    future = submit(device_work, producers, ok, timer)
    host = [(prod, prod.produce(ok, timer)) for prod in producers if prod.host_only]
    return Work(batch, ok, host, future)


def finish(work: Work, producers: list[P.Producer], checks: dict[str, tuple], sample_rate: int
           ) -> list[tuple[str, dict | None, tuple | None]]:
    """Step 3 (module docstring): merge the producers' results (in producer order: a row's first
    failure is its reason), check and cast each value, build the json member; ``(key, members,
    reject)`` per row, in the batch's order (``members`` maps member names to values as
    :class:`shards.ShardWriter` takes them). Rows are rejected ``encode_failed`` when a producer failed
    on one of their items, a value breaks its field's check (e.g. latents non-finite or beyond
    float16), or a row has an image but the job has no image encoder (``image_encoder: null``)."""
    got = dict(work.host + work.future.result())
    results: dict[int, dict[str, Any] | Exception] = {id(p): {} for p in work.ok}
    for prod in producers:
        for p, r in zip(work.ok, got[prod]):
            if isinstance(results[id(p)], Exception):
                continue
            if isinstance(r, Exception):
                results[id(p)] = r
            else:
                extra = r.pop(P.JSON, None) if P.JSON in r else None
                results[id(p)].update(r)
                if extra:
                    results[id(p)].setdefault(P.JSON, {}).update(extra)
    frame_rate = next((p.manifest_info().get("frame_rate") for p in producers
                       if isinstance(p, P.CodesProducer) and "audio_segments" in p.outputs), None)
    out = []
    for p in work.batch:
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
            reraise_infrastructure(r)  # (the producers raise those; never a reject)
            out.append((key, None, (key, p.req.source, schema.ENCODE_FAILED, f"{type(r).__name__}: {r}")))
            continue
        members, why = to_members(r, checks)
        if why is not None:
            out.append((key, None, (key, p.req.source, schema.ENCODE_FAILED, why)))
            continue
        out.append((key, {"json": _meta(p, sample_rate, frame_rate) | r.get(P.JSON, {}), **members}, None))
    return out


def inline(fn: Callable[..., Callable[[], Any]], *args: Any) -> Future:
    """Run ``fn(*args)`` and what it returns in this thread: a finished :class:`Future` (the synchronous
    counterpart of :meth:`precompute.executor.EncoderThread.submit`)."""
    f: Future = Future()
    try:
        f.set_result(fn(*args)())
    except BaseException as e:  # noqa: BLE001 - re-raised by result()
        f.set_exception(e)
    return f


def encode_batch(batch: list[Prepared], producers: list[P.Producer], checks: dict[str, tuple], sample_rate: int,
                 summary: Summary) -> list[tuple[str, dict | None, tuple | None]]:
    """The three steps of the module docstring in this thread; the encoder work's wall time is added to
    ``summary.encoder_s``."""
    timer = P.Timer()

    def timed(fn, *args):
        t = time.perf_counter()
        done = fn(*args)

        def wait():
            try:
                return done()
            finally:
                summary.encoder_s += time.perf_counter() - t
        return wait

    return finish(start(batch, producers, lambda fn, *a: inline(timed, fn, *a), timer), producers, checks,
                  sample_rate)
