"""Frozen encoders used once by ``precompute``: audio codec tokens, image VAE latents, text ids.

Public API::

    load_audio_tokenizer(cfg, device="cpu") -> AudioTokenizer      # a name of AUDIO_TOKENIZERS, or a factory
    load_image_encoder(cfg, device="cpu") -> ImageEncoder          # a name of IMAGE_ENCODERS, or a factory
    load_text_tokenizer(cfg=None) -> TextTokenizer                 # a name of TEXT_TOKENIZERS, or a factory
    fingerprint(*describe_dicts, preprocessing=dict) -> str        # sha256 hex

See ``base`` for the contracts (shapes, dtypes), ``audio`` for why batches only hold clips of equal
frame count, ``image`` for the latent normalisation conventions.
"""
from .audio import AUDIO_TOKENIZERS, DacTokenizer, EncodecTokenizer, HFCodecTokenizer, MimiTokenizer, plan_batches
from .base import AudioTokenizer, ImageEncoder, TextTokenizer, check_protocol
from .fingerprint import fingerprint, fingerprint_payload, fingerprints_match
from .image import IMAGE_ENCODERS, CosmosVAEEncoder, DiffusersVAEEncoder, WanVAEEncoder
from .registry import load_audio_tokenizer, load_factory, load_image_encoder, load_text_tokenizer
from .text import TEXT_TOKENIZERS, ByteTokenizer, HFTokenizer

__all__ = [
    "AudioTokenizer",
    "ImageEncoder",
    "TextTokenizer",
    "check_protocol",
    "HFCodecTokenizer",
    "DacTokenizer",
    "EncodecTokenizer",
    "MimiTokenizer",
    "plan_batches",
    "DiffusersVAEEncoder",
    "WanVAEEncoder",
    "CosmosVAEEncoder",
    "ByteTokenizer",
    "HFTokenizer",
    "AUDIO_TOKENIZERS",
    "IMAGE_ENCODERS",
    "TEXT_TOKENIZERS",
    "load_audio_tokenizer",
    "load_image_encoder",
    "load_text_tokenizer",
    "load_factory",
    "fingerprint",
    "fingerprint_payload",
    "fingerprints_match",
]
