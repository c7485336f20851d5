"""The loader's half of streaming a remote cache: which files each step of this rank's plan reads.

The mirror itself (the local folder, downloads, the prefetch thread and its evictions) is the format's
(:mod:`shards.mirror`); the plan is the loader's: :func:`file_uses` tells the
:class:`shards.mirror.Prefetcher` which file every step needs, in order.
"""
from __future__ import annotations

import numpy as np


def file_uses(plan, rank: int, sources) -> dict[tuple[int, str], np.ndarray]:
    """``(source index, file name) -> sorted int64 steps`` of ``plan`` whose batch on ``rank``
    reads that file (its shard, and the sidecar tar of each sidecar field read). Vectorised."""
    batches = [np.asarray(plan.rank_batch(s, rank), dtype=np.int64) for s in range(plan.n_steps)]
    ids = np.concatenate(batches) if batches else np.zeros(0, np.int64)
    step = np.repeat(np.arange(len(batches), dtype=np.int64), [len(b) for b in batches])
    which = np.searchsorted(sources.offsets, ids, side="right") - 1
    out: dict[tuple[int, str], np.ndarray] = {}
    for i in np.unique(which).tolist():
        src = sources.sources[i]
        sel = which == i
        files = src.row_files()[ids[sel] - sources.offsets[i]]            # (m, k) file numbers
        n_files = len(src.reader.files)
        pairs = np.unique((np.repeat(step[sel], files.shape[1]) * n_files + files.reshape(-1)))
        steps, nums = pairs // n_files, pairs % n_files
        order = np.lexsort((steps, nums))
        steps, nums = steps[order], nums[order]
        bounds = np.flatnonzero(np.diff(nums)) + 1
        for grp_steps, grp_nums in zip(np.split(steps, bounds), np.split(nums, bounds)):
            if len(grp_nums):
                out[(i, src.reader.files[int(grp_nums[0])])] = grp_steps
    return out


__all__ = ["file_uses"]
