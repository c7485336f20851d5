"""``shards verify``: check shard files against the manifest, and (``--deep``) samples against the index.

Quick mode (default) reads manifest.json, the ``key``/``shard`` index columns and every shard's
bytes (sha256): missing, extra, resized or changed shards, index/manifest disagreements and
``.tmp`` leftovers. A shard that fails is then re-scanned against its index rows so the report
names the samples affected. ``--deep`` does that scan for every shard: it compares each sample's
sha256 and member offsets/sizes/dtypes/shapes with the index and decodes every tensor member
through :class:`~shards.reader.ShardReader`.

Sidecar tars of fields added with ``shardcache add-field`` (``manifest.json`` ``fields``)
are checked the same way (size + sha256 against their manifest entry) and, with ``--deep`` or when
that fails, for key alignment with their main shard (same keys, same order, one ``FIELD.npy``
each at the index's offsets): see :func:`check_sidecar`.

Both modes check every file the integrity root covers (``index.parquet``, ``manifest.json``,
``rejects.parquet`` and the parts a re-merge builds from: :func:`shards.index.root_problems`) and
open the cache the way every reader does (:func:`loader_refusal`: :meth:`shards.Cache.problems`, where
what a valid cache is is decided for the loader too), so whatever the loader refuses to open, verify
refuses too; ``--deep`` reads every value the loader would read, with its checks. The index is read as
columns (:mod:`shards.columns`: no Python object per sample), so quick mode costs a constant time per
sample besides hashing the shards. A cache
that another command is writing right now is not verified: verify names that command and exits 2
(its files are half-written, and nothing should be deleted or rebuilt meanwhile).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import re
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import fields
from ..checksum import COLUMN as CHECKSUM
from ..errors import ShardcacheError, UnsafePath, UnsupportedFormat
from ..index import root_problems, rows_to_table
from ..lock import CacheLocked, describe
from ..manifest import read_manifest
from ..reader import ShardReader, value_checks_from_manifest
from ..scan import scan_shard, unindexed_members
from ..schema import (INDEX_FILE, MANIFEST_FILE, PARTS_DIR, SHARD_GLOB, TENSOR_DTYPES, WHOLE_MEMBER_DTYPES,
                      is_main_shard_name, parse_shard_name)
from ._common import (Out, UsageError, add_jobs_option, expand_targets, load_manifest, manifest_shards, progress,
                      read_index_columns, shard_path)

#: scalar index fields re-derived by scan_shard and compared in deep mode
ROW_FIELDS = ("duration_s", "sample_rate") + tuple(c.name for c in fields.INDEX_FIELD_COLUMNS) \
    + ("speaker", "bytes")  # derived from the field registry (shards.fields)
MEMBER_FIELDS = ("offset", "size", "dtype", "shape", "member", CHECKSUM)
_SAMPLE_IN_MESSAGE = re.compile(r"(?:sample '([^']+)'|member '([^'./]+)\.)")


@dataclass
class Problem:
    shard: str | None
    sample: str | None
    message: str

    def __str__(self) -> str:
        where = " ".join(x for x in (self.shard and f"{self.shard}:",
                                     self.sample is not None and f"sample {self.sample!r}:") if x)
        return f"{where} {self.message}" if where else self.message


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "verify", parents=[common], help="check shards against the manifest (and index with --deep)",
        description="Check a cache. Default: every shard listed in manifest.json exists, no "
                    "unlisted shard-*.tar is present, each shard's size and sha256 match the "
                    "manifest, index.parquet agrees with the manifest's shard list and counts, and "
                    "reports .tmp leftovers; a shard that fails is re-scanned to name the samples "
                    "affected. --deep re-scans every tar and compares each sample's sha256 and "
                    "member offsets/shapes/dtypes with the index, and decodes every tensor. Given "
                    "shard paths or a glob instead of a directory, each tar is scanned and decoded, "
                    "and checked against its directory's manifest.json/index.parquet when present. "
                    "Exit code 1 on any problem.")
    p.add_argument("paths", nargs="+", metavar="DIR|SHARD",
                   help="a cache directory, or shard tars: paths and/or globs (quote them)")
    p.add_argument("--deep", action="store_true",
                   help="re-scan every tar and compare every sample with the index; decode tensors")
    p.add_argument("--strict", action="store_true",
                   help="also fail (exit 1) on warnings such as leftover .tmp files")
    add_jobs_option(p, "shards checked")
    p.add_argument("--no_progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_verify)


# ------------------------------------------------------------------------------------ helpers

def file_sha256(path: Path, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


class IndexRows:
    """Index rows of one cache grouped by shard, loaded on first use (thread-safe)."""

    def __init__(self, d: Path):
        self.d = d
        self.present = (d / INDEX_FILE).exists()
        self._lock = threading.Lock()
        self._table: pa.Table | None = None
        self._groups: dict[str, np.ndarray] = {}

    def get(self, shard: str) -> pa.Table | None:
        """The index rows of ``shard`` (in index order), or None when the cache has no index."""
        if not self.present:
            return None
        with self._lock:
            if self._table is None:
                table = read_index_columns(self.d)
                enc = table.column("shard").combine_chunks().dictionary_encode()
                codes = enc.indices.to_numpy(zero_copy_only=False)
                order = np.argsort(codes, kind="stable")
                cuts = np.searchsorted(codes[order], np.arange(len(enc.dictionary) + 1))
                self._groups = {name: order[cuts[j]:cuts[j + 1]]
                                for j, name in enumerate(enc.dictionary.to_pylist())}
                self._table = table
        rows = self._groups.get(shard)
        if rows is None:
            return self._table.slice(0, 0)
        return self._table.take(pa.array(rows, pa.int64()))


def _scan_problem(shard: str, path: Path, e: Exception) -> Problem:
    msg = str(e)
    for prefix in (f"{path}: ", f"{shard}: "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    m = _SAMPLE_IN_MESSAGE.search(msg)
    sample = (m.group(1) or m.group(2)) if m else None
    if m and m.group(1) and msg.startswith(f"sample {sample!r} "):
        msg = msg[len(f"sample {sample!r} "):]  # the report names the sample already
    return Problem(shard, sample, msg)


def member_differences(indexed: dict, scanned: dict) -> list[str]:
    """``"FIELD A in index, B"`` for each of :data:`MEMBER_FIELDS` where an index member entry and
    the entry scanned from the tar differ (a checksum the index does not record is not compared:
    indexes written before checksums)."""
    out = []
    for f in MEMBER_FIELDS:
        va, vb = indexed.get(f), scanned.get(f)
        if f == "shape":
            va, vb = list(va or []), list(vb or [])
        if f == CHECKSUM and va is None:
            continue
        if va != vb:
            out.append(f"{f} {va} in index, {vb}")
    return out


def compare_rows(shard: str, scanned: list[dict], indexed: list[dict]) -> list[Problem]:
    """Differences between the rows scan_shard derived from a tar and the index rows of it."""
    probs: list[Problem] = []
    tar = {r["key"]: r for r in scanned}
    idx = {r["key"]: r for r in indexed}
    for k in idx:
        if k not in tar:
            probs.append(Problem(shard, k, "listed in index.parquet but not found in the tar"))
    for k in tar:
        if k not in idx:
            probs.append(Problem(shard, k, "in the tar but not in index.parquet "
                                           "(`shardcache shards reindex` rebuilds the index)"))
    for k, a in idx.items():
        b = tar.get(k)
        if b is None:
            continue
        if a["sha256"] != b["sha256"]:
            probs.append(Problem(shard, k, f"sha256 mismatch: index {a['sha256'][:16]}..., tar "
                                           f"{b['sha256'][:16]}... (the sample's bytes changed)"))
        ma = {m["name"]: m for m in a["members"] or [] if not m.get("file")}  # sidecars: check_sidecar
        mb = {m["name"]: m for m in b["members"] or []}
        if set(ma) != set(mb):
            probs.append(Problem(shard, k, f"members differ: index {sorted(ma)}, tar {sorted(mb)}"))
        for name in sorted(set(ma) & set(mb)):
            probs.extend(Problem(shard, k, f"member {name}: {d} in tar")
                         for d in member_differences(ma[name], mb[name]))
        for f in ROW_FIELDS:
            if a[f] != b[f]:
                probs.append(Problem(shard, k, f"{f} {a[f]!r} in index, {b[f]!r} in tar"))
    return probs


def decode_check(shard: str, directory: Path, table: pa.Table) -> list[Problem]:
    """Decode every member of ``table``'s rows via ShardReader; check shape x itemsize == size and
    every value with its field's kind (codes in ``[0, codebook_size)``, ids in the vocabulary,
    floats finite: :func:`shards.reader.value_checks_from_manifest`)."""
    probs: list[Problem] = []
    try:  # manifest={}: the caller checked manifest.json (format version) once for the cache
        checks = value_checks_from_manifest(read_manifest(directory))  # {} without a manifest
        # checksums=False: every value is checked with its kind below, so the report says what is wrong
        reader = ShardReader(directory, index=table, manifest={}, value_checks=checks,
                             checksums=False)
    except (ShardcacheError, TypeError, ValueError) as e:
        return [_scan_problem(shard, directory / shard, e)]
    try:
        for i, row in enumerate(table.select(["key", "members"]).to_pylist()):
            key, ok = row["key"], True
            for m in row["members"] or []:
                if m["dtype"] in WHOLE_MEMBER_DTYPES:
                    continue
                try:
                    dt = np.dtype(m["dtype"])
                except TypeError:
                    probs.append(Problem(shard, key, f"member {m['name']}: unknown dtype {m['dtype']!r}"))
                    ok = False
                    continue
                want = TENSOR_DTYPES.get(m["name"])
                if want is not None and dt != np.dtype(want):
                    probs.append(Problem(shard, key, f"member {m['name']}: dtype {dt}, the format "
                                                     f"requires {want}"))
                expect = int(np.prod(m["shape"] or [], dtype=np.int64)) * dt.itemsize
                if expect != m["size"]:
                    probs.append(Problem(shard, key, f"member {m['name']}: shape {tuple(m['shape'])} "
                                                     f"x {dt.itemsize} bytes = {expect}, but size is "
                                                     f"{m['size']}"))
                    ok = False
            if ok:
                try:
                    reader.get(i)
                except (ShardcacheError, ValueError, TypeError) as e:
                    p = _scan_problem(shard, directory / shard, e)
                    probs.append(Problem(shard, key, f"cannot decode: {p.message}"))
    finally:
        reader.close()
    return probs


def check_shard(path: Path, entry: dict | None, deep: bool,
                index_rows: Callable[[str], pa.Table | None] | None) -> tuple[list[Problem], int]:
    """Check one shard file; return ``(problems, samples checked)``.

    ``entry`` is its manifest entry (None: no manifest to compare with, so the tar is scanned).
    """
    name = path.name
    if not path.exists():
        msg = "missing: listed in manifest.json but not on disk"
        try:
            keys = index_rows(name).column("key").to_pylist() if index_rows is not None else []
        except ShardcacheError:
            keys = []
        if keys:
            shown = ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
            msg += f"; the index's {len(keys)} sample(s) in it ({shown}) cannot be read"
        return [Problem(name, None, msg)], 0
    probs: list[Problem] = []
    size = path.stat().st_size
    size_bad = entry is not None and entry.get("bytes") is not None and size != entry["bytes"]
    if size_bad:
        probs.append(Problem(name, None, f"size {size} bytes, manifest.json says {entry['bytes']} "
                                         "(truncated or rewritten)"))
    if entry is not None and not deep:
        if not probs:
            sha = file_sha256(path)
            if sha != entry.get("sha256"):
                probs.append(Problem(name, None, f"sha256 {sha[:16]}... differs from manifest.json "
                                                 f"{str(entry.get('sha256'))[:16]}..."))
        if not probs:
            return probs, int(entry.get("samples") or 0)
    # scan the tar: always in deep mode, without a manifest, or to explain a quick-mode failure
    rows = None
    try:
        rows, sha, _ = scan_shard(path)
    except (ShardcacheError, OSError) as e:
        probs.append(_scan_problem(name, path, e))
    if rows is not None and entry is not None and deep:
        if sha != entry.get("sha256") and not size_bad:
            probs.append(Problem(name, None, f"sha256 {sha[:16]}... differs from manifest.json "
                                             f"{str(entry.get('sha256'))[:16]}..."))
        if entry.get("samples") is not None and len(rows) != entry["samples"]:
            probs.append(Problem(name, None, f"{len(rows)} samples in the tar, manifest.json says "
                                             f"{entry['samples']}"))
    indexed = None
    if index_rows is not None:
        try:
            indexed = index_rows(name)
        except ShardcacheError as e:
            probs.append(Problem(name, None, str(e)))
    if indexed is not None:
        if rows is not None:
            probs.extend(compare_rows(name, rows, indexed.to_pylist()))
        probs.extend(decode_check(name, path.parent, indexed))
    elif rows is not None:
        probs.extend(decode_check(name, path.parent, rows_to_table(rows)))
    return _dedupe(probs), len(rows) if rows is not None else 0


def check_sidecar(path: Path, entry: dict, deep: bool,
                  index_rows: Callable[[str], pa.Table | None] | None) -> tuple[list[Problem], int]:
    """Check one sidecar tar (``entry``: its manifest entry plus ``__field__``): size and sha256
    against the manifest and (deep, or to explain a failure) key alignment with its main shard:
    the same keys in the same order, one ``FIELD.npy`` each, at the offsets/shapes the index says."""
    name, field_name, main = path.name, entry["__field__"], entry.get("shard")
    if not path.exists():
        return [Problem(name, None, f"missing: sidecar of field {field_name!r} for {main} listed in "
                                    "manifest.json but not on disk")], 0
    probs: list[Problem] = []
    size = path.stat().st_size
    if entry.get("bytes") is not None and size != entry["bytes"]:
        probs.append(Problem(name, None, f"size {size} bytes, manifest.json says {entry['bytes']}"))
    elif file_sha256(path) != entry.get("sha256"):
        probs.append(Problem(name, None, f"sha256 differs from manifest.json "
                                         f"{str(entry.get('sha256'))[:16]}... (sidecar rewritten?)"))
    if not deep and not probs:
        return probs, int(entry.get("samples") or 0)
    try:
        rows, _, _ = scan_shard(path)
    except (ShardcacheError, OSError) as e:
        return _dedupe(probs + [_scan_problem(name, path, e)]), 0
    indexed = index_rows(main) if index_rows is not None and main else None
    if indexed is None:
        return _dedupe(probs), len(rows)
    keys = indexed.column("key").to_pylist()
    side_keys = [r["key"] for r in rows]
    if side_keys != keys:
        j = next((i for i, (a, b) in enumerate(zip(side_keys, keys)) if a != b), min(len(keys), len(side_keys)))
        a = side_keys[j] if j < len(side_keys) else None
        b = keys[j] if j < len(keys) else None
        probs.append(Problem(name, a or b, f"misaligned with {main}: sample {j} is {a!r} in the sidecar, "
                                           f"{b!r} in the shard ({len(side_keys)} vs {len(keys)} samples); "
                                           f"`shardcache drop-field` and add the field again"))
    # what its producer writes (manifest.json fields.NAME.members: e.g. audio_16k and audio_16k_starts)
    expected = {f"{m}.npy" for m in entry.get("__members__") or [field_name]}
    idx = {k: [m for m in ms or [] if m.get("file") == name]
           for k, ms in zip(keys, indexed.column("members").to_pylist())}
    for r in rows:
        got = {m["name"]: m for m in r["members"]}
        if set(got) != expected:
            probs.append(Problem(name, r["key"], f"members {sorted(got)}, a sidecar of {field_name!r} holds "
                                                 f"{', '.join(sorted(expected))}"))
            continue
        indexed_members = {m["name"]: m for m in idx.get(r["key"]) or []}
        for member in sorted(expected):
            want = indexed_members.get(member)
            if want is None:
                if r["key"] in idx:
                    probs.append(Problem(name, r["key"], f"{member} in the sidecar but not in index.parquet"))
                continue
            probs.extend(Problem(name, r["key"], f"member {member}: {d} in sidecar")
                         for d in member_differences(want, got[member]))
    return _dedupe(probs), len(rows)


def _dedupe(probs: list[Problem]) -> list[Problem]:
    seen, out = set(), []
    for p in probs:
        k = (p.shard, p.sample, p.message)
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


# ------------------------------------------------------------------------------------- command

def _cache_checks(d: Path, cache: Any = None) -> tuple[list[tuple[Path, dict | None]], list[Problem], list[str],
                                                      IndexRows]:
    """Cheap whole-cache checks; returns the shards to check, problems, warnings, index rows. ``cache``:
    the cache opened leniently (``Cache.open(d, strict=False)``), whose index columns say where bytes of
    a shard are located by no entry."""
    problems: list[Problem] = []
    warnings: list[str] = []
    manifest = None
    if (d / MANIFEST_FILE).exists() and (d / INDEX_FILE).exists():
        # every file integrity.json covers: index, manifest (and its cache id), rejects, parts
        problems.extend(Problem(None, None, why) for why in root_problems(d, full=True)[1])
    if not (d / MANIFEST_FILE).exists():
        problems.append(Problem(None, None, f"{d / MANIFEST_FILE} is missing; `shardcache shards reindex {d}` "
                                            "rebuilds it from the tars"))
    else:
        try:
            manifest = load_manifest(d)
            if "shards" not in manifest:
                problems.append(Problem(None, None, f"{d / MANIFEST_FILE} has no shard list"))
                manifest = None
        except UnsupportedFormat:
            raise  # nothing else can be checked with the rules of another format version
        except ShardcacheError as e:
            problems.append(Problem(None, None, str(e)))
            manifest = None
    on_disk, side_on_disk = [], []
    for p in sorted(d.glob(SHARD_GLOB)):
        if not is_main_shard_name(p.name) and fields.parse_sidecar_name(p.name):
            side_on_disk.append(p.name)
            continue
        try:
            shard_path(d, p.name)  # a symlink out of the cache is never read
        except UnsafePath as e:
            problems.append(Problem(p.name, None, str(e)))
            continue
        if p.is_file():
            on_disk.append(p.name)
    if manifest is not None:
        entries = {}
        for s in manifest_shards(manifest):
            try:
                shard_path(d, s["path"])
            except UnsafePath as e:
                if not any(p.message == str(e) or p.shard == s["path"] for p in problems):
                    problems.append(Problem(None, None, str(e)))  # not reported above
                continue
            try:
                parse_shard_name(s["path"])
                entries[s["path"]] = s
            except (TypeError, ValueError):
                problems.append(Problem(None, None, f"manifest.json lists an invalid shard name "
                                                    f"{s['path']!r}"))
        targets = [(d / name, entries[name]) for name in sorted(entries)]
        listed = set()
        for fname, info in sorted((manifest.get("fields") or {}).items()):
            if not isinstance(info, dict) or not info.get("sidecar", True):
                continue
            for e in info.get("shards") or []:
                try:
                    shard_path(d, e["path"])
                    shard_path(d, e.get("shard"))
                except (UnsafePath, KeyError, TypeError) as err:
                    problems.append(Problem(None, None, str(err)))
                    continue
                listed.add(e["path"])
                targets.append((d / e["path"], dict(e, __field__=fname, __members__=info.get("members"))))
            for main in sorted(set(entries) - {e.get("shard") for e in info.get("shards") or []}):
                problems.append(Problem(main, None, f"no sidecar of field {fname!r} listed in manifest.json"))
        for name in side_on_disk:
            if name not in listed:
                problems.append(Problem(name, None, "extra sidecar: on disk but not listed in manifest.json "
                                                    "(an interrupted add-field? rerun it, or delete the file)"))
        for name in on_disk:
            if name not in entries:
                problems.append(Problem(name, None, "extra shard: on disk but not listed in "
                                                    "manifest.json (from another run? delete it, or "
                                                    "`shardcache shards reindex` to adopt it)"))
    else:
        entries = {}
        targets = [(d / name, None) for name in on_disk]
    for tmp in sorted(d.glob("*.tmp")) + sorted((d / PARTS_DIR).glob("*.tmp")):
        # (no command writes the cache: verify_cache refused otherwise, and the next writer removes it)
        warnings.append(f"{tmp}: leftover temporary file of an interrupted write (the next precompute or "
                        "add-field on this cache replaces it)")
    index = IndexRows(d)
    if not index.present:
        problems.append(Problem(None, None, f"{d / INDEX_FILE} is missing; `shardcache shards reindex {d}` "
                                            "rebuilds it"))
        return targets, problems, warnings, index
    try:
        t = read_index_columns(d, ["key", "shard"])
    except ShardcacheError as e:
        problems.append(Problem(None, None, str(e)))
        index.present = False
        return targets, problems, warnings, index
    unsafe = set()
    for name in t.column("shard").unique().to_pylist():
        try:
            shard_path(d, name)
        except UnsafePath as e:
            unsafe.add(name)
            if not any(p.message == str(e) or p.shard == name for p in problems):
                problems.append(Problem(None, None, str(e)))
    hidden = ([msg for kind, msg in cache.columns.problems if kind == "hidden"]
              if cache is not None and cache.columns is not None else
              unindexed_members(read_index_columns(d, ["key", "shard", "members"])))
    for message in hidden:
        problems.append(Problem(None, None, message))
    counts = pc.value_counts(t.column("key"))  # (first seen first, as the keys come)
    if len(counts) != t.num_rows:
        dups = counts.filter(pc.greater(counts.field("counts"), 1)).field("values").slice(0, 20)
        for k in dups.to_pylist():
            problems.append(Problem(None, k, f"duplicate key in {INDEX_FILE}"))
    per_shard = {v["values"]: v["counts"] for v in pc.value_counts(t.column("shard")).to_pylist()}
    if manifest is not None:
        counts = manifest.get("counts") or {}
        if counts.get("samples") is not None and counts["samples"] != t.num_rows:
            problems.append(Problem(None, None, f"manifest.json counts {counts['samples']} samples, "
                                                f"{INDEX_FILE} has {t.num_rows} rows"))
        for shard, n in sorted(per_shard.items()):
            if shard not in entries and shard not in unsafe:
                problems.append(Problem(shard, None, f"{INDEX_FILE} lists {n} sample(s) in this shard "
                                                     "but manifest.json does not list the shard"))
        for shard, e in sorted(entries.items()):
            want = e.get("samples")
            if want is not None and per_shard.get(shard, 0) != want:
                problems.append(Problem(shard, None, f"manifest.json says {want} samples, "
                                                     f"{INDEX_FILE} has {per_shard.get(shard, 0)}"))
    return targets, problems, warnings, index


def _tar_targets(tars: list[Path]) -> tuple[list[tuple[Path, dict | None]], list[Problem],
                                             dict[Path, IndexRows]]:
    """Shard paths given explicitly: compare with their directory's manifest where there is one."""
    targets, problems = [], []
    indexes: dict[Path, IndexRows] = {}
    manifests: dict[Path, dict | None] = {}
    for t in tars:
        parent = t.parent
        if parent not in manifests:
            manifests[parent] = None
            if (parent / MANIFEST_FILE).exists():
                try:
                    m = load_manifest(parent)
                    manifests[parent] = {s["path"]: s for s in manifest_shards(m)} if "shards" in m else None
                except UnsupportedFormat:
                    raise
                except ShardcacheError as e:
                    problems.append(Problem(None, None, str(e)))
            indexes[parent] = IndexRows(parent)
        entries = manifests[parent]
        entry = None
        if entries is not None:
            entry = entries.get(t.name)
            if entry is None and t.exists():
                problems.append(Problem(t.name, None, f"extra shard: not listed in "
                                                      f"{parent / MANIFEST_FILE}"))
        if not t.exists():
            problems.append(Problem(t.name, None, f"{t}: no such file"))
            continue
        targets.append((t, entry))
    return targets, problems, indexes


def loader_refusal(cache: Any) -> list[str]:
    """Why the loader refuses to open ``cache`` (opened with ``Cache.open(d, strict=False)``), one
    message each (empty when it opens it): :meth:`shards.Cache.problems`, what every reader of the cache
    checks before it reads (root, format, unsafe or hidden members, field shapes and sizes, incomplete
    or missing fields, missing or short shard files), with every field the cache holds. Read-time checks
    (checksums, values) are ``--deep``'s."""
    return [f"the loader refuses to open the cache: {why}" for why in cache.problems()]


def _open(d: Path) -> Any:
    """``d`` opened leniently (its problems kept), None when it has no index or Arrow cannot read it."""
    from ..cache import Cache
    try:
        return Cache.open(d, strict=False)
    except FileNotFoundError:
        return None


def refuse_while_written(d: Path) -> None:
    """Raise :class:`~shards.lock.CacheLocked` (exit 2) when another command writes cache ``d`` now:
    what verify would report is a cache half-written, and what it would advise (delete, reindex)
    must not be done meanwhile."""
    from ..lock import holder
    h = holder(d)
    if h:
        raise CacheLocked(f"{d} is being written right now by {describe(h)}: not verified (its files are "
                          "half-written); verify it once that command has ended", h)


def verify_cache(d: Path, deep: bool = False, jobs: int = 1,
                 bar: Callable[[int], Any] | None = None) -> tuple[list[Problem], list[str], int, int]:
    """Verify cache folder ``d`` (see the module docstring): ``(problems, warnings, shards checked,
    samples checked)``. ``bar(total)``: a context manager giving ``advance(name)`` (a progress bar).
    Raises :class:`~shards.lock.CacheLocked` while another command writes it,
    :class:`~shards.errors.UnsupportedFormat` for a newer format."""
    refuse_while_written(d)
    cache = _open(d) if (d / INDEX_FILE).exists() else None
    targets, problems, warnings, index = _cache_checks(d, cache)
    with (bar(len(targets)) if bar is not None else contextlib.nullcontext(None)) as advance:
        problems, n, samples = _check_targets(targets, problems, {d: index}, deep, jobs, advance)
    for why in loader_refusal(cache) if cache is not None else []:
        if not any(p.message in why for p in problems):
            problems.append(Problem(None, None, why))
    return problems, warnings, n, samples


def _check_targets(targets, problems: list[Problem], lookup: dict, deep: bool, jobs: int,
                   advance: Callable[[str], None] | None) -> tuple[list[Problem], int, int]:
    results: dict[Path, tuple[list[Problem], int]] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {}
        for path, entry in targets:
            idx = lookup.get(path.parent)
            getter = idx.get if idx is not None and idx.present else None
            check = check_sidecar if entry is not None and "__field__" in entry else check_shard
            futures[pool.submit(check, path, entry, deep, getter)] = path
        for fut in as_completed(futures):
            path = futures[fut]
            try:
                results[path] = fut.result()
            except (ShardcacheError, OSError) as e:
                results[path] = ([Problem(path.name, None, str(e))], 0)
            if advance is not None:
                advance(path.name)
    problems = list(problems)
    for path, _ in targets:
        problems.extend(results[path][0])
    return problems, len(targets), sum(n for _, n in results.values())


def cmd_verify(args: argparse.Namespace) -> int:
    out = Out(args)
    if args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    d, tars = expand_targets(args.paths)
    warnings: list[str] = []

    def bar(total: int):
        return progress(total, "verify" + (" --deep" if args.deep else ""),
                        enabled=not args.no_progress and not out.json)

    if d is not None:
        problems, warnings, n_targets, samples = verify_cache(d, args.deep, args.jobs, bar)
    else:
        targets, problems, lookup = _tar_targets(tars)
        with bar(len(targets)) as advance:
            problems, n_targets, samples = _check_targets(targets, problems, lookup, args.deep, args.jobs, advance)
    bad_shards = sorted({p.shard for p in problems if p.shard})
    failed = bool(problems) or (args.strict and bool(warnings))
    mode = "deep" if args.deep else "quick"
    if out.json:
        out.emit_json(dict(ok=not failed, mode=mode, dir=str(d) if d else None,
                           shards_checked=n_targets, samples_checked=samples,
                           problems=[asdict(p) for p in problems], warnings=warnings))
        return 1 if failed else 0
    if problems and out.rich:
        out.table(["shard", "sample", "problem"],
                  [[p.shard or "-", p.sample if p.sample is not None else "-", p.message]
                   for p in problems])
    elif problems:  # one greppable line per problem: "SHARD: sample 'KEY': what is wrong"
        for p in problems:
            out.line(str(p))
    for w in warnings:
        out.line(f"warning: {w}", style="yellow")
    what = f"{n_targets} shard(s), {samples} sample(s) checked ({mode})"
    if problems:
        out.line(f"FAILED: {len(problems)} problem(s) in {len(bad_shards)} shard(s); {what}",
                 style="bold red")
    elif failed:
        out.line(f"FAILED (--strict): {len(warnings)} warning(s); {what}", style="bold red")
    else:
        out.line(f"OK: {what}", style="bold green")
    return 1 if failed else 0
