"""Training step time: cached shards vs the uncached pipeline the seed scripts ran every step.

Same model (``train.models.ReferenceModel``), same batches (the same rows, same batch size), same
optimizer, in one run:

* ``cached``: ``loaders.ShardLoader`` batches of the precomputed cache -> forward/backward/step.
* ``uncached``: for every batch, decode + resample each audio file, run the codec, run the VAE
  on each image, tokenize, collate with the same ``collate_fn`` -> forward/backward/step.

Reports median seconds per step (after warm-up) and the ratio uncached / cached, for the tiny
test encoders and the real-size (randomly initialised) DAC and Wan configs.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from loaders import Order, ShardLoader, collate_fn
from precompute.encode import Summary
from precompute.job import Job
from precompute.manifests import read_requests
from shards import Cache
from train.models import ReferenceModel

FIELDS = ("codes", "input_ids", "latents")


def _step(model, opt, batch) -> None:
    out = model(batch)
    loss = out["loss"] if isinstance(out, dict) else out
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _uncached_batch(reqs, pipe) -> dict:
    """What a training step pays without a cache: decode, resample, codec, VAE, tokenize, collate."""
    enc, cfg = pipe.enc, pipe.cfg
    prepared = [pipe.prepare(r) for r in reqs]
    samples = []
    with torch.inference_mode():
        encoded = pipe.encode(prepared, Summary())
    for key, fields, _ in encoded:
        samples.append({"__key__": key, "codes": fields["codes.npy"], "input_ids": fields["input_ids.npy"],
                        **({"latents": fields["latents.npy"]} if "latents.npy" in fields else {})})
    grid = cfg.image_size // enc.image.spatial_factor
    return collate_fn(samples, fields=FIELDS, latent_shape=(enc.image.latent_channels, 1, grid, grid))


def bench(manifest: Path, cache: Path, cfg, batch_size: int = 4, steps: int = 4, warmup: int = 1) -> dict:
    """Median step seconds, cached vs uncached, over the first ``steps`` batches of epoch 0."""
    torch.manual_seed(0)
    model = ReferenceModel.from_cache(Cache.open(cache), {"d_model": 128, "n_layers": 2})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = ShardLoader(cache, batch_size, fields=FIELDS, order=Order(shuffle=False))
    loader.set_epoch(0)
    keys_in_order, cached_times = [], []
    it = iter(loader)
    for i in range(warmup + steps):
        t = time.perf_counter()
        batch = next(it)
        _step(model, opt, batch)
        if i >= warmup:
            cached_times.append(time.perf_counter() - t)
        keys_in_order.append(batch["keys"])
    loader.close()
    pipe = Job.build(cfg, "cpu")
    by_key = {r.key: r for r in read_requests(manifest) if r.error is None}
    uncached_times = []
    for i, keys in enumerate(keys_in_order):
        t = time.perf_counter()
        batch = _uncached_batch([by_key[k] for k in keys], pipe)
        _step(model, opt, batch)
        if i >= warmup:
            uncached_times.append(time.perf_counter() - t)
    cached, uncached = statistics.median(cached_times), statistics.median(uncached_times)
    return {"batch_size": batch_size, "steps": steps, "cached_step_s": round(cached, 4),
            "uncached_step_s": round(uncached, 4), "uncached_over_cached": round(uncached / cached, 1)}
