"""A :class:`loaders.ShardLoader`'s ``torch.utils.data.DataLoader`` form: one rank's batches
addressed by ``(epoch, step)``, for trainers that rebuild, skip or wrap a ``DataLoader``.

Why a DataLoader form at all. HF ``Trainer`` resumes mid-epoch with accelerate's
``skip_first_batches(dataloader, k)``, which builds a *new* ``DataLoader`` from the original's
``dataset``, ``sampler``/``batch_sampler`` (wrapped in ``SkipBatchSampler``, which drops the first
``k`` index lists without reading them), ``collate_fn``, ``num_workers``, ``pin_memory``... (accelerate's
``_PYTORCH_DATALOADER_KWARGS``), then calls ``set_epoch`` on the batch sampler it wrapped. Here the
dataset is :class:`StepBatches` (item ``(epoch, step)``: this rank's collated batch of that step,
read by the loader's own reader), the batch sampler is :class:`StepSampler` (``[(epoch, s)]`` for
every step ``s`` of its epoch) and ``collate_fn`` unwraps the one-item list. So a skip costs no read,
and the batches after it are those of the uninterrupted run. A ``ShardLoader`` declares these same
attributes (:class:`DataLoaderForm`), so returning the loader itself from
``Trainer.get_train_dataloader`` resumes exactly too; :meth:`loaders.ShardLoader.as_dataloader` is the
same form as a real :class:`StepDataLoader`.

What other trainers do with it, and the answer of each (docs/integrations.md, tested under torchrun
in tests/test_integrations.py):

* ``accelerator.prepare(dl)`` re-shards every ``DataLoader`` it is given (``BatchSamplerShard``: rank
  ``r`` of ``n`` keeps index lists ``r, r + n, ...``), which on a plan that is already one rank's would
  train each rank on every other batch. Accelerate skips that for a loader marked
  ``_is_accelerate_prepared`` (its guard against wrapping twice, ``Accelerator.prepare_data_loader``):
  a :class:`StepDataLoader` carries the mark, so ``prepare`` hands it back unchanged and each rank gets
  exactly its plan. (A ``ShardLoader`` is no ``DataLoader``: ``prepare`` returns it as it is.)
* Lightning (``use_distributed_sampler``, the default under DDP) rebuilds a ``DataLoader``'s batch
  sampler with its ``DistributedSampler``, ``type(batch_sampler)(sampler, batch_size=...,
  drop_last=...)`` (``_dataloader_init_kwargs_resolve_sampler``): :class:`StepSampler` takes only a
  ShardLoader and refuses that call with :data:`RESHARD` (return the ShardLoader itself instead: Lightning
  checkpoints its position and never re-shards it).
* ``DataLoader(loader)`` treats the ShardLoader as a map-style dataset: its first item refuses
  (:meth:`loaders.ShardLoader.__getitem__`), naming the fix.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

from torch.utils.data import DataLoader, Dataset, Sampler

from .dataset import SKIPPED

log = logging.getLogger("loaders")

#: what a trainer that would re-shard a ShardLoader's batches is told instead
RESHARD = (
    "a ShardLoader's batches are already this rank's share of each step (the loader splits the epoch by "
    "global rank itself), so a trainer must not shard them again. Lightning: return the ShardLoader itself "
    "from train_dataloader (Lightning leaves it as it is and checkpoints its position), not "
    "loader.as_dataloader() or DataLoader(loader). accelerate: pass the ShardLoader itself (prepare leaves "
    "it as it is; register it with accelerator.register_for_checkpointing(loader) to resume exactly) or "
    "loader.as_dataloader() to accelerator.prepare, never a DataLoader built around the loader. HF "
    "Trainer: return the ShardLoader (or loader.as_dataloader()) from get_train_dataloader. "
    "See docs/integrations.md")


def _first(items: list[Any]) -> Any:
    """``collate_fn`` of the DataLoader form: the one batch of the one-item index list."""
    return items[0]


class StepBatches(Dataset):
    """Map-style dataset of one rank's collated batches: ``ds[(epoch, step)]`` -> the batch dict of
    :mod:`loaders.collate` (with the loader's ``transform``). ``len``: samples of this rank per epoch
    (steps x ``batch_size``; budget mode: of the current epoch). Picklable into workers. Samples left
    out under ``skip_corrupt`` are logged here (the ShardLoader's own count is not kept by this form)."""

    def __init__(self, loader: Any):
        self.sources, self.spec, self.rank = loader.sources, loader._spec, loader.global_rank
        self.batch_size, self.epoch = loader.batch_size, loader.epoch

    def __len__(self) -> int:
        return self.spec.plan(self.epoch).n_steps * self.batch_size

    def __getitem__(self, index: tuple[int, int]) -> dict[str, Any]:
        epoch, step = (int(i) for i in index)
        batch = self.sources.read_batch(self.spec.plan(epoch).rank_batch(step, self.rank))
        for why in batch.pop(SKIPPED, None) or ():
            log.warning("skipped a damaged sample: %s", why)
        return batch


class StepSampler(Sampler):
    """Batch sampler yielding ``[(epoch, step)]`` for the steps ``start, start + 1, ...`` of its epoch.

    ``set_epoch(e)`` selects epoch ``e`` from its first step (default: the loader's current epoch);
    :class:`StepDataLoader` sets ``start`` when it resumes. ``batch_size`` (1: each index list holds
    one ``(epoch, step)``) and ``drop_last`` (False) are ``BatchSampler``'s attributes.

    Built from a ShardLoader only. Anything else is refused with a ``TypeError`` naming the fix: that is
    Lightning re-instantiating the batch sampler with its ``DistributedSampler`` to re-shard the
    batches (see the module docstring), which would give each rank half of its own plan.
    """

    batch_size = 1
    drop_last = False

    def __init__(self, loader: Any, *args: Any, **kwargs: Any):
        from .loader import ShardLoader
        if args or kwargs or not isinstance(loader, ShardLoader):
            given = ", ".join([type(loader).__name__] + [type(a).__name__ for a in args] + list(kwargs))
            raise TypeError(f"StepSampler (ShardLoader.as_dataloader()) was built again from ({given}): a "
                            f"trainer is re-sharding it with its own sampler. {RESHARD}")
        self.spec, self.epoch, self.start = loader._spec, loader.epoch, 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration yields, from its first step (``ValueError`` when negative)."""
        if int(epoch) < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch, self.start = int(epoch), 0

    def __len__(self) -> int:
        return self.spec.plan(self.epoch).n_steps

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, start = self.epoch, self.start
        self.start = 0  # a resume position serves one iteration
        for step in range(start, self.spec.plan(epoch).n_steps):
            yield [(epoch, step)]


class DataLoaderForm:
    """The ``DataLoader`` attributes a :class:`loaders.ShardLoader` declares, for code that rebuilds a
    loader from them: accelerate's ``skip_first_batches`` (HF ``Trainer``'s mid-epoch resume) reads
    ``dataset``, ``sampler``, ``batch_sampler`` and accelerate's ``_PYTORCH_DATALOADER_KWARGS``
    (``collate_fn``, ``num_workers``, ``pin_memory``, ``timeout``, ``worker_init_fn``,
    ``multiprocessing_context``, ``prefetch_factor``, ``persistent_workers``...; absent ones: their
    ``DataLoader`` defaults). The form is :class:`StepBatches` + :class:`StepSampler`: the rebuilt
    ``DataLoader`` reads this rank's batches of the ``(seed, epoch)`` plan, the skip reads nothing, and
    ``set_epoch`` reaches the sampler. The loader's own iteration does not use these attributes.
    ``batch_size`` keeps its ShardLoader meaning (samples per batch of this rank); with a
    ``batch_sampler`` no rebuild reads it."""

    #: no sampler of indices: the batch sampler holds the plan
    sampler = None
    #: nothing is dropped by the form (the plan decided ``drop_remainder`` already)
    drop_last = False
    #: a rebuilt DataLoader lives for the rest of one epoch
    persistent_workers = False
    collate_fn = staticmethod(_first)

    @property
    def dataset(self) -> StepBatches:
        """:class:`StepBatches` of this loader (``len``: samples of this rank per epoch)."""
        return StepBatches(self)

    @property
    def batch_sampler(self) -> StepSampler:
        """This loader's :class:`StepSampler` (one per loader: ``set_epoch`` on it holds)."""
        if getattr(self, "_step_sampler", None) is None:
            self._step_sampler = StepSampler(self)
        return self._step_sampler

    @property
    def prefetch_factor(self) -> int | None:
        """Batches each worker of a rebuilt loader keeps ready (None without workers, as DataLoader
        requires)."""
        return self._prefetch_factor if self.num_workers > 0 else None

    @property
    def multiprocessing_context(self) -> Any:
        """The worker start method the loader's own workers use (:mod:`loaders.context`)."""
        return self._dl_kwargs["multiprocessing_context"] if self.num_workers > 0 else None

    @property
    def timeout(self) -> float:
        """Seconds to wait for a worker's batch (0: forever)."""
        return self._dl_kwargs["timeout"]

    def __getitem__(self, index: Any):
        """Refused: a ShardLoader is a loader of batches, not a dataset of samples. Reached by
        ``DataLoader(loader)`` (which takes it for a map-style dataset) at its first item, before a
        step trains; the message names the fix (:data:`RESHARD`)."""
        raise TypeError(f"{type(self).__name__} is not a dataset of samples: DataLoader({type(self).__name__}) "
                        f"(or a trainer that wraps it in one) asked for item {index!r}. Iterate the loader "
                        f"itself, or use loader.as_dataloader() where a torch DataLoader is needed; {RESHARD}")


class StepDataLoader(DataLoader):
    """The ``DataLoader`` of :meth:`loaders.ShardLoader.as_dataloader`: ``len`` = steps of the epoch,
    batches as the ShardLoader's, epochs and resume as the ShardLoader's.

    * ``set_epoch(e)`` selects epoch ``e`` from its first step (``DistributedSampler`` style). Without
      it, iterating again after a complete epoch yields the next epoch (a loop that only re-iterates,
      as Lightning's over a DataLoader whose sampler has no ``set_epoch``, sees every epoch), and after
      an incomplete one the rest of it.
    * ``state_dict()`` / ``load_state_dict()``: the position after the last batch this loader handed
      out (``epoch``, ``step``) and what the order depends on (the ShardLoader's seed, global batch,
      cache id...; another one is refused with ``ValueError``). Lightning and accelerate's
      ``register_for_checkpointing`` save and restore it; the next iteration continues there.
    * ``_is_accelerate_prepared = True``: accelerate's ``Accelerator.prepare`` returns it unchanged
      (its guard against wrapping a loader twice) instead of re-sharding a plan that is already this
      rank's; batches stay where the loader puts them (the host: move them with
      :func:`loaders.device.to_device`).
    """

    _is_accelerate_prepared = True

    def __init__(self, *args: Any, signature: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._signature = dict(signature or {})
        self._epoch, self._step, self._chosen = self.batch_sampler.epoch, 0, False

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration, from its first step."""
        self.batch_sampler.set_epoch(epoch)
        self.dataset.epoch = self._epoch = int(epoch)
        self._step, self._chosen = 0, True

    def __iter__(self):
        sampler = self.batch_sampler
        if not self._chosen and self._step >= sampler.spec.plan(self._epoch).n_steps:
            self._epoch, self._step = self._epoch + 1, 0  # the epoch is complete: the next one
        self._chosen = False
        sampler.epoch, sampler.start = self._epoch, self._step
        self.dataset.epoch = self._epoch
        return self._count(super().__iter__(), self._epoch)

    def _count(self, batches, epoch: int):
        for batch in batches:
            if epoch == self._epoch:
                self._step += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "step"}`` after the last batch handed out, plus the loader's signature (plain
        ints, bools and strings; the same on every rank)."""
        return {**self._signature, "epoch": int(self._epoch), "step": int(self._step)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue right after the batch recorded in ``sd``; ``ValueError`` when ``sd`` was recorded
        with another seed, global batch, cache or order settings (named)."""
        differ = {k: (sd.get(k), v) for k, v in self._signature.items() if k in sd and sd[k] != v}
        if differ:
            raise ValueError("the state was recorded by another loader: " + ", ".join(
                f"{k}={a!r} there, {b!r} here" for k, (a, b) in differ.items()))
        self._epoch, self._step, self._chosen = int(sd["epoch"]), int(sd["step"]), False


def step_dataloader(loader: Any, num_workers: int = 0, **kwargs: Any) -> StepDataLoader:
    """:class:`StepDataLoader` over ``loader``'s cache, rank and plan; ``num_workers`` worker
    processes read whole batches (0: in this process); ``kwargs`` go to ``DataLoader``
    (``pin_memory``, ``prefetch_factor``, ``persistent_workers``...)."""
    signature = {k: v for k, v in loader.state_dict().items() if k not in ("epoch", "cursor")}
    return StepDataLoader(StepBatches(loader), batch_sampler=StepSampler(loader), collate_fn=_first,
                          num_workers=int(num_workers), signature=signature, **kwargs)
