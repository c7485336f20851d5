"""``loaders.higgs.HiggsChatMLDataset`` against the real ``boson-multimodal`` 0.1.1 (Higgs-Audio's own
code). It pins ``transformers<4.47`` and cannot be imported beside transformers 5, so it runs in a venv
of its own (``make boson-venv``, built on first use from the package index: skipped, with the reason,
where that cannot be done; ``$SHARDCACHE_BOSON_VENV`` puts it elsewhere, e.g. somewhere that outlives a
fresh clone) through ``tests/boson_check.py``.

On a voice-cloning cache: each sample's ``input_ids``/``label_ids`` equal Boson's ``prepare_chatml_sample``
on the same ChatML record (Boson's label rule computed by Boson's code), ``HiggsAudioSampleCollator``
trains exactly the target items' columns (frames + delay) of ``label_audio_ids``, and ``HiggsAudioModel``
(tiny random config) runs forward on the batch.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import ROOT


def _tokenizer_for_transformers_4(higgs_models, out):
    """The tiny Higgs tokenizer's files as a released checkpoint has them: ``tokenizer_class``
    ``PreTrainedTokenizerFast``, which transformers 4.46 loads (transformers 5 writes ``TokenizersBackend``,
    which 4.46 does not know); the same vocabulary, so the same fingerprint in both versions."""
    out.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (higgs_models / "higgs-tiny" / f).exists():
            (out / f).write_bytes((higgs_models / "higgs-tiny" / f).read_bytes())
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(dict(cfg, tokenizer_class="PreTrainedTokenizerFast")))
    return out


@pytest.mark.slow
def test_boson_collator_and_model_on_the_dataset(boson_python, higgs_caches, higgs_models, tmp_path):
    """(The dataset checks the model's contract first: the checkpoint's config, its tokenizer, here given as
    :func:`_tokenizer_for_transformers_4`, and the audio tokenizer the codes came from.)"""
    cache, recs = higgs_caches["voice_clone"]
    manifest = cache.parent / "voice_clone.json"
    tokenizer = _tokenizer_for_transformers_4(higgs_models, tmp_path / "tokenizer")
    r = subprocess.run([boson_python, str(ROOT / "tests" / "boson_check.py"), str(cache), str(manifest),
                        str(higgs_models / "higgs-tiny"), str(higgs_models / "higgs-audio-tokenizer-tiny"),
                        str(tokenizer)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["n"] == len(recs) and all(got["same_tokens"]) and all(got["same_labels"])
    assert got["speakers"] == sorted({rec["speaker"] for rec in recs.values()})     # one map for the cache
    # the columns each item occupies in label_audio_ids: its frames + 2 stream tokens + Q - 1 delay columns;
    # a target item (its turn at or after start_index) trains all but its first (frames + delay)
    Q, at, want = 8, 0, []
    starts = []
    for item in got["items"]:
        width = item["frames"] + Q + 1
        starts.append(at)
        if item["target"]:
            want += list(range(at + 1, at + width))
        at += width
    assert got["audio_out_ids_start"] == starts and got["label_audio_ids_shape"] == [Q, at]
    assert any(i["target"] for i in got["items"]) and any(not i["target"] for i in got["items"])
    assert got["trained_columns"] == want
    assert got["finite"] and got["audio_logits_shape"] == [at, Q, 1026]


#: ChatML records with recipients: on an assistant text turn, on a trained and on a context (before
#: start_index) audio turn, an empty one; the last has one on a user turn, which Boson refuses
RECIPIENT_RECORDS = [
    {"messages": [{"role": "system", "content": "Speak."}, {"role": "user", "content": "Hello there."},
                  {"role": "assistant", "recipient": "narrator", "content": "Hi."}]},
    {"messages": [{"role": "user", "content": "Read it."},
                  {"role": "assistant", "recipient": "speaker_a",
                   "content": [{"type": "text", "text": "Sure:"}, {"type": "audio", "audio_url": "a.wav"}]},
                  {"role": "assistant", "recipient": "speaker_b", "content": {"type": "audio", "audio_url": "b.wav"}}],
     "start_index": 2},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "recipient": "", "content": "y"}]},
    {"messages": [{"role": "user", "recipient": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
]


@pytest.mark.slow
def test_recipient_renders_as_boson_prepare_chatml_sample(boson_python, tmp_path):
    """A ChatML ``recipient`` is rendered (``{recipient}<|recipient|>`` after the assistant header, labelled)
    token for token and label for label as Boson's own ``prepare_chatml_sample``; where Boson refuses the
    record (a recipient on a user turn) the row is refused too."""
    from precompute.chat import render
    from precompute.conversation import from_chatml
    from precompute.encoders.registry import load_text_tokenizer

    tok_dir = ROOT / "models" / "higgs-tiny"
    if not (tok_dir / "tokenizer.json").exists():
        pytest.skip("models/higgs-tiny not built (make models)")
    (tmp_path / "recs.json").write_text(json.dumps(RECIPIENT_RECORDS))
    r = subprocess.run([boson_python, str(ROOT / "tests" / "boson_check.py"), "render", str(tmp_path / "recs.json"),
                        str(tok_dir)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    boson = json.loads(r.stdout.strip().splitlines()[-1])
    tok = load_text_tokenizer({"name": "hf", "pretrained": str(tok_dir)})
    for rec, want in zip(RECIPIENT_RECORDS, boson):
        conv, _ = from_chatml(rec, tmp_path)
        if want is None:
            with pytest.raises(ValueError, match="recipient"):
                render(conv, tok, "llama3")
            continue
        ids, labels = render(conv, tok, "llama3")
        assert ids.tolist() == want[0] and labels.tolist() == want[1]
    assert boson[3] is None and all(b is not None for b in boson[:3])
