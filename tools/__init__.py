"""Support code of the repository, not of the product (not in the wheel): the tiny test-model
builder (:mod:`tools.testing`, ``make models``) and the test-only ``torchaudio`` stand-in
(:mod:`tools.torchaudio_shim`)."""
