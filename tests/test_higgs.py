"""Higgs-Audio v2 from the cache: batches equal to ``HiggsAudioV2Processor(output_labels=True)``'s.

Each real-mini ChatML manifest (a few samples of each: conftest.higgs_caches) is precomputed with configs/precompute-tts.yaml
(the tiny random Higgs audio tokenizer and text tokenizer). The same conversations go through
``transformers``' own processor, built as its conversion script builds it, with the same text tokenizer
and the same audio tokenizer (``HiggsAudioV2TokenizerModel``, run here with the soxr fallback for torchaudio;
it never resamples), fed the waveforms as Boson and transformers load them (``librosa.load`` at 24 kHz, not
our own decoder: the real-mini clips are 8 and 22.05 kHz, so a change of our resampler fails). The cache's batch
(``loaders.higgs.HiggsBatch``, the higgs recipe's ``batch_transform``) must be ``torch.equal`` on every
key, and the model's loss equal on both paths.

Text for the processor: Higgs-Audio v2's real chat template (``apply_chat_template(tokenize=False)``).
It refuses assistant text (the audio-understanding answers); for those conversations the template's
assistant branch renders text items as its user branch does (the only change). It drops user audio,
and ``apply_chat_template(tokenize=True)`` then fails on such a conversation (checked below).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import HIGGS_MANIFESTS

KEYS = ("input_ids", "attention_mask", "labels", "audio_input_ids", "audio_input_ids_mask", "audio_labels")


@pytest.fixture(scope="module")
def processor(higgs_codec):
    """``HiggsAudioV2Processor`` as ``convert_higgs_audio_v2_to_hf.py`` builds it."""
    from transformers import AutoTokenizer, DacFeatureExtractor, HiggsAudioV2Processor

    from transformers import HiggsAudioV2TokenizerModel
    tok = AutoTokenizer.from_pretrained(str(higgs_codec / "higgs-tiny"))
    codec = HiggsAudioV2TokenizerModel.from_pretrained(str(higgs_codec / "higgs-audio-tokenizer-tiny")).eval()
    fe = DacFeatureExtractor(feature_size=1, hop_length=1, padding_side="right", padding_value=0.0,
                             sampling_rate=24000, return_attention_mask=True)
    return HiggsAudioV2Processor(feature_extractor=fe, tokenizer=tok, audio_tokenizer=codec,
                                 chat_template=tok.chat_template, audio_token="<|AUDIO_OUT|>",
                                 audio_bos_token="<|audio_out_bos|>", audio_eos_token="<|audio_eos|>",
                                 audio_stream_bos_id=1024, audio_stream_eos_id=1025)


def _recipe(higgs_codec, cache, **kw):
    """--model.name higgs on ``cache``, its contract naming the tiny audio tokenizer as the paired one."""
    from train.models import build_model, run_contract
    torch.manual_seed(0)
    kwargs = {"lm": str(higgs_codec / "higgs-tiny"), **kw}
    contract = run_contract("higgs", kwargs, str(higgs_codec / "higgs-audio-tokenizer-tiny"))
    return build_model("higgs", kwargs, cache, contract=contract).eval()


def _wave(url: str, sr: int = 24000) -> np.ndarray:
    """The clip as Boson (``HiggsAudioDataset``) and transformers' docs load it: ``librosa.load`` at the
    codec's rate, mono float32; independent of ``precompute.audio.load_audio`` (a change of its resampler
    changes the cache's codes and fails the equivalence tests)."""
    import librosa
    return librosa.load(url, sr=sr, mono=True)[0]


def _conversation(rec: dict, user_audio: str = "drop") -> tuple[list[dict], list[np.ndarray]]:
    """HF messages of a ChatML record and the waveforms the template renders, in order."""
    conv, audios = [], []
    for m in rec["messages"]:
        items = m["content"] if isinstance(m["content"], list) else [m["content"]]
        out = []
        for it in items:
            if isinstance(it, str):
                out.append({"type": "text", "text": it})
            elif it["type"] == "text":
                out.append({"type": "text", "text": it["text"]})
            elif it["type"] == "audio":
                w = _wave(it["audio_url"])
                out.append({"type": "audio", "audio": w})
                if m["role"] == "assistant" or user_audio == "codes":
                    audios.append(w)
        conv.append({"role": m["role"], "content": out})
    return conv, audios


def _template(processor, user_audio: str = "drop") -> str:
    """The real template; its assistant branch also takes text (rendered as the user branch renders
    it); with ``user_audio="codes"`` the user branch writes audio as the scene branch does, unspaced."""
    t = processor.chat_template
    t = t.replace("{%- if message['role'] == 'assistant' %}",
                  "{%- if message['role'] == 'assistant' and message['content'][0]['type'] == 'audio' %}")
    if user_audio == "codes":
        t = t.replace("""                {%- if content_item['type'] == 'text' %}
                    {{- content_item['text'] | trim }}
                {%- endif %}""", """                {%- if content_item['type'] == 'text' %}
                    {{- content_item['text'] | trim }}
                {%- elif content_item['type'] == 'audio' %}
                    {{- '<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}
                {%- endif %}""")
        assert "'<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>' }}\n                {%- endif %}" in t
    return t


def _both(processor, recipe, cache: Path, recs: dict, user_audio: str = "drop"):
    """(processor batch, cache batch) of every sample the cache kept, in index order."""
    from loaders.collate import collate_fn
    from shards import ShardReader, read_manifest

    reader = ShardReader(cache)
    template = _template(processor, user_audio)
    texts, audios = [], []
    for key in reader.keys:
        conv, waves = _conversation(recs[key], user_audio)
        texts.append(processor.apply_chat_template(conv, chat_template=template, tokenize=False))
        audios += waves
    proc = processor(text=texts, audio=audios or None, output_labels=True, return_tensors="pt",
                     add_special_tokens=False)   # as apply_chat_template(tokenize=True): the template writes BOS
    pad = read_manifest(cache)["text"]["pad_id"]
    batch = collate_fn([reader.get(i) for i in range(len(reader))], recipe.fields, pad_id=pad)
    return dict(proc), recipe.batch_transform(batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HIGGS_MANIFESTS))
def test_cache_batch_equals_the_processors_and_so_does_the_loss(name, higgs_caches, processor, higgs_codec):
    cache, recs = higgs_caches[name]
    recipe = _recipe(higgs_codec, cache)
    proc, ours = _both(processor, recipe, cache, recs)
    assert set(ours) - {"keys"} == set(proc), (sorted(ours), sorted(proc))
    for k in proc:
        assert ours[k].dtype == proc[k].dtype and torch.equal(ours[k], proc[k]), k
    if name != "understanding":      # every sample has output audio: frames, delay tokens, audio labels
        assert int(proc["audio_input_ids_mask"].sum()) > 0 and int((proc["audio_labels"] >= 0).sum()) > 0
    assert int((proc["attention_mask"] == 0).sum()) > 0    # several lengths: left padding was compared
    with torch.no_grad():
        ref = recipe.lm(**{k: proc[k] for k in KEYS if k in proc}, use_cache=False).loss
        loss = recipe({**ours})["loss"]
    assert torch.isfinite(ref) and torch.equal(loss, ref.float()), (loss, ref)


@pytest.mark.slow
def test_input_audio_as_codes_equals_the_processor_given_them_as_audio_tokens(higgs_caches, processor, higgs_codec):
    """``input_audio: codes``: a user-turn audio item written as the template writes scene audio."""
    cache, recs = higgs_caches["understanding"]
    recipe = _recipe(higgs_codec, cache, input_audio="codes")
    proc, ours = _both(processor, recipe, cache, recs, user_audio="codes")
    assert int(proc["audio_input_ids_mask"].sum()) > 0
    for k in proc:
        assert torch.equal(ours[k], proc[k]), k


@pytest.mark.slow
def test_the_real_template_drops_user_audio_and_the_processor_then_refuses_it(higgs_caches, processor):
    cache, recs = higgs_caches["understanding"]
    conv, _ = _conversation(next(iter(recs.values())))
    conv[-1]["content"] = [{"type": "audio", "audio": np.zeros(2400, np.float32)}]   # an audio answer
    text = processor.apply_chat_template(conv, tokenize=False)
    assert "<|AUDIO|>" not in text and text.count("<|AUDIO_OUT|>") == 1                # user audio dropped
    with pytest.raises(ValueError, match="number of audio tokens"):
        processor.apply_chat_template(conv, tokenize=True, return_dict=True, return_tensors="pt")


@pytest.mark.slow
def test_targets_labels_train_only_the_trained_turns(higgs_caches, processor, higgs_codec):
    """``labels: targets``: same inputs; text labels the cached ones (the last assistant turn of a
    voice-cloning sample), audio labels the target item's codes and its stream EOS (Boson's
    collator), computed here from the cached codes column by column."""
    from shards import ShardReader

    cache, recs = higgs_caches["voice_clone"]
    recipe = _recipe(higgs_codec, cache, labels="targets")
    proc, ours = _both(processor, recipe, cache, recs)
    for k in ("input_ids", "attention_mask", "audio_input_ids", "audio_input_ids_mask"):
        assert torch.equal(ours[k], proc[k]), k
    reader = ShardReader(cache)
    Q, eos = 8, 1025
    for b in range(len(reader)):
        s = reader.get(b)
        segs, codes = np.asarray(s["audio_segments"]), np.asarray(s["codes"]).astype(np.int64)
        want = []
        for k, seg in enumerate(segs):                       # start_index 4: only the last item trains
            n, start = int(seg[4]), int(seg[3])
            lab = np.full((n + Q + 1, Q), -100)
            if k == len(segs) - 1:
                for q in range(Q):
                    for j in range(n + Q + 1):
                        c = j - q
                        if 1 <= c <= n:
                            lab[j, q] = codes[q, start + c - 1]
                        elif c == n + 1:
                            lab[j, q] = eos
            want.append(lab)
        want = np.concatenate(want)
        got = ours["audio_labels"][b, :len(want)].numpy()
        assert (got == want).all() and (ours["audio_labels"][b, len(want):] == -100).all()
        # text: exactly the tokens the cache trains (the last assistant turn), audio positions -100
        n_text = int((np.asarray(s["labels"]) != -100).sum())
        trained = ours["labels"][b][ours["labels"][b] != -100]
        cached = torch.from_numpy(np.asarray(s["labels"]).astype(np.int64))
        cached = cached[(cached != -100) & (cached != recipe.batch_transform.audio_token_id)]
        assert torch.equal(trained, cached) and n_text > 0
    assert not torch.equal(ours["labels"], proc["labels"])


def test_model_path_must_be_a_higgs_checkpoint(tiny_models, higgs_models, tmp_path):
    from shards import ContractMismatch
    from test_train_support import cache_with_manifest
    from train.models import build_model
    man = {"n_codebooks": 4, "codebook_size": 1024, "frame_rate": 25.0, "codec_sample_rate": 24000,
           "encoders": {"audio_tokenizer": {"name": "higgs"}},
           "text": {"vocab_size": 300, "pad_id": 0, "special_token_ids": {"<|AUDIO_OUT|>": 268}}}
    cache = cache_with_manifest(tmp_path / "cache", man, Q=4)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "higgs_audio"}))    # Boson's own format
    with pytest.raises(ValueError, match="convert_higgs_audio_v2_to_hf"):
        build_model("higgs", {"lm": str(tmp_path)}, cache)
    with pytest.raises(ValueError, match="use --model.name tts"):
        build_model("higgs", {"lm": str(tiny_models / "lm-tiny")}, cache)
    # a cache made with another tokenizer's ids and another number of codebooks: refused by name
    with pytest.raises(ContractMismatch) as e:
        build_model("higgs", {"lm": str(higgs_models / "higgs-tiny")}, cache)
    items = [m[0] for m in e.value.mismatches]
    assert "special_tokens.<|AUDIO_OUT|>" in items and "codec.n_codebooks" in items


@pytest.mark.slow
def test_the_transform_runs_in_the_loader_workers(higgs_caches, higgs_codec):
    """ShardLoader(transform=recipe.batch_transform): the same batches from 2 worker processes as in-process."""
    from loaders import ShardLoader, Workers
    cache, _ = higgs_caches["voice_clone"]
    recipe = _recipe(higgs_codec, cache)

    def batches(workers: int) -> list[dict]:
        ld = ShardLoader(cache, 3, fields=recipe.fields, transform=recipe.batch_transform, workers=Workers(num_workers=workers))
        ld.set_epoch(0)
        return list(ld)

    here, there = batches(0), batches(2)
    assert len(here) == len(there) == 2
    for a, b in zip(here, there):
        assert a["keys"] == b["keys"] and set(a) == set(b) and "audio_input_ids" in a
        assert all(torch.equal(a[k], b[k]) for k in KEYS)


@pytest.mark.slow
def test_lora_checkpoints_hold_the_adapters_only(higgs_caches, higgs_models, tmp_path, monkeypatch):
    from safetensors import safe_open

    from test_train_support import Captured
    from test_train_support import config_from_dict as from_dict
    from train.trainer import run
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cache, _ = higgs_caches["voice_clone"]
    cfg = from_dict({"data": {"cache": str(cache), "batch_size": 2},
                     "model": {"name": "higgs", "kwargs": {"lm": str(higgs_models / "higgs-tiny")},
                               "audio_tokenizer": str(higgs_models / "higgs-audio-tokenizer-tiny")},
                     "lora": {"enabled": True}, "training": {"steps": 3}, "checkpoint": {"every": 3},
                     "job": {"dir": str(tmp_path / "run")}, "metrics": {"progress": False}, "dist": {"threads": 1}})
    with Captured():          # (a handler of our own: the trainer leaves the logger's propagation alone)
        assert run(cfg) == 0
    ck = tmp_path / "run" / "step-3"
    assert (ck / "adapter.safetensors").exists() and not (ck / "model.safetensors").exists()
    with safe_open(str(ck / "adapter.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all("lora_" in n for n in names), names
    assert any("self_attn.q_proj.lora_A" in n for n in names)


def test_chatml_dataset_input_waveforms_and_speakers(higgs_caches, higgs_models):
    """HiggsChatMLDataset (without boson_multimodal: ``sample_class``): the input items' waveforms at
    16 kHz (decoded here again from the source files), one speaker map for the whole cache."""
    from types import SimpleNamespace

    from loaders.higgs import HiggsChatMLDataset
    model = {"checkpoint": higgs_models / "higgs-tiny", "audio_tokenizer": higgs_models / "higgs-audio-tokenizer-tiny"}
    cache, recs = higgs_caches["understanding"]
    ds = HiggsChatMLDataset(cache, **model, sample_class=SimpleNamespace)
    assert ds.waveforms == "audio_16k" and ds.rate == 16000
    assert ds.speakers == sorted({r["speaker"] for r in recs.values()})
    for i, key in enumerate(ds.reader.keys):
        s, rec = ds[i], recs[key]
        url = next(it["audio_url"] for m in rec["messages"] if isinstance(m["content"], list)
                   for it in m["content"] if isinstance(it, dict) and it.get("type") == "audio")
        want = _wave(url, 16000)
        assert s.audio_sample_rate.tolist() == [16000.0] and s.audio_waveforms_start.tolist() == [0]
        np.testing.assert_allclose(s.audio_waveforms_concat.numpy(), want, atol=2e-4)
        assert s.audio_speaker_indices.tolist() == [-1]   # input items have a speaker only when the item names one
        assert s.audio_ids_concat.shape[0] == 8 and s.audio_ids_start.tolist() == [0]
    cache, recs = higgs_caches["voice_clone"]                # output items: the sample's speaker, cache-wide ids
    for speakers in (None, ["nobody", "lucas", "jackson", "george"]):
        ds = HiggsChatMLDataset(cache, **model, speakers=speakers, sample_class=SimpleNamespace)
        assert ds.speakers == (speakers or sorted({r["speaker"] for r in recs.values()}))
        for i, key in enumerate(ds.reader.keys):
            assert ds[i].audio_speaker_indices.tolist() == [ds.speakers.index(recs[key]["speaker"])] * 2
            assert ds[i].audio_waveforms_concat.numel() == 0


def test_a_checkpoint_without_a_text_head_is_refused_unless_asked_to_create_one(higgs_models, tmp_path):
    """``use_text_head`` (default) on a checkpoint without ``text_lm_head.weight`` (Boson's generation
    checkpoint converted without one): refused before loading, naming the option; ``create_text_head:
    true`` builds a new one (not the checkpoint's: it has none); ``use_text_head: false`` needs none."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from train.recipes.higgs import HiggsModel
    src = higgs_models / "higgs-tiny"
    cfg = AutoConfig.from_pretrained(str(src))
    headless = tmp_path / "headless"
    shutil.copytree(src, headless)
    weights = load_file(str(src / "model.safetensors"))
    assert "text_lm_head.weight" in weights
    save_file({k: v for k, v in weights.items() if k != "text_lm_head.weight"}, str(headless / "model.safetensors"),
              metadata={"format": "pt"})
    kw = {"n_codebooks": cfg.num_codebooks, "codebook_size": cfg.audio_stream_bos_id}   # the codes below BOS/EOS
    with pytest.raises(ValueError, match="has no text head .*create_text_head: true"):
        HiggsModel(lm=str(headless), **kw)
    torch.manual_seed(0)
    made = HiggsModel(lm=str(headless), create_text_head=True, **kw)
    assert made.lm.text_lm_head is not None
    assert not torch.equal(made.lm.text_lm_head.weight, weights["text_lm_head.weight"])
    assert HiggsModel(lm=str(headless), use_text_head=False, **kw).lm.text_lm_head is None
    loaded = HiggsModel(lm=str(src), **kw)                          # the checkpoint's own head, as stored
    assert torch.equal(loaded.lm.text_lm_head.weight, weights["text_lm_head.weight"])


def test_tts_preset_pins_the_released_bandwidth_and_codebooks(higgs_codec):
    """configs/precompute-tts.yaml pins the Higgs tokenizer at 2 kbps = 8 codebooks: its codec loads with
    8 codebooks of 1024 at 25 frames/s; a bandwidth giving another count (here 1 kbps -> 4, as a config
    reaching 16 would) is refused when the codec loads, at stage one, naming both options."""
    from precompute.config import load_config
    from precompute.encoders.registry import load_audio_tokenizer
    from precompute.validate import check_config
    from conftest import ROOT
    cfg = load_config(ROOT / "configs" / "precompute-tts.yaml",
                      [f"audio_tokenizer.pretrained={higgs_codec / 'higgs-audio-tokenizer-tiny'}"])
    assert check_config(cfg) == []
    assert (cfg.audio_tokenizer["bandwidth"], cfg.audio_tokenizer["n_codebooks"]) == (2, 8)
    codec = load_audio_tokenizer(cfg.audio_tokenizer)
    assert (codec.n_codebooks, codec.codebook_size, codec.sample_rate // codec.hop_length) == (8, 1024, 25)
    with pytest.raises(ValueError, match=r"bandwidth 1 kbps gives 4 codebooks, n_codebooks pins 8"):
        load_audio_tokenizer(dict(cfg.audio_tokenizer, bandwidth=1))


def test_lora_run_exports_as_a_from_pretrained_checkpoint(higgs_models, tmp_path):
    """A LoRA run (adapters saved as the trainer saves them, loaded back onto a fresh recipe) exported
    with ``train.checkpoint.export_pretrained``: ``HiggsAudioV2ForConditionalGeneration.from_pretrained``
    of the directory gives the LoRA model's logits (text and audio), not the base model's; it holds no
    LoRA weight, and the tokenizer files of the base come with it."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, HiggsAudioV2ForConditionalGeneration

    from train.checkpoint import base_fingerprint, export_pretrained, load_model, save
    from train.dist import DistInfo
    from train.recipes.higgs import HiggsModel
    src = higgs_models / "higgs-tiny"
    cfg = AutoConfig.from_pretrained(str(src))
    kw = {"lm": str(src), "n_codebooks": cfg.num_codebooks, "codebook_size": cfg.audio_stream_bos_id, "lora": True}
    torch.manual_seed(0)
    trained = HiggsModel(**kw).eval()
    with torch.no_grad():
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)               # as after training: B = 0 would make the merge a no-op
    save(tmp_path / "run", 1, model=trained, state={"optimizer": {}}, loader_state={}, info=DistInfo(), config={},
         keep=1, adapter={"format": 1, "model": "higgs", "base": str(src), "base_fingerprint": base_fingerprint(trained),
                          "lora": trained.lora})
    model = HiggsModel(**kw).eval()
    load_model(model, tmp_path / "run" / "step-1")
    T, Q = 12, cfg.num_codebooks
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 250, (2, T), generator=g), "attention_mask": torch.ones(2, T, dtype=torch.long),
             "audio_input_ids": torch.randint(0, 1024, (2, 5, Q), generator=g),
             "audio_input_ids_mask": torch.ones(2, 5, dtype=torch.bool)}
    batch["input_ids"][:, 3:8] = cfg.audio_token_id
    with torch.no_grad():
        want = model.lm(**batch, use_cache=False)
        base = HiggsAudioV2ForConditionalGeneration.from_pretrained(str(src), use_text_head=True).eval()(**batch, use_cache=False)
    assert (want.logits - base.logits).abs().max() > 1e-3                # the adapters change the output
    out = export_pretrained(model, tmp_path / "export", base=src)
    reloaded = HiggsAudioV2ForConditionalGeneration.from_pretrained(str(out), use_text_head=True).eval()
    with torch.no_grad():
        got = reloaded(**batch, use_cache=False)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert "text_lm_head.weight" in names and not any("lora" in n for n in names)
    assert AutoTokenizer.from_pretrained(str(out)).vocab == AutoTokenizer.from_pretrained(str(src)).vocab


def test_bosons_tokenizer_format_is_refused_with_what_to_use(higgs_codec, tmp_path):
    """A directory as Boson ships its tokenizer (``bosonai/higgs-audio-v2-tokenizer``: ``model.pth`` and the
    keyword arguments of boson_multimodal's ``HiggsAudioTokenizer`` as config.json) is refused naming the
    format and the transformers-format tokenizer to use, not with transformers' generic error; the
    transformers-format one loads."""
    from precompute.encoders.registry import load_audio_tokenizer
    boson = tmp_path / "higgs-audio-v2-tokenizer"
    boson.mkdir()
    (boson / "config.json").write_text(json.dumps({"n_filters": 32, "D": 128, "target_bandwidths": [1, 1.5, 2, 4, 6],
                                                   "ratios": [8, 5, 4, 2, 3], "sample_rate": 24000, "bins": 1024,
                                                   "n_q": 8, "semantic_techer": "hubert_base_general"}))
    (boson / "model.pth").write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"Boson's own Higgs audio tokenizer format .* transformers cannot load.*"
                                         r"eustlb/higgs-audio-v2-tokenizer"):
        load_audio_tokenizer({"name": "higgs", "pretrained": str(boson)})
    assert load_audio_tokenizer({"name": "higgs", "pretrained": str(higgs_codec / "higgs-audio-tokenizer-tiny")}).n_codebooks == 8
