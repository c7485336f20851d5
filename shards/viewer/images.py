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
import os
import stat
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np

#: the VAE grid's spatial factor stage one resizes to (its ``load_image`` default)
MULTIPLE = 8
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
    from ..pixels import RESIZE_MODES, RGB_MODES  # (Pillow: imported with the first image)
    if cfg["image_resize"] not in RESIZE_MODES or cfg["image_rgb"] not in RGB_MODES:
        raise ImageProblem(f"unknown preprocessing image_resize={cfg['image_resize']!r} image_rgb={cfg['image_rgb']!r}")
    return dict(size=cfg["image_size"], mode=cfg["image_resize"], rgb=cfg["image_rgb"], max_pixels=cfg["max_image_pixels"])


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

    from ..pixels import resized, to_rgb  # (Pillow: imported with the first image)
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
    im = to_rgb(ImageOps.exif_transpose(im)) if pre["rgb"] == "composite" else im.convert("RGB")
    return resized(im, int(pre["size"]), pre["mode"], MULTIPLE)


def thumbnail_png(image: np.ndarray, side: int = THUMB_PX) -> bytes:
    """uint8 RGB ``(H, W, 3)`` scaled down to at most ``side`` pixels a side, as PNG bytes."""
    from PIL import Image
    im = Image.fromarray(np.asarray(image, dtype=np.uint8), mode="RGB")
    im.thumbnail((side, side), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


__all__ = ["ImageProblem", "preprocessing", "source_image", "thumbnail_png", "THUMB_PX"]
