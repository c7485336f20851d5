"""Stage two: train from a shardcache cache.

Modules: :mod:`train.config` (TrainConfig: nested sections), :mod:`train.trainer` (the Trainer:
setup, ``train_step``, ``evaluate``, checkpoint state; ``train()``, the run), :mod:`train.data`
(loaders, held-out split, batches on the device), :mod:`train.optim` (AdamW groups, the LambdaLR
schedule), :mod:`train.precision` (autocast, GradScaler), :mod:`train.metrics` (device-side step
statistics, JSONL/TensorBoard/tqdm on rank 0), :mod:`train.checkpoint` (atomic step-N dirs, LoRA
adapters, resume with fallback), :mod:`train.profiling` (``--profile`` report), :mod:`train.dist`
(process group, stop requests), :mod:`train.models` (reference model, ``module:factory`` plug-ins,
LoRA), :mod:`train.recipes` (the recipes of ``RECIPES``), :mod:`train.cli` (``shardcache train``), :mod:`train.batch_size`
(``shardcache find-batch-size``).

Never imports decoders (librosa, soundfile, PIL) or diffusers: a training machine must not need
them, and a stray import would mean something is being recomputed.
"""
from .config import TrainConfig

__all__ = ["TrainConfig"]
