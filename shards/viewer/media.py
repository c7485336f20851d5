"""Cached arrays made into what a browser shows: WAV (the standard library's ``wave``), PNG
(matplotlib's ``imsave``) and the numbers of an inline SVG plot.

Every function takes a stored array (the dtype the cache keeps) and returns bytes or numbers; none
reads a file. PNGs are at the array's own resolution (one pixel per code, per latent cell): the
page scales them up with ``image-rendering: pixelated``, so nothing is interpolated.
"""
from __future__ import annotations

import io
import wave

import numpy as np

#: matplotlib colormaps: codes are categories (a perceptually ordered map with many hues tells
#: neighbouring codes apart), latents are signed values (diverging, 0 white)
CODES_CMAP, LATENTS_CMAP = "turbo", "RdBu_r"


def wav(pcm: np.ndarray, sample_rate: int) -> bytes:
    """A mono 16-bit PCM WAV file of ``pcm`` (int16 ``(T,)``, the cache's ``round(x * 32768)``) at
    ``sample_rate`` Hz, the samples unchanged. Raises ``ValueError`` for another dtype or rank, or a
    rate that is not a positive integer."""
    pcm = np.asarray(pcm)
    if pcm.dtype != np.int16 or pcm.ndim != 1:
        raise ValueError(f"a waveform is int16 (T,), got {pcm.dtype} {pcm.shape}")
    if int(sample_rate) <= 0:
        raise ValueError(f"sample_rate must be a positive number of Hz, got {sample_rate!r}")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm.astype("<i2", copy=False).tobytes())
    return buf.getvalue()


def _png(image: np.ndarray, **kw) -> bytes:
    from matplotlib.image import imsave
    buf = io.BytesIO()
    imsave(buf, image, format="png", **kw)
    return buf.getvalue()


def codes_png(codes: np.ndarray, codebook_size: int | None = None) -> bytes:
    """``codes`` int ``(n_codebooks, frames)`` as a PNG of that many rows and columns, codebook 0 on
    top, each code coloured by its value in ``[0, codebook_size)`` (default: the array's range)."""
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.size == 0:
        raise ValueError(f"codes are (n_codebooks, frames) with at least one frame, got {codes.shape}")
    top = (codebook_size - 1) if codebook_size else max(int(codes.max()), 1)
    return _png(codes.astype(np.float32), cmap=CODES_CMAP, vmin=0, vmax=top)


def channel_png(channel: np.ndarray) -> bytes:
    """One latent channel ``(H, W)`` (float16) as a PNG, coloured on a scale symmetric around 0 (the
    channel's largest absolute value at either end; non-finite values shown as 0)."""
    x = np.nan_to_num(np.asarray(channel, dtype=np.float32), nan=0.0, posinf=0.0, neginf=0.0)
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"a latent channel is (H, W), got {x.shape}")
    m = float(np.abs(x).max()) or 1.0
    return _png(x, cmap=LATENTS_CMAP, vmin=-m, vmax=m)


def rgb_png(image: np.ndarray) -> bytes:
    """uint8 RGB ``(H, W, 3)`` (an image as stage one gave it to the VAE) as a PNG."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"an image is uint8 (H, W, 3), got {image.dtype} {image.shape}")
    return _png(image)


def token_norms(features: np.ndarray) -> np.ndarray:
    """The L2 norm over ``hidden`` of each token of ``features`` float32 ``(n_images, tokens, hidden)``:
    float32 ``(n_images, tokens)``."""
    f = np.asarray(features, dtype=np.float32)
    if f.ndim != 3:
        raise ValueError(f"image features are (n_images, tokens, hidden), got {f.shape}")
    return np.linalg.norm(f, axis=2)


def polyline(values: np.ndarray, width: float, height: float, pad: float = 4.0) -> str:
    """The ``points`` of an SVG polyline drawing ``values`` across ``width x height``, the smallest
    value at the bottom and the largest at the top (a flat series in the middle): numbers only, e.g.
    ``"4.0,60.0 10.5,12.3"``."""
    v = np.nan_to_num(np.asarray(values, dtype=np.float64).reshape(-1))
    if v.size == 0:
        return ""
    lo, hi = float(v.min()), float(v.max())
    y = (v - lo) / (hi - lo) if hi > lo else np.full(v.size, 0.5)
    xs = np.linspace(pad, width - pad, v.size) if v.size > 1 else np.array([width / 2])
    ys = height - pad - y * (height - 2 * pad)
    return " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(xs, ys))


__all__ = ["wav", "codes_png", "channel_png", "rgb_png", "token_norms", "polyline", "CODES_CMAP", "LATENTS_CMAP"]
