"""Tiny (and full-size) random image VAEs of the real architectures (diffusers ``AutoencoderKLWan``,
``AutoencoderKLCosmos``): the tiny configs keep the real latent contract (16 channels, 8x downsampling)."""
from __future__ import annotations

from typing import Callable


def wan_kwargs(size: str = "tiny") -> dict:
    """``AutoencoderKLWan`` constructor kwargs (``{}`` = the real default config)."""
    if size == "tiny":
        return dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    return {}


def cosmos_kwargs(size: str = "tiny") -> dict:
    """``AutoencoderKLCosmos`` constructor kwargs (``{}`` = the real default config)."""
    if size == "tiny":
        return dict(
            latent_channels=16,
            encoder_block_out_channels=(8, 16, 16, 16),
            decode_block_out_channels=(16, 16, 16, 16),
            num_layers=1,
        )
    return {}


def make_wan(size: str = "tiny", seed: int = 0):
    """Random ``AutoencoderKLWan`` (tiny or the real default config)."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**wan_kwargs(size)).eval()


def make_cosmos(size: str = "tiny", seed: int = 0):
    """Random ``AutoencoderKLCosmos`` (tiny or the real default config)."""
    import torch
    from diffusers import AutoencoderKLCosmos

    torch.manual_seed(seed)
    return AutoencoderKLCosmos(**cosmos_kwargs(size)).eval()


MAKERS: dict[str, Callable] = {"wan": make_wan, "cosmos": make_cosmos}
