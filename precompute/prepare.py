"""Decode one manifest row (a conversation) into model inputs (runs in DataLoader worker processes).

A :class:`Prepared` holds every audio item's waveform at the rates the job reads for it (an item
gets the rates of the producers that read its direction: the 16 kHz copy a Whisper-style field
keeps of input items is not made for output items), every image on the VAE grid (and as the
image features' encoder takes it, :attr:`Prepared.model_images`) and the rendered
``input_ids``/``labels``, or the reason the row was rejected. Each distinct audio file is opened
once, whatever number of items (windows) of the conversation use it. Decoding never raises for a
bad sample: the error travels with the row to the shard's rejects part.

Out of memory while decoding (:class:`MemoryError`) is the one exception that is not always the row's. Decoding
a row is bounded by the configured limits: each audio item by ``max_duration`` seconds of frames (from its
header, or counted as it streams), the row by ``max_total_duration_s`` and ``max_audio_items``, each image by
``max_image_pixels`` (from its header), all checked before their frames are decoded. A row within them that
runs out of memory says the host is short of it (too many decode workers for its memory, another process's
use), not that the row is bad: rejecting it would reject the good rows after it one by one. So a
``MemoryError`` on a row within the limits is an infrastructure fault (:class:`precompute.faults.DeviceFault`,
``host memory``): the job stops (exit 1) naming the decode worker and the row, nothing is rejected, and the
same command run again (with fewer ``num_workers``, or on a host with the memory) completes the cache. The
limits bound seconds and pixels, not the width of a frame: a row is beyond them, and its ``MemoryError`` its own
fault (rejected ``unreadable_audio``, naming the header), when one of its audio files' headers declares frames
wider than :data:`MAX_SAMPLE_RATE` Hz x :data:`MAX_CHANNELS` channels (a broken or hostile header asking for
gigabytes within ``max_duration``). :func:`oversized_frames` reads that from the headers.

One object decodes: :class:`Preparer`, built once by the job (:meth:`precompute.job.Job.build`)
from the config's decode options and what the job's producers declare, picklable, called in the
decode workers (:class:`PrepareDataset`) and wherever else a row is decoded (``shardcache check``,
the precision check, the worker-count probe).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from shards import schema
from shards.errors import CorruptSample

from . import chat
from .audio import header, header_seconds, load_audio_windows
from .config import MAX_SAMPLE_RATE, PrecomputeConfig
from .faults import DeviceFault, kind_of
from .images import decode_image, load_image
from .manifests import Request

#: the most channels of an audio frame a row within the limits decodes (with :data:`MAX_SAMPLE_RATE` Hz, the
#: highest rate an option takes): a header declaring wider frames makes a MemoryError the row's fault
MAX_CHANNELS = 64


@dataclass
class Prepared:
    """Decoded inputs of one row.

    ``audio``: one ``{rate Hz: float32 (n,)}`` per audio item of the conversation (in order);
    ``durations``: seconds per item; ``images``: uint8 ``(H, W, 3)`` per image item on the VAE grid;
    ``model_images``: per image item, what the job's ``image_input`` (a producer's declared image
    preprocessing: Gemma 3's resize) made of the decoded image, only when a producer declares one;
    ``input_ids``/``labels``: int32 ``(L,)`` (:func:`precompute.chat.render`);
    ``calls``: codec calls recorded for this row (``shardcache check`` sets them; empty at stage one);
    ``error``: ``(reason, detail)`` when the row is rejected; ``fault``: ``(kind, what, message)`` of an
    infrastructure fault met decoding it in a decode worker (:func:`precompute.faults.kind_of`; out of host memory
    on a row within the limits, see the module docstring), never a reject: the main process raises it
    (:func:`precompute.slots.unpack`).
    """

    req: Request
    chunk: int
    audio: list[dict[int, np.ndarray]] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    orig_sample_rates: list[int] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)
    model_images: list[np.ndarray] = field(default_factory=list)
    input_ids: np.ndarray | None = None
    labels: np.ndarray | None = None
    error: tuple[str, str] | None = None
    calls: dict[str, list] = field(default_factory=dict)
    fault: tuple[str, str, str] | None = None

    @property
    def duration_s(self) -> float:
        return float(sum(self.durations))

    @property
    def key(self) -> str:
        return self.req.key

    @property
    def conversation(self):
        """The row's :class:`precompute.conversation.Conversation` (what producers read)."""
        return self.req.conversation


def _decode_audio(req: Request, rates: tuple[tuple[int, frozenset[str]], ...], cfg: "DecodeOptions",
                  out: Prepared) -> None:
    items = req.conversation.audio
    need = [tuple(r for r, dirs in rates if it.direction in dirs) for it in items]  # each item's rates
    by_source: dict[object, list[int]] = {}
    for k, it in enumerate(items):  # one open per distinct file (raw bytes: per item)
        by_source.setdefault(it.source if it.data is None else ("raw", k), []).append(k)
    results: list = [None] * len(items)
    for src, ks in by_source.items():
        first = items[ks[0]]
        union = tuple(r for r, _ in rates if any(r in need[k] for k in ks))  # one file in both directions: both
        got = load_audio_windows(first.data if first.data is not None else first.source,
                                 [(items[k].offset_s, items[k].duration_s) for k in ks], union,
                                 min_duration=cfg.min_duration, max_duration=cfg.max_duration,
                                 silence_rms=cfg.silence_rms)
        for k, r in zip(ks, got):
            if isinstance(r, CorruptSample):
                raise CorruptSample(r.reason, f"audio item {k}: {r.detail}" if len(items) > 1 else r.detail,
                                    r.source)
            waves, duration, sr = r
            results[k] = ({rate: waves[rate] for rate in need[k]}, duration, sr)  # only what is read
        decoded = sum(r[1] for r in results if r is not None)
        if decoded > cfg.max_total_duration_s:  # lengths no header gave: stop at the first file past the cap
            raise _too_large("seconds of audio", round(decoded, 3), cfg.max_total_duration_s, "max_total_duration_s")
    for waves, duration, sr in results:
        out.audio.append(waves)
        out.durations.append(duration)
        out.orig_sample_rates.append(sr)


def _too_large(what: str, n: float, cap: float, option: str) -> CorruptSample:
    return CorruptSample(schema.TOO_LARGE, f"{what} {n:g}, more than {option} {cap:g} per sample")


def check_caps(conv, cfg: "DecodeOptions | PrecomputeConfig") -> None:
    """The caps per sample, before any decoding: ``max_audio_items``, ``max_images`` and
    ``max_total_duration_s`` over what is known of each audio item's length: the duration the row
    gives, else the file's length from its header (:func:`precompute.audio.header_seconds`, read
    once per file, for rows of two or more such items) less the item's offset. Raises
    :class:`CorruptSample` (``too_large``) naming the cap; items whose length no header gives, and
    a row's single item (its decode is bounded by ``max_duration`` from its own header read), are
    counted as they are decoded (:func:`_decode_audio`)."""
    if len(conv.audio) > cfg.max_audio_items:
        raise _too_large("audio items", len(conv.audio), cfg.max_audio_items, "max_audio_items")
    if len(conv.images) > cfg.max_images:
        raise _too_large("images", len(conv.images), cfg.max_images, "max_images")
    given = sum(a.duration_s for a in conv.audio if a.duration_s is not None)
    if given > cfg.max_total_duration_s:
        raise _too_large("seconds of audio", given, cfg.max_total_duration_s, "max_total_duration_s")
    unknown = [a for a in conv.audio if a.duration_s is None and a.data is None]
    if len(unknown) < 2:  # one file: the decoder checks max_duration from its own header read, and the
        return            # total after it (no second open of every file of a plain dataset)
    lengths: dict[str, float | None] = {}
    total = given
    for a in unknown:
        if a.source not in lengths:
            lengths[a.source] = header_seconds(a.source)
        if lengths[a.source] is not None:
            total += max(0.0, lengths[a.source] - a.offset_s)
            if total > cfg.max_total_duration_s:
                raise _too_large("seconds of audio (from the files' headers, before decoding)", round(total, 3),
                                 cfg.max_total_duration_s, "max_total_duration_s")


@dataclass(frozen=True)
class DecodeOptions:
    """The config's options that decoding reads (see :class:`precompute.config.PrecomputeConfig` for
    each): duration bounds and silence, the image policy and guards, the per-sample caps, the label policy."""

    min_duration: float
    max_duration: float
    silence_rms: float | None
    image_size: int
    image_resize: str
    image_rgb: str
    max_image_pixels: int
    min_image_side: int
    max_text_tokens: int
    max_audio_items: int
    max_total_duration_s: float
    max_images: int
    label_policy: str

    @classmethod
    def of(cls, cfg: PrecomputeConfig) -> "DecodeOptions":
        """The decode options of ``cfg`` (a field here for each option of the same name there)."""
        values = vars(cfg)
        return cls(**{f.name: values[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class Preparer:
    """Decodes manifest rows for one job: ``preparer(req, chunk) -> Prepared`` (see :meth:`__call__`).

    Built once per job (:meth:`precompute.job.Job.build`) and picklable (decode workers).

    Attributes:
        options: :class:`DecodeOptions`.
        rates: ``((rate Hz, directions), ...)``: each rate the job's producers read and the audio items
            (by direction) they read it of, in the order the producers run.
        text: the text tokenizer; ``template``: the resolved chat template; ``tokens``: the
            :class:`precompute.chat.ChatTokens` (the job's: Gemma 3's image sequence when
            ``image_features`` is set).
        image_multiple: pixels per latent cell of the VAE (images are sized to a multiple of it).
        image_input: a producer's declared image preprocessing (``uint8 (H, W, 3) -> array``, Gemma 3's
            resize) run on each decoded image into :attr:`Prepared.model_images`, or None.
    """

    options: DecodeOptions
    rates: tuple[tuple[int, frozenset[str]], ...]
    text: Any
    template: str = "llama3"
    tokens: "chat.ChatTokens | None" = None
    image_multiple: int = 8
    image_input: Callable[[np.ndarray], Any] | None = None

    def __call__(self, req: Request, chunk: int = 0) -> Prepared:
        """Decode ``req``; a :class:`CorruptSample` (or any decoder crash) becomes ``Prepared.error``.

        The caps per sample (``max_audio_items``, ``max_images``, ``max_total_duration_s``,
        ``max_text_tokens``) reject a row as ``too_large``: counts and seconds before any decoding
        (:func:`check_caps`: seconds from the row and the files' headers; seconds no header gives as
        each file is decoded), tokens after rendering the conversation."""
        cfg = self.options
        out = Prepared(req=req, chunk=chunk)
        if req.error:
            out.error = req.error
            return out
        conv = req.conversation
        stage = schema.ENCODE_FAILED  # reason for an unexpected crash, by the step that crashed
        try:
            check_caps(conv, cfg)
            # rendered first: a row without targets (no_targets) or past max_text_tokens is rejected before decoding
            out.input_ids, out.labels = chat.render(conv, self.text, self.template, self.tokens or chat.ChatTokens(),
                                                    cfg.label_policy)
            if len(out.input_ids) > cfg.max_text_tokens:
                raise _too_large("text tokens", len(out.input_ids), cfg.max_text_tokens, "max_text_tokens")
            stage = schema.UNREADABLE_AUDIO
            if conv.audio:
                _decode_audio(req, self.rates, cfg, out)
                if out.duration_s > cfg.max_total_duration_s:
                    raise _too_large("seconds of audio", round(out.duration_s, 3), cfg.max_total_duration_s,
                                     "max_total_duration_s")
            stage = schema.IMAGE_UNREADABLE
            for im in conv.images:
                decoded = decode_image(im.source, max_pixels=cfg.max_image_pixels, min_side=cfg.min_image_side,
                                       rgb=cfg.image_rgb)  # once, for the VAE grid and the model's processor
                out.images.append(load_image(im.source, cfg.image_size, mode=cfg.image_resize,
                                             multiple=self.image_multiple, max_pixels=cfg.max_image_pixels,
                                             min_side=cfg.min_image_side, rgb=cfg.image_rgb, decoded=decoded))
                if self.image_input is not None:
                    out.model_images.append(self.image_input(np.asarray(decoded, dtype=np.uint8)))
            if len({a.shape for a in out.images}) > 1:
                raise CorruptSample(schema.MALFORMED_ROW, f"{len(out.images)} images of different sizes in one "
                                    "conversation (image_resize: bucket); use center_crop or pad", conv.images[0].source)
        except CorruptSample as e:
            out.error = (e.reason, e.detail)
            out.audio, out.images, out.model_images, out.input_ids, out.labels = [], [], [], None, None
        except MemoryError as e:  # the host's fault on a row within the limits (module docstring)
            out.audio, out.images, out.model_images, out.input_ids, out.labels = [], [], [], None, None
            wide = oversized_frames(req)
            if wide is not None:  # the row's own header asks for more than the limits bound
                out.error = (schema.UNREADABLE_AUDIO, f"{type(e).__name__}: {e} ({wide})")
                return out
            fault = self.out_of_memory(req, e)
            if get_worker_info() is None:  # decoding in this process: the job stops here
                raise fault from e
            out.fault = (kind_of(fault), fault.what, str(fault))
        except Exception as e:  # a decoder bug must cost one sample, not the job
            out.error = (stage, f"{type(e).__name__}: {e}")
            out.audio, out.images, out.model_images, out.input_ids, out.labels = [], [], [], None, None
        return out

    def out_of_memory(self, req: Request, e: MemoryError) -> DeviceFault:
        """The :class:`~precompute.faults.DeviceFault` of a ``MemoryError`` decoding ``req``, a row within the limits
        (the module docstring), naming the decode worker (or this process), the row and the limits."""
        info = get_worker_info()
        what = f"decode worker {info.id}" if info is not None else "the decoding process"
        cfg = self.options
        return DeviceFault("host memory", (
            f"{what} (pid {os.getpid()}) ran out of host memory decoding row {req.key!r} ({req.source}), a row "
            f"within the configured limits (max_duration {cfg.max_duration:g} s per audio item, max_total_duration_s "
            f"{cfg.max_total_duration_s:g}, max_image_pixels {cfg.max_image_pixels}, frames of at most "
            f"{MAX_SAMPLE_RATE} Hz x {MAX_CHANNELS} channels): the host is short of memory, not the row bad "
            f"({type(e).__name__}: {e}); run the same command again with fewer num_workers or more memory"))


def oversized_frames(req: Request) -> str | None:
    """What makes row ``req`` beyond the limits where they bound no byte (the module docstring): the first audio
    file whose header declares frames wider than :data:`MAX_SAMPLE_RATE` Hz x :data:`MAX_CHANNELS` channels, said in
    words (None: every header within them, or unreadable: decoding said why)."""
    seen = set()
    for it in req.conversation.audio if req.conversation is not None else ():
        src = it.source if it.data is None else None
        if src in seen and src is not None:
            continue
        seen.add(src)
        info = header(bytes(it.data) if it.data is not None else it.source)
        if info is None:
            continue
        if info.samplerate > MAX_SAMPLE_RATE or info.channels > MAX_CHANNELS:
            return (f"{it.source if it.data is None else 'raw audio'}: its header declares frames of "
                    f"{info.samplerate} Hz x {info.channels} channels, more than the {MAX_SAMPLE_RATE} Hz x "
                    f"{MAX_CHANNELS} channels a row within the limits decodes")
    return None


class PrepareDataset(Dataset):
    """Map-style dataset over ``[(request, chunk)]`` returning :class:`Prepared` (use ``collate_fn=list``)."""

    def __init__(self, items: list[tuple[Request, int]], preparer: Preparer):
        self.items, self.preparer = items, preparer

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Prepared:
        return self.preparer(*self.items[i])


def identity_collate(batch: list[Prepared]) -> list[Prepared]:
    """``collate_fn`` that keeps the list of :class:`Prepared` as is."""
    return batch
