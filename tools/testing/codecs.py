"""Tiny (and full-size) random audio codecs of the real architectures: DAC, EnCodec, Mimi.

Random EnCodec and Mimi inits have all-zero codebook buffers (every frame gets code 0). Their codebooks
are filled here from a fixed calibration signal (chirp + noise), level by level as residual VQ works:
each quantizer's entries are Gaussian with the per-dimension mean and std of the residual reaching
it, and the ``cluster_size``/``cluster_usage``/``inited`` buffers are set (Mimi's cached
``codebook._embed`` is reset). Loading back gives non-constant codes. DAC's codebooks are
``nn.Embedding`` and need no fix.
"""
from __future__ import annotations

import math
from typing import Any, Callable


def dac_config(size: str = "tiny"):
    """``DacConfig`` with the Higgs Audio v2 tokenizer's code contract (24 kHz, hop 960, 8 x 1024)."""
    from transformers import DacConfig

    kw: dict[str, Any] = dict(
        downsampling_ratios=[8, 5, 4, 2, 3],
        upsampling_ratios=[8, 5, 4, 2, 3],
        hop_length=960,
        sampling_rate=24000,
        n_codebooks=8,
        codebook_size=1024,
    )
    if size == "tiny":
        kw.update(encoder_hidden_size=8, decoder_hidden_size=64, hidden_size=32, codebook_dim=8)
    return DacConfig(**kw)


def encodec_config(size: str = "tiny"):
    """``EncodecConfig`` of the 24 kHz model (full) or a narrow copy of it (tiny)."""
    from transformers import EncodecConfig

    if size == "tiny":
        return EncodecConfig(hidden_size=32, num_filters=4, num_lstm_layers=1, codebook_size=1024)
    return EncodecConfig()


def mimi_config(size: str = "tiny"):
    """``MimiConfig`` of kyutai/mimi (full) or a narrow copy with 8 codebooks (tiny)."""
    from transformers import MimiConfig

    if size == "tiny":
        return MimiConfig(
            hidden_size=32,
            num_filters=4,
            num_hidden_layers=1,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            codebook_dim=16,
            vector_quantization_hidden_dimension=16,
            num_quantizers=8,
            upsample_groups=32,
        )
    return MimiConfig()


def calibration_audio(sample_rate: int = 24000, seconds: float = 2.0, seed: int = 0):
    """float32 torch ``(1, 1, T)``: a 100 Hz -> 4 kHz chirp with amplitude modulation plus noise, peak < 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = int(sample_rate * seconds)
    t = torch.arange(n, dtype=torch.float64) / sample_rate
    f0, f1 = 100.0, 4000.0
    phase = 2 * math.pi * (f0 * t + (f1 - f0) * t * t / (2 * seconds))
    x = 0.4 * torch.sin(phase) * (0.6 + 0.4 * torch.sin(2 * math.pi * 3 * t))
    x = x + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    return x.clamp(-0.99, 0.99).to(torch.float32).view(1, 1, n)


def _fill_codebooks(layers, residual, g, set_entries: Callable) -> None:
    """Data-matched random init of residual VQ ``layers`` from ``residual`` ``(B, D, frames)``, level by level
    (in the codebook's space: after the layer's ``project_in`` where it has one, as the Higgs tokenizer's)."""
    import torch

    for layer in layers:
        frames = residual.permute(0, 2, 1).reshape(-1, residual.shape[1])
        project = getattr(layer, "project_in", None)
        if project is not None:
            frames = project(frames)
        k = layer.codebook.codebook_size
        mean = frames.mean(dim=0, keepdim=True)
        spread = frames.std(dim=0, keepdim=True).clamp_min(1e-6)
        # Gaussian entries with the residual's per-dimension statistics: spread out like a trained
        # codebook (copies of calibration frames would create many near-ties between entries)
        entries = mean + spread * torch.randn(k, frames.shape[1], generator=g)
        set_entries(layer.codebook, entries)
        codes = layer.encode(residual)
        residual = residual - layer.decode(codes)


def _set_encodec_entries(cb, entries) -> None:
    """EnCodec's and the Higgs tokenizer's ``EuclideanCodebook`` buffers."""
    cb.embed.copy_(entries)
    cb.embed_avg.copy_(entries)
    cb.cluster_size.fill_(1.0)
    cb.inited.fill_(1.0)


def _set_mimi_entries(cb, entries) -> None:
    cb.embed_sum.copy_(entries)  # embed = embed_sum / cluster_usage
    cb.cluster_usage.fill_(1.0)
    cb.initialized.fill_(1.0)
    cb._embed = None  # drop the cached embed so the next access recomputes it


def make_dac(size: str = "tiny", seed: int = 0):
    """Random ``DacModel`` (eval mode) of the given size."""
    import torch
    from transformers import DacModel

    torch.manual_seed(seed)
    return DacModel(dac_config(size)).eval()


def make_encodec(size: str = "tiny", seed: int = 0):
    """Random ``EncodecModel`` with calibrated (non-zero) codebooks."""
    import torch
    from transformers import EncodecModel

    torch.manual_seed(seed)
    model = EncodecModel(encodec_config(size)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = model.encoder(calibration_audio(model.config.sampling_rate, seed=seed))
        _fill_codebooks(model.quantizer.layers, emb, g, _set_encodec_entries)
    return model


def make_mimi(size: str = "tiny", seed: int = 0):
    """Random ``MimiModel`` with calibrated (non-zero) semantic and acoustic codebooks."""
    import torch
    from transformers import MimiModel

    torch.manual_seed(seed)
    model = MimiModel(mimi_config(size)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        out = model.encoder(calibration_audio(model.config.sampling_rate, seed=seed))
        latents = getattr(out, "latents", out)  # a tensor before transformers 5.x returned an output object
        for rvq in (model.quantizer.semantic_residual_vector_quantizer, model.quantizer.acoustic_residual_vector_quantizer):
            x = rvq.input_proj(latents) if rvq.input_proj is not None else latents
            _fill_codebooks(rvq.layers, x, g, _set_mimi_entries)
    return model



MAKERS: dict[str, Callable] = {"dac": make_dac, "encodec": make_encodec, "mimi": make_mimi}
