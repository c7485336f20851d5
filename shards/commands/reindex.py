"""``shards reindex``: rebuild index.parquet, the index parts and the manifest's shard list from the tars."""
from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import ShardcacheError, ShardCorrupt
from ..index import REJECTS_SCHEMA, part_paths, read_part_shard_entry, rows_to_table, write_parts
from ..fields import parse_sidecar_name
from ..merge import keep_added_fields, write_cache_files
from ..scan import scan_shard
from ..storage import local_path
from ..schema import (INDEX_FILE, MANIFEST_FILE, PARTS_DIR, REJECTS_FILE, ROOT_FILE, SHARD_GLOB,
                      parse_shard_name)
from ..unfinished import unfinished
from ..writing import session, writes_cache
from ._common import Out, UsageError, add_jobs_option, load_manifest, progress, shard_path, warn
from .needs import Needs

#: manifest fields that write_cache_files recomputes; every other field is kept as it is
RECOMPUTED = ("format_version", "created", "counts", "shards")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "reindex", parents=[common], help="rebuild index.parquet and manifest.json from the tars",
        description="Scan every shard-r*-*.tar in DIR and rebuild index.parquet, the per-shard "
                    "index parts in parts/ and manifest.json's shard list and counts. The "
                    "manifest's other fields (encoders, fingerprint, config, ...) and the existing "
                    "rejects are kept. Nothing is written if any tar is unreadable. It takes the "
                    "cache's writer lock (like precompute, add-field and drop-field): while another "
                    "command writes DIR it exits 2 naming it, and writes nothing. A folder of a stage-one job "
                    "that stopped before the end (parts/job.json, no index.parquet yet) is refused, exit 2: the "
                    "same precompute command completes it; --partial publishes the committed chunks alone.")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.add_argument("--dry_run", action="store_true", help="scan and report, write nothing")
    p.add_argument("--partial", action="store_true",
                   help="publish the committed chunks of a stage-one job that stopped before the end (refused "
                        "otherwise: the same precompute command completes it; the rows it had not encoded are "
                        "left out of the cache until then)")
    add_jobs_option(p, "tars scanned")
    p.add_argument("--no_progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_reindex, needs=Needs(("joblib",), "inspect"))


def _existing_rejects(d: Path) -> pa.Table:
    """The concatenated rejects parts (what each committed chunk rejected: rejects.parquet is made of
    them, so a rejects.parquet edited since is not carried over), or rejects.parquet where there are
    no parts."""
    p = d / REJECTS_FILE
    try:
        parts = sorted((d / PARTS_DIR).glob("*.rejects.parquet"))
        if parts:
            return pa.concat_tables([pq.read_table(x, schema=REJECTS_SCHEMA) for x in parts])
        if p.exists():
            return pq.read_table(p, schema=REJECTS_SCHEMA)
    except (pa.ArrowException, OSError) as e:
        raise ShardCorrupt(f"{p}: cannot read the existing rejects ({e})") from e
    return REJECTS_SCHEMA.empty_table()


def _old_index(d: Path) -> pa.Table | None:
    p = d / INDEX_FILE
    if not p.exists():
        return None
    try:
        return pq.read_table(p, columns=["key", "shard", "sha256"])
    except (pa.ArrowException, OSError):
        return None


def _scan(path: Path) -> tuple[str, tuple | None, str | None]:
    """``(shard name, scan_shard result, None)`` or ``(name, None, error message)``."""
    try:
        return path.name, scan_shard(path), None
    except (ShardcacheError, OSError) as e:
        return path.name, None, str(e)


def cmd_reindex(args: argparse.Namespace) -> int:
    d = local_path(args.dir)
    if not d.is_dir():
        raise UsageError(f"{d}: no such directory" if not d.exists() else f"{d}: not a directory")
    if args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    if (why := unfinished(d)) is not None:  # rebuilding its index would publish a cache without the rows to come
        if not args.partial:
            raise UsageError(f"{why}. Refused: nothing written (--partial publishes the committed chunks alone)")
        warn(f"{why}. --partial: publishing the committed chunks alone; the rows stage one had not encoded are "
             "not in the cache (the same precompute command adds them later)")
    if args.dry_run:  # writes nothing: a reader
        return _reindex(args, d)
    return _reindex_locked(args, d)


@writes_cache("shards reindex", cache="d")
def _reindex_locked(args: argparse.Namespace, d: Path) -> int:
    """:func:`_reindex` holding the cache's writer lock from the scan to the root."""
    return _reindex(args, d)


def _reindex(args: argparse.Namespace, d: Path) -> int:
    out = Out(args)
    tars = []
    for p in sorted(d.glob(SHARD_GLOB)):
        if parse_sidecar_name(p.name):
            continue  # a sidecar of a field added by `precompute add-field`: re-attached below
        try:
            parse_shard_name(p.name)
        except ValueError:
            warn(f"{p}: skipped, not a shard name (shard-rRRRR-NNNNNN.tar)")
            continue
        shard_path(d, p.name)  # UnsafePath: a symlink out of the cache is never adopted
        if p.is_file():
            tars.append(p)
    has_manifest = (d / MANIFEST_FILE).exists()
    if not tars and not has_manifest and not (d / REJECTS_FILE).exists():
        raise UsageError(f"{d}: no shard-r*-*.tar, {MANIFEST_FILE} or {REJECTS_FILE}; not a "
                         "shardcache cache")
    manifest = load_manifest(d)
    if not has_manifest:
        warn(f"{d / MANIFEST_FILE} is missing: the new manifest will lack encoders/fingerprint")

    scanned: dict[str, tuple[list[dict], str, int]] = {}
    errors: list[str] = []
    with progress(len(tars), "reindex", enabled=not args.no_progress and not out.json) as advance:
        # tar parsing holds the GIL: scan shards in worker processes (joblib/loky), results as they finish
        from joblib import Parallel, delayed  # [inspect] (declared: needs)
        jobs = Parallel(n_jobs=args.jobs, return_as="generator_unordered")(delayed(_scan)(p) for p in tars)
        for name, result, error in jobs:
            if error is None:
                scanned[name] = result
            else:
                errors.append(error)
            advance(name)
    if errors:
        for e in sorted(errors):
            out.line(f"error: {e}", style="bold red")
        out.line(f"reindex aborted: {len(errors)} unreadable shard(s); nothing was written. Delete "
                 "or regenerate them, then rerun.", style="bold red")
        return 1

    rows: list[dict] = []
    entries: list[dict] = []
    where: dict[str, str] = {}
    for p in tars:
        shard_rows, sha, size = scanned[p.name]
        for r in shard_rows:
            if r["key"] in where:
                raise ShardCorrupt(f"{d}: key {r['key']!r} is in both {where[r['key']]} and {p.name}; "
                                   "delete one of the shards and rerun")
            where[r["key"]] = p.name
        rows.extend(shard_rows)
        entries.append(dict(path=p.name, samples=len(shard_rows), bytes=size, sha256=sha))
    index = rows_to_table(rows)
    rejects = _existing_rejects(d)

    old = _old_index(d)
    change = None
    if old is not None:
        before = dict(zip(old.column("key").to_pylist(),
                          zip(old.column("shard").to_pylist(), old.column("sha256").to_pylist())))
        after = {r["key"]: (r["shard"], r["sha256"]) for r in rows}
        change = dict(before=len(before), after=len(after),
                      added=len(after.keys() - before.keys()),
                      removed=len(before.keys() - after.keys()),
                      changed=sum(1 for k in after.keys() & before.keys() if after[k] != before[k]))

    stale = []
    for part in sorted((d / PARTS_DIR).glob("*.index.parquet")):
        stem = part.name[: -len(".index.parquet")]
        if f"{stem}.tar" in scanned:
            continue
        try:
            entry = read_part_shard_entry(part)
        except (pa.ArrowException, OSError, ValueError):
            entry = {"path": f"{stem}.tar"}  # unreadable part: treat as stale
        if entry is not None:  # the part describes a tar that is gone
            stale.append(part)

    result = dict(dir=str(d), dry_run=bool(args.dry_run), shards=len(entries), samples=len(rows),
                  rejects_kept=rejects.num_rows, index_change=change,
                  stale_parts_removed=[str(p) for p in stale],
                  manifest_fields_kept=sorted(k for k in manifest if k not in RECOMPUTED))
    if not args.dry_run:
        for p in tars:
            stem = p.name[:-4]
            _, rejects_part = part_paths(d, stem)
            kept = (pq.read_table(rejects_part, schema=REJECTS_SCHEMA).to_pylist()
                    if rejects_part.exists() else [])
            entry = next(e for e in entries if e["path"] == p.name)
            write_parts(d, stem, scanned[p.name][0], kept, entry)
        with session(d / ROOT_FILE) as s:  # (the command's session: no symlink followed)
            for part in stale:
                s.unlink(part)
        base = {k: v for k, v in manifest.items() if k not in RECOMPUTED}
        index, added = keep_added_fields(d, index, base.get("fields"))
        for fname, info in sorted(added.items()):
            if info.get("incomplete"):
                warn(f"field {fname!r} (added by add-field) has no sidecar for {len(info['incomplete'])} shard(s): "
                     "kept as incomplete; the same `shardcache add-field` adds them")
        if "fields" in base:
            base["fields"] = {**base["fields"], **added}
        write_cache_files(d, index, rejects, entries, base)

    if out.json:
        out.emit_json(result)
        return 0
    pairs = [("cache", str(d)), ("shards", str(len(entries))), ("samples", str(len(rows))),
             ("rejects kept", str(rejects.num_rows))]
    if change is not None:
        pairs.append(("index rows", f"{change['before']} -> {change['after']} ({change['added']} "
                                    f"added, {change['removed']} removed, {change['changed']} changed)"))
    else:
        pairs.append(("index rows", f"{len(rows)} (no previous {INDEX_FILE})"))
    if stale:
        pairs.append(("stale parts", f"{len(stale)} removed (their tars are gone)"
                                     if not args.dry_run else f"{len(stale)} would be removed"))
    pairs.append(("manifest fields kept", ", ".join(result["manifest_fields_kept"]) or "-"))
    out.kv(pairs, title="dry run: nothing written" if args.dry_run else f"rebuilt {INDEX_FILE}, "
                                                                          f"{PARTS_DIR}/ and {MANIFEST_FILE}")
    return 0
