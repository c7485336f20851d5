"""Stage two: train from a shardcache cache.

Modules: :mod:`train.config` (TrainConfig), :mod:`train.dist` (process group, stop requests),
:mod:`train.models` (reference model, ``module:factory`` plug-ins, LoRA), :mod:`train.checkpoint`
(atomic step-N dirs, resume), :mod:`train.metrics` (JSONL/TensorBoard/tqdm on rank 0),
:mod:`train.loop` (the step), :mod:`train.cli` (``python -m train``), :mod:`train.batch_size`
(``python -m train.find_batch_size``).

Never imports decoders (librosa, soundfile, PIL) or diffusers: a training machine must not need
them, and a stray import would mean something is being recomputed.
"""
from .config import TrainConfig

__all__ = ["TrainConfig"]
