"""Stage-two configuration: :class:`TrainConfig`, nested sections with a docstring per option, read by
:mod:`shardcache.config` from the command line of :mod:`train.cli` (the order: its description) and checked by
:func:`check_config`. The effective config is logged at start and kept in every checkpoint."""
# no `from __future__ import annotations`: the annotations are the types jsonargparse checks (bounded(...))
from dataclasses import dataclass
from typing import Any, Literal

from shardcache.config import bounded, option

from .recipes import RECIPES  # a dict of names: imports no model library

#: environment variable naming the config file when no --config is given
CONFIG_ENV = "SHARDCACHE_TRAIN_CONFIG"
#: the most steps any step-count option accepts (a trillion)
MAX_STEPS = 10**12


@dataclass
class DataConfig:
    """What is read: the cache, the fields, batches per rank, loader workers."""

    cache: str = ""
    """Training cache directory (made by `shardcache precompute`). Required."""
    val_cache: str = ""
    """Validation cache directory; empty = validate on the keys of --data.cache held out by --data.val_fraction."""
    val_fraction: bounded(float, ge=0.0, le=0.5) = 0.02
    """Without --data.val_cache: the fraction of keys held out for validation (by sha256(key)); 0 = none."""
    fields: tuple[str, ...] = ("auto",)
    """Fields the loader collates: auto (the recipe's declared fields, else all) | all | a list: input_ids,labels."""
    batch_size: bounded(int, gt=0, le=1_000_000) = 8
    """Samples per rank per micro-step. Global batch = batch_size x world size x training.grad_accum."""
    num_workers: bounded(int, ge=0, le=1024) | Literal["auto"] = "auto"
    """DataLoader workers per rank. auto: on CUDA this rank's share of the cores - 1 (1 to 8); on CPU 0."""
    loader: str = "loaders:ShardLoader"
    """module:class of the loader (the ShardLoader API)."""
    loader_kwargs: dict[str, Any] = option(factory=dict)
    """Loader settings {order: {..}, workers: {..}, reads: {..}} (loaders.Order...), filters, storage_options, local_dir."""
    compact_batches: bool = True
    """Load int16 audio and float16 latents as stored and widen them to float32 on the device (half the bytes)."""
    prefetch_to_device: Literal["auto", "on", "off"] = "auto"
    """Copy batch k+1 to the device while step k runs: auto = on CUDA; on = also on CPU (no overlap); off."""
    seed: bounded(int, ge=0, le=2**63 - 1) = 0
    """Seed of the data order and of the model init; rank r seeds its own RNGs with seed + r."""
    skip_corrupt: bounded(int, ge=0, le=1_000_000) = 0
    """Damaged samples (checksum mismatch, truncated shard) a rank may skip before ShardCorrupt; 0 = none."""


@dataclass
class ModelConfig:
    """What is trained."""

    name: str = "reference"
    """A recipe of train.recipes.RECIPES, module:Class of a Recipe, or module:factory(**model.kwargs) (an nn.Module)."""
    kwargs: dict[str, Any] = option(factory=dict)
    """Keyword arguments of the model (reference: d_model, n_layers...; recipes: lm, dtype...); flags update them."""
    audio_tokenizer: str = ""
    """Audio tokenizer (dir or hub id) the model was trained with: the cache's codes must come from its weights."""
    audio_tokenizer_revision: str = ""
    """Hub revision (branch, tag or commit) of --model.audio_tokenizer; default the hub's main (a folder has none)."""
    contract: dict[str, Any] = option(factory=dict)
    """More contract items (fields, special_tokens, codec: {name, weights...}...); a plain factory's whole contract."""
    allow_other_encoder_weights: bool = False
    """Train on codes / latents / features of other encoder weights than the model's (recorded in the run)."""
    latent_loss: Literal["none", "cosine", "mse"] = "none"
    """Reference model: latent-regression head (next image patch)."""
    latent_loss_weight: bounded(float, ge=0.0, le=1e6) = 1.0
    """Weight of the latent-regression loss."""
    init_from: str = ""
    """Initialise weights from a step-N dir or a .safetensors file; not a resume (optimizer and data start fresh)."""
    activation_checkpointing: bool = False
    """Recompute transformer blocks in backward (torch.utils.checkpoint, use_reentrant=False)."""
    compile: bool = False
    """torch.compile the model (before the DDP wrap)."""


@dataclass
class LoraConfig:
    """LoRA adapters (peft): only they (and a recipe's own media modules) train and are checkpointed."""

    enabled: bool = False
    """Train LoRA adapters instead of all weights; checkpoints then hold the trainable tensors only."""
    r: bounded(int, gt=0, le=65536) = 8
    """LoRA rank."""
    alpha: bounded(int, gt=0, le=1_000_000) = 16
    """LoRA alpha (scale alpha / r)."""
    dropout: bounded(float, ge=0.0, le=1.0) = 0.0
    """LoRA dropout."""
    targets: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
    """Module-name suffixes that get adapters (the reference model's; recipes default to their own)."""


@dataclass
class OptimConfig:
    """AdamW and gradient clipping."""

    lr: bounded(float, ge=0.0, le=100.0) = 3e-4
    """Peak learning rate (a model's own optimizer groups may scale it: the VLM's projection_lr)."""
    weight_decay: bounded(float, ge=0.0, le=100.0) = 0.1
    """AdamW weight decay on matrices and embeddings (dim >= 2); biases and norms exempt."""
    beta1: bounded(float, ge=0.0, le=1.0) = 0.9
    """AdamW beta1."""
    beta2: bounded(float, ge=0.0, le=1.0) = 0.95
    """AdamW beta2."""
    eps: bounded(float, gt=0.0, le=1.0) = 1e-8
    """AdamW epsilon."""
    fused: Literal["auto", "on", "off"] = "auto"
    """Fused AdamW: auto (where this torch and device support it) | on | off."""
    grad_clip: bounded(float, ge=0.0, le=1e12) = 1.0
    """Max global grad norm; 0 = no clipping (the norm is still logged). A non-finite norm skips the step."""
    grad_norm_warn: bounded(float, ge=0.0, le=1e30) = 1000.0
    """Warn when the pre-clip grad norm exceeded this since the last log (usually 1-100); 0 = never."""


@dataclass
class ScheduleConfig:
    """The learning-rate schedule: a torch LambdaLR (its state is in every checkpoint)."""

    name: Literal["constant", "linear", "cosine", "polynomial"] = "cosine"
    """After warmup, lr down to min_lr_ratio x lr at the last step; polynomial: (1 - progress) ** power."""
    warmup_steps: bounded(int, ge=0, le=MAX_STEPS) = 100
    """Linear warmup steps (lr x (step + 1) / warmup_steps)."""
    min_lr_ratio: bounded(float, ge=0.0, le=1.0) = 0.1
    """Final lr as a fraction of each group's lr (groups with their own lr keep their ratio)."""
    power: bounded(float, gt=0.0, le=1000.0) = 1.0
    """Exponent of the polynomial schedule (1 = linear)."""


@dataclass
class TrainingConfig:
    """Length, accumulation, precision, failure limits."""

    steps: bounded(int, ge=0, le=MAX_STEPS) = 1000
    """Optimizer steps in total (the schedule spans them); ignored when --training.epochs > 0."""
    epochs: bounded(float, ge=0.0, le=1e6) = 0.0
    """Epochs to train, may be fractional (steps = ceil(epochs x batches per epoch / grad_accum)); 0 = steps."""
    grad_accum: bounded(int, gt=0, le=1_000_000) = 1
    """Micro-steps per optimizer step; gradients are all-reduced on the last only (no_sync)."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """auto: on CUDA bf16 where supported, else fp16 (with a GradScaler); fp32 on CPU. Or bf16 | fp16 | fp32."""
    nonfinite_limit: bounded(int, ge=0, le=MAX_STEPS) = 20
    """Stop (exit 1, no checkpoint) after this many consecutive non-finite (skipped) steps; 0 = never."""


@dataclass
class DistConfig:
    """Devices, process group, DDP."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto (cuda:<local rank> if available, else cpu) | cpu | cuda (each rank on its cuda:<local rank>)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto (nccl on CUDA, gloo on CPU)."""
    pg_timeout_min: bounded(float, gt=0.0, le=525_600.0) = 30.0
    """Process-group timeout in minutes (a hung collective fails after it)."""
    bucket_cap_mb: bounded(int, gt=0, le=65536) = 25
    """DDP gradient bucket size in MiB."""
    find_unused_parameters: bool = False
    """DDP find_unused_parameters (plug-in models with unused branches)."""
    threads: bounded(int, ge=0, le=4096) = 0
    """torch intra-op threads per process; 0 = leave as is (torchrun sets OMP_NUM_THREADS=1)."""


@dataclass
class CheckpointConfig:
    """Atomic step-N checkpoints in the run directory."""

    every: bounded(int, gt=0, le=MAX_STEPS) = 500
    """Save a checkpoint every N steps (and at the end, and on a stop request)."""
    keep: bounded(int, gt=0, le=1_000_000) = 3
    """Complete checkpoints kept (older ones are deleted after a new one is complete)."""
    resume: str = ""
    """'' = start fresh (refused over a run); fresh = replace that run; auto = the newest checkpoint, if any; step-N."""
    allow_other_cache: bool = False
    """Resume a checkpoint made on another cache (another cache id: the data position means other samples)."""


@dataclass
class JobConfig:
    """The run directory, stop requests, requeue."""

    dir: str = "runs/train"
    """Run directory: checkpoints step-N/, metrics.jsonl, profile/, REQUEUE."""
    stop_file: str = ""
    """A stop is requested when this file exists; '' = RUN_DIR/STOP. Consumed after the stop checkpoint."""
    stop_at_step: bounded(int, ge=0, le=MAX_STEPS) = 0
    """Request a stop after this step (as if SIGUSR1 arrived); 0 = never."""
    requeue_exit_code: bounded(int, ge=0, le=255) = 3
    """Exit status after a stop request (checkpoint saved; the job should be requeued)."""


@dataclass
class EvalConfig:
    """Held-out validation, on every rank."""

    enabled: bool = True
    """Validate during training (--data.val_cache, else the held-out keys); false: never, nothing held out."""
    every: bounded(int, ge=0, le=MAX_STEPS) = 0
    """Validate every N steps and at the end; 0 = every checkpoint.every steps (see stagger)."""
    stagger: bool = True
    """A validation due on a checkpoint step runs one step later (500, 1001, 1500...); false: in that step."""
    batches: bounded(int, ge=0, le=MAX_STEPS) = 0
    """Batches per rank per validation; 0 = the whole validation epoch."""
    batch_size: bounded(int, ge=0, le=1_000_000) = 0
    """Samples per rank per validation batch; 0 = --data.batch_size."""


@dataclass
class MetricsConfig:
    """metrics.jsonl (and TensorBoard) on global rank 0."""

    every: bounded(int, gt=0, le=MAX_STEPS) = 10
    """Write a metrics record every N steps (the only steps that wait for the device)."""
    tensorboard: bool = False
    """Also log to RUN_DIR/tb (needs the tensorboard package)."""
    progress: bool = True
    """tqdm progress bar on global rank 0."""
    throughput_warn: bounded(float, ge=0.0, le=1.0) = 0.5
    """Warn when samples/s falls below this fraction of its running average."""
    debug: bool = False
    """Records also hold latents_mean/std/min/max of the window's batches, logged at DEBUG level."""


@dataclass
class ProfileConfig:
    """torch.profiler over the first steps: a trace and RUN_DIR/profile/report.md."""

    enabled: bool = False
    """Profile the steps below (rank 0): a Chrome trace and RUN_DIR/profile/report.md (time per phase)."""
    wait: bounded(int, ge=0, le=1_000_000) = 1
    """Profiler schedule: steps skipped."""
    warmup: bounded(int, ge=0, le=1_000_000) = 1
    """Profiler schedule: warmup steps."""
    active: bounded(int, gt=0, le=1_000_000) = 3
    """Profiler schedule: recorded steps."""


@dataclass
class TrainConfig:
    """Every option of shardcache train (see configs/train.yaml)."""

    data: DataConfig = option(factory=DataConfig)
    model: ModelConfig = option(factory=ModelConfig)
    lora: LoraConfig = option(factory=LoraConfig)
    optim: OptimConfig = option(factory=OptimConfig)
    schedule: ScheduleConfig = option(factory=ScheduleConfig)
    training: TrainingConfig = option(factory=TrainingConfig)
    dist: DistConfig = option(factory=DistConfig)
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig)
    job: JobConfig = option(factory=JobConfig)
    eval: EvalConfig = option(factory=EvalConfig)
    metrics: MetricsConfig = option(factory=MetricsConfig)
    profile: ProfileConfig = option(factory=ProfileConfig)


# ---- checks ------------------------------------------------------------------------------------------

def check_config(cfg: TrainConfig) -> list[tuple[str, str]]:
    """Rules across options (after each option's own type and range passed); the cache's and the loader's
    are :mod:`train.preflight`'s and :mod:`train.bounds`'."""
    fields, m = tuple(cfg.data.fields), cfg.model
    explicit = fields not in (("auto",), ("all",))
    return [(k, msg) for k, ok, msg in (
        ("data.fields", not explicit or not {"auto", "all"} & set(fields), "auto or all alone, or a list of fields"),
        ("model.name", m.name == "reference" or m.name in RECIPES or ":" in m.name,
         f"expected 'reference', one of {', '.join(sorted(RECIPES))} or module:factory, got {m.name!r}"),
        ("model.latent_loss", m.latent_loss == "none" or not explicit or "latents" in fields,
         "needs 'latents' in data.fields"),
        ("data.fields", not explicit or "codes" in fields or m.name != "reference",
         "the reference model needs 'codes' in data.fields")) if not ok]
