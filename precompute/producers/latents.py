"""VAE latents of every image of a sample: ``latents`` ``(C, n_images, H/8, W/8)`` and, with
``store_posterior``, ``latents_logvar`` (the Gaussian posterior's log-variance)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..effects import BYTES, SPEC
from ..encoders.capabilities import Pending, capabilities_of
from .base import Producer, Timer, encode_each, encoder_spec_problems, submit_each


class LatentsProducer(Producer):
    """Latents from ``vae`` (an :class:`precompute.encoders.ImageEncoder`): images of one encoder
    batch are encoded in groups of equal size; image ``k`` of a sample is ``latents[:, k]``.
    ``posterior``: also ``latents_logvar`` (``vae.encode_posterior``). Each image's latents are checked
    against the encoder's declaration first (:func:`latents_problem`): one that breaks it rejects its sample."""

    name = "latents"
    needs_images = True
    OPTION_EFFECTS = {"producer": BYTES, "image_encoder": SPEC, "store_posterior": BYTES}

    @classmethod
    def spec_problems(cls, field: str, **spec: Any) -> list[tuple[str, str]]:
        """The ``image_encoder`` spec's problems (its declared options and bounds)."""
        return encoder_spec_problems("image_encoder", spec)

    @classmethod
    def from_spec(cls, field: str, device: str = "cpu", image_encoder: Any = None, store_posterior: bool = False,
                  **_: Any) -> "LatentsProducer":
        """``{producer: latents, image_encoder: {name, pretrained, ...}, store_posterior}``: the VAE's latents."""
        from ..encoders import load_image_encoder
        if not image_encoder:
            raise ValueError(f"producer latents for {field!r} needs an image_encoder spec ({{name, pretrained}})")
        return cls(load_image_encoder(image_encoder, device), bool(store_posterior), field)

    def __init__(self, vae: Any, posterior: bool = False, field: str = "latents", info: dict | None = None,
                 device: str = "cpu"):
        self.vae, self.posterior, self.field = vae, bool(posterior), field
        self.caps = capabilities_of(vae, device)  # declared: async submit
        self.outputs = (field, f"{field}_logvar") if posterior else (field,)
        self.info = info  # manifest.json ``latents``: how they were made (see latents_info)

    def describe(self) -> dict[str, Any]:
        return self.vae.describe()

    def manifest_info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"latent_channels": int(self.vae.latent_channels)}
        if self.info is not None:
            out["latents"] = self.info
        return out

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        return self.submit(samples, timer).result()

    def _checked(self, z: Any, image: np.ndarray, k: int) -> Any:
        """``z`` (an image's latents, or ``(mean, logvar)``), or the :class:`LatentsRefused` of its values."""
        for part, name in ((z[0], self.field), (z[1], f"{self.field}_logvar")) if self.posterior else ((z, self.field),):
            why = latents_problem(part, self.vae, image.shape)
            if why is not None:
                return LatentsRefused(f"{name}: image {k}: {why}")
        return z

    def submit(self, samples: list, timer: Timer) -> Pending:
        by_shape: dict[tuple, list[tuple[int, int]]] = {}
        for j, s in enumerate(samples):
            for k, img in enumerate(s.images):
                by_shape.setdefault(img.shape, []).append((j, k))
        groups = []
        for group in by_shape.values():
            imgs = [samples[j].images[k] for j, k in group]
            if self.caps.asynchronous:  # one call per group of equal shapes; one wait for the batch
                def each(batch, posterior=self.posterior):
                    pend = self.vae.submit(np.stack(batch), posterior)
                    return Pending(lambda: list(zip(*pend.result())) if posterior else list(pend.result()[0]))
                groups.append((group, submit_each(each, imgs)))
            else:
                if self.posterior:
                    fn = lambda imgs: list(zip(*self.vae.encode_posterior(np.stack(imgs))))  # noqa: E731
                else:
                    fn = lambda imgs: list(self.vae.encode(np.stack(imgs)))  # noqa: E731
                groups.append((group, Pending.done(encode_each(fn, imgs, timer))))

        def finish() -> list[dict[str, Any] | Exception]:
            got: dict[tuple[int, int], Any] = {}
            for group, pend in groups:
                for jk, z in zip(group, pend.result()):
                    got[jk] = z
            out: list[dict[str, Any] | Exception] = []
            for j, s in enumerate(samples):
                zs = [got[(j, k)] if isinstance(got[(j, k)], Exception) else self._checked(got[(j, k)], img, k)
                      for k, img in enumerate(s.images)]
                bad = next((z for z in zs if isinstance(z, Exception)), None)
                if bad is not None:
                    out.append(bad)
                elif not zs:
                    out.append({})
                elif self.posterior:
                    out.append({self.field: np.concatenate([np.asarray(m, np.float32) for m, _ in zs], axis=1),
                                f"{self.field}_logvar": np.concatenate([np.asarray(v, np.float32) for _, v in zs], axis=1)})
                else:
                    out.append({self.field: np.concatenate([np.asarray(z, np.float32) for z in zs], axis=1)})
            return out

        return Pending(finish)


class LatentsRefused(ValueError):
    """An image's latents break the image encoder's declaration (:meth:`LatentsProducer.latents_problem`): a
    row fault, its sample rejected ``encode_failed`` with this message (the field, the image, the value)."""


def latents_problem(z: Any, vae: Any, shape: tuple) -> str | None:
    """Why one image's latents ``z`` break :meth:`precompute.encoders.base.ImageEncoder.encode`'s declaration
    for an image of ``shape`` ``(H, W, 3)``: not a float array of ``(latent_channels, 1, H // spatial_factor,
    W // spatial_factor)`` (finiteness: the field's kind, :func:`precompute.encode.to_members`). None: kept."""
    try:
        a = np.asarray(z)
    except (ValueError, TypeError) as e:
        return f"latents that are not one array ({type(e).__name__}: {e})"
    sf, c = int(vae.spatial_factor), int(vae.latent_channels)
    want = (c, 1, int(shape[0]) // sf, int(shape[1]) // sf)
    if a.dtype.kind != "f":
        return f"{a.dtype} latents, expected floats"
    if a.shape != want:
        return (f"latents of shape {tuple(a.shape)} for a {shape[0]}x{shape[1]} image, expected {want}: "
                f"latent_channels x 1 x H/{sf} x W/{sf}")
    return None


def latents_info(cfg: Any, image_encoder: Any) -> dict[str, Any]:
    """``manifest.json`` ``latents``: how the cached latents were made, for the trainer.

    ``resize``/``size``/``interpolation``/``rgb`` (:mod:`precompute.images`), ``input_range`` (the
    pixel values the VAE was fed), ``dtype`` (the VAE's compute dtype), ``normalized`` with the
    per-channel ``latents_mean``/``latents_std`` (the values applied when normalised, else the VAE
    config's, null when it has none; :meth:`precompute.encoders.image.DiffusersVAEEncoder.latent_stats`).
    """
    from ..encoders.image import PIXEL_RANGES
    from shards.pixels import RESAMPLE
    facts = dict(capabilities_of(image_encoder).latents or {})  # declared; a plug-in: the config's range only
    rng = facts.pop("input_range", None) or PIXEL_RANGES[cfg.image_pixel_range]
    out = {"resize": cfg.image_resize, "size": cfg.image_size, "interpolation": RESAMPLE[cfg.image_resize].name.lower(),
           "rgb": cfg.image_rgb, "input_range": [float(v) for v in rng], "dtype": facts.pop("dtype", None),
           "store_posterior": cfg.store_posterior}
    return out | (facts or {"normalized": None})
