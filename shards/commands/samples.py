"""``shards head``, ``shards show`` and ``shards export-audio``: look at individual samples."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..reader import ShardReader
from ..schema import WHOLE_MEMBER_DTYPES
from ..writing import cache_holding
from ._common import (SCALAR_COLUMNS, NotFound, Out, UsageError, fmt_bytes, fmt_value, open_output, readable,
                      read_index_columns, read_index_head)
from .needs import Needs


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "head", parents=[common], help="show the first N samples in full",
        description="Show the first N samples of the index: every index field, every member with "
                    "dtype, shape and value range (min/max; mean/std for float latents), the text "
                    "and the metadata JSON.")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.add_argument("-n", type=int, default=5, metavar="N", help="number of samples (default: 5)")
    p.set_defaults(func=cmd_head)

    p = sub.add_parser(
        "show", parents=[common], help="show samples by key",
        description="Show samples by key: every index field, every member with dtype, shape and "
                    "value range (min/max; mean/std for float latents), the text and the metadata "
                    "JSON.")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.add_argument("keys", nargs="+", metavar="KEY", help="sample key(s) as stored in the index")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "export-audio", parents=[common], help="write a sample's cached waveform as WAV",
        description="Write the cached int16 waveform (audio.npy) of one sample at its sample rate "
                    "as a 16-bit PCM file; the format follows the extension (.wav, .flac, ...).")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.add_argument("key", metavar="KEY", help="sample key")
    p.add_argument("output", metavar="OUT", type=Path, help="output file, e.g. out.wav")
    p.set_defaults(func=cmd_export_audio, needs=Needs(("soundfile",), "inspect"))


# ----------------------------------------------------------------------------------- reading

def rows_for_keys(d: Path, keys: Sequence[str]) -> pa.Table:
    """Index rows of ``keys`` in the order given; :class:`NotFound` names any missing key."""
    table = read_index_columns(d, None, filter=pc.field("key").isin(list(keys)))
    found = table.column("key").to_pylist()
    pos = {k: i for i, k in enumerate(found)}
    missing = [k for k in keys if k not in pos]
    if missing:
        shown = ", ".join(repr(k) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise NotFound(f"no sample {shown} in {d / 'index.parquet'} "
                       f"(`shardcache shards query {d} \"key == '...'\"` or `shards head {d}` list keys)")
    return table.take(pa.array([pos[k] for k in keys], pa.int64()))


def array_stats(arr: np.ndarray) -> dict[str, Any]:
    """min/max of an array; for floating arrays also mean/std and the count of non-finite values."""
    if arr.size == 0:
        return dict(min=None, max=None)
    if np.issubdtype(arr.dtype, np.floating):
        a = arr.astype(np.float64)
        finite = np.isfinite(a)
        non_finite = int(a.size - int(finite.sum()))
        if non_finite:
            a = a[finite]
        if a.size == 0:
            return dict(min=None, max=None, mean=None, std=None, non_finite=non_finite)
        return dict(min=float(a.min()), max=float(a.max()), mean=float(a.mean()),
                    std=float(a.std()), non_finite=non_finite)
    return dict(min=int(arr.min()), max=int(arr.max()))


def describe(reader: ShardReader, i: int, row: dict) -> dict[str, Any]:
    """Everything about index row ``i`` of ``reader``: fields, members with value ranges, text, JSON."""
    sample = reader.get(i)
    members = []
    for m in row["members"]:
        name = m["name"]
        entry = dict(name=name, dtype=m["dtype"], shape=list(m["shape"]), bytes=m["size"],
                     offset=m["offset"], member=m.get("member"))
        if name.endswith(".npy"):
            entry.update(array_stats(sample[name[:-4]]))
        members.append(entry)
    meta = sample.get("json", {})
    return dict(key=row["key"], shard=row["shard"],
                fields={c: row[c] for c in SCALAR_COLUMNS if c not in ("key", "shard")},
                members=members, text=meta.get("text") if isinstance(meta, dict) else None,
                json=meta)


def describe_table(d: Path, table: pa.Table) -> list[dict]:
    reader = ShardReader(d, index=table)
    try:
        return [describe(reader, i, row) for i, row in enumerate(table.to_pylist())]
    finally:
        reader.close()


def render(out: Out, s: dict) -> None:
    out.heading(f"{s['key']}  ({s['shard']})")
    f = s["fields"]
    out.kv([
        ("duration", f"{f['duration_s']:.3f} s"),
        ("sample rate", f"{f['sample_rate']} Hz"),
        ("num samples", fmt_value(f["num_samples"])),
        ("code frames", f"{f['n_frames']} x {f['n_codebooks']} codebooks"),
        ("text tokens", fmt_value(f["n_text_tokens"])),
        ("has image", fmt_value(f["has_image"])),
        ("speaker", f["speaker"] or "-"),
        ("bytes", f"{f['bytes']} ({fmt_bytes(f['bytes'])})"),
        ("sha256", f["sha256"]),
    ])
    out.table(["member", "dtype", "shape", "bytes", "min", "max", "mean", "std"],
              [[m["name"], _dtype_name(m["dtype"]), tuple(m["shape"]) if m["dtype"] not in WHOLE_MEMBER_DTYPES else "-",
                m["bytes"], m.get("min"), m.get("max"), m.get("mean"), m.get("std")]
               for m in s["members"]])
    bad = [m for m in s["members"] if m.get("non_finite")]
    for m in bad:
        out.line(f"warning: {m['name']} has {m['non_finite']} non-finite values", style="bold red")
    out.line(f"text: {s['text']!s}" if s["text"] is not None else "text: -")
    out.line("json:")
    out.json_block(s["json"])


def _dtype_name(dtype: str) -> str:
    """``"<i2"`` -> ``"int16"``; ``json``/``bytes`` and unknown strings unchanged."""
    if dtype in WHOLE_MEMBER_DTYPES:
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        return dtype


def _emit(out: Out, samples: list[dict]) -> None:
    if out.json:
        out.emit_json(samples)
        return
    for i, s in enumerate(samples):
        if i:
            out.line()
        render(out, s)


# ---------------------------------------------------------------------------------- commands

def cmd_head(args: argparse.Namespace) -> int:
    if args.n < 0:
        raise UsageError("-n must be >= 0")
    out = Out(args)
    d = readable(args.dir)
    table = read_index_head(d, args.n)
    _emit(out, describe_table(d, table))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    out = Out(args)
    d = readable(args.dir)
    _emit(out, describe_table(d, rows_for_keys(d, args.keys)))
    return 0


def cmd_export_audio(args: argparse.Namespace) -> int:
    import soundfile as sf

    out = Out(args)
    d = readable(args.dir)
    path: Path = args.output
    ext = path.suffix.lstrip(".").upper()
    formats = sf.available_formats()
    if ext not in formats:
        raise UsageError(f"{path}: unknown audio format {path.suffix!r}; use .wav or .flac")
    if not sf.check_format(ext, "PCM_16"):
        raise UsageError(f"{path}: format {ext} cannot hold 16-bit PCM; use .wav or .flac")
    if not path.parent.is_dir():
        raise UsageError(f"{path.parent}: no such directory")
    table = rows_for_keys(d, [args.key])
    row = table.to_pylist()[0]
    reader = ShardReader(d, index=table)
    try:
        sample = reader.get(0)
        if "audio" not in sample:
            raise NotFound(f"sample {args.key!r} in {row['shard']} has no audio.npy member")
        audio = np.array(sample["audio"])  # copy out of the memory map
        meta = sample.get("json") or {}
    finally:
        reader.close()
    sr = int(row["sample_rate"] or (meta.get("sample_rate") if isinstance(meta, dict) else 0) or 0)
    if sr <= 0:
        raise NotFound(f"sample {args.key!r} in {row['shard']} has no sample rate in its index row "
                       "or metadata")
    if audio.ndim != 1:
        raise NotFound(f"sample {args.key!r}: audio.npy has shape {audio.shape}, expected (num_samples,)")
    with open_output(path, d) as f:  # refuses, by descriptor, any file or folder of the cache
        try:
            sf.write(f, audio, sr, format=ext, subtype="PCM_16")
        except (RuntimeError, OSError, TypeError, ValueError) as e:
            raise UsageError(f"{path}: cannot write it ({e})") from e
    result = dict(key=args.key, path=str(path), sample_rate=sr, num_samples=int(audio.shape[0]),
                  duration_s=audio.shape[0] / sr)
    if out.json:
        out.emit_json(result)
    else:
        out.line(f"wrote {path}: {args.key}, {result['num_samples']} samples at {sr} Hz "
                 f"({result['duration_s']:.3f} s, 16-bit PCM)")
    return 0
