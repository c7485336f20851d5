"""A plug-in image encoder whose latents break the protocol (tests only), loaded with ``--image_encoder``
``plugin_bad_vae:make``: ``mode`` says how (:data:`MODES`); its latents are otherwise a deterministic function of
the pixels (each 8x8 cell's mean per channel, then 4 channels of it), of the declared shape
``(B, latent_channels, 1, H / 8, W / 8)`` float32."""
from __future__ import annotations

import numpy as np

#: mode -> what the latents ``(B, C, 1, h, w)`` of a batch become
MODES = {
    "narrow": lambda z: z[..., :-1],                                    # one latent column short
    "channels": lambda z: z[:, :-1],                                    # 3 of the 4 channels it declares
    "no_frame_axis": lambda z: z[:, :, 0],                              # (B, C, h, w): a 3-D array per image
    "nan": lambda z: np.where(np.arange(z.shape[-1]) == 1, np.nan, z).astype(np.float32),
    "inf": lambda z: np.where(np.arange(z.shape[-1]) == 2, np.inf, z).astype(np.float32),
    "integers": lambda z: np.round(z).astype(np.int32),
}


class BadVAE:
    spatial_factor = 8
    latent_channels = 4

    def __init__(self, mode: str):
        self.mode = mode

    def encode(self, images: np.ndarray) -> np.ndarray:
        b, h, w, _ = images.shape
        cells = images.reshape(b, h // 8, 8, w // 8, 8, 3).mean(axis=(2, 4)) / 255.0  # (B, h, w, 3)
        z = np.concatenate([cells, cells.mean(-1, keepdims=True)], axis=-1)  # (B, h, w, 4)
        z = np.ascontiguousarray(z.transpose(0, 3, 1, 2)[:, :, None]).astype(np.float32)  # (B, 4, 1, h, w)
        return MODES[self.mode](z)

    def describe(self):
        return {"class": "plugin_bad_vae.BadVAE", "name": "bad-vae", "config": {"mode": self.mode},
                "weights_sha256": "0" * 64}


def make(mode: str, device: str = "cpu") -> BadVAE:
    return BadVAE(mode)
