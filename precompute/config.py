"""Stage-one configuration: :class:`PrecomputeConfig`, read by :mod:`shardcache.config` (defaults < config
file < flags), checked by :mod:`precompute.validate`; :data:`FINGERPRINT` lists what changes a cached byte."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shardcache import config as S
from shardcache.config import option
from shards.tokens import IMAGE

from .chat import CHAT_TEMPLATES, LABEL_POLICIES  # each option's values: the module that implements them
from .encoders._common import ENCODER_DTYPES
from .encoders.image import PIXEL_RANGES
from .images import RESIZE_MODES, RGB_MODES
from .manifests import FORMATS
from .rerun import SOURCE_DIGESTS

#: environment variable naming the config file when no --config is given
CONFIG_ENV = "SHARDCACHE_PRECOMPUTE_CONFIG"
#: the highest sample rate (Hz) an option accepts: 384 kHz, the highest of studio converters
MAX_SAMPLE_RATE = 384_000


@dataclass
class PrecisionTolerance:
    """How far an encoder_dtype other than float32 may differ from float32 (:mod:`precompute.precision`)."""

    latents_rel_err: float = option(0.02, ge=0.0, le=1e6)
    """The most relative L2 error of the latents."""
    codes_agreement: float = option(0.95, ge=0.0, le=1.0)
    """The least fraction of codes equal to float32's."""


#: the options that change cached bytes, so the cache's fingerprint (:meth:`PrecomputeConfig.preprocessing`)
FINGERPRINT = ("sample_rate", "image_size", "image_resize", "image_rgb", "image_pixel_range", "image_token",
               "world_tokens", "store_posterior", "chat_template", "label_policy", "image_features")


@dataclass
class PrecomputeConfig:
    """Every option of shardcache precompute (defaults: configs/precompute.yaml)."""

    sample_rate: int = option(24000, gt=0, le=MAX_SAMPLE_RATE)
    """Hz of the stored waveform (audio.npy); the codec gets its own rate, resampled from the same decoded array."""
    min_duration: float = option(0.05, ge=0.0, le=86400.0)
    """Seconds; shorter clips are rejected (too_short)."""
    max_duration: float = option(30.0, gt=0.0, le=86400.0)
    """Seconds; longer clips are rejected (too_long) from the file header, before decoding."""
    silence_rms: float | None = option(None, ge=0.0, le=1.0)
    """Reject clips whose RMS (full scale 1.0) is below this (silent); null disables the check."""
    image_size: int = option(256, gt=0, le=16384)
    """Pixels of the square VAE input (a multiple of the VAE's spatial factor, 8)."""
    image_resize: str = option("center_crop", choices=RESIZE_MODES)
    """center_crop | pad | bucket (aspect kept, bicubic) | stretch (aspect not kept: TheWorld's CosmosVAEEncoder)."""
    image_rgb: str = option("composite", choices=RGB_MODES)
    """composite: EXIF rotation applied, alpha over white; convert: Pillow's convert("RGB") alone (TheWorld's)."""
    image_pixel_range: str = option("-1..1", choices=tuple(PIXEL_RANGES))
    """Pixel values the VAE is fed: -1..1 (as the Wan / Cosmos VAEs document) or 0..255 (TheWorld's)."""
    image_token: str = option(IMAGE)
    """Placeholder token of an image in input_ids, the k-th for image k: <image> (LLaVA), <start_of_image> (Gemma 3)."""
    world_tokens: tuple[str, ...] | None = None
    """TheWorld's markers [<start_of_world>, <end_of_world>]: one pair per image right after BOS (label -100)."""
    add_missing_tokens: bool = False
    """Add the placeholder / marker tokens the text tokenizer lacks; false: such a tokenizer is refused."""
    store_posterior: bool = False
    """Also store latents_logvar beside the mean (to sample mean + exp(0.5 * logvar) * eps); wan only."""
    max_image_pixels: int = option(64_000_000, gt=0, le=1 << 30)
    """Decompression-bomb guard: images with more pixels are rejected (image_too_large)."""
    min_image_side: int = option(16, gt=0, le=16384)
    """Images whose shorter side is below this many pixels are rejected (image_too_small)."""
    samples_per_shard: int = option(256, gt=0, le=1_000_000)
    """Rows of the manifest per shard (rejected rows included)."""
    encoder_batch_size: int = option(8, gt=0, le=65536)
    """Clips or images per encoder call (not the training batch)."""
    num_workers: int | str = option("auto", choices=("auto",), ge=0, le=1024)
    """Decode worker processes (0: in the main process); auto: on CUDA sized from the first batch, on CPU 0."""
    device: str = "auto"
    """auto = cuda:LOCAL_RANK when available, else cpu; or cpu, cuda, cuda:N (mps, xpu:N...)."""
    encoder_dtype: str = option("float32", choices=tuple(ENCODER_DTYPES))
    """Compute dtype of the codec and the VAE; anything but float32 is first measured against float32."""
    precision_samples: int = option(8, ge=0, le=100_000)
    """Rows used for that measurement."""
    precision_tolerance: PrecisionTolerance = option(factory=PrecisionTolerance)
    """The accepted difference: latents relative L2 error, fraction of equal codes."""
    audio_tokenizer: dict[str, Any] | None = option(
        factory=lambda: {"name": "dac", "pretrained": "descript/dac_24khz"})
    """Codec {name (listed by --help), pretrained: DIR or hub id, options...} or a factory; null = no codes."""
    image_encoder: dict[str, Any] | None = option(
        factory=lambda: {"name": "wan", "pretrained": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"})
    """VAE {name (listed by --help), pretrained: DIR or hub id, ...} or a factory; null = no latents."""
    image_features: dict[str, Any] | None = option(None)
    """{name: gemma3, pretrained, dtype}: Gemma 3's vision tower and projector once per image; null = none."""
    text_tokenizer: dict[str, Any] = option(factory=lambda: {"name": "bytes"})
    """Text tokenizer spec: {name: bytes} or {name: hf, pretrained: DIR or hub id} (the LM's own tokenizer)."""
    chat_template: str = option("auto", choices=CHAT_TEMPLATES)
    """auto (the tokenizer's template, else llama3) | llama3 (Higgs-Audio's) | tokenizer (or an error) | theworld."""
    label_policy: str = option("answers", choices=LABEL_POLICIES)
    """Which tokens get labels: answers (the assistant turns') | all_but_world (every token: TheWorld's rule)."""
    extra_fields: dict[str, dict] = option(factory=dict)
    """More fields: NAME -> {producer: waveform | codes | ..., **options} or a plug-in {factory, kwargs}."""
    manifest_format: str | None = option(None, choices=tuple(FORMATS))
    """Manifest format; null = detected from the file."""
    columns: dict[str, str] = option(factory=dict)
    """Column mapping for JSONL/CSV/Parquet rows, e.g. {audio: path} (--columns.audio path)."""
    allow_outside_root: bool = False
    """Read media outside --root (default: the manifest's folder); off: such a row is rejected (malformed_row)."""
    source_digest: str = option("stat", choices=SOURCE_DIGESTS)
    """What a rerun compares of each media file: stat = path, size, mtime; content = path and sha256 (reads all)."""
    keep_removed_rows: bool = False
    """Rerun: keep cached rows no longer in the manifest instead of removing them (the job says how many)."""
    max_text_tokens: int = option(65536, gt=0, le=100_000_000)
    """Per sample: the most input_ids tokens; a longer one is rejected as too_large."""
    max_audio_items: int = option(256, gt=0, le=1_000_000)
    """Per sample: the most audio items of a conversation; more are rejected as too_large before any decoding."""
    max_total_duration_s: float = option(3600.0, gt=0.0, le=1e7)
    """Per sample: the most seconds of audio, every item together; more is rejected as too_large."""
    max_images: int = option(64, gt=0, le=1_000_000)
    """Per sample: the most images of a conversation; more are rejected as too_large before any decoding."""

    def preprocessing(self) -> dict[str, Any]:
        """Every parameter that changes cached bytes (the cache's fingerprint): the options of
        :data:`FINGERPRINT`, the stored dtypes, the encoders' compute dtype and ``sample_layout`` (the
        conversation rendering of :mod:`precompute.chat`: label spans from the template's structure)."""
        options = S.to_dict(self)
        return {k: options[k] for k in FINGERPRINT} | {
            "audio_format": "pcm_s16le", "latents_dtype": "float16", "sample_layout": "conversation-2",
            "encoder_dtype": ENCODER_DTYPES[self.encoder_dtype]}


def load_config(path: str | Path | dict | None = None, overrides: list[str] | None = None) -> PrecomputeConfig:
    """Defaults < the YAML file ``path`` (or a mapping: a cache's recorded config) < ``key=value`` overrides.
    Raises :class:`~shardcache.config.ConfigError` on unknown options and wrong types (rules: :mod:`.validate`)."""
    text = yaml.safe_dump(path) if isinstance(path, dict) else str(path) if path else "none"
    argv = ["--config", text] + [f"--{o}" for o in overrides or ()]
    return S.parse(S.parser(PrecomputeConfig, "load_config"), PrecomputeConfig, argv, "")[0]
