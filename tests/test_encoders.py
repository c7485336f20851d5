"""Tests of precompute.encoders with tiny randomly initialised models of the real architectures.

The models are built once per module with ``tools.testing`` into a temporary directory and
loaded back through ``from_pretrained``, the same code path a real checkpoint takes.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from conftest import ROOT  # noqa: E402
from tools import testing as random_models  # noqa: E402
from precompute.encoders import (  # noqa: E402
    AudioTokenizer,
    ByteTokenizer,
    DacTokenizer,
    ImageEncoder,
    TextTokenizer,
    check_protocol,
    fingerprint,
    load_audio_tokenizer,
    load_image_encoder,
    load_text_tokenizer,
    plan_batches,
)

SR = 24000


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: deterministic timing on a shared 2-core box (2 threads + other load = 10x slower)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")  # the Higgs models: test_higgs.py (higgs_models fixture)
    return random_models.build_models(out, "tiny", [n for n in random_models.MAKERS if not n.startswith("higgs")],
                                      log=None)


def chirp(n: int, seed: int = 0, f0: float = 150.0) -> np.ndarray:
    """float32 (n,) chirp f0 -> f0+3 kHz over 2 s plus a little noise, peak < 1."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SR
    x = 0.5 * np.sin(2 * np.pi * (f0 + 1500.0 * t) * t) + 0.05 * rng.standard_normal(n)
    return np.clip(x, -0.99, 0.99).astype(np.float32)


def images(b: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """uint8 (b, h, w, 3): smooth gradients plus noise (not constant)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1), (xx + yy) % 256], -1)
    noise = rng.integers(-40, 40, size=(b, h, w, 3))
    return np.clip(base[None] + noise, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def dac(models):
    return load_audio_tokenizer({"name": "dac", "pretrained": str(models["dac"])})


# -- audio: DAC ---------------------------------------------------------------------------------------


def test_dac_codes_contract(dac):
    check_protocol(dac, AudioTokenizer)
    assert (dac.sample_rate, dac.hop_length, dac.n_codebooks, dac.codebook_size) == (24000, 960, 8, 1024)
    assert dac.frame_rate == 25.0
    lengths = [48000, 30001, 960, 1, 0]
    codes = dac.encode([chirp(n, seed=i) for i, n in enumerate(lengths)])
    for n, c in zip(lengths, codes):
        assert c.dtype == np.int16
        assert c.shape == (8, math.ceil(n / 960))
        if c.size:
            assert c.min() >= 0 and c.max() < 1024
    first = codes[0]
    for q in range(8):  # a chirp must not map to one code per codebook
        assert len(np.unique(first[q])) > 5, f"codebook {q} constant"


def test_dac_batched_equals_one_by_one(models, dac):
    lengths = [48000, 30000, 30000, 20160, 961, 0, 48000, 30500]
    clips = [chirp(n, seed=10 + i, f0=100.0 + 30 * i) for i, n in enumerate(lengths)]
    one_by_one = [dac.encode([x])[0] for x in clips]
    batched_tok = DacTokenizer.from_pretrained(str(models["dac"]), max_batch_size=8)
    plan = plan_batches(lengths, 960, 8, 10**9)
    assert any(len(idx) > 1 for _, idx in plan)  # equal frame counts really are batched together
    for tok in (dac, batched_tok):
        got = tok.encode(clips)
        assert len(got) == len(clips)
        for a, b in zip(got, one_by_one):
            np.testing.assert_array_equal(a, b)


def test_naive_padding_would_change_dac_tail(dac):
    """Why clips are never padded to each other's length: DAC is non-causal, the tail sees the padding."""
    model = dac.model
    short = np.zeros((1, 1, 21 * 960), np.float32)
    short[0, 0, :20160] = chirp(20160, seed=3)
    long_ = np.zeros((2, 1, 50 * 960), np.float32)
    long_[0, 0, : short.shape[-1]] = short[0, 0]
    long_[1, 0] = chirp(50 * 960, seed=4)
    with torch.inference_mode():
        alone = model.encoder(torch.from_numpy(short))[0]
        padded = model.encoder(torch.from_numpy(long_))[0, :, :21]
    # relative change per frame; random tiny weights give small activations, so compare relatively
    rel = ((alone - padded).abs().amax(dim=0) / alone.abs().amax(dim=0)).tolist()
    assert rel[-1] > 0.05  # the last frame sees the padding instead of the conv's own zero padding
    assert max(rel[:3]) < 1e-4  # far from the end the effect has (almost) decayed


def test_reload_gives_identical_codes_and_hash(models, dac):
    fresh = DacTokenizer(random_models.codecs.make_dac("tiny"))
    clips = [chirp(48000, seed=7), chirp(12345, seed=8)]
    for a, b in zip(fresh.encode(clips), dac.encode(clips)):
        np.testing.assert_array_equal(a, b)
    again = load_audio_tokenizer({"name": "dac", "pretrained": str(models["dac"])})
    assert _built(fresh.describe()) == _built(dac.describe()) == _built(again.describe())
    assert dac.describe()["checkpoint_sha256"] == again.describe()["checkpoint_sha256"] is not None


def _built(d: dict) -> dict:
    """A description less the checkpoint's identity (``checkpoint_sha256``, ``loaded_from``), which only a
    model loaded with ``from_pretrained`` has (an encoder built in memory has no checkpoint: None)."""
    assert d["checkpoint_sha256"] is None or len(d["checkpoint_sha256"]) == 64
    return {k: v for k, v in d.items() if k not in ("checkpoint_sha256", "loaded_from")}


@pytest.mark.parametrize("name", ["encodec", "mimi", "wan", "cosmos"])
def test_reload_matches_in_memory_model(models, name):
    """save_pretrained -> from_pretrained keeps everything that matters (incl. the filled codebook buffers)."""
    from precompute.encoders import AUDIO_TOKENIZERS, IMAGE_ENCODERS

    cls = {**AUDIO_TOKENIZERS, **IMAGE_ENCODERS}[name]
    from shardcache.weights import checkpoint_sha256
    fresh = cls(random_models.MAKERS[name]("tiny"))
    loaded = cls.from_pretrained(str(models[name]))
    assert _built(fresh.describe()) == _built(loaded.describe())
    library = "transformers" if name in AUDIO_TOKENIZERS else "diffusers"
    assert loaded.describe()["checkpoint_sha256"] == checkpoint_sha256(models[name], library=library)
    if name in AUDIO_TOKENIZERS:
        x = [chirp(24000, seed=31)]
        np.testing.assert_array_equal(fresh.encode(x)[0], loaded.encode(x)[0])
    else:
        x = images(1, 64, 64, seed=31)
        np.testing.assert_array_equal(fresh.encode(x), loaded.encode(x))


def test_audio_input_validation(dac):
    with pytest.raises(TypeError, match="list"):
        dac.encode(chirp(960))
    with pytest.raises(ValueError, match="1-D"):
        dac.encode([np.zeros((2, 960), np.float32)])
    with pytest.raises(ValueError, match="floating point"):
        dac.encode([np.zeros(960, np.int16)])
    with pytest.raises(ValueError, match="NaN"):
        dac.encode([np.full(960, np.nan, np.float32)])
    with pytest.raises(ValueError, match="peak"):
        dac.encode([np.full(960, 1000.0, np.float32)])
    assert dac.encode([]) == []


def test_plan_batches():
    plan = plan_batches([960, 0, 1920, 961, 1900, 5], hop_length=960, max_batch_size=2, max_batch_samples=10**6)
    assert plan == [(1, [0, 5]), (2, [2, 3]), (2, [4])]
    assert plan_batches([9600] * 3, 960, 8, 9600 * 2) == [(10, [0, 1]), (10, [2])]


# -- audio: EnCodec, Mimi -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, options, n_codebooks, hop",
    [
        ("encodec", {}, 2, 320),  # bandwidth default = config.target_bandwidths[0] = 1.5 kbps
        ("encodec", {"bandwidth": 6.0}, 8, 320),
        ("mimi", {}, 8, 1920),
    ],
)
def test_encodec_mimi_codes_not_constant(models, name, options, n_codebooks, hop):
    tok = load_audio_tokenizer({"name": name, "pretrained": str(models[name]), **options})
    check_protocol(tok, AudioTokenizer)
    assert (tok.n_codebooks, tok.hop_length) == (n_codebooks, hop)
    clips = [chirp(48000, seed=21), chirp(7000, seed=22)]
    codes = tok.encode(clips)
    for x, c in zip(clips, codes):
        assert c.dtype == np.int16 and c.shape == (n_codebooks, math.ceil(x.size / hop))
        assert c.min() >= 0 and c.max() < tok.codebook_size
    for q in range(n_codebooks):
        assert len(np.unique(codes[0][q])) > 3, f"{name}: codebook {q} constant"
    for a, b in zip(codes, [tok.encode([x])[0] for x in clips]):
        np.testing.assert_array_equal(a, b)


def test_encodec_rejects_unsupported_bandwidth(models):
    with pytest.raises(ValueError, match="bandwidth"):
        load_audio_tokenizer({"name": "encodec", "pretrained": str(models["encodec"]), "bandwidth": 5.0})


# -- images ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["wan", "cosmos"])
def test_image_latents(models, name):
    enc = load_image_encoder({"name": name, "pretrained": str(models[name])})
    check_protocol(enc, ImageEncoder)
    assert (enc.spatial_factor, enc.latent_channels) == (8, 16)
    for h, w in [(64, 64), (64, 96)]:
        x = images(2, h, w, seed=h + w)
        z = enc.encode(x)
        assert z.dtype == np.float32 and z.shape == (2, 16, 1, h // 8, w // 8)
        assert np.isfinite(z).all() and z.std() > 0
        np.testing.assert_array_equal(z, enc.encode(x))  # mode() is deterministic
        np.testing.assert_allclose(enc.encode(x[1:]), z[1:], atol=1e-5)  # batch-size changes rounding only
    assert enc.encode(np.zeros((0, 64, 64, 3), np.uint8)).shape == (0, 16, 1, 8, 8)


@pytest.mark.parametrize("name", ["wan", "cosmos"])
def test_image_normalize(models, name):
    raw = load_image_encoder({"name": name, "pretrained": str(models[name])})
    norm = load_image_encoder({"name": name, "pretrained": str(models[name]), "normalize": True})
    d = norm.describe()
    mean = np.asarray(d["latents_mean"], np.float32).reshape(16, -1)[:, 0].reshape(1, 16, 1, 1, 1)
    std = np.asarray(d["latents_std"], np.float32).reshape(16, -1)[:, 0].reshape(1, 16, 1, 1, 1)
    x = images(1, 64, 64, seed=5)
    np.testing.assert_allclose(norm.encode(x), (raw.encode(x) - mean) / std, rtol=1e-5, atol=1e-5)
    assert raw.describe()["weights_sha256"] == d["weights_sha256"]
    assert fingerprint(raw.describe(), preprocessing={}) != fingerprint(d, preprocessing={})


def test_image_pixel_range_0_255_feeds_the_uint8_values(models):
    """input_range (0, 255): the VAE gets the pixel values themselves (TheWorld's ``to_tensor(img) *
    255``), computed here with diffusers directly; the default stays x / 127.5 - 1."""
    from diffusers import AutoencoderKLWan
    vae = AutoencoderKLWan.from_pretrained(str(models["wan"])).eval()
    x = images(2, 64, 64, seed=7)
    t = torch.from_numpy(x).permute(0, 3, 1, 2).float()[:, :, None]
    with torch.no_grad():
        want_255 = vae.encode(t).latent_dist.mode().numpy()
        want_default = vae.encode(t / 127.5 - 1).latent_dist.mode().numpy()
    enc = load_image_encoder({"name": "wan", "pretrained": str(models["wan"]), "input_range": [0, 255]})
    np.testing.assert_allclose(enc.encode(x), want_255, rtol=1e-4, atol=1e-4)
    default = load_image_encoder({"name": "wan", "pretrained": str(models["wan"])})
    np.testing.assert_allclose(default.encode(x), want_default, rtol=1e-4, atol=1e-5)
    assert enc.describe()["input_range"] == [0.0, 255.0] and default.describe()["input_range"] == [-1.0, 1.0]
    stats = default.latent_stats()
    assert stats["normalized"] is False and len(stats["latents_mean"]) == len(stats["latents_std"]) == 16
    with pytest.raises(ValueError, match="input_range"):
        load_image_encoder({"name": "wan", "pretrained": str(models["wan"]), "input_range": [1, 1]})


def test_image_posterior(models):
    """Wan: encode_posterior's mean is encode()'s output, logvar is finite and shaped alike;
    normalize maps mean like encode and shifts logvar by -2 log(std). Cosmos has no posterior."""
    from precompute.job import check_posterior
    raw = load_image_encoder({"name": "wan", "pretrained": str(models["wan"])})
    norm = load_image_encoder({"name": "wan", "pretrained": str(models["wan"]), "normalize": True})
    x = images(3, 64, 96, seed=7)
    mean, logvar = raw.encode_posterior(x)
    assert mean.dtype == logvar.dtype == np.float32 and mean.shape == logvar.shape == (3, 16, 1, 8, 12)
    np.testing.assert_array_equal(mean, raw.encode(x))
    assert np.isfinite(logvar).all() and logvar.std() > 0 and (logvar >= -30).all() and (logvar <= 20).all()
    n_mean, n_logvar = norm.encode_posterior(x)
    np.testing.assert_array_equal(n_mean, norm.encode(x))
    std = np.asarray(norm.describe()["latents_std"], np.float32).reshape(1, 16, 1, 1, 1)
    np.testing.assert_allclose(n_logvar, logvar - 2 * np.log(std), rtol=1e-5, atol=1e-5)
    check_posterior(raw)
    cosmos = load_image_encoder({"name": "cosmos", "pretrained": str(models["cosmos"])})
    with pytest.raises(ValueError, match="AutoencoderKLCosmos.*IdentityDistribution.*store_posterior: false"):
        cosmos.encode_posterior(x)
    with pytest.raises(ValueError, match="store_posterior.*IdentityDistribution"):
        check_posterior(cosmos)  # the job refuses before writing anything


def test_image_input_validation(models):
    enc = load_image_encoder({"name": "wan", "pretrained": str(models["wan"])})
    with pytest.raises(ValueError, match="uint8"):
        enc.encode(np.zeros((1, 64, 64, 3), np.float32))
    with pytest.raises(ValueError, match=r"\(B, H, W, 3\)"):
        enc.encode(np.zeros((64, 64, 3), np.uint8))
    with pytest.raises(ValueError, match="multiple of 8"):
        enc.encode(np.zeros((1, 60, 64, 3), np.uint8))


# -- text -----------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = load_text_tokenizer({"name": "bytes"})
    assert isinstance(tok, ByteTokenizer) and (tok.vocab_size, tok.pad_id) == (259 + 11, 0)
    check_protocol(tok, TextTokenizer)
    text = "Héllo wörld: naïve café — 日本語 🎵"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids[0] == 1 and ids[-1] == 2
    assert len(ids) == len(text.encode("utf-8")) + 2 and ids.min() >= 0 and ids.max() < 259
    assert tok.decode(ids) == text
    np.testing.assert_array_equal(tok.encode("hé"), [1, 104 + 3, 0xC3 + 3, 0xA9 + 3, 2])
    np.testing.assert_array_equal(tok.encode(""), [1, 2])
    assert load_text_tokenizer(None).describe() == tok.describe()
    # the chat templates' special tokens are single ids after the bytes, recognised inside text
    at = 259 + list(tok.special_tokens).index("<|AUDIO_OUT|>")
    assert tok.token_to_id("<|AUDIO_OUT|>") == at
    np.testing.assert_array_equal(tok.encode("a<|AUDIO_OUT|>b", add_special_tokens=False), [ord("a") + 3, at, ord("b") + 3])
    assert tok.decode([ord("a") + 3, at]) == "a"
    plain = load_text_tokenizer({"name": "bytes", "special_tokens": []})
    assert plain.vocab_size == 259 and len(plain.encode("<image>", add_special_tokens=False)) == 7


def test_hf_tokenizer(models):
    tok = load_text_tokenizer({"name": "hf", "pretrained": str(models["tokenizer"])})
    check_protocol(tok, TextTokenizer)
    ids = tok.encode("The quick brown fox, déjà vu.")
    assert ids.dtype == np.int32 and ids[0] == 1 and ids[-1] == 2 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == "The quick brown fox, déjà vu."
    assert len(tok.describe()["vocab_sha256"]) == 64


# -- registry -------------------------------------------------------------------------------------------


class ToyAudioTokenizer:
    """A plug-in audio tokenizer: codes = quantised mean of each hop."""

    sample_rate = 16000
    codebook_size = 16
    hop_length = 320

    def __init__(self, n_codebooks: int = 2, device: str = "cpu"):
        self.n_codebooks = n_codebooks
        self.frame_rate = self.sample_rate / self.hop_length
        self.device = device

    def encode(self, waveforms):
        out = []
        for w in waveforms:
            f = math.ceil(len(w) / self.hop_length)
            x = np.zeros(f * self.hop_length, np.float32)
            x[: len(w)] = w
            m = x.reshape(f, self.hop_length).mean(1)
            q = np.clip(((m + 1) / 2 * self.codebook_size).astype(np.int64), 0, self.codebook_size - 1)
            out.append(np.repeat(q[None], self.n_codebooks, 0).astype(np.int16))
        return out

    def describe(self):
        return {"class": "ToyAudioTokenizer", "name": "toy", "config": {"n_codebooks": self.n_codebooks}}


def make_toy_audio(**kwargs):
    return ToyAudioTokenizer(**kwargs)


def make_broken_audio():
    return object()


def test_plugin_factory():
    tok = load_audio_tokenizer({"factory": f"{__name__}:make_toy_audio", "kwargs": {"n_codebooks": 3}}, device="cpu")
    assert isinstance(tok, ToyAudioTokenizer) and tok.n_codebooks == 3 and tok.device == "cpu"
    assert tok.encode([np.zeros(700, np.float32)])[0].shape == (3, 3)
    via_class = load_audio_tokenizer({"factory": f"{__name__}:ToyAudioTokenizer"})
    assert via_class.n_codebooks == 2
    with pytest.raises(TypeError, match="does not satisfy AudioTokenizer.*sample_rate"):
        load_audio_tokenizer({"factory": f"{__name__}:make_broken_audio"})
    with pytest.raises(ValueError, match="module:callable"):
        load_audio_tokenizer({"factory": "no_colon_here"})
    with pytest.raises(ImportError, match="no_such_module_xyz"):
        load_audio_tokenizer({"factory": "no_such_module_xyz:make"})
    with pytest.raises(AttributeError, match="nope"):
        load_audio_tokenizer({"factory": f"{__name__}:nope"})


def test_unknown_names_and_options(models, tmp_path):
    with pytest.raises(ValueError, match="audio tokenizer.name: expected one of dac, encodec, higgs, mimi "):
        load_audio_tokenizer({"name": "snac", "pretrained": "x"})
    with pytest.raises(ValueError, match="expected one of cosmos, wan"):
        load_image_encoder({"name": "sdxl", "pretrained": "x"})
    with pytest.raises(ValueError, match="expected one of bytes, hf"):
        load_text_tokenizer({"name": "sentencepiece"})
    with pytest.raises(ValueError, match="unknown option"):
        load_audio_tokenizer({"name": "dac", "pretrained": str(models["dac"]), "bandwidth": 6.0})
    missing = tmp_path / "models" / "dac-tiny"
    with pytest.raises(FileNotFoundError, match=r"python -m tools\.testing --out models"):
        load_audio_tokenizer({"name": "dac", "pretrained": str(missing)})
    with pytest.raises(FileNotFoundError, match="tools.testing"):
        load_image_encoder({"name": "wan", "pretrained": str(tmp_path / "nothing")})


def test_pretrained_values_are_not_matched_against_test_model_names(tmp_path, monkeypatch):
    """The product knows no test-model directory names: without a ``models/`` folder here,
    ``models/dac-tiny`` is a hub id like any ``org/name`` (``./models/dac-tiny`` is local and fails fast)."""
    from shardcache.pretrained import resolve_pretrained
    monkeypatch.chdir(tmp_path)
    assert resolve_pretrained("models/dac-tiny", what="audio_tokenizer") == "models/dac-tiny"
    assert resolve_pretrained("dac-tiny", what="audio_tokenizer") == "dac-tiny"
    with pytest.raises(FileNotFoundError, match="tools.testing"):
        load_audio_tokenizer({"name": "dac", "pretrained": "./models/dac-tiny"})


def test_vae_in_pipeline_layout(models, tmp_path):
    import shutil

    shutil.copytree(models["wan"], tmp_path / "pipeline" / "vae")
    auto = load_image_encoder({"name": "wan", "pretrained": str(tmp_path / "pipeline")})
    explicit = load_image_encoder({"name": "wan", "pretrained": str(tmp_path / "pipeline"), "subfolder": "vae"})
    assert auto.describe()["weights_sha256"] == explicit.describe()["weights_sha256"]


# -- fingerprint ----------------------------------------------------------------------------------------


def test_fingerprint(models, dac):
    wan = load_image_encoder({"name": "wan", "pretrained": str(models["wan"])})
    text = ByteTokenizer()
    pre = {"sample_rate": 24000, "image_size": [64, 96], "crop": "center"}
    base = fingerprint(dac.describe(), wan.describe(), text.describe(), preprocessing=pre)
    assert len(base) == 64 and int(base, 16) >= 0
    reordered = dict(reversed(list(pre.items())))
    assert fingerprint(dac.describe(), wan.describe(), text.describe(), preprocessing=reordered) == base
    assert fingerprint(dac.describe(), wan.describe(), text.describe(), preprocessing={**pre, "crop": "resize"}) != base
    changed = random_models.codecs.make_dac("tiny")
    with torch.no_grad():
        changed.encoder.conv1.bias[0] += 1e-3
    other = DacTokenizer(changed)
    assert other.describe()["weights_sha256"] != dac.describe()["weights_sha256"]
    assert fingerprint(other.describe(), wan.describe(), text.describe(), preprocessing=pre) != base
    fewer = DacTokenizer(random_models.codecs.make_dac("tiny"), n_quantizers=4)
    assert fingerprint(fewer.describe(), wan.describe(), text.describe(), preprocessing=pre) != base
    with pytest.raises(TypeError):
        fingerprint(dac.describe(), preprocessing={"bad": object()})


# -- random_models CLI ----------------------------------------------------------------------------------


def test_random_models_cli(tmp_path, capsys):
    assert random_models.main(["--out", str(tmp_path), "--only", "dac,cosmos"]) == 0
    out = capsys.readouterr().out
    assert "built" in out and (tmp_path / "dac-tiny" / "config.json").exists()
    assert (tmp_path / "cosmos-tiny" / "config.json").exists() and not (tmp_path / "wan-tiny").exists()
    random_models.main(["--out", str(tmp_path), "--only", "dac"])
    assert "exists" in capsys.readouterr().out
    random_models.main(["--out", str(tmp_path), "--only", "dac", "--force"])
    assert "built" in capsys.readouterr().out
    assert not list(tmp_path.glob(".*.tmp*"))
    with pytest.raises(SystemExit):
        random_models.main(["--out", str(tmp_path), "--only", "nope"])


def test_higgs_codec_with_resampler_torchaudio_refuses_to_load_without_it(higgs_models, monkeypatch):
    """``resampler: torchaudio`` (the codec's default) where torchaudio cannot be imported: the codec refuses
    to load, naming torchaudio and the way out (precompute stops with this one line, before any row)."""
    import sys
    monkeypatch.setitem(sys.modules, "torchaudio", None)   # what a failed import looks like
    with pytest.raises(ImportError, match=r"resamples its semantic input with torchaudio, which cannot be imported "
                                          r"here; .* or set audio_tokenizer.resampler: soxr \(or auto\)"):
        load_audio_tokenizer({"name": "higgs", "pretrained": str(higgs_models / "higgs-audio-tokenizer-tiny")})
    with pytest.raises(ValueError, match="audio.tokenizer.resampler: expected one of torchaudio, soxr, auto"):  # (refused by its declaration, before the model loads)
        load_audio_tokenizer({"name": "higgs", "pretrained": str(higgs_models / "higgs-audio-tokenizer-tiny"),
                              "resampler": "sinc"})


def test_the_soxr_resampler_keeps_torchaudios_contract():
    """``precompute.encoders.higgs_resampler.resample`` (``resampler: soxr``, and the tests' torchaudio stand-in
    under torchaudio's name): torchaudio's shape contract ``(..., ceil(n * new / old))``, dtype kept, soxr's
    HQ values."""
    import soxr

    from precompute.encoders.higgs_resampler import resample
    from tools.shims.torchaudio import functional
    x = torch.randn(2, 1, 2401)
    y = resample(x, 24000, 16000)
    assert y.shape == (2, 1, 1601) and y.dtype == x.dtype
    want = soxr.resample(x[1, 0].numpy(), 24000, 16000, "HQ")[:1601]
    assert np.allclose(y[1, 0, :len(want)].numpy(), want)
    assert resample(x, 16000, 16000) is x
    assert functional.resample is resample      # one resampler: the stand-in is the product's function


def test_higgs_tokenizer_encodes_each_clip_unpadded_as_the_model_does(higgs_codec):
    """The cached codes of the higgs codec are the model's own codes of the clip as it is (what
    HiggsAudioV2Processor and boson_multimodal compute), alone or batched with clips of equal length;
    zero-padding to a multiple of the hop (the other codecs' canonical encoding) would differ."""
    from precompute.encoders import load_audio_tokenizer
    tok = load_audio_tokenizer({"name": "higgs", "pretrained": str(higgs_codec / "higgs-audio-tokenizer-tiny")})
    assert (tok.n_codebooks, tok.codebook_size, tok.sample_rate, tok.hop_length) == (8, 1024, 24000, 960)
    assert tok.bandwidth == 2 and tok.describe()["padding"].startswith("none")
    clips = [chirp(n, seed=n) for n in (25449, 961, 2400, 25449)]
    got = tok.encode(clips)
    with torch.inference_mode():
        for c, g in zip(clips, got):
            want = tok.model.encode(torch.from_numpy(c)[None, None], bandwidth=2).audio_codes[0].numpy()
            np.testing.assert_array_equal(g, want)
            padded = np.zeros(-(-len(c) // 960) * 960, np.float32)
            padded[:len(c)] = c
            pcodes = tok.model.encode(torch.from_numpy(padded)[None, None], bandwidth=2).audio_codes[0].numpy()
            if len(c) == 25449:
                assert pcodes.shape != g.shape or (pcodes != g).any()
    assert [g.shape[1] for g in got] == [27, 1, 3, 27] and len({g.tobytes() for g in got}) == 3
    batched = load_audio_tokenizer({"name": "higgs", "pretrained": str(higgs_codec / "higgs-audio-tokenizer-tiny"),
                                    "max_batch_size": 4}).encode(clips)
    for a, b in zip(batched, got):
        np.testing.assert_array_equal(a, b)
