"""Conversations cached faithfully: Higgs-Audio voice cloning, audio understanding, LLaVA multi-turn.

Expected token sequences are written out here by hand from the manifest records (the Llama-3 /
Higgs-Audio layout) and expected codes come from running the codec on the clip directly, never
from the code under test.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import soundfile as sf
import soxr

from precompute.encoders import load_audio_tokenizer
from precompute.encoders.text import ByteTokenizer
from precompute.job import run
from shards import ShardReader

BOT, SH, EH, EOT = "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
AUDIO_IN = "<|audio_bos|><|AUDIO|><|audio_eos|>"
AUDIO_OUT = "<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>"
TOK = ByteTokenizer()


def header(role: str, first: bool = False) -> str:
    return (BOT if first else "") + f"{SH}{role}{EH}\n\n"


def ids(text: str) -> np.ndarray:
    return TOK.encode(text, add_special_tokens=False)


def trained_positions(prefix: str, trained: str) -> list[int]:
    """Token positions of ``trained`` right after ``prefix`` (byte tokenizer: one id per byte or special)."""
    start = len(ids(prefix))
    return list(range(start, start + len(ids(trained))))


@pytest.fixture(scope="module")
def caches(real_mini, tiny_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv")
    audio_cfg = dataclasses.replace(tiny_config, image_encoder=None)
    result = {}
    for name, cfg in [("chatml_voice_clone", audio_cfg), ("chatml_audio_understanding", audio_cfg),
                      ("llava_multiturn", dataclasses.replace(tiny_config, audio_tokenizer=None))]:
        summary, _ = run(real_mini / f"{name}.json", out / name, cfg, progress=False)
        assert summary.rejected == 0, summary.reasons
        result[name] = out / name
    return result


def _by_key(cache):
    r = ShardReader(cache)
    return {k: r.get(i) for i, k in enumerate(r.keys)}


def test_voice_clone_keeps_both_clips_and_trains_only_the_target(real_mini, caches, tiny_config):
    recs = json.loads((real_mini / "chatml_voice_clone.json").read_text())
    samples = _by_key(caches["chatml_voice_clone"])
    assert len(samples) == len(recs) == 30
    codec = load_audio_tokenizer(tiny_config.audio_tokenizer)
    for rec in recs[:4]:
        s = samples[rec["misc"]["key"]]
        m = rec["messages"]
        system, ref_text, target_text = m[0]["content"], m[1]["content"], m[3]["content"]
        prefix = (header("system", True) + system + EOT + header("user") + ref_text + EOT
                  + header("assistant") + AUDIO_OUT + EOT + header("user") + target_text + EOT
                  + header("assistant"))
        assert s["input_ids"].tolist() == ids(prefix + AUDIO_OUT + EOT).tolist()
        # Higgs-Audio (prepare_chatml_sample) trains the last assistant turn (start_index 4): its three
        # audio-out tokens, the <|AUDIO_OUT|> placeholder included (Boson's collator reads that label to
        # pick the target items), and <|eot_id|>; the reference turn (2) is context, all -100
        expect = trained_positions(prefix, AUDIO_OUT + EOT)
        assert len(expect) == 4 and s["input_ids"][expect[1]] == TOK.token_to_id("<|AUDIO_OUT|>")
        assert np.flatnonzero(s["labels"] != -100).tolist() == expect
        assert (s["labels"][expect] == s["input_ids"][expect]).all()
        # two audio segments: the reference (turn 2) and the target (turn 4), both output-side
        seg = s["audio_segments"]
        assert seg.shape == (2, 6)
        assert seg[:, 1].tolist() == [2, 4] and seg[:, 2].tolist() == [1, 1]
        # the target clip is the LAST segment: its codes are the codec's codes of the target file
        for k, msg in ((0, m[2]), (1, m[4])):
            y, sr = sf.read(real_mini / msg["content"]["audio_url"], dtype="float32")
            want = codec.encode([soxr.resample(y, sr, codec.sample_rate, quality="HQ").astype(np.float32)])[0]
            start, n = int(seg[k, 3]), int(seg[k, 4])
            assert n == want.shape[1]
            np.testing.assert_array_equal(s["codes"][:, start:start + n], want)
        assert int(seg[1, 3] + seg[1, 4]) == s["codes"].shape[1]
        # waveforms: one span per item, at 24 kHz, the target's length from the file itself
        starts = s["audio_starts"]
        info = sf.info(str(real_mini / m[4]["content"]["audio_url"]))
        assert starts[2] - starts[1] == pytest.approx(info.frames * 24000 / info.samplerate, abs=2)
        assert s["json"]["conversation"]["start_index"] == 4


def test_audio_understanding_keeps_user_audio_as_input(real_mini, caches):
    recs = json.loads((real_mini / "chatml_audio_understanding.json").read_text())
    samples = _by_key(caches["chatml_audio_understanding"])
    for rec in recs[:3]:
        s = samples[rec["misc"]["key"]]
        m = rec["messages"]
        question = m[1]["content"][0]["text"]
        prefix = (header("system", True) + m[0]["content"] + EOT + header("user") + question + AUDIO_IN
                  + EOT + header("assistant"))
        assert s["input_ids"].tolist() == ids(prefix + m[2]["content"] + EOT).tolist()
        assert np.flatnonzero(s["labels"] != -100).tolist() == trained_positions(prefix, m[2]["content"] + EOT)
        seg = s["audio_segments"]
        assert seg.shape == (1, 6) and seg[0, 1] == 1 and seg[0, 2] == 0  # turn 1, direction in
        assert seg[0, 4] > 0 and s["codes"].shape[1] == seg[0, 4]


def test_llava_multiturn_keeps_both_rounds_and_trains_both_answers(real_mini, caches):
    recs = json.loads((real_mini / "llava_multiturn.json").read_text())
    samples = _by_key(caches["llava_multiturn"])
    assert len(samples) == len(recs)
    for rec in recs:
        s = samples[rec["id"]]
        c = [t["value"] for t in rec["conversations"]]
        assert "<image>" in c[0]
        text = (header("user", True) + c[0] + EOT + header("assistant") + c[1] + EOT
                + header("user") + c[2] + EOT + header("assistant") + c[3] + EOT)
        assert s["input_ids"].tolist() == ids(text).tolist()
        p1 = header("user", True) + c[0] + EOT + header("assistant")
        p2 = p1 + c[1] + EOT + header("user") + c[2] + EOT + header("assistant")
        want = trained_positions(p1, c[1] + EOT) + trained_positions(p2, c[3] + EOT)
        assert np.flatnonzero(s["labels"] != -100).tolist() == want
        assert TOK.decode(s["labels"][s["labels"] != -100]) == c[1] + c[3]
        assert s["latents"].shape[:2] == (16, 1)  # one image: latent frame 0
        assert "codes" not in s and "audio" not in s


def test_image_text_job_never_builds_an_audio_tokenizer(real_mini, tiny_config, tmp_path, monkeypatch):
    import precompute.encode as encode

    def boom(*a, **k):
        raise AssertionError("an audio tokenizer was constructed for an image-text job")

    monkeypatch.setattr(encode, "load_audio_tokenizer", boom)
    cfg = dataclasses.replace(tiny_config, audio_tokenizer=None)
    summary, manifest = run(real_mini / "llava_multiturn.json", tmp_path / "c", cfg, progress=False)
    assert summary.kept == 8 and "n_codebooks" not in manifest
    assert manifest["text"]["special_token_ids"]["<image>"] == TOK.token_to_id("<image>")


def test_audio_job_never_builds_an_image_encoder_and_rejects_image_rows(real_mini, tiny_config, tmp_path,
                                                                         monkeypatch):
    import precompute.encode as encode

    monkeypatch.setattr(encode, "load_image_encoder", lambda *a, **k: (_ for _ in ()).throw(AssertionError("VAE")))
    cfg = dataclasses.replace(tiny_config, image_encoder=None)
    summary, manifest = run(real_mini / "train_chatml_samples.json", tmp_path / "c", cfg, progress=False)
    assert summary.reasons == {"encode_failed": 8}  # the 8 rows with an image item, named in rejects
    assert summary.kept == 260 and "latent_channels" not in manifest


def test_extra_waveform_for_input_audio_at_16k(real_mini, tiny_config, tmp_path):
    cfg = dataclasses.replace(tiny_config, image_encoder=None, extra_fields={
        "audio_16k": {"producer": "waveform", "sample_rate": 16000, "direction": "in"}})
    _, manifest = run(real_mini / "chatml_audio_understanding.json", tmp_path / "c", cfg, progress=False)
    assert manifest["waveforms"]["audio_16k"] == {"sample_rate": 16000, "directions": ["in"]}
    assert manifest["encoders"]["preprocessing"]["extra_fields"]["audio_16k"]["sample_rate"] == 16000  # fingerprinted
    rec = json.loads((real_mini / "chatml_audio_understanding.json").read_text())[0]
    s = _by_key(tmp_path / "c")[rec["misc"]["key"]]
    y, sr = sf.read(real_mini / rec["messages"][1]["content"][1]["audio_url"], dtype="float32")
    want = np.clip(np.rint(soxr.resample(y, sr, 16000, quality="HQ") * 32768), -32768, 32767).astype(np.int16)
    assert s["audio_16k_starts"].tolist() == [0, len(want)]
    np.testing.assert_allclose(s["audio_16k"].astype(np.int32), want.astype(np.int32), atol=1)


def test_extra_waveform_absent_where_no_item_has_its_direction(real_mini, tiny_config, tmp_path):
    """A TTS conversation has only output audio: no empty audio_16k member (a tar header each)."""
    cfg = dataclasses.replace(tiny_config, image_encoder=None, extra_fields={
        "audio_16k": {"producer": "waveform", "sample_rate": 16000, "direction": "in"}})
    run(real_mini / "chatml_voice_clone.json", tmp_path / "c", cfg, progress=False)
    s = next(iter(_by_key(tmp_path / "c").values()))
    assert "audio_16k" not in s and "audio_16k_starts" not in s and s["audio_starts"].shape == (3,)
