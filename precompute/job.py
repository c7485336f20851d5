"""The stage-one job: manifest rows -> chunks -> decode (workers) -> encode (device) -> shards.

Planning. The manifest is read once as a stream (:class:`precompute.plan.ManifestPlan`: each row keyed,
checked and digested, the decisions across rows taken on columns, memory bounded by the block of rows read,
not by the manifest), compared with the committed chunks (:mod:`precompute.rerun`) and cut into chunks
(:mod:`precompute.chunks`) before any encoder is loaded. When nothing is to be encoded and the cache's
recorded :func:`precompute.identity.input_identity` (the options, checkpoints' files, plug-ins' code and
library versions the fingerprint is made from) is this job's, no encoder is loaded at all: the job says the
cache is up to date (and merges the index again only when a chunk was dropped). Otherwise the encoders are
loaded and the fingerprint is compared as before.

Work units. The manifest's rows, in order, are cut into chunks of ``samples_per_shard`` rows;
chunk ``j`` becomes ``shard-{j:06d}.tar`` (with its index/rejects parts; the index part is the
commit marker). Chunks not yet committed are dealt round-robin to the ranks of this run; each rank reads
its own chunks' rows from the manifest again as it encodes them (:class:`precompute.chunks.ChunkRows`). So the
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

The spine. The config is read in two places: :meth:`precompute.options.JobOptions.of` (how the manifest is
read, what a rerun compares, the batch policy, chunking, workers, precision: typed fields, read before any
encoder loads) and :meth:`Job.build`, which loads the encoders and reads what they declare
(:mod:`precompute.encoders.capabilities`: device, batching, asynchronous calls), starts what they run beside
this process (a codec's processes, all at once), builds the producers, the chat tokens, the audio rates each
item is read at, the one picklable :class:`precompute.prepare.Preparer` the decode workers run, the value
checks and the fingerprint. Everything after it (the decode workers, the encoder thread, ``shardcache
check``) reads the :class:`Job` and its :class:`~precompute.options.JobOptions`.

Progress. One bar per job (rank 0's) counts the rows written (encoded and handed to the shard writer, in
manifest order) of this rank's rows, with the rows read and rejected beside it; its rate, and so its ETA,
is the encoders' throughput.

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
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from shardcache.workers import auto_workers

from shards.index import PARTS_DIR, read_part_meta
from shards.merge import merge_parts
from shards.manifest import TextInfo, read_manifest
from shards.schema import INDEX_FILE, MANIFEST_FILE, ROOT_FILE
from shards.writing import CacheWriter

from . import chat
from . import encode as E
from .chunks import Chunk, ChunkRecords, ChunkRows, RowsDataset, plan_chunks
from .config import PrecomputeConfig
from .encode import Encoders, Summary, load_encoders
from .encoders import fingerprint
from .encoders.capabilities import Capabilities, Declares
from .executor import EncoderThread
from .faults import WorkerPids, legacy_infrastructure_rejects, raise_if_stopped
from .identity import (JOB_FILE, check_batch_record, check_job_record, input_identity, preprocessing_of,
                       record_inputs, recorded_inputs)
from .lock import die_with_parent
from .manifests import Request
from .options import JobOptions
from .output import open_output
from .pipeline import EncodeStream, job_workers, preload_decoders
from .plan import ManifestPlan
from .precision import check_precision
from .rerun import RerunPlan, carried_name, carry_removed, plan_rerun, write_carried
from .slots import receiver as slot_receiver, unpack as unpack_rows
from .writer import ChunkWriter
from .prepare import DecodeOptions, Prepared, Preparer, identity_collate
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

    Attributes beyond the names: ``options`` (:class:`~precompute.options.JobOptions`: the device and every
    other fact of the config the job reads), ``capabilities`` (``{"audio_tokenizer"|"image_encoder":
    Capabilities}``, declared), ``added`` (tokens the job added to the text tokenizer),
    ``info`` (what ``manifest.json`` records about the fields), ``describe`` (the encoders'
    ``describe()`` and the preprocessing: what the fingerprint hashes), ``batch_size`` (rows per
    encoder batch), ``window`` (rows held to batch by length: ``WINDOW_BATCHES`` batches when an
    encoder batches inputs of several lengths (a batched codec; the VAE with ``image_resize:
    bucket``), else one batch: rows go on as they come)."""

    cfg: PrecomputeConfig
    options: JobOptions
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

    @property
    def device(self) -> str:
        """The device the encoders run on (``options.device``)."""
        return self.options.device

    @classmethod
    def build(cls, cfg: PrecomputeConfig, device: str, requests: list | None = None, *,
              kinds: frozenset[str] | None = None, options: JobOptions | None = None) -> "Job":
        """Load the encoders on ``device`` (starting what they run beside this process: a codec's
        ``processes``, all at once) and derive the rest (hashes every weight once). The special tokens the
        job's rows need are checked first (added to the text tokenizer when ``add_missing_tokens``;
        :func:`precompute.chat.ensure_tokens`), so the fingerprint describes the tokenizer the job renders
        with: ``kinds``, the media kinds the rows hold (:attr:`precompute.plan.Stats.kinds`), or ``requests``
        (a list of rows) to find them in. ``options``: the job's :class:`~precompute.options.JobOptions`
        (default: ``cfg``'s on ``device``)."""
        options = options or JobOptions.of(cfg, device)
        enc = load_encoders(cfg, device)
        for encoder in (enc.audio, enc.image):
            if isinstance(encoder, Declares):
                encoder.start()  # e.g. audio_tokenizer.processes: N codec processes, all at once
        caps = enc.capabilities
        template = chat.resolve_template(cfg.chat_template, enc.text)
        producers, extra = E.job_producers(cfg, enc, template, device)
        tokens = E.job_tokens(cfg, producers)
        added: dict[str, int] = {}  # tokens the job needs and the tokenizer lacked
        if kinds is None:
            kinds = frozenset(chat.needed_kinds(r.conversation for r in requests or [] if r.conversation is not None))
        if kinds:
            added = chat.ensure_tokens(enc.text, kinds, tokens, cfg.add_missing_tokens)
            if added:
                log.info("added %s to the text tokenizer (vocab_size %d): resize the LM's embeddings", added,
                         enc.text.vocab_size)
        info = E.job_info(producers, extra, enc.text)
        encoders = enc.describe()
        preprocessing = preprocessing_of(cfg)
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
        return cls(cfg, options, enc, caps, template, tokens, added, producers, extra, rates, preparer, info,
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


def precision_check(job: Job, rows: Any, any_image: bool) -> dict | None:
    """Measure half-precision encoders against float32 on the job's first rows (None for float32 and
    for ``precision_samples`` 0): ``rows``, the manifest's requests in order (read as far as needed);
    half of the rows with an image where ``any_image`` (a row not rejected while reading has one), so both
    encoders are measured.

    Raises :class:`precompute.precision.PrecisionMismatch` outside ``precision_tolerance``.
    """
    cfg, opts = job.cfg, job.options.precision
    if opts.dtype in ("float32", "fp32"):
        return None
    if opts.samples == 0:  # e.g. the theworld preset: bfloat16 is the reference there
        log.info("encoder_dtype=%s not measured against float32 (precision_samples 0)", opts.dtype)
        return None
    ref = load_encoders(cfg, job.device, dtype="float32")
    n_img = opts.samples // 2 if any_image else 0
    picked: dict[bool, list] = {True: [], False: []}
    quota = {True: n_img, False: opts.samples - n_img}
    for req in rows:
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
        result = check_precision(job.enc, ref, prepared, opts.tolerance, opts.dtype)
    log.info("encoder_dtype=%s vs float32 on %d rows: latents rel. err %s, codes agreement %s",
             opts.dtype, result["samples"], result["latents_rel_err"], result["codes_agreement"])
    return result


def check_fingerprint(out_dir: Path, fp: str, describe: dict, global_rank: int, batch: dict | None = None) -> bool:
    """Refuse to add to a cache made with other encoders/preprocessing or another batch policy; record ours on
    first use (returns True when this call wrote ``parts/job.json``): :func:`precompute.identity.check_job_record`.

    Raises :class:`FingerprintMismatch` (:class:`precompute.identity.BatchPolicyMismatch`) naming what differs.
    """
    return check_job_record(out_dir, fp, describe, batch or {}, global_rank)


def check_root(plan: ManifestPlan, manifest: str | Path, root: str | Path | None) -> None:
    """Raise ``ValueError`` when every row was rejected for a path outside the media root: then the
    root is wrong, not the rows (an empty cache with exit 0 would hide it). Some such rows only
    log a warning (their rejects name each one)."""
    stats = plan.stats
    if not stats.outside:
        return
    where = f"--root {root}" if root else f"the manifest's folder {Path(manifest).resolve().parent}"
    if stats.outside == stats.rows:
        raise ValueError(f"{manifest}: every row names media outside {where} (e.g. {stats.first_outside}); "
                         "pass --root DIR (a folder holding every media file) or set allow_outside_root: true")
    log.warning("%d of %d rows name media outside %s: rejected as malformed_row (see rejects.parquet; "
                "allow_outside_root: true reads them)", stats.outside, stats.rows, where)


def check_posterior(image_encoder: Any) -> None:
    """Raise ``ValueError`` (before anything is written) when ``store_posterior`` cannot be honoured:
    the image encoder does not declare a posterior (:attr:`Capabilities.posterior`)."""
    from .encoders.capabilities import capabilities_of
    why = capabilities_of(image_encoder).posterior
    if why:
        raise ValueError(f"store_posterior: true, but the image encoder has no posterior to store: {why}. "
                         "Set store_posterior: false or use the wan image encoder.")


class Committed(dict):
    """The committed chunks of a cache: part stem (``shard-000003``) -> the job metadata of its index part
    (:func:`precompute.rerun.chunk_meta`), each read when it is looked up (a rerun reads them one at a time)."""

    def __init__(self, out_dir: Path):
        super().__init__({p.name.split(".")[0]: p for p in sorted((out_dir / PARTS_DIR).glob("*.index.parquet"))})

    def __getitem__(self, stem: str) -> dict:
        return read_part_meta(dict.__getitem__(self, stem)) or {}



#: the key of ``manifest.json`` that records which chunks the last merge covered (:func:`chunks_digest`)
CHUNKS_KEY = "merged_chunks"


def chunks_digest(stems) -> str:
    """sha256 of the sorted stems of the committed chunks a merge covers: a rerun that finds other chunks
    committed merges again (a run killed after committing, before merging)."""
    import hashlib
    return hashlib.sha256("\n".join(sorted(stems)).encode()).hexdigest()


def committed(out_dir: Path) -> Committed:
    """The committed chunks of ``out_dir`` (:class:`Committed`)."""
    return Committed(out_dir)


def start_worker(parent: int, pids: WorkerPids, worker_id: int) -> None:
    """A decode worker's ``worker_init_fn``: it dies with the job (:func:`precompute.lock.die_with_parent`) and
    records its pid (:class:`precompute.faults.WorkerPids`)."""
    die_with_parent(parent)
    pids.record(worker_id)


def decoding_label(plan: ManifestPlan) -> Callable[[int], str]:
    """How a decode worker that hung names its row (:meth:`precompute.faults.WorkerPids.receive`): manifest position
    -> ``row 'KEY' (its media files)``, read from ``plan`` (pass a :meth:`~precompute.plan.ManifestPlan.view`: a
    spill reader of its own)."""
    return lambda p: f"row {plan.key_of(p)!r} ({';'.join(s[0] for s in plan.sources_of(p))})"


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
        manifest: manifest file (see :class:`precompute.manifests.ManifestReader`).
        out_dir: cache directory (created). Existing committed chunks are kept and skipped. A URL
            (``s3://bucket/cache``...) writes through the local folder ``staging`` and uploads each
            committed chunk (:mod:`precompute.output`; ``storage_options`` for fsspec).
        cfg: the job's :class:`PrecomputeConfig`.
        barrier: callable synchronising all ranks (``torch.distributed.barrier``) when world_size > 1.

    Returns ``(summary, manifest_dict)``; ``manifest_dict`` is None on ranks other than 0.
    Raises :class:`FingerprintMismatch` when ``out_dir`` holds a cache from other encoders,
    :class:`shards.lock.CacheLocked` (rank 0, before anything is written) when another command
    is writing to it, :class:`shards.writing.NotACache` when ``out_dir`` holds files of another tool,
    :class:`precompute.plan.ManifestChanged` when the manifest is edited while the job runs.
    """
    t0 = time.perf_counter()
    output = open_output(out_dir, storage_options=storage_options, staging=staging, global_rank=global_rank)
    # one writer per cache, in a folder it owns (rank 0 takes the lock; the other ranks write under it)
    with CacheWriter(output.local, "precompute", rank=global_rank, create=True), \
            output.writer_lock("precompute", global_rank):  # (a remote cache: the lock at its location too)
        summary, result = _run(output, manifest, cfg, root=root, global_rank=global_rank, world_size=world_size,
                               local_rank=local_rank, barrier=barrier, progress=progress, t0=t0)
    return summary, result


def _merged(out_dir: Path) -> dict:
    """The cache's ``manifest.json`` as the last merge wrote it ({} when there is none or it does not read: the
    job then merges it again)."""
    from shards.errors import ShardcacheError
    try:
        return read_manifest(out_dir)
    except ShardcacheError:
        return {}


def _complete(out_dir: Path) -> bool:
    """Whether the cache's index, manifest and integrity root are there (a merge finished)."""
    return all((out_dir / name).exists() for name in (INDEX_FILE, MANIFEST_FILE, ROOT_FILE))


def _run(output, manifest: str | Path, cfg: PrecomputeConfig, *, root, global_rank: int, world_size: int,
         local_rank: int, barrier, progress: bool, t0: float) -> tuple[Summary, dict | None]:
    """:func:`run` once the cache's writer lock is held (by rank 0)."""
    output.pull()  # a remote cache: its committed parts, so a rerun resumes against the bucket
    out_dir = output.local
    sync = barrier or (lambda: None)
    opts = JobOptions.of(cfg, resolve_device(cfg.device, local_rank))  # what the job reads of cfg, typed
    manifest = Path(manifest).absolute()
    with ManifestPlan.build(opts.read.reader(manifest, root), source_digest=opts.rerun.source_digest,
                            filters=opts.rerun.filters) as plan:
        check_root(plan, manifest, root)
        check_batch_record(out_dir, dict(opts.batch))  # another batch policy is refused before anything else
        done = committed(out_dir)  # read by every rank before rank 0 deletes stale chunks
        rerun = plan_rerun(plan, done, keep_removed=opts.rerun.keep_removed,
                           retry=legacy_infrastructure_rejects(out_dir, done))
        if done and global_rank == 0:
            log.info("%s", rerun.describe())
        kept = [stem for stem in done if stem not in rerun.stale]
        chunks = plan_chunks(plan.n, opts.samples_per_shard, rerun.covered, kept)
        inputs, recorded = input_identity(cfg, plan.stats.kinds, opts.device), recorded_inputs(out_dir)
        sync()  # every rank has read the recorded inputs before rank 0 records new ones
        if not chunks and not rerun.carry and inputs is not None and inputs == recorded and _merged(out_dir):
            return _up_to_date(output, plan, rerun, done, opts, manifest, global_rank, world_size, sync, t0)
        job = Job.build(cfg, opts.device, kinds=plan.stats.kinds, options=opts)  # the encoders load here
        return _encode(output, plan, rerun, chunks, kept, job, inputs, manifest, global_rank, world_size, sync,
                       progress, t0)


def _up_to_date(output, plan: ManifestPlan, rerun: RerunPlan, done: Committed, opts: JobOptions, manifest: Path,
                global_rank: int, world_size: int, sync, t0: float) -> tuple[Summary, dict | None]:
    """A rerun with nothing to encode, on a cache whose recorded inputs are this job's: no encoder is loaded.
    Rank 0 drops the chunks of rows no longer in the manifest and merges the index again where one was
    dropped, a chunk was committed after the last merge, or the config recorded differs; else the cache is
    left as it is."""
    out_dir = output.local
    summary = Summary(skipped_rows=plan.n, rerun=rerun.counts())
    sync()  # every rank has read the same state before rank 0 deletes a chunk
    result = None
    if global_rank == 0:
        log.info("nothing to encode: the cache holds every row of the manifest, made with these encoders "
                 "(recorded in %s/%s; no encoder loaded)", PARTS_DIR, JOB_FILE)
        old = _merged(out_dir)
        if rerun.stale:
            output.drop_chunks(rerun.stale)  # rows no longer in the manifest: their chunks go
        why = ("chunks were dropped" if rerun.stale else "the index, manifest or integrity root is missing"
               if not _complete(out_dir) else "a chunk was committed after the last merge"
               if old.get(CHUNKS_KEY) != chunks_digest(done) else "the config recorded differs"
               if old.get("config") != opts.config else "the manifest recorded differs"
               if old.get("source_manifest") != str(manifest) else None)
        if why is not None:
            log.info("merging the index again: %s", why)
            keep = {k: v for k, v in old.items() if k not in ("format_version", "created", "counts", "shards")}
            stems = [stem for stem in done if stem not in rerun.stale]
            result = merge_parts(out_dir, keep | {"config": dict(opts.config), "source_manifest": str(manifest),
                                                  "world_size": world_size, CHUNKS_KEY: chunks_digest(stems)})
            output.publish()
        else:
            result = old
    summary.setup_s = time.perf_counter() - t0
    return summary, result


def _encode(output, plan: ManifestPlan, rerun: RerunPlan, chunks: list[Chunk], kept: list[str], job: Job,
            inputs: str | None, manifest: Path, global_rank: int, world_size: int, sync, progress: bool,
            t0: float) -> tuple[Summary, dict | None]:
    """The job with its encoders loaded: the checks that need them, the stale chunks dropped, this rank's chunks
    decoded, encoded and written (module docstring), rank 0's merge."""
    out_dir, opts = output.local, job.options
    enc, template, fp, describe = job.enc, job.template, job.fingerprint, job.describe
    if opts.store_posterior and enc.image is not None:
        check_posterior(enc.image)
    precision = precision_check(job, (req for _, req in plan.requests()), plan.any_image())
    if check_fingerprint(out_dir, fp, describe, global_rank, dict(opts.batch)):
        output.push_part(JOB_FILE)
    if global_rank == 0 and record_inputs(out_dir, inputs):  # the next rerun knows the cache without loading
        output.push_part(JOB_FILE)
    sync()
    carried = carry_removed(out_dir, rerun) if global_rank == 0 else []  # removed rows kept from stale chunks
    if rerun.stale and global_rank == 0:
        output.drop_chunks(rerun.stale)  # changed or deleted rows: their chunks are encoded again
    if carried:
        write_carried(output, carried_name([c.name for c in chunks], kept, plan.n, opts.samples_per_shard), carried)
    sync()  # every rank has read the same state before anyone commits a chunk
    rows = ChunkRows(plan, chunks[global_rank::world_size], job.batch_size)  # chunk k of the plan -> rank k % world
    summary = Summary(skipped_rows=plan.n - sum(len(c) for c in chunks), rerun=rerun.counts())
    bar = tqdm(total=rows.rows, desc="precompute" if world_size == 1 else f"precompute r{global_rank}/{world_size}",
               unit="row", disable=not progress or global_rank != 0, dynamic_ncols=True, smoothing=0.1)
    preload_decoders()  # imports (librosa's take seconds) are setup; and the workers fork with them loaded
    summary.setup_s = time.perf_counter() - t0
    t_loop = time.perf_counter()
    workers = summary.decode_workers = job_workers(opts.num_workers, opts.device, job,
                                                   rows.first(job.batch_size) if opts.num_workers == "auto" else [],
                                                   job.batch_size)
    # decoded rows come through reusable shared-memory slots (precompute.slots): per worker, its batches
    # in flight, those held in the length window and on the encoder thread
    slots, collate = slot_receiver(workers, PREFETCH + job.window // job.batch_size + DEPTH + 2) if workers \
        else (None, identity_collate)
    pids = WorkerPids(workers)  # each decode worker's pid and row: a failed loader names one that died or hung
    stall = opts.stall_timeout_s  # (precompute.faults: a process with work and no progress for that long hung)
    loader = DataLoader(RowsDataset(job.preparer, pids if workers else None), batch_sampler=rows, num_workers=workers,
                        collate_fn=collate, prefetch_factor=PREFETCH if workers else None,
                        timeout=stall if workers else 0,
                        worker_init_fn=functools.partial(start_worker, os.getpid(), pids) if workers else None)
    writer = ChunkWriter(output, ChunkRecords(plan, rows.order), summary, None, process=writer_process(opts.device),
                         stall_s=stall)
    read = [0]

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
        if done:
            bar.update(len(done))  # rows written, in manifest order: the bar's rate is the encoders'
            bar.set_postfix(read=read[0], rejected=summary.rejected, shards=summary.shards_written, refresh=False)

    thread = EncoderThread(opts.device, stall)  # the encoders run here, off the main thread
    stream = EncodeStream(lambda rows: job.start(rows, thread, summary), job.batch_size, job.window, depth=DEPTH)
    finished, loading = False, bool(workers)
    try:
        batches = pids.receive(iter(loader), stall, decoding_label(plan.view()))
        while True:
            t = time.perf_counter()
            batch = next(batches, None)
            raise_if_stopped()  # a SIGTERM whose Stopped a callback swallowed (precompute.faults): not this batch
            if batch is None:
                loading = False  # (the decode workers end here)
                break
            batch = unpack_rows(batch)
            summary.receive_s += time.perf_counter() - t
            read[0] += len(batch)
            put(stream.feed(batch))
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
        output.wait_for_chunks([c.name for c in chunks])
        man = job.info  # the producers' facts (codec sizes, latent channels, extra fields), typed
        man.fingerprint, man.encoders, man.sample_rate = fp, describe, job.sample_rate
        man.waveforms = {p.field: p.manifest_info() for p in job.producers if isinstance(p, WaveformProducer)}
        man.text = TextInfo.from_dict(chat.describe(template, enc.text, job.tokens, job.added))
        man.text_vocab_size, man.text_pad_id = enc.text.vocab_size, enc.text.pad_id
        man.config, man.source_manifest, man.world_size = dict(opts.config), str(manifest), world_size
        man.extra["media_root"] = str(plan.reader.root)
        man.extra[CHUNKS_KEY] = chunks_digest(stem for stem in Committed(out_dir))
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
