"""Image VAE encoders (diffusers ``AutoencoderKLWan``, ``AutoencoderKLCosmos``) behind :class:`ImageEncoder`.

Pipeline for a batch of same-sized RGB images:
uint8 ``(B, H, W, 3)`` -> float32 in ``input_range``: ``x / 127.5 - 1`` in [-1, 1] (the VAEs'
documented range, default) or, generally, ``lo + x * (hi - lo) / 255`` (``[0, 255]``: the uint8 values
themselves, what TheWorld's ``CosmosVAEEncoder`` feeds, ``to_tensor(img) * 255``) -> the VAE's dtype
-> ``(B, 3, 1, H, W)`` (an image is a one-frame video) -> ``vae.encode(x).latent_dist.mode()`` ->
``(B, 16, 1, H/8, W/8)`` -> optional normalisation -> float32 numpy.

``mode()`` is deterministic (Wan: the Gaussian's mean; Cosmos: an identity "distribution", which has
no ``.mean``). Batch size changes the latents only by float rounding (about 1e-7 absolute on CPU).

Normalisation (``normalize=True``) follows the Cosmos-Predict2 convention ``(z - mean) / std`` with the
per-channel ``latents_mean``/``latents_std`` of the VAE config. Cosmos 1.0 stores 16 x 16 values
(channel x latent frame); an image has one latent frame, so frame 0's values are used, as the
Cosmos 1.0 pipelines do by slicing to the frame count. The pipelines' extra ``* sigma_data`` factor is
the diffusion model's business and is not applied here.

Posterior (``encode_posterior``, used by ``store_posterior: true``): the Wan VAE's ``latent_dist`` is a
diagonal Gaussian; its ``.mean`` (== ``mode()``, so == :meth:`DiffusersVAEEncoder.encode`) and
``.logvar`` (natural log of the variance, clamped to [-30, 20] by diffusers) are returned. With
``normalize`` the mean becomes ``(mean - latents_mean) / latents_std`` and the log-variance
``logvar - 2 log(latents_std)``, so ``z = mean + exp(0.5 * logvar) * eps`` is a posterior sample in
the same (normalised) space. Cosmos' distribution is an identity (no variance): no posterior.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shardcache.weights import checkpoint_sha256, identity

from ..effects import BATCH, BYTES, IDENTITY, Effect
from ..transfer import to_device, to_host
from ._common import (
    clean_config,
    load_error,
    resolve_device,
    resolve_dtype,
    resolve_pretrained,
    state_dict_sha256,
)
from .batching import BatchPolicy
from .capabilities import Capabilities, Declares, Pending
from .options import device_problem, dtype_problem, range_problem, takes

#: bump when the pipeline above changes, so fingerprints of old caches stop matching
ENCODE_VERSION = 1
#: the values of the option ``image_pixel_range`` -> the (low, high) pixel values the VAE is fed (``input_range``)
PIXEL_RANGES: dict[str, tuple[float, float]] = {"-1..1": (-1.0, 1.0), "0..255": (0.0, 255.0)}


class DiffusersVAEEncoder(Declares):
    """Shared machinery of the diffusers VAE wrappers.

    Args:
        vae: the loaded diffusers autoencoder (moved to ``device``/``dtype``, eval mode, frozen).
        device: torch device (``"cpu"``, ``"cuda"``...).
        dtype: VAE dtype, float32 by default. float16 needs CUDA; bfloat16 is accepted on CPU
            (``AutoencoderKLCosmos`` has no bf16 ``avg_pool3d`` on CPU).
        normalize: return ``(z - latents_mean) / latents_std`` instead of raw latents.
        max_batch_size: at most this many images per forward pass.
        input_range: ``(lo, hi)`` the pixel values 0 and 255 are mapped to (default ``(-1, 1)``).

    Raises:
        ValueError: float16 on CPU; ``normalize=True`` without latents_mean/std in the config;
            ``input_range`` not two finite numbers lo < hi.
    """

    name = "vae"
    OPTIONS: tuple[str, ...] = ("device", "dtype", "normalize", "max_batch_size", "subfolder", "input_range",
                                "revision")
    #: what each option does to a cache (:class:`precompute.effects.Effect`; ``name``/``pretrained``:
    #: :data:`precompute.identity.SPEC_KEYS`); ``subfolder`` and ``revision`` (the hub revision of
    #: ``pretrained``) pick the weights (their sha256 is the identity)
    #: (and the values it takes: :func:`precompute.encoders.options.takes`, checked with the config)
    OPTION_EFFECTS: dict[str, Effect] = {
        "device": takes(BATCH, str, check=device_problem), "dtype": takes(BYTES, str, nullable=True, check=dtype_problem),
        "normalize": takes(BYTES, bool), "max_batch_size": takes(BATCH, int, ge=1),
        "subfolder": takes(IDENTITY, str, nullable=True), "input_range": takes(BYTES, list, check=range_problem),
        "revision": takes(IDENTITY, str, nullable=True)}

    spatial_factor: int
    latent_channels: int
    #: None when ``latent_dist`` has ``.mean``/``.logvar``; else why :meth:`encode_posterior` refuses.
    posterior_unsupported: str | None = None

    def __init__(
        self, vae, *, device: Any = "cpu", dtype: Any = None, normalize: bool = False, max_batch_size: int = 8,
        input_range: Any = (-1.0, 1.0),
    ) -> None:
        import torch

        lo, hi = (float(v) for v in input_range)
        if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
            raise ValueError(f"input_range must be two finite numbers lo < hi, got {input_range!r}")
        self.input_range = (lo, hi)

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        if self.device.type == "cpu" and self.dtype == torch.float16:
            # fp16 convolutions are missing or emulated on CPU; bf16 runs (slowly), so the
            # precision guard (precompute.precision) can be exercised without a GPU
            raise ValueError(f"{type(self).__name__}: float16 needs CUDA; use float32 or bfloat16 on CPU")
        if int(max_batch_size) < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.max_batch_size = int(max_batch_size)
        vae = vae.to(self.device)
        if next(vae.parameters()).dtype != self.dtype:  # from_pretrained already loads in self.dtype
            vae = vae.to(dtype=self.dtype)
        self.vae = vae.eval()
        self.vae.requires_grad_(False)
        self.pretrained: str | None = None
        self.subfolder: str | None = None   #: of a diffusers pipeline layout (``vae``)
        self.revision: str | None = None    #: the hub revision of ``pretrained`` it was loaded at (None: main)
        self._init_geometry()
        self.normalize = bool(normalize)
        self._mean = self._std = None
        if self.normalize:
            stats = self._latent_stats()
            if stats is None:
                raise ValueError(f"{type(self).__name__}: normalize=True but the VAE config has no latents_mean/std")
            mean, std = stats
            if np.any(std <= 0):
                raise ValueError("latents_std must be positive")
            self._mean = torch.from_numpy(mean).view(1, -1, 1, 1, 1).to(self.device)
            self._std = torch.from_numpy(std).view(1, -1, 1, 1, 1).to(self.device)
            self._logvar_shift = 2.0 * torch.log(self._std)  # log(std**2): Var[(z - m) / s] = Var[z] / s**2

    # -- to implement -------------------------------------------------------------------------
    @classmethod
    def _model_class(cls):  # pragma: no cover - abstract
        raise NotImplementedError

    def _init_geometry(self) -> None:  # pragma: no cover - abstract
        """Set ``spatial_factor`` and ``latent_channels`` from the config."""
        raise NotImplementedError

    def _latent_stats(self, dtype=np.float32) -> tuple[np.ndarray, np.ndarray] | None:  # pragma: no cover
        """Per-channel ``(latent_channels,)`` mean and std (``dtype``) for an image, or None."""
        raise NotImplementedError

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls, pretrained: Any, *, device: Any = "cpu", dtype: Any = None, subfolder: str | None = None,
        revision: str | None = None, **kwargs: Any
    ):
        """Load the VAE with diffusers ``from_pretrained`` (local directory or hub id, at ``revision``: the hub
        id's branch, tag or commit, default ``main``) and wrap it.

        A diffusers pipeline layout is accepted too: give ``subfolder="vae"`` (needed for hub ids, e.g.
        a Cosmos-Predict2 pipeline repository); a local directory without ``config.json`` but with
        ``vae/config.json`` is detected automatically.

        Raises:
            FileNotFoundError: ``pretrained`` looks like a local path that does not exist (the message
                says how to build a random test model).
            shardcache.weights.CheckpointUnreadable: its weight files cannot be read (checked first);
                :class:`shardcache.weights.LocalRevision` for a ``revision`` with a local folder.
            OSError: loading failed.
        """
        from pathlib import Path

        what = cls.__name__
        path = resolve_pretrained(pretrained, what=what)
        load_kwargs: dict[str, Any] = {"torch_dtype": resolve_dtype(dtype), "revision": revision or None}
        p = Path(path)
        if subfolder:
            load_kwargs["subfolder"] = subfolder
        elif p.is_dir() and not (p / "config.json").exists() and (p / "vae" / "config.json").exists():
            load_kwargs["subfolder"] = "vae"
        # its identity first (the files diffusers opens): what cannot be read is refused before any weight loads
        checkpoint_sha256(path, load_kwargs.get("subfolder"), library="diffusers", revision=revision,
                          what="image_encoder.revision")
        try:
            vae = cls._model_class().from_pretrained(path, **load_kwargs)
        except (OSError, ValueError) as e:
            raise load_error(what, path, e) from e
        obj = cls(vae, device=device, dtype=dtype, **kwargs)
        obj.pretrained, obj.subfolder, obj.revision = path, load_kwargs.get("subfolder"), revision or None
        return obj

    # -- the protocol -------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """On its device, asynchronous (:meth:`submit`); calls of up to ``max_batch_size`` images of one
        shape (latents then differ from one image per call by float rounding only, within ``shardcache
        check``'s tolerance); the posterior where ``latent_dist`` has one; the latents' facts
        (:func:`precompute.producers.latents_info`)."""
        return Capabilities(device=str(self.device), batching=BatchPolicy(self.max_batch_size), asynchronous=True,
                            posterior=self.posterior_unsupported,
                            latents={"input_range": list(self.input_range), "dtype": str(self.dtype).replace("torch.", ""),
                                     **self.latent_stats()})

    def encode(self, images: np.ndarray) -> np.ndarray:
        """Encode uint8 RGB ``(B, H, W, 3)`` into float32 ``(B, latent_channels, 1, H/f, W/f)``, f = spatial_factor.

        Raises:
            ValueError: not uint8, not ``(B, H, W, 3)``, or H/W not multiples of ``spatial_factor``.
            RuntimeError: the VAE returned an unexpected latent shape.
        """
        return self._encode(images, posterior=False)[0]

    def encode_posterior(self, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Posterior ``(mean, logvar)`` of uint8 RGB ``(B, H, W, 3)``: two float32 arrays
        ``(B, latent_channels, 1, H/f, W/f)``; ``mean`` equals :meth:`encode`, ``logvar`` is the natural
        log of the variance (both normalised when ``normalize``; see the module docstring).

        Raises:
            ValueError: the VAE has no Gaussian posterior (``AutoencoderKLCosmos``), or as :meth:`encode`.
            RuntimeError: as :meth:`encode`.
        """
        if self.posterior_unsupported:
            raise ValueError(f"{type(self).__name__}: no posterior to store: {self.posterior_unsupported}; "
                             "set store_posterior: false (or use the wan image encoder)")
        return self._encode(images, posterior=True)

    def _encode(self, images: np.ndarray, posterior: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """``(mode or mean, logvar or None)`` as float32 ``(B, C, 1, H/f, W/f)`` arrays."""
        return self.submit(images, posterior).result()

    def submit(self, images: np.ndarray, posterior: bool = False) -> Pending:
        """Queue the calls that encode ``images`` (as :meth:`encode`; ``posterior``: as :meth:`encode_posterior`);
        ``result()`` gives ``(latents, logvar or None)``. On CUDA the inputs go from pinned memory, each
        call's latents come back with one non-blocking copy into pinned memory, and ``result()`` waits
        once. Raises as :meth:`encode` (input checks at once; the latents' shape when queued)."""
        import torch
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

        a = np.asarray(images)
        if a.dtype != np.uint8:
            raise ValueError(f"images must be uint8, got {a.dtype}")
        if a.ndim != 4 or a.shape[-1] != 3:
            raise ValueError(f"images must have shape (B, H, W, 3), got {a.shape}")
        b, h, w, _ = a.shape
        f = self.spatial_factor
        if h == 0 or w == 0 or h % f or w % f:
            raise ValueError(f"image size {h}x{w} must be a positive multiple of {f} (crop or resize first)")
        out_shape = (self.latent_channels, 1, h // f, w // f)
        parts = []
        for start in range(0, b, self.max_batch_size):
            chunk = np.ascontiguousarray(a[start : start + self.max_batch_size])
            with torch.inference_mode():
                x = to_device(chunk, self.device)  # pinned + non-blocking on CUDA
                x = self._to_range(x.permute(0, 3, 1, 2).to(torch.float32))
                x = x.unsqueeze(2).to(self.dtype).contiguous()  # (b, 3, 1, H, W)
                dist = self.vae.encode(x).latent_dist
                if posterior and not isinstance(dist, DiagonalGaussianDistribution):
                    name = type(dist).__name__
                    raise ValueError(f"{type(self).__name__}: latent_dist {name} has no mean/logvar")
                z = dist.mean if posterior else dist.mode()
                if tuple(z.shape) != (len(chunk), *out_shape):
                    raise RuntimeError(
                        f"{type(self).__name__}: VAE returned latents {tuple(z.shape)}, expected "
                        f"{(len(chunk), *out_shape)}"
                    )
                z = z.to(torch.float32)
                if self.normalize:
                    z = (z - self._mean) / self._std
                lv = None
                if posterior:
                    lv = dist.logvar.to(torch.float32)
                    if self.normalize:
                        lv = lv - self._logvar_shift
                    lv = to_host(lv)
                parts.append((to_host(z), lv))
        wait = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            wait = event.synchronize

        def finish() -> tuple[np.ndarray, np.ndarray | None]:
            out = np.empty((b, *out_shape), dtype=np.float32)
            out_lv = np.empty((b, *out_shape), dtype=np.float32) if posterior else None
            for k, (z, lv) in enumerate(parts):
                start = k * self.max_batch_size
                out[start : start + len(z)] = z.numpy()
                if posterior:
                    out_lv[start : start + len(lv)] = lv.numpy()
            return out, out_lv

        return Pending(finish, wait)

    def _to_range(self, x):
        """float32 pixel values 0..255 -> ``input_range`` (in place)."""
        lo, hi = self.input_range
        if (lo, hi) == (-1.0, 1.0):
            return x.div_(127.5).sub_(1.0)  # the bytes every cache before input_range was made with
        return x.mul_((hi - lo) / 255.0).add_(lo)

    def latent_stats(self) -> dict[str, Any]:
        """What the cached latents are: ``{"normalized", "latents_mean", "latents_std"}``, the
        per-channel ``(latent_channels,)`` values a normalised cache was made with (``z_cached = (z -
        mean) / std``; undo with ``z = z_cached * std + mean``), else the VAE config's values (or None)
        that a trainer may apply itself."""
        stats = self._latent_stats(np.float64)  # the config's numbers as written
        mean, std = (None, None) if stats is None else (stats[0].tolist(), stats[1].tolist())
        return {"normalized": self.normalize, "latents_mean": mean, "latents_std": std}

    def describe(self) -> dict:
        """``class``, ``name``, ``config``, ``weights_sha256``, geometry, ``normalize``, ``dtype``,
        ``encode_version``, plus ``latents_mean``/``latents_std`` when the config has them, and the
        identity a recipe's contract compares (:func:`shardcache.weights.identity`: ``checkpoint_sha256`` of
        the files ``diffusers`` loads, ``numerics``; and ``loaded_from``, recorded, left out of the fingerprint).
        """
        cfg = clean_config(self.vae.config)
        d = {
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "name": self.name,
            "config": cfg,
            "weights_sha256": state_dict_sha256(self.vae),
            "dtype": str(self.dtype).replace("torch.", ""),
            "spatial_factor": int(self.spatial_factor),
            "latent_channels": int(self.latent_channels),
            "input_range": list(self.input_range),
            "normalize": self.normalize,
            "encode_version": ENCODE_VERSION,
        }
        for key in ("latents_mean", "latents_std"):
            if cfg.get(key) is not None:
                d[key] = cfg[key]
        d.update(identity(self.pretrained, dtype=self.dtype, device=self.device, library="diffusers",
                          subfolder=self.subfolder, revision=self.revision))   # what a contract compares
        return d

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(spatial_factor={self.spatial_factor}, latent_channels={self.latent_channels}, "
            f"normalize={self.normalize}, device={self.device}, dtype={self.dtype})"
        )


class WanVAEEncoder(DiffusersVAEEncoder):
    """Wan 2.1 VAE (diffusers ``AutoencoderKLWan``), the VAE of Cosmos-Predict2/2.5 (the default image encoder).

    ``spatial_factor`` = ``config.scale_factor_spatial`` (8), ``latent_channels`` = ``config.z_dim`` (16).
    ``latents_mean``/``latents_std``: 16 values each.
    """

    name = "wan"

    @classmethod
    def _model_class(cls):
        from diffusers import AutoencoderKLWan

        return AutoencoderKLWan

    def _init_geometry(self) -> None:
        cfg = self.vae.config
        self.spatial_factor = int(cfg.get("scale_factor_spatial") or 8)
        self.latent_channels = int(cfg["z_dim"])

    def _latent_stats(self, dtype=np.float32):
        cfg = self.vae.config
        mean, std = cfg.get("latents_mean"), cfg.get("latents_std")
        if mean is None or std is None:
            return None
        mean = np.asarray(mean, dtype=dtype)
        std = np.asarray(std, dtype=dtype)
        if mean.shape != (self.latent_channels,) or std.shape != (self.latent_channels,):
            raise ValueError(
                f"latents_mean/std must have {self.latent_channels} values, got {mean.shape} and {std.shape}"
            )
        return mean, std


class CosmosVAEEncoder(DiffusersVAEEncoder):
    """Cosmos 1.0 continuous tokenizer CV8x8x8 (diffusers ``AutoencoderKLCosmos``).

    ``spatial_factor`` = ``config.spatial_compression_ratio`` (8), ``latent_channels`` =
    ``config.latent_channels`` (16). ``latents_mean``/``latents_std`` hold 16 x K values (channel-major,
    K latent frames); frame 0 is used for images.
    """

    name = "cosmos"
    posterior_unsupported = (
        "AutoencoderKLCosmos encodes to an IdentityDistribution (a deterministic latent, no mean/logvar)"
    )

    @classmethod
    def _model_class(cls):
        from diffusers import AutoencoderKLCosmos

        return AutoencoderKLCosmos

    def _init_geometry(self) -> None:
        cfg = self.vae.config
        self.spatial_factor = int(cfg["spatial_compression_ratio"])
        self.latent_channels = int(cfg["latent_channels"])

    def _latent_stats(self, dtype=np.float32):
        cfg = self.vae.config
        mean, std = cfg.get("latents_mean"), cfg.get("latents_std")
        if mean is None or std is None:
            return None
        c = self.latent_channels
        mean = np.asarray(mean, dtype=dtype)
        std = np.asarray(std, dtype=dtype)
        if mean.size % c or std.size != mean.size or mean.size == 0:
            raise ValueError(f"latents_mean/std must hold a multiple of {c} values, got {mean.size} and {std.size}")
        # (C, K) channel-major as in the Cosmos 1.0 pipelines' .view(1, C, -1, 1, 1)[:, :, :frames]
        return np.ascontiguousarray(mean.reshape(c, -1)[:, 0]), np.ascontiguousarray(std.reshape(c, -1)[:, 0])


#: registry name -> wrapper class
IMAGE_ENCODERS: dict[str, type[DiffusersVAEEncoder]] = {
    "wan": WanVAEEncoder,
    "cosmos": CosmosVAEEncoder,
}
