"""Field kinds: how one kind of cached tensor is stored, checked, batched and moved to the device.

A :class:`shards.fields.Field` names a tensor member of a cached sample and points at its kind.
The kind owns everything that depends on what the values *are* (lhotse's one-writer-per-field and
torchtitan's components as models), so the code that handles fields (``loaders.collate``,
``train.data.to_device``, token counting, ``shards verify``, the writers of stage one) loops over
the declared fields and calls their kind; no such code names a specific field.

What a kind decides:

* **values** (:meth:`FieldKind.value_check`): a :class:`ValueCheck` object that finds the first
  bad value itself (:class:`InRange`: codes in ``[0, codebook_size)``, the size from
  ``manifest.json``, token ids in ``[0, vocab_size)``; :class:`LabelIds`; :class:`Finite`: floats
  finite and inside the storage dtype's range; :class:`Bf16Finite`). A kind with a check of its own
  declares it beside the kind, nothing else. Checked when a sample is written, by readers asked to
  (``value_checks``) and by ``shards verify``.
* **batch layout** (:meth:`FieldKind.layout`, :meth:`FieldKind.fill`): every sample's array of
  shape ``s_j`` goes into a batch tensor ``(B, *S)`` with ``S`` the element-wise maximum over the
  batch; the rest is the kind's pad value. The per-sample sizes along :attr:`FieldKind.lengths_axis`
  go into ``Field.lengths`` (int64 ``(B,)``), and ``Field.mask`` is a bool tensor over
  :attr:`FieldKind.mask_axes` that is True on real cells. Axes a kind keeps fixed (the codebooks of
  ``codes``, the 6 columns of ``audio_segments``) must agree across a batch (``ValueError`` naming
  the keys otherwise).
* **dtypes**: a batch holds the storage dtype (``compact``: half the bytes to copy and to send to
  the GPU) or the model dtype (:attr:`FieldKind.model_dtype`: int64 ids, float32 values); the move
  to the device (:meth:`FieldKind.to_model`) widens compact tensors there, never on the host.
* **accounting** (:meth:`FieldKind.count_tokens`): what a batch contributes to tokens/s.

Built-in kinds (instances below): :data:`TOKENS` (ids ``(L,)``), :data:`LABELS` (ids or -100), :data:`CODES` (``(Q, F)`` codec
tokens), :data:`WAVEFORM` (int16 PCM ``(T,)``; owns the PCM scale), :data:`OFFSETS` (``(S + 1,)``
item offsets, padded with the last offset), :data:`SEGMENTS` (``(S, 6)`` table rows, padded with -1),
:data:`LATENTS` (``(C, T, H, W)`` VAE latents, padded on every axis, mask over ``(T, H, W)``) and
:data:`FEATURES` (float ``(D, frames)`` features such as log-mel spectrograms, frame mask) and
:data:`BF16_BITS` (bfloat16 ``(n_items, tokens, hidden)`` stored as exact int16 bit patterns, e.g.
Gemma 3's ``image_features``). A new
kind is a subclass (or an instance with other parameters) of :class:`FieldKind`.

This module imports numpy only; torch is imported by the methods that build or move tensors.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .tokens import IGNORE_INDEX

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .fields import Field

#: ``Field.pad`` value meaning "pad with the cache's text pad id" (``manifest.json`` ``text.pad_id``)
PAD_TEXT = "text_pad_id"
#: ``Field.pad`` value meaning "repeat the sample's last value" (offset arrays)
PAD_LAST = "last"
#: full scale of int16 PCM: a float sample ``x`` in [-1, 1) is stored as ``round(x * 32768)``
#: clipped to int16 and read back as ``pcm / 32768`` (soundfile's convention; exact for every int16)
PCM16_FULL_SCALE = 32768.0
#: float32 factor from int16 PCM to [-1, 1) (a power of two: the conversion is exact)
PCM16_SCALE = np.float32(1.0 / PCM16_FULL_SCALE)
#: largest finite float16
FLOAT16_MAX = 65504.0
#: batch tensors and masks up to this many bytes are padded (masks written) with one broadcast write
#: (ids, labels, attention masks, codes of short clips); larger ones (audio, latents) row by row,
#: touching only each row's tails
_SMALL_PAD = 1 << 16


@dataclass(frozen=True)
class BatchContext:
    """What a kind needs from the cache and the loader to batch a field.

    ``pad_id``: pad of text ids (``manifest.json`` ``text.pad_id``); ``compact``: keep storage
    dtypes; ``default_shapes``: field -> per-sample shape used when no sample of a batch holds the
    field (the cache's most common shape; e.g. latents of a batch without an image).
    """

    pad_id: int = 0
    compact: bool = False
    default_shapes: Any = None

    def default_shape(self, name: str) -> tuple[int, ...] | None:
        d = self.default_shapes or {}
        s = d.get(name)
        return None if s is None else tuple(int(v) for v in s)


_TORCH_DTYPES: dict = {}


def _torch_dtype(name: str):
    if not _TORCH_DTYPES:  # built on first use: this module imports numpy only
        import torch
        _TORCH_DTYPES.update({"int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "uint8": torch.uint8,
                              "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                              "uint16": torch.uint16, "bool": torch.bool, "float64": torch.float64})
    return _TORCH_DTYPES[name]


class FieldKind:
    """The behaviour of one kind of field (see the module docstring). Override what differs.

    Attributes:
        name: the kind's name (``shards show``, the README table).
        model_dtype: dtype the model sees (None: the storage dtype).
        lengths_axis: per-sample axis whose size goes into ``Field.lengths`` (None: no lengths).
        mask_axes: per-sample axes the ``Field.mask`` tensor spans (its shape is ``(B, *S[axes])``).
        fixed_axes: per-sample axes that must have the same size in every sample of a batch.
        counts_tokens: whether :meth:`count_tokens` counts the field's mask.
    """

    name = "array"
    model_dtype: str | None = None
    lengths_axis: int | None = 0
    mask_axes: tuple[int, ...] = (0,)
    fixed_axes: tuple[int, ...] = ()
    counts_tokens = False

    # -- values ----------------------------------------------------------------------------------
    def value_check(self, field: "Field", manifest: Any) -> "ValueCheck | None":
        """The check of this field's values in a cache with ``manifest`` (a
        :class:`shards.manifest.CacheManifest`), or None (nothing to check). Default: finite and
        inside the storage dtype's range for float fields (:class:`Finite`), else nothing."""
        if np.dtype(field.dtype).kind == "f":
            return Finite(FLOAT16_MAX if np.dtype(field.dtype).itemsize == 2 else None)
        return None

    def value_problem(self, arr: np.ndarray, check: "ValueCheck | None") -> str | None:
        """Why ``arr`` breaks ``check`` (a short text naming the first bad value), or None."""
        return None if check is None else check.problem(arr)

    # -- batch geometry --------------------------------------------------------------------------
    def model_torch_dtype(self, field: "Field"):
        return _torch_dtype(self.model_dtype or field.dtype)

    def host_dtype(self, field: "Field", compact: bool):
        """torch dtype of the field in a host batch: the storage dtype when ``compact``."""
        return _torch_dtype(field.dtype) if compact else self.model_torch_dtype(field)

    def pad_value(self, field: "Field", ctx: BatchContext) -> Any:
        """The value written into padded cells (None: repeat the sample's last value)."""
        pad = field.pad
        if pad == PAD_TEXT:
            return int(ctx.pad_id)
        if pad == PAD_LAST:
            return None
        return pad

    def empty_shape(self, field: "Field", ctx: BatchContext) -> tuple[int, ...]:
        """Per-sample shape of a sample that lacks the field (zeros; offsets: one offset)."""
        return (0,) * field.ndim

    def batch_shape(self, field: "Field", keys: Sequence[str], shapes: np.ndarray, present: np.ndarray,
                    ctx: BatchContext) -> tuple[int, ...]:
        """``S``: the padded per-sample shape of a batch (``shapes`` int64 ``(B, ndim)``, absent
        rows already holding :meth:`empty_shape`). Raises ``ValueError`` naming the keys when a
        fixed axis differs between samples that hold the field."""
        have = shapes[present]
        if not len(have):
            d = ctx.default_shape(field.name) if self.uses_default_shape else None
            if d is not None:
                return d
            return tuple(int(v) for v in shapes.max(axis=0)) if len(shapes) else self.empty_shape(field, ctx)
        for ax in self.fixed_axes:
            vals = have[:, ax]
            if (vals != vals[0]).any():
                odd = [keys[j] for j in np.flatnonzero(present)[vals != vals[0]][:6]]
                raise ValueError(f"{field.name} of one batch have different sizes along axis {ax}: "
                                 f"{int(vals[0])} and {sorted(set(vals[vals != vals[0]].tolist()))} ({odd}); "
                                 f"{self.mixed_hint(field)}")
        return tuple(shapes.max(axis=0).tolist())

    #: use ``BatchContext.default_shapes`` for a batch where no sample holds the field
    uses_default_shape = False

    def mixed_hint(self, field: "Field") -> str:
        return "samples of one batch must agree there"

    def layout(self, field: "Field", B: int, S: tuple[int, ...], ctx: BatchContext) -> list[tuple]:
        """``[(key, shape, torch dtype)]`` of the batch tensors of this field: the data
        ``(B, *S)``, then ``Field.lengths`` and ``Field.mask`` when declared."""
        out = [(field.name, (B, *S), self.host_dtype(field, ctx.compact))]
        if field.lengths and self.lengths_axis is not None:
            out.append((field.lengths, (B,), _torch_dtype("int64")))
        if field.mask:
            out.append((field.mask, (B, *(S[a] for a in self.mask_axes)), _torch_dtype("bool")))
        return out

    def fill(self, field: "Field", out: dict, arrays: Sequence[np.ndarray | None], shapes: np.ndarray,
             present: np.ndarray, S: tuple[int, ...], ctx: BatchContext) -> None:
        """Copy each sample's array into the corner of its row of ``out[field.name]`` (with the
        kind's conversion, :meth:`copy_into`), then :meth:`finish` (padding, lengths, mask).
        What :func:`loaders.collate.collate_views` does; the loader's reader puts the bytes into
        the same corners straight from the shard files (:meth:`runs`) and calls :meth:`finish` too."""
        o = out[field.name].numpy()
        for j, a in enumerate(arrays):
            if a is not None and a.size:
                self.copy_into(o[j][tuple(slice(0, d) for d in a.shape)], a, ctx)
        self.finish(field, out, shapes, present, S, ctx)

    def copy_into(self, dst: np.ndarray, src: np.ndarray, ctx: BatchContext) -> None:
        """``dst[...] = src`` with the kind's conversion (default: a cast)."""
        _copy(dst, src)

    def finish(self, field: "Field", out: dict, shapes: np.ndarray, present: np.ndarray, S: tuple[int, ...],
               ctx: BatchContext) -> None:
        """Once every sample's values are in their corner: :meth:`pad`, then the lengths and the
        mask (:meth:`fill_lengths_mask`, from ``shapes``: the index's, never the data)."""
        self.pad(field, out[field.name], shapes, present, S, ctx)
        self.fill_lengths_mask(field, out, shapes, S)

    def pad(self, field: "Field", data: "torch.Tensor", shapes: np.ndarray, present: np.ndarray,
            S: tuple[int, ...], ctx: BatchContext) -> None:
        """Write the pad value into every cell of ``data`` ``(B, *S)`` outside the corner
        ``[:s_0, :s_1, ...]`` of each sample's row, each cell once (rows that fill ``S`` are not
        touched); a row without the field is all pad (0 where the pad repeats the last value)."""
        o = data.numpy()
        pad = self.pad_value(field, ctx)
        rows, pres, full = shapes.tolist(), present.tolist(), list(S)  # a batch is a few dozen rows: lists
        todo = [j for j, (p, r) in enumerate(zip(pres, rows)) if not p or r != full]
        if not todo:
            return
        if pad is not None and full and o.nbytes <= _SMALL_PAD:
            # small fields (ids, labels, codes of short clips): one masked write, not slices per row
            dims = shapes if all(pres) else np.where(present[:, None], shapes, 0)
            np.copyto(o, pad, where=~_inside(dims, S), casting="unsafe")
            return
        for j in todo:
            row = o[j]
            if not pres[j]:
                row[...] = 0 if pad is None else pad
                continue
            shape = rows[j]
            value = pad
            if pad is None:  # repeat the sample's last value
                value = row[tuple(d - 1 for d in shape)] if all(shape) else 0
            _pad_tails(row, shape, value)

    def runs(self, field: "Field", shapes: np.ndarray, present: np.ndarray,
             S: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """Where each sample's values land in the batch tensor ``(B, *S)`` (row-major, the corner
        of its row, as :meth:`fill` puts them): contiguous runs, each as contiguous in the stored
        array as in the batch, in stored order within a sample.

        Returns int64 arrays ``(sample, src, dst, count)``, one entry per run, in elements: run
        ``r`` copies ``count[r]`` values from element ``src[r]`` of sample ``sample[r]``'s stored
        array to element ``dst[r]`` of the flat batch tensor. A sample of shape ``s`` gives
        ``prod(s[:k])`` runs of ``s[k] * prod(S[k + 1:])`` values, ``k`` the last axis along which
        some sample of the batch is shorter than ``S`` (one run per sample when none is: 1-D fields
        and equal shapes); none for samples without the field (``present`` False) or with no
        values. Vectorised; the reader turns runs into ``preadv`` buffers.
        """
        B, nd = shapes.shape
        if nd == 1:  # 1-D fields (audio, ids): one run per sample holding values
            count = shapes[:, 0]
            sample = np.flatnonzero(present & (count > 0))
            return sample, np.zeros(len(sample), np.int64), sample * int(S[0]), count[sample]
        Sa = np.asarray(S, dtype=np.int64)
        count = shapes.prod(axis=1) if nd else np.ones(B, np.int64)
        have = (count > 0) & present
        short = np.flatnonzero((shapes[have] != Sa).any(axis=0)) if nd else np.zeros(0, np.int64)
        k = int(short[-1]) if len(short) else 0
        if k == 0:  # one run per sample (1-D fields, equal shapes): the common case, kept cheap
            sample = np.flatnonzero(have)
            return sample, np.zeros(len(sample), np.int64), sample * int(Sa.prod()), count[sample]
        inner = int(np.prod(Sa[k + 1:])) if nd else 1
        n_runs = np.where(have, shapes[:, :k].prod(axis=1), 0)
        sample = np.repeat(np.arange(B, dtype=np.int64), n_runs)
        local = np.arange(len(sample), dtype=np.int64) - np.repeat(np.cumsum(n_runs) - n_runs, n_runs)
        dst = sample * int(np.prod(Sa))
        src = np.zeros(len(sample), dtype=np.int64)
        s = shapes[sample]
        src_stride = np.full(len(sample), inner, dtype=np.int64) * (s[:, k] if nd else 1)
        dst_stride = inner * (int(Sa[k]) if nd else 1)
        for a in range(k - 1, -1, -1):  # unravel the run index over the sample's leading axes
            idx = local % s[:, a]
            local = local // s[:, a]
            dst = dst + idx * dst_stride
            src = src + idx * src_stride
            dst_stride *= int(Sa[a])
            src_stride = src_stride * s[:, a]
        n = (s[:, k] * inner) if nd else np.ones(len(sample), np.int64)
        return sample, src, dst, n

    def widen_host(self, field: "Field", dst: "torch.Tensor", src: "torch.Tensor") -> None:
        """``dst`` (the host dtype) from ``src`` (the same shape in the storage dtype), the whole
        batch tensor at once, converting as :meth:`copy_into` does (default: a cast). For batches
        that are not ``compact``: the reader fills ``src``, this converts it in one pass (unless the
        native reader widened each member as it read it: :meth:`host_widening`)."""
        serial(lambda d, s: d.copy_(s), dst, src)

    def host_widening(self, field: "Field") -> tuple | None:
        """What :meth:`widen_host` does, said so that the native reader (``shards._readv``) can do it
        per member, right after reading it (``shards.readinto.CONVERSIONS``): ``("cast", scale)``:
        the stored value cast to the host dtype, times ``scale`` (1.0: none); ``("bf16",)``: int16
        bfloat16 bit patterns to the float32 they are. None: only :meth:`widen_host` knows (the
        default for a kind that overrides :meth:`widen_host` but not this)."""
        return ("cast", 1.0) if type(self).widen_host is FieldKind.widen_host else None

    def fill_lengths_mask(self, field: "Field", out: dict, shapes: np.ndarray, S: tuple[int, ...]) -> None:
        """``Field.lengths`` (int64 ``(B,)``: each sample's size along :attr:`lengths_axis`) and
        ``Field.mask`` (bool ``(B, *S[mask_axes])``: True on real cells) from ``shapes``, written in
        place: one fill when no row is short, one broadcast comparison when small, else row by row."""
        if field.lengths and field.lengths in out and self.lengths_axis is not None:
            out[field.lengths].numpy()[:] = shapes[:, self.lengths_axis]
        if field.mask and field.mask in out:
            m = out[field.mask].numpy()
            axes = self.mask_axes
            if not axes:
                m[...] = True
                return
            want = [S[a] for a in axes]
            real = [[r[a] for a in axes] for r in shapes.tolist()]  # a few dozen rows: lists
            short = {j for j, r in enumerate(real) if r != want}
            if not short:  # no sample is short along a masked axis: one fill
                m.fill(True)
                return
            if m.nbytes <= _SMALL_PAD:  # small (attention masks, short clips): one comparison per axis
                m[...] = _inside(np.asarray(real, dtype=np.int64).reshape(len(real), len(axes)), want)
                return
            if len(axes) == 1:  # one memset per row and side: faster than a comparison over the mask
                for j, (d,) in enumerate(real):
                    m[j, :d] = True
                    m[j, d:] = False
                return
            for j, dims in enumerate(real):  # a row: all True, or False then its corner True
                if j not in short:
                    m[j] = True
                    continue
                m[j] = False
                m[j][tuple(slice(0, d) for d in dims)] = True

    # -- the device ------------------------------------------------------------------------------
    def to_model(self, field: "Field", value: "torch.Tensor") -> "torch.Tensor":
        """``value`` (already on its device) in the model dtype: widened there, exactly."""
        want = self.model_torch_dtype(field)
        return value if value.dtype == want else value.to(want)

    def count_tokens(self, field: "Field", batch: dict) -> Any:
        """Tokens this field contributes to a batch (a 0-dim tensor, no host sync; 0 for none)."""
        if self.counts_tokens and field.mask and field.mask in batch:
            return batch[field.mask].sum()
        return 0


# ------------------------------------------------------------------------------ the built-in kinds

class Tokens(FieldKind):
    """Token ids ``(L,)``: ``input_ids`` (padded with the cache's pad id, ``attention_mask``) and,
    with ``labels=True``, ``labels`` (padded with -100, which is also every untrained position).
    Values in ``[0, vocab_size)`` (``manifest.json`` ``text``), labels also -100."""

    model_dtype = "int64"
    counts_tokens = True

    def __init__(self, labels: bool = False):
        self.labels = bool(labels)
        self.name = "labels" if labels else "tokens"

    def value_check(self, field, manifest):
        v = manifest.vocab_size() if manifest is not None else None
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return None
        return LabelIds(int(v)) if self.labels else InRange(0, int(v))


class Codes(FieldKind):
    """Codec tokens ``(Q, F)`` (``codes``, ``codes_<codec>``): ragged along frames, padded with -100
    (``CrossEntropyLoss`` skips it), ``NAME_lengths`` frames, ``NAME_mask`` ``(B, F)``. Values in
    ``[0, codebook_size)`` (``manifest.json``). Every sample of a batch has the same ``Q``."""

    name = "codes"
    model_dtype = "int64"
    lengths_axis = 1
    mask_axes = (1,)
    fixed_axes = (0,)
    counts_tokens = True

    def value_check(self, field, manifest):
        v = manifest.codebook_size_of(field.name) if manifest is not None else None
        return InRange(0, int(v)) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    def mixed_hint(self, field):
        return "was the cache encoded with several codecs? filter by n_codebooks"

    def batch_shape(self, field, keys, shapes, present, ctx):
        if not present.any():  # no audio in the batch: (Q, 0) with no codebooks either
            return (0, 0)
        return super().batch_shape(field, keys, shapes, present, ctx)


class Waveform(FieldKind):
    """Mono int16 PCM ``(T,)`` at the cache's ``sample_rate`` (``audio``, ``audio_<name>``), padded
    with 0, ``NAME_lengths``/``NAME_mask``. The model sees float32 ``pcm / 32768`` in [-1, 1)
    (:data:`PCM16_SCALE`; the scale is defined here and nowhere else)."""

    name = "waveform"
    model_dtype = "float32"

    def value_check(self, field, manifest):
        return None  # every int16 is a valid sample

    @staticmethod
    def to_storage(x: np.ndarray) -> np.ndarray:
        """float [-1, 1] -> int16 PCM: ``round(x * 32768)`` clipped to ``[-32768, 32767]``."""
        return np.clip(np.rint(np.asarray(x, dtype=np.float64) * PCM16_FULL_SCALE), -32768, 32767).astype(np.int16)

    @staticmethod
    def from_storage(pcm: np.ndarray) -> np.ndarray:
        """int16 PCM -> float32 ``pcm / 32768`` (exact)."""
        return np.asarray(pcm).astype(np.float32) * PCM16_SCALE

    def copy_into(self, dst, src, ctx):
        if dst.dtype.kind == "f" and src.dtype.kind != "f":
            np.multiply(src, PCM16_SCALE, out=dst)
        else:
            _copy(dst, src)

    def widen_host(self, field, dst, src):
        if dst.is_floating_point() and not src.is_floating_point():
            # numpy, two passes on the calling thread (no OpenMP region): a cast (exact, every int16
            # is a float32) then a multiply by a power of two (exact); faster than torch's
            # mixed-dtype multiply run serially in pieces (docs/benchmarks.md)
            d = dst.numpy()
            np.copyto(d, src.numpy(), casting="unsafe")
            np.multiply(d, PCM16_SCALE.astype(d.dtype), out=d)
        else:
            super().widen_host(field, dst, src)

    def host_widening(self, field):
        return ("cast", float(PCM16_SCALE))

    def to_model(self, field, value):
        import torch
        if value.dtype == torch.int16:
            return value.float() * float(PCM16_SCALE)
        return super().to_model(field, value)


class Offsets(FieldKind):
    """Item offsets ``(S + 1,)`` into a waveform (``audio_starts``): padded by repeating the last
    offset (padded items are empty); a sample without the member is one item-less offset (0)."""

    name = "offsets"
    model_dtype = "int64"
    lengths_axis = None
    mask_axes = ()

    def empty_shape(self, field, ctx):
        return (1,)

    def layout(self, field, B, S, ctx):
        return [(field.name, (B, *S), self.host_dtype(field, ctx.compact))]


class Rows(FieldKind):
    """Table rows ``(S, columns)`` (``audio_segments``: one row per audio item), padded with -1
    rows; ``Field.lengths`` holds the row count."""

    name = "rows"
    model_dtype = "int64"
    mask_axes = ()
    fixed_axes = (1,)

    def __init__(self, columns: int):
        self.columns = int(columns)

    def empty_shape(self, field, ctx):
        return (0, self.columns)

    def batch_shape(self, field, keys, shapes, present, ctx):
        S = super().batch_shape(field, keys, shapes, present, ctx)
        return (S[0], self.columns)


class Latents(FieldKind):
    """VAE latents ``(C, T, H, W)`` float16 (image ``k`` of a conversation is ``[:, k]``): a batch
    pads every axis to its maximum with 0.0; ``latents_mask`` ``(B, T, H, W)`` is True on real
    cells (channels are never masked: a cache has one latent channel count) and ``has_image``
    ``(B,)`` says which samples hold latents. Values finite and inside float16's range."""

    name = "latents"
    model_dtype = "float32"
    lengths_axis = None
    mask_axes = (1, 2, 3)
    uses_default_shape = True

    def layout(self, field, B, S, ctx):
        out = super().layout(field, B, S, ctx)
        if field.present_key:
            out.append((field.present_key, (B,), _torch_dtype("bool")))
        return out

    def finish(self, field, out, shapes, present, S, ctx):
        super().finish(field, out, shapes, present, S, ctx)  # absent rows: shape (0, 0, 0, 0), mask all False
        if field.present_key and field.present_key in out:
            out[field.present_key].numpy()[:] = present


class Features(FieldKind):
    """Float features ``(D, frames)`` (e.g. Whisper log-mel ``(n_mels, frames)`` float16): ragged
    along frames, padded with 0.0, ``NAME_lengths`` frames and ``NAME_mask`` ``(B, frames)``; ``D``
    fixed. The model sees float32 (widened on the device). Values finite and inside the storage
    dtype's range."""

    name = "features"
    model_dtype = "float32"
    lengths_axis = 1
    mask_axes = (1,)
    fixed_axes = (0,)


#: the exponent bits of a bfloat16 (all set: NaN or inf)
BF16_EXPONENT = 0x7F80


class BFloat16Bits(FieldKind):
    """bfloat16 values ``(n_items, tokens, hidden)`` stored as their exact bit patterns in int16
    (numpy has no bfloat16: ``torch_tensor.view(torch.int16).numpy()``, read back with
    ``torch.from_numpy(a).view(torch.bfloat16)``; no rounding anywhere, a bf16 value round-trips
    bit for bit). E.g. ``image_features``: Gemma 3's vision tower + multimodal projector output,
    one ``(mm_tokens_per_image, hidden)`` block per image, in bfloat16 as Gemma 3 computes it.

    A batch pads the item axis to its maximum with 0 (the bits of +0.0), ``NAME_lengths`` items per
    sample, ``NAME_mask`` ``(B, n_items)``; ``tokens`` and ``hidden`` fixed. A compact batch keeps
    the int16 bits on the host and the device move reinterprets them as bfloat16 there (a view:
    no copy, exact); a batch that is not compact holds float32 (every bfloat16 is a float32: exact).
    Values: no NaN/inf (exponent bits not all set)."""

    name = "bf16_bits"
    model_dtype = "float32"
    lengths_axis = 0
    mask_axes = (0,)
    fixed_axes = (1, 2)

    def value_check(self, field, manifest):
        return Bf16Finite()

    @staticmethod
    def to_storage(x) -> np.ndarray:
        """A torch tensor (cast to bfloat16 first, round to nearest even) -> int16 bits, same shape."""
        import torch
        return x.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy()

    @staticmethod
    def from_storage(bits: np.ndarray) -> np.ndarray:
        """int16 bits -> float32 values (exact: a bfloat16 is the top half of a float32)."""
        b = np.ascontiguousarray(bits)
        return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    def copy_into(self, dst, src, ctx):
        if dst.dtype == np.float32 and src.dtype == np.int16:
            dst[...] = self.from_storage(src)
        else:
            _copy(dst, src)

    def widen_host(self, field, dst, src):
        import torch
        if dst.dtype == torch.float32 and src.dtype == torch.int16:
            serial(lambda d, s: d.copy_(s.view(torch.bfloat16)), dst, src)
        else:
            super().widen_host(field, dst, src)

    def host_widening(self, field):
        return ("bf16",)

    def to_model(self, field, value):
        """int16 bits (a compact batch) -> the bfloat16 they are (a view, exact); float32 kept."""
        import torch
        if value.dtype == torch.int16:
            return value.view(torch.bfloat16)
        return value if value.is_floating_point() else value.float()


TOKENS, LABELS, CODES, WAVEFORM, OFFSETS, SEGMENTS, LATENTS, FEATURES, BF16_BITS = (
    Tokens(), Tokens(labels=True), Codes(), Waveform(), Offsets(), Rows(columns=6), Latents(), Features(),
    BFloat16Bits())
#: name -> kind, for ``shards show`` and the docs table
KINDS: dict[str, FieldKind] = {k.name: k for k in (TOKENS, LABELS, CODES, WAVEFORM, OFFSETS, SEGMENTS, LATENTS,
                                                   FEATURES, BF16_BITS)}


# ------------------------------------------------------------------------------ value checks

#: float itemsize -> the exponent bits (all set: NaN or inf) as an unsigned int of that size
_EXPONENT_MASK = {2: np.uint16(0x7C00), 4: np.uint32(0x7F800000), 8: np.uint64(0x7FF0000000000000)}


class ValueCheck:
    """A check of one field's values, made by its kind (:meth:`FieldKind.value_check`), handed to
    readers as ``value_checks`` (picklable: DataLoader workers get it). Subclasses implement
    :meth:`find` on a non-empty array; compare by value (frozen dataclasses)."""

    def problem(self, arr: np.ndarray | None) -> str | None:
        """Why ``arr`` breaks the check (a short text naming the first bad value), or None
        (also for None and empty arrays)."""
        if arr is None or not np.asarray(arr).size:
            return None
        return self.find(np.asarray(arr))

    def find(self, a: np.ndarray) -> str | None:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class InRange(ValueCheck):
    """Values in ``[lo, hi)`` (codes ``[0, codebook_size)``, ids ``[0, vocab_size)``). One reduction
    and no temporaries in the common case: ``[0, hi)`` on a signed int array is ``max(view as
    unsigned) < hi`` (negative values wrap to huge ones)."""

    lo: int
    hi: int

    def find(self, a):
        lo, hi = self.lo, self.hi
        if (lo == 0 and a.dtype.kind == "i" and a.flags.c_contiguous and hi <= 1 << (8 * a.dtype.itemsize - 1)):
            ok = a.reshape(-1).view(a.dtype.str.replace("i", "u")).max() < hi
        else:
            ok = a.min() >= lo and a.max() < hi
        if ok:
            return None
        bad = a[(a < lo) | (a >= hi)]
        return f"value {bad.flat[0].item()} outside [{lo}, {hi}) ({bad.size} such value(s))"


@dataclass(frozen=True)
class LabelIds(ValueCheck):
    """Label ids: each in ``[0, vocab_size)`` or :data:`IGNORE_INDEX`."""

    vocab_size: int

    def find(self, a):
        ok = a >= 0
        bad = a[(~ok & (a != IGNORE_INDEX)) | (ok & (a >= self.vocab_size))]
        return None if not bad.size else \
            f"label {bad.flat[0].item()} neither {IGNORE_INDEX} nor in [0, {self.vocab_size}) ({bad.size} such value(s))"


@dataclass(frozen=True)
class Finite(ValueCheck):
    """Floats without NaN/inf (``max(bits & exponent mask) < exponent mask``: NaN/inf have every
    exponent bit set) and, for floats wider than 2 bytes, within ``+-max_abs`` (None: no bound) so
    they fit float16. Integer arrays pass."""

    max_abs: float | None = None

    def find(self, a):
        if a.dtype.kind != "f":
            return None
        mask = _EXPONENT_MASK.get(a.dtype.itemsize)
        if mask is not None and a.flags.c_contiguous:
            finite = int(np.bitwise_and(a.reshape(-1).view(mask.dtype), mask).max()) < int(mask)
        else:
            finite = bool(np.isfinite(a).all())
        if not finite:
            return f"has {int(a.size - np.isfinite(a).sum())} non-finite value(s) (NaN/inf)"
        limit = self.max_abs
        if limit is not None and a.dtype.itemsize > 2 and float(np.abs(a).max()) > limit:
            return f"values beyond +-{limit:g} (largest {float(np.abs(a).max()):.4g}) overflow float16"
        return None


@dataclass(frozen=True)
class Bf16Finite(ValueCheck):
    """bfloat16 bit patterns (int16) without NaN/inf (exponent bits all set)."""

    def find(self, a):
        bits = np.ascontiguousarray(a).reshape(-1).view(np.uint16) & np.uint16(BF16_EXPONENT)
        bad = int((bits == BF16_EXPONENT).sum())
        return None if not bad else f"has {bad} non-finite bfloat16 value(s) (NaN/inf)"


# ------------------------------------------------------------------------------ copying

#: a copy_ of 32768 elements or more opens an OpenMP parallel region; below: serial
_PIECE = 32767


def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src``; float16 -> float32 of a large array through torch (faster than numpy)."""
    if dst.dtype == np.float32 and src.dtype == np.float16 and src.size > 4096:
        import torch
        copy_serial(torch.from_numpy(dst), src)
    else:
        dst[...] = src


def serial(op, dst, src) -> None:
    """``op(dst, src)`` (torch tensors of one shape, e.g. a cast copy) on the calling thread: in
    pieces below the grain size at which torch opens an OpenMP parallel region, when it would (see
    :func:`copy_serial`: on busy cores a parallel region costs more than it saves)."""
    import torch
    if dst.numel() <= _PIECE or torch.get_num_threads() == 1 or not (dst.is_contiguous() and src.is_contiguous()):
        op(dst, src)
        return
    for a, b in zip(dst.view(-1).split(_PIECE), src.view(-1).split(_PIECE)):
        op(a, b)


def copy_serial(dst, src: np.ndarray) -> None:
    """``dst.copy_(src)`` (a torch tensor from a numpy array; dtype conversion allowed) on the
    calling thread.

    A copy_ of 32768 elements or more opens an OpenMP parallel region. Per sample that costs more
    than it saves (docs/benchmarks.md), and when the cores
    are busy (DataLoader workers, other jobs) waking the pool can cost a scheduler time slice
    (ms) per call. With more than one intra-op thread we copy in pieces below the grain size.
    torch's strided copy converts float16 faster than numpy's.
    """
    import torch
    s = torch.from_numpy(np.ascontiguousarray(src)).reshape(-1)
    if dst.is_contiguous():
        d = dst.view(-1)
        if d.numel() <= _PIECE or torch.get_num_threads() == 1:
            d.copy_(s)
            return
        for a, b in zip(d.split(_PIECE), s.split(_PIECE)):
            a.copy_(b)
    else:
        dst.copy_(s.view(dst.shape))


def _inside(dims: np.ndarray, S: Sequence[int]) -> np.ndarray:
    """bool ``(B, *S)``: True on the cells of row ``j`` inside its corner ``[:dims[j, 0], :dims[j, 1], ...]``
    (``dims`` int64 ``(B, len(S))``), one broadcast comparison per axis."""
    n, out = len(S), None
    for a, size in enumerate(S):
        shape = [1] * (n + 1)
        shape[a + 1] = int(size)
        cmp = np.arange(int(size)).reshape(shape) < dims[:, a].reshape((-1,) + (1,) * n)
        out = cmp if out is None else out & cmp
    return out


def _pad_tails(row: np.ndarray, shape: tuple[int, ...], pad: Any) -> None:
    """Write ``pad`` into every cell of ``row`` outside ``row[:shape[0], :shape[1], ...]``, each once."""
    lead: tuple = ()
    for ax, d in enumerate(shape):
        if d < row.shape[ax]:
            row[lead + (slice(d, None),)] = pad
        lead = lead + (slice(0, d),)


__all__ = ["FieldKind", "BatchContext", "Tokens", "Codes", "Waveform", "Offsets", "Rows", "Latents", "Features",
           "BFloat16Bits", "TOKENS", "LABELS", "CODES", "WAVEFORM", "OFFSETS", "SEGMENTS", "LATENTS", "FEATURES",
           "BF16_BITS", "KINDS", "PAD_TEXT", "PAD_LAST", "PCM16_SCALE", "PCM16_FULL_SCALE",
           "IGNORE_INDEX", "ValueCheck", "InRange", "LabelIds", "Finite", "Bf16Finite", "copy_serial", "serial"]
