"""Chat templates: the tokenizer's own apply_chat_template and the named Llama-3 layout agree; label
spans come from the template's structure for the real Llama 3, Gemma 3 and Qwen2-VL templates."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from precompute import chat
from precompute.conversation import from_chatml, from_llava
from precompute.encoders import load_text_tokenizer
from shards.errors import CorruptSample
from tools.testing.chat_templates import QWEN2VL_IMAGE, make_chat_tokenizer

#: per model: its image placeholder, the answer as its template renders it (Llama 3 and Gemma 3
#: ``trim`` the content, Qwen2-VL keeps it), the end token of an assistant turn
MODELS = {"llama3": ("<image>", str.strip, "<|eot_id|>"),
          "gemma3": ("<start_of_image>", str.strip, "<end_of_turn>"),
          "qwen2vl": (QWEN2VL_IMAGE, lambda s: s, "<|im_end|>")}
ANSWERS = (" A rocket on a pad.\n", "\tWhite, mostly.  ")


@pytest.fixture(scope="module")
def hf_tok(tiny_models):
    return load_text_tokenizer({"name": "hf", "pretrained": str(tiny_models / "tokenizer-tiny")})


@pytest.fixture(scope="module")
def model_toks(tmp_path_factory):
    """The tiny tokenizers with the real templates, saved and loaded back as a user's would be."""
    out = {}
    for name in MODELS:
        path = tmp_path_factory.mktemp(name)
        make_chat_tokenizer(name).save_pretrained(str(path))
        out[name] = path
    return out


def labelled_runs(ids: np.ndarray, labels: np.ndarray) -> list[list[int]]:
    """Maximal runs of consecutive trained positions, as lists of token ids."""
    runs, cur = [], []
    for i, lab in zip(ids.tolist(), labels.tolist()):
        if lab != -100:
            assert lab == i
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("manifest", ["chatml_voice_clone.json", "chatml_audio_understanding.json",
                                      "llava_multiturn.json"])
def test_tokenizer_template_equals_named_template(real_mini, hf_tok, manifest):
    assert chat.resolve_template("auto", hf_tok) == "tokenizer"
    for rec in json.loads((real_mini / manifest).read_text())[:5]:
        conv = from_chatml(rec, real_mini)[0] if "messages" in rec else from_llava(rec, real_mini)
        ids_t, lab_t = chat.render(conv, hf_tok, "tokenizer")
        ids_n, lab_n = chat.render(conv, hf_tok, "llama3")
        text = hf_tok.tokenizer.decode
        assert text(ids_t.tolist()) == text(ids_n.tolist())
        # trained text is the same, whatever the two tokenizations of the pieces
        assert text(lab_t[lab_t != -100].tolist()) == text(lab_n[lab_n != -100].tolist())
        never = [hf_tok.token_to_id(t) for t in ("<|AUDIO|>", "<image>")]
        out = hf_tok.token_to_id("<|AUDIO_OUT|>")
        # Higgs' rule: output audio of a trained turn carries its placeholder's label, nothing else does
        trained_out = sum(a.direction == "out" and conv.trained(a.turn) for a in conv.audio)
        for lab in (lab_t, lab_n):
            assert not np.isin(lab, never).any() and int((lab == out).sum()) == trained_out
        assert np.isin(ids_t, never + [out]).sum() == len(conv.audio) + len(conv.images)


@pytest.mark.parametrize("model", list(MODELS))
def test_label_spans_come_from_the_template_not_from_the_content(model_toks, model):
    """Whitespace-padded answers through each real template: every assistant turn's labelled run
    decodes to the answer as that template renders it plus its end token; the whole rendering is
    exactly the template's own text."""
    image, rendered, end = MODELS[model]
    tok = load_text_tokenizer({"name": "hf", "pretrained": str(model_toks[model])})
    tokens = chat.ChatTokens(image=image)
    # Gemma 3 and Qwen2-VL have their image token; for LLaVA on the text-only Llama 3 it is added
    assert list(chat.ensure_tokens(tok, {"image"}, tokens, add=model == "llama3")) == ["<image>"] * (model == "llama3")
    rec = {"image": "a.jpg", "conversations": [
        {"from": "system", "value": "Answer briefly."},
        {"from": "human", "value": "<image>\n What is this? "}, {"from": "gpt", "value": ANSWERS[0]},
        {"from": "human", "value": "Its colour?"}, {"from": "gpt", "value": ANSWERS[1]}]}
    conv = from_llava(rec, Path("/data"))
    ids, labels = chat.render(conv, tok, chat.resolve_template("auto", tok), tokens)
    hf = tok.tokenizer
    msgs = [{"role": r, "content": c} for r, c in [("system", "Answer briefly."),
                                                   ("user", f"{image}\n What is this? "), ("assistant", ANSWERS[0]),
                                                   ("user", "Its colour?"), ("assistant", ANSWERS[1])]]
    assert hf.decode(ids.tolist()) == hf.apply_chat_template(msgs, tokenize=False)
    runs = [hf.decode(r) for r in labelled_runs(ids, labels)]
    assert runs == [rendered(a) + end for a in ANSWERS]
    img = ids == hf.convert_tokens_to_ids(image)
    assert int(img.sum()) == 1 and (labels[img] == -100).all()


@pytest.mark.parametrize("model", ["llama3", "gemma3"])
def test_start_index_and_turn_boundaries_through_real_templates(model_toks, model):
    """Only assistant turns at or after start_index are trained (Higgs-Audio's rule), whatever the
    template does with the system prompt (Gemma 3 folds it into the first user turn)."""
    _, rendered, end = MODELS[model]
    tok = load_text_tokenizer({"name": "hf", "pretrained": str(model_toks[model])})
    rec = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one"},
                        {"role": "assistant", "content": " uno "}, {"role": "user", "content": "two"},
                        {"role": "assistant", "content": " dos\n"}], "start_index": 4}
    conv, _ = from_chatml(rec, Path("/data"))
    ids, labels = chat.render(conv, tok, "tokenizer")
    assert [tok.tokenizer.decode(r) for r in labelled_runs(ids, labels)] == ["dos" + end]
    conv.start_index = None
    ids, labels = chat.render(conv, tok, "tokenizer")
    assert [tok.tokenizer.decode(r) for r in labelled_runs(ids, labels)] == ["uno" + end, "dos" + end]


def test_a_conversation_without_targets_is_rejected_no_targets(model_toks):
    tok = load_text_tokenizer({"name": "hf", "pretrained": str(model_toks["gemma3"])})
    tokens = chat.ChatTokens(image="<start_of_image>")
    cases = {
        "whitespace answer": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": " \n\t"}],
        "no assistant turn": [{"from": "human", "value": "<image>\nWhat?"}],
    }
    for what, turns in cases.items():
        conv = from_llava({"image": "a.jpg", "conversations": turns}, Path("/data"))
        for template in ("tokenizer", "llama3"):
            with pytest.raises(CorruptSample, match="assistant") as e:
                chat.render(conv, tok, template, tokens)
            assert e.value.reason == "no_targets", what
    rec = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "start_index": 2}
    with pytest.raises(CorruptSample) as e:
        chat.render(from_chatml(rec, Path("/data"))[0], tok, "tokenizer")
    assert e.value.reason == "no_targets" and "start_index" in e.value.detail


def test_tokenizer_requirements_follow_the_job(model_toks, hf_tok):
    """An image-only job needs only its image placeholder, an audio job only its audio tokens; missing
    tokens are added only when asked, as special tokens, and the vocabulary grows by them."""
    from precompute.encoders.text import ByteTokenizer
    gemma = load_text_tokenizer({"name": "hf", "pretrained": str(model_toks["gemma3"])})
    image = chat.ChatTokens(image="<start_of_image>")
    assert chat.ensure_tokens(gemma, {"image"}, image, add=False) == {}
    with pytest.raises(ValueError, match="AUDIO_OUT"):
        chat.ensure_tokens(gemma, {"audio_out"}, image, add=False)
    with pytest.raises(ValueError, match="<image>"):               # the default placeholder: not Gemma's
        chat.ensure_tokens(gemma, {"image"}, chat.ChatTokens(), add=False)
    world = dataclasses.replace(image, world=("<start_of_world>", "<end_of_world>"))
    with pytest.raises(ValueError, match="start_of_world"):
        chat.ensure_tokens(gemma, {"image"}, world, add=False)
    n = gemma.vocab_size
    added = chat.ensure_tokens(gemma, {"image"}, world, add=True)
    assert added == {"<start_of_world>": n, "<end_of_world>": n + 1} and gemma.vocab_size == n + 2
    assert gemma.encode("x<start_of_world>y", add_special_tokens=False).tolist().count(n) == 1
    # an audio job with the byte tokenizer lacking the image token is fine; lacking an audio token is not
    assert chat.check_tokenizer(ByteTokenizer(special_tokens=["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]),
                                {"audio_in"})
    with pytest.raises(ValueError, match="AUDIO_OUT"):
        chat.check_tokenizer(ByteTokenizer(special_tokens=["<image>"]))   # None = every kind
    assert chat.check_tokenizer(hf_tok)["<|AUDIO_OUT|>"] == hf_tok.token_to_id("<|AUDIO_OUT|>")
    assert chat.needed_kinds([from_llava({"image": "a.jpg", "conversations": [{"from": "human", "value": "q"}]},
                                         Path("/d"))]) == {"image"}
