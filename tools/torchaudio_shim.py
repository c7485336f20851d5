"""Make ``import torchaudio`` work in tests where the real one cannot load (no torchaudio build
loads beside the CPU torch 2.13 of the development machines), for the tiny Higgs audio tokenizer.

:func:`install` puts ``tools/shims`` (a ``torchaudio`` package whose ``functional.resample`` is
soxr's) first on ``sys.path`` and on ``PYTHONPATH`` (so subprocesses and loader workers see it too).
The product never does this: its ``higgs`` codec takes ``resampler: soxr | auto`` instead
(:mod:`precompute.encoders.higgs_resampler`, which makes no torchaudio module).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SHIMS = Path(__file__).resolve().parent / "shims"


def real_torchaudio_loads() -> bool:
    """Whether the real ``torchaudio`` imports here (checked in a fresh process: a failed import
    can leave half-initialised extension state behind)."""
    if importlib.util.find_spec("torchaudio") is None:
        return False
    r = subprocess.run([sys.executable, "-c", "import torchaudio"], capture_output=True,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONNOUSERSITE": "1"})
    return r.returncode == 0


def install() -> str:
    """``"torchaudio"`` when the real module loads (nothing changed); else put the stand-in on
    ``sys.path`` and ``PYTHONPATH`` and return ``"shim"``. Call it before ``transformers`` is imported
    (it caches whether torchaudio is available)."""
    if str(SHIMS) in sys.path:
        return "shim"
    if real_torchaudio_loads():
        return "torchaudio"
    sys.path.insert(0, str(SHIMS))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIMS), os.environ.get("PYTHONPATH")) if p)
    return "shim"


__all__ = ["install", "real_torchaudio_loads", "SHIMS"]
