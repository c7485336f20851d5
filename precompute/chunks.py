"""The job's work units: chunks of manifest rows, each one shard, and how a rank streams its own.

:func:`plan_chunks` cuts the manifest's ``N`` rows into ``ceil(N / per_shard)`` chunks of equal size (give
or take one row: 268 rows at 256 per shard become 134 + 134, not 256 + 12, so readers that split by shard
stay balanced); chunk ``j`` becomes ``shard-{j:06d}.tar``, whatever the number of ranks, kills and reruns (a
committed chunk is skipped). Rows added to the manifest after a chunk was committed (incremental runs) go,
in order, into new chunks numbered after every chunk there is. A :class:`Chunk` holds its rows' positions
(numpy), not the rows.

A rank's chunks are read from the manifest as it encodes them (:class:`ChunkRows`): one pass over the
manifest yields the rows of the chunks whose positions follow each other (:func:`passes`; the chunks of
rows added after a committed chunk may lie between others and take a pass of their own), in encoder
batches of one chunk each (:func:`chunk_batches`). The shard writer gets each chunk's row records
(:class:`ChunkRecords`) from the plan when it starts the chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
from torch.utils.data import Dataset

from shards import schema


@dataclass(frozen=True)
class Chunk:
    """One work unit: ``name`` (``shard-NNNNNN.tar``) and ``positions`` (int64, ascending: the manifest rows
    it holds)."""

    name: str
    positions: np.ndarray

    def __len__(self) -> int:
        return len(self.positions)


def plan_chunks(n: int, per_shard: int, covered: np.ndarray | None = None,
                kept: Iterable[str] = ()) -> list[Chunk]:
    """The chunks still to encode, in manifest order (see the module docstring). ``covered``: bool ``(n,)``,
    the rows held by committed chunks kept (None: none); ``kept``: the stems of those chunks
    (``shard-000003``)."""
    kept = set(kept)
    free = np.ones(n, bool) if covered is None else ~np.asarray(covered, bool)
    n_pos = -(-n // per_shard)
    edges = [j * n // n_pos for j in range(n_pos + 1)] if n_pos else [0]  # sizes differ by <= 1
    todo: list[Chunk] = []
    leftover: list[np.ndarray] = []
    for j in range(n_pos):
        rows = np.flatnonzero(free[edges[j]:edges[j + 1]]) + edges[j]
        if schema.chunk_shard_name(j)[:-4] in kept:
            leftover.append(rows)  # the chunk was committed when the manifest was shorter
        elif len(rows):
            todo.append(Chunk(schema.chunk_shard_name(j), rows.astype(np.int64)))
    rest = np.concatenate(leftover) if leftover else np.zeros(0, np.int64)
    nxt = max([schema.parse_shard_name(stem + ".tar")[1] for stem in kept] + [n_pos - 1]) + 1
    for k in range(0, len(rest), per_shard):
        todo.append(Chunk(schema.chunk_shard_name(nxt + k // per_shard), rest[k:k + per_shard].astype(np.int64)))
    return todo


def passes(chunks: list[Chunk]) -> list[list[Chunk]]:
    """``chunks`` in the order a rank encodes them, grouped into passes over the manifest: in each pass the
    chunks' positions follow each other (each chunk's first row after the previous chunk's last), so one
    read of the manifest yields them chunk by chunk. Chunks that do not fit a pass go to the next one."""
    left = sorted(chunks, key=lambda c: int(c.positions[0]) if len(c) else -1)
    out: list[list[Chunk]] = []
    while left:
        this, rest, end = [], [], -1
        for c in left:
            if len(c) and int(c.positions[0]) > end:
                this.append(c)
                end = int(c.positions[-1])
            elif not len(c):
                this.append(c)
            else:
                rest.append(c)
        out.append(this)
        left = rest
    return out


def chunk_batches(chunk_of_item: list[int], batch_size: int) -> list[list[int]]:
    """Encoder batches: consecutive items of ONE chunk, ``batch_size`` at a time from the chunk's
    start, so a batch never spans two chunks and its rows do not depend on what ran before."""
    out: list[list[int]] = []
    for i, c in enumerate(chunk_of_item):
        if out and chunk_of_item[out[-1][0]] == c and len(out[-1]) < batch_size:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class ChunkRows:
    """The rows of a rank's chunks, read from the manifest as they are needed: iterating yields encoder
    batches ``[(request, chunk index), ...]`` (``batch_size`` rows of one chunk at a time, from the chunk's
    start: :func:`chunk_batches`), chunk after chunk in :attr:`order`. A ``batch_sampler`` of the job's
    DataLoader (:class:`RowsDataset` decodes each item), so no more rows are read than the loader works ahead.

    ``plan``: the :class:`precompute.plan.ManifestPlan`; ``chunks``: this rank's :class:`Chunk` list."""

    def __init__(self, plan: Any, chunks: list[Chunk], batch_size: int):
        self.plan, self.batch_size = plan, int(batch_size)
        self.order: list[Chunk] = [c for p in passes(chunks) for c in p]
        self._passes = passes(chunks)

    def __len__(self) -> int:
        return sum(-(-len(c) // self.batch_size) for c in self.order)

    @property
    def rows(self) -> int:
        """Rows of all the chunks."""
        return sum(len(c) for c in self.order)

    def __iter__(self) -> Iterator[list[tuple[Any, int]]]:
        base = 0
        for group in self._passes:  # one read of the manifest per pass; its chunks' rows come in order
            rows = self.plan.requests(p for c in group for p in c.positions.tolist())
            for k, c in enumerate(group):
                batch: list[tuple[Any, int]] = []
                for _ in range(len(c)):
                    batch.append((next(rows)[1], base + k))
                    if len(batch) == self.batch_size:
                        yield batch
                        batch = []
                if batch:
                    yield batch
            rows.close()
            base += len(group)

    def first(self, n: int) -> list:
        """The first ``n`` requests this rank encodes (the worker-count probe's rows)."""
        out: list = []
        for batch in self:
            out += [req for req, _ in batch]
            if len(out) >= n:
                break
        return out[:n]


class ChunkRecords:
    """``[(shard name, [RowRecord of each row])]`` of a rank's chunks in the order it encodes them, each
    chunk's records made from the plan when the writer comes to it (:class:`precompute.writer.ChunkWriter`'s
    ``chunks``: iterated once, in the writer)."""

    def __init__(self, plan: Any, order: list[Chunk]):
        self.plan, self.order = plan, order

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[tuple[str, list]]:
        plan = self.plan.view()
        for c in self.order:
            yield c.name, plan.records(c.positions.tolist())


class RowsDataset(Dataset):
    """The DataLoader's dataset over the items :class:`ChunkRows` yields: ``dataset[(request, chunk)]`` is
    the decoded row (:class:`precompute.prepare.Preparer`). ``progress``: a :class:`precompute.faults.WorkerPids`
    told which row (its manifest position, ``request.row``) each decode worker is on, for the stall deadline;
    None: not told."""

    def __init__(self, preparer: Any, progress: Any = None):
        self.preparer, self.progress = preparer, progress

    def __getitem__(self, item: tuple[Any, int]) -> Any:
        if self.progress is None:
            return self.preparer(*item)
        self.progress.begin(item[0].row)
        try:
            return self.preparer(*item)
        finally:
            self.progress.end()


__all__ = ["Chunk", "ChunkRecords", "ChunkRows", "RowsDataset", "chunk_batches", "passes", "plan_chunks"]
