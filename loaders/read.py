"""A batch read straight into its tensors: one copy from the page cache, padding written once.

:func:`read_batch` builds the same batch as :func:`loaders.collate.collate_views` over the same
samples (the tests compare them), without numpy views of mapped files in between:

1. shapes and presence of every field come from the index (:class:`shards.reader.FieldArrays`),
   so the padded shape ``S``, the batch layout, the lengths and the masks are known before a byte
   is read (each field's kind: :meth:`~shards.kinds.FieldKind.batch_shape`, ``layout``,
   ``fill_lengths_mask``);
2. the batch tensors are laid out in one reused block (a worker's shared-memory slot, or in the
   loader's own process a host block, pinned when the loader pins: :func:`loaders.collate.allocate`);
3. each field's kind says where each sample's values land (:meth:`~shards.kinds.FieldKind.runs`),
   and :meth:`shards.ShardReader.read_into` copies them there with one ``preadv`` per sample
   (usually: adjacent members of a sample are read in one call) and checks each member's XXH3-64
   against the index while it is still in cache, the whole batch in one call that holds no GIL
   where the native reader is built (:mod:`shards.readinto`);
4. fields whose batch dtype is not the stored one (``compact=False``: float32 audio and latents,
   int64 ids and codes) are read into a reused buffer in the stored dtype and widened into the
   batch member by member by the native reader (:meth:`~shards.kinds.FieldKind.host_widening`),
   else in one vectorised pass per field after the read (:meth:`~shards.kinds.FieldKind.widen_host`);
5. padding is written once, outside each sample's corner (:meth:`~shards.kinds.FieldKind.pad`).

``checks="values"`` asks for the kinds' value checks (codes and ids in range, floats finite)
instead of checksums, ``"none"`` for nothing (benchmarks).
A field whose samples are stored with another dtype than the format's (never written by this
project) is read through :meth:`~shards.ShardReader.views` and collated as
:func:`~loaders.collate.collate_views` does.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from shards import fields as registry
from shards.kinds import BatchContext
from shards.readinto import conversion

from .collate import allocate, check_rates
from .settings import CHECKS


class Staging:
    """Reused buffers in the stored dtype for fields that are widened on the host (one per field,
    grown when a batch needs more): the bytes land there, then ``widen_host`` converts them."""

    def __init__(self):
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = int(np.prod(shape, dtype=np.int64))
        t = torch.empty((), dtype=dtype)
        buf = self._bufs.get(name)
        need = n * t.element_size()
        if buf is None or buf.nbytes < need:
            buf = self._bufs[name] = np.empty(max(need, 1), dtype=np.uint8)
        return torch.frombuffer(buf, dtype=dtype, count=n).view(shape) if n else torch.empty(shape, dtype=dtype)


def read_batch(groups: Sequence[tuple[Any, np.ndarray, np.ndarray]], B: int, fields: Sequence[str],
               ctx: BatchContext, *, arena=None, checks: str = "checksums",
               staging: Staging | None = None) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """The collated batch of ``B`` samples and the damaged ones.

    Args:
        groups: ``(source, positions, rows)`` per cache: a :class:`loaders.dataset.CacheSource`,
            the batch positions (int64) its samples take and their rows in its reader's index.
        fields: the fields to collate (registry names), as :func:`loaders.collate.collate_views`.
        ctx: pad id, ``compact``, default shapes (see :class:`shards.kinds.BatchContext`).
        arena: where the batch tensors live: a DataLoader worker's :class:`loaders.shm.SlotArena`,
            the loader process's :class:`loaders.host.HostArena` (pinned where asked), or None.
        checks: :data:`CHECKS`.
        staging: reused host buffers for widened fields (default: new ones).

    Returns ``(batch, problems)``: ``problems`` lists ``(position, message)`` for samples whose
    bytes are not what the index says (checksum mismatch, truncated file, bad value); when it is
    not empty the batch is incomplete and must not be used. Raises :class:`shards.ShardCorrupt`
    for a shard replaced or missing, ``ValueError`` as :func:`~loaders.collate.collate_views`.
    """
    single = len(groups) == 1  # one cache: its rows are the batch's positions in order
    if single:
        src0, _, rows0 = groups[0]
        keys: list[Any] = src0.reader.keys_at(rows0)
        rates = src0.sample_rates(rows0)
    else:
        keys = [None] * B
        rates = np.zeros(B, dtype=np.int64)
        for src, pos, rows in groups:
            for p, k in zip(pos.tolist(), src.reader.keys_at(rows)):
                keys[p] = k
            rates[pos] = src.sample_rates(rows)
    rate = check_rates(keys, rates)
    plans, layout, seen = [], [], set()
    for name in fields:
        f = registry.get(name)
        if single:  # the index arrays at the batch's rows
            fa = src0.reader.field(name, f.ndim)
            shapes, present = fa.shapes(rows0), fa.presence(rows0)
            if not present.all():
                shapes[~present] = f.kind.empty_shape(f, ctx)
        else:
            empty = f.kind.empty_shape(f, ctx)
            shapes = np.empty((B, len(empty)), dtype=np.int64)
            shapes[:] = empty
            present = np.zeros(B, dtype=bool)
            for src, pos, rows in groups:
                fa = src.reader.field(name, f.ndim)
                have = fa.presence(rows)
                shapes[pos[have]] = fa.shapes(rows[have])
                present[pos] = have
        S = f.kind.batch_shape(f, keys, shapes, present, ctx)
        for key, shape, dtype in f.kind.layout(f, B, S, ctx):
            if key not in seen:  # keys shared by several fields (latents_mask) are laid out once
                seen.add(key)
                layout.append((key, shape, dtype))
        plans.append((f, shapes, present, S))
    if any(f.paired_with for f, _, _, _ in plans):
        _check_paired(keys, plans)
    batch: dict[str, Any] = {"keys": keys, "sample_rate": rate}
    batch.update(allocate(layout, arena))
    staging = staging if staging is not None else Staging()
    targets, reads = {}, [[] for _ in groups]
    fallback, widened = [], set()
    for f, shapes, present, S in plans:
        data = batch[f.name]
        stored = f.kind.host_dtype(f, True)
        if not all(_stored_as(src.reader.field(f.name), f) for src, _, _ in groups):
            fallback.append(f.name)
            continue
        conv = None
        if data.dtype != stored:  # read into staging; widened per member by the reader where it can
            target = staging.get(f.name, tuple(data.shape), stored)
            how = conversion(f.kind.host_widening(f), f.dtype, str(data.dtype).removeprefix("torch."))
            if how is not None and data.numel():
                conv = (memoryview(data.numpy()).cast("B"), *how)
                widened.add(f.name)
        else:
            target = data
        targets[f.name] = target
        if not target.numel():
            continue
        sample, src_el, dst_el, n = f.kind.runs(f, shapes, present, S)
        item = target.element_size()
        buf = memoryview(target.numpy()).cast("B")
        if len(groups) == 1:
            reads[0].append((f.name, buf, (sample, src_el * item, dst_el * item, n * item), conv))
            continue
        for g, (src, pos, rows) in enumerate(groups):
            sel = np.isin(sample, pos)
            reads[g].append((f.name, buf, (sample[sel], src_el[sel] * item, dst_el[sel] * item, n[sel] * item),
                             conv))
    problems: list[tuple[int, str]] = []
    for (src, pos, rows), plan in zip(groups, reads):
        if plan:
            at = rows
            if len(groups) > 1:
                at = np.full(B, -1, dtype=np.int64)
                at[pos] = rows
            problems += src.reader.read_into(at, plan, checksums=checks == "checksums")
    if checks != "none":
        problems += _value_problems(groups, plans, targets, checks, {p for p, _ in problems})
    if problems:
        return batch, sorted(problems)
    for f, shapes, present, S in plans:
        if f.name in fallback:
            arrays: list = [None] * B
            for src, pos, rows in groups:
                for p, a in zip(pos.tolist(), src.reader.views(f.name, rows)):
                    arrays[p] = a
            f.kind.fill(f, batch, arrays, shapes, present, S, ctx)
            continue
        data, target = batch[f.name], targets[f.name]
        if target is not data and data.numel() and f.name not in widened:
            f.kind.widen_host(f, data, target)
        f.kind.finish(f, batch, shapes, present, S, ctx)
    return batch, []


def _stored_as(fa, f) -> bool:
    """Every row of the field is stored in the field's dtype (what the format says)."""
    return not fa.dtypes or (len(fa.dtypes) == 1 and fa.dtypes[0] == f.dtype)


def _check_paired(keys: list, plans: list) -> None:
    """A field declared ``paired_with`` another must be held exactly where, and shaped as, that one
    (from the index shapes; the message of :func:`loaders.collate.collate_views`)."""
    by = {f.name: (shapes, present) for f, shapes, present, _ in plans}
    for f, shapes, present, _ in plans:
        if f.paired_with not in by:
            continue
        o_shapes, o_present = by[f.paired_with]
        bad = (present != o_present) | (present & (shapes != o_shapes).any(axis=1))
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            show = lambda s, p: tuple(s[j].tolist()) if p[j] else None  # noqa: E731
            raise ValueError(f"sample {keys[j]!r}: {f.paired_with} {show(o_shapes, o_present)} but {f.name} "
                             f"{show(shapes, present)}; was the cache made with store_posterior?")


def _value_problems(groups, plans, targets, checks: str, known: set) -> list[tuple[int, str]]:
    """Each kind's value checks (:meth:`shards.kinds.FieldKind.value_problem`) on the members read
    unchecked by checksum: all with ``checks="values"``, none with ``"checksums"`` (every member has one)."""
    out = []
    if checks == "checksums":
        return out
    for f, shapes, present, _ in plans:
        target = targets.get(f.name)
        if target is None:
            continue
        for src, pos, rows in groups:
            spec = src.reader.value_checks.get(f.name)
            if spec is None:
                continue
            fa = src.reader.field(f.name)
            todo = fa.presence(rows)
            o = target.numpy()
            for p, r in zip(pos[todo].tolist(), rows[todo].tolist()):
                if p in known:
                    continue
                region = o[p][tuple(slice(0, d) for d in shapes[p].tolist())]
                why = f.kind.value_problem(region, spec)
                if why is not None:
                    known.add(p)
                    at = np.array([r])
                    path = src.reader.io.paths[int(fa.files(at, src.reader.shard_of[at])[0])]
                    out.append((p, f"{path}: sample {src.reader.key(r)!r}: {f.name} {why}; the "
                                   "shard is damaged or was not written for this cache's settings; run "
                                   "`shardcache shards verify --deep`"))
    return out


__all__ = ["read_batch", "Staging", "CHECKS"]
