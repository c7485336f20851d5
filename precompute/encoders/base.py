"""The three encoder contracts used by ``precompute`` and a checker for plug-ins.

Every encoder is *frozen*: it is built once, run under ``torch.inference_mode()`` and described by
``describe()``, a JSON-able dict whose canonical hash (:func:`precompute.encoders.fingerprint`)
identifies the cache it writes. ``describe()`` always has the keys

- ``class``: the dotted ``module.QualName`` of the wrapper,
- ``name``: the registry name (``dac``, ``wan``, ``bytes``...) or a plug-in's own name,
- ``config``: the model's config as a JSON-able dict (paths and library versions removed),
- ``weights_sha256``: sha256 of the ``state_dict`` tensors in sorted key order (text tokenizers give
  ``vocab_sha256`` instead, a hash of their vocabulary and special tokens).

The classes below are ``typing.Protocol``s: implementations do not need to inherit from them.
:func:`check_protocol` verifies a plug-in object at load time.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class AudioTokenizer(Protocol):
    """Waveform -> discrete codec tokens (a residual-VQ codec such as DAC, EnCodec or Mimi).

    Attributes:
        sample_rate: rate in Hz that ``encode`` expects its input at (no resampling happens inside).
        n_codebooks: number of residual codebooks (rows of each output array).
        codebook_size: number of entries per codebook; every code is in ``[0, codebook_size)``.
        frame_rate: output frames per second, ``sample_rate / hop_length`` (float; 25.0 for DAC-24k).
        hop_length: input samples per output frame.
    """

    sample_rate: int
    n_codebooks: int
    codebook_size: int
    frame_rate: float
    hop_length: int

    def encode(self, waveforms: list[np.ndarray]) -> list[np.ndarray]:
        """Encode mono clips.

        Args:
            waveforms: float32 arrays of shape ``(num_samples,)`` with values in [-1, 1], at
                ``sample_rate`` Hz. Lengths may differ.

        Returns:
            One int16 array of shape ``(n_codebooks, ceil(num_samples / hop_length))`` per input, in
            input order (a codec that gives another count declares its rule: :class:`FrameRule`), every
            code in ``[0, codebook_size)``; any integer dtype holding those values is taken. The result for
            a clip must not depend on the other clips in the call. Stage one checks each clip's codes
            against all of this (:func:`codes_problem`) and rejects the clip's row, naming the field and
            the value, when they break it.

        Raises:
            ValueError: an input is not 1-D, not floating point, not finite, or clearly not in [-1, 1].
        """
        ...

    def describe(self) -> dict:
        """JSON-able dict with ``class``, ``name``, ``config``, ``weights_sha256`` (see module doc)."""
        ...


class FrameRule(ABC):
    """Derived from by a codec whose codes per clip have a frame count other than the protocol's
    ``ceil(num_samples / hop_length)`` (the Higgs Audio v2 tokenizer: its model's own length arithmetic):
    :meth:`frames` is the count, the one stage one checks each clip's codes against (:func:`expected_frames`).
    The built-in codecs derive from it (:class:`precompute.encoders.audio.HFCodecTokenizer`: DAC, EnCodec
    and Mimi pad each clip to a multiple of the hop, so ``ceil``; Higgs: its model's count)."""

    @abstractmethod
    def frames(self, n: int) -> int:
        """Code frames of a clip of ``n`` samples at ``sample_rate``."""


def expected_frames(codec: Any, n: int) -> tuple[int, str]:
    """``(frames, the rule in words)`` the codes of a clip of ``n`` samples must have: the codec's declared
    :meth:`FrameRule.frames`, else the protocol's ``ceil(n / hop_length)``."""
    if isinstance(codec, FrameRule):
        return int(codec.frames(int(n))), f"{type(codec).__name__}.frames({int(n)})"
    hop = int(codec.hop_length)
    return -(-int(n) // hop), f"ceil({int(n)} samples / hop_length {hop})"


def codes_problem(codes: Any, codec: Any, n: int) -> str | None:
    """Why ``codes`` (one clip's, as a codec returned them) break :meth:`AudioTokenizer.encode`'s declaration
    for a clip of ``n`` samples, naming the value (None: they keep it): not an integer array, not
    ``n_codebooks x`` :func:`expected_frames` ``(codec, n)``, a code outside ``[0, codebook_size)``. Checked in
    this order, so a NaN in float codes is named as such before any comparison."""
    try:
        a = np.asarray(codes)
    except (ValueError, TypeError) as e:  # a ragged list
        return f"codes that are not one array ({type(e).__name__}: {e})"
    q, size = int(codec.n_codebooks), int(codec.codebook_size)
    seconds = f"{int(n) / float(codec.sample_rate):.3f} s"
    if a.dtype.kind not in "iu":
        bad = ""
        if a.dtype.kind == "f" and a.size:
            odd = a[~np.isfinite(a)] if not np.isfinite(a).all() else a[a != np.round(a)]
            bad = f" (e.g. {odd.flat[0].item()!r})" if odd.size else ""
        return f"{a.dtype} codes{bad}, expected integer codes in [0, {size})"
    frames, rule = expected_frames(codec, n)
    if a.shape != (q, frames):
        return (f"codes of shape {tuple(a.shape)} for a clip of {int(n)} samples ({seconds}), expected "
                f"({q}, {frames}): n_codebooks x {rule}")
    if a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= size:
            return f"code {lo if lo < 0 else hi} outside [0, {size}) (codebook_size)"
    return None


@runtime_checkable
class ImageEncoder(Protocol):
    """RGB images -> continuous VAE latents (Cosmos / Wan VAEs), one latent frame per image.

    Attributes:
        spatial_factor: pixels per latent cell along H and W (8 for the Cosmos/Wan 2.1 VAEs).
        latent_channels: channels C of the latent (16 for the Cosmos/Wan 2.1 VAEs).

    Optional (needed only by ``store_posterior: true``): ``encode_posterior(images) -> (mean, logvar)``,
    two float32 arrays shaped like ``encode``'s output, ``mean`` equal to it, ``logvar`` the natural
    log of the posterior variance; and ``posterior_unsupported``: None, or a string saying why not.
    """

    spatial_factor: int
    latent_channels: int

    def encode(self, images: np.ndarray) -> np.ndarray:
        """Encode a batch of same-sized images.

        Args:
            images: uint8 array ``(B, H, W, 3)``, RGB, H and W multiples of ``spatial_factor``.

        Returns:
            float32 array ``(B, latent_channels, 1, H // spatial_factor, W // spatial_factor)``.

        Raises:
            ValueError: wrong dtype, rank, channel count, or H/W not divisible by ``spatial_factor``.
        """
        ...

    def describe(self) -> dict:
        """As :meth:`AudioTokenizer.describe`, plus ``latents_mean``/``latents_std`` when the config has them."""
        ...


@runtime_checkable
class TextTokenizer(Protocol):
    """Text -> token ids.

    Attributes:
        vocab_size: number of distinct ids; every id is in ``[0, vocab_size)``.
        pad_id: id to pad batches with.
    """

    vocab_size: int
    pad_id: int

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` as int32 ``(n_tokens,)``, special tokens included as the tokenizer defines."""
        ...

    def describe(self) -> dict:
        """JSON-able dict with ``class``, ``name``, ``config`` and ``vocab_sha256``."""
        ...


_REQUIRED: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # (integer-like attributes, callables)
    AudioTokenizer: (("sample_rate", "n_codebooks", "codebook_size", "hop_length"), ("encode", "describe")),
    ImageEncoder: (("spatial_factor", "latent_channels"), ("encode", "describe")),
    TextTokenizer: (("vocab_size", "pad_id"), ("encode", "describe")),
}


def check_protocol(obj: Any, protocol: type, what: str = "encoder") -> Any:
    """Return ``obj`` if it satisfies ``protocol`` (one of the three above), else raise ``TypeError``.

    Checks that the integer attributes exist and are positive ints (``pad_id`` may be 0), that
    ``frame_rate`` (audio) is a positive number, that ``encode``/``describe`` are callable and that
    ``describe()`` returns a dict with the keys ``class``, ``name`` and ``config``. The message lists
    everything that is missing, not just the first problem.
    """
    if protocol not in _REQUIRED:
        raise ValueError(f"unknown protocol {protocol!r}")
    int_attrs, methods = _REQUIRED[protocol]
    problems: list[str] = []
    for name in int_attrs:
        if not hasattr(obj, name):
            problems.append(f"missing attribute {name!r}")
            continue
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            problems.append(f"attribute {name!r} must be an int, got {type(value).__name__}")
        elif value < (0 if name == "pad_id" else 1):
            problems.append(f"attribute {name!r} must be {'>= 0' if name == 'pad_id' else '> 0'}, got {value}")
    if protocol is AudioTokenizer:
        fr = getattr(obj, "frame_rate", None)
        if isinstance(fr, bool) or not isinstance(fr, (int, float, np.number)) or not fr > 0:
            problems.append(f"attribute 'frame_rate' must be a positive number, got {fr!r}")
    for name in methods:
        if not callable(getattr(obj, name, None)):
            problems.append(f"missing method {name}()")
    if not problems:
        desc = obj.describe()
        if not isinstance(desc, dict):
            problems.append(f"describe() must return a dict, got {type(desc).__name__}")
        else:
            missing = [k for k in ("class", "name", "config") if k not in desc]
            if missing:
                problems.append(f"describe() lacks keys {missing}")
    if problems:
        raise TypeError(
            f"{what} of type {type(obj).__module__}.{type(obj).__qualname__} does not satisfy "
            f"{protocol.__name__}: " + "; ".join(problems)
        )
    return obj
