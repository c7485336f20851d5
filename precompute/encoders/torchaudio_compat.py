"""``torchaudio`` for the Higgs audio tokenizer where the real one cannot be imported.

``transformers``' ``HiggsAudioV2TokenizerModel`` imports torchaudio at module level and calls one
function of it, ``torchaudio.functional.resample``, to bring its semantic branch's input from 24 kHz
to 16 kHz. torchaudio has no build for some torch releases (none loads beside the CPU torch 2.13
of the development machines). Where the real module imports, it is used, untouched. Where it does
not, :func:`ensure_torchaudio` puts a module named ``torchaudio`` in ``sys.modules`` whose
``functional.resample`` is soxr's high-quality resampler (the one stage one uses for every waveform),
so the tokenizer loads and runs; its codes then come from a (slightly) different resampling than
torchaudio's windowed-sinc one, so the codec's ``describe()`` records the resampler
(``resampler: soxr``) and a cache made this way has another fingerprint than one made with
torchaudio, and a warning says so. A model whose semantic rate equals its input rate never resamples.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import math
import sys
import types

log = logging.getLogger("precompute")

#: attribute of the fallback module (absent from the real torchaudio)
MARK = "__shardcache_soxr_fallback__"


def resample(waveform, orig_freq: int, new_freq: int, **_ignored):
    """``torchaudio.functional.resample``'s contract with soxr ("HQ"): ``waveform`` float tensor
    ``(..., time)`` at ``orig_freq`` Hz -> ``(..., ceil(time * new_freq / orig_freq))`` at
    ``new_freq`` Hz, same dtype and device (computed on the CPU)."""
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


def torchaudio_importable() -> bool:
    """Whether the real ``torchaudio`` imports here (False where it is missing or cannot load its
    extension against this torch)."""
    mod = sys.modules.get("torchaudio")
    if mod is not None:
        return not getattr(mod, MARK, False)
    if importlib.util.find_spec("torchaudio") is None:
        return False
    try:
        import torchaudio  # noqa: F401
    except Exception:  # noqa: BLE001 - OSError from its extension, ImportError...
        for name in [m for m in sys.modules if m == "torchaudio" or m.startswith("torchaudio.")]:
            sys.modules.pop(name, None)
        return False
    return True


def ensure_torchaudio() -> str:
    """``"torchaudio"`` when the real module imports; else install the soxr fallback (once, with a
    warning) and return ``"soxr"``. Tells ``transformers`` either way (it caches whether torchaudio
    is available)."""
    if torchaudio_importable():
        return "torchaudio"
    if "torchaudio" not in sys.modules:
        mod = types.ModuleType("torchaudio")
        mod.__spec__ = importlib.machinery.ModuleSpec("torchaudio", loader=None)
        mod.__version__ = "0+shardcache-soxr"
        setattr(mod, MARK, True)
        fn = types.ModuleType("torchaudio.functional")
        fn.__spec__ = importlib.machinery.ModuleSpec("torchaudio.functional", loader=None)
        fn.resample = resample
        mod.functional = fn
        sys.modules["torchaudio"], sys.modules["torchaudio.functional"] = mod, fn
        log.warning("torchaudio cannot be imported here: the Higgs audio tokenizer resamples its semantic input "
                    "with soxr instead (codes may differ slightly from torchaudio's; recorded as resampler: soxr)")
    try:
        from transformers.utils import import_utils
        import_utils.is_torchaudio_available.cache_clear()
    except (ImportError, AttributeError):  # pragma: no cover - older transformers: nothing cached
        pass
    return "soxr"


__all__ = ["ensure_torchaudio", "torchaudio_importable", "resample"]
