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
* ``model_images``: one array per image item as the job's :attr:`Producer.image_input` made it in the
  decode workers (empty when no producer declares one, and in ``add-field``: the producer makes them);
* ``calls``: ``{field: [[size, length, place] or None per audio item]}``, the codec calls recorded in
  a cached sample's json (``shardcache check`` rebuilds them; empty at stage one);
* ``input_ids`` / ``labels``: int32 ``(L,)``.

``produce`` returns, per sample, a dict ``{field: array}`` with exactly the fields of
:attr:`Producer.outputs` that the sample has (a sample without audio has no codes), or the
exception that made this sample fail (it is rejected ``encode_failed``; the others go on). Values
may be in any dtype the field's storage dtype holds exactly; the writer checks them with the
field's kind (:meth:`shards.kinds.FieldKind.value_check`) and casts them. A result may also hold
:data:`JSON`: entries merged into the sample's ``json`` member (e.g. the codec calls of a batched
codec, ``codes_calls``).

How it runs is declared, not guessed: :attr:`Producer.host_only` producers (no encoder: text,
waveforms, segments) run on the main thread while the others run on the encoder thread
(:mod:`precompute.executor`); those may implement :meth:`Producer.submit` (queue the encoder work,
collect it later: one wait per batch on a GPU), else :meth:`Producer.produce` runs there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

from ..effects import Effect
from ..encoders.capabilities import Pending
from ..faults import reraise_infrastructure

#: the key of a producer's result whose entries go into the sample's json member
JSON = "json"


@dataclass(frozen=True)
class ImageTokens:
    """The text an image placeholder becomes when a producer's features stand at the image's tokens
    (Gemma 3: ``Gemma3Processor.full_image_sequence``): ``placeholder`` (``<start_of_image>``, must be the
    config's ``image_token``), ``sequence`` (the expanded text), ``inner`` (its other tokens, never trained)."""

    placeholder: str
    sequence: str
    inner: tuple[str, ...] = ()


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


def _outputs(got: Any, n: int) -> list:
    """``got`` (what an encoder returned for ``n`` inputs) as a list of ``n``; ``ValueError`` naming the count
    when it is not one output per input (a plug-in's: zipped with its inputs, a short list would drop rows)."""
    out = list(got)
    if len(out) != n:
        raise ValueError(f"the encoder returned {len(out)} output(s) for {n} input(s), not one per input")
    return out


def encode_each(fn: Callable[[list], Sequence], inputs: list, timer: Timer) -> list:
    """``fn`` on the whole batch; if the batch fails, on one input at a time, so a bad input costs
    only itself: returns one output or one exception per input, in order. An infrastructure fault
    (:func:`precompute.faults.infrastructure`: a device error, out of memory) is never an input's: it
    is raised (a batch that failed with one is still tried one input at a time first)."""
    if not inputs:
        return []
    try:
        return _outputs(timer(fn, inputs), len(inputs))
    except Exception as e:  # noqa: BLE001 - each input alone
        if len(inputs) == 1:
            reraise_infrastructure(e)
        outs: list = []
        for x in inputs:
            try:
                outs.append(_outputs(timer(fn, [x]), 1)[0])
            except Exception as e:  # noqa: BLE001 - travels with its sample to the rejects (a row fault)
                reraise_infrastructure(e)
                outs.append(e)
        return outs


def submit_each(submit: Callable[[list], Pending], inputs: list) -> Pending:
    """:func:`encode_each` for an asynchronous encoder: ``submit`` (``list -> Pending`` of one output per
    input) on the whole batch; if queueing or collecting it fails, each input alone, so a bad input
    costs only itself. ``result()``: one output or one exception per input, in order; an
    infrastructure fault is raised, as by :func:`encode_each`."""
    if not inputs:
        return Pending.done([])

    def alone() -> list:
        outs: list = []
        for x in inputs:
            try:
                outs.append(_outputs(submit([x]).result(), 1)[0])
            except Exception as e:  # noqa: BLE001 - travels with its sample to the rejects (a row fault)
                reraise_infrastructure(e)
                outs.append(e)
        return outs

    try:
        whole = submit(inputs)
    except Exception as e:  # noqa: BLE001
        if len(inputs) == 1:
            reraise_infrastructure(e)
        return Pending(alone)

    def finish() -> list:
        try:
            return _outputs(whole.result(), len(inputs))
        except Exception as e:  # noqa: BLE001
            if len(inputs) == 1:
                reraise_infrastructure(e)
            return alone()

    return Pending(finish)


class Producer:
    """Base class (see the module docstring). Subclasses set :attr:`outputs` and implement :meth:`produce`.

    Attributes:
        name: the producer's registry name (``codes``, ``waveform``, ``latents``, ``text`` or a plug-in's).
        outputs: the field names it writes (declared in :mod:`shards.fields`).
        needs_images: whether it reads ``sample.images``.
        host_only: it runs no encoder (runs on the main thread); False: on the encoder thread.
        directions: the audio items (by direction, ``in``/``out``) whose audio it reads at :meth:`rates`:
            the decode workers resample and ship only those.
        image_tokens: the text its features need at each image placeholder (:class:`ImageTokens`), or None.
        image_input: a picklable callable ``uint8 (H, W, 3) -> array`` the decode workers run on each
            decoded image for it (``sample.model_images``: Gemma 3's resize), or None.
    """

    name = "producer"
    #: the keys of the spec that names it (``extra_fields: {NAME: {producer: name, ...}}``, ``add-field
    #: --producer``) and what changing each does to a cache (:class:`precompute.effects.Effect`, walked by
    #: :mod:`precompute.identity`): ``SPEC``, an encoder spec whose keys its class declares; ``"*"``: the
    #: other keys are an encoder spec of the producer's own name. Empty: no spec names it (the job's own
    #: text and segments). With :meth:`spec_problems` and :meth:`from_spec`, all a spec needs of it.
    OPTION_EFFECTS: ClassVar[Mapping[str, Effect]] = {}
    outputs: tuple[str, ...] = ()
    needs_images = False
    host_only = False
    directions: frozenset[str] | set[str] = frozenset({"in", "out"})
    image_tokens: ImageTokens | None = None
    image_input: Callable[[Any], Any] | None = None

    @classmethod
    def spec_problems(cls, field: str, **spec: Any) -> list[tuple[str, str]]:
        """What keeps ``spec`` (its keys, ``producer`` included) from making ``field``, as ``(key suffix,
        message)``: the config check lists them before any encoder loads, :meth:`from_spec` raises the first
        (:func:`precompute.producers.load_producer`). None by default."""
        return []

    @classmethod
    def from_spec(cls, field: str, device: str = "cpu", **options: Any) -> "Producer":
        """The producer of a spec's ``options`` (its keys but ``producer``) writing ``field``, its encoder on
        ``device``."""
        raise NotImplementedError(f"{cls.__name__} is not made from a spec")

    def rates(self) -> set[int]:
        """Audio rates (Hz) it reads from ``sample.audio`` (of the items of :attr:`directions`)."""
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

    def submit(self, samples: list, timer: Timer) -> Pending:
        """Queue the work of :meth:`produce` and return it as a :class:`Pending` (``result()``: what
        :meth:`produce` returns). This default runs :meth:`produce` at once; producers of asynchronous
        encoders queue the device work and wait in ``result()``."""
        return Pending.done(self.produce(samples, timer))


__all__ = ["Producer", "Timer", "encode_each", "submit_each", "ImageTokens", "JSON"]


def encoder_spec_problems(option: str, spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The problems of the encoder spec a producer's ``option`` holds (``audio_tokenizer``,
    ``image_encoder``): its names, options and their values by the encoder registry's declarations
    (:data:`precompute.encoders.registry.SPECS`), as ``(".option.key", message)``."""
    from ..encoders.registry import SPECS, spec_problems
    inner = spec.get(option)
    return [(f".{option}{k}", m) for k, m in spec_problems(inner, *SPECS[option])] if isinstance(inner, Mapping) else []
