"""Stage one's pixel rules, owned here so the viewer shows an image exactly as stage one saw it
(:mod:`precompute.images` encodes with them, :mod:`shards.viewer.images` shows with them): high bit depths to
8 bits by fixed scaling, alpha composited on white, and the resize of each mode onto the VAE grid.

Imports Pillow: only stage one and the viewer import this module (neither is in the core install)."""
from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageOps

RESIZE_MODES, RGB_MODES = ("center_crop", "pad", "bucket", "stretch"), ("composite", "convert")

#: the Pillow resampling filter of each resize mode
RESAMPLE = {"center_crop": Image.Resampling.BICUBIC, "pad": Image.Resampling.BICUBIC,
            "bucket": Image.Resampling.BICUBIC, "stretch": Image.Resampling.BILINEAR}


def to_8bit(im: Image.Image) -> Image.Image:
    """16-bit (``I;16*``) and 32-bit int (``I``) grayscale -> ``L`` by fixed scaling, never by the
    image's own min/max (an all-white 16-bit PNG stays white, a dark one stays dark).

    ``I;16*``: round(x / 257), so 65535 -> 255 and 257 * k -> k. ``I``: Pillow opens 16-bit PNGs
    (older Pillow) and 16-bit TIFFs as ``I``: when every value fits in 0..65535 it is scaled as
    16-bit, else the non-negative int32 range 0..2**31-1 is mapped to 0..255. ``F`` (float): values
    in 0..1 are scaled by 255, any other range is clipped to 0..255.
    """
    if im.mode.startswith("I;16"):
        a = np.asarray(im).astype(np.float64) / 257.0
    elif im.mode == "I":
        a = np.asarray(im, dtype=np.int64)
        a = a / 257.0 if a.size and a.min() >= 0 and a.max() <= 65535 else np.clip(a, 0, None) / ((2**31 - 1) / 255.0)
    else:  # "F"
        a = np.asarray(im, dtype=np.float64)
        a = np.nan_to_num(a, nan=0.0, posinf=255.0, neginf=0.0)
        if a.size and a.min() >= 0.0 and a.max() <= 1.0:
            a = a * 255.0
    return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), mode="L")


def to_rgb(im: Image.Image) -> Image.Image:
    """RGB of any Pillow mode: :func:`to_8bit` first for ``I;16*``/``I``/``F``, a palette through RGBA, alpha
    composited on white (``rgb: composite``)."""
    if im.mode.startswith("I;16") or im.mode in ("I", "F"):
        im = to_8bit(im)
    if im.mode == "P":
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(background, im.convert("RGBA"))
    return im.convert("RGB")


def target_size(width: int, height: int, size: int, mode: str, multiple: int = 8) -> tuple[int, int]:
    """Output ``(width, height)`` in pixels for an input of ``width x height``."""
    if mode != "bucket":
        return size, size
    scale = math.sqrt(size * size / (width * height))
    w = max(multiple, int(round(width * scale / multiple)) * multiple)
    h = max(multiple, int(round(height * scale / multiple)) * multiple)
    return w, h


def resized(im: Image.Image, size: int, mode: str, multiple: int = 8) -> np.ndarray:
    """uint8 RGB ``(H, W, 3)`` of RGB ``im`` resized by ``mode`` (:data:`RESIZE_MODES`) to ``size`` (``bucket``:
    about ``size**2`` pixels, each side a multiple of ``multiple``) with the mode's :data:`RESAMPLE` filter."""
    out = target_size(im.width, im.height, size, mode, multiple)
    if mode == "stretch":
        im = im.resize(out, RESAMPLE[mode])
    elif mode == "pad":
        im = ImageOps.pad(im, out, RESAMPLE[mode], color=(0, 0, 0))
    else:
        im = ImageOps.fit(im, out, RESAMPLE[mode])
    return np.array(im, dtype=np.uint8)  # writable: torch.from_numpy warns on read-only arrays


__all__ = ["RESIZE_MODES", "RGB_MODES", "RESAMPLE", "to_8bit", "to_rgb", "target_size", "resized"]
