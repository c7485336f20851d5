"""``torchaudio.functional.resample`` of the test stand-in: the product's soxr resampler of the Higgs
tokenizer (:func:`precompute.encoders.higgs_resampler.resample`), under torchaudio's name."""
from precompute.encoders.higgs_resampler import resample  # noqa: F401
