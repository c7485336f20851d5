"""The resampler of the Higgs Audio v2 tokenizer's semantic branch: ``audio_tokenizer.resampler``.

transformers' ``HiggsAudioV2TokenizerModel`` feeds its semantic branch 16 kHz audio made from the 24 kHz
input with ``torchaudio.functional.resample``, and its module imports torchaudio at the top. Where no
torchaudio build loads (the CPU torch 2.13 wheels: PyPI's torchaudio 2.11 fails to load its extension
beside it), that module cannot even be imported. The option says what to do:

- ``torchaudio`` (the codec's default): torchaudio or a refusal naming it (``ImportError``).
- ``soxr``: that one call is computed with soxr ("HQ") instead. transformers' module is executed once more
  from its file as a module of its own (:data:`SOXR_MODULE`), with the name ``torchaudio`` bound, in that
  module's namespace only, to :data:`SOXR`: no ``torchaudio`` module is made, so nothing else sees one.
- ``auto``: torchaudio where it loads, else soxr, with a warning.

Codes made with soxr differ slightly from torchaudio's; the codec's ``describe()`` records which
resampler ran (``torchaudio 2.9.1``, ``soxr 0.5.0 HQ``), so such caches never share a fingerprint.
"""
from __future__ import annotations

import builtins
import functools
import importlib.util
import logging
import math
import sys
import types

log = logging.getLogger("precompute")

#: ``audio_tokenizer.resampler`` values
RESAMPLERS = ("torchaudio", "soxr", "auto")
MODULE = "transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer"


def resample(waveform, orig_freq: int, new_freq: int, **_ignored):
    """``torchaudio.functional.resample``'s contract computed with soxr ("HQ"): float tensor ``(..., time)``
    at ``orig_freq`` Hz -> ``(..., ceil(time * new_freq / orig_freq))`` at ``new_freq`` Hz, same dtype and
    device (computed on the CPU, row by row)."""
    import numpy as np
    import soxr
    import torch

    if int(orig_freq) == int(new_freq):
        return waveform
    x = waveform.detach().to("cpu", torch.float32).reshape(-1, waveform.shape[-1]).numpy()
    n = math.ceil(waveform.shape[-1] * int(new_freq) / int(orig_freq))
    out = np.zeros((x.shape[0], n), dtype=np.float32)
    for i, row in enumerate(x):
        y = soxr.resample(row, int(orig_freq), int(new_freq), "HQ")[:n]
        out[i, :len(y)] = y
    return torch.from_numpy(out).reshape(*waveform.shape[:-1], n).to(waveform.device, waveform.dtype)


#: what the name ``torchaudio`` means inside transformers' module with ``resampler: soxr``
SOXR = types.SimpleNamespace(functional=types.SimpleNamespace(resample=resample))


def torchaudio_version() -> str | None:
    """The version of the ``torchaudio`` this process can import, or None where it cannot."""
    try:
        import torchaudio
    except (ImportError, OSError):  # OSError: an extension built for another torch
        return None
    return torchaudio.__version__


#: the name of that copy of transformers' module (the module itself keeps its name: it never loads here)
SOXR_MODULE = __name__ + "._soxr_model"


@functools.cache
def _soxr_model_class() -> type:
    """``HiggsAudioV2TokenizerModel`` of transformers' module file executed as :data:`SOXR_MODULE`, with
    ``torchaudio`` bound to :data:`SOXR` in its namespace (once per process)."""
    spec = importlib.util.spec_from_file_location(SOXR_MODULE, importlib.util.find_spec(MODULE).origin)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = MODULE.rpartition(".")[0]  # its relative imports are transformers'

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        return SOXR if (name, level) == ("torchaudio", 0) else builtins.__import__(name, globals, locals, fromlist, level)

    module.__builtins__ = {**vars(builtins), "__import__": _import}
    sys.modules[spec.name] = module  # importlib's recipe: findable while it runs (inspect reads its file)
    spec.loader.exec_module(module)
    return module.HiggsAudioV2TokenizerModel


def model_class(resampler: str = "torchaudio") -> tuple[type, str]:
    """``(the HiggsAudioV2TokenizerModel class to load, the resampler it runs)`` for ``resampler`` (one of
    :data:`RESAMPLERS`). Raises ``ValueError`` for another value, ``ImportError`` for ``torchaudio`` where
    torchaudio cannot be imported (naming it and the way out)."""
    if resampler not in RESAMPLERS:
        raise ValueError(f"audio_tokenizer.resampler: expected one of {', '.join(RESAMPLERS)}, got {resampler!r}")
    version = torchaudio_version() if resampler != "soxr" else None
    if version is not None:
        from transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer import (
            HiggsAudioV2TokenizerModel)
        return HiggsAudioV2TokenizerModel, f"torchaudio {version}"
    if resampler == "torchaudio":
        import torch
        raise ImportError(f"the higgs audio tokenizer resamples its semantic input with torchaudio, which cannot be "
                          f"imported here; install the torchaudio build for torch {torch.__version__}, or set "
                          "audio_tokenizer.resampler: soxr (or auto) to resample with soxr (codes differ slightly; "
                          "recorded in the fingerprint)")
    if resampler == "auto":
        log.warning("audio_tokenizer.resampler auto: torchaudio cannot be imported here; the higgs tokenizer's "
                    "semantic input is resampled with soxr (codes differ slightly from torchaudio's; recorded in "
                    "the cache's fingerprint)")
    import soxr
    return _soxr_model_class(), f"soxr {soxr.__version__} HQ"
