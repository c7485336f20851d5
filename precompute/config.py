"""Stage-one configuration: :class:`PrecomputeConfig`, one section of documented, checked options.

Read through :mod:`shardcache.config` (jsonargparse; the mechanism ``train`` uses too): dataclass
defaults < config file (YAML; ``--config FILE``, else ``$SHARDCACHE_PRECOMPUTE_CONFIG``, else none)
< flags in their order (``--sample_rate 16000``, ``--audio_tokenizer.pretrained /ckpt/dac``,
``--set encoder_batch_size=32``). Every problem is reported as
``option: message`` and ``shardcache precompute`` exits with status 2 before any model is loaded
(:mod:`precompute.validate` adds the rules across options and the encoder specs).

Everything that changes the bytes of a cached tensor is part of :meth:`PrecomputeConfig.preprocessing`
and therefore of the cache's fingerprint; renaming an option never changes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shardcache import config as S
from shardcache.config import option
from shards.tokens import IMAGE

from .manifests import FORMATS

#: environment variable naming the config file when no --config is given
CONFIG_ENV = "SHARDCACHE_PRECOMPUTE_CONFIG"
#: the highest sample rate (Hz) an option accepts: 384 kHz, the highest of studio converters
MAX_SAMPLE_RATE = 384_000

# The values of the enumerated options. Each list has its one owner here: the option below declares
# it as its choices, and the module that implements it (named beside it) imports it from here.
#: ``image_resize`` (:func:`precompute.images.resize_image`)
RESIZE_MODES = ("center_crop", "pad", "bucket", "stretch")
#: ``image_rgb`` (:mod:`precompute.images`)
RGB_MODES = ("composite", "convert")
#: ``image_pixel_range`` -> the (low, high) pixel values the VAE is fed (:mod:`precompute.encoders.image`)
PIXEL_RANGES: dict[str, tuple[float, float]] = {"-1..1": (-1.0, 1.0), "0..255": (0.0, 255.0)}
#: ``chat_template`` (:mod:`precompute.chat`)
CHAT_TEMPLATES = ("auto", "llama3", "tokenizer", "theworld")
#: ``label_policy`` (:mod:`precompute.chat`)
LABEL_POLICIES = ("answers", "all_but_world")
#: ``source_digest``: what a rerun compares of each media file (:mod:`precompute.rerun`)
SOURCE_DIGESTS = ("stat", "content")
#: ``encoder_dtype`` spellings -> the dtype they mean (:func:`precompute.encoders._common.resolve_dtype`)
ENCODER_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16",
                  "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


#: the options that change cached bytes, so the cache's fingerprint (:meth:`PrecomputeConfig.preprocessing`)
FINGERPRINT = ("sample_rate", "image_size", "image_resize", "image_rgb", "image_pixel_range", "image_token",
               "world_tokens", "store_posterior", "chat_template", "label_policy", "extra_waveforms", "image_features")


@dataclass
class PrecomputeConfig:
    """Every option of shardcache precompute (defaults: configs/precompute.yaml)."""

    sample_rate: int = option(24000, gt=0, le=MAX_SAMPLE_RATE)
    """Hz of the stored waveform (audio.npy). The codec gets its own rate (tokenizer.sample_rate); both are
    resampled from the one decoded array."""
    min_duration: float = option(0.05, ge=0.0, le=86400.0)
    """Seconds; shorter clips are rejected (too_short)."""
    max_duration: float = option(30.0, gt=0.0, le=86400.0)
    """Seconds; longer clips are rejected (too_long) from the file header, before decoding."""
    silence_rms: float | None = option(None, ge=0.0, le=1.0)
    """Reject clips whose RMS (full scale 1.0) is below this (silent); null disables the check."""
    image_size: int = option(256, gt=0, le=16384)
    """Pixels of the square VAE input (a multiple of the VAE's spatial factor, 8)."""
    image_resize: str = option("center_crop", choices=RESIZE_MODES)
    """center_crop | pad | bucket (aspect kept: latent H, W vary; loaders pad them and return latents_mask) |
    stretch (the whole image, aspect not kept, Pillow bilinear to image_size x image_size: TheWorld's
    CosmosVAEEncoder). center_crop, pad and bucket resample bicubic."""
    image_rgb: str = option("composite", choices=RGB_MODES)
    """How a decoded image becomes 8-bit RGB: composite = EXIF orientation applied, transparency composited
    over white, 16-bit scaled by 1/257 (precompute.images); convert = Pillow's Image.convert("RGB") of the file
    as decoded, nothing else (TheWorld's loaders: no EXIF rotation, alpha dropped)."""
    image_pixel_range: str = option("-1..1", choices=tuple(PIXEL_RANGES))
    """Pixel values the VAE is fed: -1..1 (x / 127.5 - 1, the range the Wan / Cosmos VAEs document) or 0..255
    (uint8 values as floats, what TheWorld's CosmosVAEEncoder feeds: to_tensor(img) * 255; use it to
    continue from a TheWorld checkpoint)."""
    image_token: str = option(IMAGE)
    """Placeholder token of an image in input_ids (one per image; the k-th is image k): <image> (LLaVA), Gemma
    3's <start_of_image>. Must be one token of the text tokenizer (see add_missing_tokens)."""
    world_tokens: tuple[str, ...] | None = None
    """TheWorld's world-token markers, e.g. [<start_of_world>, <end_of_world>]: one pair per image is put right
    after BOS in input_ids (label -100; the model puts the image's world embeddings between them); null = none."""
    add_missing_tokens: bool = False
    """Add the placeholder / marker tokens the job needs that the text tokenizer lacks, as special tokens
    (manifest.json text.added_tokens; the LM's embeddings are resized to text.vocab_size); false = a tokenizer
    that lacks one is refused before any work."""
    store_posterior: bool = False
    """Also store the VAE posterior: latents.npy = its mean (as without it: Wan's mode is the mean) plus
    latents_logvar.npy float16 (C, T, H, W), so training can sample mean + exp(0.5 * logvar) * eps. Needs an
    encoder with encode_posterior (wan; not cosmos)."""
    max_image_pixels: int = option(64_000_000, gt=0, le=1 << 30)
    """Decompression-bomb guard: images with more pixels are rejected (image_too_large)."""
    min_image_side: int = option(16, gt=0, le=16384)
    """Images whose shorter side is below this many pixels are rejected (image_too_small)."""
    samples_per_shard: int = option(256, gt=0, le=1_000_000)
    """Rows of the manifest per shard (rejected rows included)."""
    encoder_batch_size: int = option(8, gt=0, le=65536)
    """Clips or images per encoder call (not the training batch)."""
    num_workers: int | str = option("auto", choices=("auto",), ge=0, le=1024)
    """Decode worker processes (0 = decode in the main process). auto: on CUDA, sized from the first batch's
    measured decode and encoder times, at most the rank's share of the CPU cores minus one
    (precompute.pipeline.decode_workers); on CPU, 0, because the encoder's intra-op threads already use every
    core and worker processes only add contention (measured: make bench)."""
    device: str = "auto"
    """auto = cuda:LOCAL_RANK when available, else cpu; or cpu, cuda, cuda:N (mps, xpu:N...)."""
    encoder_dtype: str = option("float32", choices=tuple(ENCODER_DTYPES))
    """Compute dtype of the codec and the VAE: float32 | bfloat16 | float16 (CUDA). Anything but float32 is
    measured against float32 on the job's first rows before use (precompute.precision)."""
    precision_samples: int = option(8, ge=0, le=100_000)
    """Rows used for that measurement."""
    precision_tolerance: dict[str, float] = option(
        factory=lambda: {"latents_rel_err": 0.02, "codes_agreement": 0.95})
    """The accepted difference: latents relative L2 error, fraction of equal codes."""
    audio_tokenizer: dict | None = option(
        factory=lambda: {"name": "dac", "pretrained": "descript/dac_24khz"})
    """Codec spec {name: a codec of the registry (listed by --help; higgs is the Higgs Audio v2 tokenizer and
    needs torchaudio), pretrained: DIR or hub id, options...} or {factory:
    module:callable, kwargs}; null = no codes (an image-text job never loads a codec). Flags:
    --audio_tokenizer.name NAME, --audio_tokenizer.pretrained DIR."""
    image_encoder: dict | None = option(
        factory=lambda: {"name": "wan", "pretrained": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"})
    """VAE spec {name: a VAE of the registry (listed by --help), pretrained: DIR or hub id, ...} or a factory; null = no latents (an audio
    job never loads a VAE). Flags: --image_encoder.name NAME, --image_encoder.pretrained DIR."""
    image_features: dict | None = option(None)
    """A VLM's frozen image encoder run once here: {name: gemma3, pretrained: DIR or hub id, dtype: bfloat16}
    runs Gemma 3's processor + SigLIP vision tower + multimodal projector on each decoded image and stores
    image_features (n_images, mm_tokens_per_image, hidden) bfloat16 (as int16 bits); input_ids then hold
    Gemma's expanded image sequence exactly as Gemma3Processor builds it (image_token must be its
    <start_of_image>). null = not computed (a job that does not need them never loads the model)."""
    text_tokenizer: dict = option(factory=lambda: {"name": "bytes"})
    """Text tokenizer spec: {name: bytes} or {name: hf, pretrained: DIR or hub id} (the LM's own tokenizer)."""
    chat_template: str = option("auto", choices=CHAT_TEMPLATES)
    """How a conversation becomes input_ids/labels (precompute.chat): auto = the HF tokenizer's own
    apply_chat_template when it has a chat template, else llama3 (Higgs-Audio's Llama-3 headers with
    audio/image placeholders); tokenizer forces the tokenizer's template (error if it has none); theworld = the
    tokenizer's template given each turn as content items, its images first, then its text as one item (what
    TheWorld's collate passes to Gemma 3's processor: no newline after <end_of_image>)."""
    label_policy: str = option("answers", choices=LABEL_POLICIES)
    """Which tokens get labels: answers = the assistant turns (at or after start_index), never a placeholder,
    image or world-marker token; all_but_world = every token of input_ids (TheWorld's forward labels its whole
    input but the world embeddings, which the recipe inserts with -100)."""
    extra_waveforms: dict[str, dict] = option(factory=dict)
    """More waveform fields besides audio (all items at sample_rate): name -> {sample_rate: Hz, direction:
    in | out | all}; e.g. {audio_16k: {sample_rate: 16000, direction: in}} stores the user-side audio at
    16 kHz for a Whisper-style audio encoder."""
    extra_fields: dict[str, dict] = option(factory=dict)
    """More fields, each computed by a producer (precompute.producers): name -> {producer: NAME, **options}
    (built-in: codes, waveform, latents) or {factory: package.module:callable, kwargs: {...}} (a plug-in;
    its fields must be declared, shards.fields.register). The same spec adds the field to an existing
    cache: shardcache add-field CACHE --field NAME --producer ..."""
    manifest_format: str | None = option(None, choices=tuple(FORMATS))
    """Manifest format; null = detected from the file."""
    columns: dict[str, str] = option(factory=dict)
    """Column mapping for JSONL/CSV/Parquet rows, e.g. {audio: path} (--set columns.audio=path)."""
    allow_outside_root: bool = False
    """Read media files outside --root (default root: the manifest's folder). Off: a path that leaves it (../,
    an absolute path elsewhere, a symlink pointing out) rejects its row as malformed_row naming the field."""
    source_digest: str = option("stat", choices=SOURCE_DIGESTS)
    """What a rerun compares of each media file to tell a changed row: stat = its path, size and modification
    time; content = its path and the sha256 of its bytes (reads every media file on every rerun)."""
    keep_removed_rows: bool = False
    """Rerun: keep cached rows that are no longer in the manifest (the job says how many) instead of removing
    them (their chunk is still redone when another of its rows changed)."""
    max_text_tokens: int = option(65536, gt=0, le=100_000_000)
    """Per sample: the most input_ids tokens (the rendered conversation); a longer one is rejected as too_large
    (a 50 MB JSON line would otherwise become one 52 M-token sample that no batch can hold)."""
    max_audio_items: int = option(256, gt=0, le=1_000_000)
    """Per sample: the most audio items of a conversation; more are rejected as too_large before any decoding."""
    max_total_duration_s: float = option(3600.0, gt=0.0, le=1e7)
    """Per sample: the most seconds of audio, every item together; more is rejected as too_large (from the
    windows' durations before decoding where the row gives them, else after)."""
    max_images: int = option(64, gt=0, le=1_000_000)
    """Per sample: the most images of a conversation; more are rejected as too_large before any decoding."""

    def preprocessing(self) -> dict[str, Any]:
        """Every parameter that changes cached bytes (the cache's fingerprint): the options of
        :data:`FINGERPRINT`, the stored dtypes, the encoders' compute dtype and ``sample_layout`` (the
        conversation rendering of :mod:`precompute.chat`: label spans from the template's structure)."""
        options = self.to_dict()
        return {k: options[k] for k in FINGERPRINT} | {
            "audio_format": "pcm_s16le", "latents_dtype": "float16", "sample_layout": "conversation-2",
            "encoder_dtype": ENCODER_DTYPES[self.encoder_dtype]}

    def to_dict(self) -> dict[str, Any]:
        return S.to_dict(self)


def load_config(path: str | Path | dict | None = None, overrides: list[str] | None = None) -> PrecomputeConfig:
    """Defaults < the YAML file ``path`` (or a mapping, e.g. a cache's recorded config) < ``key=value``
    overrides (values read as YAML). Unknown options and values of the wrong type raise
    :class:`shardcache.config.ConfigError` naming them; the declared rules are checked by
    :func:`precompute.validate.validate_config`."""
    text = yaml.safe_dump(path) if isinstance(path, dict) else str(path) if path else "none"
    argv = ["--config", text] + [a for o in overrides or () for a in ("--set", o)]
    return S.parse(S.parser(PrecomputeConfig, "load_config"), PrecomputeConfig, argv, "")[0]
