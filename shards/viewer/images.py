"""A sample's source image as stage one gave it to the image encoder, decoded here with Pillow.

Stage one decodes an image (``precompute.images.load_image``) and resizes it to the VAE grid with the
preprocessing ``manifest.json`` records in ``config`` (``image_size``, ``image_resize``, ``image_rgb``,
``max_image_pixels``); the viewer does the same steps with Pillow itself (the format package imports
nothing of stage one), and ``tests/test_viewer.py`` checks pixel for pixel that both give the same
array for every resize and RGB mode:

* decode, refusing more than ``max_image_pixels`` pixels before any pixel is decoded (decompression
  bombs);
* ``image_rgb``: ``composite``: EXIF orientation applied, 16/32-bit grey scaled to 8 bits by a fixed
  factor, palette and alpha images composited over white; ``convert``: ``Image.convert("RGB")`` alone;
* ``image_resize``: ``center_crop`` (shorter side to ``size``, centre crop, bicubic), ``pad``
  (longer side to ``size``, black borders, bicubic), ``bucket`` (``H*W ~= size**2``, both multiples
  of 8, bicubic), ``stretch`` (``size x size``, bilinear).
"""
from __future__ import annotations

import io
import math
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

#: the VAE grid's spatial factor stage one resizes to (its ``load_image`` default)
MULTIPLE = 8
RESIZE_MODES, RGB_MODES = ("center_crop", "pad", "bucket", "stretch"), ("composite", "convert")
#: the largest source file read (bytes)
MAX_FILE_BYTES = 512 * 2**20
#: the side of a grid thumbnail (pixels)
THUMB_PX = 96


class ImageProblem(Exception):
    """The image cannot be shown (unreadable, too large, a preprocessing the cache does not record)."""


def preprocessing(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """``size``, ``mode``, ``rgb``, ``max_pixels`` from a cache's ``manifest.json`` ``config``.
    Raises :class:`ImageProblem` naming what is not recorded or not known."""
    cfg = dict(config or {})
    need = {"image_size": int, "image_resize": str, "image_rgb": str, "max_image_pixels": int}
    missing = [k for k, t in need.items() if not isinstance(cfg.get(k), t) or isinstance(cfg.get(k), bool)]
    if missing:
        raise ImageProblem(f"the cache's config does not record {', '.join(missing)}")
    if cfg["image_resize"] not in RESIZE_MODES or cfg["image_rgb"] not in RGB_MODES:
        raise ImageProblem(f"unknown preprocessing image_resize={cfg['image_resize']!r} image_rgb={cfg['image_rgb']!r}")
    return dict(size=cfg["image_size"], mode=cfg["image_resize"], rgb=cfg["image_rgb"], max_pixels=cfg["max_image_pixels"])


def _to_8bit(im):
    from PIL import Image
    if im.mode.startswith("I;16"):
        a = np.asarray(im).astype(np.float64) / 257.0
    elif im.mode == "I":
        a = np.asarray(im, dtype=np.int64)
        a = a / 257.0 if a.size and a.min() >= 0 and a.max() <= 65535 else np.clip(a, 0, None) / ((2**31 - 1) / 255.0)
    else:  # "F"
        a = np.nan_to_num(np.asarray(im, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        if a.size and a.min() >= 0.0 and a.max() <= 1.0:
            a = a * 255.0
    return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), mode="L")


def _composite(im):
    from PIL import Image
    if im.mode.startswith("I;16") or im.mode in ("I", "F"):
        im = _to_8bit(im)
    if im.mode == "P":
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "PA"):
        im = Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), im.convert("RGBA"))
    return im.convert("RGB")


def read_file(path: str | Path) -> bytes:
    """The bytes of the regular file at ``path`` (a FIFO, device or folder is refused before it is
    read: opened non-blocking, checked with ``fstat``), at most :data:`MAX_FILE_BYTES`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ImageProblem(f"{path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageProblem(f"{path}: not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise ImageProblem(f"{path}: {st.st_size:,} bytes, more than the viewer reads ({MAX_FILE_BYTES:,})")
        return f.read(MAX_FILE_BYTES + 1)


def source_image(path: str | Path, pre: Mapping[str, Any]) -> np.ndarray:
    """uint8 RGB ``(H, W, 3)``: the image at ``path`` decoded and resized as ``pre``
    (:func:`preprocessing`) says. Raises :class:`ImageProblem` naming the file and the reason."""
    from PIL import Image, ImageOps, UnidentifiedImageError
    data = read_file(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            if w * h > pre["max_pixels"]:
                raise ImageProblem(f"{path}: {w}x{h} pixels, more than max_image_pixels {pre['max_pixels']}")
            im.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning, UnidentifiedImageError, OSError,
            SyntaxError, ValueError) as e:
        raise ImageProblem(f"{path}: not an image Pillow decodes ({e})") from None
    im = _composite(ImageOps.exif_transpose(im)) if pre["rgb"] == "composite" else im.convert("RGB")
    size, mode = int(pre["size"]), pre["mode"]
    if mode == "bucket":
        scale = math.sqrt(size * size / (im.width * im.height))
        out = (max(MULTIPLE, int(round(im.width * scale / MULTIPLE)) * MULTIPLE),
               max(MULTIPLE, int(round(im.height * scale / MULTIPLE)) * MULTIPLE))
    else:
        out = (size, size)
    if mode == "stretch":
        im = im.resize(out, Image.Resampling.BILINEAR)
    elif mode == "pad":
        im = ImageOps.pad(im, out, Image.Resampling.BICUBIC, color=(0, 0, 0))
    else:
        im = ImageOps.fit(im, out, Image.Resampling.BICUBIC)
    return np.array(im, dtype=np.uint8)


def thumbnail_png(image: np.ndarray, side: int = THUMB_PX) -> bytes:
    """uint8 RGB ``(H, W, 3)`` scaled down to at most ``side`` pixels a side, as PNG bytes."""
    from PIL import Image
    im = Image.fromarray(np.asarray(image, dtype=np.uint8), mode="RGB")
    im.thumbnail((side, side), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


__all__ = ["ImageProblem", "preprocessing", "source_image", "thumbnail_png", "THUMB_PX"]
