"""Stage-two configuration: one dataclass, documented defaults, YAML file, every field a CLI flag.

Precedence: dataclass defaults < ``--config FILE`` (YAML, default ``configs/train.yaml`` when it
exists) < command-line flags. Every field ``foo_bar`` is the flag ``--foo-bar``; booleans also get
``--no-foo-bar``; dict fields take JSON and update the
value from the file (``--model-kwargs '{"d_model": 128}'``), tuple fields a
comma-separated list. The effective config is printed at start (global rank 0) and stored in every
checkpoint (``config.json`` and inside ``trainer.pt``).

The Higgs-Audio / HF Trainer spellings (``--train_data_file``, ``--learning_rate``, ``--bf16``...,
:data:`ALIASES`) are accepted as aliases of these options, so the Higgs-Audio launch line works as
written. ``--model_path P`` sets ``model_kwargs.lm = P`` and ``--model tts`` unless ``--model`` is
given. A ``--model`` on the command line that differs from the file's drops the file's
``model_kwargs`` (they belong to the file's model).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_CONFIG_FILE = "configs/train.yaml"


def _f(default: Any, help: str, **kw) -> Any:
    """A dataclass field with a help string (shown by ``--help``)."""
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """Every option of ``python -m train`` (see ``configs/train.yaml``)."""

    # ---- data ------------------------------------------------------------------------------------
    cache: str = _f("", "training cache directory (made by `python -m precompute`). Required.")
    val_cache: str = _f("", "validation cache directory; empty = validate on the keys of --cache held out "
                        "by --val-fraction.")
    val_fraction: float = _f(0.02, "without --val-cache: the fraction of --cache's keys held out of training "
                             "for validation, chosen by sha256(key) (the same keys for every run, seed and "
                             "world size; a key's membership does not depend on the other keys); at least 1 "
                             "key when the cache has >= 20 samples, none below; 0 = nothing held out, no "
                             "validation. At most 0.5.")
    fields: tuple = _f(("auto",), "cached fields the loader collates: auto = the model's `fields` attribute "
                       "(recipes declare theirs), else every field the cache holds; all = every field the "
                       "cache holds; or a list, e.g. input_ids,labels,codes,audio_segments.")
    batch_size: int = _f(8, "samples per rank per micro-step. Global batch = batch_size x world x grad_accum.")
    eval_batch_size: int = _f(0, "samples per rank per validation batch; 0 = --batch-size.")
    num_workers: int = _f(0, "DataLoader worker processes per rank (0 = load in the training process).")
    loader: str = _f("loaders:ShardLoader", "module:class of the loader (ShardLoader API).")
    loader_kwargs: dict = _f({}, "extra keyword arguments for the loader (JSON).")
    compact_batches: bool = _f(True, "ask the loader for int16 audio and float16 latents as stored and convert "
                                     "them to float32 on the training device: half the host copies and "
                                     "host-to-device bytes (only for loaders that accept compact=).")
    seed: int = _f(0, "seed of the data order and of model init; rank r seeds its own RNGs with seed+r.")

    # ---- model -----------------------------------------------------------------------------------
    model: str = _f("reference", "'reference', a recipe (tts | vlm: train.recipes) or module:factory returning "
                    "an nn.Module whose forward(batch) returns a loss tensor or a dict with 'loss'.")
    audio_tokenizer: str = _f("", "the audio tokenizer (path or hub id) the cache's codes should come from: "
                              "logged and compared with manifest.json (config.audio_tokenizer.pretrained), "
                              "a mismatch warns. Never loaded: the codes are cached.")
    model_kwargs: dict = _f({}, "keyword arguments for the model factory (JSON); for the reference "
                            "model: d_model, n_layers, n_heads, mlp_ratio, dropout, patch_size, max_positions.")
    latent_loss: str = _f("none", "reference model latent-regression head: none | cosine | mse.")
    latent_loss_weight: float = _f(1.0, "weight of the latent-regression loss.")
    init_from: str = _f("", "checkpoint dir or .safetensors file to initialise weights from (not a resume).")
    activation_checkpointing: bool = _f(False, "recompute transformer blocks in backward (use_reentrant=False).")
    compile: bool = _f(False, "torch.compile the model (before the DDP wrap).")
    lora: bool = _f(False, "train LoRA adapters (peft) instead of all weights.")
    lora_r: int = _f(8, "LoRA rank.")
    lora_alpha: int = _f(16, "LoRA alpha.")
    lora_dropout: float = _f(0.0, "LoRA dropout.")
    lora_targets: tuple = _f(("qkv", "proj", "fc1", "fc2"), "module names that get LoRA adapters.")

    # ---- optimisation ----------------------------------------------------------------------------
    steps: int = _f(1000, "optimizer steps in total (the schedule spans them); ignored when --epochs > 0.")
    epochs: float = _f(0.0, "train for this many epochs (may be fractional): steps = ceil(epochs x "
                       "steps_per_epoch), steps_per_epoch = loader batches per epoch // grad_accum; "
                       "0 = use --steps.")
    grad_accum: int = _f(1, "micro-steps per optimizer step; gradients are all-reduced on the last only.")
    lr: float = _f(3e-4, "peak learning rate.")
    min_lr: float = _f(3e-5, "final learning rate of the cosine/linear decay.")
    warmup_steps: int = _f(100, "linear warmup steps (from lr/warmup to lr).")
    schedule: str = _f("cosine", "cosine | linear | constant (after warmup).")
    weight_decay: float = _f(0.1, "AdamW weight decay on matrices and embeddings (dim >= 2); biases and norms exempt.")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.95, "AdamW beta2.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    fused: str = _f("auto", "fused AdamW: auto (if this torch/device supports it) | on | off.")
    grad_clip: float = _f(1.0, "max global grad norm; 0 = no clipping (the norm is still logged). "
                          "A non-finite norm skips the step.")
    grad_norm_warn: float = _f(1000.0, "warn (global rank 0) when the pre-clip grad norm exceeds this "
                               "(first 3 times, then every 100th); expected O(1-100); 0 = never.")
    precision: str = _f("auto", "auto (bf16 autocast on CUDA, fp32 on CPU) | bf16 (also on CPU) | fp32.")

    # ---- parallelism / runtime -------------------------------------------------------------------
    device: str = _f("auto", "auto (cuda:LOCAL_RANK if available, else cpu) | cpu | cuda.")
    backend: str = _f("auto", "process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo.")
    pg_timeout_min: float = _f(30.0, "process-group timeout in minutes (a hung collective fails after it).")
    bucket_cap_mb: int = _f(25, "DDP gradient bucket size.")
    find_unused_parameters: bool = _f(False, "DDP find_unused_parameters (plug-in models with unused branches).")
    threads: int = _f(0, "torch intra-op threads per process; 0 = leave as is (torchrun sets OMP_NUM_THREADS=1).")

    # ---- output, checkpoints, stopping -----------------------------------------------------------
    out: str = _f("runs/train", "run directory: checkpoints step-N/, metrics.jsonl, profile/.")
    ckpt_every: int = _f(500, "save a checkpoint every N steps (and at the end, and on a stop request).")
    keep: int = _f(3, "complete checkpoints kept (older ones are deleted after a new one is complete).")
    resume: str = _f("", "'' = start fresh, 'auto' = newest complete checkpoint in --out if any, or a step-N dir.")
    stop_file: str = _f("", "a stop is requested when this file exists; '' = OUT/STOP. Consumed after the stop save.")
    stop_at_step: int = _f(0, "request a stop after this step (as if SIGUSR1 arrived); 0 = never.")
    requeue_exit_code: int = _f(3, "exit status after a stop request (checkpoint saved; the job should be requeued).")

    # ---- evaluation ------------------------------------------------------------------------------
    validation: bool = _f(True, "validate during training (on --val-cache, else on the keys held out by "
                          "--val-fraction); --no-validation: never, and nothing is held out.")
    eval_every: int = _f(0, "validate every N steps and at the end; 0 = at each checkpoint (--ckpt-every) "
                         "and at the end.")
    eval_batches: int = _f(0, "batches per rank per validation; 0 = the whole validation epoch.")

    # ---- logging / profiling ---------------------------------------------------------------------
    log_every: int = _f(1, "write a metrics record every N steps.")
    tensorboard: bool = _f(False, "also log to OUT/tb (needs the tensorboard package).")
    progress: bool = _f(True, "tqdm progress bar on global rank 0.")
    throughput_warn: float = _f(0.5, "warn when samples/s falls below this fraction of its running average.")
    profile: bool = _f(False, "run torch.profiler over the first steps; trace to OUT/profile/, top ops printed.")
    profile_wait: int = _f(1, "profiler schedule: steps skipped.")
    profile_warmup: int = _f(1, "profiler schedule: warmup steps.")
    profile_active: int = _f(3, "profiler schedule: recorded steps.")

    # ---- testing hooks ---------------------------------------------------------------------------
    fail_at_step: int = _f(-1, "testing: --fail-rank raises RuntimeError once this many steps are done (-1 = never).")
    fail_rank: int = _f(-1, "testing: the global rank that raises at --fail-at-step.")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def dump(self) -> str:
        """The effective config as YAML (what is printed at start)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_TYPES = typing.get_type_hints(TrainConfig)


def _convert(name: str, value: Any) -> Any:
    """Coerce a YAML/CLI value to the field's type (raises ValueError naming the option)."""
    t = _TYPES[name]
    try:
        if t is tuple:
            if isinstance(value, str):
                return tuple(s.strip() for s in value.split(",") if s.strip())
            return tuple(value)
        if t is dict:
            if isinstance(value, str):
                value = json.loads(value) if value.strip() else {}
            if not isinstance(value, dict):
                raise TypeError("expected a mapping")
            return dict(value)
        if t is bool:
            if isinstance(value, str):
                low = value.strip().lower()
                if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                return low in ("1", "true", "yes", "on")
            return bool(value)
        if t is float:
            return float(value)
        if t is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        return "" if value is None else str(value)
    except (TypeError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"option {name}: cannot use {value!r} as {t.__name__} ({e})") from None


def from_dict(data: dict[str, Any], base: TrainConfig | None = None, source: str = "config") -> TrainConfig:
    """``base`` (default: the defaults) with the values of ``data`` (names with - or _)."""
    base = base or TrainConfig()
    clean = {}
    for k, v in (data or {}).items():
        name = k.replace("-", "_")
        if name not in _FIELDS:
            raise ValueError(f"{source}: unknown option {k!r}; see `python -m train --help`")
        clean[name] = _convert(name, v)
        if _TYPES[name] is dict:  # a dict option updates the one below it (file < flags)
            clean[name] = {**getattr(base, name), **clean[name]}
    return validate(dataclasses.replace(base, **clean))


def load_yaml(path: str | Path, base: TrainConfig | None = None) -> TrainConfig:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of option: value")
    return from_dict(data, base, source=str(path))


#: ``fields`` values that are not a list of fields
FIELD_MODES = (("auto",), ("all",))

PRECOMPUTE_HINT = ("python -m precompute --manifest {file} --out DIR --config configs/precompute-tts.yaml")


def check_cache_path(cache: str) -> None:
    """A manifest file given where a cache directory belongs: ValueError with the precompute command."""
    if cache and Path(cache).is_file():
        raise ValueError(
            f"--train_data_file/--cache {cache} is a file (a manifest?), not a cache directory: training "
            "reads the tensors that stage one caches (no audio decoding or codec here). Run\n"
            f"  {PRECOMPUTE_HINT.format(file=cache)}\n"
            "first, then pass --train_data_file DIR (or --cache DIR).")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Raise ValueError for inconsistent options."""
    from .recipes import RECIPES  # a dict of names: imports nothing heavy

    check_cache_path(cfg.cache)
    fields = tuple(cfg.fields)
    explicit = fields not in FIELD_MODES
    checks = [
        (not explicit or not {"auto", "all"} & set(fields), "fields: auto or all alone, or a list of fields"),
        (0.0 <= cfg.val_fraction <= 0.5, "val_fraction must be in [0, 0.5]"),
        (cfg.epochs >= 0, "epochs must be >= 0"),
        (cfg.grad_norm_warn >= 0, "grad_norm_warn must be >= 0 (0 = never)"),
        (cfg.batch_size >= 1, "batch_size must be >= 1"),
        (cfg.grad_accum >= 1, "grad_accum must be >= 1"),
        (cfg.steps >= 0, "steps must be >= 0"),
        (cfg.keep >= 1, "keep must be >= 1"),
        (cfg.ckpt_every >= 1 and cfg.log_every >= 1, "ckpt_every and log_every must be >= 1"),
        (cfg.eval_every >= 0 and cfg.eval_batches >= 0, "eval_every and eval_batches must be >= 0"),
        (cfg.schedule in ("cosine", "linear", "constant"), "schedule must be cosine|linear|constant"),
        (cfg.precision in ("auto", "bf16", "fp32"), "precision must be auto|bf16|fp32"),
        (cfg.latent_loss in ("none", "cosine", "mse"), "latent_loss must be none|cosine|mse"),
        (cfg.fused in ("auto", "on", "off"), "fused must be auto|on|off"),
        (cfg.backend in ("auto", "nccl", "gloo"), "backend must be auto|nccl|gloo"),
        (cfg.model == "reference" or cfg.model in RECIPES or ":" in cfg.model,
         f"model must be 'reference', one of {sorted(RECIPES)} or module:factory"),
        (":" in cfg.loader, "loader must be module:class"),
        (not cfg.lora or cfg.lora_r >= 1, "lora_r must be >= 1"),
        (cfg.latent_loss == "none" or not explicit or "latents" in fields, "latent_loss needs 'latents' in fields"),
        (not explicit or "codes" in fields or cfg.model != "reference", "the reference model needs 'codes' in fields"),
        (0 <= cfg.requeue_exit_code <= 255, "requeue_exit_code must be 0..255"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)
    return cfg


#: Higgs-Audio / HF Trainer flag -> (our option, constant or None for "takes a value", help).
#: ``--model_path`` is special: ``model_kwargs.lm`` (see :func:`config_from_namespace`).
ALIASES: dict[str, tuple[str, Any, str]] = {
    "--model_path": ("model_path", None, "LM checkpoint (dir or hub id) = --model-kwargs '{\"lm\": P}'; "
                     "--model defaults to tts."),
    "--audio_tokenizer_path": ("audio_tokenizer", None, "= --audio-tokenizer (compared with the cache's)."),
    "--train_data_file": ("cache", None, "= --cache: a cache DIR made by `python -m precompute` "
                          "(not the .json manifest)."),
    "--output_dir": ("out", None, "= --out."),
    "--save_steps": ("ckpt_every", None, "= --ckpt-every."),
    "--disable_evaluation": ("validation", False, "= --no-validation (nothing held out)."),
    "--per_device_train_batch_size": ("batch_size", None, "= --batch-size."),
    "--learning_rate": ("lr", None, "= --lr."),
    "--num_train_epochs": ("epochs", None, "= --epochs."),
    "--logging_steps": ("log_every", None, "= --log-every."),
    "--warmup_steps": ("warmup_steps", None, "= --warmup-steps."),
    "--bf16": ("precision", "bf16", "= --precision bf16."),
    "--use_lora": ("lora", True, "= --lora."),
}


def build_parser(prog: str = "python -m train", description: str | None = None,
                 exclude: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """``--config``, ``--print-config`` and one flag per TrainConfig field (except ``exclude``:
    another tool that reuses the options can give those flag names its own meaning)."""
    p = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=description if description is not None else (
            "Train from a shardcache cache (stage two).\n\n"
            "  python -m train --cache cache/demo --out runs/demo --steps 50\n"
            "  torchrun --nproc_per_node=2 -m train --cache cache/demo --out runs/demo\n\n"
            "Options come from the dataclass defaults, then --config FILE (YAML; default\n"
            f"{DEFAULT_CONFIG_FILE} when it exists), then these flags. Exit status: 0 done,\n"
            "the --requeue-exit-code (default 3) after a stop request (SIGUSR1/SIGTERM or the stop\n"
            "file; a checkpoint was saved, requeue the job), 1 on an error (on any rank)."),
    )
    p.add_argument("--config", default=None, help=f"YAML file of options (default: {DEFAULT_CONFIG_FILE} if present; "
                   "'none' for none).")
    p.add_argument("--print-config", action="store_true", help="print the effective config and exit.")
    for name, f in _FIELDS.items():
        if name in exclude:
            continue
        t = _TYPES[name]
        flag = "--" + name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = json.dumps(default) if t is dict else (",".join(default) if t is tuple else default)
        help_ = f"{f.metadata.get('help', '')} (default: {shown})".replace("%", "%%")
        if t is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_)
        else:
            p.add_argument(flag, default=argparse.SUPPRESS, metavar=t.__name__.upper(), help=help_)
    g = p.add_argument_group("aliases (Higgs-Audio / HF Trainer spelling)")
    for flag, (dest, const, help_) in ALIASES.items():
        if dest in exclude or (dest == "model_path" and "model_kwargs" in exclude):
            continue
        if const is None:
            g.add_argument(flag, dest=dest, default=argparse.SUPPRESS, metavar="VALUE", help=help_)
        else:
            g.add_argument(flag, dest=dest, action="store_const", const=const, default=argparse.SUPPRESS,
                           help=help_)
    return p


def config_from_namespace(ns: argparse.Namespace) -> TrainConfig:
    """Parsed flags (of :func:`build_parser`) -> effective config (defaults < YAML < flags)."""
    cfg = TrainConfig()
    path = ns.config
    if path is None and Path(DEFAULT_CONFIG_FILE).exists():
        path = DEFAULT_CONFIG_FILE
    if path and path != "none":
        cfg = load_yaml(path, cfg)
    overrides = {k: v for k, v in vars(ns).items() if k in _FIELDS}
    model_path = getattr(ns, "model_path", None)
    if model_path:
        overrides.setdefault("model", "tts")
        if overrides["model"] == "reference":
            raise ValueError("--model_path: the reference model loads no LM; use --model tts|vlm|module:factory")
        kw = _convert("model_kwargs", overrides.get("model_kwargs", {}))
        overrides["model_kwargs"] = {**kw, "lm": str(model_path)}
    if overrides.get("model", cfg.model) != cfg.model:  # the file's model_kwargs are for the file's model
        cfg = dataclasses.replace(cfg, model_kwargs={})
    return from_dict(overrides, cfg, source="command line")


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    """CLI -> effective config (defaults < YAML < flags)."""
    ns = build_parser().parse_args(argv)
    return config_from_namespace(ns), ns
