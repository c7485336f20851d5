"""Pad a list of samples into one batch of torch tensors (lengths + masks), with one copy per array.

:func:`collate_fn` takes the dicts returned by :meth:`shards.ShardReader.get` (numpy views of the
memory-mapped tars). :class:`loaders.ShardLoader` skips the dicts and hands the same views straight
to :func:`collate_views`, so both produce identical batches.

Batch layout (``B`` samples; only the requested ``fields`` are present):

===================  =========  =========================  =============================================
key                  dtype      shape                      meaning
===================  =========  =========================  =============================================
``keys``             list[str]  B                          sample keys
``sample_rate``      int                                   audio sample rate in Hz (same for every sample)
``codes``            int64      (B, n_codebooks, F)        codec tokens, padded with ``CODES_PAD_ID``
``codes_lengths``    int64      (B,)                       real frames per sample
``codes_mask``       bool       (B, F)                     True on real frames
``audio``            float32    (B, T)                     PCM int16 / 32768 in [-1, 1), padded with 0.0
``audio_lengths``    int64      (B,)                       real samples per sample
``audio_mask``       bool       (B, T)                     True on real samples
``audio_starts``     int64      (B, S + 1)                 item k of sample j is ``audio[j, s[k]:s[k+1]]``;
                                                           padded with the last offset (empty items)
``audio_segments``   int64      (B, S, 6)                  ``[item, turn, direction, code_start,
                                                           code_frames, speaker]`` per audio item,
                                                           padded with rows of -1
``audio_segments_count`` int64  (B,)                       audio items per sample
``input_ids``        int64      (B, L)                     rendered conversation, padded with the cache's
                                                           pad id (``manifest.json`` ``text.pad_id``)
``input_lengths``    int64      (B,)                       real tokens
``attention_mask``   bool       (B, L)                     True on real tokens
``labels``           int64      (B, L)                     ``input_ids`` on trained tokens, else -100;
                                                           padded with -100 (not shifted)
``text_ids``         int64      (B, L)                     token ids, padded with ``TEXT_PAD_ID`` (caches
                                                           made before conversations)
``text_lengths``     int64      (B,)                       real tokens
``text_mask``        bool       (B, L)                     True on real tokens
``latents``          float32    (B, C, T, H, W)            VAE latents (mode = mean), zero-padded to the
                                                           batch's max C, T, H, W; all zeros where
                                                           ``has_image`` is False
``latents_mask``     bool       (B, T, H, W)               True on real latent cells; all False where
                                                           ``has_image`` is False
``latents_logvar``   float32    (B, C, T, H, W)            VAE posterior log-variance (natural log),
                                                           padded like ``latents`` with 0.0; only when
                                                           requested (:data:`OPTIONAL_FIELDS`)
``has_image``        bool       (B,)                       sample has latents
===================  =========  =========================  =============================================

Fields added to a cache with ``python -m precompute add-field`` (e.g. ``codes_mimi``, kind ``codes``
in :mod:`shards.fields`) are collated like ``codes``: ``codes_mimi`` (B, Q', F') padded with -100,
``codes_mimi_lengths`` (B,), ``codes_mimi_mask`` (B, F'). Every pad value, lengths/mask key and
rank comes from the field registry (:mod:`shards.fields`).

(``T, H, W`` of the latent rows are latent frames and latent cells, e.g. ``(1, H_px/8, W_px/8)``,
unrelated to the audio ``T``; in a conversation latent frame ``k`` is image ``k``.) Extra waveform
fields (e.g. ``audio_16k``, ``audio_16k_starts``) are collated like ``audio``/``audio_starts``. ``latents_mask``/``has_image`` come with ``latents`` or
``latents_logvar``.

Mixed latent shapes (``image_resize: bucket`` caches hold several aspect ratios): each sample's
latent ``(c, t, h, w)`` is written into ``latents[j, :c, :t, :h, :w]`` and the rest of the row is
0.0; ``latents_mask[j, :t, :h, :w]`` is True, the rest False (channels are not masked: a cache
has one latent channel count, precompute refuses mixing encoders). When every image sample of the
batch has the same shape nothing is padded and ``latents_mask[j]`` is simply ``has_image[j]``
broadcast. A posterior sample is ``latents + exp(0.5 * latents_logvar) * eps``; multiply by
``latents_mask[:, None]`` (or ignore masked cells in the loss) so padding stays out of training.

Every array is copied exactly once, from the mmap view into a tensor allocated for the batch (in a
DataLoader worker: in shared memory, so handing it to the main process copies nothing). Padding is
written only into the tail of each row.

Errors: ``ValueError`` (naming the keys) when samples of one batch have different numbers of
codebooks or different sample rates, or a sample's ``latents_logvar`` is missing or differs in
shape from its ``latents``; ``KeyError`` when a sample lacks a requested field.
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import get_worker_info

from shards import fields as registry

from . import shm

#: pad value of ``codes``: PyTorch ``CrossEntropyLoss(ignore_index=-100)`` skips these positions.
CODES_PAD_ID = registry.BY_NAME["codes"].pad
#: pad value of ``text_ids``.
TEXT_PAD_ID = registry.TEXT_PAD_ID
#: label of tokens that are not trained (PyTorch's ``CrossEntropyLoss`` default ``ignore_index``).
IGNORE_INDEX = registry.IGNORE_INDEX
#: ``audio`` float32 = int16 PCM * AUDIO_SCALE (exact: a power of two).
AUDIO_SCALE = np.float32(1.0 / 32768.0)
#: the fields a loader reads by default (those of them the cache holds), in read order.
#: (Derived from the field registry, :mod:`shards.fields`.)
FIELDS = tuple(f.name for f in registry.FIELDS if f.default_read)
#: fields read only when named in ``fields``: ``latents_logvar`` (caches made with store_posterior).
OPTIONAL_FIELDS = tuple(f.name for f in registry.FIELDS if not f.default_read)
#: every fixed field a batch can hold, in the order the loader reads them (plus extra waveforms,
#: see :func:`is_waveform`).
ALL_FIELDS = FIELDS + OPTIONAL_FIELDS
#: member ndim of each field (``FIELD.npy``; extra waveforms: 1)
NDIM = {f.name: f.ndim for f in registry.FIELDS}


def is_waveform(field: str) -> bool:
    """``audio`` or an extra waveform field such as ``audio_16k`` (not ``audio_starts``/``audio_segments``)."""
    return registry.kind(field) == "waveform"


def is_starts(field: str) -> bool:
    return registry.kind(field) == "starts"


def is_codes(field: str) -> bool:
    """``codes`` or a field of its kind (e.g. ``codes_mimi``, added with ``precompute add-field``)."""
    return registry.kind(field) == "codes"


def field_ndim(field: str) -> int:
    return registry.ndim(field)
#: the latent-shaped fields (padded together, share ``latents_mask``/``has_image``).
LATENT_FIELDS = tuple(f.name for f in registry.FIELDS if f.kind == "latents")
_PIECE = 32767  # < at::internal::GRAIN_SIZE (32768): copy_ stays serial

# torch.from_numpy warns (once per process, from C++) on read-only arrays, and the views of a
# read-only mmap are read-only. We only ever read from them (copy_ into a fresh tensor), so the
# warning is consumed here, silently, once.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.from_numpy(np.frombuffer(b"\0\0", dtype=np.int16))


def check_fields(fields: Iterable[str]) -> tuple[str, ...]:
    """Validate a field selection; returns it as a tuple in :data:`ALL_FIELDS` order.

    Raises ``ValueError`` for an unknown or empty selection.
    """
    if isinstance(fields, str):
        fields = (fields,)
    fields = tuple(fields)
    bad = [f for f in fields if registry.lookup(f) is None]
    if bad or not fields:
        raise ValueError(f"unknown fields {bad} (or none given); choose from {ALL_FIELDS} "
                         "(plus extra waveforms such as audio_16k, and added fields such as codes_mimi)")
    extra = sorted(f for f in fields if f not in ALL_FIELDS)
    return tuple(f for f in ALL_FIELDS if f in fields) + tuple(extra)


_NP_DTYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.bool: np.bool_,
              torch.int16: np.int16, torch.int32: np.int32, torch.float16: np.float16}


def allocate(layout: Sequence[tuple[str, Sequence[int], torch.dtype]], arena=None) -> dict[str, torch.Tensor]:
    """Uninitialised tensors ``{name: tensor}`` for a batch, from ``(name, shape, dtype)`` entries.

    In the main process each is its own numpy allocation wrapped by ``torch.from_numpy``: glibc
    recycles freed numpy blocks, whereas ``torch.empty`` blocks of this size come back as fresh
    kernel pages on every batch (page faults + zeroing: measured 2x slower for a 14 MB batch).
    In a DataLoader worker all of them are views of ONE shared-memory block (64-byte aligned): a
    reused slot of ``arena`` (:class:`loaders.shm.SlotArena`), so nothing is allocated, faulted in
    or sent but a small message (see :mod:`loaders.shm`); without an arena, or with every slot
    busy, a new shared block (one file descriptor per batch instead of ``default_collate``'s one
    per tensor). Keeping any one of these tensors alive keeps the whole block alive.
    """
    layout = [(n, tuple(int(x) for x in shp), dt) for n, shp, dt in layout]
    if arena is not None:
        return arena.allocate(layout)
    if get_worker_info() is None:
        return {n: torch.from_numpy(np.empty(shp, dtype=_NP_DTYPES[dt])) for n, shp, dt in layout}
    offsets, total = shm.layout_bytes([(None, shp, dt) for _, shp, dt in layout])
    storage = torch.UntypedStorage._new_shared(total)
    return {name: shm.view(storage, off, shp, dt) for (name, shp, dt), off in zip(layout, offsets)}


def empty_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """One uninitialised tensor, allocated as :func:`allocate` does."""
    return allocate([("x", shape, dtype)])["x"]


def copy_serial(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (contiguous, same numel, dtype conversion allowed) on the calling thread.

    A copy_ of 32768 elements or more opens an OpenMP parallel region. Per sample that costs more
    than it saves (measured 79 vs 39 us for a 16x64x64 latent on 2 threads), and when the cores
    are busy (DataLoader workers, other jobs) waking the pool can cost a scheduler time slice
    (ms) per call. With more than one intra-op thread we copy in pieces below the grain size.
    """
    d, s = dst.view(-1), src.view(-1)
    if d.numel() <= _PIECE or torch.get_num_threads() == 1:
        d.copy_(s)
        return
    for a, b in zip(d.split(_PIECE), s.split(_PIECE)):
        a.copy_(b)


def _name(keys: Sequence[str], idx: Iterable[int]) -> list[str]:
    return [keys[i] for i in list(idx)[:6]]


def _fill_lengths_mask(lens: list[int], lengths: torch.Tensor, mask: torch.Tensor) -> None:
    lengths.numpy()[:] = lens
    m = mask.numpy()
    for j, n in enumerate(lens):
        m[j, :n] = True
        m[j, n:] = False


def _latent_shape(keys, lists: dict[str, list], latent_shape) -> tuple[tuple[int, ...], bool]:
    """``(padded (C, T, H, W), uniform)`` of a batch's latent-shaped fields.

    ``lists`` maps the requested latent fields to per-sample arrays (None: no image). ``uniform``:
    every image sample has the same shape (no padding). Raises ``ValueError`` naming the key when
    ``latents_logvar`` is missing for a sample with latents (or vice versa) or differs in shape.
    """
    first = next(iter(lists.values()))
    if len(lists) == 2:
        for k, a, v in zip(keys, lists["latents"], lists["latents_logvar"]):
            if (a is None) != (v is None) or (a is not None and a.shape != v.shape):
                raise ValueError(
                    f"sample {k!r}: latents {None if a is None else tuple(a.shape)} but latents_logvar "
                    f"{None if v is None else tuple(v.shape)}; was the cache made with store_posterior?")
    shapes = {tuple(a.shape) for a in first if a is not None}
    if not shapes:
        return tuple(int(v) for v in (latent_shape or (0, 0, 0, 0))), True
    if len(shapes) == 1:
        return next(iter(shapes)), True
    if len({len(s) for s in shapes}) > 1:
        raise ValueError(f"latents of one batch have different numbers of dims: {sorted(shapes)}")
    return tuple(int(v) for v in np.max(np.array(sorted(shapes)), axis=0)), False


def _copy_padded(o: torch.Tensor, a: np.ndarray) -> None:
    """Write ``a`` (c, t, h, w) into the corner of ``o`` (C, T, H, W) and 0.0 into the rest only.

    torch's strided copy converts float16 5x faster than numpy's; one channel at a time keeps each
    copy below the OpenMP grain size (see :func:`copy_serial`).
    """
    c, t, h, w = a.shape
    o[c:].zero_()
    o[:c, t:].zero_()
    o[:c, :t, h:].zero_()
    o[:c, :t, :h, w:].zero_()
    src = torch.from_numpy(a)
    if a.size <= _PIECE or torch.get_num_threads() == 1:
        o[:c, :t, :h, :w].copy_(src)
        return
    for i in range(c):
        o[i, :t, :h, :w].copy_(src[i])


def _ragged_spec(field: str, pad_id: int) -> tuple[int | None, str | None, str | None]:
    """``(pad value (None: repeat the last value), lengths key, mask key)`` of a 1-D/2-D ragged field
    (from its :class:`shards.fields.Field` entry)."""
    return registry.ragged_spec(field, pad_id)


def collate_views(keys: list[str], sample_rates: Sequence[int], fields: Sequence[str],
                  latent_shape: Sequence[int] | None = None, compact: bool = False, pad_id: int = TEXT_PAD_ID,
                  arena=None, **arrays: list) -> dict[str, Any]:
    """Build a batch from per-field lists of numpy arrays (one entry per sample, keyword = field).

    ``codes``: int ``(n_codebooks, F_i)``; waveforms (``audio``, ``audio_16k``...): int16
    ``(T_i,)`` (float input is copied unscaled); ``input_ids``/``labels``/``text_ids``: int
    ``(L_i,)``; ``audio_starts``: int ``(S_i + 1,)``; ``audio_segments``: int ``(S_i, 6)``;
    ``latents`` / ``latents_logvar``: float ``(C, T_i, H_i, W_i)``. None stands for a sample
    without that member (no image: zero latents; no audio: empty codes/waveforms/segments).
    ``sample_rates``: Hz per sample (0 for samples without audio). ``latent_shape`` is used when
    no sample of the batch has an image (else the batch's latents are ``(B, 0, 0, 0, 0)``).
    ``compact``: keep the cache's dtypes, waveforms int16 PCM (scale by :data:`AUDIO_SCALE` on the
    device) and latents float16, half the bytes to copy here and to send to the GPU. ``pad_id``:
    the pad of ``input_ids`` (the cache's ``text.pad_id``). ``arena``: a DataLoader worker's
    :class:`loaders.shm.SlotArena` to collate into (see :func:`allocate`). Raises ``ValueError``
    naming the keys for mixed sample rates or codebook counts (see the module docstring).
    """
    B = len(keys)
    rates = np.asarray(sample_rates, dtype=np.int64)
    audible = rates[rates > 0]
    if len(audible) and (audible != audible[0]).any():
        odd = np.flatnonzero((rates != audible[0]) & (rates > 0))
        first = keys[int(np.flatnonzero(rates > 0)[0])]
        raise ValueError(f"samples of one batch have different sample rates: {first!r} at "
                         f"{audible[0]} Hz, {_name(keys, odd)} at {sorted(set(rates[odd].tolist()))} Hz")
    i64, f32, b8 = torch.int64, torch.float32, torch.bool
    layout: list = []
    ragged: dict[str, tuple[list, list[int], int | None]] = {}  # field -> (arrays, lengths, pad)
    code_fields = [f for f in fields if is_codes(f)]
    c_lens: dict[str, list[int]] = {}
    for cf in code_fields:
        codes = arrays[cf]
        ncb_all = np.array([a.shape[0] for a in codes if a is not None])
        if len(ncb_all) and (ncb_all != ncb_all[0]).any():
            odd = [j for j, a in enumerate(codes) if a is not None and a.shape[0] != ncb_all[0]]
            raise ValueError(f"{cf} of one batch have different numbers of codebooks: {ncb_all[0]} and "
                             f"{sorted(set(codes[j].shape[0] for j in odd))} ({_name(keys, odd)}); "
                             "was the cache encoded with several codecs? filter by n_codebooks")
        Q = int(ncb_all[0]) if len(ncb_all) else 0
        c_len = c_lens[cf] = [0 if a is None else a.shape[1] for a in codes]
        F = max(c_len, default=0)
        _, lk, mk = _ragged_spec(cf, pad_id)
        layout += [(cf, (B, Q, F), i64), (lk, (B,), i64), (mk, (B, F), b8)]
    for f in fields:
        if is_codes(f) or f in LATENT_FIELDS:
            continue
        pad, lengths, mask = _ragged_spec(f, pad_id)
        arrs = arrays[f]
        lens = [0 if a is None else a.shape[0] for a in arrs]
        if is_starts(f):  # one more offset than items; an absent member is one item-less offset
            lens = [1 if a is None else a.shape[0] for a in arrs]
        n = max(lens, default=0)
        wave = is_waveform(f)
        dtype = (torch.int16 if compact else f32) if wave else i64
        layout.append((f, (B, n, 6) if f == "audio_segments" else (B, n), dtype))
        if lengths:
            layout.append((lengths, (B,), i64))
        if mask:
            layout.append((mask, (B, n), b8))
        ragged[f] = (arrs, lens, pad)
    lat = {f: arrays[f] for f in LATENT_FIELDS if f in fields}
    if lat:
        shape, uniform = _latent_shape(keys, lat, latent_shape)
        layout += [(f, (B, *shape), torch.float16 if compact else f32) for f in lat]
        layout += [("latents_mask", (B, *shape[1:]), b8), ("has_image", (B,), b8)]
    batch: dict[str, Any] = {"keys": keys, "sample_rate": int(audible[0]) if len(audible) else 0}
    batch.update(allocate(layout, arena))

    for cf in code_fields:
        o, c_len = batch[cf].numpy(), c_lens[cf]
        pad, lk, mk = _ragged_spec(cf, pad_id)
        for j, a in enumerate(arrays[cf]):
            n = c_len[j]
            if n:
                o[j, :, :n] = a
            o[j, :, n:] = pad
        _fill_lengths_mask(c_len, batch[lk], batch[mk])
    for f, (arrs, lens, pad) in ragged.items():
        o = batch[f].numpy()
        scale = is_waveform(f) and not compact
        for j, a in enumerate(arrs):
            n = lens[j]
            if a is None:
                a = np.zeros((n,) + o.shape[2:], dtype=o.dtype)
            if scale and a.dtype.kind != "f":
                np.multiply(a, AUDIO_SCALE, out=o[j, :n])
            else:
                o[j, :n] = a
            o[j, n:] = (a[-1] if len(a) else 0) if pad is None else pad
        _, lengths, mask = _ragged_spec(f, pad_id)
        if lengths and mask:
            _fill_lengths_mask(lens, batch[lengths], batch[mask])
        elif lengths:
            batch[lengths].numpy()[:] = lens
    if lat:
        has, mask = batch["has_image"].numpy(), batch["latents_mask"].numpy()
        first = next(iter(lat.values()))
        has[:] = [a is not None for a in first]
        mask[:] = has[:, None, None, None]
        if not uniform:
            for j, a in enumerate(first):
                if a is not None and tuple(a.shape) != shape:
                    _, t, h, w = a.shape
                    mask[j] = False
                    mask[j, :t, :h, :w] = True
        for name, arrays_ in lat.items():
            out = batch[name]
            for j, a in enumerate(arrays_):
                if a is None:
                    out[j].numpy().fill(0.0)
                elif uniform or tuple(a.shape) == shape:
                    copy_serial(out[j], torch.from_numpy(a))
                else:
                    _copy_padded(out[j], a)
    return batch


def collate_fn(samples: Sequence[dict[str, Any]], fields: Iterable[str] | None = None, *,
               latent_shape: Sequence[int] | None = None, compact: bool = False,
               pad_id: int = TEXT_PAD_ID) -> dict[str, Any]:
    """Collate :meth:`shards.ShardReader.get` dicts into one padded batch (see the module table).

    Args:
        samples: dicts with ``__key__``, ``json`` (for ``sample_rate``) and the numpy arrays
            ``codes`` int16 (n_codebooks, F), ``audio`` int16 (T,), ``input_ids``/``labels``
            int32 (L,), ``audio_segments`` int32 (S, 6), ``audio_starts`` int32 (S + 1,),
            ``latents`` float16 (C, T, H, W) and ``latents_logvar`` float16 (C, T, H, W)
            (image samples only; logvar only in caches made with ``store_posterior``).
        fields: which fields to collate; default: those of :data:`FIELDS` any sample has.
        latent_shape: ``(C, T, H, W)`` used when no sample of the batch has an image.
        compact: ``audio`` int16 and latents float16 as stored, instead of float32.
        pad_id: pad of ``input_ids``.

    Latents of different shapes are zero-padded to the batch's max ``(C, T, H, W)`` and
    ``latents_mask`` (B, T, H, W) bool marks the real cells (see the module docstring).

    Raises ``KeyError`` naming the key when no sample has a requested field, a sample lacks
    ``input_ids``/``labels``/``text_ids``, or has ``latents`` without a requested
    ``latents_logvar``; ``ValueError`` as described in the module docstring.
    """
    if fields is None:
        fields = [f for f in FIELDS if any(f in s for s in samples)]
    fields = check_fields(fields)
    keys = [s["__key__"] for s in samples]
    rates = [int((s.get("json") or {}).get("sample_rate", 0)) for s in samples]
    for f in fields:
        if f in LATENT_FIELDS:
            continue
        missing = [s["__key__"] for s in samples if f not in s]
        if missing and (len(missing) == len(samples) or registry.get(f).every_sample):
            raise KeyError(f"sample {missing[0]!r} has no {f!r}; drop it from fields or filter")
    if "latents_logvar" in fields:
        for s in samples:
            if "latents" in s and "latents_logvar" not in s:
                raise KeyError(f"sample {s['__key__']!r} has latents but no 'latents_logvar' (cache made "
                               "without store_posterior); drop it from fields")
    return collate_views(keys, rates, fields, latent_shape=latent_shape, compact=compact, pad_id=pad_id,
                         **{f: [s.get(f) for s in samples] for f in fields})
