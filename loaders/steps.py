"""A ``torch.utils.data.DataLoader`` view of a :class:`loaders.ShardLoader` whose batches are
addressed by ``(epoch, step)``: what HF ``Trainer`` (through accelerate's ``skip_first_batches``)
rebuilds and skips on ``resume_from_checkpoint``.

accelerate's ``skip_first_batches(dataloader, k)`` builds a new ``DataLoader`` from the original's
``dataset``, ``batch_sampler`` (wrapped in its ``SkipBatchSampler``, which drops the first ``k``
index lists without reading them), ``collate_fn``, ``num_workers``, ``pin_memory``... Here the
dataset is :class:`StepBatches` (item ``(epoch, step)``: this rank's collated batch of that step,
read by the loader's own reader), the batch sampler is :class:`StepSampler` (``[(epoch, s)]`` for
every step ``s`` of its epoch) and ``collate_fn`` unwraps the one-item list. So a skip costs no
read, and the batches after it are those of the uninterrupted run: the epoch comes from
``set_epoch`` (``Trainer`` calls it on the loader, or after a skip on the sampler it wraps), the
batch from the ``(seed, epoch)`` plan. Use it from ``Trainer.get_train_dataloader`` (see
docs/integrations.md); the ShardLoader's own cursor and ``state_dict`` are not used by this view.
"""
from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader, Dataset, Sampler

from .dataset import SKIPPED


def _first(items: list[Any]) -> Any:
    """``collate_fn`` of :class:`StepDataLoader`: the one batch of the one-item index list."""
    return items[0]


class StepBatches(Dataset):
    """Map-style dataset of one rank's collated batches: ``ds[(epoch, step)]`` -> the batch dict of
    :mod:`loaders.collate` (with the loader's ``transform``). ``len``: samples of this rank per epoch
    (steps x ``batch_size``; budget mode: of the current epoch). Picklable into workers."""

    def __init__(self, loader: Any):
        self.sources, self.spec, self.rank = loader.sources, loader._spec, loader.global_rank
        self.batch_size, self.epoch = loader.batch_size, loader.epoch

    def __len__(self) -> int:
        return self.spec.plan(self.epoch).n_steps * self.batch_size

    def __getitem__(self, index: tuple[int, int]) -> dict[str, Any]:
        epoch, step = (int(i) for i in index)
        batch = self.sources.read_batch(self.spec.plan(epoch).rank_batch(step, self.rank))
        batch.pop(SKIPPED, None)
        return batch


class StepSampler(Sampler):
    """Batch sampler yielding ``[(epoch, step)]`` for every step of its epoch, in order; ``set_epoch``
    selects the epoch (default: the loader's current one)."""

    def __init__(self, loader: Any):
        self.spec, self.epoch = loader._spec, loader.epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration yields (``ValueError`` when negative)."""
        if int(epoch) < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.spec.plan(self.epoch).n_steps

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch = self.epoch
        for step in range(self.spec.plan(epoch).n_steps):
            yield [(epoch, step)]


class StepDataLoader(DataLoader):
    """The ``DataLoader`` of :meth:`loaders.ShardLoader.as_dataloader`: ``len`` = steps of the epoch,
    ``set_epoch`` forwarded to its :class:`StepSampler`, batches as the ShardLoader's."""

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration (``DistributedSampler`` style)."""
        self.batch_sampler.set_epoch(epoch)
        self.dataset.epoch = int(epoch)


def step_dataloader(loader: Any, num_workers: int = 0, **kwargs: Any) -> StepDataLoader:
    """:class:`StepDataLoader` over ``loader``'s cache, rank and plan; ``num_workers`` worker
    processes read whole batches (0: in this process); ``kwargs`` go to ``DataLoader``
    (``pin_memory``, ``prefetch_factor``, ``persistent_workers``...)."""
    return StepDataLoader(StepBatches(loader), batch_sampler=StepSampler(loader), collate_fn=_first,
                          num_workers=int(num_workers), **kwargs)
