"""``shards ls``, ``shards info`` and ``shards rejects``: what a cache holds, from its index files."""
from __future__ import annotations

import argparse
import json
import tarfile
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import ShardCorrupt
from ..index import REJECTS_SCHEMA
from ..schema import INDEX_FILE, REASONS, REJECTS_FILE
from ._common import (Out, UsageError, cache_dir, expand_targets, fmt_bytes, fmt_value, readable,
                      load_manifest, manifest_shards, read_index_columns, shard_path, warn)


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "ls", parents=[common], help="list shards with sample counts and sizes",
        description="List the shards of a cache with their sample counts, sizes and sha256. For a "
                    "cache directory this reads only manifest.json (falling back to "
                    "index.parquet); for shard paths or globs it reads the tar headers.")
    p.add_argument("paths", nargs="+", metavar="DIR|SHARD",
                   help="a cache directory, or shard tars: paths and/or globs such as "
                        "'cache/shard-r0000-*.tar' (quote it to let shards expand it)")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser(
        "info", parents=[common], help="summary: samples, hours, images, encoders, rejects",
        description="Summarise a cache: samples, shards, bytes, hours of audio, images, sample "
                    "rates, speakers, encoders and fingerprint (from manifest.json) and rejected "
                    "rows by reason. Reads only manifest.json and a few index/rejects columns.")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "rejects", parents=[common], help="rejected input rows with their reasons",
        description="List the rows that precompute rejected (rejects.parquet): key, source, reason "
                    "code and detail, then the counts by reason. Reason codes: "
                    + ", ".join(REASONS) + ".")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.add_argument("--reason", metavar="CODE", help="only rows with this reason code")
    p.add_argument("--limit", type=int, metavar="N", help="print at most N rows")
    p.set_defaults(func=cmd_rejects)


# ------------------------------------------------------------------------------------------ ls

def count_tar(path: Path) -> tuple[int, int]:
    """``(samples, bytes)`` of a shard tar, reading only its member headers.

    Raises :class:`ShardCorrupt` for an unreadable or truncated tar.
    """
    size = path.stat().st_size
    samples, last = 0, None
    try:
        with tarfile.open(path, mode="r:") as tf:
            for info in tf:
                if not info.isfile():
                    continue
                if info.offset_data + info.size > size:
                    raise ShardCorrupt(f"{path}: truncated inside member {info.name!r}")
                key = info.name.rpartition("/")[2].partition(".")[0]
                if key != last:
                    samples, last = samples + 1, key
    except tarfile.TarError as e:
        raise ShardCorrupt(f"{path}: not a readable tar ({e})") from e
    return samples, size


def cmd_ls(args: argparse.Namespace) -> int:
    out = Out(args)
    d, tars = expand_targets(args.paths)
    errors = 0
    if d is not None:
        manifest = load_manifest(d)
        if "shards" in manifest:
            source = "manifest"
            entries = [dict(path=s["path"], samples=s.get("samples"), bytes=s.get("bytes"),
                            sha256=s.get("sha256")) for s in manifest_shards(manifest, d)]
        else:
            source = "index"
            warn(f"{d}: manifest.json has no shard list; counting from {INDEX_FILE}")
            t = read_index_columns(d, ["shard"]).group_by("shard").aggregate([("shard", "count")])
            entries = []
            for name, n in zip(t.column("shard").to_pylist(), t.column("shard_count").to_pylist()):
                f = shard_path(d, name)
                entries.append(dict(path=name, samples=n,
                                    bytes=f.stat().st_size if f.exists() else None, sha256=None))
        entries.sort(key=lambda e: e["path"])
    else:
        source = "tars"
        entries = []
        for t in tars:
            e = dict(path=str(t), samples=None, bytes=None)
            try:
                e["samples"], e["bytes"] = count_tar(t)
            except (ShardCorrupt, OSError) as exc:
                msg = str(exc) if not isinstance(exc, OSError) else exc.strerror or str(exc)
                e["error"] = msg[len(f"{t}: "):] if msg.startswith(f"{t}: ") else msg
                errors += 1
            entries.append(e)
    total = dict(shards=len(entries), samples=sum(e["samples"] or 0 for e in entries),
                 bytes=sum(e["bytes"] or 0 for e in entries))
    if out.json:
        out.emit_json(dict(dir=str(d) if d else None, source=source, shards=entries, total=total))
    else:
        caption = (f"{total['shards']} shards, {total['samples']} samples, "
                   f"{fmt_bytes(total['bytes'])}" + (f", {errors} unreadable" if errors else ""))
        if source == "tars":
            rows = [[e["path"], e["samples"], fmt_bytes(e["bytes"]) if e["bytes"] is not None else "?"]
                    + ([e.get("error", "")] if errors else []) for e in entries]
            out.table(["shard", "samples", "size"] + (["error"] if errors else []), rows, caption=caption)
        else:
            rows = [[e["path"], e["samples"], fmt_bytes(e["bytes"]),
                     (e["sha256"] or "-")[:16]] for e in entries]
            out.table(["shard", "samples", "size", "sha256"], rows, caption=caption)
    return 1 if errors else 0


# ---------------------------------------------------------------------------------------- info

def _reject_counts(d: Path, manifest: dict) -> dict[str, int]:
    p = d / REJECTS_FILE
    if p.exists():
        try:
            reasons = pq.read_table(p, columns=["reason"], schema=REJECTS_SCHEMA).column("reason")
        except Exception as e:
            raise ShardCorrupt(f"{p}: cannot read ({e})") from e
        return dict(sorted(Counter(reasons.to_pylist()).items(), key=lambda kv: (-kv[1], kv[0])))
    return dict((manifest.get("counts") or {}).get("rejects_by_reason") or {})


def _encoder_summary(value, limit: int = 160) -> str:
    """One line for an encoder entry: name (class) and its scalar settings; --json has it all."""
    if not isinstance(value, dict):
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    else:
        head = str(value.get("name", ""))
        if value.get("class"):
            head += f" ({value['class']})" if head else str(value["class"])
        scalars = [f"{k}={v}" for k, v in value.items()
                   if k not in ("name", "class") and (isinstance(v, (int, float, bool))
                                                      or (isinstance(v, str) and len(v) <= 24))]
        text = ", ".join(x for x in [head] + scalars if x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cmd_info(args: argparse.Namespace) -> int:
    out = Out(args)
    d = readable(args.dir)
    manifest = load_manifest(d)
    shards = manifest_shards(manifest, d) if "shards" in manifest else None
    warnings: list[str] = []
    info: dict = dict(dir=str(d), format_version=manifest.get("format_version"),
                      created=manifest.get("created"))
    if (d / INDEX_FILE).exists():
        t = read_index_columns(d, ["shard", "duration_s", "sample_rate", "has_image", "speaker",
                                   "n_text_tokens", "n_frames"])
        n = t.num_rows
        dur = t.column("duration_s")  # (Arrow compute throughout: no Python object per sample)
        rates = {v["values"]: v["counts"] for v in pc.value_counts(t.column("sample_rate")).to_pylist()}
        speakers = pc.unique(t.column("speaker"))
        info.update(
            samples=n,
            audio_hours=(pc.sum(dur).as_py() or 0.0) / 3600.0,
            mean_duration_s=pc.mean(dur).as_py() if n else None,
            images=int(pc.sum(t.column("has_image")).as_py() or 0),
            sample_rates={int(k): v for k, v in sorted(rates.items())},
            speakers=len(speakers) - int(pc.any(pc.equal(speakers, "")).as_py() or 0),
            text_tokens=int(pc.sum(t.column("n_text_tokens")).as_py() or 0),
            code_frames=int(pc.sum(t.column("n_frames")).as_py() or 0),
        )
        index_shards = set(t.column("shard").unique().to_pylist())
        for name in sorted(index_shards):
            shard_path(d, name)  # UnsafePath for a name that is not a file inside the cache
        if shards is None:
            shards = [dict(path=s) for s in sorted(index_shards)]
        counts = manifest.get("counts") or {}
        if "samples" in counts and counts["samples"] != n:
            warnings.append(f"manifest.json counts {counts['samples']} samples but {INDEX_FILE} "
                            f"has {n} rows; run `shardcache shards verify {d}`")
        missing = index_shards - {s["path"] for s in shards}
        if missing:
            warnings.append(f"{INDEX_FILE} names {len(missing)} shard(s) not in manifest.json, "
                            f"e.g. {sorted(missing)[0]}; run `shardcache shards verify {d}`")
    else:
        counts = manifest.get("counts") or {}
        warnings.append(f"{d / INDEX_FILE} is missing (figures from manifest.json); "
                        f"`shardcache shards reindex {d}` rebuilds it")
        info.update(samples=counts.get("samples"), audio_hours=counts.get("audio_hours"),
                    mean_duration_s=None, images=counts.get("images"), sample_rates=None,
                    speakers=None, text_tokens=None, code_frames=None)
        shards = shards or []
    by_reason = _reject_counts(d, manifest)
    sizes = [s.get("bytes") for s in shards]
    info.update(
        shards=len(shards),
        bytes=sum(b for b in sizes if b) if any(b is not None for b in sizes) or not sizes else None,
        encoders=manifest.get("encoders"),
        fingerprint=manifest.get("fingerprint"),
        rejected=sum(by_reason.values()),
        rejects_by_reason=by_reason,
        other_manifest_fields=sorted(set(manifest) - {
            "format_version", "created", "counts", "shards", "encoders", "fingerprint"}),
        warnings=warnings,
    )
    if out.json:
        out.emit_json(info)
        return 0
    hours = info["audio_hours"]
    pairs: list[tuple[str, str]] = [
        ("cache", str(d)),
        ("format version", fmt_value(info["format_version"])),
        ("created", fmt_value(info["created"])),
        ("samples", f"{info['samples']:,}" if info["samples"] is not None else "?"),
        ("shards", f"{info['shards']:,}"),
        ("size", f"{fmt_bytes(info['bytes'])} ({info['bytes']:,} bytes)" if info["bytes"] is not None else "?"),
        ("audio", (f"{hours:.3f} h" if hours is not None else "?")
         + (f" (mean {info['mean_duration_s']:.2f} s per sample)" if info["mean_duration_s"] else "")),
        ("images", fmt_value(info["images"])),
        ("sample rates", ", ".join(f"{r} Hz ({c})" for r, c in info["sample_rates"].items())
         if info["sample_rates"] else "-"),
        ("speakers", fmt_value(info["speakers"])),
        ("text tokens", f"{info['text_tokens']:,}" if info["text_tokens"] is not None else "-"),
        ("code frames", f"{info['code_frames']:,}" if info["code_frames"] is not None else "-"),
    ]
    encoders = info["encoders"]
    if isinstance(encoders, dict) and encoders:
        for name, value in encoders.items():
            pairs.append((f"encoder {name}", _encoder_summary(value)))
    else:
        pairs.append(("encoders", "-" if encoders is None else json.dumps(encoders, ensure_ascii=False)))
    pairs.append(("fingerprint", fmt_value(info["fingerprint"])))
    pairs.append(("rejected", f"{info['rejected']:,}"))
    for reason, count in by_reason.items():
        pairs.append((f"  {reason}", f"{count:,}"))
    if info["other_manifest_fields"]:
        pairs.append(("manifest also has", ", ".join(info["other_manifest_fields"])))
    out.kv(pairs)
    for w in warnings:
        warn(w)
    return 0


# ------------------------------------------------------------------------------------- rejects

def cmd_rejects(args: argparse.Namespace) -> int:
    out = Out(args)
    d = cache_dir(args.dir)
    p = d / REJECTS_FILE
    if p.exists():
        try:
            table = pq.read_table(p, schema=REJECTS_SCHEMA)
        except Exception as e:
            raise ShardCorrupt(f"{p}: cannot read ({e})") from e
    else:
        warn(f"{p} not found; showing no rejects")
        table = REJECTS_SCHEMA.empty_table()
    by_reason = dict(sorted(Counter(table.column("reason").to_pylist()).items(),
                            key=lambda kv: (-kv[1], kv[0])))
    if args.reason:
        if args.reason not in REASONS and args.reason not in by_reason:
            raise UsageError(f"unknown reason code {args.reason!r}; known codes: {', '.join(REASONS)}")
        table = table.filter(pc.equal(table.column("reason"), args.reason))
    if args.limit is not None and args.limit < 0:
        raise UsageError("--limit must be >= 0")
    total = table.num_rows
    shown = table.slice(0, args.limit) if args.limit is not None else table
    rows = shown.to_pylist()
    if out.json:
        out.emit_json(dict(dir=str(d), total=total, by_reason=by_reason, rows=rows))
        return 0
    caption = f"{total} rejected row(s)" + (f" with reason {args.reason}" if args.reason else "")
    if len(rows) < total:
        caption += f", showing {len(rows)}"
    out.table(["key", "source", "reason", "detail"],
              [[r["key"], r["source"], r["reason"], r["detail"]] for r in rows], caption=caption)
    if not args.reason and by_reason:
        out.line()
        out.table(["reason", "rows"], list(by_reason.items()))
    return 0
