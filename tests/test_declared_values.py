"""Issue 49 item 2: every value is checked against a declaration before it is used.

An encoder's output (a plug-in's here, built-in codecs go through the same check) against the field and the
codec's declaration: integer codes of ``n_codebooks x`` the frames the codec's rule gives for the clip, in
``[0, codebook_size)``; a plug-in VAE's latents against its ``latent_channels`` / ``spatial_factor``: floats of
``(latent_channels, 1, H / spatial_factor, W / spatial_factor)``, finite. A clip or image that breaks it rejects
its own row, naming the field and the value, and the job goes on. Every encoder spec value against the type and bounds its option declares, at config time: exit 2
naming the option before any model loads or any folder is made."""
from __future__ import annotations

import dataclasses
import math

import pytest

from conftest import DEMO, ROOT

#: good demo rows with audio only (their durations: the demo cache's index)
ROWS = ("spk-us-0001", "spk-us-0002", "spk-gb-0003", "spk-gb-0004", "spk-usf-0005", "spk-rp-0006")
BAD_S = 2.5


@pytest.fixture(scope="module")
def six_rows(tmp_path_factory):
    import json
    lines = [line for line in (DEMO / "samples.jsonl").read_text().splitlines()
             if any(f'"key": "{k}"' in line for k in ROWS)]
    assert [json.loads(line)["key"] for line in lines] == list(ROWS)
    out = tmp_path_factory.mktemp("six") / "six.jsonl"
    out.write_text("".join(line + "\n" for line in lines))
    return out


@pytest.fixture(scope="module")
def long_keys(demo_cache):
    from shards import read_index
    durations = dict(zip(*read_index(demo_cache).select(["key", "duration_s"]).to_pydict().values()))
    keys = {k for k in ROWS if durations[k] > BAD_S}
    assert 0 < len(keys) < len(ROWS)
    return keys


@pytest.mark.parametrize("mode,named", [
    ("nan", "float32 codes (e.g. nan), expected integer codes in [0, 256)"),
    ("zero_frames", "codes of shape (4, 0) for a clip of"),
    ("one_frame", "codes of shape (4, 1) for a clip of"),
    ("triple_frames", "codes of shape (4, {3f}) for a clip of"),
    ("codebooks", "codes of shape (3, {f}) for a clip of"),
    ("out_of_range", "code 256 outside [0, 256) (codebook_size)"),
    ("fewer_outputs", "the encoder returned 0 output(s) for 1 input(s)"),
])
def test_a_plugin_codecs_bad_codes_reject_their_row_naming_field_and_value(tiny_config, six_rows, long_keys,
                                                                          demo_cache, tmp_path, mode, named):
    """Float codes with a NaN crashed the job (IndexError in the value check, exit 1); codes of 0, 1 or 3x the
    frames, or of another codebook count, were kept and would train. Now each is a reject of its own row."""
    from shards import read_index, read_rejects
    from precompute.job import run
    cfg = dataclasses.replace(tiny_config, image_encoder=None, encoder_batch_size=8, audio_tokenizer={
        "factory": "plugin_bad_codec:make", "kwargs": {"mode": mode, "bad_s": BAD_S}})
    summary, _ = run(six_rows, tmp_path / "c", cfg, root=DEMO, progress=False)
    rejects = {r["key"]: r for r in read_rejects(tmp_path / "c").to_pylist()}
    assert set(rejects) == long_keys
    durations = dict(zip(*read_index(demo_cache).select(["key", "duration_s"]).to_pydict().values()))
    for key, r in rejects.items():
        frames = math.ceil(round(durations[key] * 16000) / 320)  # the protocol's rule: ceil(samples / hop)
        assert r["reason"] == "encode_failed"
        detail = named.format(f=frames, **{"3f": 3 * frames})
        assert detail in r["detail"], r["detail"]
        if mode != "fewer_outputs":
            assert "codes: audio item 0: " in r["detail"], r["detail"]  # the field and the item
    assert set(read_index(tmp_path / "c").column("key").to_pylist()) == set(ROWS) - long_keys
    assert summary.kept == len(ROWS) - len(long_keys)


def test_the_built_in_codecs_codes_pass_their_own_declaration(tiny_models):
    """The check holds the built-in codecs to their declared rule (DAC: ``ceil(n / hop)``, a clip padded to the
    hop): their codes of clips of every length pass it, and a frame more or less does not."""
    import numpy as np

    from precompute.encoders import load_audio_tokenizer
    from precompute.encoders.base import codes_problem
    codec = load_audio_tokenizer({"name": "dac", "pretrained": str(tiny_models / "dac-tiny")})
    hop = codec.hop_length
    for n in (1, hop - 1, hop, hop + 1, 5 * hop + 7):
        codes = codec.encode([np.zeros(n, np.float32) + 0.1])[0]
        assert codes.shape == (codec.n_codebooks, -(-n // hop))
        assert codes_problem(codes, codec, n) is None
        assert "expected" in codes_problem(np.concatenate([codes, codes[:, :1]], axis=1), codec, n)
        assert "expected" in codes_problem(codes[:, 1:], codec, n)


# ---- encoder spec values at config time ----------------------------------------------------------------------

@pytest.fixture
def no_precompute(monkeypatch):
    from precompute import cli
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("the job started"))
    return cli


@pytest.mark.parametrize("flag,message", [
    ("--audio_tokenizer.processes=0", "audio_tokenizer.processes: expected an integer >= 1 and <= 64, got 0"),
    ("--audio_tokenizer.bucket_s=-1", "audio_tokenizer.bucket_s: expected a number >= 0 and <= 3600, got -1"),
    ("--audio_tokenizer.bucket_s=.nan", "audio_tokenizer.bucket_s: expected a number >= 0 and <= 3600, got nan"),
    ("--audio_tokenizer.max_batch_size=0", "audio_tokenizer.max_batch_size: expected an integer >= 1, got 0"),
    ("--audio_tokenizer.max_batch_samples=0", "audio_tokenizer.max_batch_samples: expected an integer >= 1, got 0"),
    ("--audio_tokenizer.max_batch_size=true", "audio_tokenizer.max_batch_size: expected an integer >= 1, got True"),
    ("--audio_tokenizer.n_quantizers=0", "audio_tokenizer.n_quantizers: expected an integer >= 1 (or null), got 0"),
    ("--audio_tokenizer.dtype=fp8", "audio_tokenizer.dtype: expected one of"),
    ("--image_encoder.max_batch_size=0", "image_encoder.max_batch_size: expected an integer >= 1, got 0"),
    ("--image_encoder.input_range=[1, -1]", "image_encoder.input_range: expected two finite numbers [lo, hi] with lo < hi"),
    ("--image_encoder.normalize=2", "image_encoder.normalize: expected true or false, got 2"),
    ("--text_tokenizer.add_bos=yes please", "text_tokenizer.add_bos: expected true or false, got 'yes please'"),
])
def test_a_bad_encoder_spec_value_exits_2_before_any_model_loads(no_precompute, capsys, tmp_path, flag, message):
    """These passed the config check and failed in the constructor, after the model had loaded, with the cache
    folder already made."""
    rc = no_precompute.main(["--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "c"),
                             "--config", str(ROOT / "configs" / "precompute.yaml"), flag])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {message}" in err, err
    assert not (tmp_path / "c").exists()


def test_every_option_of_every_built_in_encoder_declares_its_values():
    """One declaration per option (its effect and the values it takes, :func:`precompute.encoders.options.takes`),
    beside the option: the config check reads it; there is no second list."""
    from precompute.encoders.options import Option
    from precompute.encoders.registry import SPECS
    for option, (table, _) in SPECS.items():
        for name, cls in table.items():
            for key in cls.OPTIONS:
                assert isinstance(cls.OPTION_EFFECTS[key], Option), (option, name, key)


# ---- a plug-in image encoder's latents ---------------------------------------------------------------------------

@pytest.mark.parametrize("mode,named", [
    ("narrow", "latents: image 0: latents of shape (4, 1, 8, 7) for a 64x64 image, expected (4, 1, 8, 8): "
               "latent_channels x 1 x H/8 x W/8"),
    ("channels", "latents: image 0: latents of shape (3, 1, 8, 8) for a 64x64 image, expected (4, 1, 8, 8)"),
    ("no_frame_axis", "latents: image 0: latents of shape (4, 8, 8) for a 64x64 image, expected (4, 1, 8, 8)"),
    ("integers", "latents: image 0: int32 latents, expected floats"),
    ("nan", "latents: has 32 non-finite value(s) (NaN/inf)"),  # one latent column of a 64x64 image: 4 x 8 cells
    ("inf", "latents: has 32 non-finite value(s) (NaN/inf)"),
])
def test_a_plugin_vaes_bad_latents_reject_their_row_naming_field_and_value(tiny_config, demo_cache, tmp_path, mode,
                                                                          named):
    """A plug-in VAE's latents of the wrong shape (a column short, a channel short, no frame axis), of integers, or
    holding a NaN or an infinity: each image row is rejected ``encode_failed`` naming the field, the image and the
    shape or the value; the job goes on and keeps every row without an image."""
    from precompute.job import run
    from shards import read_index, read_rejects
    cfg = dataclasses.replace(tiny_config, image_encoder={"factory": "plugin_bad_vae:make", "kwargs": {"mode": mode}})
    summary, _ = run(DEMO / "samples.jsonl", tmp_path / "c", cfg, progress=False)
    demo = read_index(demo_cache).select(["key", "has_image"]).to_pylist()
    with_image = {r["key"] for r in demo if r["has_image"]}
    kept = set(read_index(tmp_path / "c").column("key").to_pylist())
    assert with_image and kept == {r["key"] for r in demo} - with_image
    rejects = {r["key"]: r for r in read_rejects(tmp_path / "c").to_pylist() if r["key"] in with_image}
    assert set(rejects) == with_image
    for r in rejects.values():
        assert r["reason"] == "encode_failed" and named in r["detail"], r["detail"]
