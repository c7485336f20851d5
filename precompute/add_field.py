"""Add, replace or drop a field of an existing cache, without touching a byte of its shards.

``shardcache add-field CACHE --field NAME --producer SPEC`` runs a stage-one producer
(:mod:`precompute.producers`, the same code ``precompute`` runs for ``extra_fields``) over every
sample of the cache and writes, next to each shard ``shard-000003.tar``, a sidecar
``shard-000003.NAME.tar`` holding a ``KEY.<field>.npy`` member per field the producer writes for
every key of the shard, in the same order (aligned by key order). The producer reads the cache
itself (:class:`precompute.producers.cached.CachedSample`): audio from the stored waveform
resampled as needed, images decoded again from the sources the sample's json names; no source
audio is read again. Any declared field can be added (:mod:`shards.fields`), e.g.

* ``--field codes_mimi --audio_tokenizer mimi --pretrained DIR`` (producer ``codes``; the
  ``codes_<codec>`` name rule makes the field: kind ``codes``, int16 ``(Q, F)``);
* ``--field audio_16k --producer waveform --options '{sample_rate: 16000, direction: in}'``;
* a plug-in field: ``--producer mypkg.fields:make_mel`` (its module registers the field).

Values are checked with the field's kind as stage one checks them; a sample the producer fails on
gets no member (named in the log and in ``manifest.json`` ``fields.NAME.missing``).

Commit: a sidecar is written to ``.tmp``, fsynced, renamed, then its part
``parts/shard-000003.NAME.sidecar.parquet`` (keys + member offsets, the sidecar's manifest
entry in the metadata) is written atomically: a rerun skips sidecars whose part exists (resume).
Many ranks (``torchrun ... -m shardcache add-field``): shards are dealt round-robin by global rank;
rank 0 waits for every part, then joins the sidecar members into ``index.parquet`` (each member
with ``file`` = its sidecar) and records the field in ``manifest.json`` ``fields`` with its own
producer fingerprint. The shards, their parts and their sha256 stay as they were.

Identity: the field's fingerprint holds the producer's ``describe()`` and every ``bytes`` key of its spec;
its batch policy (``--encoder_batch_size``, the device type, the spec's batch keys) is recorded with the
field and compared when a run resumes or completes it (:mod:`precompute.identity`, the declarations of
:class:`AddFieldOptions`).

``shardcache drop-field CACHE NAME`` removes the sidecars, their parts and the field from the
index and manifest, again without touching any other byte.
"""
# no `from __future__ import annotations`: AddFieldOptions' annotations are the types jsonargparse checks
import argparse
import io
import json
import logging
import os
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import yaml

from shardcache.helptext import HelpFormatter, plain
from shardcache.yaml_limits import YAMLRefused, load_yaml, read_yaml
from shardcache.config import ConfigError, bounded, option
from shards import fields as registry
from shards.errors import ShardcacheError, WriteRefused
from shards.index import (attach_sidecar, detach_field, read_index, read_rejects,
                          read_sidecar_parts, safe_shard_path, sidecar_part_path, sidecar_parts,
                          write_json_atomic, write_sidecar_part)
from shards.merge import write_cache_files
from shards.manifest import CacheManifest, FieldInfo
from shards.reader import ShardReader
from shards.schema import PARTS_DIR, ROOT_FILE
from shards.scan import scan_shard
from shards.writer import npy_bytes, tar_member
from shards.writing import session, writes_cache

from .effects import BATCH, BYTES, IDENTITY, OPERATIONAL, SPEC, Effect

log = logging.getLogger("precompute.add_field")


class FieldError(ShardcacheError):
    """add-field / drop-field refused (unknown field, fingerprint mismatch...)."""


def _check_field(name: str, man: CacheManifest, index) -> registry.Field:
    f = registry.lookup(name)
    if f is None:
        raise FieldError(f"{name!r} cannot be added: it is not a declared field (a codes_<codec> or audio_<name> "
                         "name, or a field a plug-in registers with shards.fields.register)")
    import pyarrow.compute as pc
    held = set(pc.unique(index.column("members").combine_chunks().flatten().field("name")).to_pylist())
    if f.suffix in held and name not in man.sidecar_fields:
        raise FieldError(f"{name!r} cannot be added: the cache's stage one already wrote it; choose another name "
                         "(e.g. codes_<codec>)")
    return f


def write_sidecar(cache_dir: Path, shard: str, field_name: str, keys: list[str],
                  members: list[dict[str, np.ndarray]]) -> dict:
    """Write the sidecar tar of ``field_name`` for ``shard`` atomically (one ``KEY.<field>.npy``
    member per array of ``members[j]``, in key order), then its part; returns its manifest entry."""
    name = registry.sidecar_name(shard, field_name)
    path = safe_shard_path(cache_dir, name)
    tmp = path.with_name(name + ".tmp")
    with session(path) as s:  # the command's writing session: O_EXCL | O_NOFOLLOW, no symlink written through
        with os.fdopen(s.create(tmp, 0o444), "wb") as fh:
            with tarfile.open(fileobj=fh, mode="w|", format=tarfile.PAX_FORMAT) as tf:
                for key, arrays in zip(keys, members):
                    for field in sorted(arrays):
                        data = npy_bytes(np.ascontiguousarray(arrays[field]))
                        tf.addfile(tar_member(f"{key}.{field}.npy", len(data)), io.BytesIO(data))
            fh.flush()
            os.fsync(fh.fileno())
        rows, sha, size = scan_shard(tmp, name)  # the same offsets a reader will use
        written = [r["key"] for r in rows]
        if [k for k, m in zip(keys, members) if m] != written:
            s.unlink(tmp)
            raise FieldError(f"{name}: written keys differ from {shard}'s (bug)")
        s.replace(tmp, path)
        s.fsync_dir(path)
    entry = dict(path=name, shard=shard, samples=len(rows), bytes=size, sha256=sha)
    part_rows = [dict(key=r["key"], members=[dict(m, file=name) for m in r["members"]]) for r in rows]
    write_sidecar_part(cache_dir, shard, field_name, part_rows, entry)
    return entry


def image_loader(man: CacheManifest):
    """``path -> uint8 (H, W, 3)`` with the image preprocessing recorded in the cache's config."""
    from .config import PrecomputeConfig
    from .images import load_image
    cfg = dict(man.config or {})
    d = PrecomputeConfig()
    size, mode = int(cfg.get("image_size", d.image_size)), str(cfg.get("image_resize", d.image_resize))
    rgb = str(cfg.get("image_rgb", d.image_rgb))
    return lambda path: load_image(path, size, mode=mode, max_pixels=int(cfg.get("max_image_pixels", d.max_image_pixels)),
                                   min_side=int(cfg.get("min_image_side", d.min_image_side)), rgb=rgb)


def _pending_path(cache_dir: Path, field_name: str) -> Path:
    return Path(cache_dir) / PARTS_DIR / f"{field_name}.field.json"


@writes_cache("add-field", cache="cache_dir", rank="global_rank")
def add_field(cache_dir: str | Path, field_name: str, spec: dict, *, device: str = "cpu",
              global_rank: int = 0, world_size: int = 1, barrier=None, replace: bool = False,
              progress: bool = True, batch_size: int = 8) -> dict | None:
    """Add ``field_name`` to the cache with the producer of ``spec`` (this rank's share of the
    shards, ``batch_size`` samples per producer call); rank 0 merges at the end.

    Returns the new manifest dict on rank 0 (None elsewhere). Raises :class:`FieldError` when the
    field is not declared, was written by stage one, or exists with another fingerprint (pass
    ``replace=True`` to drop and re-add it); ``ValueError`` for a bad producer spec;
    :class:`shards.lock.CacheLocked` when another command writes the cache (rank 0 holds the
    writer lock from the first line to the merge: :func:`shards.writing.writes_cache`).
    """
    import pyarrow.compute as pc
    import torch

    from .encode import to_members, value_checks
    from .encoders import fingerprint
    from .producers import load_producer
    from .producers.cached import CachedSample

    cache_dir = Path(cache_dir)
    sync = barrier or (lambda: None)
    man = CacheManifest.read(cache_dir)
    index = read_index(cache_dir)
    _check_field(field_name, man, index)
    sr = int(man.sample_rate or 0)
    from .identity import options_batch_policy, spec_batch_policy, spec_fingerprint
    producer = load_producer(spec, field_name, device)
    describe = producer.describe()
    fp = fingerprint(describe, preprocessing={"field": field_name, "from": "cache", "sample_rate": sr,
                                              **spec_fingerprint(spec)})
    batch = options_batch_policy(AddFieldOptions, {"encoder_batch_size": int(batch_size), "device": device}) | \
        spec_batch_policy(spec)
    old = man.fields.get(field_name)
    if old is not None and old.fingerprint != fp:
        if not replace:
            raise FieldError(f"{cache_dir}: field {field_name!r} exists with fingerprint {old.fingerprint[:16]}..., "
                             f"this producer gives {fp[:16]}...; drop it first (`shardcache drop-field "
                             f"{cache_dir} {field_name}`) or pass --replace")
        if global_rank == 0:
            drop_field(cache_dir, field_name)
        sync()
        man = CacheManifest.read(cache_dir)
        index = read_index(cache_dir)
        old = None
    if old is not None and old.extra.get("batch") != batch:  # completing a field (its incomplete sidecars)
        _refuse_batch(cache_dir, field_name, old.extra.get("batch"), batch)
    info = FieldInfo.from_dict({"fingerprint": fp, "encoder": describe, "sidecar": True,
                                "kind": registry.get(field_name).kind.name, "members": list(producer.outputs),
                                **producer.manifest_info(), "batch": batch})
    man.fields[field_name] = info
    checks = value_checks([producer], man)
    pending = _pending_path(cache_dir, field_name)
    if global_rank == 0:
        if pending.exists():
            prev = json.loads(pending.read_text())
            if prev.get("fingerprint") != fp:
                raise FieldError(f"{cache_dir}: an interrupted add-field of {field_name!r} used fingerprint "
                                 f"{str(prev.get('fingerprint'))[:16]}..., this run {fp[:16]}...; "
                                 f"`shardcache drop-field {cache_dir} {field_name}` first")
            if prev.get("batch") != batch:
                _refuse_batch(cache_dir, field_name, prev.get("batch"), batch)
        else:
            write_json_atomic({"fingerprint": fp, "encoder": describe, "batch": batch}, pending)
    sync()
    shards = sorted(s["path"] for s in man.shards or [])
    mine = shards[global_rank::world_size]
    load_img = image_loader(man) if producer.needs_images else None
    t0, done, missing = time.perf_counter(), 0, []
    from .producers import Timer
    timer = Timer(device)
    for shard in mine:
        if sidecar_part_path(cache_dir, shard, field_name).exists():
            continue  # committed by an earlier run
        rows = index.filter(pc.equal(index.column("shard"), shard))
        reader = ShardReader(cache_dir, index=rows, manifest=man.to_dict())
        samples = [CachedSample(reader.get(i), sr, load_img) for i in range(rows.num_rows)]
        members: list[dict[str, np.ndarray]] = []
        with torch.inference_mode():
            for a in range(0, len(samples), batch_size):
                batch = samples[a:a + batch_size]
                for smp, got in zip(batch, producer.produce(batch, timer)):
                    arrays, why = (None, f"{type(got).__name__}: {got}") if isinstance(got, Exception) \
                        else to_members(got, checks)
                    if why is not None:
                        log.warning("%s: sample %r gets no %s: %s", shard, smp.key, field_name, why)
                        missing.append({"key": smp.key, "reason": why})
                    members.append({k[:-4]: v for k, v in (arrays or {}).items()})
        reader.close()
        write_sidecar(cache_dir, shard, field_name, [smp.key for smp in samples], members)
        done += 1
        if progress:
            log.info("[rank %d] %s: %d samples (%d/%d shards, %.1f s)", global_rank,
                     registry.sidecar_name(shard, field_name), len(samples), done, len(mine), time.perf_counter() - t0)
    sync()
    if global_rank != 0:
        return None
    _wait(cache_dir, shards, field_name)
    if missing:
        info.extra["missing"] = missing
    manifest = _merge(cache_dir, man, field_name, info)
    with session(pending) as s:
        s.unlink(pending)
    return manifest


def _refuse_batch(cache_dir: Path, field_name: str, recorded: dict | None, batch: dict) -> None:
    """Raise :class:`FieldError`: the field was started with another batch policy (its sidecars would mix two)."""
    raise FieldError(f"{cache_dir}: field {field_name!r} was started with batch policy {recorded}, this run has "
                     f"{batch}: on a GPU a sample's values depend on its batch; rerun with the recorded "
                     f"--encoder_batch_size / device / spec, or `shardcache drop-field {cache_dir} {field_name}` first")


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


@writes_cache("drop-field", cache="cache_dir")
def drop_field(cache_dir: str | Path, field_name: str) -> dict:
    """Remove field ``field_name``: its sidecars, their parts, its index members and manifest entry.

    The integrity root goes first (until the new one is written, readers are refused rather than
    shown an index naming sidecars that are gone), then the sidecars and their parts, then the index
    and manifest are written without the field, the root last. Raises :class:`FieldError` for a
    stage-one field, :class:`shards.lock.CacheLocked` when another command writes the cache."""
    cache_dir = Path(cache_dir)
    man = CacheManifest.read(cache_dir)
    info = man.fields.get(field_name)
    if field_name in {f.name for f in registry.FIELDS} or (info is not None and not info.sidecar):
        raise FieldError(f"{field_name!r} is a stage-one field; only fields added with add-field can be dropped")
    with session(cache_dir / ROOT_FILE) as s:
        s.unlink(cache_dir / ROOT_FILE)
        for p in sidecar_parts(cache_dir, field_name):
            s.unlink(p)
        for e in man.shards or []:
            for name in (registry.sidecar_name(e["path"], field_name),
                         registry.sidecar_name(e["path"], field_name) + ".tmp"):
                s.unlink(safe_shard_path(cache_dir, name))
        s.unlink(_pending_path(cache_dir, field_name))
    return _merge(cache_dir, man, field_name, None)


# ------------------------------------------------------------------------------------------ CLI

@dataclass
class AddFieldOptions:
    """The options of shardcache add-field (each declares its effect on the field's identity; the keys of the
    producer spec they make are declared by the producer and its encoder: precompute.identity)."""

    field: str = option("", effect=BYTES)
    """Field name, e.g. codes_mimi, audio_16k or a plug-in's field. Required."""
    producer: Optional[str] = option(None, effect=SPEC)
    """What computes it: a producer name (codes, waveform, latents, image_features) or a plug-in module:factory."""
    options: Optional[dict[str, Any]] = option(None, effect=SPEC)
    """The producer's options as a YAML/JSON mapping, e.g. '{sample_rate: 16000, direction: in}'."""
    audio_tokenizer: Optional[str] = option(None, effect=SPEC)
    """Codes fields: the codec (a registry name or a plug-in module:factory)."""
    pretrained: Optional[str] = option(None, effect=IDENTITY)
    """Codes fields: the codec's checkpoint directory or hub id."""
    revision: Optional[str] = option(None, effect=IDENTITY)
    """Codes fields: the hub revision (branch, tag or commit) of --pretrained; default main (a folder has none)."""
    config: Optional[str] = option(None, effect=SPEC)
    """Codes fields: a YAML file with an audio_tokenizer mapping (a precompute config), or the mapping itself."""
    device: str = option("cpu", effect=Effect("batch", canonical=lambda d: str(d).partition(":")[0]))
    """Device of the producer's encoder (cpu, cuda; under a launcher cuda is cuda:<local rank>)."""
    encoder_batch_size: bounded(int, gt=0, le=65536) = option(8, effect=BATCH)
    """Samples per producer call."""
    replace: bool = option(False, effect=OPERATIONAL)
    """Drop the field first if it exists with another producer."""
    no_progress: bool = option(False, effect=OPERATIONAL)
    """No per-shard progress lines."""


def producer_spec(args: Any) -> dict[str, Any]:
    """The producer spec of the command line (an :class:`AddFieldOptions`): ``--producer`` (+ ``--options``),
    else the codec flags (``--audio_tokenizer``/``--pretrained``/``--revision``/``--config``: producer
    ``codes``). Without
    either, a ``codes_<codec>`` field needs the codec flags; other fields need ``--producer``. Raises
    :class:`~shardcache.config.ConfigError` naming the option."""
    options: dict[str, Any] = dict(args.options or {})
    if args.producer:
        if ":" in args.producer:
            return {"factory": args.producer, "kwargs": options}
        return {"producer": args.producer, **options}
    codec: dict[str, Any] = {}
    if args.config:  # a file (a precompute config), else YAML text of the mapping itself
        try:
            loaded = read_yaml(args.config) if os.path.lexists(args.config) else load_yaml(args.config, "--config")
        except YAMLRefused as e:
            raise ConfigError([(e.where, e.reason)]) from None
        except yaml.YAMLError:
            loaded = None
        if not isinstance(loaded, dict):
            raise ConfigError([("config", "expected a YAML file with an audio_tokenizer mapping or the mapping "
                                          f"itself ({{name: mimi, pretrained: DIR}}), got {args.config!r}: no such "
                                          "file, nor a mapping")])
        codec = dict(loaded.get("audio_tokenizer") or loaded)
    if args.audio_tokenizer:
        spec = args.audio_tokenizer
        codec = {"factory": spec} if ":" in spec else dict(codec, name=spec)
    if args.pretrained:
        codec["pretrained"] = args.pretrained
    if args.revision:
        codec["revision"] = args.revision
    if not codec:
        raise ConfigError([("producer", "give --producer NAME|module:factory (with --options), or for a codes "
                                        "field --audio_tokenizer NAME|module:factory and --pretrained DIR|hub-id")])
    return {"producer": "codes", "audio_tokenizer": codec, **options}


def build_add_parser():
    """``shardcache add-field CACHE`` and a flag per option of :class:`AddFieldOptions` (jsonargparse: types,
    mappings, ``--help``)."""
    from jsonargparse import ArgumentParser

    from shardcache import config as S
    p = ArgumentParser(prog="shardcache add-field", description=plain(__doc__), exit_on_error=False,
                       formatter_class=HelpFormatter, parser_mode="shardcache")
    p.add_argument("cache", metavar="CACHE", help="the cache directory")
    S.add_options(p, AddFieldOptions)
    return p


def main_add(argv: list[str]) -> int:
    from shardcache import config as S
    from shardcache.weights import CheckpointUnreadable
    p = build_add_parser()
    try:
        args, ns = S.parse(p, AddFieldOptions, argv)  # (its --config is an option: a codec's config)
        if not args.field:
            raise ConfigError([("field", "required: the name of the field to add")])
        spec = producer_spec(args)
    except ConfigError as e:
        return e.report("shardcache add-field")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from shardcache.ranks import Ranks
    try:
        ranks = Ranks.detect()
        barrier, close = ranks.barrier()
    except ValueError as e:  # a partial launcher environment, or no rendezvous for the barrier
        print(f"error: {e}", file=sys.stderr)
        return 2
    global_rank, world_size = ranks.global_rank, ranks.world_size
    device = args.device
    if device == "cuda" and world_size > 1:
        device = f"cuda:{ranks.local_rank}"
    try:
        m = add_field(ns.cache, args.field, spec, device=device, global_rank=global_rank,
                      world_size=world_size, barrier=barrier, replace=args.replace, progress=not args.no_progress,
                      batch_size=args.encoder_batch_size)
    except (WriteRefused, CheckpointUnreadable) as e:  # another command writes the cache, or it is no cache; a
        print(f"error: {e}", file=sys.stderr)             # checkpoint file that cannot be read: nothing was written
        return 2
    except (ShardcacheError, FileNotFoundError, ValueError, ImportError, AttributeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        close()
    if m is not None:
        fi = m["fields"][args.field]
        print(f"cache {ns.cache}: field {args.field} added ({len(fi['shards'])} sidecars, "
              f"{sum(s['bytes'] for s in fi['shards']) / 1e6:.1f} MB), fingerprint {fi['fingerprint'][:16]}")
    return 0


def build_drop_parser() -> argparse.ArgumentParser:
    """``shardcache drop-field CACHE NAME``."""
    p = argparse.ArgumentParser(prog="shardcache drop-field",
                                description="Remove a field added with add-field (its sidecars, index members, "
                                            "manifest entry); no other byte changes.")
    p.add_argument("cache", metavar="CACHE")
    p.add_argument("field", metavar="NAME")
    return p


def main_drop(argv: list[str]) -> int:
    args = build_drop_parser().parse_args(argv)
    try:
        drop_field(args.cache, args.field)
    except WriteRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ShardcacheError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"cache {args.cache}: field {args.field} dropped")
    return 0
