"""The stage-one job: manifest rows -> chunks -> decode (workers) -> encode (device) -> shards.

Work units. The manifest's rows, in order, are cut into chunks of ``samples_per_shard`` rows;
chunk ``j`` becomes ``shard-{j:06d}.tar`` (with its index/rejects parts; the index part is the
commit marker). Chunks not yet committed are dealt round-robin to the ranks of this run. So the
cache is a function of (manifest, config, encoder weights) only: the same shard names and sample
bytes for any number of ranks, kills and reruns, or decode workers (encoder batches are formed
inside one chunk, from its start). One mechanism gives resume after a kill, incremental runs (rows
added to the manifest go into new chunks), reruns that follow an edited manifest (a chunk holding a
changed or deleted row is deleted and its rows encoded again: :mod:`precompute.rerun`) and elastic
multi-rank jobs: a torchrun restart with any number of ranks shares out the chunks still missing.
Rank 0 merges the index when every chunk is committed, polling the parts folder instead of waiting
at a collective (a slow rank delays the job, never crashes it); ``shardcache shards reindex`` rebuilds the index from committed
shards at any time. ``out_dir`` may be a URL in object storage: chunks are committed in a local
staging folder and uploaded, index part last (:mod:`precompute.output`).

Overlap. Decoding and resampling run in DataLoader worker processes; the main thread only runs
encoders (batched, on the device); a writer thread commits shards from a bounded queue. The
fraction of wall time spent inside encoder calls is reported as ``encoder_busy``. Encoder batches
are formed by length from a window of decoded rows of one chunk and written back in manifest
order; ``num_workers: auto`` sizes the decode processes from the first batch's measured rates
(:mod:`precompute.pipeline`).
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from shardcache.config import to_dict
from shardcache.workers import auto_workers

from shards import schema
from shards.index import PARTS_DIR, merge_parts, read_part_meta
from shards.manifest import TextInfo
from shards.writer import ShardWriter
from shards.writing import CacheWriter

from . import chat
from .config import PrecomputeConfig
from .conversation import OUTSIDE_ROOT
from .encode import Pipeline, Summary, load_encoders
from .lock import die_with_parent
from .manifests import Request, read_requests
from .output import LocalOutput, open_output
from .pipeline import EncodeStream, job_workers, preload_decoders
from .precision import check_precision
from .identity import JOB_FILE, batch_policy, check_job_record, filter_values
from .rerun import carried_name, carry_removed, chunk_meta, plan_rerun, row_ids, write_carried
from .prepare import PrepareDataset, identity_collate
from .producers import WaveformProducer

log = logging.getLogger("precompute")


def row_id(req: Request) -> str:
    """Identity of one manifest row for resume bookkeeping, from the manifest alone (:func:`precompute.rerun.row_ids`,
    which also numbers rows claiming one id)."""
    return row_ids([req])[0]


def precision_check(pipe: Pipeline, requests: list[Request]) -> dict | None:
    """Measure half-precision encoders against float32 on the job's first rows (None for float32 and
    for ``precision_samples`` 0).

    Raises :class:`precompute.precision.PrecisionMismatch` outside ``cfg.precision_tolerance``.
    """
    cfg, enc = pipe.cfg, pipe.enc
    if cfg.encoder_dtype in ("float32", "fp32"):
        return None
    if cfg.precision_samples == 0:  # e.g. the theworld preset: bfloat16 is the reference there
        log.info("encoder_dtype=%s not measured against float32 (precision_samples 0)", cfg.encoder_dtype)
        return None
    ref = load_encoders(cfg, pipe.device, dtype="float32")
    # half of the rows with an image where the manifest has them, so both encoders are measured
    n_img = cfg.precision_samples // 2 if any(r.has_image and not r.error for r in requests) else 0
    picked: dict[bool, list] = {True: [], False: []}
    quota = {True: n_img, False: cfg.precision_samples - n_img}
    for req in requests:
        kind = req.has_image
        if req.error or len(picked[kind]) >= quota[kind]:
            if all(len(picked[k]) >= quota[k] for k in picked):
                break
            continue
        p = pipe.prepare(req)
        if p.error is None:
            picked[kind].append(p)
    prepared = picked[True] + picked[False]
    with torch.inference_mode():
        result = check_precision(enc, ref, prepared, cfg.precision_tolerance, cfg.encoder_dtype)
    log.info("encoder_dtype=%s vs float32 on %d rows: latents rel. err %s, codes agreement %s",
             cfg.encoder_dtype, result["samples"], result["latents_rel_err"], result["codes_agreement"])
    return result


def check_fingerprint(out_dir: Path, fp: str, describe: dict, global_rank: int, batch: dict | None = None) -> bool:
    """Refuse to add to a cache made with other encoders/preprocessing or another batch policy; record ours on
    first use (returns True when this call wrote ``parts/job.json``): :func:`precompute.identity.check_job_record`.

    Raises :class:`FingerprintMismatch` (:class:`precompute.identity.BatchPolicyMismatch`) naming what differs.
    """
    return check_job_record(out_dir, fp, describe, batch or {}, global_rank)


def check_root(requests: list[Request], manifest: str | Path, root: str | Path | None) -> None:
    """Raise ``ValueError`` when every row was rejected for a path outside the media root: then the
    root is wrong, not the rows (an empty cache with exit 0 would hide it). Some such rows only
    log a warning (their rejects name each one)."""
    outside = [r for r in requests if r.error and OUTSIDE_ROOT in r.error[1]]
    if not outside:
        return
    where = f"--root {root}" if root else f"the manifest's folder {Path(manifest).resolve().parent}"
    if len(outside) == len(requests):
        raise ValueError(f"{manifest}: every row names media outside {where} (e.g. {outside[0].error[1]}); "
                         "pass --root DIR (a folder holding every media file) or set allow_outside_root: true")
    log.warning("%d of %d rows name media outside %s: rejected as malformed_row (see rejects.parquet; "
                "allow_outside_root: true reads them)", len(outside), len(requests), where)


def check_posterior(image_encoder: Any) -> None:
    """Raise ``ValueError`` (before anything is written) when ``store_posterior`` cannot be honoured."""
    why = getattr(image_encoder, "posterior_unsupported", None)
    if not callable(getattr(image_encoder, "encode_posterior", None)):
        why = f"{type(image_encoder).__name__} has no encode_posterior() method"
    if why:
        raise ValueError(f"store_posterior: true, but the image encoder has no posterior to store: {why}. "
                         "Set store_posterior: false or use the wan image encoder.")


def committed(out_dir: Path) -> dict[str, dict]:
    """Committed chunks: part stem (``shard-000003``) -> the job metadata of its index part
    (:func:`precompute.rerun.chunk_meta`)."""
    return {p.name.split(".")[0]: read_part_meta(p) or {}
            for p in sorted((out_dir / PARTS_DIR).glob("*.index.parquet"))}


def plan_chunks(requests: list[Request], per_shard: int, done: dict[str, set[str]],
                ids: list[str] | None = None) -> list[tuple[str, list[Request]]]:
    """The chunks still to encode: ``[(shard_name, rows)]`` in manifest order.

    The manifest's ``N`` rows are cut into ``ceil(N / per_shard)`` chunks of equal size (give or
    take one row: 268 rows at 256 per shard become 134 + 134, not 256 + 12, so readers that split
    by shard stay balanced); chunk ``j`` becomes ``shard-{j:06d}.tar``, whatever the number of
    ranks, kills and reruns (a committed chunk is skipped). Rows added to the manifest after a
    chunk was committed (incremental runs) go, in order, into new chunks numbered after every
    chunk there is. ``done``: stem -> the row ids of each committed chunk kept; ``ids``: each
    request's id (default :func:`row_id`).
    """
    covered = set().union(*done.values()) if done else set()
    ids = ids if ids is not None else [row_id(r) for r in requests]
    id_of = {id(r): i for r, i in zip(requests, ids)}
    n_pos = -(-len(requests) // per_shard)
    edges = [j * len(requests) // n_pos for j in range(n_pos + 1)] if n_pos else [0]  # sizes differ by <= 1
    todo, leftover = [], []
    for j in range(n_pos):
        rows = [r for r in requests[edges[j]:edges[j + 1]] if id_of[id(r)] not in covered]
        if schema.chunk_shard_name(j)[:-4] in done:
            leftover += rows  # the chunk was committed when the manifest was shorter
        elif rows:
            todo.append((schema.chunk_shard_name(j), rows))
    numbers = [schema.parse_shard_name(stem + ".tar")[1] for stem in done] + [n_pos - 1]
    nxt = max(numbers) + 1
    for k in range(0, len(leftover), per_shard):
        todo.append((schema.chunk_shard_name(nxt + k // per_shard), leftover[k:k + per_shard]))
    return todo


class _ChunkWriter(threading.Thread):
    """Background thread: receives encoded rows in order, commits each chunk when complete."""

    def __init__(self, output: LocalOutput, chunks: list[tuple[str, list[Request]]], summary: Summary,
                 progress, row_meta: dict[int, Any]):
        super().__init__(daemon=True, name="shard-writer")
        self.output, self.out_dir = output, output.local
        self.row_meta = row_meta  # id(request) -> its precompute.rerun.RowRecord
        self.chunks, self.summary, self.progress = chunks, summary, progress
        self.queue: queue.Queue = queue.Queue(maxsize=64)
        self.error: BaseException | None = None

    def run(self) -> None:
        writer = None
        try:
            for name, rows in self.chunks:
                writer = ShardWriter(self.out_dir, name)
                for _ in rows:
                    item = self.queue.get()
                    if item is None:
                        writer.abort()
                        return
                    key, fields, reject = item
                    if reject:
                        writer.reject(*reject)
                    else:
                        writer.add(key, fields)
                self._commit(writer, rows)
                writer = None
        except BaseException as e:  # surfaced by the main thread
            self.error = e
            if writer is not None:
                writer.abort()
            while True:  # unblock the producer
                try:
                    if self.queue.get(timeout=1) is None:
                        break
                except queue.Empty:
                    continue

    def _commit(self, writer: ShardWriter, rows: list[Request]) -> None:
        # the manifest rows this chunk covered and what they said: resume / rerun bookkeeping
        entry = writer.commit(chunk_meta([self.row_meta[id(r)] for r in rows], writer.keys))
        self.output.chunk_committed(writer.name, entry is not None)  # a remote cache: upload it
        self.summary.shards_written += entry is not None
        if self.progress is not None:
            self.progress.set_postfix(shards=self.summary.shards_written, rejected=self.summary.rejected)

    def put(self, item) -> None:
        if self.error is not None:
            raise RuntimeError(f"shard writer failed: {self.error}") from self.error
        self.queue.put(item)


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


def resolve_device(device: str, local_rank: int) -> str:
    """``auto`` -> ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if device == "auto":
        return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    return device


def resolve_workers(num_workers: int | str, device: str) -> int:
    """Decode worker processes for ``num_workers`` ("auto" or a count) on ``device``: auto is
    :func:`shardcache.workers.auto_workers` (on CPU 0: with 2 workers on a 2-core machine the
    real-size encoders ran 15 % slower than with decoding inline)."""
    if num_workers != "auto":
        return int(num_workers)
    return auto_workers(on_accelerator=not device.startswith("cpu"))


def run(manifest: str | Path, out_dir: str | Path, cfg: PrecomputeConfig, *, root: str | Path | None = None,
        global_rank: int = 0, world_size: int = 1, local_rank: int = 0, barrier=None,
        progress: bool = True, storage_options: dict | None = None,
        staging: str | Path | None = None) -> tuple[Summary, dict | None]:
    """Run stage one for this rank; rank 0 merges the parts at the end.

    Args:
        manifest: manifest file (see :func:`precompute.manifests.read_requests`).
        out_dir: cache directory (created). Existing committed chunks are kept and skipped. A URL
            (``s3://bucket/cache``...) writes through the local folder ``staging`` and uploads each
            committed chunk (:mod:`precompute.output`; ``storage_options`` for fsspec).
        cfg: the job's :class:`PrecomputeConfig`.
        barrier: callable synchronising all ranks (``torch.distributed.barrier``) when world_size > 1.

    Returns ``(summary, manifest_dict)``; ``manifest_dict`` is None on ranks other than 0.
    Raises :class:`FingerprintMismatch` when ``out_dir`` holds a cache from other encoders,
    :class:`shards.lock.CacheLocked` (rank 0, before anything is written) when another command
    is writing to it, :class:`shards.writing.NotACache` when ``out_dir`` holds files of another tool.
    """
    t0 = time.perf_counter()
    output = open_output(out_dir, storage_options=storage_options, staging=staging, global_rank=global_rank)
    # one writer per cache, in a folder it owns (rank 0 takes the lock; the other ranks write under it)
    with CacheWriter(output.local, "precompute", rank=global_rank, create=True):
        summary, result = _run(output, manifest, cfg, root=root, global_rank=global_rank, world_size=world_size,
                               local_rank=local_rank, barrier=barrier, progress=progress, t0=t0)
    return summary, result


def _run(output, manifest: str | Path, cfg: PrecomputeConfig, *, root, global_rank: int, world_size: int,
         local_rank: int, barrier, progress: bool, t0: float) -> tuple[Summary, dict | None]:
    """:func:`run` once the cache's writer lock is held (by rank 0)."""
    output.pull()  # a remote cache: its committed parts, so a rerun resumes against the bucket
    out_dir = output.local
    sync = barrier or (lambda: None)
    device = resolve_device(cfg.device, local_rank)
    requests = read_requests(manifest, root=root, fmt=cfg.manifest_format, columns=cfg.columns,
                             allow_outside_root=cfg.allow_outside_root)
    check_root(requests, manifest, root)
    pipe = Pipeline.build(cfg, device, requests)  # tokens the rows need are checked / added first
    enc, template, fp, describe = pipe.enc, pipe.template, pipe.fingerprint, pipe.describe
    if cfg.store_posterior and enc.image is not None:
        check_posterior(enc.image)
    precision = precision_check(pipe, requests)
    if check_fingerprint(out_dir, fp, describe, global_rank, batch_policy(cfg, device)):
        output.push_part(JOB_FILE)
    done = committed(out_dir)  # read by every rank before rank 0 deletes stale chunks
    rerun, records = plan_rerun(requests, done, source_digest=cfg.source_digest, keep_removed=cfg.keep_removed_rows,
                                filters=filter_values(cfg))
    ids = [r.id for r in records]
    if done and global_rank == 0:
        log.info("%s", rerun.describe())
    sync()
    carried = carry_removed(out_dir, rerun) if global_rank == 0 else []  # removed rows kept from stale chunks
    if rerun.stale and global_rank == 0:
        output.drop_chunks(rerun.stale)  # changed or deleted rows: their chunks are encoded again
    kept = {stem: set(meta.get("rows") or []) for stem, meta in done.items() if stem not in rerun.stale}
    plan = plan_chunks(requests, cfg.samples_per_shard, kept, ids)
    if carried:
        write_carried(output, carried_name([n for n, _ in plan], kept, len(requests), cfg.samples_per_shard), carried)
    sync()  # every rank has read the same state before anyone commits a chunk
    chunks = plan[global_rank::world_size]  # chunk k of the plan -> rank k % world_size
    items = [(req, ci) for ci, (_, rows) in enumerate(chunks) for req in rows]
    summary = Summary(skipped_rows=len(requests) - sum(len(rows) for _, rows in plan), rerun=rerun.counts())
    bar = tqdm(total=len(items), desc=f"precompute r{global_rank}", unit="sample",
               disable=not progress or global_rank != 0, dynamic_ncols=True)
    summary.setup_s = time.perf_counter() - t0
    t_loop = time.perf_counter()
    writer = _ChunkWriter(output, chunks, summary, bar, {id(r): rec for r, rec in zip(requests, records)})
    writer.start()
    workers = summary.decode_workers = job_workers(cfg.num_workers, device, pipe, [r for r, _ in items],
                                                   cfg.encoder_batch_size)
    preload_decoders()  # before the workers fork: they inherit the decode libraries
    loader = DataLoader(PrepareDataset(items, cfg, pipe.rates, enc.text, template, pipe.image_multiple,
                                       pipe.tokens, pipe.source_images),
                        batch_sampler=chunk_batches([c for _, c in items], cfg.encoder_batch_size), num_workers=workers,
                        collate_fn=identity_collate, prefetch_factor=4 if workers else None,
                        worker_init_fn=functools.partial(die_with_parent, os.getpid()) if workers else None)
    stream = EncodeStream(lambda rows: pipe.encode(rows, summary), cfg.encoder_batch_size)  # length buckets

    def put(done: list) -> None:
        for key, fields, reject in done:
            if reject:
                summary.rejected += 1
                summary.reasons[reject[2]] = summary.reasons.get(reject[2], 0) + 1
            else:
                summary.kept += 1
                summary.audio_seconds += fields["json"]["duration_s"]
            writer.put((key, fields, reject))

    try:
        with torch.inference_mode():
            for batch in loader:
                put(stream.feed(batch))
                bar.update(len(batch))
            put(stream.close())
    finally:
        writer.queue.put(None)
        writer.join()
        bar.close()
    if writer.error is not None:
        raise RuntimeError(f"shard writer failed: {writer.error}") from writer.error
    summary.wall_s = time.perf_counter() - t_loop
    result = None
    if global_rank == 0:  # the other ranks are done; rank 0 merges once every chunk is committed
        output.wait_for_chunks([name for name, _ in plan])
        man = pipe.info  # the producers' facts (codec sizes, latent channels, extra fields), typed
        man.fingerprint, man.encoders, man.sample_rate = fp, describe, cfg.sample_rate
        man.waveforms = {p.field: p.manifest_info() for p in pipe.producers if isinstance(p, WaveformProducer)}
        man.text = TextInfo.from_dict(chat.describe(template, enc.text, pipe.tokens, pipe.added))
        man.text_vocab_size, man.text_pad_id = enc.text.vocab_size, enc.text.pad_id
        man.config, man.source_manifest, man.world_size = to_dict(cfg), str(manifest), world_size
        if precision:
            man.extra["precision_check"] = precision
        result = merge_parts(out_dir, man)
        output.publish()
        for name, info in sorted((result.get("fields") or {}).items()):
            if isinstance(info, dict) and info.get("incomplete"):
                log.warning("field %r (added by add-field) has no sidecar for %d new or re-encoded shard(s) (%s): "
                            "run the same `shardcache add-field %s --field %s ...` again (it adds only the missing "
                            "sidecars), or `shardcache drop-field %s %s`", name, len(info["incomplete"]),
                            ", ".join(info["incomplete"][:3]), output.target, name, output.target, name)
    return summary, result
