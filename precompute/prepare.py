"""Decode one manifest row into model inputs (runs in DataLoader worker processes).

A :class:`Prepared` holds the waveform at every needed rate (decoded from one read), the RGB
image on the VAE grid and the text token ids, or the reason the row was rejected. Decoding never
raises for a bad sample: the error travels with the row to the shard's rejects part.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch.utils.data import Dataset

from shards import schema
from shards.errors import CorruptSample

from .audio import load_audio
from .config import PrecomputeConfig
from .images import load_image
from .manifests import Request


@dataclass
class Prepared:
    """Decoded inputs of one row.

    ``audio``: {rate Hz: float32 (n,)}; ``image``: uint8 (H, W, 3) or None; ``text_ids``: int32
    (n_tokens,); ``error``: ``(reason, detail)`` when the row is rejected.
    """

    req: Request
    chunk: int
    audio: dict[int, np.ndarray] = field(default_factory=dict)
    duration_s: float = 0.0
    orig_sample_rate: int = 0
    image: np.ndarray | None = None
    text_ids: np.ndarray | None = None
    error: tuple[str, str] | None = None


def prepare(req: Request, chunk: int, cfg: PrecomputeConfig, rates: tuple[int, ...], text_tokenizer,
            image_multiple: int = 8) -> Prepared:
    """Decode ``req``; a :class:`CorruptSample` (or any decoder crash) becomes ``Prepared.error``."""
    out = Prepared(req=req, chunk=chunk)
    if req.error:
        out.error = req.error
        return out
    stage = schema.UNREADABLE_AUDIO  # reason for an unexpected crash, by the step that crashed
    try:
        if req.audio:
            out.audio, out.duration_s, out.orig_sample_rate = load_audio(
                req.audio, rates, offset_s=req.offset_s, duration_s=req.duration_s,
                min_duration=cfg.min_duration, max_duration=cfg.max_duration, silence_rms=cfg.silence_rms)
        stage = schema.IMAGE_UNREADABLE
        if req.image:
            out.image = load_image(req.image, cfg.image_size, mode=cfg.image_resize, multiple=image_multiple,
                                   max_pixels=cfg.max_image_pixels, min_side=cfg.min_image_side)
        stage = schema.ENCODE_FAILED
        out.text_ids = np.asarray(text_tokenizer.encode(req.text), dtype=np.int32)
    except CorruptSample as e:
        out.error = (e.reason, e.detail)
        out.audio, out.image = {}, None
    except Exception as e:  # a decoder bug must cost one sample, not the job
        out.error = (stage, f"{type(e).__name__}: {e}")
        out.audio, out.image = {}, None
    return out


class PrepareDataset(Dataset):
    """Map-style dataset over ``[(request, chunk)]`` returning :class:`Prepared` (use ``collate_fn=list``)."""

    def __init__(self, items: list[tuple[Request, int]], cfg: PrecomputeConfig, rates: tuple[int, ...],
                 text_tokenizer, image_multiple: int = 8):
        self.items, self.cfg, self.rates = items, cfg, rates
        self.text_tokenizer, self.image_multiple = text_tokenizer, image_multiple

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Prepared:
        req, chunk = self.items[i]
        return prepare(req, chunk, self.cfg, self.rates, self.text_tokenizer, self.image_multiple)


def identity_collate(batch: list[Prepared]) -> list[Prepared]:
    """``collate_fn`` that keeps the list of :class:`Prepared` as is."""
    return batch
