"""Render a :class:`~precompute.conversation.Conversation` once into ``input_ids`` and ``labels``.

Two ways, chosen by ``chat_template`` in the config:

* ``llama3`` (the offline default, works with any tokenizer): Higgs-Audio's layout
  (``boson_multimodal/dataset/chatml_dataset.py``, ``prepare_chatml_sample``)::

      <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>

  audio in a user/system turn renders as ``<|audio_bos|><|AUDIO|><|audio_eos|>``, audio in an
  assistant turn as ``<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>``, an image as ``<image>``
  (LLaVA); an assistant turn followed by another assistant turn ends with ``<|eom_id|>``. Each
  piece is tokenized on its own, as Higgs-Audio does.
* ``tokenizer``: the HF tokenizer's own ``apply_chat_template`` over the turns (media rendered
  to the same placeholder strings inside the content); turn boundaries come from rendering each
  prefix of the conversation, and labels from the tokens' character offsets.

``auto`` picks ``tokenizer`` when the (HF) tokenizer has a chat template, else ``llama3``.

Labels (int32, same length as ``input_ids``, not shifted: the model shifts, HF convention) copy
``input_ids`` on trained tokens and are ``-100`` elsewhere. Trained: the content and the closing
``<|eot_id|>``/``<|eom_id|>`` of assistant turns at or after ``start_index`` (all assistant turns
without one), as in Higgs-Audio. Not trained: headers, system and user turns, turns before
``start_index``, and the media placeholder tokens themselves (``<|AUDIO|>``, ``<|AUDIO_OUT|>``,
``<image>``; their targets, if any, are the codes), which differs from Higgs-Audio only there.
"""
from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from shards.tokens import (AUDIO_BOS, AUDIO_EOS, AUDIO_IN, AUDIO_OUT, AUDIO_OUT_BOS, BEGIN_OF_TEXT,  # noqa: F401
                           END_HEADER, EOM, EOT, IGNORE_INDEX, IMAGE, PLACEHOLDERS, SPECIAL_TOKENS,
                           START_HEADER)

from .conversation import Conversation

TEMPLATES = ("auto", "llama3", "tokenizer")


def media_text(conv: Conversation, role: str, kind: str) -> str:
    """Placeholder text of one media item in a turn of ``role``."""
    if kind == "image":
        return IMAGE
    return AUDIO_OUT_BOS + AUDIO_OUT + AUDIO_EOS if role == "assistant" else AUDIO_BOS + AUDIO_IN + AUDIO_EOS


def llama3_pieces(conv: Conversation) -> list[tuple[str, bool]]:
    """The Llama-3 / Higgs-Audio rendering as ``[(text, trained)]`` pieces in order."""
    out: list[tuple[str, bool]] = []
    n = len(conv.turns)
    for i, turn in enumerate(conv.turns):
        trained = conv.trained(i)
        out.append(((BEGIN_OF_TEXT if i == 0 else "") + f"{START_HEADER}{turn.role}{END_HEADER}\n\n", False))
        for p in turn.parts:
            text = p.text if p.type == "text" else media_text(conv, turn.role, p.type)
            if text:
                out.append((text, trained))
        eom = turn.role == "assistant" and i + 1 < n and conv.turns[i + 1].role == "assistant"
        out.append((EOM if eom else EOT, trained))
    return out


def turn_messages(conv: Conversation) -> list[dict[str, str]]:
    """``[{role, content}]`` with media as placeholder text, for ``apply_chat_template``."""
    return [{"role": t.role, "content": "".join(p.text if p.type == "text" else media_text(conv, t.role, p.type)
                                               for p in t.parts)} for t in conv.turns]


def special_ids(tokenizer) -> dict[str, int]:
    """Ids of :data:`SPECIAL_TOKENS` in ``tokenizer`` (those it has)."""
    out = {}
    for tok in SPECIAL_TOKENS:
        i = tokenizer.token_to_id(tok)
        if i is not None:
            out[tok] = int(i)
    return out


def check_tokenizer(tokenizer, conv_kinds: set[str] | None = None) -> dict[str, int]:
    """The special-token ids, raising ``ValueError`` when a placeholder the job needs is missing.

    A tokenizer without ``<|AUDIO_OUT|>`` etc. would split them into ordinary tokens and the
    trainer could not find the media positions: add them (``tokenizer.add_special_tokens``) and
    resize the LM's embeddings.
    """
    ids = special_ids(tokenizer)
    missing = [t for t in PLACEHOLDERS + (AUDIO_BOS, AUDIO_EOS, AUDIO_OUT_BOS) if t not in ids]
    if missing:
        raise ValueError(f"text tokenizer has no single-token ids for {missing}: add them as special tokens "
                         "(tokenizer.add_special_tokens({'additional_special_tokens': [...]}) and "
                         "model.resize_token_embeddings), or use the bytes tokenizer")
    return ids


def resolve_template(name: str, tokenizer) -> str:
    """``auto`` -> ``tokenizer`` when it has a chat template, else ``llama3``. Raises ``ValueError``."""
    if name not in TEMPLATES:
        raise ValueError(f"chat_template: expected one of {TEMPLATES}, got {name!r}")
    has = getattr(tokenizer, "chat_template", None) is not None
    if name == "auto":
        return "tokenizer" if has else "llama3"
    if name == "tokenizer" and not has:
        raise ValueError("chat_template: tokenizer, but the text tokenizer has no chat template")
    return name


def _finish(ids: list[int], trained: list[bool], placeholder_ids: set[int]) -> tuple[np.ndarray, np.ndarray]:
    input_ids = np.asarray(ids, dtype=np.int32)
    labels = np.where(np.asarray(trained, dtype=bool), input_ids, IGNORE_INDEX).astype(np.int32)
    if placeholder_ids and len(labels):
        labels[np.isin(input_ids, list(placeholder_ids))] = IGNORE_INDEX
    return input_ids, labels


def render(conv: Conversation, tokenizer, template: str) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, labels)``, both int32 ``(L,)``, of ``conv`` (see the module docstring).

    ``template``: ``llama3`` or ``tokenizer`` (already resolved). Raises ``ValueError`` when the
    number of placeholder tokens differs from the number of media items (a placeholder string
    inside the text itself, say) or the tokenizer's template is not prefix-stable.
    """
    specials = special_ids(tokenizer)
    ph = {i for t, i in specials.items() if t in PLACEHOLDERS}
    if template == "llama3":
        tokens: list[int] = []
        trained: list[bool] = []
        for text, tr in llama3_pieces(conv):
            piece = tokenizer.encode(text, add_special_tokens=False).tolist()
            tokens += piece
            trained += [tr] * len(piece)
        input_ids, labels = _finish(tokens, trained, ph)
    else:
        input_ids, labels = _render_hf(conv, tokenizer, ph)
    _check_placeholders(conv, specials, input_ids)
    return input_ids, labels


def _render_hf(conv: Conversation, tokenizer, ph: set[int]) -> tuple[np.ndarray, np.ndarray]:
    tok = tokenizer.tokenizer
    msgs = turn_messages(conv)

    def text_of(n: int) -> str:
        return tok.apply_chat_template(msgs[:n], tokenize=False) if n else ""

    full = text_of(len(msgs))
    spans: list[tuple[int, int]] = []  # trained character ranges
    prev = ""
    for i in range(len(msgs)):
        cur = text_of(i + 1)
        if not cur.startswith(prev):
            raise ValueError("the tokenizer's chat template is not prefix-stable (rendering turn "
                             f"{i + 1} changes the text of the turns before it); use chat_template: llama3")
        if conv.trained(i):
            seg = cur[len(prev):]
            content = msgs[i]["content"]
            at = seg.find(content) if content else -1
            start = len(prev) + (at if at >= 0 else len(seg))
            spans.append((start, len(cur)))
        prev = cur
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    starts = [s for s, _ in spans]
    trained = []
    for a, b in enc["offset_mapping"]:
        k = bisect.bisect_right(starts, a) - 1
        trained.append(k >= 0 and a < spans[k][1] and b > a)
    return _finish(list(enc["input_ids"]), trained, ph)


def _check_placeholders(conv: Conversation, ids: dict[str, int], input_ids: np.ndarray) -> None:
    n_audio = int(np.isin(input_ids, [ids.get(AUDIO_IN, -1), ids.get(AUDIO_OUT, -1)]).sum())
    n_image = int((input_ids == ids.get(IMAGE, -1)).sum())
    if n_audio != len(conv.audio) or n_image != len(conv.images):
        raise ValueError(f"rendered text has {n_audio} audio and {n_image} image placeholder tokens for "
                         f"{len(conv.audio)} audio and {len(conv.images)} image items (is a placeholder "
                         "string part of the text itself?)")


def describe(template: str, tokenizer) -> dict[str, Any]:
    """What goes into ``manifest.json`` ``text``: template, vocab size, pad id, special-token ids."""
    return {"template": template, "vocab_size": int(tokenizer.vocab_size), "pad_id": int(tokenizer.pad_id),
            "special_token_ids": special_ids(tokenizer), "ignore_index": IGNORE_INDEX}
