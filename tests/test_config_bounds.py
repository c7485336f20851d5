"""Options that reach a constructor are bounded before any model loads: exit 2 naming the option
(issue 30 item 6): extra_fields names against the field registry, data.loader_kwargs against
the loader's declared settings, the reference model's model.kwargs, a batch larger than the cache."""
from __future__ import annotations


import pytest

from conftest import DEMO, ROOT
from test_train_support import make_cache


@pytest.fixture
def no_precompute(monkeypatch):
    from precompute import cli
    monkeypatch.setattr(cli, "run", lambda *a, **k: pytest.fail("the job started"))
    return cli


@pytest.mark.parametrize("name,message", [
    ("codes", "'codes' is written by the job itself (reserved)"),
    ("audio", "'audio' is written by the job itself (reserved)"),
    ("latents", "'latents' is written by the job itself (reserved)"),
    ("spectrogram", "'spectrogram' is not a field shards.fields knows"),
    ("codes_16k", "'codes_16k' is a codes field"),
])
def test_waveform_field_names_are_checked_against_the_registry(no_precompute, capsys, tmp_path, name, message):
    from shards import fields
    assert (name in fields.BY_NAME) == message.endswith("(reserved)")  # the registry's own answer
    rc = no_precompute.main(["--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "c"),
                             "--config", str(ROOT / "configs" / "precompute.yaml"),
                             f"--extra_fields={{{name}: {{producer: waveform, sample_rate: 16000}}}}"])
    assert rc == 2 and f"error: extra_fields.{name}: {message}" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_a_waveform_name_of_the_registry_passes():
    from precompute.config import load_config
    from precompute.validate import check_config
    assert check_config(load_config(None, ["extra_fields={audio_16k: {producer: waveform, sample_rate: 16000, "
                                           "direction: in}}"])) == []


@pytest.mark.parametrize("spec,message", [
    ("{codes_x: {producer: nope}}", "extra_fields.codes_x.producer: expected one of codes, waveform, latents, "
                                    "image_features (or a plug-in: factory), got 'nope'"),
    ("{audio: {producer: waveform, sample_rate: 16000}}", "extra_fields.audio: 'audio' is written by the job itself"),
    ("{codes: {producer: codes}}", "extra_fields.codes: 'codes' is written by the job itself"),
    ("{spectrogram: {producer: waveform, sample_rate: 16000}}",
     "extra_fields.spectrogram: 'spectrogram' is not a field shards.fields knows"),
    ("{mel: {factory: plugin_fields}}", "extra_fields.mel.factory: expected 'package.module:callable'"),
])
def test_extra_fields_are_checked_before_any_encoder_loads(no_precompute, capsys, tmp_path, spec, message):
    """An extra field's producer and name are refused at the option (exit 2), not after the codec and the VAE
    have loaded (where building the producers found them before)."""
    rc = no_precompute.main(["--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "c"),
                             "--config", str(ROOT / "configs" / "precompute.yaml"), f"--extra_fields={spec}"])
    assert rc == 2 and f"error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_extra_fields_the_registry_knows_pass():
    from precompute.config import load_config
    from precompute.validate import check_config
    ok = ("extra_fields={codes_mimi: {producer: codes, audio_tokenizer: {name: mimi, pretrained: x}}, "
          "audio_8k: {producer: waveform, sample_rate: 8000}, mel: {factory: 'plugin_fields:make_mel'}}")
    assert check_config(load_config(None, [ok])) == []


def test_image_features_specs_have_one_set_of_rules_before_gemma3_loads(monkeypatch):
    """The ``image_features`` option and a producer ``image_features`` spec (``add-field``) are checked by
    the same rules before the model loads; the producer path used to load Gemma 3 and then fail every
    image on a bad ``image_rgb``."""
    from precompute.config import load_config
    from precompute.producers import image_features, load_producer
    from precompute.validate import check_config
    monkeypatch.setattr(image_features.Gemma3VisionEncoder, "__init__", lambda *a, **k: pytest.fail("it loaded"))
    assert check_config(load_config(None, ["image_features={pretrained: '', dtype: fp8}"])) == [
        ("image_features.pretrained", "expected a local directory or hub id (e.g. google/gemma-3-4b-it), got ''"),
        ("image_features.dtype", "expected one of float32, fp32, float, float16, fp16, half, bfloat16, bf16, "
                                 "got 'fp8'")]
    with pytest.raises(ValueError, match="image_features.image_rgb: expected one of composite, convert, got 'rgb'"):
        load_producer({"producer": "image_features", "pretrained": "google/gemma-3-4b-it", "image_rgb": "rgb"},
                      "image_features")


@pytest.fixture
def train_main(monkeypatch):
    import train.trainer
    monkeypatch.setattr(train.trainer, "run", lambda *a, **k: 99)  # training would start: exit 99, not 2
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from train.cli import main
    return main


@pytest.fixture(scope="module")
def cache24(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("bounds") / "cache", n=24)


def _rc_err(main, capsys, cache, *args):
    rc = main(["--config", "none", "--cache", str(cache), "--model.kwargs", '{"d_model": 32, "n_heads": 2}', *args])
    return rc, capsys.readouterr().err


def test_loader_kwargs_are_the_loaders_declared_settings(train_main, capsys, cache24):
    """data.loader_kwargs: sections of the loader's settings, each field checked against the dataclass
    that declares it (loaders.Order / Workers / Reads), what the trainer sets refused naming its option."""
    import dataclasses
    from loaders import Order
    assert "shufle" not in {f.name for f in dataclasses.fields(Order)}
    rc, err = _rc_err(train_main, capsys, cache24, "--data.loader_kwargs", "{order: {shufle: false}}")
    assert rc == 2 and "error: data.loader_kwargs.order.shufle: not a field of loaders.Order; it has: shuffle," in err, err
    rc, err = _rc_err(train_main, capsys, cache24, "--data.loader_kwargs", "{shuffle: false}")
    assert rc == 2 and "data.loader_kwargs.shuffle: not a setting of loaders:ShardLoader; it takes: order: {...}" in err
    rc, err = _rc_err(train_main, capsys, cache24, "--data.loader_kwargs", "{seed: 3}")
    assert rc == 2 and "data.loader_kwargs.seed: not a setting of loaders:ShardLoader (the trainer sets it: --data.seed)" in err
    rc, err = _rc_err(train_main, capsys, cache24, "--data.loader_kwargs", "{workers: {num_workers: 2}}")
    assert rc == 2 and "data.loader_kwargs.workers.num_workers: set by the trainer: use --data.num_workers" in err, err
    rc, err = _rc_err(train_main, capsys, cache24, "--data.loader_kwargs", "{reads: {checks: all}}")
    assert rc == 2 and "data.loader_kwargs.reads.checks: Reads.checks must be one of" in err, err
    from train.bounds import problems
    from train.cli import parse_args
    cfg, _ = parse_args(["--config", "none", "--cache", str(cache24), "--data.loader_kwargs",
                         "{order: {shuffle: false}, reads: {checks: values}}"])
    assert problems(cfg) == []


@pytest.mark.parametrize("kwargs,message", [
    ('{"d_model": -1}', "model.kwargs.d_model: expected an integer between 1 and 65536, got -1"),
    ('{"dropout": 1.5}', "model.kwargs.dropout: expected a number between 0 and 1, got 1.5"),
    ('{"n_layers": 2.5}', "model.kwargs.n_layers: expected an integer between 1 and 1024, got 2.5"),
    ('{"d_modell": 32}', "model.kwargs.d_modell: not an option of the reference model"),
    ('{"d_model": 30, "n_heads": 4}', "model.kwargs.d_model: 30 is not a multiple of n_heads 4"),
])
def test_reference_model_kwargs_out_of_range_exit_2(train_main, capsys, cache24, kwargs, message):
    rc = train_main(["--config", "none", "--cache", str(cache24), "--model.kwargs", kwargs])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {message}" in err and "Traceback" not in err, err


def test_a_batch_larger_than_the_cache_exits_2(train_main, capsys, cache24, monkeypatch):
    import json
    samples = json.loads((cache24 / "manifest.json").read_text())["counts"]["samples"]
    assert samples == 24
    rc, err = _rc_err(train_main, capsys, cache24, "--data.batch_size", "25")
    assert rc == 2 and "error: data.batch_size: 25 per rank x 1 rank(s) is more than the 24 samples" in err, err
    monkeypatch.setenv("RANK", "0")  # rank 0 of a 2-process launch (shardcache.ranks.Ranks)
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc, err = _rc_err(train_main, capsys, cache24, "--data.batch_size", "13")
    assert rc == 2 and "13 per rank x 2 rank(s) is more than the 24 samples" in err and "at most 12" in err, err
    from train.bounds import problems
    from train.cli import parse_args
    assert problems(parse_args(["--config", "none", "--cache", str(cache24), "--data.batch_size", "12"])[0]) == []
