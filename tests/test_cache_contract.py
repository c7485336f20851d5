"""``shards.Cache`` (the cache opened once) and ``cache.require(contract)``: each contract item refused by
name with the cache's and the model's value; the recipes' contracts (read from the tiny checkpoints'
configs, no weights) refuse caches from another codec, frame rate, tokenizer, image preset or feature
encoder before any weight loads, and accept their own caches."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shards import Cache, ContractMismatch, read_cache_id
from shards.cache import Codec, Contract, FeatureEncoder, ImagePreset
from test_train_support import cache_with_manifest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo" / "samples.jsonl"

#: a manifest as stage one writes it (the keys the identity is read from)
MANIFEST = {
    "encoders": {
        "audio_tokenizer": {"name": "higgs", "bandwidth": 2, "n_codebooks": 2, "codebook_size": 4,
                            "checkpoint_sha256": "c" * 64, "dtype": "float32",
                            "numerics": {"dtype": "float32", "tf32_matmul": False, "tf32_cudnn": False,
                                         "float32_matmul_precision": "highest"}},
        "image_encoder": {"name": "wan", "normalize": False, "dtype": "bfloat16", "checkpoint_sha256": "d" * 64,
                          "numerics": {"tf32_matmul": False, "tf32_cudnn": True}},
        "text_tokenizer": {"name": "hf", "vocab_sha256": "a" * 64, "config": {"chat_template_sha256": "7" * 64}},
        "preprocessing": {"image_size": 512, "image_resize": "stretch", "image_rgb": "convert",
                          "image_pixel_range": "0..255", "latents_dtype": "float16", "label_policy": "answers"}},
    "sample_rate": 24000, "codec_sample_rate": 24000, "n_codebooks": 2, "codebook_size": 4, "frame_rate": 25.0,
    "latent_channels": 4,
    "text": {"template": "tokenizer", "vocab_size": 16, "pad_id": 1,
             "special_token_ids": {"<|AUDIO_OUT|>": 10, "<|audio_out_bos|>": 9}},
    "fields": {"image_features": {"fingerprint": "f", "sidecar": False, "tokens_per_image": 2, "hidden_size": 4,
                                  "encoder": {"producer": "image_features", "encoder": {
                                      "name": "gemma3", "dtype": "bfloat16", "checkpoint_sha256": "e" * 64,
                                      "pixel_options": {"do_normalize": True, "image_mean": [0.5] * 3},
                                      "numerics": {"float32_matmul_precision": "high"}}}}},
}

#: the contract MANIFEST meets, item by item
MATCHING = Contract("--model test", fields=("codes", "input_ids", "labels", "latents", "image_features"),
                    special_tokens={"<|AUDIO_OUT|>": 10, "<|audio_out_bos|>": None}, pad_id=1,
                    codec=Codec("higgs", 24000, 25.0, 2, 4, 2.0, "c" * 64, "float32", False), text_tokenizer="a" * 64,
                    chat_template="tokenizer", chat_template_sha256="7" * 64, label_policy="answers",
                    image=ImagePreset("wan", 512, "stretch", "convert", "0..255", 4, False, "bfloat16", "float16", "d" * 64,
                                      True),
                    feature_encoder=FeatureEncoder("gemma3", 2, 4, "bfloat16", "e" * 64, True,
                                                   {"do_normalize": True, "image_mean": [0.5] * 3}))

#: item -> (a contract differing from MATCHING in that item only, the cache's value, the model's value)
ITEMS = {
    "fields": (dict(fields=("codes", "mel")), None, None),
    "special_tokens.<|AUDIO_OUT|>": (dict(special_tokens={"<|AUDIO_OUT|>": 11}), 10, 11),
    "special_tokens.<start_of_world>": (dict(special_tokens={"<start_of_world>": None}), None, "any id"),
    "pad_id": (dict(pad_id=0), 1, 0),
    "codec.name": (dict(codec=Codec(name="encodec")), "higgs", "encodec"),
    "codec.sample_rate": (dict(codec=Codec(sample_rate=16000)), 24000, 16000),
    "codec.frame_rate": (dict(codec=Codec(frame_rate=75.0)), 25.0, 75.0),
    "codec.n_codebooks": (dict(codec=Codec(n_codebooks=8)), 2, 8),
    "codec.codebook_size": (dict(codec=Codec(codebook_size=1024)), 4, 1024),
    "codec.bandwidth": (dict(codec=Codec(bandwidth=6.0)), 2.0, 6.0),
    "codec.weights": (dict(codec=Codec(weights="b" * 64)), "c" * 64, "b" * 64),
    "codec.dtype": (dict(codec=Codec(dtype="bfloat16")), "float32", "bfloat16"),
    "codec.tf32": (dict(codec=Codec(tf32=True)), False, True),
    "text_tokenizer": (dict(text_tokenizer="b" * 64), "a" * 64, "b" * 64),
    "chat_template": (dict(chat_template="theworld"), "tokenizer", "theworld"),
    "chat_template_sha256": (dict(chat_template_sha256="8" * 64), "7" * 64, "8" * 64),   # an edited template
    "label_policy": (dict(label_policy="all_but_world"), "answers", "all_but_world"),
    "image.encoder": (dict(image=ImagePreset(encoder="cosmos")), "wan", "cosmos"),
    "image.size": (dict(image=ImagePreset(size=256)), 512, 256),
    "image.resize": (dict(image=ImagePreset(resize="center_crop")), "stretch", "center_crop"),
    "image.rgb": (dict(image=ImagePreset(rgb="composite")), "convert", "composite"),
    "image.pixel_range": (dict(image=ImagePreset(pixel_range="-1..1")), "0..255", "-1..1"),
    "image.latent_channels": (dict(image=ImagePreset(latent_channels=16)), 4, 16),
    "image.normalized": (dict(image=ImagePreset(normalized=True)), False, True),
    "image.dtype": (dict(image=ImagePreset(dtype="float32")), "bfloat16", "float32"),
    "image.latents_dtype": (dict(image=ImagePreset(latents_dtype="float32")), "float16", "float32"),
    "image.weights": (dict(image=ImagePreset(weights="b" * 64)), "d" * 64, "b" * 64),
    "image.tf32": (dict(image=ImagePreset(tf32=False)), True, False),         # cuDNN's TF32 switch was on
    "feature_encoder.name": (dict(feature_encoder=FeatureEncoder(name="siglip")), "gemma3", "siglip"),
    "feature_encoder.tokens_per_image": (dict(feature_encoder=FeatureEncoder(tokens_per_image=256)), 2, 256),
    "feature_encoder.hidden_size": (dict(feature_encoder=FeatureEncoder(hidden_size=2560)), 4, 2560),
    "feature_encoder.dtype": (dict(feature_encoder=FeatureEncoder(dtype="float32")), "bfloat16", "float32"),
    "feature_encoder.weights": (dict(feature_encoder=FeatureEncoder(weights="b" * 64)), "e" * 64, "b" * 64),
    "feature_encoder.tf32": (dict(feature_encoder=FeatureEncoder(tf32=False)), True, False),   # matmul "high"
    "feature_encoder.image_processor": (dict(feature_encoder=FeatureEncoder(image_processor={
        "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073]})),                 # CLIP's mean
        {"do_normalize": True, "image_mean": [0.5] * 3}, {"do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073]}),
}


def test_every_contract_item_is_in_the_table():
    """ITEMS walks every item a contract can set (each attribute of Contract and of its encoder parts)."""
    from dataclasses import fields
    from shards.cache import PARTS
    names = {f.name for f in fields(Contract)} - {"model", "optional_fields", "reads", "special_tokens"}
    every = {f"{p}.{a.name}" for p, cls in PARTS.items() for a in fields(cls)} | (names - set(PARTS))
    assert every == {i for i in ITEMS if not i.startswith("special_tokens.")}


def test_a_contract_from_a_mapping_is_its_items_and_fills_what_another_cannot_tell():
    """``--model.contract``'s mapping (Contract.from_dict) round-trips through items(); merged onto a
    spec's contract it fills "any" and Unknown items, unites fields and tokens, and refuses an item the
    spec sets otherwise or a name no contract has."""
    from shards.cache import Unknown
    d = {"fields": ["codes"], "special_tokens": {"<|AUDIO_OUT|>": 10}, "label_policy": "answers",
         "codec": {"name": "higgs", "weights": "c" * 64}, "image": {"size": 512}}
    c = Contract.from_dict("m", d)
    assert c.items() == {"fields": ("codes",), "special_tokens.<|AUDIO_OUT|>": 10, "codec.name": "higgs",
                         "codec.weights": "c" * 64, "label_policy": "answers", "image.size": 512}
    assert Contract.from_items("m", c.items()) == c
    spec = Contract("m", fields=("input_ids",), codec=Codec(name="higgs", weights=Unknown("name it")))
    got = spec.merged(c)
    assert got.codec == Codec(name="higgs", weights="c" * 64) and got.fields == ("input_ids", "codes")
    assert got.image == ImagePreset(size=512) and got.label_policy == "answers"
    with pytest.raises(ValueError, match="already sets codec.name to 'higgs', not 'dac'"):
        spec.merged(Contract.from_dict("m", {"codec": {"name": "dac"}}))
    with pytest.raises(ValueError, match=r"unknown item\(s\) \['tokenizer', 'codec.rate'\]"):
        Contract.from_dict("m", {"tokenizer": "x", "codec": {"rate": 1}})


@pytest.fixture(scope="module")
def typed_cache(tmp_path_factory) -> Path:
    return cache_with_manifest(tmp_path_factory.mktemp("typed") / "c", MANIFEST, latents=True, image_features=True)


def test_open_reads_manifest_index_id_fields_and_encoders(typed_cache):
    c = Cache.open(str(typed_cache))
    assert c.dir == typed_cache and c.source == str(typed_cache) and len(c) == c.index.num_rows == 2
    assert c.id == read_cache_id(typed_cache) and c.manifest.n_codebooks == 2
    assert set(c.fields) == {"codes", "input_ids", "labels", "audio_segments", "latents", "image_features"}
    assert c.codec == Codec("higgs", 24000, 25.0, 2, 4, 2.0, "c" * 64, "float32", False)
    assert (c.text_tokenizer, c.chat_template, c.label_policy) == ("a" * 64, "tokenizer", "answers")
    assert c.chat_template_sha256 == "7" * 64
    assert c.image == ImagePreset("wan", 512, "stretch", "convert", "0..255", 4, False, "bfloat16", "float16", "d" * 64,
                                  True)
    assert c.feature_encoder == FeatureEncoder("gemma3", 2, 4, "bfloat16", "e" * 64, True,
                                               {"do_normalize": True, "image_mean": [0.5] * 3})
    assert (c.vocab_size, c.pad_id, c.token_id("<|AUDIO_OUT|>"), c.token_id("<nope>")) == (16, 1, 10, None)
    assert Cache.open(c) is c
    c.require(MATCHING)  # every item met: nothing raised
    from loaders import ShardLoader
    ld = ShardLoader(c, 2, fields=("codes", "input_ids"))   # a loader takes the opened cache
    ld.set_epoch(0)
    assert ld.cache_id == c.id and sorted(next(iter(ld))["keys"]) == ["k000", "k001"]
    ld.close()


@pytest.mark.parametrize("item", sorted(ITEMS))
def test_require_refuses_each_item_by_name(typed_cache, item):
    change, cache_value, model_value = ITEMS[item]
    contract = Contract(**{**MATCHING.__dict__, **change})
    with pytest.raises(ContractMismatch) as e:
        Cache.open(typed_cache).require(contract)
    assert e.value.item == item, str(e.value)
    assert [m[0] for m in e.value.mismatches] == [item]             # that item and no other
    msg = str(e.value)
    assert msg.startswith("ContractMismatch: --model test cannot train on the cache ")
    assert "\n" not in msg and f"{item}: the cache has " in msg
    if item != "fields":
        assert (e.value.cache_value, e.value.model_value) == (cache_value, model_value)
        assert repr(model_value) in msg


def test_a_cache_without_codes_or_images_is_refused_by_what_needs_them(tmp_path):
    bare = copy.deepcopy(MANIFEST)
    for k in ("n_codebooks", "codebook_size", "frame_rate", "codec_sample_rate", "latent_channels", "fields"):
        bare.pop(k)
    bare["encoders"]["audio_tokenizer"] = {"name": None}
    bare["encoders"]["image_encoder"] = {"name": None}
    c = Cache.open(cache_with_manifest(tmp_path / "c", bare))
    assert c.codec is c.image is c.feature_encoder is None
    with pytest.raises(ContractMismatch, match=r"codec\.name: the cache has None"):
        c.require(Contract("m", codec=Codec(name="higgs")))
    with pytest.raises(ContractMismatch, match=r"feature_encoder\.name: the cache has None"):
        c.require(Contract("m", feature_encoder=FeatureEncoder(name="gemma3")))
    c.require(Contract("m", codec=Codec(), image=None))             # "any codec" asks for nothing


# ---- the recipes' contracts against caches of other encoders ------------------------------------------

@pytest.fixture(scope="module")
def MODELS(higgs_models, tmp_path_factory) -> Path:
    """A folder of the tiny models these tests name: higgs-tiny and its audio tokenizer (the session's),
    gemma3-tiny, encodec-tiny, wan-tiny."""
    from tools.testing import build
    out = tmp_path_factory.mktemp("contract-models")
    for name in ("higgs-tiny", "higgs-audio-tokenizer-tiny"):
        (out / name).symlink_to(higgs_models / name)
    for name in ("gemma3", "encodec", "wan"):
        build(name, out)
    return out


def _higgs_contract(MODELS):
    """--model.name higgs's contract with the tiny tokenizer named as its paired audio tokenizer."""
    from train.models import run_contract
    return run_contract("higgs", {"lm": str(MODELS / "higgs-tiny")}, str(MODELS / "higgs-audio-tokenizer-tiny"))


def _theworld_contract(MODELS, **kw):
    from train.recipes.theworld import TheWorldModel
    return TheWorldModel.contract({"lm": str(MODELS / "gemma3-tiny"), "vae": str(MODELS / "wan-tiny"), **kw})


def test_higgs_declares_its_codec_frame_rate_and_tokenizer(MODELS):
    """The codec, the tokenizer and every id the model reads come from the checkpoint (config, tokenizer
    files); the codec's weights from its paired audio tokenizer: named by the processor config (the tiny
    checkpoint has none: Unknown, refused whatever the cache) or by --model.audio_tokenizer."""
    from transformers import AutoTokenizer

    from shardcache.weights import checkpoint_sha256
    from shards.cache import Unknown
    from shards.tokens import vocab_sha256
    from train.recipes.higgs import HiggsModel
    c = _higgs_contract(MODELS)
    tok = AutoTokenizer.from_pretrained(str(MODELS / "higgs-tiny"))
    assert c.codec == Codec("higgs", 24000, 25.0, 8, 1024, 2.0,            # 8 x 10 bits x 25 frames/s = 2 kbps
                            checkpoint_sha256(str(MODELS / "higgs-audio-tokenizer-tiny")), "float32")
    assert c.text_tokenizer == vocab_sha256(tok)
    assert c.special_tokens == {t: tok.convert_tokens_to_ids(t) for t in (
        "<|AUDIO_OUT|>", "<|audio_out_bos|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|eot_id|>", "<|eom_id|>")}
    assert c.special_tokens["<|AUDIO_OUT|>"] == 310 and c.pad_id == tok.pad_token_id
    assert (c.chat_template, c.label_policy) == ("llama3", "answers")
    unnamed = HiggsModel.contract({"lm": str(MODELS / "higgs-tiny")}).codec.weights
    assert isinstance(unnamed, Unknown) and "--model.audio_tokenizer" in repr(unnamed)
    # a processor config naming its audio tokenizer (what the conversion script writes) is read
    named = MODELS / "higgs-with-processor"
    named.mkdir(exist_ok=True)
    for f in (MODELS / "higgs-tiny").iterdir():
        (named / f.name).unlink(missing_ok=True)
        (named / f.name).symlink_to(f)
    (named / "processor_config.json").write_text(json.dumps({"audio_tokenizer": {
        "audio_tokenizer_class": "HiggsAudioV2TokenizerModel",
        "audio_tokenizer_name_or_path": str(MODELS / "higgs-audio-tokenizer-tiny")}}))
    assert HiggsModel.contract({"lm": str(named)}).codec == c.codec


def _higgs_like(MODELS, **codec) -> dict:
    c = _higgs_contract(MODELS)
    m = copy.deepcopy(MANIFEST)
    m["encoders"]["audio_tokenizer"] = {"name": codec.get("name", "higgs"), "bandwidth": codec.get("bandwidth", 2),
                                        "checkpoint_sha256": codec.get("weights", c.codec.weights), "dtype": "float32"}
    m["encoders"]["text_tokenizer"]["vocab_sha256"] = codec.get("tokenizer", c.text_tokenizer)
    m.update(n_codebooks=8, codebook_size=1024, frame_rate=codec.get("frame_rate", 25.0))
    m["text"]["special_token_ids"] = dict(c.special_tokens)
    m["text"].update(pad_id=c.pad_id, template="llama3")
    return m


def test_higgs_refuses_encodec_at_75_frames_and_another_tokenizer(tmp_path, MODELS):
    """EnCodec at 6 kbps writes 8 x 1024 codes (the codebook count and size Higgs has) at 75 frames/s:
    refused by codec name, frame rate, bandwidth and weights; codes of Higgs' codec tokenized with another
    tokenizer are refused by its fingerprint."""
    contract = _higgs_contract(MODELS)
    Cache.open(cache_with_manifest(tmp_path / "ok", _higgs_like(MODELS), Q=8)).require(contract)
    enc = Cache.open(cache_with_manifest(tmp_path / "enc", _higgs_like(
        MODELS, name="encodec", frame_rate=75.0, bandwidth=6, weights="9" * 64), Q=8))
    with pytest.raises(ContractMismatch) as e:
        enc.require(contract)
    assert [m[0] for m in e.value.mismatches] == ["codec.name", "codec.frame_rate", "codec.bandwidth", "codec.weights"]
    assert "codec.frame_rate: the cache has 75.0, the model needs 25.0" in str(e.value)
    assert "--model.allow_other_encoder_weights" in str(e.value)
    tok = Cache.open(cache_with_manifest(tmp_path / "tok", _higgs_like(MODELS, tokenizer="c" * 64), Q=8))
    with pytest.raises(ContractMismatch, match="text_tokenizer: the cache has 'ccc"):
        tok.require(contract)


def test_theworld_refuses_another_feature_encoder_and_image_preset(tmp_path, MODELS):
    contract = _theworld_contract(MODELS)
    fe = contract.feature_encoder
    assert (fe.name, fe.tokens_per_image, fe.hidden_size, fe.dtype) == ("gemma3", 16, 64, "bfloat16")
    m = copy.deepcopy(MANIFEST)
    m["text"]["special_token_ids"] = dict(contract.special_tokens)
    m["text"].update(template="theworld", pad_id=contract.pad_id)
    m["encoders"]["preprocessing"]["label_policy"] = "all_but_world"
    m["fields"]["image_features"].update(tokens_per_image=16, hidden_size=64)
    m["fields"]["image_features"]["encoder"]["encoder"].update(checkpoint_sha256=fe.weights,
                                                               pixel_options=fe.image_processor)
    m["latent_channels"] = 16
    m["encoders"]["image_encoder"]["checkpoint_sha256"] = contract.image.weights
    m["encoders"]["text_tokenizer"]["vocab_sha256"] = contract.text_tokenizer   # Gemma's, world markers added
    m["encoders"]["text_tokenizer"]["config"]["chat_template_sha256"] = contract.chat_template_sha256
    Cache.open(cache_with_manifest(tmp_path / "ok", m, latents=True, image_features=True)).require(contract)
    other = copy.deepcopy(m)
    other["fields"]["image_features"].update(tokens_per_image=256)       # another vision tower's features
    other["encoders"]["preprocessing"]["image_pixel_range"] = "-1..1"     # LLaVA-style latents
    other["encoders"]["text_tokenizer"]["vocab_sha256"] = "d" * 64        # another tokenizer
    with pytest.raises(ContractMismatch) as e:
        Cache.open(cache_with_manifest(tmp_path / "other", other, latents=True, image_features=True)).require(contract)
    assert [x[0] for x in e.value.mismatches] == ["text_tokenizer", "image.pixel_range",
                                                   "feature_encoder.tokens_per_image"]


def test_every_recipe_judges_the_demo_cache(demo_cache, MODELS):
    """The demo cache (DAC codes, the byte tokenizer, Wan latents, no image features, no world markers):
    the reference model can use it (it sizes itself from it); tts and vlm read token ids with an LM's token
    embeddings, so only an LM of that tokenizer can (the default LM, not here, ships none that is known:
    refused naming model.kwargs.tokenizer; the tiny Higgs tokenizer is another one); higgs and theworld
    cannot, and say why."""
    from train.models import run_contract
    c = Cache.open(demo_cache)
    c.require(run_contract("reference", {}))
    for name in ("tts", "vlm"):
        with pytest.raises(ContractMismatch) as e:
            c.require(run_contract(name, {}))
        assert [m[0] for m in e.value.mismatches] == ["text_tokenizer"] and "model.kwargs.tokenizer" in str(e.value)
        with pytest.raises(ContractMismatch, match="text_tokenizer: the cache has '[0-9a-f]{64}', the model needs "
                                                   r"'[0-9a-f]{64}' \(read from .*higgs-tiny\)"):
            c.require(run_contract(name, {"tokenizer": str(MODELS / "higgs-tiny")}))
    with pytest.raises(ContractMismatch) as e:
        c.require(_higgs_contract(MODELS))
    items = [m[0] for m in e.value.mismatches]
    assert "codec.name" in items and "text_tokenizer" in items and "special_tokens.<|AUDIO_OUT|>" in items
    with pytest.raises(ContractMismatch) as e:
        c.require(_theworld_contract(MODELS))
    items = [m[0] for m in e.value.mismatches]
    assert items[0] == "fields" and "feature_encoder.name" in items and "image.pixel_range" in items


def test_train_cli_refuses_a_mismatch_with_exit_2_before_loading_weights(demo_cache, tmp_path, MODELS):
    r = subprocess.run([sys.executable, "-m", "shardcache", "train", "--cache", str(demo_cache), "--model.name", "higgs",
                        "--model.kwargs", json.dumps({"lm": str(MODELS / "higgs-tiny")}), "--run_dir", str(tmp_path / "run"),
                        "--training.steps", "1"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stdout + r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "error: ContractMismatch: --model.name higgs cannot train on the cache" in last
    assert "codec.name: the cache has 'dac', the model needs 'higgs'" in last and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").glob("step-*"))


def test_the_trainer_reads_the_manifest_and_index_once(tmp_path, monkeypatch):
    """Setting up a run (model sized from the cache, contract, training and held-out validation loaders,
    the cache id) reads index.parquet at most once (into the node's index store, shards.columns: none
    when the store of that index is there already; the held-out split reads the keys from the store)
    and manifest.json twice (its contents, and the integrity root's check): the trainer opens the cache
    once and hands the Cache to the model and both loaders (before: 6 manifest and 3 index reads)."""
    import pyarrow.parquet as pq

    from test_train_support import TINY_MODEL, make_cache
    from train import dist as D
    from test_train_support import from_dict
    from train.trainer import Trainer
    cache = make_cache(tmp_path / "c", n=24)
    cfg = from_dict(dict(cache=str(cache), out=str(tmp_path / "run"), model_kwargs=TINY_MODEL, batch_size=4,
                         steps=2, val_fraction=0.2, progress=False, threads=1))
    reads = {"manifest": 0, "index": 0}
    real_text, real_table, real_file = Path.read_text, pq.read_table, pq.ParquetFile.__init__

    def text(p, *a, **k):
        reads["manifest"] += p.name == "manifest.json"
        return real_text(p, *a, **k)

    def table(p, *a, **k):
        reads["index"] += str(p).endswith("index.parquet")
        return real_table(p, *a, **k)

    def parquet_file(self, p, *a, **k):
        reads["index"] += str(p).endswith("index.parquet")
        return real_file(self, p, *a, **k)

    monkeypatch.setattr(Path, "read_text", text)
    monkeypatch.setattr(pq, "read_table", table)
    monkeypatch.setattr(pq.ParquetFile, "__init__", parquet_file)
    t = Trainer(cfg, D.DistInfo())
    try:
        assert t.val_loader is not None and t.cache_id == t.cache.id
        assert reads["manifest"] == 2 and reads["index"] <= 1, reads
    finally:
        t.loader.close()
        t.val_loader.close()


@pytest.mark.slow
def test_higgs_accepts_its_own_caches_and_refuses_a_real_encodec_cache(higgs_caches, tiny_config, tmp_path, MODELS):
    """Caches precomputed with the tiny models: configs/precompute-tts.yaml with Higgs' tiny tokenizers
    meets every item of --model.name higgs's contract (the tokenizer fingerprint stage one records is the one
    the recipe computes); demo rows encoded with EnCodec at 6 kbps (8 x 1024 codes at 75 frames/s) are
    refused by codec name, frame rate and bandwidth, not by codebooks."""
    import dataclasses

    from precompute.job import run
    contract = _higgs_contract(MODELS)
    for cache, _ in higgs_caches.values():
        Cache.open(cache).require(contract)
    cfg = dataclasses.replace(tiny_config, audio_tokenizer={"name": "encodec", "pretrained": str(MODELS / "encodec-tiny"),
                                                             "bandwidth": 6.0}, image_encoder=None)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(x + "\n" for x in DEMO.read_text().splitlines()[:2]))
    (tmp_path / "audio").symlink_to(DEMO.parent / "audio")
    run(rows, tmp_path / "encodec", cfg, progress=False)
    c = Cache.open(tmp_path / "encodec")
    from shardcache.weights import checkpoint_sha256
    assert c.codec == Codec("encodec", 24000, 75.0, 8, 1024, 6.0, checkpoint_sha256(MODELS / "encodec-tiny"), "float32",
                            c.codec.tf32)
    with pytest.raises(ContractMismatch) as e:
        c.require(contract)
    codec = [m[0] for m in e.value.mismatches if m[0].startswith("codec.")]
    assert codec == ["codec.name", "codec.frame_rate", "codec.bandwidth", "codec.weights"]   # codebooks agree
