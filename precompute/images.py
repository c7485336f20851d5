"""Image decoding with Pillow: bomb guard, any mode -> RGB, resize to the VAE grid.

RGB modes (``rgb``):

* ``composite`` (default): EXIF orientation applied; modes L, LA, P (with or without
  transparency), RGBA, CMYK, I;16 and I become 8-bit RGB (transparency composited over white;
  16-bit scaled by 1/257, see :func:`shards.pixels.to_8bit`; 16-bit RGB and gray+alpha PNGs are reduced to 8
  bits by Pillow itself).
* ``convert``: ``Image.convert("RGB")`` of the image as decoded and nothing else (no EXIF
  rotation, alpha dropped): what TheWorld's loaders and ``CosmosVAEEncoder`` do
  (``kasohrab/theworld``, ``python/theworld/modeling/cosmos_vae_encoder.py``).

Resize modes:

* ``center_crop``: scale the shorter side to ``size`` and crop the centre to ``size x size`` (bicubic).
* ``pad``: scale the longer side to ``size`` and pad to ``size x size`` with black (bicubic).
* ``bucket``: keep the aspect ratio: scale so that H*W ~= size**2, both rounded to multiples of
  ``multiple`` (the VAE's spatial factor), e.g. 256x256, 192x320... (bicubic).
* ``stretch``: the whole image to ``size x size``, aspect not kept, Pillow bilinear
  (``Image.resize((size, size), BILINEAR)``, which torchvision's ``resize`` of a PIL image calls:
  TheWorld's 512 x 512).
"""
from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from shards import schema
from shards.pixels import RESIZE_MODES, RGB_MODES, resized, to_rgb
from shards.errors import CorruptSample

from .sources import MISSING, MediaRefused, file_problem, open_media

#: the values of the options ``image_resize`` (:func:`resize_image`) and ``image_rgb`` (:func:`decode_image`)
def decode_image(path: str | Path, *, max_pixels: int = 64_000_000, min_side: int = 16,
                 rgb: str = "composite") -> Image.Image:
    """Decode ``path`` (read once) to an 8-bit RGB Pillow image of its own size (``rgb``: see the
    module docstring): what :func:`load_image` resizes, and what a model's own image processor
    (Gemma 3's, for ``image_features``) is given. Raises as :func:`load_image`."""
    if rgb not in RGB_MODES:
        raise ValueError(f"unknown rgb mode {rgb!r}; known: {', '.join(RGB_MODES)}")
    source, path = path, Path(path)
    problem = file_problem(path)
    if problem is not None:  # a directory, FIFO or socket is named as such
        raise CorruptSample(schema.MISSING_FILE if problem == MISSING else schema.IMAGE_UNREADABLE, problem, str(path))
    try:  # read through the descriptor checked for its media root (precompute.sources.open_media)
        with os.fdopen(open_media(source), "rb") as f:
            data = f.read()
    except MediaRefused as e:
        reason = schema.MALFORMED_ROW if e.outside else schema.IMAGE_UNREADABLE
        raise CorruptSample(reason, e.detail, str(path)) from None
    except FileNotFoundError:
        raise CorruptSample(schema.MISSING_FILE, MISSING, str(path)) from None
    except OSError as e:
        raise CorruptSample(schema.IMAGE_UNREADABLE, f"cannot open: {e.strerror or e}", str(path)) from None
    if not data:
        raise CorruptSample(schema.IMAGE_UNREADABLE, "zero-byte file", str(path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            if w * h > max_pixels:
                raise CorruptSample(schema.IMAGE_TOO_LARGE, f"{w}x{h} = {w * h} pixels > max_pixels {max_pixels}", str(path))
            im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise CorruptSample(schema.IMAGE_TOO_LARGE, str(e), str(path)) from e
    except UnidentifiedImageError as e:
        raise CorruptSample(schema.IMAGE_UNREADABLE, "not an image Pillow can identify", str(path)) from e
    except (OSError, SyntaxError, ValueError) as e:
        reason = schema.IMAGE_TRUNCATED if "truncated" in str(e).lower() else schema.IMAGE_UNREADABLE
        raise CorruptSample(reason, str(e), str(path)) from e
    if min(w, h) < min_side:
        raise CorruptSample(schema.IMAGE_TOO_SMALL, f"{w}x{h} has a side < min_side {min_side}", str(path))
    return to_rgb(ImageOps.exif_transpose(im)) if rgb == "composite" else im.convert("RGB")


def load_image(path: str | Path, size: int = 256, *, mode: str = "center_crop", multiple: int = 8,
               max_pixels: int = 64_000_000, min_side: int = 16, rgb: str = "composite",
               decoded: Image.Image | None = None) -> np.ndarray:
    """Decode ``path`` (read once) to uint8 RGB ``(H, W, 3)`` on the VAE grid (``mode``, ``rgb``:
    see the module docstring); ``decoded``: the image :func:`decode_image` already returned for it.

    Raises :class:`CorruptSample` with reason ``missing_file``, ``image_unreadable``,
    ``image_truncated``, ``image_too_large`` (more than ``max_pixels`` pixels: decompression-bomb
    guard, checked from the header before any pixel is decoded) or ``image_too_small`` (shorter
    side below ``min_side`` px). ``ValueError`` for a bad ``mode`` or ``rgb``, or a ``size`` that
    is not a multiple of ``multiple``.
    """
    if mode not in RESIZE_MODES:
        raise ValueError(f"unknown resize mode {mode!r}; known: {', '.join(RESIZE_MODES)}")
    if rgb not in RGB_MODES:
        raise ValueError(f"unknown rgb mode {rgb!r}; known: {', '.join(RGB_MODES)}")
    if size % multiple:
        raise ValueError(f"image size {size} is not a multiple of the VAE's spatial factor {multiple}")
    im = decoded if decoded is not None else decode_image(path, max_pixels=max_pixels, min_side=min_side, rgb=rgb)
    return resized(im, size, mode, multiple)
