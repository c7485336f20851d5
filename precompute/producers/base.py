"""What a stage-one producer is: the code that computes one group of fields of a sample.

A producer is built once per job (its encoder loaded on the job's device), then called on encoder
batches of samples. The same producer runs inside ``shardcache precompute`` (on samples decoded from
the manifest's source files, :class:`precompute.prepare.Prepared`) and inside ``shardcache
add-field`` (on samples read back from a cache, :class:`precompute.producers.cached.CachedSample`),
so a field added later is computed exactly as stage one would have computed it.

A sample, as a producer sees it (both classes above provide these attributes):

* ``key`` (str) and ``conversation`` (:class:`precompute.conversation.Conversation`: ``audio`` items
  with ``direction`` ``in``/``out``, ``turn`` and ``speaker``; ``images``);
* ``audio``: one ``{rate Hz: float32 (n,) in [-1, 1]}`` per audio item, holding every rate of
  :meth:`Producer.rates` (and the job's other rates);
* ``images``: one uint8 ``(H, W, 3)`` array per image item (preprocessed by the job's policy);
* ``input_ids`` / ``labels``: int32 ``(L,)``.

``produce`` returns, per sample, a dict ``{field: array}`` with exactly the fields of
:attr:`Producer.outputs` that the sample has (a sample without audio has no codes), or the
exception that made this sample fail (it is rejected ``encode_failed``; the others go on). Values
may be in any dtype the field's storage dtype holds exactly; the writer checks them with the
field's kind (:meth:`shards.kinds.FieldKind.value_check`) and casts them.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence


class Timer:
    """Adds the duration of encoder calls to ``seconds`` (device-synchronised on CUDA), for the
    job's ``encoder_busy`` figure."""

    def __init__(self, device: str = "cpu"):
        self.device = str(device)
        self.seconds = 0.0

    def __call__(self, fn: Callable, *args: Any) -> Any:
        t = time.perf_counter()
        out = fn(*args)
        if self.device.startswith("cuda"):
            import torch
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t
        return out


def encode_each(fn: Callable[[list], Sequence], inputs: list, timer: Timer) -> list:
    """``fn`` on the whole batch; if the batch fails, on one input at a time, so a bad input costs
    only itself: returns one output or one exception per input, in order."""
    if not inputs:
        return []
    try:
        return list(timer(fn, inputs))
    except Exception:
        outs: list = []
        for x in inputs:
            try:
                outs.append(timer(fn, [x])[0])
            except Exception as e:  # noqa: BLE001 - travels with its sample to the rejects
                outs.append(e)
        return outs


class Producer:
    """Base class (see the module docstring). Subclasses set :attr:`outputs` and implement :meth:`produce`.

    Attributes:
        name: the producer's registry name (``codes``, ``waveform``, ``latents``, ``text`` or a plug-in's).
        outputs: the field names it writes (declared in :mod:`shards.fields`).
        needs_images: whether it reads ``sample.images``.
    """

    name = "producer"
    outputs: tuple[str, ...] = ()
    needs_images = False

    def rates(self) -> set[int]:
        """Audio rates (Hz) it reads from ``sample.audio``."""
        return set()

    def describe(self) -> dict[str, Any]:
        """JSON-able description of everything that changes its output (encoder weights, options);
        part of the cache's fingerprint."""
        return {"producer": self.name, "outputs": list(self.outputs)}

    def manifest_info(self) -> dict[str, Any]:
        """What ``manifest.json`` records about its outputs (e.g. ``n_codebooks``, ``codebook_size``,
        ``frame_rate`` of a codec; ``latent_channels`` of a VAE)."""
        return {}

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        raise NotImplementedError


__all__ = ["Producer", "Timer", "encode_each"]
