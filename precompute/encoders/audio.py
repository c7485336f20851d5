"""Audio codec tokenizers (transformers ``DacModel``, ``EncodecModel``, ``MimiModel``) behind :class:`AudioTokenizer`.

Canonical encoding of one clip of ``n`` samples (what :meth:`HFCodecTokenizer.encode` computes per clip):

1. the clip is zero-padded at the end to ``frames * hop_length`` samples, ``frames = ceil(n / hop_length)``
   (this is what ``DacFeatureExtractor`` does with ``pad_to_multiple_of=hop_length``, and the last
   partial 1920-sample frame of Mimi's streaming mode); a clip of 0 samples gives ``(n_codebooks, 0)``;
2. the padded clip alone, shape ``(1, 1, frames * hop_length)``, goes through ``model.encode``;
3. the codes ``(n_codebooks, frames)`` are returned as int16.

Batched vs one-by-one (the measurements: docs/benchmarks.md):

- Padding clips of *different* lengths to the longest one and trimming afterwards is NOT equal to
  one-by-one for DAC. DAC's encoder is non-causal (symmetric zero padding in every conv, residual
  units with dilations 1/3/9 at every stride level); after the first layer the activations over
  the padded tail are not zero, so the deeper layers of a short clip see other right context than
  the conv padding they see when the clip is encoded alone (the last frames of the shorter clip
  change). EnCodec and Mimi are causal (no right context), so in exact arithmetic padding cannot
  change earlier frames, but see the next point.
- Even batches of clips of *equal* padded length are not bit-identical to one-by-one: conv, LSTM
  and attention kernels round differently for different batch sizes. Codes are arg-min/arg-max
  over codebook distances, so a near tie can flip (seen for EnCodec on CPU; trained codebooks have
  fewer near ties than random ones, but nothing rules them out). On CUDA most clips of a batch had
  some codes flip (DAC and Higgs-Audio, ``benchmarks/gpu_codec_batch.py``); a clip's codes did not
  depend on the other clips of a batch of fixed shape, but changed with its place in the batch. Batched
  codes are a function of the batch's shape and the clip's place in it, not of the clip alone.
- On CPU, batching does not pay.

Therefore :meth:`encode` encodes clip by clip by default (``max_batch_size=1``): the codes of a clip
are a function of the clip and the weights only, never of the other clips in the call or of how a
job was split into calls. ``max_batch_size > 1`` (for GPUs, where batching pays) makes fixed-shape
calls (:mod:`precompute.encoders.batching`): ``max_batch_size`` clips x a length bucket
(``bucket_s``; 0 = clips of equal frame count only, each padded to its own ``frames * hop_length``),
zero slots where no clip is. A clip's codes are then a function of the clip, its place in the call
and the call's shape: stage one records place and shape per clip and ``shardcache check`` rebuilds
that call (:meth:`HFCodecTokenizer.encode_placed`). With ``bucket_s > 0`` a clip is zero-padded to
its bucket, so DAC's last frames see that padding (the receptive-field effect above): the trade
the option's help names. A batched codec's policy is part of its identity (``describe()["batching"]``,
so of the fingerprint: its codes are other codes), and its options are declared ``batch``: recorded when
a cache is started and compared first on every resume (:func:`precompute.identity.check_job_record`).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Sequence

import numpy as np

from shardcache.weights import checkpoint_sha256, identity

from ..effects import BATCH, BYTES, IDENTITY, OPERATIONAL, Effect
from ..faults import reraise_infrastructure
from ..transfer import to_device, to_host
from ._common import (
    clean_config,
    load_error,
    resolve_device,
    resolve_dtype,
    resolve_pretrained,
    state_dict_sha256,
)
from .base import FrameRule
from .batching import BatchPolicy, Call, plan_calls
from .capabilities import Capabilities, Declares, Pending
from .higgs_resampler import RESAMPLERS
from .options import device_problem, dtype_problem, takes

#: bump when the canonical encoding above changes, so fingerprints of old caches stop matching
ENCODE_VERSION = 1

#: a clip whose peak magnitude exceeds this is rejected (e.g. int16 PCM cast to float without scaling)
PEAK_LIMIT = 2.0


def _check_waveform(i: int, w: Any) -> np.ndarray:
    """Validate clip ``i`` and return it as a contiguous float32 ``(num_samples,)`` array."""
    a = np.asarray(w)
    if a.ndim != 1:
        raise ValueError(f"waveform {i}: expected a mono 1-D array (num_samples,), got shape {a.shape}")
    if a.dtype.kind != "f":
        raise ValueError(
            f"waveform {i}: expected floating point samples in [-1, 1], got dtype {a.dtype} "
            "(convert integer PCM with x / 32768.0 for int16)"
        )
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.size:
        if not np.isfinite(a).all():
            raise ValueError(f"waveform {i}: contains NaN or inf")
        peak = float(np.abs(a).max())
        if peak > PEAK_LIMIT:
            raise ValueError(f"waveform {i}: peak amplitude {peak:.4g} > {PEAK_LIMIT}; expected samples in [-1, 1]")
    return a


def _length(w: Any) -> int:
    """Samples of a clip that failed its checks (its place in a call is kept: a zero slot)."""
    shape = np.shape(w)
    return int(shape[0]) if len(shape) else 0


def _check_shape(codec: "HFCodecTokenizer", call: Call, shape: tuple) -> None:
    expected = (call.size, codec.n_codebooks, codec.frames(call.length))
    if shape != expected:
        raise RuntimeError(
            f"{type(codec).__name__}: model returned codes of shape {shape} for input "
            f"{(call.size, 1, call.length)}, expected {expected} (hop_length={codec.hop_length}); the checkpoint's "
            "config does not match this wrapper")


class _Checked:
    """A call's codes from a codec process, shape-checked when they come."""

    def __init__(self, remote: Any, codec: "HFCodecTokenizer", call: Call):
        self.remote, self.codec, self.call = remote, codec, call

    def numpy(self) -> np.ndarray:
        codes = self.remote.numpy()
        _check_shape(self.codec, self.call, tuple(codes.shape))
        return codes


def plan_batches(
    lengths: Sequence[int], hop_length: int, max_batch_size: int, max_batch_samples: int
) -> list[tuple[int, list[int]]]:
    """Group clip indices into batches of equal frame count.

    Args:
        lengths: number of samples of each clip.
        hop_length: samples per frame.
        max_batch_size: at most this many clips per batch (>= 1).
        max_batch_samples: at most this many padded samples per batch (a batch always holds >= 1 clip).

    Returns:
        ``[(frames, [clip indices...]), ...]`` in increasing frame count, clips of 0 frames left out;
        each index appears exactly once, indices within a batch in input order.
    """
    if max_batch_size < 1 or max_batch_samples < 1:
        raise ValueError("max_batch_size and max_batch_samples must be >= 1")
    groups: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(lengths):
        frames = -(-int(n) // hop_length)
        if frames:
            groups[frames].append(i)
    plan: list[tuple[int, list[int]]] = []
    for frames in sorted(groups):
        per_batch = max(1, min(max_batch_size, max_batch_samples // (frames * hop_length)))
        idxs = groups[frames]
        for start in range(0, len(idxs), per_batch):
            plan.append((frames, idxs[start : start + per_batch]))
    return plan


class HFCodecTokenizer(Declares, FrameRule):
    """Shared machinery of the transformers codec wrappers (input checks, calls, describe).

    Subclasses set ``name``, ``_model_class()`` and ``_encode_batch`` and fill ``sample_rate``,
    ``hop_length``, ``n_codebooks`` and ``codebook_size`` in ``__init__``.

    Args:
        model: the loaded transformers model (moved to ``device``/``dtype``, put in eval mode, frozen).
        device: torch device for the model and inputs (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        dtype: model dtype; float32 by default. float16 needs CUDA; bfloat16 is accepted on CPU.
        max_batch_size: clips per call; 1 (default) = clip by clip, codes a function of the clip
            alone on every device. Larger values make fixed-shape calls of ``max_batch_size`` clips x
            a length bucket (:mod:`precompute.encoders.batching`): faster on a GPU; a clip's codes
            are then a function of its place in the call and the call's shape (recorded in the
            cache), and differ from clip by clip in near ties.
        max_batch_samples: at most this many (padded) samples per call; bounds memory for long
            clips (a clip longer than this is still encoded, alone).
        bucket_s: seconds per length bucket of batched calls (0: clips of equal length only).
        processes: copies of the model on ``device``, each in a process of its own
            (:mod:`precompute.encoders.processes`; for codecs bound by kernel launches); a call's codes
            are the same whichever copy runs it. Needs the codec loaded by :meth:`from_pretrained`.
    """

    name = "codec"
    #: option names accepted by the registry besides ``name``/``pretrained``
    OPTIONS: tuple[str, ...] = ("device", "dtype", "max_batch_size", "max_batch_samples", "bucket_s", "processes",
                                "revision")
    #: what each option does to a cache (:class:`precompute.effects.Effect`; ``name``/``pretrained``:
    #: :data:`precompute.identity.SPEC_KEYS`), one entry per option of :attr:`OPTIONS`; ``processes``:
    #: copies of the model, each clip's codes the same in any of them (tested), so operational; ``revision``
    #: picks the hub revision of ``pretrained`` whose files load (their sha256 is the identity)
    #: (and the values it takes: :func:`precompute.encoders.options.takes`, checked with the config)
    OPTION_EFFECTS: dict[str, Effect] = {
        "device": takes(BATCH, str, check=device_problem), "dtype": takes(BYTES, str, nullable=True, check=dtype_problem),
        "max_batch_size": takes(BATCH, int, ge=1), "max_batch_samples": takes(BATCH, int, ge=1),
        "bucket_s": takes(BATCH, float, ge=0, le=3600), "processes": takes(OPERATIONAL, int, ge=1, le=64),
        "revision": takes(IDENTITY, str, nullable=True)}
    #: clips are zero-padded to a multiple of ``hop_length`` (the canonical encoding above); False:
    #: encoded as they are, and the model says how many frames (:class:`HiggsTokenizer`)
    PADS_TO_HOP = True

    sample_rate: int
    hop_length: int
    n_codebooks: int
    codebook_size: int

    def __init__(
        self,
        model,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        max_batch_size: int = 1,
        max_batch_samples: int = 24_000 * 240,
        bucket_s: float = 0.0,
        processes: int = 1,
    ) -> None:
        import torch

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        if self.device.type == "cpu" and self.dtype == torch.float16:
            # fp16 convolutions are missing or emulated on CPU; bf16 runs (slowly), so the
            # precision guard (precompute.precision) can be exercised without a GPU
            raise ValueError(f"{type(self).__name__}: float16 needs CUDA; use float32 or bfloat16 on CPU")
        if int(max_batch_size) < 1 or int(max_batch_samples) < 1:
            raise ValueError("max_batch_size and max_batch_samples must be >= 1")
        self.batch_policy = BatchPolicy(int(max_batch_size), float(bucket_s))
        if not isinstance(processes, int) or isinstance(processes, bool) or not 1 <= processes <= 64:
            raise ValueError(f"processes must be an integer in [1, 64], got {processes!r}")
        self.processes = processes
        self._recipe: tuple | None = None  # (class, pretrained, options): how a codec process loads it
        self._pool = None
        self.max_batch_size = int(max_batch_size)
        self.max_batch_samples = int(max_batch_samples)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        self.pretrained: str | None = None
        self.revision: str | None = None   #: the hub revision of ``pretrained`` it was loaded at (None: main)

    # -- to implement -------------------------------------------------------------------------
    @classmethod
    def _model_class(cls):  # pragma: no cover - abstract
        raise NotImplementedError

    def _encode_batch(self, x):  # pragma: no cover - abstract
        """``x``: float ``(B, 1, T)`` on the model's device/dtype -> long ``(B, n_q, frames(T))``."""
        raise NotImplementedError

    def _extra_describe(self) -> dict:
        return {}

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained: Any, *, device: Any = "cpu", dtype: Any = None, model_class: type | None = None,
                        revision: str | None = None, **kwargs: Any):
        """Load the model with ``from_pretrained`` (local directory or hub id; ``model_class``: the class to
        load, default :meth:`_model_class`; ``revision``: the hub id's branch, tag or commit, default ``main``)
        and wrap it.

        Raises:
            FileNotFoundError: ``pretrained`` looks like a local path that does not exist (the
                message says how to build a random test model).
            shardcache.weights.CheckpointUnreadable: its weight files cannot be read (checked first);
                :class:`shardcache.weights.LocalRevision` for a ``revision`` with a local folder.
            OSError: loading failed (not a model directory, no network for a hub id...).
        """
        what = f"{cls.__name__}"
        path = resolve_pretrained(pretrained, what=what)
        # its identity first: what cannot be read is refused before any weight loads
        checkpoint_sha256(path, revision=revision, what="audio_tokenizer.revision")
        try:
            model = (model_class or cls._model_class()).from_pretrained(path, dtype=resolve_dtype(dtype),
                                                                        revision=revision or None)
        except (OSError, ValueError) as e:
            raise load_error(what, path, e) from e
        obj = cls(model, device=device, dtype=dtype, **kwargs)
        obj.pretrained, obj.revision = path, revision or None
        if model_class is None:  # (HiggsTokenizer records its own call)
            obj._recipe = (cls, path, dict(kwargs, device=str(device), dtype=dtype, revision=revision or None))
        return obj

    # -- the protocol -------------------------------------------------------------------------
    @property
    def frame_rate(self) -> float:
        """Frames per second, ``sample_rate / hop_length``."""
        return self.sample_rate / self.hop_length

    @property
    def capabilities(self) -> Capabilities:
        """On its device, asynchronous (:meth:`submit`), batching by :attr:`batch_policy`."""
        return Capabilities(device=str(self.device), batching=self.batch_policy, asynchronous=True,
                            posterior="a codec has no posterior")

    def frames(self, n: int) -> int:
        """Code frames of a clip of ``n`` samples: ``ceil(n / hop_length)`` (:class:`HiggsTokenizer`: its model's count)."""
        return -(-int(n) // self.hop_length)

    def canonical_length(self, n: int) -> int:
        """The samples a clip of ``n`` is encoded at alone: ``frames(n) * hop_length`` (:class:`HiggsTokenizer`: ``n``)."""
        return self.frames(n) * self.hop_length if self.PADS_TO_HOP else int(n)

    def plan(self, lengths: list[int]) -> list[Call]:
        """The calls that encode clips of ``lengths`` samples (:func:`precompute.encoders.batching.plan_calls`
        with this codec's policy, hop-rounded bucket and ``max_batch_samples``)."""
        hops = round(self.batch_policy.bucket_s * self.sample_rate / self.hop_length)
        step = max(1, hops) * self.hop_length if self.batch_policy.bucket_s > 0 else 0
        return plan_calls(lengths, self.canonical_length, self.batch_policy, step, self.max_batch_samples)

    def encode(self, waveforms: Iterable[np.ndarray]) -> list[np.ndarray]:
        """Encode mono float32 clips at ``sample_rate`` Hz into int16 ``(n_codebooks, frames(n))`` codes:
        ``ceil(n / hop_length)`` frames (:class:`HiggsTokenizer`: the frames its model gives for the clip).

        Clip by clip by default; with ``max_batch_size > 1`` in the fixed-shape calls of :meth:`plan`.
        Output order is input order.

        Raises:
            TypeError: ``waveforms`` is a single array instead of a list of arrays.
            ValueError: a clip is not 1-D, not floating point, not finite, or has peak > ``PEAK_LIMIT``.
            RuntimeError: the model returned an unexpected code shape (config/hop mismatch).
        """
        got = self.submit(waveforms).result()
        bad = next((g for g in got if isinstance(g, Exception)), None)
        if bad is not None:
            raise bad
        return got

    def encode_placed(self, waveform: np.ndarray, size: int, length: int, place: int) -> np.ndarray:
        """The codes of one clip encoded at ``place`` of a call of ``size`` clips x ``length`` samples, the other
        places zero slots: how ``shardcache check`` rebuilds a batched clip's recorded call. Raises as :meth:`encode`."""
        got = self.submit([waveform], [Call.alone(int(size), int(length), int(place))]).result()[0]
        if isinstance(got, Exception):
            raise got
        return got

    def submit(self, waveforms: Iterable[np.ndarray], calls: list[Call] | None = None) -> Pending:
        """Queue the calls that encode ``waveforms`` (default :meth:`plan`); ``result()`` is one int16 codes
        array or one exception per clip, in input order: an invalid clip (see :meth:`encode`) is a zero
        slot of its call and gets its ``ValueError``; a call the model fails is run again one clip at a
        time at the same places (zero slots elsewhere), so a failure costs only its own clip.

        On CUDA the calls' inputs go from pinned memory, their codes come back with one non-blocking
        copy each into pinned memory, and ``result()`` waits once (one event) for all of them.
        """
        import torch

        if isinstance(waveforms, np.ndarray) or isinstance(waveforms, torch.Tensor):
            raise TypeError("encode() takes a list of 1-D arrays, not a single array; wrap it: encode([x])")
        clips: list[np.ndarray | Exception] = []
        for i, w in enumerate(waveforms):
            try:
                clips.append(_check_waveform(i, w))
            except ValueError as e:
                clips.append(e)
        lengths = [c.size if isinstance(c, np.ndarray) else max(1, _length(w)) for c, w in zip(clips, waveforms)]
        out: list[Any] = [c if isinstance(c, Exception) else None for c in clips]
        for i, c in enumerate(clips):
            if isinstance(c, np.ndarray) and c.size == 0:
                out[i] = np.zeros((self.n_codebooks, 0), dtype=np.int16)
        launched = []
        for call in (calls if calls is not None else self.plan(lengths)):
            live = [p for p, i in enumerate(call.places) if i >= 0 and isinstance(clips[i], np.ndarray)]
            try:
                launched.append((call, live, self._launch(call, [(p, clips[call.places[p]]) for p in live])))
            except Exception as e:  # noqa: BLE001 - the call again, one clip at a time at its place
                if len(live) == 1:
                    reraise_infrastructure(e)  # (a call of many may fit the device one clip at a time)
                for p in live:
                    try:
                        launched.append((call, [p], self._launch(call, [(p, clips[call.places[p]])])))
                    except Exception as e:  # noqa: BLE001 - travels with its clip (a row fault)
                        reraise_infrastructure(e)
                        out[call.places[p]] = e
        wait = None
        if self.device.type == "cuda" and self.processes == 1:
            event = torch.cuda.Event()
            event.record()
            wait = event.synchronize

        def finish() -> list:
            for call, live, host in launched:
                try:
                    codes = host.numpy()
                except Exception as e:  # noqa: BLE001 - a codec process's call failed: its clips
                    reraise_infrastructure(e)  # (a dead codec process, a device error: the job's, not the rows')
                    for p in live:
                        out[call.places[p]] = e
                    continue
                if codes.size and (codes.min() < 0 or codes.max() >= self.codebook_size):
                    err = RuntimeError(f"{type(self).__name__}: codes outside [0, {self.codebook_size})")
                    for p in live:
                        out[call.places[p]] = err
                    continue
                for p in live:
                    i = call.places[p]
                    n = clips[i].size
                    keep = codes.shape[-1] if call.length == self.canonical_length(n) else self.frames(n)
                    out[i] = codes[p, :, :keep].astype(np.int16)
            return out

        return Pending(finish, wait)

    def _launch(self, call: Call, clips: list[tuple[int, np.ndarray]]):
        """Queue one call (zero padding, zero slots) on the device, or send it to a codec process; its codes
        ``(size, n_q, frames)`` come from the returned object's ``numpy()`` once done (pinned and copied
        without blocking on CUDA)."""
        import torch

        x = np.zeros((call.size, 1, call.length), dtype=np.float32)
        for p, c in clips:
            x[p, 0, : c.size] = c
        if self.processes > 1:
            self.start()
            return _Checked(self._pool.submit(x), self, call)
        with torch.inference_mode():
            xt = to_device(x, self.device, self.dtype)  # pinned + non-blocking on CUDA
            codes = self._encode_batch(xt)
        _check_shape(self, call, tuple(codes.shape))
        return to_host(codes)

    def close(self) -> None:
        """Stop the codec processes (``processes > 1``); the next call starts them again."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def start(self) -> None:
        """With ``processes > 1``: start the codec processes, all at once (each loads the checkpoint), and wait
        until every one is ready; the job calls it when it builds, so no call waits for them. Nothing else."""
        if self.processes > 1 and self._pool is None:
            if self._recipe is None:
                raise ValueError(f"{type(self).__name__}: processes > 1 needs a codec loaded with from_pretrained")
            from .processes import CodecPool
            self._pool = CodecPool(self._recipe, self.processes)

    def describe(self) -> dict:
        """``class``, ``name``, ``config``, ``weights_sha256`` plus the code contract and ``encode_version``.

        ``weights_sha256`` is recomputed on every call (about 1 s per 500 MB of weights). The identity a
        recipe's contract compares (:func:`shardcache.weights.identity`): ``checkpoint_sha256`` (the
        tensors of the files ``transformers`` loads; None for a model not loaded with :meth:`from_pretrained`),
        ``numerics`` (device type, dtype, CPU kernels, TF32 and cuDNN switches) and ``loaded_from`` (the hub
        id and commit, or the local folder: recorded, left out of the fingerprint).
        """
        d = {
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "name": self.name,
            "config": clean_config(self.model.config),
            "weights_sha256": state_dict_sha256(self.model),
            "dtype": str(self.dtype).replace("torch.", ""),
            "sample_rate": int(self.sample_rate),
            "hop_length": int(self.hop_length),
            "n_codebooks": int(self.n_codebooks),
            "codebook_size": int(self.codebook_size),
            "padding": "zeros to a multiple of hop_length; batches hold equal frame counts only",
            "encode_version": ENCODE_VERSION,
        }
        d.update(self._extra_describe())
        if self.batch_policy.batched:  # a batched clip's codes depend on its place and the call's shape
            d["batching"] = self.batch_policy.describe()
        d.update(identity(self.pretrained, dtype=self.dtype, device=self.device,   # what a recipe's contract compares
                          revision=self.revision))
        return d

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sample_rate={self.sample_rate}, hop_length={self.hop_length}, "
            f"n_codebooks={self.n_codebooks}, codebook_size={self.codebook_size}, device={self.device}, "
            f"dtype={self.dtype})"
        )

    def _check_codebook_size(self) -> None:
        if not 1 <= self.codebook_size <= 32768:
            raise ValueError(f"codebook_size {self.codebook_size} does not fit int16 codes")


class DacTokenizer(HFCodecTokenizer):
    """Descript Audio Codec via transformers ``DacModel`` (the default audio tokenizer).

    ``model.encode(input_values (B, 1, T)).audio_codes`` is long ``(B, n_codebooks, T / hop_length)``.
    Shaped like the Higgs Audio v2 tokenizer (``downsampling_ratios=[8,5,4,2,3]``): 24 kHz in, hop 960,
    25 frames/s, 8 codebooks x 1024.

    Args:
        model: a ``transformers.DacModel``.
        n_quantizers: use only the first ``n_quantizers`` codebooks (default: all ``config.n_codebooks``).
        **kwargs: see :class:`HFCodecTokenizer`.
    """

    name = "dac"
    OPTIONS = HFCodecTokenizer.OPTIONS + ("n_quantizers",)
    OPTION_EFFECTS = HFCodecTokenizer.OPTION_EFFECTS | {"n_quantizers": takes(BYTES, int, ge=1, nullable=True)}

    def __init__(self, model, *, n_quantizers: int | None = None, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        cfg = model.config
        self.sample_rate = int(cfg.sampling_rate)
        # the encoder's real stride; config.hop_length can be overridden by a kwarg and disagree
        self.hop_length = int(np.prod(cfg.downsampling_ratios))
        total = int(cfg.n_codebooks)
        n = total if n_quantizers is None else int(n_quantizers)
        if not 1 <= n <= total:
            raise ValueError(f"n_quantizers must be in [1, {total}], got {n_quantizers}")
        self.n_codebooks = n
        self.codebook_size = int(cfg.codebook_size)
        self._check_codebook_size()

    @classmethod
    def _model_class(cls):
        from transformers import DacModel

        return DacModel

    def _encode_batch(self, x):
        return self.model.encode(x, n_quantizers=self.n_codebooks).audio_codes


class EncodecTokenizer(HFCodecTokenizer):
    """Meta EnCodec via transformers ``EncodecModel`` (24 kHz: hop 320, 75 frames/s, codebooks of 1024).

    The number of codebooks follows from the bandwidth: ``floor(bandwidth * 1000 / (log2(codebook_size)
    * frame_rate))`` (24 kHz: 1.5 kbps -> 2, 6 kbps -> 8, 24 kbps -> 32).

    Args:
        model: a ``transformers.EncodecModel``.
        bandwidth: kbps, one of ``config.target_bandwidths``; default ``config.target_bandwidths[0]``
            (what ``EncodecModel.encode`` uses when given none).
        **kwargs: see :class:`HFCodecTokenizer`.

    Raises:
        ValueError: bandwidth not in the config, or a chunked / normalising / stereo config (the 48 kHz
            model): its codes come per overlapping chunk with a scale each, which does not fit
            ``(n_codebooks, frames)``.
    """

    name = "encodec"
    OPTIONS = HFCodecTokenizer.OPTIONS + ("bandwidth",)
    OPTION_EFFECTS = HFCodecTokenizer.OPTION_EFFECTS | {"bandwidth": takes(BYTES, float, gt=0, nullable=True)}

    def __init__(self, model, *, bandwidth: float | None = None, **kwargs: Any) -> None:
        cfg = model.config
        if cfg.chunk_length_s is not None or cfg.normalize or int(cfg.audio_channels) != 1:
            raise ValueError(
                "EncodecTokenizer supports mono, unchunked, unnormalised EnCodec configs (the 24 kHz model); "
                f"got chunk_length_s={cfg.chunk_length_s}, normalize={cfg.normalize}, "
                f"audio_channels={cfg.audio_channels}"
            )
        bws = [float(b) for b in cfg.target_bandwidths]
        bw = bws[0] if bandwidth is None else float(bandwidth)
        if bw not in bws:
            raise ValueError(f"bandwidth {bandwidth} kbps not supported by this model; choose one of {bws}")
        super().__init__(model, **kwargs)
        self.bandwidth = bw
        self.sample_rate = int(cfg.sampling_rate)
        self.hop_length = int(np.prod(cfg.upsampling_ratios))
        self.n_codebooks = int(model.quantizer.get_num_quantizers_for_bandwidth(bw))
        self.codebook_size = int(cfg.codebook_size)
        self._check_codebook_size()

    @classmethod
    def _model_class(cls):
        from transformers import EncodecModel

        return EncodecModel

    def _encode_batch(self, x):
        # audio_codes: (nb_chunks=1, B, n_q, frames) for an unchunked config
        out = self.model.encode(x, bandwidth=self.bandwidth)
        codes = out.audio_codes
        if codes.shape[0] != 1:
            raise RuntimeError(f"EnCodec returned {codes.shape[0]} chunks; expected 1 (unchunked config)")
        return codes[0]

    def _extra_describe(self) -> dict:
        return {"bandwidth": self.bandwidth}


class MimiTokenizer(HFCodecTokenizer):
    """Kyutai Mimi via transformers ``MimiModel`` (24 kHz: hop 1920, 12.5 frames/s, codebooks of 2048).

    ``model.encode(x, num_quantizers=n).audio_codes`` is ``(B, n, frames)``; the first
    ``config.num_semantic_quantizers`` codebooks are the semantic ones.

    Args:
        model: a ``transformers.MimiModel``.
        num_quantizers: number of codebooks (default ``config.num_quantizers``; Moshi uses 8 of 32).
        **kwargs: see :class:`HFCodecTokenizer`.
    """

    name = "mimi"
    OPTIONS = HFCodecTokenizer.OPTIONS + ("num_quantizers",)
    OPTION_EFFECTS = HFCodecTokenizer.OPTION_EFFECTS | {"num_quantizers": takes(BYTES, int, ge=1, nullable=True)}

    def __init__(self, model, *, num_quantizers: int | None = None, **kwargs: Any) -> None:
        cfg = model.config
        total = int(cfg.num_quantizers)
        n = total if num_quantizers is None else int(num_quantizers)
        if not int(cfg.num_semantic_quantizers) <= n <= total:
            raise ValueError(
                f"num_quantizers must be in [{cfg.num_semantic_quantizers}, {total}], got {num_quantizers}"
            )
        if int(cfg.audio_channels) != 1:
            raise ValueError(f"MimiTokenizer supports mono models, got audio_channels={cfg.audio_channels}")
        super().__init__(model, **kwargs)
        self.sample_rate = int(cfg.sampling_rate)
        self.hop_length = int(cfg.frame_size)
        self.n_codebooks = n
        self.codebook_size = int(cfg.codebook_size)
        self._check_codebook_size()

    @classmethod
    def _model_class(cls):
        from transformers import MimiModel

        return MimiModel

    def _encode_batch(self, x):
        return self.model.encode(x, num_quantizers=self.n_codebooks).audio_codes


class HiggsTokenizer(HFCodecTokenizer):
    """The Higgs Audio v2 tokenizer via transformers ``HiggsAudioV2TokenizerModel`` (24 kHz, 25 frames/s),
    the codec of Higgs-Audio v2: ``name: higgs``, ``pretrained``: a directory written by its
    ``save_pretrained`` or a hub id of one in ``transformers`` format.

    ``model.encode(x (B, 1, T), bandwidth).audio_codes`` is ``(B, n_q, frames)`` with
    ``n_q = floor(bandwidth * 1000 / (frame_rate * log2(codebook_size)))``: 2 kbps -> 8 codebooks of
    1024, the layout Higgs Audio v2 trains on.

    Canonical encoding (differs from the other codecs): each clip is encoded **as it is, unpadded**,
    exactly as ``HiggsAudioV2Processor`` (``DacFeatureExtractor`` with hop 1, no padding) and
    ``boson_multimodal``'s ``HiggsAudioTokenizer.encode`` do, so the cached codes are the codes the
    model's own processor computes on the fly. The model pads internally and its frame count is its
    own (about ``n / 960``: e.g. 961 samples -> 1 frame, 2,400 -> 3); with ``max_batch_size > 1`` only
    clips of exactly equal length are batched (no padding at all).

    Its transformers port resamples the semantic branch's input to 16 kHz with torchaudio: option
    ``resampler`` (torchaudio | soxr | auto, :mod:`precompute.encoders.higgs_resampler`) says what runs
    where torchaudio cannot be imported, and ``describe()`` records the resampler that ran, so codes
    resampled differently never share a fingerprint.

    Args:
        model: a ``transformers.HiggsAudioV2TokenizerModel``.
        bandwidth: kbps, one of ``config.target_bandwidths``; default: the last one, what
            ``model.encode`` and ``HiggsAudioV2Processor`` use (2 kbps -> 8 codebooks for Higgs v2).
        n_codebooks: the codebook count ``bandwidth`` must give (None: not checked). The TTS preset
            pins 8 at 2 kbps, the released layout: a tokenizer config whose bandwidth gives another
            count (transformers' default config reaches 16) is refused when the codec loads, at
            stage one, instead of writing codes the model cannot train on.
        resampler: the resampler that ran in the model's semantic branch, as
            :func:`precompute.encoders.higgs_resampler.model_class` names it (``torchaudio 2.9.1``).
        **kwargs: see :class:`HFCodecTokenizer`.
    """

    name = "higgs"
    OPTIONS = HFCodecTokenizer.OPTIONS + ("bandwidth", "n_codebooks", "resampler")
    #: n_codebooks only checks what bandwidth gives (a refusal or the same codes)
    OPTION_EFFECTS = HFCodecTokenizer.OPTION_EFFECTS | {
        "bandwidth": takes(BYTES, float, gt=0, nullable=True), "n_codebooks": takes(OPERATIONAL, int, ge=1, nullable=True),
        "resampler": takes(BYTES, str, choices=RESAMPLERS)}
    PADS_TO_HOP = False

    def __init__(self, model, *, bandwidth: float | None = None, n_codebooks: int | None = None,
                 resampler: str = "torchaudio", **kwargs: Any) -> None:
        cfg = model.config
        bandwidth = cfg.target_bandwidths[-1] if bandwidth is None else bandwidth
        if bandwidth not in tuple(cfg.target_bandwidths):
            raise ValueError(f"bandwidth must be one of {list(cfg.target_bandwidths)}, got {bandwidth}")
        super().__init__(model, **kwargs)
        self.bandwidth, self.resampler = bandwidth, resampler
        self.sample_rate = int(cfg.sample_rate)
        self.hop_length = int(cfg.hop_length)
        self.codebook_size = int(cfg.codebook_size)
        self.n_codebooks = int(model.quantizer.get_num_quantizers_for_bandwidth(bandwidth))
        if n_codebooks is not None and int(n_codebooks) != self.n_codebooks:
            raise ValueError(f"audio_tokenizer: bandwidth {bandwidth} kbps gives {self.n_codebooks} codebooks, "
                             f"n_codebooks pins {n_codebooks} (Higgs Audio v2 trains on 8 at 2 kbps): set "
                             "audio_tokenizer.bandwidth to the model's")
        self._check_codebook_size()

    #: ``model_type`` of a tokenizer in ``transformers`` format
    MODEL_TYPE = "higgs_audio_v2_tokenizer"

    @classmethod
    def from_pretrained(cls, pretrained: Any, **kwargs: Any):
        """As :meth:`HFCodecTokenizer.from_pretrained`, after reading the checkpoint's ``config.json``:
        Boson's own tokenizer format (``bosonai/higgs-audio-v2-tokenizer``: ``model.pth`` and a config
        without ``model_type``, loaded by ``boson_multimodal``'s ``load_higgs_audio_tokenizer``), which
        ``transformers`` cannot load, is refused with a ``ValueError`` saying so and naming the
        ``transformers``-format tokenizer to use instead (docs/higgs-audio.md)."""
        from transformers import PretrainedConfig

        from shardcache.weights import checkpoint
        path = resolve_pretrained(pretrained, what=cls.__name__)
        revision = kwargs.get("revision") or None
        checkpoint(path, revision=revision, what="audio_tokenizer.revision")   # a folder has no revisions: refused
        try:
            raw, _ = PretrainedConfig.get_config_dict(path, revision=revision)
        except (OSError, ValueError) as e:
            raise load_error(cls.__name__, path, e) from e
        if raw.get("model_type") != cls.MODEL_TYPE:
            boson = "n_q" in raw or "semantic_techer" in raw or raw.get("model_type") is None
            raise ValueError(
                f"audio_tokenizer.pretrained {path}: "
                + ("Boson's own Higgs audio tokenizer format (model.pth + its config, boson_multimodal), which "
                   "transformers cannot load" if boson else f"model_type {raw.get('model_type')!r}, not {cls.MODEL_TYPE}")
                + ": use the tokenizer in transformers format (eustlb/higgs-audio-v2-tokenizer, the conversion "
                  "script's default; docs/higgs-audio.md)")
        from .higgs_resampler import model_class
        asked = kwargs.pop("resampler", "torchaudio")
        model_cls, resampler = model_class(asked)
        obj = super().from_pretrained(path, model_class=model_cls, resampler=resampler, **kwargs)
        obj._recipe = (cls, path, dict(kwargs, resampler=asked))
        return obj

    def _encode_batch(self, x):
        return self.model.encode(x, bandwidth=self.bandwidth).audio_codes

    def frames(self, n: int) -> int:
        """The frames the model gives for a clip of ``n`` samples, by its own length arithmetic: its semantic
        branch's (the input resampled to ``semantic_sample_rate``, ``ceil(n * semantic / rate)`` samples as
        torchaudio's ``resample`` and the soxr stand-in give, padded by 160 on each side, through the
        HuBERT feature extractor's convolutions, every ``semantic_downsample_factor``-th frame kept); the
        acoustic branch is padded to match it."""
        import torch

        cfg = self.model.config
        m = int(n) if cfg.sample_rate == cfg.semantic_sample_rate else \
            -(-int(n) * int(cfg.semantic_sample_rate) // int(cfg.sample_rate))
        length = int(self.model.semantic_model._get_feat_extract_output_lengths(torch.tensor(m + 320)))
        return -(-length // int(cfg.semantic_downsample_factor))

    def _extra_describe(self) -> dict:
        out = {"bandwidth": self.bandwidth, "padding": "none: each clip as it is (HiggsAudioV2Processor's encoding)"}
        cfg = self.model.config
        if cfg.sample_rate != cfg.semantic_sample_rate:
            out["resampler"] = self.resampler  # the semantic input's resampling is part of the codes
        return out


#: registry name -> wrapper class
AUDIO_TOKENIZERS: dict[str, type[HFCodecTokenizer]] = {
    "dac": DacTokenizer,
    "encodec": EncodecTokenizer,
    "mimi": MimiTokenizer,
    "higgs": HiggsTokenizer,
}
