"""``shards stats``: distributions of durations, code frames, text lengths and latent channels."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..reader import ShardReader
from ._common import Out, UsageError, open_output, read_index_columns, readable, warn
from .needs import DUCKDB, PLOT, require

#: index column -> (label in tables, axis label in the plot)
DISTRIBUTIONS = {
    "duration_s": ("duration (s)", "duration (seconds)"),
    "n_frames": ("code frames", "codec frames per sample"),
    "n_text_tokens": ("text tokens", "text length (tokens)"),
}
PERCENTILES = (5, 25, 50, 75, 95)


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "stats", parents=[common], help="distributions of durations, frames, text lengths, latents",
        description="Distributions (count, mean, std, min, percentiles, max) of audio durations, "
                    "codec frames and text lengths over the index, and per-channel mean/std of the "
                    "VAE latents of up to --max_samples image samples (read from the shards). "
                    "--plot writes a PNG with histograms and the per-channel latent mean +- std.")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.add_argument("--plot", type=Path, metavar="PNG", help="write histograms to this PNG file")
    p.add_argument("--max_samples", type=int, default=500, metavar="N",
                   help="image samples to read latents from (default: %(default)s; 0 skips latents)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for choosing which image samples to read (default: %(default)s)")
    p.add_argument("--where", metavar="SQL",
                   help="only rows matching this SQL condition (see `shardcache shards query --help`)")
    p.set_defaults(func=cmd_stats, needs=DUCKDB)


def distribution(values: np.ndarray) -> dict[str, Any]:
    """count, mean, std, min, percentiles and max of ``values`` (None where empty)."""
    values = np.asarray(values, dtype=np.float64)
    out: dict[str, Any] = dict(count=int(values.size))
    if values.size == 0:
        out.update(mean=None, std=None, min=None, **{f"p{p}": None for p in PERCENTILES}, max=None)
        return out
    pct = np.percentile(values, PERCENTILES)
    out.update(mean=float(values.mean()), std=float(values.std()), min=float(values.min()),
               **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}, max=float(values.max()))
    return out


def latent_stats(d: Path, image_rows: pa.Table, max_samples: int, seed: int) -> dict[str, Any]:
    """Per-channel mean/std/min/max of the latents of up to ``max_samples`` random image rows.

    Statistics are pooled over every (T, H, W) position of every chosen sample (float64, Chan's
    parallel update). Samples whose channel count differs from the first one's are skipped.
    """
    n = image_rows.num_rows
    result: dict[str, Any] = dict(image_samples=n, samples_read=0, channels=[], shapes={},
                                  skipped=0, non_finite=0)
    if n == 0 or max_samples <= 0:
        return result
    k = min(n, max_samples)
    chosen = np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False)) if k < n else np.arange(n)
    rows = image_rows.take(pa.array(chosen, pa.int64()))
    reader = ShardReader(d, index=rows)
    count = mean = m2 = lo = hi = None
    channels = None
    shapes: dict[str, int] = {}
    try:
        for i in range(rows.num_rows):
            lat = reader.get(i).get("latents")
            if lat is None:
                continue
            shapes[str(tuple(lat.shape))] = shapes.get(str(tuple(lat.shape)), 0) + 1
            c = lat.shape[0] if lat.ndim else 0
            if channels is None:
                channels = c
                count = np.zeros(c)
                mean, m2 = np.zeros(c), np.zeros(c)
                lo, hi = np.full(c, np.inf), np.full(c, -np.inf)
            if c != channels or c == 0:
                result["skipped"] += 1
                continue
            x = np.asarray(lat, dtype=np.float64).reshape(c, -1)
            finite = np.isfinite(x)
            if not finite.all():
                result["non_finite"] += int((~finite).sum())
            nb = finite.sum(axis=1).astype(np.float64)
            mb = np.where(finite, x, 0.0).sum(axis=1) / np.maximum(nb, 1)
            m2b = (np.where(finite, x - mb[:, None], 0.0) ** 2).sum(axis=1)
            tot = count + nb
            delta = mb - mean
            mean = mean + delta * nb / np.maximum(tot, 1)
            m2 = m2 + m2b + delta ** 2 * count * nb / np.maximum(tot, 1)
            count = tot
            lo = np.minimum(lo, np.where(finite, x, np.inf).min(axis=1))
            hi = np.maximum(hi, np.where(finite, x, -np.inf).max(axis=1))
            result["samples_read"] += 1
    finally:
        reader.close()
    result["shapes"] = shapes
    if channels:
        std = np.sqrt(np.where(count > 0, m2 / np.maximum(count, 1), np.nan))
        result["channels"] = [
            dict(channel=j, mean=float(mean[j]) if count[j] else None,
                 std=float(std[j]) if count[j] else None,
                 min=float(lo[j]) if count[j] else None, max=float(hi[j]) if count[j] else None)
            for j in range(channels)]
    return result


def cmd_stats(args: argparse.Namespace) -> int:
    out = Out(args)
    from .query import _local, refuse_while_written
    refuse_while_written(_local(args.dir), "no statistics of it (its index is half-written)")
    d = readable(args.dir)
    if args.max_samples < 0:
        raise UsageError("--max_samples must be >= 0")
    if args.plot is not None:
        require(PLOT, "--plot")
        _check_plot_path(args.plot)
    from .query import select
    table = select(d, args.where, ["key"] + list(DISTRIBUTIONS) + ["has_image"])
    dists = {col: distribution(table.column(col).to_numpy(zero_copy_only=False)) for col in DISTRIBUTIONS}
    latents = dict(image_samples=int(pc.sum(table.column("has_image")).as_py() or 0), samples_read=0,
                   channels=[], shapes={}, skipped=0, non_finite=0)
    if args.max_samples > 0 and latents["image_samples"]:
        keys = table.filter(table.column("has_image")).column("key")
        image_rows = read_index_columns(d, ["key", "shard", "members"], filter=pc.field("key").isin(keys))
        latents = latent_stats(d, image_rows, args.max_samples, args.seed)
    result = dict(dir=str(d), where=args.where, samples=table.num_rows, distributions=dists,
                  latents=latents)
    if args.plot is not None:
        values = {col: table.column(col).to_numpy(zero_copy_only=False) for col in DISTRIBUTIONS}
        plot(args.plot, d, values, latents, where=args.where)
        result["plot"] = str(args.plot)
    if latents["skipped"]:
        warn(f"{latents['skipped']} latent(s) with a different channel count were skipped")
    if latents["non_finite"]:
        warn(f"{latents['non_finite']} non-finite latent values (NaN/inf) were left out of the statistics")
    if out.json:
        out.emit_json(result)
        return 0
    cols = ["quantity", "count", "mean", "std", "min"] + [f"p{p}" for p in PERCENTILES] + ["max"]
    out.table(cols, [[DISTRIBUTIONS[c][0]] + [dists[c][k] for k in cols[1:]] for c in DISTRIBUTIONS],
              title=f"{table.num_rows} samples" + (f" where {args.where}" if args.where else ""))
    out.line()
    if latents["channels"]:
        shapes = ", ".join(f"{s} x{n}" for s, n in latents["shapes"].items())
        out.table(["channel", "mean", "std", "min", "max"],
                  [[c["channel"], c["mean"], c["std"], c["min"], c["max"]] for c in latents["channels"]],
                  title=f"latents: {latents['samples_read']} of {latents['image_samples']} image "
                        f"samples read (shapes {shapes})")
    else:
        out.line(f"latents: {latents['image_samples']} image samples"
                 + (", none read (--max_samples 0)" if latents["image_samples"] else ""))
    if args.plot is not None:
        out.line(f"wrote {args.plot}")
    return 0


def _check_plot_path(path: Path) -> None:
    if not path.parent.is_dir():
        raise UsageError(f"{path}: directory {path.parent} does not exist")
    if path.suffix.lower() not in (".png", ""):
        raise UsageError(f"{path}: --plot writes a PNG; name the file *.png")


def plot(path: Path, d: Path, values: dict[str, np.ndarray], latents: dict[str, Any],
         where: str | None = None) -> None:
    """Write a 2x2 PNG to ``path``: histograms of durations, frames, text lengths; latent mean +- std.
    ``path`` is opened with :func:`~._common.open_output` (no file or folder of cache ``d``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(12, 8), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    titles = {"duration_s": "Audio duration", "n_frames": "Codec frames",
              "n_text_tokens": "Text length"}
    n = len(next(iter(values.values()))) if values else 0
    for ax, col in zip(axes.flat, DISTRIBUTIONS):
        v = np.asarray(values[col], dtype=np.float64)
        if v.size:
            bins = int(min(60, max(5, np.sqrt(v.size) * 2)))
            ax.hist(v, bins=bins, color="tab:blue", edgecolor="white", linewidth=0.5)
            med = float(np.median(v))
            ax.axvline(med, color="tab:orange", linestyle="--", linewidth=1.2, label=f"median {med:.4g}")
            ax.legend(loc="upper right", fontsize=8)
            ax.set_title(f"{titles[col]} (n={v.size}, mean {v.mean():.4g})")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            ax.set_title(titles[col])
        ax.set_xlabel(DISTRIBUTIONS[col][1])
        ax.set_ylabel("samples")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    ax = axes.flat[3]
    chans = [c for c in latents.get("channels", []) if c["mean"] is not None]
    if chans:
        x = [c["channel"] for c in chans]
        ax.errorbar(x, [c["mean"] for c in chans], yerr=[c["std"] for c in chans], fmt="o",
                    capsize=3, color="tab:green", ecolor="tab:gray", label="mean ± std")
        ax.axhline(0.0, color="black", linewidth=0.6)
        ax.set_xticks(x)
        ax.legend(loc="upper right", fontsize=8)
        ax.set_title(f"VAE latents per channel ({latents['samples_read']} image samples)")
    else:
        ax.text(0.5, 0.5, "no image latents in this cache" if not latents.get("image_samples")
                else "latents not read (--max_samples 0)",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_title("VAE latents per channel")
    ax.set_xlabel("latent channel")
    ax.set_ylabel("value (mean ± std)")
    ax.grid(True, alpha=0.3)
    seconds = float(np.sum(values.get("duration_s", [])))
    total = f"{seconds / 3600:.2f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min"
    fig.suptitle(f"shardcache {d.resolve().name}: {n} samples, {total} of audio"
                 + (f" (where {where})" if where else ""))
    fig.tight_layout()
    with open_output(path, d) as f:
        fig.savefig(f, format="png")
