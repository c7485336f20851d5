"""The cache format (version 1): member names, dtypes, file names and reject reason codes.

Both stages import this module; it imports neither. Layout of a cache directory::

    OUT/
      manifest.json                 what encoded the cache, counts, every shard with bytes + sha256
      index.parquet                 one row per kept sample (see INDEX_COLUMNS)
      rejects.parquet               key, source, reason, detail
      shard-r0000-000000.tar ...    WebDataset tars; members KEY.json, KEY.codes.npy, ...
      parts/                        per-shard index/reject parts (written atomically with the tar)

A sample is a group of tar members sharing the basename ``KEY`` (WebDataset's convention: the key
is everything before the first dot of the member name, so keys never contain ``.`` or ``/``).

Tensor members (all ``.npy`` written by ``numpy.save`` with ``allow_pickle=False``):

* ``codes.npy``    int16 ``(n_codebooks, frames)`` audio codec tokens (codebook size <= 32768).
* ``audio.npy``    int16 ``(num_samples,)`` mono PCM at ``sample_rate`` Hz (full scale 32767).
* ``latents.npy``  float16 ``(C, T, H, W)`` VAE latents, e.g. ``(16, 1, H/8, W/8)``; image samples only.
  With ``image_resize: bucket`` H and W vary per sample. With ``store_posterior`` this is the
  posterior mean.
* ``latents_logvar.npy`` float16 ``(C, T, H, W)`` VAE posterior log-variance (natural log, same
  normalisation as ``latents``: shifted by ``-2 log(latents_std)``); only in caches made with
  ``store_posterior: true``, then on every image sample. Sample ``z = mean + exp(0.5 * logvar) * eps``.
* ``text_ids.npy`` int32 ``(n_tokens,)`` token ids.
* ``json``         UTF-8 JSON metadata: text, speaker, sources, sample_rate, duration_s, ...
"""
from __future__ import annotations

import re

FORMAT_VERSION = 1

MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.parquet"
REJECTS_FILE = "rejects.parquet"
PARTS_DIR = "parts"
SHARD_GLOB = "shard-r*-*.tar"

#: tensor member name -> numpy dtype it is stored with
TENSOR_DTYPES = {
    "codes.npy": "int16",
    "audio.npy": "int16",
    "latents.npy": "float16",
    "latents_logvar.npy": "float16",
    "text_ids.npy": "int32",
}
JSON_MEMBER = "json"
#: extensions a reader refuses: they would need unpickling
PICKLE_EXTENSIONS = (".pyd", ".pkl", ".pickle", ".pth", ".pt")

#: Index columns (one row per sample). ``members`` is a list of structs
#: ``{name, offset, size, dtype, shape}`` where offset/size (bytes) locate the raw payload inside
#: the tar (for ``.npy`` members: the array data after the npy header), so a reader can
#: ``np.frombuffer(mmap, dtype, count, offset)`` without parsing tar or npy headers.
INDEX_COLUMNS = (
    "key", "shard", "duration_s", "sample_rate", "num_samples", "n_frames", "n_codebooks",
    "n_text_tokens", "has_image", "speaker", "bytes", "sha256", "members",
)
REJECT_COLUMNS = ("key", "source", "reason", "detail")

# Reject reason codes (short, stable strings stored in rejects.parquet).
MISSING_FILE = "missing_file"
UNREADABLE_AUDIO = "unreadable_audio"          # not audio, unknown format, truncated header
ZERO_FRAMES = "zero_frames"
NON_FINITE = "non_finite"
TOO_SHORT = "too_short"
TOO_LONG = "too_long"
SILENT = "silent"
IMAGE_UNREADABLE = "image_unreadable"
IMAGE_TRUNCATED = "image_truncated"
IMAGE_TOO_LARGE = "image_too_large"            # decompression-bomb guard
IMAGE_TOO_SMALL = "image_too_small"
EMPTY_TEXT = "empty_text"
DUPLICATE_KEY = "duplicate_key"
MALFORMED_ROW = "malformed_row"
ENCODE_FAILED = "encode_failed"
REASONS = (
    MISSING_FILE, UNREADABLE_AUDIO, ZERO_FRAMES, NON_FINITE, TOO_SHORT, TOO_LONG, SILENT,
    IMAGE_UNREADABLE, IMAGE_TRUNCATED, IMAGE_TOO_LARGE, IMAGE_TOO_SMALL, EMPTY_TEXT,
    DUPLICATE_KEY, MALFORMED_ROW, ENCODE_FAILED,
)

_SHARD_RE = re.compile(r"^shard-r(\d{4})-(\d{6})\.tar$")
_KEY_BAD = re.compile(r"[./\\\s]")


def shard_name(global_rank: int, n: int) -> str:
    """File name of shard ``n`` written by ``global_rank``: ``shard-r{rank:04d}-{n:06d}.tar``."""
    return f"shard-r{global_rank:04d}-{n:06d}.tar"


def parse_shard_name(name: str) -> tuple[int, int]:
    """Inverse of :func:`shard_name`. Raises ``ValueError`` for any other name."""
    m = _SHARD_RE.match(name)
    if not m:
        raise ValueError(f"not a shard file name: {name!r} (expected shard-rRRRR-NNNNNN.tar)")
    return int(m.group(1)), int(m.group(2))


def safe_key(key: str) -> str:
    """Map a manifest key to a WebDataset-safe key: ``.``, ``/``, ``\\`` and whitespace become ``_``.

    WebDataset splits member names at the first dot, so a key with a dot would break grouping.
    """
    key = _KEY_BAD.sub("_", str(key).strip())
    if not key:
        raise ValueError("empty key")
    return key
