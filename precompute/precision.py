"""Half-precision guard: run the encoders in bf16/fp16 only where they match fp32 on real inputs.

A codec or VAE in bf16/fp16 is faster on GPUs, but whether its codes and latents stay close to
fp32 depends on the architecture and the weights, so it is measured, not assumed. Before a job
encodes anything with ``encoder_dtype`` other than float32, :func:`check_precision` encodes up to
``precision_samples`` rows of the job itself with both the half-precision encoders and float32
copies of them, and measures

* ``latents_rel_err``: the largest ``||z_half - z_fp32|| / ||z_fp32||`` over the images;
* ``codes_agreement``: the fraction of audio codes that are identical.

The job stops with :class:`PrecisionMismatch` when either is outside ``precision_tolerance``; the
measured numbers are stored in ``manifest.json`` under ``precision_check`` either way.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from shards.errors import ShardcacheError

from .config import PrecisionTolerance


class PrecisionMismatch(ShardcacheError):
    """Half-precision encoders differ from float32 by more than the configured tolerance."""


def measure(half: Any, ref: Any, prepared: list) -> dict[str, Any]:
    """Compare two :class:`precompute.job.Encoders` on decoded rows (:class:`Prepared`, errors skipped).

    Returns ``{"samples", "images", "latents_rel_err", "codes_agreement"}`` (None where no row
    had an image / audio).
    """
    good = [p for p in prepared if p.error is None]
    audio = [w[half.audio.sample_rate] for p in good for w in p.audio] if half.audio is not None else []
    agree = total = 0
    if audio:
        for a, b in zip(half.audio.encode(audio), ref.audio.encode(audio)):
            agree += int((np.asarray(a) == np.asarray(b)).sum())
            total += int(np.asarray(b).size)
    errs = []
    images = [im for p in good for im in p.images] if half.image is not None else []
    for img in images:
        z_half = np.asarray(half.image.encode(img[None]), dtype=np.float64)
        z_ref = np.asarray(ref.image.encode(img[None]), dtype=np.float64)
        errs.append(float(np.linalg.norm(z_half - z_ref) / max(np.linalg.norm(z_ref), 1e-12)))
    return {"samples": len(good), "images": len(errs),
            "latents_rel_err": round(max(errs), 6) if errs else None,
            "codes_agreement": round(agree / total, 6) if total else None}


def check_precision(half: Any, ref: Any, prepared: list, tolerance: PrecisionTolerance | None = None,
                    dtype: str = "") -> dict[str, Any]:
    """:func:`measure`, then raise :class:`PrecisionMismatch` if outside ``tolerance``.

    ``tolerance``: the config's ``precision_tolerance`` (default: its defaults). Returns the
    measurement with the tolerance added.
    """
    tol = dataclasses.asdict(tolerance or PrecisionTolerance())
    result = measure(half, ref, prepared) | {"dtype": dtype, "tolerance": tol}
    bad = []
    if result["latents_rel_err"] is not None and result["latents_rel_err"] > tol["latents_rel_err"]:
        bad.append(f"latents differ from float32 by {result['latents_rel_err']:.4f} (relative L2) "
                   f"> {tol['latents_rel_err']}")
    if result["codes_agreement"] is not None and result["codes_agreement"] < tol["codes_agreement"]:
        bad.append(f"only {result['codes_agreement']:.2%} of codes equal float32's < {tol['codes_agreement']:.0%}")
    if bad:
        raise PrecisionMismatch(
            f"encoder_dtype={dtype} is not safe for these encoders on {result['samples']} samples of this job: "
            + "; ".join(bad) + ". Use encoder_dtype: float32 (or loosen precision_tolerance if you accept it).")
    return result
