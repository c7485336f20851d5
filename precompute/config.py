"""Stage-one configuration: one dataclass with documented defaults, loadable from YAML.

Precedence: dataclass defaults < ``--config FILE`` (YAML) < command-line flags / ``--set a.b=v``.
Everything that changes the bytes of a cached tensor is part of :meth:`PrecomputeConfig.preprocessing`
and therefore of the cache's fingerprint.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class PrecomputeConfig:
    """Defaults of ``python -m precompute`` (see ``configs/precompute.yaml``)."""

    #: Hz of the stored waveform (``audio.npy``). The codec gets its own rate
    #: (``tokenizer.sample_rate``); both are resampled from the one decoded array.
    sample_rate: int = 24000
    #: seconds; shorter clips are rejected (``too_short``), longer ones (``too_long``).
    min_duration: float = 0.05
    max_duration: float = 30.0
    #: reject clips whose RMS (full scale 1.0) is below this; None disables the check.
    silence_rms: float | None = None
    #: pixels of the square VAE input (multiple of the VAE's spatial factor, 8).
    image_size: int = 256
    #: center_crop | pad | bucket (see precompute.images).
    image_resize: str = "center_crop"
    #: also store the VAE posterior: ``latents.npy`` = its mean (as without it: Wan's mode is the
    #: mean) plus ``latents_logvar.npy`` float16 (C, T, H, W), so training can sample
    #: ``mean + exp(0.5 * logvar) * eps``. Needs an encoder with ``encode_posterior`` (wan; not cosmos).
    store_posterior: bool = False
    #: decompression-bomb guard: images with more pixels are rejected (``image_too_large``).
    max_image_pixels: int = 64_000_000
    #: images whose shorter side is below this many pixels are rejected (``image_too_small``).
    min_image_side: int = 16
    #: rows of the manifest per shard (rejected rows included).
    samples_per_shard: int = 256
    #: samples per encoder call.
    batch_size: int = 8
    #: decode worker processes (0 = decode in the main process). "auto": on CUDA, the rank's share
    #: of the CPU cores minus one (at most 8); on CPU, 0, because the encoder's intra-op threads
    #: already use every core and worker processes only add contention (measured: make bench).
    num_workers: int | str = "auto"
    #: "auto" = cuda:LOCAL_RANK when available, else cpu.
    device: str = "auto"
    #: compute dtype of the codec and the VAE: float32 | bfloat16 | float16 (CUDA). Anything but
    #: float32 is measured against float32 on the job's first rows before use (precompute.precision).
    encoder_dtype: str = "float32"
    #: rows used for that measurement, and the accepted difference.
    precision_samples: int = 8
    precision_tolerance: dict[str, float] = field(
        default_factory=lambda: {"latents_rel_err": 0.02, "codes_agreement": 0.95})
    #: encoder specs, see precompute.encoders.registry. ``audio_tokenizer: null`` (no codes: an
    #: image-text job never loads a codec) and ``image_encoder: null`` (no latents: an audio job
    #: never loads a VAE) are valid.
    audio_tokenizer: dict[str, Any] | None = field(default_factory=lambda: {"name": "dac", "pretrained": "models/dac-tiny"})
    image_encoder: dict[str, Any] | None = field(default_factory=lambda: {"name": "wan", "pretrained": "models/wan-tiny"})
    text_tokenizer: dict[str, Any] = field(default_factory=lambda: {"name": "bytes"})
    #: how a conversation becomes ``input_ids``/``labels`` (precompute.chat): ``auto`` = the HF
    #: tokenizer's own ``apply_chat_template`` when it has a chat template, else ``llama3``
    #: (Higgs-Audio's Llama-3 headers with audio/image placeholders); ``tokenizer`` forces the
    #: tokenizer's template (error if it has none).
    chat_template: str = "auto"
    #: more waveform fields besides ``audio`` (all items at ``sample_rate``): name ->
    #: ``{sample_rate: Hz, direction: in | out | all}``; e.g. ``{audio_16k: {sample_rate: 16000,
    #: direction: in}}`` stores the user-side audio at 16 kHz for a Whisper-style audio encoder.
    extra_waveforms: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: manifest options: format (auto when None) and column mapping for jsonl/csv/parquet.
    manifest_format: str | None = None
    columns: dict[str, str] = field(default_factory=dict)

    def preprocessing(self) -> dict[str, Any]:
        """Every parameter that changes cached bytes (part of the fingerprint).

        ``store_posterior`` is listed only when true, so caches made before it existed (all without
        a posterior) keep their fingerprint; True and False still give different fingerprints.
        """
        keys = ("sample_rate", "image_size", "image_resize")
        out = {k: getattr(self, k) for k in keys} | {"audio_format": "pcm_s16le", "latents_dtype": "float16"}
        if self.store_posterior:
            out["store_posterior"] = True
        out["sample_layout"] = "conversation-1"  # precompute.conversation + precompute.chat
        out["chat_template"] = self.chat_template
        if self.extra_waveforms:
            out["extra_waveforms"] = self.extra_waveforms
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _coerce(value: str) -> Any:
    return yaml.safe_load(value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PrecomputeConfig:
    """Build the config from defaults, a YAML file and ``a.b=value`` overrides (YAML-parsed values).

    Raises ``ValueError`` naming the unknown key (and the file) for a misspelt option.
    """
    cfg = PrecomputeConfig()
    names = {f.name for f in dataclasses.fields(cfg)}
    data: dict[str, Any] = {}
    if path:
        data = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{path}: unknown option(s) {sorted(unknown)}; known: {sorted(names)}")
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        dotted, value = item.split("=", 1)
        top, *rest = dotted.split(".")
        if top not in names:
            raise ValueError(f"--set {dotted}: unknown option {top!r}; known: {sorted(names)}")
        if rest:
            node = data.setdefault(top, dict(getattr(cfg, top)))
            for part in rest[:-1]:
                node = node.setdefault(part, {})
            node[rest[-1]] = _coerce(value)
        else:
            data[top] = _coerce(value)
    return dataclasses.replace(cfg, **data)
