"""Null encoders: the real encoders' output shapes and dtypes, no compute (zeros).

They measure stage one's own ceiling (decode, resample, tokenize, value checks, tar write,
checksums, index) with the encoders taking no time (``make bench``, :mod:`benchmarks.bench_ceiling`).
They are plug-ins registered the normal way, by a ``{factory, kwargs}`` spec in the precompute
config (:func:`precompute.encoders.load_audio_tokenizer`, :func:`precompute.producers.load_producer`)::

    audio_tokenizer: {factory: benchmarks.null_encoders:codec}
    image_encoder: {factory: benchmarks.null_encoders:vae}
    extra_fields: {image_features: {factory: benchmarks.null_encoders:image_features}}

Defaults are the real models' shapes: the Higgs Audio v2 tokenizer (24 kHz in, hop 960 = 25
frames/s, 8 codebooks of 1024), the Wan 2.1 VAE (8 px per latent cell, 16 channels) and Gemma 3
4B's SigLIP + projector (256 tokens per image of hidden size 2560, bfloat16 bits as int16).
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from precompute.producers.image_features import ImageFeaturesProducer


class NullCodec:
    """:class:`precompute.encoders.AudioTokenizer` whose codes are zeros: int16
    ``(n_codebooks, ceil(n / hop_length))`` per clip of ``n`` samples at ``sample_rate`` Hz."""

    def __init__(self, sample_rate: int = 24000, hop_length: int = 960, n_codebooks: int = 8,
                 codebook_size: int = 1024):
        self.sample_rate, self.hop_length = int(sample_rate), int(hop_length)
        self.n_codebooks, self.codebook_size = int(n_codebooks), int(codebook_size)
        self.frame_rate = self.sample_rate / self.hop_length

    def encode(self, waveforms: list[np.ndarray]) -> list[np.ndarray]:
        """One int16 ``(n_codebooks, ceil(len / hop_length))`` array of zeros per float32 ``(len,)`` clip."""
        return [np.zeros((self.n_codebooks, -(-len(w) // self.hop_length)), np.int16) for w in waveforms]

    def describe(self) -> dict:
        return {"class": f"{__name__}.NullCodec", "name": "null-codec", "weights_sha256": "none",
                "config": {"sample_rate": self.sample_rate, "hop_length": self.hop_length,
                           "n_codebooks": self.n_codebooks, "codebook_size": self.codebook_size}}


class SleepingCodec(NullCodec):
    """A stand-in for a GPU codec: :class:`NullCodec`'s codes after waiting ``seconds_per_clip`` per clip
    in ``time.sleep``, which releases the GIL as a CUDA call and its synchronisation do. A plug-in with
    only a synchronous ``encode()`` (it declares nothing), so it also shows that such an encoder
    overlaps the rest of the job (``make bench``'s overlap section, :mod:`benchmarks.bench_overlap`)."""

    def __init__(self, seconds_per_clip: float = 0.05, gil_seconds_per_clip: float = 0.0, **kwargs: Any):
        super().__init__(**kwargs)
        self.seconds_per_clip = float(seconds_per_clip)
        self.gil_seconds_per_clip = float(gil_seconds_per_clip)

    def encode(self, waveforms: list[np.ndarray]) -> list[np.ndarray]:
        """Per clip: ``gil_seconds_per_clip`` of Python holding the GIL (as kernel launches do), then
        ``seconds_per_clip`` in ``time.sleep`` (the device's work)."""
        for _ in waveforms:
            if self.gil_seconds_per_clip:
                end = time.perf_counter() + self.gil_seconds_per_clip
                while time.perf_counter() < end:
                    pass
            time.sleep(self.seconds_per_clip)
        return super().encode(waveforms)

    def describe(self) -> dict:
        return super().describe() | {"class": f"{__name__}.SleepingCodec", "name": "sleeping-codec"}


class NullVAE:
    """:class:`precompute.encoders.ImageEncoder` whose latents are zeros: float32
    ``(B, latent_channels, 1, H / spatial_factor, W / spatial_factor)`` for uint8 ``(B, H, W, 3)``."""

    def __init__(self, spatial_factor: int = 8, latent_channels: int = 16):
        self.spatial_factor, self.latent_channels = int(spatial_factor), int(latent_channels)

    def encode(self, images: np.ndarray) -> np.ndarray:
        b, h, w, _ = images.shape
        f = self.spatial_factor
        return np.zeros((b, self.latent_channels, 1, h // f, w // f), np.float32)

    def describe(self) -> dict:
        return {"class": f"{__name__}.NullVAE", "name": "null-vae", "weights_sha256": "none",
                "config": {"spatial_factor": self.spatial_factor, "latent_channels": self.latent_channels}}


class SquareResize:
    """uint8 ``(H, W, 3)`` -> uint8 ``(3, size, size)``: Pillow's bilinear resize, the step Gemma 3's image
    processor runs first (its PIL backend's; in the decode workers at stage one). Picklable."""

    def __init__(self, size: int = 896):
        self.size = int(size)

    def __call__(self, image: np.ndarray) -> np.ndarray:
        from PIL import Image
        out = Image.fromarray(np.asarray(image, dtype=np.uint8)).resize((self.size, self.size), Image.BILINEAR)
        return np.ascontiguousarray(np.asarray(out).transpose(2, 0, 1))


class NullVision:
    """The encoder of an ``image_features`` producer (see
    :class:`precompute.producers.image_features.Gemma3VisionEncoder`'s attributes) whose features
    are zeros: int16 ``(tokens_per_image, hidden_size)`` (bfloat16 bits) per image. Its image
    sequence is Gemma 3's: ``\\n\\n<start_of_image>`` + ``tokens_per_image`` soft tokens +
    ``<end_of_image>\\n\\n``. Its ``image_input`` is Gemma 3's resize to ``image_size`` px
    (:class:`SquareResize`, run in the decode workers as the real encoder's is); the normalisation,
    on the device for the real encoder, is not run."""

    def __init__(self, tokens_per_image: int = 256, hidden_size: int = 2560, boi_token: str = "<start_of_image>",
                 image_token: str = "<image_soft_token>", eoi_token: str = "<end_of_image>", image_size: int = 896):
        self.tokens_per_image, self.hidden_size = int(tokens_per_image), int(hidden_size)
        self.boi_token, self.image_token, self.eoi_token = boi_token, image_token, eoi_token
        self.image_sequence = f"\n\n{boi_token}{image_token * self.tokens_per_image}{eoi_token}\n\n"
        self.image_input = SquareResize(image_size)

    def encode(self, images: list[np.ndarray]) -> list[np.ndarray]:
        return self.submit([self.image_input(a) for a in images]).result()

    def submit(self, resized: list[np.ndarray]):
        from precompute.encoders.capabilities import Pending
        return Pending.done([np.zeros((self.tokens_per_image, self.hidden_size), np.int16) for _ in resized])

    def describe(self) -> dict:
        return {"class": f"{__name__}.NullVision", "name": "null-vision", "weights_sha256": "none",
                "config": {"tokens_per_image": self.tokens_per_image, "hidden_size": self.hidden_size},
                "image_sequence": self.image_sequence}


def codec(device: str = "cpu", **kwargs: Any) -> NullCodec:
    """Factory of ``audio_tokenizer: {factory: benchmarks.null_encoders:codec, kwargs: {...}}``."""
    return NullCodec(**kwargs)


def sleeping_codec(device: str = "cpu", **kwargs: Any) -> SleepingCodec:
    """Factory of ``audio_tokenizer: {factory: benchmarks.null_encoders:sleeping_codec, kwargs: {seconds_per_clip: 0.05}}``."""
    return SleepingCodec(**kwargs)


def vae(device: str = "cpu", **kwargs: Any) -> NullVAE:
    """Factory of ``image_encoder: {factory: benchmarks.null_encoders:vae, kwargs: {...}}``."""
    return NullVAE(**kwargs)


def image_features(field: str = "image_features", device: str = "cpu", image_rgb: str = "convert",
                   **kwargs: Any) -> ImageFeaturesProducer:
    """Factory of ``extra_fields: {image_features: {factory: benchmarks.null_encoders:image_features}}``."""
    return ImageFeaturesProducer(NullVision(**kwargs), field, image_rgb)
