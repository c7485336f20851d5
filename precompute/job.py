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

The spine. :meth:`Job.build` is where the config stops: it loads the encoders and reads what
they declare (:mod:`precompute.encoders.capabilities`: device, batching, asynchronous calls), builds
the producers, the chat tokens, the audio rates each item is read at, the one picklable
:class:`precompute.prepare.Preparer` the decode workers run, the value checks and the fingerprint.
Everything after it (the decode workers, the encoder thread, ``shardcache check``) reads the
:class:`Job`.

Overlap. Decoding and resampling run in DataLoader worker processes; the encoders run on their own
thread (:mod:`precompute.executor`; on CUDA its own stream, one wait per batch); the main thread
receives decoded rows, runs the host-only producers, checks values and builds the json member; a
writer commits shards (:mod:`precompute.writer`: on an accelerator in its own process, so tar, npz and
hashes stay off this process's GIL). The fraction of wall time spent inside encoder
calls is reported as ``encoder_busy``, and where the rest went in :meth:`Summary.split`. Encoder
batches are formed by length from a window of decoded rows of one chunk (when an encoder batches)
and written back in manifest order; ``num_workers: auto`` sizes the decode processes from the first
batch's measured rates (:mod:`precompute.pipeline`).
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass
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
from shards.writing import CacheWriter

from . import chat
from . import encode as E
from .config import PrecomputeConfig
from .conversation import OUTSIDE_ROOT
from .encode import Encoders, Summary, load_encoders
from .encoders import fingerprint
from .encoders.capabilities import Capabilities
from .executor import EncoderThread
from .faults import WorkerPids, legacy_infrastructure_rejects, raise_if_stopped
from .lock import die_with_parent
from .manifests import Request, read_requests
from .output import open_output
from .pipeline import EncodeStream, job_workers, preload_decoders
from .precision import check_precision
from .identity import JOB_FILE, batch_policy, check_job_record, filter_values
from .rerun import carried_name, carry_removed, plan_rerun, row_ids, write_carried
from .slots import receiver as slot_receiver, unpack as unpack_rows
from .writer import ChunkWriter
from .prepare import DecodeOptions, Prepared, PrepareDataset, Preparer, identity_collate
from .producers import Producer, WaveformProducer

log = logging.getLogger("precompute")


#: encoder batches held for length batching, per encoder batch (when an encoder batches)
WINDOW_BATCHES = 8
#: encoder batches in flight on the encoder thread while the main thread finishes the last
DEPTH = 2
#: decode batches each decode process works ahead
PREFETCH = 4


@dataclass
class Job:
    """Everything a stage-one job needs, built once from the config (:meth:`build`): the encoders
    and what they declare, the resolved chat template and tokens, the producers (and those of
    ``extra_fields``), the rates each audio item is read at, the one :class:`Preparer` the decode
    workers run, the value checks and the job's fingerprint. ``shardcache precompute`` runs it over
    the manifest (:func:`run`); ``shardcache check`` over a few rows to compare with a cache.

    Attributes beyond the names: ``capabilities`` (``{"audio_tokenizer"|"image_encoder":
    Capabilities}``, declared), ``added`` (tokens the job added to the text tokenizer),
    ``info`` (what ``manifest.json`` records about the fields), ``describe`` (the encoders'
    ``describe()`` and the preprocessing: what the fingerprint hashes), ``batch_size`` (rows per
    encoder batch), ``window`` (rows held to batch by length: ``WINDOW_BATCHES`` batches when an
    encoder batches inputs of several lengths (a batched codec; the VAE with ``image_resize:
    bucket``), else one batch: rows go on as they come)."""

    cfg: PrecomputeConfig
    device: str
    enc: Encoders
    capabilities: dict[str, Capabilities]
    template: str
    tokens: Any
    added: dict[str, int]
    producers: list[Producer]
    extra: dict[str, Producer]
    rates: tuple[tuple[int, frozenset[str]], ...]
    preparer: Preparer
    info: Any
    checks: dict[str, tuple]
    fingerprint: str
    describe: dict[str, Any]
    sample_rate: int
    batch_size: int
    window: int

    @classmethod
    def build(cls, cfg: PrecomputeConfig, device: str, requests: list | None = None) -> "Job":
        """Load the encoders on ``device`` and derive the rest (hashes every weight once). With the
        job's ``requests``, the special tokens their conversations need are checked first (added to
        the text tokenizer when ``add_missing_tokens``; :func:`precompute.chat.ensure_tokens`), so
        the fingerprint describes the tokenizer the job renders with."""
        enc = load_encoders(cfg, device)
        caps = enc.capabilities
        template = chat.resolve_template(cfg.chat_template, enc.text)
        producers, extra = E.job_producers(cfg, enc, template, device)
        tokens = E.job_tokens(cfg, producers)
        added: dict[str, int] = {}  # tokens the job needs and the tokenizer lacked
        convs = [r.conversation for r in requests or [] if r.conversation is not None]
        if convs:
            added = chat.ensure_tokens(enc.text, chat.needed_kinds(convs), tokens, cfg.add_missing_tokens)
            if added:
                log.info("added %s to the text tokenizer (vocab_size %d): resize the LM's embeddings", added,
                         enc.text.vocab_size)
        info = E.job_info(producers, extra, enc.text)
        encoders = enc.describe()
        preprocessing = cfg.preprocessing()
        if extra:  # the producers' own identity, beside the extra_fields options (precompute.identity)
            preprocessing["extra_field_producers"] = {name: p.describe() for name, p in extra.items()}
        rates = E.job_rates(producers)
        inputs = [p.image_input for p in producers if p.image_input is not None]
        if len(inputs) > 1:
            raise ValueError(f"{len(inputs)} producers declare an image_input; the decode workers make one per image")
        image_multiple = int(enc.image.spatial_factor) if enc.image is not None else 8  # no VAE: images are rejected
        preparer = Preparer(DecodeOptions.of(cfg), rates, enc.text, template, tokens, image_multiple,
                            inputs[0] if inputs else None)
        # a length window pays where a batching encoder gets inputs of several lengths: clips, or images
        # bucketed by aspect (the other image policies give every image the configured size)
        varies = {"audio_tokenizer": True, "image_encoder": cfg.image_resize == "bucket"}
        batched = any(c.batching.batched and varies[name] for name, c in caps.items())
        return cls(cfg, device, enc, caps, template, tokens, added, producers, extra, rates, preparer, info,
                   E.value_checks(producers, info), fingerprint(*encoders.values(), preprocessing=preprocessing),
                   encoders | {"preprocessing": preprocessing}, int(cfg.sample_rate), int(cfg.encoder_batch_size),
                   int(cfg.encoder_batch_size) * (WINDOW_BATCHES if batched else 1))

    @property
    def image_multiple(self) -> int:
        """Pixels per latent cell of the image encoder (8 without one: images are then rejected anyway)."""
        return self.preparer.image_multiple

    def prepare(self, req: Any, chunk: int = 0) -> Prepared:
        """Decode one manifest row (:class:`precompute.prepare.Preparer`)."""
        return self.preparer(req, chunk)

    def encode(self, batch: list[Prepared], summary: Summary) -> list[tuple[str, dict | None, tuple | None]]:
        """Encode one batch in this thread (:func:`precompute.encode.encode_batch`)."""
        return E.encode_batch(batch, self.producers, self.checks, self.sample_rate, summary)

    def start(self, batch: list[Prepared], thread: EncoderThread, summary: Summary) -> "Encoding":
        """Queue the batch's encoder work on ``thread`` and run its host-only producers here; the
        :class:`Encoding` finishes it when collected."""
        t = time.perf_counter()
        work = E.start(batch, self.producers, thread.submit)
        summary.host_s += time.perf_counter() - t
        return Encoding(self, work, summary)


class Encoding:
    """A batch in flight (:meth:`Job.start`): ``done()`` when the encoder thread has finished it,
    ``result()`` its rows (:func:`precompute.encode.finish`, on the calling thread)."""

    def __init__(self, job: Job, work: E.Work, summary: Summary):
        self.job, self.work, self.summary = job, work, summary

    def done(self) -> bool:
        return self.work.done()

    def result(self) -> list[tuple[str, dict | None, tuple | None]]:
        t = time.perf_counter()
        self.work.future.result()  # waiting for the encoder thread is collect_wait_s, not host work
        t1 = time.perf_counter()
        out = E.finish(self.work, self.job.producers, self.job.checks, self.job.sample_rate)
        self.summary.collect_wait_s += t1 - t
        self.summary.host_s += time.perf_counter() - t1
        return out


def row_id(req: Request) -> str:
    """Identity of one manifest row for resume bookkeeping, from the manifest alone (:func:`precompute.rerun.row_ids`,
    which also numbers rows claiming one id)."""
    return row_ids([req])[0]


def precision_check(job: Job, requests: list[Request]) -> dict | None:
    """Measure half-precision encoders against float32 on the job's first rows (None for float32 and
    for ``precision_samples`` 0).

    Raises :class:`precompute.precision.PrecisionMismatch` outside ``cfg.precision_tolerance``.
    """
    cfg, enc = job.cfg, job.enc
    if cfg.encoder_dtype in ("float32", "fp32"):
        return None
    if cfg.precision_samples == 0:  # e.g. the theworld preset: bfloat16 is the reference there
        log.info("encoder_dtype=%s not measured against float32 (precision_samples 0)", cfg.encoder_dtype)
        return None
    ref = load_encoders(cfg, job.device, dtype="float32")
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
        p = job.prepare(req)
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
    """Raise ``ValueError`` (before anything is written) when ``store_posterior`` cannot be honoured:
    the image encoder does not declare a posterior (:attr:`Capabilities.posterior`)."""
    from .encoders.capabilities import capabilities_of
    why = capabilities_of(image_encoder).posterior
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


def start_worker(parent: int, pids: WorkerPids, worker_id: int) -> None:
    """A decode worker's ``worker_init_fn``: it dies with the job (:func:`precompute.lock.die_with_parent`) and
    records its pid (:class:`precompute.faults.WorkerPids`)."""
    die_with_parent(parent)
    pids.record(worker_id)


def resolve_device(device: str, local_rank: int) -> str:
    """``auto`` -> ``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if device == "auto":
        return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    return device


def writer_process(device: str) -> bool:
    """Whether the shard writer gets a process of its own (:mod:`precompute.writer`): on an accelerator,
    where the encoder thread's kernel launches need the main process's GIL; on the CPU a thread (the
    cores are the encoders' and the decoders'; measured on 2 shared cores with a stand-in codec, the
    process gave no gain: docs/benchmarks.md)."""
    return not str(device).startswith("cpu")


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
    with CacheWriter(output.local, "precompute", rank=global_rank, create=True), \
            output.writer_lock("precompute", global_rank):  # (a remote cache: the lock at its location too)
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
    job = Job.build(cfg, device, requests)  # the config stops here; tokens the rows need are checked / added first
    enc, template, fp, describe = job.enc, job.template, job.fingerprint, job.describe
    if cfg.store_posterior and enc.image is not None:
        check_posterior(enc.image)
    precision = precision_check(job, requests)
    if check_fingerprint(out_dir, fp, describe, global_rank, batch_policy(cfg, device)):
        output.push_part(JOB_FILE)
    done = committed(out_dir)  # read by every rank before rank 0 deletes stale chunks
    rerun, records = plan_rerun(requests, done, source_digest=cfg.source_digest, keep_removed=cfg.keep_removed_rows,
                                filters=filter_values(cfg), retry=legacy_infrastructure_rejects(out_dir, done))
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
    preload_decoders()  # imports (librosa's take seconds) are setup; and the workers fork with them loaded
    summary.setup_s = time.perf_counter() - t0
    t_loop = time.perf_counter()
    workers = summary.decode_workers = job_workers(cfg.num_workers, device, job, [r for r, _ in items], job.batch_size)
    # decoded rows come through reusable shared-memory slots (precompute.slots): per worker, its batches
    # in flight, those held in the length window and on the encoder thread
    slots, collate = slot_receiver(workers, PREFETCH + job.window // job.batch_size + DEPTH + 2) if workers \
        else (None, identity_collate)
    pids = WorkerPids(workers)  # each decode worker's pid and row: a failed loader names one that died or hung
    stall = cfg.stall_timeout_s  # (precompute.faults: a process with work and no progress for that long hung)
    loader = DataLoader(PrepareDataset(items, job.preparer, pids if workers else None),
                        batch_sampler=chunk_batches([c for _, c in items], job.batch_size), num_workers=workers,
                        collate_fn=collate, prefetch_factor=PREFETCH if workers else None,
                        timeout=stall if workers else 0,
                        worker_init_fn=functools.partial(start_worker, os.getpid(), pids) if workers else None)

    record = {id(r): rec for r, rec in zip(requests, records)}  # the chunks' rows and what they said
    writer = ChunkWriter(output, [(name, [record[id(r)] for r in rows]) for name, rows in chunks], summary, bar,
                         process=writer_process(device), stall_s=stall)

    def put(done: list) -> None:
        for key, fields, reject in done:
            if reject:
                summary.rejected += 1
                summary.reasons[reject[2]] = summary.reasons.get(reject[2], 0) + 1
            else:
                summary.kept += 1
                summary.audio_seconds += fields["json"]["duration_s"]
            t = time.perf_counter()
            writer.put(key, fields, reject)
            summary.writer_wait_s += time.perf_counter() - t

    thread = EncoderThread(device, stall)  # the encoders run here, off the main thread
    stream = EncodeStream(lambda rows: job.start(rows, thread, summary), job.batch_size, job.window, depth=DEPTH)
    finished, loading = False, bool(workers)
    try:
        batches = pids.receive(iter(loader), stall, lambda i: f"row {items[i][0].key!r} ({items[i][0].source})")
        while True:
            t = time.perf_counter()
            batch = next(batches, None)
            raise_if_stopped()  # a SIGTERM whose Stopped a callback swallowed (precompute.faults): not this batch
            if batch is None:
                loading = False  # (the decode workers end here)
                break
            batch = unpack_rows(batch)
            summary.receive_s += time.perf_counter() - t
            put(stream.feed(batch))
            bar.update(len(batch))
        put(stream.close())
        raise_if_stopped()  # (nor the last chunk's commit)
        finished = True
    except Exception as e:  # (torch raises a decode worker's death wherever the main thread is)
        fault = pids.fault(e) if loading else None  # a decode worker died: an infrastructure fault
        if fault is not None:
            raise fault from e
        raise
    finally:
        thread.close()
        job.enc.close()  # (a codec's processes)
        timings = thread.timings
        summary.encoder_s += timings.busy_s
        summary.encoder_host_s += timings.host_s
        summary.encoder_device_s += timings.device_s
        t = time.perf_counter()
        try:
            writer.close(abort=not finished)  # the last chunk's commit; raises when the writer failed
        finally:
            summary.writer_wait_s += time.perf_counter() - t
            bar.close()
    summary.wall_s = time.perf_counter() - t_loop
    result = None
    if global_rank == 0:  # the other ranks are done; rank 0 merges once every chunk is committed
        output.wait_for_chunks([name for name, _ in plan])
        man = job.info  # the producers' facts (codec sizes, latent channels, extra fields), typed
        man.fingerprint, man.encoders, man.sample_rate = fp, describe, job.sample_rate
        man.waveforms = {p.field: p.manifest_info() for p in job.producers if isinstance(p, WaveformProducer)}
        man.text = TextInfo.from_dict(chat.describe(template, enc.text, job.tokens, job.added))
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
