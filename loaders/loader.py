"""``ShardLoader``: one rank's batches of a cache, deterministic, resumable mid-epoch, elastic.

Typical use::

    loader = ShardLoader(cache, batch_size=16, seed=0, workers=Workers(num_workers=4))  # rank: Ranks.detect()
    loader.load_state_dict(ckpt["loader"])          # optional; any rank's state (they are equal)
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)                      # optional: keeps the cursor if epoch == loader.epoch
        for batch in loader:                         # len(loader) batches, equal on every rank
            ...
            ckpt["loader"] = loader.state_dict()     # position after the batch just received

Epochs: ``iter(loader)`` yields the rest of the current epoch; once that epoch is complete, the next
``iter()`` starts the next epoch (so a trainer that only re-iterates, like Lightning, sees every
epoch) unless ``set_epoch`` chose that epoch since: ``set_epoch(e)`` selects epoch ``e`` (keeping
the cursor when ``e`` is the current epoch, so a finished epoch chosen again yields nothing). The
order is a pure function of ``(seed, epoch)``. Rank and world size: :meth:`shardcache.ranks.Ranks.detect`
(the process group, else explicit arguments, else the launcher's variables: torchrun, OpenMPI,
MPICH/PMI, SLURM's srun; a partial launcher environment is refused). Other trainers (HF ``Trainer``, accelerate, Lightning, torchtitan):
docs/integrations.md. A ShardLoader also declares a ``DataLoader`` form (``dataset``,
``batch_sampler``, ``collate_fn``...: :class:`loaders.steps.DataLoaderForm`), which accelerate's
``skip_first_batches`` (HF ``Trainer``'s mid-epoch resume) rebuilds a loader from; ``DataLoader(loader)``
is refused at its first item, naming the fix.

How batches reach the consumer. Every process computes the same epoch plan
(:mod:`loaders.order`, :mod:`loaders.batching`) from ``(seed, epoch)`` and the index; rank ``r``
reads its batch of each step. With ``num_workers = n > 0`` a ``torch.utils.data.DataLoader`` with
``batch_size=None`` runs :class:`loaders.dataset.PlanDataset` in ``n`` workers; after a resume at
step ``s0`` worker ``w`` collates steps ``s0 + w, s0 + w + n, ...`` and tags each batch with its
step; the main process hands them out in step order (re-ordering if needed) and advances the
cursor only when the consumer receives a batch, so ``state_dict()`` never counts prefetched
batches, and the sequence is the same for any ``num_workers``. Workers collate into reusable
shared-memory slots (``prefetch_factor + 2`` per worker) and send only a small message; the
batch's tensors are views of the slot, which is reused once they are all freed
(:mod:`loaders.shm`): no per-batch shared-memory block, page faults or file descriptors.

DataLoader settings (``Workers(num_workers > 0)``, :class:`loaders.Workers`): ``persistent_workers=True``
(the epoch and start step reach persistent workers through a shared-memory tensor read at each
``iter()``), ``prefetch_factor`` batches per worker, ``pin_memory`` when CUDA is available
(``Reads(pin_memory=...)``), multiprocessing context: the platform default (fork on Linux) unless
CUDA is already initialised in this process, then ``"forkserver"`` with the loaders preloaded in it
(:mod:`loaders.context`). ``num_workers=None`` picks ``min(8, cpus // LOCAL_WORLD_SIZE - 1)`` (>= 1).
"""
from __future__ import annotations

import gc
import logging
import os
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from shardcache.ranks import Ranks
from shardcache.workers import auto_workers
from shards import Cache, ShardCorrupt
from shards import fields as registry
from shards.mirror import DEFAULT_CACHE_LIMIT, Prefetcher, default_local_dir
from shards.storage import is_url

from .batching import PlanSpec
from .context import worker_context
from .dataset import SKIPPED, CacheSource, PlanDataset, Sources
from .host import KEEP
from .readahead import Failed, ReadAhead
from .order import ShardOrder
from .remote import file_uses
from .settings import Order, Reads, Workers
from .shm import SlotBatch, SlotReceiver, new_flags
from .steps import DataLoaderForm

STATE_KEYS = ("epoch", "cursor", "seed", "world_size", "global_batch_size")
log = logging.getLogger("loaders")


def _identity(x):
    return x


def _worker_init(_worker_id: int) -> None:
    """Each DataLoader worker moves the objects it inherited (the loader, the index arrays, torch's
    modules) to the garbage collector's permanent generation (``gc.freeze``): the collections a
    worker's reads trigger then scan only what it allocated since, and leave the inherited pages
    unwritten (copy-on-write keeps them shared with the parent; a few % more batches per second,
    docs/benchmarks.md)."""
    gc.freeze()


def default_num_workers() -> int:
    """``min(8, cpus_of_this_rank - 1)``, at least 1 (:func:`shardcache.workers.auto_workers`)."""
    return auto_workers(on_accelerator=True)


def open_source(cache: "Cache | str | os.PathLike", ranks: Ranks) -> Cache:
    """``cache`` itself when opened already, else :meth:`shards.Cache.open` of the folder or URL (a URL
    mirrored into this rank's folder, :func:`shards.mirror.default_local_dir`)."""
    if isinstance(cache, Cache):
        return cache
    local_dir = default_local_dir(str(cache), ranks.global_rank) if is_url(cache) else None
    return Cache.open(cache, local_dir=local_dir)


def _pin(x):
    if isinstance(x, torch.Tensor):
        return x.pin_memory()
    if isinstance(x, dict):
        return {k: _pin(v) for k, v in x.items()}
    return x


class ShardLoader(DataLoaderForm):
    """Batches of one rank over a shardcache cache. See the module docstring for the order.

    Args:
        cache: the cache: a :class:`shards.Cache` (opened once by the caller:
            ``Cache.open(url, storage_options, local_dir)`` for a cache in object storage), or its
            folder or URL (opened here with the store's usual credentials; a URL is streamed into a
            bounded local folder per rank, :mod:`shards.mirror`).
        batch_size: samples per batch and rank (``B``); with ``order.max_frames``: the most per batch.
        seed: int >= 0; with the epoch it fixes the whole order.
        fields: the fields to read and collate (see :mod:`loaders.collate`: ``input_ids``,
            ``labels``, ``codes``, ``audio``, ``audio_starts``, ``audio_segments``, ``latents``,
            ``latents_logvar``, extra waveforms...); default None: every field the cache holds but
            ``latents_logvar`` and ``image_features``, which are read only when named.
        filters: callable on the index's scalar columns or dict on them
            (:func:`shards.filters.filter_rows`), applied before the order is built.
        ranks: this rank and the number of ranks (:class:`shardcache.ranks.Ranks`); default
            ``Ranks.detect()``: the initialised process group, else the launcher's variables
            (torchrun, srun, mpirun, PMI), else 0 of 1 (a partial launcher environment such as
            ``LOCAL_RANK`` without ``RANK`` raises ``ValueError`` naming the variables). With tensor or
            pipeline parallelism: ``Ranks.detect(group=data_parallel_group)``.
        order: :class:`loaders.Order`: shuffle, shuffle window, remainder, budget batching.
        workers: :class:`loaders.Workers`: worker processes or read-ahead threads, prefetch, start method.
        reads: :class:`loaders.Reads`: compact dtypes, checks, damaged samples skipped, pinned memory, the
            local bytes of a remote cache.
        transform: a picklable callable applied to every collated batch where it is read (in the
            worker process with workers, a read-ahead thread with ``read_threads > 1``), e.g. a
            model's own batch layout built from the cached tensors (:attr:`train.recipes`
            ``batch_transform``); default None.

    ``DataLoader`` form (:class:`loaders.steps.DataLoaderForm`): ``dataset``, ``batch_sampler``,
    ``sampler`` (None), ``collate_fn``, ``drop_last``, ``prefetch_factor``, ``timeout``,
    ``multiprocessing_context``: what accelerate's ``skip_first_batches`` rebuilds a loader from, so HF
    ``Trainer`` given this loader resumes exactly; ``loader[i]`` raises ``TypeError`` (a loader of
    batches, not a dataset of samples: ``DataLoader(loader)`` is refused at its first item).

    Attribute ``prefetcher``: the :class:`shards.mirror.Prefetcher` of a remote cache (its
    ``stats``: downloads, bytes, evictions, peak_bytes), else None. ``cache_id``: the cache's
    identity (:func:`shards.cache_id`; a MixedLoader's: its caches' ids joined by ``+``), recorded
    in :meth:`state_dict`: :meth:`load_state_dict` refuses a state recorded on another cache.

    Raises ``ValueError`` for bad arguments or when an epoch would have no step (fewer samples
    after filters than one global batch with ``drop_remainder=True``), and whatever
    :meth:`shards.Cache.open` and :meth:`shards.Cache.reader` raise for a bad cache (``UnsafeMember``,
    ``ShardCorrupt``...).
    """

    def __init__(self, cache: "Cache | str | os.PathLike", batch_size: int, *, seed: int = 0,
                 fields: Sequence[str] | None = None, filters: Any = None, ranks: Ranks | None = None,
                 order: Order = Order(), workers: Workers = Workers(), reads: Reads = Reads(),
                 transform: Callable | None = None):
        ranks = Ranks.detect() if ranks is None else ranks
        opened = open_source(cache, ranks)
        try:
            source = CacheSource(opened, None if fields is None else registry.selection(fields), filters,
                                 verify_reads=reads.verify_reads)
        except BaseException:
            if opened is not cache:
                opened.close()
            raise
        self._own_caches = [opened] if opened is not cache else []
        plan_order = ShardOrder(source.shard_of, seed, shuffle=order.shuffle, window=order.shuffle_window)
        self._setup(Sources([source]), plan_order, batch_size, ranks=ranks, seed=seed, order=order,
                    workers=workers, reads=reads, transform=transform)

    # -- construction shared with MixedLoader ----------------------------------------------------
    def _setup(self, sources: Sources, order_fn: Callable[[int], np.ndarray], batch_size: int, *,
               ranks: Ranks, seed: int, order: Order, workers: Workers, reads: Reads,
               transform: Callable | None) -> None:
        for name, value, cls in (("order", order, Order), ("workers", workers, Workers), ("reads", reads, Reads)):
            if not isinstance(value, cls):
                raise TypeError(f"{name}= takes a loaders.{cls.__name__}, got {type(value).__name__}")
        if not isinstance(ranks, Ranks):
            raise TypeError(f"ranks= takes a shardcache.ranks.Ranks (Ranks.detect()), got {type(ranks).__name__}")
        self.order, self.workers, self.reads, self.ranks = order, workers, reads, ranks
        sources.compact = reads.compact
        sources.transform = transform
        sources.checks, sources.skip_corrupt = reads.checks, reads.skip_corrupt
        self.skip_corrupt = reads.skip_corrupt
        self.skipped: list[str] = []  # messages of the damaged samples left out (all workers)
        if isinstance(batch_size, bool) or int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        global_rank, world_size = ranks.global_rank, ranks.world_size
        if int(world_size) < 1 or not 0 <= int(global_rank) < int(world_size):
            raise ValueError(f"need 0 <= global_rank < world_size, got rank {global_rank} of {world_size}")
        if int(seed) < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.sources = sources
        self.cache_id = "+".join(s.cache_id for s in sources.sources)  # verified (shards.Cache.open)
        self.batch_size, self.world_size, self.global_rank = int(batch_size), int(world_size), int(global_rank)
        self.seed, self.max_frames = int(seed), order.max_frames
        self.num_workers = default_num_workers() if workers.num_workers is None else int(workers.num_workers)
        self.read_threads = workers.read_threads
        prefetch_factor = self._prefetch_factor = workers.prefetch_factor
        self.drop_remainder = order.drop_remainder
        self.bucket_window = int(order.bucket_window or 64 * self.batch_size)
        self._order_fn = order_fn
        self._spec = PlanSpec(order_fn, self.world_size, self.batch_size, self.seed, self.drop_remainder,
                              self.max_frames, sources.frames() if self.max_frames else None,
                              self.bucket_window)
        self._position = torch.zeros(3, dtype=torch.int64).share_memory_()  # epoch, start step, generation
        self._receiver = None
        if self.num_workers > 0:  # reusable shared-memory slots per worker (loaders.shm)
            self._receiver = SlotReceiver(new_flags(self.num_workers, prefetch_factor + 2))
        self._plan_dataset = PlanDataset(sources, self._spec, self.global_rank, self._position,
                                         None if self._receiver is None else (self._receiver.flags, self._receiver.id))
        self.pin_memory = torch.cuda.is_available() if reads.pin_memory is None else reads.pin_memory
        sources.pin = self.pin_memory and self.num_workers == 0  # read straight into pinned memory
        # every batch the reads can hold at once: each read-ahead thread's untaken ones and the one it
        # fills, and the consumer's (loaders.host: fewer free blocks kept made a fresh, page-faulted
        # block every few batches: float32 batches 0.45 -> 0.63 x cat, compact 0.75 -> 0.84 with 10)
        sources.host_blocks = max(KEEP, self.read_threads * (prefetch_factor + 1) + 2)
        self._dl_kwargs = dict(
            prefetch_factor=prefetch_factor, persistent_workers=workers.persistent_workers,
            multiprocessing_context=worker_context(workers.multiprocessing_context),
            timeout=float(workers.timeout), worker_init_fn=_worker_init)
        self._dl: DataLoader | None = None
        self._step_sampler = None  # the DataLoader form's batch sampler (loaders.steps.DataLoaderForm)
        self.epoch, self._cursor, self._generation = 0, 0, 0
        self._chosen = False  # set_epoch called since the last iter(): a complete epoch stays chosen
        remotes = {i: s.remote for i, s in enumerate(sources.sources) if s.remote is not None}
        self.prefetcher: Prefetcher | None = None
        if remotes:
            self.prefetcher = Prefetcher(
                lambda epoch: file_uses(self._spec.plan(epoch), self.global_rank, sources),
                remotes, DEFAULT_CACHE_LIMIT if reads.cache_limit is None else int(reads.cache_limit),
                lookahead=max(self.num_workers, self.read_threads) * prefetch_factor + 1)
        if len(self) == 0:
            raise ValueError(
                f"an epoch has no step: {sources.n} samples after filters, global batch "
                f"{self.global_batch_size} (world_size {self.world_size} x batch_size {self.batch_size}); "
                "use a smaller batch_size, fewer ranks or drop_remainder=False")

    # -- the contract ----------------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        """``world_size * batch_size`` (in budget mode: the most samples a step can hold)."""
        return self.world_size * self.batch_size

    def __len__(self) -> int:
        """Steps (= batches of this rank) in the current epoch; equal on every rank.

        Fixed mode: ``N' / G``, the same every epoch. Budget mode: depends on the epoch.
        """
        return self._spec.plan(self.epoch).n_steps

    @property
    def step(self) -> int:
        """Steps of the current epoch the consumer has received (where the next ``iter`` starts)."""
        return self._spec.plan(self.epoch).step_at(self._cursor)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` yields. A new epoch starts at cursor 0; setting the
        current epoch again keeps the cursor (so it may follow :meth:`load_state_dict`), and a
        complete epoch chosen so yields nothing. Not needed to go on to the next epoch: ``iter()``
        after a complete epoch does that when ``set_epoch`` was not called since."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._chosen = True
        if epoch != self.epoch:
            self.epoch, self._cursor = epoch, 0
            self._generation += 1  # an iterator of the previous epoch stops

    def _complete(self) -> bool:
        """Whether the consumer has received every step of the current epoch."""
        plan = self._spec.plan(self.epoch)
        return plan.step_at(self._cursor) >= plan.n_steps

    def state_dict(self) -> dict[str, Any]:
        """Position after the last batch the consumer received; the same on every rank.

        ``{"epoch", "cursor" (global samples consumed this epoch), "seed", "world_size",
        "global_batch_size", "cache_id"}`` plus what the order depends on (``num_samples``,
        ``shuffle``, ``shuffle_window``, ``max_frames``, ``batch_size``, ``drop_remainder``...), all
        plain ints/bools/strings.
        """
        sd = {"epoch": self.epoch, "cursor": int(self._cursor), "seed": self.seed,
              "world_size": self.world_size, "global_batch_size": self.global_batch_size,
              "cache_id": self.cache_id}
        sd.update(self._signature())
        return sd

    def _signature(self) -> dict[str, Any]:
        sig = dict(self._order_fn.signature())
        sig.update(drop_remainder=self.drop_remainder, max_frames=self.max_frames, batch_size=self.batch_size)
        if self.max_frames is not None:
            sig["bucket_window"] = self.bucket_window
        return sig

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Continue right after the last batch recorded in ``sd``; seeks, replays nothing.

        Allowed with other ``num_workers`` and another ``world_size`` as long as the global batch
        ``world_size * batch_size`` is the same (budget mode: same ``max_frames``/``batch_size``
        and a cursor on a step boundary of the new world size). Raises ``ValueError`` explaining
        what differs otherwise (seed, global batch, cache size after filters, shuffle settings...),
        and when ``sd`` was recorded on another cache (its ``cache_id`` differs; both ids named). A
        state without ``cache_id`` (one the caller removed on purpose to resume
        on other data) is not checked for it.

        A state recorded after the last batch of epoch ``e``: the next ``iter()`` yields epoch
        ``e + 1`` (``set_epoch(e)`` first: nothing, then ``set_epoch(e + 1)``, as before).
        """
        missing = [k for k in STATE_KEYS if k not in sd]
        if missing:
            raise ValueError(f"not a ShardLoader state: missing {missing}")
        if sd.get("cache_id") is not None and sd["cache_id"] != self.cache_id:
            raise ValueError(f"the state was recorded on the cache with id {sd['cache_id']}, this loader reads the "
                             f"cache with id {self.cache_id}: its position would land on other data. Resume on the "
                             "same cache, or drop 'cache_id' from the state to continue by position anyway")
        if int(sd["seed"]) != self.seed:
            raise ValueError(f"checkpoint was made with seed={sd['seed']}, this loader has seed={self.seed}: "
                             "the order would differ; construct the loader with the checkpoint's seed")
        if self.max_frames is None and int(sd["global_batch_size"]) != self.global_batch_size:
            G = int(sd["global_batch_size"])
            hint = (f"batch_size={G // self.world_size} with world_size={self.world_size}"
                    if G % self.world_size == 0 else f"a world size that divides {G}")
            raise ValueError(
                f"checkpoint global batch {G} (= world_size {sd['world_size']} x batch_size "
                f"{G // max(int(sd['world_size']), 1)}) differs from this loader's "
                f"{self.global_batch_size} (= {self.world_size} x {self.batch_size}); an exact resume "
                f"needs the same global batch (the steps would cut the order elsewhere): use {hint}")
        mine = self._signature()
        for k, v in mine.items():
            if k in sd and sd[k] != v and not (k == "batch_size" and self.max_frames is None):
                raise ValueError(f"checkpoint has {k}={sd[k]!r}, this loader {k}={v!r}: the order or the "
                                 "batches would differ (cache, filters or loader settings changed)")
        epoch, cursor = int(sd["epoch"]), int(sd["cursor"])
        self._spec.plan(epoch).step_at(cursor)  # ValueError unless on a step boundary
        self.epoch, self._cursor, self._chosen = epoch, cursor, False
        self._generation += 1

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield the rest of the current epoch for this rank (all of it after ``set_epoch``); when the
        current epoch is complete, all of the next one (``loader.epoch`` then tells which)."""
        if self._complete() and not self._chosen:
            self.epoch, self._cursor = self.epoch + 1, 0
        self._chosen = False
        plan = self._spec.plan(self.epoch)
        start = plan.step_at(self._cursor)
        self._generation += 1
        if start >= plan.n_steps:
            log.debug("epoch %d chosen by set_epoch is already complete: nothing to yield", self.epoch)
            return iter(())
        self._position[0], self._position[1], self._position[2] = self.epoch, start, self._generation
        if self.prefetcher is not None:
            self.prefetcher.start_epoch(self.epoch, start)
        if self.num_workers == 0 and self.read_threads > 1 and self.prefetcher is None:  # local caches:
            rank, sources = self.global_rank, self.sources
            src = ReadAhead(lambda s: sources.read_batch(plan.rank_batch(s, rank)), range(start, plan.n_steps),
                            self.read_threads, self._prefetch_factor)
        elif self.num_workers == 0:
            src = iter(self._plan_dataset)
        else:
            self._receiver.reclaim(self._generation)  # slots of batches an earlier iter() dropped unread
            src = iter(self._dataloader())
        return self._consume(plan, start, src, self._generation)

    def _consume(self, plan, start: int, src, gen: int) -> Iterator[dict[str, Any]]:
        ahead = src if isinstance(src, ReadAhead) else None
        try:
            yield from self._in_order(plan, start, src, gen, ahead)
        finally:
            if ahead is not None:
                ahead.close()

    def _in_order(self, plan, start: int, src, gen: int, ahead: ReadAhead | None) -> Iterator[dict[str, Any]]:
        expected, pending = start, {}
        pin = self.pin_memory and self.num_workers == 0
        for step, batch in src:
            if gen != self._generation:
                return
            pending[step] = batch.unpack() if isinstance(batch, SlotBatch) else batch
            while expected in pending:
                out = pending.pop(expected)
                if isinstance(out, Failed):
                    raise out.error
                if ahead is not None:
                    ahead.taken(expected)
                self._count_skipped(out.pop(SKIPPED, None))
                self._cursor = int(plan.cursors[expected + 1])
                expected += 1
                if self.prefetcher is not None:
                    self.prefetcher.check()
                    self.prefetcher.advance(expected)
                yield _pin(out) if pin else out
                if gen != self._generation:
                    return
        if expected != plan.n_steps:
            raise RuntimeError(f"rank {self.global_rank}: received steps up to {expected} of {plan.n_steps} "
                               f"in epoch {self.epoch} (missing {sorted(pending)[:5]}...); a worker lost batches")

    def _count_skipped(self, skipped: list[str] | None) -> None:
        """Log the samples a worker left out of a batch; over ``skip_corrupt`` in all: ShardCorrupt."""
        for why in skipped or ():
            self.skipped.append(why)
            log.warning("skipped a damaged sample (%d of skip_corrupt=%d): %s", len(self.skipped),
                        self.skip_corrupt, why)
            if len(self.skipped) > self.skip_corrupt:
                raise ShardCorrupt(f"{why} ({len(self.skipped)} damaged samples, more than skip_corrupt="
                                   f"{self.skip_corrupt})")

    def as_dataloader(self, num_workers: int = 0, **kwargs: Any) -> "StepDataLoader":
        """A ``torch.utils.data.DataLoader`` of this loader's batches addressed by ``(epoch, step)``
        (:mod:`loaders.steps`), for code that needs a real ``DataLoader``: HF ``Trainer`` and
        accelerate's ``skip_first_batches`` skip steps without reading them, so a resumed run gets the
        uninterrupted run's batches; ``accelerator.prepare`` returns it unchanged (it carries
        accelerate's prepared mark: each rank keeps exactly its plan); Lightning's sampler injection
        under DDP is refused, naming the fix (return the ShardLoader itself). ``set_epoch`` on it
        selects the epoch (without it, iterating again after a complete epoch yields the next one);
        ``num_workers`` processes read whole batches; ``kwargs`` go to ``DataLoader``. This loader's
        own cursor and ``state_dict`` are not used by the view."""
        from .steps import step_dataloader
        return step_dataloader(self, num_workers, **kwargs)

    def _dataloader(self) -> DataLoader:
        if self._dl is None:
            kw = dict(self._dl_kwargs)
            self._dl = DataLoader(self._plan_dataset, batch_size=None, shuffle=False,
                                  num_workers=self.num_workers, collate_fn=_identity,
                                  pin_memory=self.pin_memory, **kw)
        return self._dl

    def close(self) -> None:
        """Stop the worker processes (persistent workers otherwise live until the loader is freed)."""
        it = getattr(self._dl, "_iterator", None) if self._dl is not None else None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self._dl = None
        if self.prefetcher is not None:
            self.prefetcher.stop()
        self.sources.close()
        for c in self._own_caches:  # caches this loader opened itself
            c.close()
        self._own_caches = []

    def __repr__(self) -> str:
        mode = f"max_frames={self.max_frames}" if self.max_frames else f"batch_size={self.batch_size}"
        return (f"{type(self).__name__}({self.sources.n} samples, {mode}, rank {self.global_rank}/"
                f"{self.world_size}, seed={self.seed}, epoch={self.epoch}, cursor={self._cursor}, "
                f"num_workers={self.num_workers})")
