"""Cache-level figures: padding waste with and without length bucketing, bytes on disk per sample.

Both are measured on a real cache (the demo, or real-mini when present), in one run.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from loaders import Order, ShardLoader
from shards import read_index
from shards.schema import WHOLE_MEMBER_DTYPES


def padding_waste(cache: Path, batch_size: int = 16, max_frames: int | None = None) -> dict | None:
    """Padded vs real codes frames over one epoch: fixed batches vs budget batches with buckets.

    ``max_frames`` defaults to ``batch_size * median frames`` so both modes hold about the same
    number of frames per batch.
    """
    frames = np.asarray(read_index(cache).column("n_frames").to_pylist())
    frames = frames[frames > 0]
    if not len(frames):
        return None  # no codes (an image-text cache)
    budget = max_frames or int(batch_size * np.median(frames))
    out = {}
    for name, order in (("fixed", Order(drop_remainder=False)), ("bucketed", Order(max_frames=budget, drop_remainder=False))):
        loader = ShardLoader(cache, min(batch_size, len(frames)), fields=("codes",), order=order)
        loader.set_epoch(0)
        real = padded = batches = 0
        for batch in loader:
            mask = batch["codes_mask"]
            real += int(mask.sum())
            padded += int(mask.numel())
            batches += 1
        out[name] = {"batches": batches, "real_frames": real, "padded_frames": padded,
                     "waste": round(1 - real / padded, 4)}
    out["max_frames"] = budget
    return out


def bytes_on_disk(cache: Path) -> dict:
    """Shard bytes per sample vs the raw tensor bytes they hold (tar + npy header overhead)."""
    index = read_index(cache).to_pylist()
    raw = sum(m["size"] for r in index for m in r["members"] if m["dtype"] not in WHOLE_MEMBER_DTYPES)
    meta = sum(m["size"] for r in index for m in r["members"] if m["dtype"] == "json")
    disk = sum(p.stat().st_size for p in cache.glob("shard-*.tar"))
    n = max(1, len(index))
    return {"samples": len(index), "disk_bytes_per_sample": round(disk / n), "tensor_bytes_per_sample": round(raw / n),
            "json_bytes_per_sample": round(meta / n), "disk_over_tensor": round(disk / max(1, raw), 3)}
