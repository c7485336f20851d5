"""Stage two: deterministic, resumable batches of cached tensors from shardcache shards.

Public API::

    from loaders import ShardLoader, MixedLoader, Order, Workers, Reads, Mix, collate_fn

* :class:`ShardLoader` (:mod:`loaders.loader`): one rank's batches; ``len``, ``set_epoch``,
  ``state_dict`` / ``load_state_dict`` (exact, elastic resume); its settings in three sections
  (:mod:`loaders.settings`: :class:`Order`, :class:`Workers`, :class:`Reads`).
* :class:`MixedLoader` (:mod:`loaders.mixing`): several caches mixed by weight.
* :func:`collate_fn` (:mod:`loaders.collate`): pad :meth:`shards.ShardReader.get` dicts into a batch.
* :mod:`loaders.order` (global order; the filters are :mod:`shards.filters`'), :mod:`loaders.batching`
  (steps, rank split, budget batches), :mod:`loaders.dataset` (the checked reader, the worker dataset), :mod:`loaders.read`
  (a batch read straight into its tensors, checksums checked).
* :mod:`loaders.higgs` (imported on use): Higgs-Audio v2's own batch layout as a loader ``transform``
  (``HiggsBatch``) and ``HiggsChatMLDataset`` for Boson's trainer.

Never imports librosa, soundfile, PIL or diffusers: training machines do not need them.
"""
from .batching import BudgetPlan, FixedPlan, PlanSpec, padding_stats
from .collate import ALL_FIELDS, AUDIO_SCALE, CODES_PAD_ID, FIELDS, TEXT_PAD_ID, collate_fn
from .dataset import CacheSource
from .loader import ShardLoader
from .mixing import MixedLoader
from .order import epoch_order
from .settings import Mix, Order, Reads, Workers

__all__ = [
    "ShardLoader", "MixedLoader", "Order", "Workers", "Reads", "Mix", "collate_fn", "CODES_PAD_ID", "TEXT_PAD_ID",
    "AUDIO_SCALE", "FIELDS", "ALL_FIELDS", "CacheSource", "BudgetPlan", "FixedPlan", "PlanSpec", "padding_stats",
    "epoch_order",
]
