"""Chat templates: the tokenizer's own apply_chat_template and the named Llama-3 layout agree."""
from __future__ import annotations

import json

import numpy as np
import pytest

from precompute import chat
from precompute.conversation import from_chatml, from_llava
from precompute.encoders import load_text_tokenizer



@pytest.fixture(scope="module")
def hf_tok(tiny_models):
    return load_text_tokenizer({"name": "hf", "pretrained": str(tiny_models / "tokenizer-tiny")})


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
        ph = [hf_tok.token_to_id(t) for t in chat.PLACEHOLDERS]
        assert not np.isin(lab_t, ph).any() and np.isin(ids_t, ph).sum() == len(conv.audio) + len(conv.images)


def test_tokenizer_without_placeholders_is_refused_before_work(hf_tok):
    from precompute.encoders.text import ByteTokenizer
    with pytest.raises(ValueError, match="AUDIO_OUT"):
        chat.check_tokenizer(ByteTokenizer(special_tokens=["<image>"]))
    assert chat.check_tokenizer(hf_tok)["<|AUDIO_OUT|>"] == hf_tok.token_to_id("<|AUDIO_OUT|>")
