"""Pad a list of samples into one batch of torch tensors (lengths + masks), with one copy per array.

:func:`collate_fn` takes the dicts returned by :meth:`shards.ShardReader.get` (numpy views of the
memory-mapped tars) and :func:`collate_views` per-field lists of arrays. :class:`loaders.ShardLoader`
reads the same samples straight from the shard files into the batch tensors
(:func:`loaders.read.read_batch`: the same kinds lay out, pad and mask both), so all three produce
identical batches.

Batch layout (``B`` samples; only the requested ``fields`` are present): ``keys`` (list[str]),
``sample_rate`` (int, Hz, the same for every sample), and per field the batch keys its kind makes
(the field, ``NAME_lengths`` / ``NAME_count``, ``NAME_mask``, ``has_image``...), padded with the
field's pad: the fields table of docs/format.md, generated from the registry (:mod:`shards.fields`,
:attr:`shards.fields.Field.batch_keys`). Waveforms are float32 ``int16 * AUDIO_SCALE`` in [-1, 1),
token ids and codes int64, latents float32 (mode = mean), masks bool.

Every field is collated by its kind (:mod:`shards.kinds`): the pad value, the lengths/mask keys
and dtypes come from the field's declaration (:mod:`shards.fields`), so a field added to a cache
(e.g. ``codes_mimi`` with ``shardcache add-field``, kind ``codes``: ``codes_mimi`` (B, Q', F')
padded with -100, ``codes_mimi_lengths`` (B,), ``codes_mimi_mask`` (B, F')) or declared by a
plug-in needs no code here. With ``compact=True`` every field keeps its storage dtype (int16
codes and audio, int32 ids, float16 latents): half the bytes to copy and to send to the GPU, where
:func:`loaders.device.to_device` widens them to the dtypes above (exactly).

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
from shards.kinds import PCM16_SCALE, BatchContext, copy_serial  # noqa: F401 (copy_serial re-exported)

from . import shm

#: pad value of ``codes``: PyTorch ``CrossEntropyLoss(ignore_index=-100)`` skips these positions.
CODES_PAD_ID = registry.BY_NAME["codes"].pad
#: default pad value of ``input_ids`` (the cache's ``text.pad_id`` wins).
TEXT_PAD_ID = registry.TEXT_PAD_ID
#: label of tokens that are not trained (PyTorch's ``CrossEntropyLoss`` default ``ignore_index``).
IGNORE_INDEX = registry.IGNORE_INDEX
#: ``audio`` float32 = int16 PCM * AUDIO_SCALE (exact: a power of two; owned by the waveform kind).
AUDIO_SCALE = PCM16_SCALE
#: the fields a loader reads by default (those of them the cache holds), in read order.
FIELDS = tuple(f.name for f in registry.FIELDS if f.default_read)
#: fields read only when named in ``fields``: ``latents_logvar`` (caches made with store_posterior).
OPTIONAL_FIELDS = tuple(f.name for f in registry.FIELDS if not f.default_read)
#: every fixed field a batch can hold, in the order the loader reads them (plus fields of the name
#: rules and plug-ins, see :func:`shards.fields.lookup`).
ALL_FIELDS = FIELDS + OPTIONAL_FIELDS
#: member ndim of each fixed field (``FIELD.npy``)
NDIM = {f.name: f.ndim for f in registry.FIELDS}

# torch.from_numpy warns (once per process, from C++) on read-only arrays, and the views of a
# read-only mmap are read-only. We only ever read from them (copy_ into a fresh tensor), so the
# warning is consumed here, silently, once.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.from_numpy(np.frombuffer(b"\0\0", dtype=np.int16))


def allocate(layout: Sequence[tuple[str, Sequence[int], torch.dtype]], arena=None) -> dict[str, torch.Tensor]:
    """Uninitialised tensors ``{name: tensor}`` for a batch, from ``(name, shape, dtype)`` entries.

    With an ``arena`` all of them are views of ONE block it hands out (64-byte aligned): in a
    DataLoader worker a reused shared-memory slot (:class:`loaders.shm.SlotArena`), so nothing is
    allocated, faulted in or sent but a small message (see :mod:`loaders.shm`); in the loader's own
    process a reused (possibly pinned) host block (:class:`loaders.host.HostArena`). Keeping any one
    of these tensors alive keeps the whole block alive. Without an arena: in the main process each
    is its own numpy allocation wrapped by ``torch.from_numpy`` (glibc recycles part of freed
    numpy blocks, whereas ``torch.empty`` blocks of this size come back as fresh kernel pages on
    every batch); in a worker a new shared block (one file descriptor per batch instead of
    ``default_collate``'s one per tensor).
    """
    layout = [(n, tuple(shp), dt) for n, shp, dt in layout]
    if arena is not None:
        return arena.allocate(layout)
    if get_worker_info() is None:
        return {n: torch.from_numpy(np.empty(shp, dtype=shm.NP_DTYPES[dt])) for n, shp, dt in layout}
    offsets, total = shm.layout_bytes([(None, shp, dt) for _, shp, dt in layout])
    storage = torch.UntypedStorage._new_shared(total)
    return {name: shm.view(storage, off, shp, dt) for (name, shp, dt), off in zip(layout, offsets)}


def _name(keys: Sequence[str], idx: Iterable[int]) -> list[str]:
    return [keys[i] for i in list(idx)[:6]]


def _check_pairs(keys: Sequence[str], fields: Sequence[str], arrays: dict[str, list]) -> None:
    """A field declared ``paired_with`` another must be held exactly where, and shaped as, that one."""
    for name in fields:
        other = registry.get(name).paired_with
        if other is None or other not in arrays:
            continue
        for k, a, v in zip(keys, arrays[other], arrays[name]):
            if (a is None) != (v is None) or (a is not None and a.shape != v.shape):
                raise ValueError(
                    f"sample {k!r}: {other} {None if a is None else tuple(a.shape)} but {name} "
                    f"{None if v is None else tuple(v.shape)}; was the cache made with store_posterior?")


def check_rates(keys: Sequence[str], sample_rates: Sequence[int]) -> int:
    """The batch's ``sample_rate`` (Hz; 0 when no sample has audio). Raises ``ValueError`` naming
    the keys when samples with audio (rate > 0) have different rates."""
    seen = {r for r in (sample_rates.tolist() if isinstance(sample_rates, np.ndarray) else sample_rates) if r > 0}
    if len(seen) > 1:
        rates = np.asarray(sample_rates, dtype=np.int64)
        audible = rates[rates > 0]
        odd = np.flatnonzero((rates != audible[0]) & (rates > 0))
        first = keys[int(np.flatnonzero(rates > 0)[0])]
        raise ValueError(f"samples of one batch have different sample rates: {first!r} at "
                         f"{audible[0]} Hz, {_name(keys, odd)} at {sorted(set(rates[odd].tolist()))} Hz")
    return int(seen.pop()) if seen else 0


def collate_views(keys: list[str], sample_rates: Sequence[int], fields: Sequence[str],
                  latent_shape: Sequence[int] | None = None, compact: bool = False, pad_id: int = TEXT_PAD_ID,
                  arena=None, default_shapes: dict | None = None, **arrays: list) -> dict[str, Any]:
    """Build a batch from per-field lists of numpy arrays (one entry per sample, keyword = field),
    each field laid out by its kind (:mod:`shards.kinds`; see the module docstring).

    None stands for a sample without that member. ``sample_rates``: Hz per sample (0 for samples
    without audio). ``default_shapes``: field -> per-sample shape for a batch where no sample holds
    the field (``latent_shape`` is that of ``latents`` and ``latents_logvar``). ``compact``: keep the
    cache's dtypes (widened on the device by :func:`loaders.device.to_device`). ``pad_id``: the pad
    of ``input_ids`` (the cache's ``text.pad_id``). ``arena``: a DataLoader worker's
    :class:`loaders.shm.SlotArena` to collate into (see :func:`allocate`). Raises ``ValueError``
    naming the keys for mixed sample rates or a fixed axis that differs (e.g. codebook counts).
    """
    B = len(keys)
    rate = check_rates(keys, sample_rates)
    defaults = dict(default_shapes or {})
    if latent_shape is not None:
        defaults.setdefault("latents", tuple(latent_shape))
        defaults.setdefault("latents_logvar", tuple(latent_shape))
    ctx = BatchContext(pad_id=int(pad_id), compact=bool(compact), default_shapes=defaults)
    _check_pairs(keys, fields, arrays)
    plans, layout, seen = [], [], set()
    for name in fields:
        f = registry.get(name)
        arrs = arrays[name]
        empty = f.kind.empty_shape(f, ctx)
        shapes = np.array([a.shape if a is not None else empty for a in arrs], dtype=np.int64).reshape(B, len(empty))
        present = np.array([a is not None for a in arrs], dtype=bool)
        S = f.kind.batch_shape(f, keys, shapes, present, ctx)
        for key, shape, dtype in f.kind.layout(f, B, S, ctx):
            if key not in seen:  # keys shared by several fields (latents_mask) are laid out once
                seen.add(key)
                layout.append((key, shape, dtype))
        plans.append((f, arrs, shapes, present, S))
    batch: dict[str, Any] = {"keys": keys, "sample_rate": rate}
    batch.update(allocate(layout, arena))
    for f, arrs, shapes, present, S in plans:
        f.kind.fill(f, batch, arrs, shapes, present, S, ctx)
    return batch


def collate_fn(samples: Sequence[dict[str, Any]], fields: Iterable[str] | None = None, *,
               latent_shape: Sequence[int] | None = None, compact: bool = False,
               pad_id: int = TEXT_PAD_ID) -> dict[str, Any]:
    """Collate :meth:`shards.ShardReader.get` dicts into one padded batch (see the module table).

    Args:
        samples: dicts with ``__key__``, ``json`` (for ``sample_rate``) and the numpy arrays of the
            fields (e.g. ``codes`` int16 (n_codebooks, F), ``audio`` int16 (T,), ``input_ids`` /
            ``labels`` int32 (L,), ``audio_segments`` int32 (S, 6), ``audio_starts`` int32 (S + 1,),
            ``latents`` float16 (C, T, H, W), image samples only).
        fields: which fields to collate; default: those of :data:`FIELDS` any sample has.
        latent_shape: ``(C, T, H, W)`` used when no sample of the batch has an image.
        compact: keep the storage dtypes (int16 audio/codes, int32 ids, float16 latents).
        pad_id: pad of ``input_ids``.

    Raises ``KeyError`` naming the key when no sample has a requested field, or a sample lacks a
    field every sample must hold (:attr:`shards.fields.Field.every_sample`) or the partner of a
    paired field (``latents_logvar`` without ``latents``); ``ValueError`` as :func:`collate_views`.
    """
    if fields is None:
        fields = [f for f in FIELDS if any(f in s for s in samples)]
    fields = registry.selection(fields)
    keys = [s["__key__"] for s in samples]
    rates = [int((s.get("json") or {}).get("sample_rate", 0)) for s in samples]
    for name in fields:
        f = registry.get(name)
        missing = [s["__key__"] for s in samples if name not in s]
        if f.kind.uses_default_shape:
            if f.paired_with:
                bad = [s["__key__"] for s in samples if f.paired_with in s and name not in s]
                if bad:
                    raise KeyError(f"sample {bad[0]!r} has {f.paired_with} but no {name!r} (cache made without "
                                   "store_posterior); drop it from fields")
            continue
        if missing and (len(missing) == len(samples) or f.every_sample):
            raise KeyError(f"sample {missing[0]!r} has no {name!r}; drop it from fields or filter")
    return collate_views(keys, rates, fields, latent_shape=latent_shape, compact=compact, pad_id=pad_id,
                         **{f: [s.get(f) for s in samples] for f in fields})
