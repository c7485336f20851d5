"""Add, replace or drop a field of an existing cache, without touching a byte of its shards.

``python -m precompute add-field CACHE --field codes_mimi --audio-tokenizer mimi`` encodes each
sample's stored ``audio.npy`` waveform (no source file is read again: only what the new field
needs is decoded) with the given codec and writes, next to each shard ``shard-000003.tar``, a
sidecar ``shard-000003.codes_mimi.tar`` holding ``KEY.codes_mimi.npy`` for every key of the shard,
in the same order (aligned by key order). ``codes_<name>`` fields are of kind ``codes``
(:mod:`shards.fields`): int16 ``(Q, F)``, every audio item's codes concatenated along frames
(``ceil(item samples / hop)`` frames each; a sample without audio gets ``(Q, 0)``).

Commit: a sidecar is written to ``.tmp``, fsynced, renamed, then its part
``parts/shard-000003.codes_mimi.sidecar.parquet`` (keys + member offsets, the sidecar's manifest
entry in the metadata) is written atomically: a rerun skips sidecars whose part exists (resume).
Many ranks (``torchrun ... -m precompute add-field``): shards are dealt round-robin by global rank;
rank 0 waits for every part, then joins the sidecar members into ``index.parquet`` (each member
with ``file`` = its sidecar) and records the field in ``manifest.json`` ``fields`` with its own
encoder fingerprint. The shards, their parts and their sha256 stay as they were.

``python -m precompute drop-field CACHE NAME`` removes the sidecars, their parts and the field
from the index and manifest, again without touching any other byte.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from shards import fields as registry
from shards.errors import ShardcacheError
from shards.index import (attach_sidecar, detach_field, fsync_dir, read_index, read_rejects,
                          read_sidecar_parts, safe_shard_path, sidecar_part_path, sidecar_parts,
                          write_cache_files, write_json_atomic, write_sidecar_part)
from shards.manifest import CacheManifest, FieldInfo
from shards.reader import ShardReader
from shards.schema import PARTS_DIR
from shards.scan import scan_shard
from shards.writer import npy_bytes, tar_member

log = logging.getLogger("precompute.add_field")


class FieldError(ShardcacheError):
    """add-field / drop-field refused (unknown field, fingerprint mismatch...)."""


def _check_field(name: str) -> registry.Field:
    f = registry.lookup(name)
    if f is None or not f.sidecar:
        raise FieldError(f"{name!r} cannot be added to an existing cache: add-field writes fields named "
                         f"{', '.join(b + '_<name>' for b in registry.DERIVABLE)} (e.g. codes_mimi); "
                         "fixed fields are written by stage one")
    if f.kind != "codes":
        raise FieldError(f"{name!r}: only fields of kind 'codes' can be added for now")
    return f


def _resample(x: np.ndarray, sr_in: int, sr_out: int) -> np.ndarray:
    if sr_in == sr_out or x.size == 0:
        return x
    import soxr
    return soxr.resample(x, sr_in, sr_out).astype(np.float32, copy=False)


def encode_sample(tok, audio: np.ndarray | None, starts: np.ndarray | None, sr: int) -> np.ndarray:
    """int16 ``(Q, F)`` codes of one sample's stored waveform, item by item (concatenated)."""
    q = int(tok.n_codebooks)
    if audio is None or audio.size == 0:
        return np.zeros((q, 0), dtype=np.int16)
    bounds = starts.tolist() if starts is not None and len(starts) >= 2 else [0, len(audio)]
    wav = audio.astype(np.float32) / 32768.0
    items = [_resample(wav[a:b], sr, int(tok.sample_rate)) for a, b in zip(bounds[:-1], bounds[1:])]
    live = [i for i, w in enumerate(items) if w.size]
    out = [np.zeros((q, 0), dtype=np.int16)] * len(items)
    if live:
        for i, c in zip(live, tok.encode([items[i] for i in live])):
            out[i] = np.asarray(c, dtype=np.int16)
    return np.concatenate(out, axis=1) if out else np.zeros((q, 0), dtype=np.int16)


def write_sidecar(cache_dir: Path, shard: str, field_name: str, keys: list[str], arrays: list[np.ndarray]) -> dict:
    """Write the sidecar tar atomically, then its part; returns its manifest entry."""
    name = registry.sidecar_name(shard, field_name)
    path = safe_shard_path(cache_dir, name)
    tmp = path.with_name(name + ".tmp")
    with open(tmp, "wb") as fh:
        with tarfile.open(fileobj=fh, mode="w|", format=tarfile.PAX_FORMAT) as tf:
            for key, arr in zip(keys, arrays):
                data = npy_bytes(np.ascontiguousarray(arr, dtype=np.int16))
                import io
                tf.addfile(tar_member(f"{key}.{field_name}.npy", len(data)), io.BytesIO(data))
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o444)
    rows, sha, size = scan_shard(tmp, name)  # the same offsets a reader will use
    if [r["key"] for r in rows] != list(keys):
        tmp.unlink()
        raise FieldError(f"{name}: written keys differ from {shard}'s (bug)")
    os.replace(tmp, path)
    fsync_dir(path.parent)
    entry = dict(path=name, shard=shard, samples=len(rows), bytes=size, sha256=sha)
    part_rows = [dict(key=r["key"], members=[dict(m, file=name) for m in r["members"]]) for r in rows]
    write_sidecar_part(cache_dir, shard, field_name, part_rows, entry)
    return entry


def _pending_path(cache_dir: Path, field_name: str) -> Path:
    return Path(cache_dir) / PARTS_DIR / f"{field_name}.field.json"


def add_field(cache_dir: str | Path, field_name: str, tokenizer_cfg: dict, *, device: str = "cpu",
              global_rank: int = 0, world_size: int = 1, barrier=None, replace: bool = False,
              progress: bool = True) -> dict | None:
    """Add ``field_name`` to the cache (this rank's share of the shards); rank 0 merges at the end.

    Returns the new manifest dict on rank 0 (None elsewhere). Raises :class:`FieldError` when the
    field exists with another fingerprint (pass ``replace=True`` to drop and re-add it).
    """
    from .encoders import fingerprint, load_audio_tokenizer

    cache_dir = Path(cache_dir)
    sync = barrier or (lambda: None)
    _check_field(field_name)
    man = CacheManifest.read(cache_dir)
    sr = int(man.sample_rate or 0)
    tok = load_audio_tokenizer(tokenizer_cfg, device)
    describe = tok.describe()
    fp = fingerprint(describe, preprocessing={"field": field_name, "from": "audio.npy", "sample_rate": sr})
    old = man.fields.get(field_name)
    if old is not None and old.fingerprint != fp:
        if not replace:
            raise FieldError(f"{cache_dir}: field {field_name!r} exists with fingerprint {old.fingerprint[:16]}..., "
                             f"this codec gives {fp[:16]}...; drop it first (`python -m precompute drop-field "
                             f"{cache_dir} {field_name}`) or pass --replace")
        if global_rank == 0:
            drop_field(cache_dir, field_name)
        sync()
        man = CacheManifest.read(cache_dir)
    pending = _pending_path(cache_dir, field_name)
    if global_rank == 0:
        if pending.exists():
            import json
            prev = json.loads(pending.read_text())
            if prev.get("fingerprint") != fp:
                raise FieldError(f"{cache_dir}: an interrupted add-field of {field_name!r} used fingerprint "
                                 f"{str(prev.get('fingerprint'))[:16]}..., this run {fp[:16]}...; "
                                 f"`python -m precompute drop-field {cache_dir} {field_name}` first")
        else:
            pending.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic({"fingerprint": fp, "encoder": describe}, pending)
    sync()
    index = read_index(cache_dir)
    shards = sorted(s["path"] for s in man.shards or [])
    mine = shards[global_rank::world_size]
    t0, done = time.perf_counter(), 0
    import torch
    for shard in mine:
        if sidecar_part_path(cache_dir, shard, field_name).exists():
            continue  # committed by an earlier run
        import pyarrow.compute as pc
        rows = index.filter(pc.equal(index.column("shard"), shard))
        keys = rows.column("key").to_pylist()
        reader = ShardReader(cache_dir, index=rows, manifest=man.to_dict())
        idx = np.arange(rows.num_rows)
        has_audio = "audio.npy" in set(pc.unique(rows.column("members").combine_chunks().flatten()
                                                 .field("name")).to_pylist())
        audio = reader.views("audio", idx) if has_audio else [None] * len(keys)
        starts = reader.views("audio_starts", idx) if has_audio and _has(rows, "audio_starts.npy") \
            else [None] * len(keys)
        with torch.inference_mode():
            arrays = [encode_sample(tok, a, s, sr) for a, s in zip(audio, starts)]
        reader.close()
        write_sidecar(cache_dir, shard, field_name, keys, arrays)
        done += 1
        if progress:
            log.info("[rank %d] %s: %d samples (%d/%d shards, %.1f s)", global_rank,
                     registry.sidecar_name(shard, field_name), len(keys), done, len(mine), time.perf_counter() - t0)
    sync()
    if global_rank != 0:
        return None
    _wait(cache_dir, shards, field_name)
    info = FieldInfo(fingerprint=fp, encoder=describe, sidecar=True, base=registry.get(field_name).name.split("_")[0],
                     n_codebooks=int(tok.n_codebooks), codebook_size=int(tok.codebook_size),
                     frame_rate=float(tok.frame_rate), codec_sample_rate=int(tok.sample_rate))
    manifest = _merge(cache_dir, man, field_name, info)
    pending.unlink(missing_ok=True)
    return manifest


def _has(rows, member: str) -> bool:
    import pyarrow.compute as pc
    return member in set(pc.unique(rows.column("members").combine_chunks().flatten().field("name")).to_pylist())


def _wait(cache_dir: Path, shards: list[str], field_name: str, poll_s: float = 2.0) -> None:
    while True:
        missing = [s for s in shards if not sidecar_part_path(cache_dir, s, field_name).exists()]
        if not missing:
            return
        time.sleep(poll_s)


def _merge(cache_dir: Path, man: CacheManifest, field_name: str, info: FieldInfo | None) -> dict:
    """Rewrite index.parquet + manifest.json with ``field_name`` (re-)attached (or removed: info None)."""
    index = detach_field(read_index(cache_dir), field_name)
    d = man.to_dict()
    fields = dict(d.get("fields") or {})
    fields.pop(field_name, None)
    if info is not None:
        side, entries = read_sidecar_parts(cache_dir, field_name)
        index = attach_sidecar(index, side)
        info.shards = sorted(entries, key=lambda e: e["path"])
        fields[field_name] = info.to_dict()
    d["fields"] = fields
    if not fields:
        d.pop("fields")
    shards = d.pop("shards", None) or []
    for k in ("format_version", "created", "counts"):
        d.pop(k, None)
    return write_cache_files(cache_dir, index, read_rejects(cache_dir), shards, d)


def drop_field(cache_dir: str | Path, field_name: str) -> dict:
    """Remove field ``field_name``: its sidecars, their parts, its index members and manifest entry."""
    cache_dir = Path(cache_dir)
    man = CacheManifest.read(cache_dir)
    if field_name in registry.BY_NAME:
        raise FieldError(f"{field_name!r} is a stage-one field; only fields added with add-field can be dropped")
    manifest = _merge(cache_dir, man, field_name, None)  # the index stops naming the sidecars first
    for p in sidecar_parts(cache_dir, field_name):
        p.unlink()
    for s in man.shards or []:
        for name in (registry.sidecar_name(s["path"], field_name),
                     registry.sidecar_name(s["path"], field_name) + ".tmp"):
            p = safe_shard_path(cache_dir, name)
            if p.exists():
                p.unlink()
    _pending_path(cache_dir, field_name).unlink(missing_ok=True)
    return manifest


# ------------------------------------------------------------------------------------------ CLI

def _tokenizer_cfg(args) -> dict:
    cfg: dict[str, Any] = {}
    if args.config:
        from shardcache.config import read_yaml  # the one YAML reader (size and alias limits)
        loaded = read_yaml(args.config)
        cfg = dict(loaded.get("audio_tokenizer") or loaded)
    if args.audio_tokenizer:
        spec = args.audio_tokenizer
        cfg = {"factory": spec} if ":" in spec else dict(cfg, name=spec)
    if args.pretrained:
        cfg["pretrained"] = args.pretrained
    if not cfg:
        raise SystemExit("error: give --audio-tokenizer NAME|module:factory or --config YAML")
    if cfg.get("name") and "pretrained" not in cfg and "factory" not in cfg:
        cfg["pretrained"] = f"models/{cfg['name']}-tiny"
    return cfg


def main_add(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m precompute add-field", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cache", metavar="CACHE")
    p.add_argument("--field", required=True, help="field name, e.g. codes_mimi")
    p.add_argument("--audio-tokenizer", default=None, metavar="NAME|module:factory", help="codec: dac | encodec | mimi")
    p.add_argument("--pretrained", default=None, help="model directory (default: models/NAME-tiny)")
    p.add_argument("--config", default=None, help="YAML with an audio_tokenizer mapping (or the mapping itself)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--replace", action="store_true", help="drop the field first if it exists with another codec")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from .ranks import make_barrier
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    global_rank = int(os.environ.get("RANK", "0"))
    device = args.device
    if device == "cuda" and world_size > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    barrier, close = make_barrier(world_size, global_rank)
    try:
        m = add_field(args.cache, args.field, _tokenizer_cfg(args), device=device, global_rank=global_rank,
                      world_size=world_size, barrier=barrier, replace=args.replace, progress=not args.no_progress)
    except (ShardcacheError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        close()
    if m is not None:
        fi = m["fields"][args.field]
        print(f"cache {args.cache}: field {args.field} added ({len(fi['shards'])} sidecars, "
              f"{sum(s['bytes'] for s in fi['shards']) / 1e6:.1f} MB), fingerprint {fi['fingerprint'][:16]}")
    return 0


def main_drop(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m precompute drop-field",
                                description="Remove a field added with add-field (its sidecars, index members, "
                                            "manifest entry); no other byte changes.")
    p.add_argument("cache", metavar="CACHE")
    p.add_argument("field", metavar="NAME")
    args = p.parse_args(argv)
    try:
        drop_field(args.cache, args.field)
    except (ShardcacheError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"cache {args.cache}: field {args.field} dropped")
    return 0
