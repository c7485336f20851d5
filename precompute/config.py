"""Stage-one configuration: :class:`PrecomputeConfig`, read by :mod:`shardcache.config` (defaults < config
file < flags), checked by :mod:`precompute.validate`. Each option's type carries its choices and bounds, and
its ``effect`` says what changing it does to a cache: :mod:`precompute.identity` derives the fingerprint, the
row digests and the recorded batch policy from these declarations (docs/trust.md's option table)."""
# no `from __future__ import annotations`: the annotations are the types jsonargparse checks (bounded(...))
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from shardcache.config import bounded, option, parse, parser
from shards.pixels import RESIZE_MODES, RGB_MODES
from shards.tokens import IMAGE

from .chat import CHAT_TEMPLATES, LABEL_POLICIES  # each option's values: the module that implements them
from .effects import AS_READ, AUDIO_ROWS, BATCH, BYTES, EVERY_ROW, IDENTITY, IMAGE_ROWS, OPERATIONAL, RERUN, SPEC, Effect
from .encoders._common import ENCODER_DTYPES
from .encoders.image import PIXEL_RANGES
from .manifests import FORMATS
from .rerun import SOURCE_DIGESTS

#: environment variable naming the config file when no --config is given
CONFIG_ENV = "SHARDCACHE_PRECOMPUTE_CONFIG"
#: the highest sample rate (Hz) an option accepts: 384 kHz, the highest of studio converters
MAX_SAMPLE_RATE = 384_000


@dataclass
class PrecisionTolerance:
    """How far an encoder_dtype other than float32 may differ from float32 (:mod:`precompute.precision`)."""

    latents_rel_err: bounded(float, ge=0.0, le=1e6) = option(0.02, effect=OPERATIONAL)
    """The most relative L2 error of the latents."""
    codes_agreement: bounded(float, ge=0.0, le=1.0) = option(0.95, effect=OPERATIONAL)
    """The least fraction of codes equal to float32's."""


@dataclass
class PrecomputeConfig:
    """Every option of shardcache precompute (defaults: configs/precompute.yaml)."""

    sample_rate: bounded(int, gt=0, le=MAX_SAMPLE_RATE) = option(24000, effect=BYTES)
    """Hz of the stored waveform (audio.npy); the codec gets its own rate, resampled from the same decoded array."""
    min_duration: bounded(float, ge=0.0, le=86400.0) = option(0.05, effect=AUDIO_ROWS)
    """Seconds; shorter clips are rejected (too_short)."""
    max_duration: bounded(float, gt=0.0, le=86400.0) = option(30.0, effect=AUDIO_ROWS)
    """Seconds; longer clips are rejected (too_long) from the file header, before decoding."""
    silence_rms: bounded(float, ge=0.0, le=1.0) | None = option(None, effect=AUDIO_ROWS)
    """Reject clips whose RMS (full scale 1.0) is below this (silent); null disables the check."""
    image_size: bounded(int, gt=0, le=16384) = option(256, effect=BYTES)
    """Pixels of the square VAE input (a multiple of the VAE's spatial factor, 8)."""
    image_resize: Literal[RESIZE_MODES] = option("center_crop", effect=BYTES)
    """center_crop | pad | bucket (aspect kept, bicubic) | stretch (aspect not kept: TheWorld's CosmosVAEEncoder)."""
    image_rgb: Literal[RGB_MODES] = option("composite", effect=BYTES)
    """composite: EXIF rotation applied, alpha over white; convert: Pillow's convert("RGB") alone (TheWorld's)."""
    image_pixel_range: Literal[tuple(PIXEL_RANGES)] = option("-1..1", effect=BYTES)
    """Pixel values the VAE is fed: -1..1 (as the Wan / Cosmos VAEs document) or 0..255 (TheWorld's)."""
    image_token: str = option(IMAGE, effect=BYTES)
    """Placeholder token of an image in input_ids, the k-th for image k: <image> (LLaVA), <start_of_image> (Gemma 3)."""
    world_tokens: tuple[str, ...] | None = option(None, effect=BYTES)
    """TheWorld's markers [<start_of_world>, <end_of_world>]: one pair per image right after BOS (label -100)."""
    add_missing_tokens: bool = option(False, effect=IDENTITY)
    """Add the placeholder / marker tokens the text tokenizer lacks; false: such a tokenizer is refused."""
    store_posterior: bool = option(False, effect=BYTES)
    """Also store latents_logvar beside the mean (to sample mean + exp(0.5 * logvar) * eps); wan only."""
    max_image_pixels: bounded(int, gt=0, le=1 << 30) = option(64_000_000, effect=IMAGE_ROWS)
    """Decompression-bomb guard: images with more pixels are rejected (image_too_large)."""
    min_image_side: bounded(int, gt=0, le=16384) = option(16, effect=IMAGE_ROWS)
    """Images whose shorter side is below this many pixels are rejected (image_too_small)."""
    samples_per_shard: bounded(int, gt=0, le=1_000_000) = option(256, effect=BATCH)
    """Rows of the manifest per shard (rejected rows included)."""
    encoder_batch_size: bounded(int, gt=0, le=65536) = option(8, effect=BATCH)
    """Clips or images per encoder call (not the training batch)."""
    num_workers: bounded(int, ge=0, le=1024) | Literal["auto"] = option("auto", effect=OPERATIONAL)
    """Decode worker processes (0: in the main process); auto: on CUDA sized from the first batch, on CPU 0."""
    stall_timeout_s: bounded(float, gt=0.0, le=604800.0) = option(600.0, effect=OPERATIONAL)
    """Seconds a codec process, decode worker, the writer or the encoder thread may go without progress (then: hung)."""
    device: str = option("auto", effect=Effect("batch", canonical=lambda d: str(d).partition(":")[0]))
    """auto = cuda:<local rank> when available, else cpu; or cpu, cuda, cuda:N (mps, xpu:N...)."""
    encoder_dtype: Literal[tuple(ENCODER_DTYPES)] = option(
        "float32", effect=Effect("bytes", via="fingerprint", canonical=ENCODER_DTYPES.get))
    """Compute dtype of the codec and the VAE; anything but float32 is first measured against float32."""
    precision_samples: bounded(int, ge=0, le=100_000) = option(8, effect=OPERATIONAL)
    """Rows used for that measurement."""
    precision_tolerance: PrecisionTolerance = option(factory=PrecisionTolerance)
    """The accepted difference: latents relative L2 error, fraction of equal codes."""
    audio_tokenizer: dict[str, Any] | None = option(
        factory=lambda: {"name": "dac", "pretrained": "descript/dac_24khz"}, effect=SPEC)
    """Codec {name (listed by --help), pretrained: DIR or hub id, options...} or a factory; null = no codes."""
    image_encoder: dict[str, Any] | None = option(
        factory=lambda: {"name": "wan", "pretrained": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"}, effect=SPEC)
    """VAE {name (listed by --help), pretrained: DIR or hub id, ...} or a factory; null = no latents."""
    image_features: dict[str, Any] | None = option(None, effect=SPEC)
    """{name: gemma3, pretrained, dtype}: Gemma 3's vision tower and projector once per image; null = none."""
    text_tokenizer: dict[str, Any] = option(factory=lambda: {"name": "bytes"}, effect=SPEC)
    """Text tokenizer spec: {name: bytes} or {name: hf, pretrained: DIR or hub id} (the LM's own tokenizer)."""
    chat_template: Literal[CHAT_TEMPLATES] = option("auto", effect=BYTES)
    """auto (the tokenizer's template, else llama3) | llama3 (Higgs-Audio's) | tokenizer (or an error) | theworld."""
    label_policy: Literal[LABEL_POLICIES] = option("answers", effect=BYTES)
    """Which tokens get labels: answers (the assistant turns') | all_but_world (every token: TheWorld's rule)."""
    extra_fields: dict[str, dict[str, Any]] = option(factory=dict, effect=SPEC)
    """More fields: NAME -> {producer: waveform | codes | ..., **options} or a plug-in {factory, kwargs}."""
    manifest_format: Literal[tuple(FORMATS)] | None = option(None, effect=AS_READ)
    """Manifest format; null = detected from the file."""
    columns: dict[str, str] = option(factory=dict, effect=AS_READ)
    """Column mapping for JSONL/CSV/Parquet rows, e.g. {audio: path} (--columns.audio path)."""
    allow_outside_root: bool = option(False, effect=AS_READ)
    """Read media outside --root (default: the manifest's folder); off: such a row is rejected (malformed_row)."""
    source_digest: Literal[SOURCE_DIGESTS] = option("stat", effect=OPERATIONAL)
    """What a rerun compares of each media file: stat = path, size, mtime; content = path and sha256 (reads all)."""
    keep_removed_rows: bool = option(False, effect=RERUN)
    """Rerun: keep cached rows no longer in the manifest instead of removing them (the job says how many)."""
    max_text_tokens: bounded(int, gt=0, le=100_000_000) = option(65536, effect=EVERY_ROW)
    """Per sample: the most input_ids tokens; a longer one is rejected as too_large."""
    max_audio_items: bounded(int, gt=0, le=1_000_000) = option(256, effect=AUDIO_ROWS)
    """Per sample: the most audio items of a conversation; more are rejected as too_large before any decoding."""
    max_total_duration_s: bounded(float, gt=0.0, le=1e7) = option(3600.0, effect=AUDIO_ROWS)
    """Per sample: the most seconds of audio, every item together; more is rejected as too_large."""
    max_images: bounded(int, gt=0, le=1_000_000) = option(64, effect=IMAGE_ROWS)
    """Per sample: the most images of a conversation; more are rejected as too_large before any decoding."""


def load_config(path: str | Path | dict | None = None, overrides: list[str] | None = None) -> PrecomputeConfig:
    """Defaults < the YAML file ``path`` (or a mapping: a cache's recorded config) < ``key=value`` overrides.
    Raises :class:`~shardcache.config.ConfigError` on unknown options and wrong types (rules: :mod:`.validate`)."""
    text = yaml.safe_dump(path) if isinstance(path, dict) else str(path) if path else "none"
    argv = ["--config", text] + [f"--{o}" for o in overrides or ()]
    return parse(parser(PrecomputeConfig, "load_config"), PrecomputeConfig, argv)[0]
