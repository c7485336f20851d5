"""The cache format (version 1): member names, dtypes, file names and reject reason codes.

Both stages import this module; it imports neither. Layout of a cache directory::

    OUT/
      manifest.json                 what encoded the cache, counts, every shard with bytes + sha256
      index.parquet                 one row per kept sample (see INDEX_COLUMNS)
      rejects.parquet               key, source, reason, detail
      shard-000000.tar ...          WebDataset tars; members KEY.json, KEY.tensors.npz (the arrays
                                    below but latents, packed: shards.npz), KEY.latents.npy
      parts/                        per-shard index/reject parts (written atomically with the tar)
      shard-000000.FIELD.tar        sidecar of a field added later (precompute add-field), aligned
                                    with shard-000000.tar by key order; parts/*.FIELD.sidecar.parquet

Tensor fields are declared in :mod:`shards.fields` (the field registry: dtype, rank, pad, index
columns); ``TENSOR_DTYPES`` and ``INDEX_COLUMNS`` below are derived from it.

A sample is a group of tar members sharing the basename ``KEY`` (WebDataset's convention: the key
is everything before the first dot of the member name, so keys never contain ``.`` or ``/``).

Arrays (each ``.npy`` as ``numpy.save`` writes it with ``allow_pickle=False``; all but the latents
are entries of the one ``KEY.tensors.npz`` member, sidecar fields are ``KEY.NAME.npy`` members of
their sidecar tar; the index locates every array either way):

* ``codes.npy``    int16 ``(n_codebooks, frames)`` audio codec tokens (codebook size <= 32768).
* ``audio.npy``    int16 ``(num_samples,)`` mono PCM at ``sample_rate`` Hz (full scale 32767).
* ``latents.npy``  float16 ``(C, T, H, W)`` VAE latents, e.g. ``(16, 1, H/8, W/8)``; image samples only.
  With ``image_resize: bucket`` H and W vary per sample. With ``store_posterior`` this is the
  posterior mean.
* ``latents_logvar.npy`` float16 ``(C, T, H, W)`` VAE posterior log-variance (natural log, same
  normalisation as ``latents``: shifted by ``-2 log(latents_std)``); only in caches made with
  ``store_posterior: true``, then on every image sample. Sample ``z = mean + exp(0.5 * logvar) * eps``.
* ``input_ids.npy`` int32 ``(L,)`` the conversation rendered through a chat template
  (:mod:`precompute.chat`); ``labels.npy`` int32 ``(L,)``: ``input_ids`` on trained tokens,
  ``-100`` elsewhere (not shifted).
* ``audio_segments.npy`` int32 ``(n_audio_items, 6)``: per audio item of the conversation, in
  order, ``[item, turn, direction (0 in / 1 out), code_start, code_frames, speaker]``; item ``k``'s
  codes are ``codes[:, code_start:code_start + code_frames]`` and it stands at the ``k``-th
  ``<|AUDIO|>``/``<|AUDIO_OUT|>`` token of ``input_ids``.
* ``audio_starts.npy`` int32 ``(n_audio_items + 1,)``: item ``k``'s waveform is
  ``audio[starts[k]:starts[k + 1]]``. Extra waveform fields (``extra_fields`` of producer
  ``waveform`` in the stage-one config, e.g. ``audio_16k.npy`` + ``audio_16k_starts.npy``) follow the same rule.
* ``json``         UTF-8 JSON metadata: conversation, audio_items, text, speaker, sources, ...

In a conversation, ``codes`` holds every audio item concatenated along frames, ``audio`` every
waveform, ``latents`` every image along T (image ``k`` = ``latents[:, k]``): the layout of
Higgs-Audio's ``ChatMLDatasetSample`` (``audio_ids_concat`` + ``audio_ids_start``...).
"""
from __future__ import annotations

import re

from . import fields

#: the format this code reads and writes (the layout above; every index entry with its checksum).
#: A reader refuses a newer version (:func:`shards.manifest.check_format_version`) rather than read
#: it wrongly.
FORMAT_VERSION = 1

MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.parquet"
REJECTS_FILE = "rejects.parquet"
PARTS_DIR = "parts"
#: the integrity root: sha256 of index.parquet and manifest.json, and the cache id (shards.index.write_root)
ROOT_FILE = "integrity.json"
SHARD_GLOB = "shard-*.tar"  # also matches sidecars: filter with is_main_shard_name

class MemberDtypes(dict):
    """Tensor member name -> numpy dtype it is stored with (derived from :mod:`shards.fields`).

    Besides the fixed entries, every name a rule of :func:`shards.fields.lookup` accepts is valid:
    waveform fields of a job's ``extra_fields`` (``audio_<name>.npy`` int16 and
    ``audio_<name>_starts.npy`` int32) and sidecar fields made by ``precompute add-field``
    (``codes_<name>.npy`` int16), so ``name in TENSOR_DTYPES`` and ``TENSOR_DTYPES[name]`` answer
    for them.
    """

    def _rule(self, name: str) -> str | None:
        f = fields.field_of_member(name)
        return f.dtype if f is not None else None

    def __missing__(self, name: str) -> str:
        rule = self._rule(name)
        if rule is None:
            raise KeyError(name)
        return rule

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or self._rule(name) is not None  # type: ignore[arg-type]

    def get(self, name, default=None):  # type: ignore[override]
        return self[name] if name in self else default


#: derived from the registry (:data:`shards.fields.FIELDS`)
TENSOR_DTYPES = MemberDtypes(fields.tensor_dtypes())
#: columns of ``audio_segments.npy``
SEGMENT_COLUMNS = ("item", "turn", "direction", "code_start", "code_frames", "speaker")
JSON_MEMBER = "json"
#: index entry dtypes that locate a whole tar member rather than an array payload: the ``json``
#: member, the packed ``tensors.npz`` member (:mod:`shards.npz`) and any other member (``bytes``)
WHOLE_MEMBER_DTYPES = ("json", "npz", "bytes")
#: extensions a reader refuses: they would need unpickling
PICKLE_EXTENSIONS = (".pyd", ".pkl", ".pickle", ".pth", ".pt")

#: Index columns (one row per sample). ``members`` is a list of structs
#: ``{name, offset, size, dtype, shape}`` where offset/size (bytes) locate the raw payload inside
#: the tar (for ``.npy`` members: the array data after the npy header), so a reader can
#: ``np.frombuffer(mmap, dtype, count, offset)`` without parsing tar or npy headers.
#: ``num_samples``...``has_image`` are contributed by fields (:data:`shards.fields.INDEX_FIELD_COLUMNS`).
INDEX_HEAD_COLUMNS = ("key", "shard", "duration_s", "sample_rate")
INDEX_TAIL_COLUMNS = ("speaker", "bytes", "sha256", "members")
INDEX_COLUMNS = INDEX_HEAD_COLUMNS + tuple(c.name for c in fields.INDEX_FIELD_COLUMNS) + INDEX_TAIL_COLUMNS
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
NO_TARGETS = "no_targets"                      # rendered without one trained token (labels all -100)
TOO_LARGE = "too_large"                        # a sample past a cap: text tokens, audio items/seconds, images
REASONS = (
    MISSING_FILE, UNREADABLE_AUDIO, ZERO_FRAMES, NON_FINITE, TOO_SHORT, TOO_LONG, SILENT,
    IMAGE_UNREADABLE, IMAGE_TRUNCATED, IMAGE_TOO_LARGE, IMAGE_TOO_SMALL, EMPTY_TEXT,
    DUPLICATE_KEY, MALFORMED_ROW, ENCODE_FAILED, NO_TARGETS, TOO_LARGE,
)

_SHARD_RE = re.compile(r"^shard-(?:r(\d{4})-)?(\d{6})\.tar$")
_KEY_BAD = re.compile(r"[./\\\s]")


def chunk_shard_name(chunk: int) -> str:
    """File name of stage one's chunk ``chunk``: ``shard-{chunk:06d}.tar``. Chunks are numbered by
    manifest position, so the name does not depend on which rank wrote it or how many there were."""
    return f"shard-{chunk:06d}.tar"


def shard_name(global_rank: int, n: int) -> str:
    """Shard ``n`` of a writer ``global_rank``: ``shard-r{rank:04d}-{n:06d}.tar`` (hand-built
    caches and tests; read everywhere like chunk names)."""
    return f"shard-r{global_rank:04d}-{n:06d}.tar"


def parse_shard_name(name: str) -> tuple[int, int]:
    """``(rank, n)`` of a :func:`shard_name` or ``(0, chunk)`` of a :func:`chunk_shard_name`.
    Raises ``ValueError`` for any other name."""
    m = _SHARD_RE.match(name)
    if not m:
        raise ValueError(f"not a shard file name: {name!r} (expected shard-NNNNNN.tar or shard-rRRRR-NNNNNN.tar)")
    return int(m.group(1) or 0), int(m.group(2))


def is_main_shard_name(name: str) -> bool:
    """True for a stage-one shard name (not a sidecar ``shard-XXXXXX.FIELD.tar``)."""
    return bool(_SHARD_RE.match(name))


#: the longest key (bytes of UTF-8): a member ``KEY.latents_logvar.npy`` extracted to a file still
#: fits the 255-byte file name limit of common file systems
MAX_KEY_BYTES = 200


#: what a key must not hold: a control character (C0, DEL, C1) or a lone surrogate
_KEY_REFUSED = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def key_problem(key: str) -> str | None:
    """Why ``key`` (already :func:`safe_key`) cannot name a sample, or None: a control character
    (a NUL ends a tar member name), a lone surrogate (not writable as UTF-8), more than
    :data:`MAX_KEY_BYTES` bytes. One regular-expression search over the key (the first offending
    character is named with its place)."""
    bad = _KEY_REFUSED.search(key)
    if bad is not None:
        i, ch = bad.start(), bad.group()
        if "\ud800" <= ch <= "\udfff":
            return f"key holds a lone surrogate {ch!r} at character {i} (not valid Unicode)"
        return f"key holds the control character {ch!r} at character {i}"
    n = len(key) if key.isascii() else len(key.encode("utf-8"))
    if n > MAX_KEY_BYTES:
        return f"key of {n} bytes, longer than {MAX_KEY_BYTES}"
    return None


def safe_key(key: str) -> str:
    """Map a manifest key to a WebDataset-safe key: ``.``, ``/``, ``\\`` and whitespace become ``_``.

    WebDataset splits member names at the first dot, so a key with a dot would break grouping.
    """
    key = _KEY_BAD.sub("_", str(key).strip())
    if not key:
        raise ValueError("empty key")
    return key
