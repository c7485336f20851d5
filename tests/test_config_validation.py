"""Configuration errors stop ``shardcache precompute`` before any work: exit 2, the option named."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from precompute import cli
from precompute.config import PrecomputeConfig, load_config
from precompute.encoders.capabilities import Declares, TextCapabilities
from precompute.identity import preprocessing_of
from precompute.validate import check_config
from shardcache.config import ConfigError, options

from conftest import DEMO, ROOT


def _choices(tp) -> tuple:
    """The values of an option's ``Literal[...]`` (inside ``X | None`` too)."""
    import typing
    parts = typing.get_args(tp) if typing.get_origin(tp) is not typing.Literal else (tp,)
    return tuple(v for p in parts if typing.get_origin(p) is typing.Literal for v in typing.get_args(p))


#: the enumerated options of stage one and their declared choices (num_workers' one word aside)
CHOICES = {p: _choices(tp) for p, (tp, _) in options(PrecomputeConfig).items() if _choices(tp) and p != "num_workers"}


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the CLI gets as far as the job (which loads the models)."""
    def refuse(*a, **k):
        raise AssertionError("the job started although the configuration is invalid")

    monkeypatch.setattr(cli, "run", refuse)
    import precompute.job as job
    monkeypatch.setattr(job, "load_encoders", refuse)


def _main(capsys, tmp_path, *extra: str) -> tuple[int, str]:
    rc = cli.main(["--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "out"),
                   "--config", str(ROOT / "configs" / "precompute.yaml"), "--no_progress", *extra])
    assert not (tmp_path / "out").exists()
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--sample_rate=abc"], "error: sample_rate: expected an integer > 0 and <= 384000, got 'abc'"),
    (["--sample_rate=0"], "error: sample_rate: expected an integer > 0 and <= 384000, got 0"),
    (["--encoder_batch_size", "0"], "error: encoder_batch_size: expected an integer > 0 and <= 65536, got 0"),
    (["--encoder-batch-size", "0"], "error: encoder-batch-size: unknown option; options are spelled with '_': "
                                    "--encoder_batch_size"),
    (["--encoder_batch_size=-1"], "error: encoder_batch_size: expected an integer > 0 and <= 65536, got -1"),
    (["--image_resize=foo"], "error: image_resize: expected one of center_crop, pad, bucket, stretch, got 'foo'"),
    (["--image_pixel_range=0..1"], "error: image_pixel_range: expected one of -1..1, 0..255, got '0..1'"),
    (["--image_rgb=bgr"], "error: image_rgb: expected one of composite, convert"),
    (["--world_tokens=[<sow>]"], "error: world_tokens: expected two different tokens"),
    (["--image_token= <image>"], "error: image_token: expected a token string without surrounding"),
    (["--world_tokens=[<image>, <eow>]"], "error: world_tokens: '<image>' is the image placeholder"),
    (["--num_workers=lots"], "error: num_workers: expected an integer >= 0 and <= 1024 or one of auto, got 'lots'"),
    (["--num_workers", "lots"], "error: num_workers: expected an integer >= 0 and <= 1024 or one of auto, got 'lots'"),
    (["--min_duration=40"], "error: min_duration: 40.0 s is greater than max_duration 30.0 s"),
    (["--image_size=100"], "error: image_size: expected a multiple of 8 (the VAE's spatial factor), got 100"),
    (["--max_duration=-1"], "error: max_duration: expected a number > 0 and <= 86400, got -1"),
    (["--silence_rms=loud"], "error: silence_rms: expected a number >= 0 and <= 1 or null, got 'loud'"),
    (["--sample_rate", "fast"], "error: sample_rate: expected an integer > 0 and <= 384000, got 'fast'"),
    (["--manifest_format", "xml"], "error: manifest_format: expected one of jsonl, chatml, llava, csv, parquet or "
                                   "null, got 'xml'"),
    (["--optim.lr=1"], "error: optim.lr: unknown option"),
    (["--store_posterior=maybe"], "error: store_posterior: expected true or false, got 'maybe'"),
    (["--device=gpu"], "error: device: expected auto, cpu, cuda"),
    (["--encoder_dtype=int8"], "error: encoder_dtype: expected one of"),
    (["--precision_tolerance.codes_agreement=1.5"],
     "error: precision_tolerance.codes_agreement: expected a number >= 0 and <= 1, got 1.5"),
    (["--precision_tolerance.latents_rel_eror=0.1"], "error: precision_tolerance.latents_rel_eror: unknown option"),
    (["--audio_tokenizer.name=snac"], "error: audio_tokenizer.name: expected one of"),
    (["--audio_tokenizer.name", "snac"], "error: audio_tokenizer.name: expected one of"),
    (["--image_encoder.nomalize=true"], "error: image_encoder: unknown option(s) ['nomalize']"),
    (["--extra_fields={audio_16k: {producer: waveform, sample_rate: 0, direction: in}}"],
     "error: extra_fields.audio_16k.sample_rate: expected an integer > 0 and <= 384000, got 0"),
    (["--extra_fields={audio_16k: {producer: waveform, sample_rate: 16000, direction: up}}"],
     "error: extra_fields.audio_16k.direction: expected one of in, out, all, got 'up'"),
    (["--no_such_option=1"], "error: no_such_option: unknown option"),
    (["--sample_rate"], "error: sample_rate: expected one argument"),
])
def test_invalid_option_exits_2_naming_it(capsys, tmp_path, no_work, args, message):
    rc, err = _main(capsys, tmp_path, *args)
    assert rc == 2 and message in err, err


def test_every_problem_is_listed(capsys, tmp_path, no_work):
    """jsonargparse stops at the first bad flag; every one is still named, one line each."""
    rc, err = _main(capsys, tmp_path, "--sample_rate=0", "--encoder_batch_size", "0", "--image_resize=x",
                    "--no-progress", "--max_images=0")
    assert rc == 2
    named = [ln.split(":")[1].strip() for ln in err.strip().splitlines()]
    assert sorted(named) == ["encoder_batch_size", "image_resize", "max_images", "no-progress", "sample_rate"], err


def test_yaml_errors_exit_2(capsys, tmp_path, no_work):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sample_rate: [1,\n")
    rc = cli.main(["--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "out"), "--config", str(bad)])
    assert rc == 2 and "error:" in capsys.readouterr().err
    bad.write_text("sampel_rate: 16000\n")
    rc = cli.main(["--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "out"), "--config", str(bad)])
    assert rc == 2 and "sampel_rate" in capsys.readouterr().err


def test_valid_values_pass(monkeypatch, capsys, tmp_path):
    seen = {}

    def fake_run(manifest, out, cfg, **kw):
        seen["cfg"] = cfg
        raise ValueError("stop here")

    monkeypatch.setattr(cli, "run", fake_run)
    rc, _ = _main(capsys, tmp_path, "--audio_tokenizer=null", "--silence_rms=1e-4",
                  "--extra_fields={audio_16k: {producer: waveform, sample_rate: 16000, direction: in}}",
                  "--num_workers=auto", "--num_workers", "2", "--device", "cuda:1")
    assert rc == 1 and seen["cfg"].num_workers == 2 and seen["cfg"].audio_tokenizer is None
    assert seen["cfg"].silence_rms == 1e-4  # YAML 1.1 reads 1e-4 as text; a number option takes it as the number
    assert check_config(PrecomputeConfig()) == []
    assert check_config(load_config(ROOT / "configs" / "precompute.yaml", ["image_encoder=null"])) == []
    for plugin in ({"factory": "mypkg.codec:make", "kwargs": {"n": 3}}, {"name": "encodec", "pretrained": "x"}):
        assert check_config(load_config(None, [f"audio_tokenizer={plugin}"])) == []
    with pytest.raises(ConfigError) as e:
        load_config(None, ["image_size=0", "max_duration=-2.5"])
    assert e.value.lines() == ["image_size: expected an integer > 0 and <= 16384, got 0",  # in the order given
                               "max_duration: expected a number > 0 and <= 86400, got -2.5"]
    with pytest.raises(ConfigError) as e:  # a value of the wrong type: named when the config is read
        load_config(None, ["max_duration=abc"])
    assert e.value.lines() == ["max_duration: expected a number > 0 and <= 86400, got 'abc'"]


class _Templated(Declares):
    """A text tokenizer that declares a chat template (what resolve_template reads)."""

    capabilities = TextCapabilities(chat_template="{{ x }}")


def test_every_declared_choice_is_implemented(tmp_path):
    """Each value an enumerated option accepts works in the module that implements it (the lists
    have one owner, precompute.config; this catches a value added there and not implemented)."""

    from PIL import Image

    from precompute.chat import resolve_template
    from precompute.encoders._common import resolve_dtype
    from precompute.encoders.image import PIXEL_RANGES
    from precompute.images import load_image
    from precompute.manifests import read_requests

    png = tmp_path / "x.png"
    Image.new("RGBA", (40, 24), (10, 20, 30, 128)).save(png)
    for mode in CHOICES["image_resize"]:
        for rgb in CHOICES["image_rgb"]:
            assert load_image(png, 16, mode=mode, rgb=rgb).shape[-1] == 3, (mode, rgb)
    assert all(PIXEL_RANGES[r][0] < PIXEL_RANGES[r][1] for r in CHOICES["image_pixel_range"])
    assert {str(resolve_dtype(d)) for d in CHOICES["encoder_dtype"]} == {"torch.float32", "torch.float16",
                                                                       "torch.bfloat16"}
    for name in CHOICES["chat_template"]:
        assert resolve_template(name, _Templated()) in ("llama3", "tokenizer", "theworld")
    for fmt in CHOICES["manifest_format"]:
        with pytest.raises(Exception) as e:
            list(read_requests(tmp_path / "no-such-manifest", fmt=fmt))
        assert "unknown manifest format" not in str(e.value), fmt


def test_cli_stops_before_loading_any_model(tmp_path):
    """A subprocess with encoders pointing at directories that do not exist: exit 2 on the option, not a
    model-loading error (which would exit 1 after minutes of setup)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"audio_tokenizer: {{name: dac, pretrained: {tmp_path / 'no-models' / 'dac'}}}\n"
                   f"image_encoder: {{name: wan, pretrained: {tmp_path / 'no-models' / 'wan'}}}\n")
    r = subprocess.run([sys.executable, "-m", "shardcache", "precompute", "--manifest", str(DEMO / "samples.jsonl"),
                        "--cache", str(tmp_path / "out"), "--config", str(cfg), "--sample_rate=abc"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    assert r.returncode == 2, r.stderr
    assert "error: sample_rate: expected an integer > 0 and <= 384000, got 'abc'" in r.stderr
    assert "no-models" not in r.stderr and not (tmp_path / "out").exists()


def test_config_files_keep_their_fingerprint(tmp_path):
    """The preprocessing() of configs/precompute-tts.yaml, written out: every bytes option (declared
    effect=BYTES) and the bytes keys of its specs that differ from the class's default (the codec's
    bandwidth and resampler; not pretrained paths, not batch sizes, not n_codebooks, a check), and a file
    read with an override. The TTS file renders Higgs-Audio's own layout (chat_template llama3)."""
    cfg = load_config(ROOT / "configs" / "precompute-tts.yaml")
    assert preprocessing_of(cfg) == {
        "audio_format": "pcm_s16le", "chat_template": "llama3", "image_resize": "center_crop", "image_size": 256,
        "image_rgb": "composite", "image_pixel_range": "-1..1", "image_token": "<image>", "world_tokens": None,
        "encoder_dtype": "float32", "latents_dtype": "float16", "sample_layout": "conversation-2",
        "sample_rate": 24000, "store_posterior": False, "label_policy": "answers", "image_features": None,
        "audio_tokenizer": {"name": "higgs", "bandwidth": 2, "resampler": "auto"}, "image_encoder": None,
        "text_tokenizer": {"name": "hf"},
        "extra_fields": {"audio_16k": {"producer": "waveform", "sample_rate": 16000, "direction": "in"}}}
    assert preprocessing_of(load_config(ROOT / "configs" / "precompute-tts.yaml", [
        "encoder_batch_size=2", "audio_tokenizer.pretrained=/elsewhere", "max_duration=3", "num_workers=0",
        "audio_tokenizer.max_batch_size=4", "encoder_dtype=fp32"])) == preprocessing_of(cfg)
    theworld = preprocessing_of(load_config(ROOT / "configs" / "precompute-theworld.yaml"))
    assert {k: theworld[k] for k in ("image_resize", "image_size", "image_rgb", "image_pixel_range", "image_token",
                                     "world_tokens", "encoder_dtype")} == {
        "image_resize": "stretch", "image_size": 512, "image_rgb": "convert", "image_pixel_range": "0..255",
        "image_token": "<start_of_image>", "world_tokens": ["<start_of_world>", "<end_of_world>"],
        "encoder_dtype": "bfloat16"}
    old = tmp_path / "old.yaml"
    old.write_text("encoder_batch_size: 32\nsample_rate: 16000\n")
    cfg = load_config(old, ["image_size=128"])
    assert (cfg.encoder_batch_size, cfg.sample_rate, cfg.image_size) == (32, 16000, 128)
    old.write_text("batch_size: 32\n")  # the name before encoder_batch_size: gone
    with pytest.raises(ConfigError, match="batch_size: unknown option"):
        load_config(old)


@pytest.mark.parametrize("text,section", [("data: 3\n", "data"), ("optim: [1, 2]\n", "optim"),
                                          ("checkpoint: 3.5\n", "checkpoint")])
def test_a_section_given_a_value_is_refused_naming_it(tmp_path, text, section):
    """A section written as a scalar or a list exits 2 naming it (it was a TypeError traceback from
    jsonargparse's instantiate), for both stages."""
    from shardcache.config import ConfigError
    from train.cli import parse_args
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(tmp_path / "t.yaml")])
    assert e.value.problems[0][0] == section and "expected a mapping of its options" in e.value.problems[0][1]
    from precompute.config import load_config
    with pytest.raises(ConfigError, match="precision_tolerance: expected a mapping of its options, got 5"):
        load_config({"precision_tolerance": 5})


def test_a_section_flag_given_a_value_says_how_to_set_one_option():
    """``--model tts`` (the spelling the docs and the recipes' messages had before ``--model.name``) is read by
    jsonargparse as the section's config file; it exits 2 naming the section and the ``--model.OPTION VALUE``
    form, not "Unable to load config", in both stages. The spelling the messages now give parses."""
    from shardcache.config import ConfigError
    from train.cli import parse_args
    with pytest.raises(ConfigError) as e:
        parse_args(["--model", "tts"])
    assert e.value.problems == [("model", "expected a YAML file of its options or a mapping (one option: "
                                          "--model.OPTION VALUE), got 'tts'")]
    assert parse_args(["--model.name", "tts"])[0].model.name == "tts"
    with pytest.raises(ConfigError, match=r"^precision_tolerance: expected a YAML file .*--precision_tolerance"
                                          r"\.OPTION VALUE\), got '5'$"):
        load_config(None, ["precision_tolerance=5"])


def test_a_key_of_an_encoder_spec_from_a_flag_keeps_its_type():
    """``--image_encoder.normalize false`` and ``--audio_tokenizer.max_batch_size 8`` reach the encoder as
    false and 8: an untyped ``dict`` option kept them as the strings 'false' (truthy) and '8'."""
    cfg = load_config(ROOT / "configs" / "precompute.yaml", ["image_encoder.normalize=false",
                                                            "audio_tokenizer.max_batch_size=8",
                                                            "text_tokenizer.pretrained=/ckpt/tok"])
    assert cfg.image_encoder["normalize"] is False and cfg.audio_tokenizer["max_batch_size"] == 8
    assert type(cfg.audio_tokenizer["max_batch_size"]) is int and cfg.text_tokenizer["pretrained"] == "/ckpt/tok"


def test_a_training_device_it_cannot_use_is_refused():
    """``--dist.device gpu`` trained on the CPU without a word; now it exits 2 naming the option."""
    from shardcache.config import ConfigError
    from train.cli import parse_args
    with pytest.raises(ConfigError, match="dist.device: expected one of auto, cpu, cuda, got 'gpu'"):
        parse_args(["--config", "none", "--dist.device", "gpu"])


def test_a_mapping_option_takes_mappings_and_keys_in_their_order():
    """``model.kwargs`` flags in their order (jsonargparse's ``dict[str, Any]``): a whole mapping replaces the
    file's, ``{}`` clears it, ``--model.kwargs.KEY VALUE`` sets one key (the value typed as YAML); anything but a
    mapping exits 2 naming the option."""
    from shardcache.config import ConfigError
    from train.cli import parse_args
    cfg, _ = parse_args(["--config", str(ROOT / "configs" / "train-tts.yaml"), "--model.kwargs.z", "1"])
    assert cfg.model.kwargs["z"] == 1 and "lm" in cfg.model.kwargs  # one key: merged into the file's mapping
    cfg, _ = parse_args(["--config", str(ROOT / "configs" / "train-tts.yaml"), "--model.kwargs", "{}",
                         "--model.kwargs.b", "3", "--model.kwargs", "{a: {}, b: 4}", "--model.kwargs.c", "[1]"])
    assert cfg.model.kwargs == {"a": {}, "b": 4, "c": [1]}
    with pytest.raises(ConfigError, match=r"model.kwargs: expected a mapping, got \[1, 2\]"):
        parse_args(["--config", "none", "--model.kwargs", "[1, 2]"])


def test_every_bad_key_of_a_config_file_is_named_with_the_file(tmp_path):
    """The file's keys are checked against the declared options before jsonargparse reads the file: each bad
    key is named at once (the library stopped at the first), with the file; a null for an option that takes
    none is refused (jsonargparse took it, and the job met None later); a section's flag given a mapping is
    checked key by key."""
    from train.cli import parse_args
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {lr: fast, lrr: 1}\ndata: {batch_size: 0, cache: null}\nsteps: 3\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(bad), "--optim.beta1", "2"])
    at = f" (in --config {bad})"
    assert e.value.lines() == [f"optim.lr: expected a number >= 0 and <= 100, got 'fast'{at}",
                               f"optim.lrr: unknown option; see --help{at}",
                               f"data.batch_size: expected an integer > 0 and <= 1000000, got 0{at}",
                               f"data.cache: expected a string, got null{at}",
                               f"steps: unknown option; see --help{at}",
                               "optim.beta1: expected a number >= 0 and <= 1, got 2"]
    with pytest.raises(ConfigError) as e:  # a section's flag: its mapping's keys, named under the section
        load_config(None, ["precision_tolerance={codes_agreement: 2, latents_rel_eror: 0.1}"])
    assert e.value.lines() == ["precision_tolerance.codes_agreement: expected a number >= 0 and <= 1, got 2",
                               "precision_tolerance.latents_rel_eror: unknown option; see --help"]
    with pytest.raises(ConfigError, match=r"^sample_rate: expected an integer > 0 and <= 384000, got null$"):
        load_config({"sample_rate": None})


def test_an_abbreviated_flag_is_refused(capsys, tmp_path, no_work):
    """One spelling: argparse took ``--sample_r`` for ``--sample_rate``; it is an unknown option now."""
    rc, err = _main(capsys, tmp_path, "--sample_r", "16000")
    assert rc == 2 and err == "error: sample_r: unknown option; see --help\n", err
