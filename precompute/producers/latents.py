"""VAE latents of every image of a sample: ``latents`` ``(C, n_images, H/8, W/8)`` and, with
``store_posterior``, ``latents_logvar`` (the Gaussian posterior's log-variance)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import Producer, Timer, encode_each


class LatentsProducer(Producer):
    """Latents from ``vae`` (an :class:`precompute.encoders.ImageEncoder`): images of one encoder
    batch are encoded in groups of equal size; image ``k`` of a sample is ``latents[:, k]``.
    ``posterior``: also ``latents_logvar`` (``vae.encode_posterior``)."""

    name = "latents"
    needs_images = True

    def __init__(self, vae: Any, posterior: bool = False, field: str = "latents"):
        self.vae, self.posterior, self.field = vae, bool(posterior), field
        self.outputs = (field, f"{field}_logvar") if posterior else (field,)

    def describe(self) -> dict[str, Any]:
        return self.vae.describe()

    def manifest_info(self) -> dict[str, Any]:
        return {"latent_channels": int(self.vae.latent_channels)}

    def produce(self, samples: list, timer: Timer) -> list[dict[str, Any] | Exception]:
        by_shape: dict[tuple, list[tuple[int, int]]] = {}
        for j, s in enumerate(samples):
            for k, img in enumerate(s.images):
                by_shape.setdefault(img.shape, []).append((j, k))
        if self.posterior:
            fn = lambda imgs: list(zip(*self.vae.encode_posterior(np.stack(imgs))))  # noqa: E731
        else:
            fn = lambda imgs: list(self.vae.encode(np.stack(imgs)))  # noqa: E731
        got: dict[tuple[int, int], Any] = {}
        for group in by_shape.values():
            for jk, z in zip(group, encode_each(fn, [samples[j].images[k] for j, k in group], timer)):
                got[jk] = z
        out: list[dict[str, Any] | Exception] = []
        for j, s in enumerate(samples):
            zs = [got[(j, k)] for k in range(len(s.images))]
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
