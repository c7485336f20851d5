"""Encode decoded conversations into the tensors of one cached sample (see :mod:`shards.schema`).

Per sample (a conversation with ``n`` audio items and ``m`` images):

* ``codes.npy`` int16 ``(n_codebooks, F)``: every audio item's codes concatenated along frames
  (Higgs-Audio's ``audio_ids_concat``), when the job has an audio tokenizer;
* ``audio_segments.npy`` int32 ``(n, 6)``: ``[item, turn, direction (0 in / 1 out), code_start,
  code_frames, speaker]`` per audio item (``audio_ids_start`` plus what the trainer needs);
* ``audio.npy`` int16 ``(T,)`` every item's waveform at ``sample_rate`` concatenated and
  ``audio_starts.npy`` int32 ``(n + 1,)`` offsets (``audio_waveforms_concat``/``_start``); the
  same for each ``extra_waveforms`` field (items of the other direction have length 0; a sample
  with no item of that field's direction has no such member);
* ``latents.npy`` float16 ``(C, m, H/8, W/8)``: image ``k`` is ``latents[:, k]``;
* ``input_ids.npy`` / ``labels.npy`` int32 ``(L,)`` (:mod:`precompute.chat`); ``json``.

The encoders run batched over the rows of one encoder batch: the codec over every audio item
(clip by clip unless configured otherwise, see :mod:`precompute.encoders.audio`), the VAE over
every image grouped by size. A failing input costs only its own row (``encode_failed``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shards import schema

from .audio import to_pcm16
from .config import PrecomputeConfig
from .encoders import load_audio_tokenizer, load_image_encoder, load_text_tokenizer
from .prepare import Prepared

DIRECTIONS = {"in": 0, "out": 1}


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
    skipped_rows: int = 0
    shards_written: int = 0

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


def _timed(summary: Summary, device: str, fn, *args):
    """Run an encoder call and add its duration (device-synchronised) to ``summary.encoder_s``."""
    t = time.perf_counter()
    out = fn(*args)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    summary.encoder_s += time.perf_counter() - t
    return out


def _encode_each(fn, inputs: list, summary: Summary, device: str) -> list:
    """Encode a batch; if the batch fails, encode one by one so a bad input costs only itself."""
    if not inputs:
        return []
    try:
        return list(_timed(summary, device, fn, inputs))
    except Exception:
        outs = []
        for x in inputs:
            try:
                outs.append(_timed(summary, device, fn, [x])[0])
            except Exception as e:
                outs.append(e)
        return outs


def _concat_waves(p: Prepared, rate: int, directions: set[str]) -> tuple[np.ndarray, np.ndarray]:
    """int16 concatenation of the selected items at ``rate`` and int32 ``(n + 1,)`` offsets."""
    items = p.req.conversation.audio
    waves = [to_pcm16(w[rate]) if it.direction in directions else np.zeros(0, np.int16)
             for it, w in zip(items, p.audio)]
    starts = np.concatenate([[0], np.cumsum([len(w) for w in waves])]).astype(np.int32)
    return (np.concatenate(waves) if waves else np.zeros(0, np.int16)), starts


def waveform_fields(cfg: PrecomputeConfig) -> dict[str, tuple[int, set[str]]]:
    """Waveform fields of the job: name -> (sample_rate, directions stored)."""
    out = {"audio": (int(cfg.sample_rate), {"in", "out"})}
    for name, spec in (cfg.extra_waveforms or {}).items():
        d = spec.get("direction", "all")
        out[name] = (int(spec["sample_rate"]), {"in", "out"} if d == "all" else {d})
    return out


def _meta(p: Prepared, cfg: PrecomputeConfig, enc: Encoders) -> dict[str, Any]:
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
    if conv.audio and enc.audio is not None:
        meta["frame_rate"] = float(enc.audio.frame_rate)
    return meta


def encode_batch(batch: list[Prepared], enc: Encoders, cfg: PrecomputeConfig, summary: Summary,
                 device: str) -> list[tuple[str, dict | None, tuple | None]]:
    """Encode the good rows of a batch; return ``(key, fields, reject)`` per row, in input order.

    ``fields`` maps member names to values as :class:`shards.ShardWriter` takes them (see the
    module docstring). Rows are rejected (``encode_failed``) when an encoder fails on one of their
    items, when latents are non-finite or overflow float16 (``|x| > 65000``), or when a row has
    an image but the job has no image encoder (``image_encoder: null``).
    """
    ok = [p for p in batch if p.error is None]
    items = [(p, k) for p in ok for k in range(len(p.audio))] if enc.audio is not None else []
    codes = _encode_each(enc.audio.encode, [p.audio[k][enc.audio.sample_rate] for p, k in items],
                         summary, device) if items else []
    codes_of: dict[tuple[int, int], Any] = {(id(p), k): c for (p, k), c in zip(items, codes)}
    latents_of: dict[tuple[int, int], Any] = {}
    if enc.image is not None:
        by_shape: dict[tuple, list[tuple[Prepared, int]]] = {}
        for p in ok:
            for k, img in enumerate(p.images):
                by_shape.setdefault(img.shape, []).append((p, k))
        if cfg.store_posterior:  # one (mean, logvar) pair per image
            fn = lambda imgs: list(zip(*enc.image.encode_posterior(np.stack(imgs))))  # noqa: E731
        else:
            fn = lambda imgs: list(enc.image.encode(np.stack(imgs)))  # noqa: E731
        for group in by_shape.values():
            for (p, k), z in zip(group, _encode_each(fn, [p.images[k] for p, k in group], summary, device)):
                latents_of[(id(p), k)] = z
    out = []
    for p in batch:
        fields, error = (None, p.error) if p.error is not None else _sample(p, enc, cfg, codes_of, latents_of)
        if error is not None:
            out.append((p.req.key, None, (p.req.key, p.req.source, error[0], error[1])))
        else:
            out.append((p.req.key, fields, None))
    return out


def _sample(p: Prepared, enc: Encoders, cfg: PrecomputeConfig, codes_of: dict, latents_of: dict
            ) -> tuple[dict | None, tuple[str, str] | None]:
    conv = p.req.conversation
    if conv.images and enc.image is None:
        return None, (schema.ENCODE_FAILED, f"row has {len(conv.images)} image(s) but the job has no image "
                                            "encoder (image_encoder: null)")
    produced = [codes_of.get((id(p), k)) for k in range(len(p.audio))] + \
               [latents_of.get((id(p), k)) for k in range(len(p.images))]
    bad = next((x for x in produced if isinstance(x, Exception)), None)
    if bad is not None:
        return None, (schema.ENCODE_FAILED, f"{type(bad).__name__}: {bad}")
    fields: dict[str, Any] = {"json": _meta(p, cfg, enc), "input_ids.npy": p.input_ids, "labels.npy": p.labels}
    if conv.audio:
        table = np.zeros((len(conv.audio), 6), dtype=np.int32)
        speakers = fields["json"]["speakers"]
        start = 0
        per_item = []
        for k, it in enumerate(conv.audio):
            c = np.asarray(codes_of[(id(p), k)], dtype=np.int16) if enc.audio is not None else None
            n = 0 if c is None else c.shape[1]
            table[k] = (k, it.turn, DIRECTIONS[it.direction], start, n,
                        speakers.index(it.speaker) if it.speaker else -1)
            start += n
            per_item.append(c)
        fields["audio_segments.npy"] = table
        if enc.audio is not None:
            fields["codes.npy"] = np.concatenate(per_item, axis=1)
        for name, (rate, directions) in waveform_fields(cfg).items():
            if name != "audio" and not any(it.direction in directions for it in conv.audio):
                continue  # e.g. audio_16k (input side) of a TTS sample: no member rather than an empty one
            wave, starts = _concat_waves(p, rate, directions)
            fields[f"{name}.npy"], fields[f"{name}_starts.npy"] = wave, starts
    if p.images:
        zs = [latents_of[(id(p), k)] for k in range(len(p.images))]
        pairs = zs if cfg.store_posterior else [(z, None) for z in zs]
        arrays = {"latents.npy": np.concatenate([np.asarray(z, np.float32) for z, _ in pairs], axis=1)}
        if cfg.store_posterior:
            arrays["latents_logvar.npy"] = np.concatenate([np.asarray(v, np.float32) for _, v in pairs], axis=1)
        bad_l = [f"{k[:-4]} {'non-finite' if not np.isfinite(v).all() else 'overflow float16'}"
                 for k, v in arrays.items() if not np.all(np.abs(v) <= 65000)]
        if bad_l:
            return None, (schema.ENCODE_FAILED, "; ".join(bad_l))
        fields.update({k: v.astype(np.float16) for k, v in arrays.items()})
    return fields, None
