"""A stand-in ``torchaudio`` for tests only (never installed by the product): a directory put on
``sys.path`` by :func:`tools.torchaudio_shim.install` where the real torchaudio cannot load.

It has the one function ``transformers``' Higgs audio tokenizer calls, ``functional.resample``,
computed with soxr ("HQ"); its ``__version__`` says so, and the codec's ``describe()`` records the
torchaudio version, so a cache made with it never shares a fingerprint with one made with torchaudio.
"""
from . import functional  # noqa: F401

__version__ = "0+soxr-test-shim"
