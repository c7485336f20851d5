"""What an encoder declares about how it runs: its device, how it batches, whether it can submit work
and collect it later, and what else it gives (a posterior, facts about its latents).

Stage one reads these declarations and never guesses them from an encoder's attributes
(``getattr``/``hasattr``): a built-in encoder derives from :class:`Declares` and states its
:class:`Capabilities` (text tokenizers: :class:`TextCapabilities`); a plug-in that derives from
nothing of ours is taken at the protocol's word only (:mod:`precompute.encoders.base`): synchronous
``encode()``, clip by clip, no posterior, on the device it was given. Such a plug-in still runs off
the main thread (:mod:`precompute.executor`), so its calls overlap decoding and writing as the
built-ins' do.

``asynchronous`` encoders implement ``submit(...) -> Pending`` (:class:`Pending`): on CUDA the call's
kernels are queued on the encoder thread's stream, the outputs copied into pinned host memory with
one non-blocking device-to-host copy, and ``Pending.result()`` waits once (one event) per call;
on the CPU ``submit`` computes and ``result`` hands the arrays over.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .batching import BatchPolicy


@dataclass(frozen=True)
class Capabilities:
    """How a codec or an image encoder runs (see the module docstring).

    Attributes:
        device: the torch device its compute runs on (``cpu``, ``cuda:0``...); CUDA devices get a
            stream of their own on the encoder thread and events for timing.
        batching: how inputs are grouped into calls (:class:`precompute.encoders.batching.BatchPolicy`);
            the default is one clip per call, whose codes depend on the clip alone.
        asynchronous: it implements ``submit(...) -> Pending`` (see the module docstring); else
            only the protocol's synchronous ``encode()``.
        posterior: None when ``encode_posterior(images)`` is supported (``store_posterior: true``),
            else why not (the message stage one shows before anything is written).
        latents: what ``manifest.json`` records about its latents beyond ``describe()``
            (``input_range``, ``dtype``, ``normalized``, ``latents_mean``/``latents_std``), or None.
    """

    device: str = "cpu"
    batching: BatchPolicy = field(default_factory=BatchPolicy)
    asynchronous: bool = False
    posterior: str | None = ("a plug-in image encoder declares a posterior by deriving from "
                             "precompute.encoders.capabilities.Declares (Capabilities.posterior None)")
    latents: Mapping[str, Any] | None = None

    @property
    def cuda(self) -> bool:
        """Whether its compute runs on a CUDA device (streams, events, pinned copies)."""
        return str(self.device).startswith("cuda")


@dataclass(frozen=True)
class TextCapabilities:
    """What a text tokenizer gives besides the :class:`~precompute.encoders.base.TextTokenizer` protocol.

    Attributes:
        adds_tokens: ``add_tokens(list[str]) -> int`` adds special tokens (``add_missing_tokens``).
        chat_template: its own Jinja chat template, or None (``chat_template: auto`` then renders llama3).
        bos_id: the id of its beginning-of-sequence token, or None (TheWorld's world tokens go after it).
    """

    adds_tokens: bool = False
    chat_template: str | None = None
    bos_id: int | None = None


class Declares(ABC):
    """Base class of an encoder that declares its capabilities (every built-in one; a plug-in may
    derive from it too). ``capabilities`` is a :class:`Capabilities` (codecs, image encoders) or a
    :class:`TextCapabilities` (text tokenizers)."""

    @property
    @abstractmethod
    def capabilities(self) -> Capabilities | TextCapabilities:
        """What this encoder declares (see the module docstring)."""

    def start(self) -> None:
        """Start what the encoder runs beside this process (a codec's processes), once, before its first call:
        the job calls it when it builds (:meth:`precompute.job.Job.build`). Nothing by default."""

    def close(self) -> None:
        """Release the processes and memory it holds beyond itself (a codec's processes); it may not be used
        afterwards, except a codec with ``processes > 1``, which starts them again on its next call. Default:
        nothing to release."""


def capabilities_of(encoder: Any, device: str = "cpu") -> Capabilities:
    """The :class:`Capabilities` ``encoder`` declares; for a plug-in that declares nothing, the protocol's
    defaults on ``device`` (the device it was built for)."""
    if isinstance(encoder, Declares):
        return encoder.capabilities
    return Capabilities(device=str(device))


def text_capabilities_of(tokenizer: Any) -> TextCapabilities:
    """The :class:`TextCapabilities` ``tokenizer`` declares; for a plug-in that declares nothing: no
    ``add_tokens``, no chat template, no BOS."""
    if isinstance(tokenizer, Declares):
        return tokenizer.capabilities
    return TextCapabilities()


class Pending:
    """Work submitted to an encoder: ``result()`` waits for it (once) and returns its outputs.

    ``wait``: None (already done) or a callable that blocks until the device is done (a CUDA event's
    ``synchronize``); ``finish``: turns what was computed into the outputs (host arrays). Exceptions
    raised by either propagate from ``result()``."""

    def __init__(self, finish: Callable[[], Any], wait: Callable[[], None] | None = None):
        self._finish, self._wait = finish, wait
        self._done = False
        self._value: Any = None

    def result(self) -> Any:
        if not self._done:
            if self._wait is not None:
                self._wait()
            self._value, self._done = self._finish(), True
            self._finish = self._wait = None
        return self._value

    @classmethod
    def done(cls, value: Any) -> "Pending":
        """Work already done (a synchronous encoder, or the CPU)."""
        return cls(lambda: value)


__all__ = ["Capabilities", "TextCapabilities", "Declares", "capabilities_of", "text_capabilities_of", "Pending"]
