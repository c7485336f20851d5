"""Render a :class:`~precompute.conversation.Conversation` once into ``input_ids`` and ``labels``.

Three ways, chosen by ``chat_template`` in the config:

* ``llama3`` (the offline default, works with any tokenizer): Higgs-Audio's layout
  (``boson_multimodal/dataset/chatml_dataset.py``, ``prepare_chatml_sample``)::

      <|begin_of_text|><|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>

  audio in a user/system turn renders as ``<|audio_bos|><|AUDIO|><|audio_eos|>``, audio in an
  assistant turn as ``<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>``, an image as the configured
  image placeholder (``<image>``, LLaVA's, by default); an assistant turn followed by another
  assistant turn ends with ``<|eom_id|>``. Each piece is tokenized on its own, as Higgs-Audio does.
  A ChatML message's ``recipient`` renders as Boson renders it: ``{recipient}<|recipient|>`` (one
  piece) right after the assistant header, **always labelled** (Boson labels it even in a turn before
  ``start_index``); a recipient on a user/system turn is refused (``ValueError``: Boson asserts
  ``role == "assistant"`` and drops the sample). An empty recipient renders nothing (Boson's ``if
  recipient:``).
* ``tokenizer``: the HF tokenizer's own ``apply_chat_template`` over the turns (media rendered
  to the same placeholder strings inside the content), tokenized once as a whole. Templates do not
  render a ``recipient``: a conversation with one is refused (``ValueError``; use ``llama3``).

* ``theworld``: the tokenizer's own template, each turn given as content items, its images first
  (``{"type": "image"}``) then its other parts as one text item, as TheWorld's collate
  (``python/theworld/data.py``, ``theworld_collate_fn``) passes a LLaVA sample to
  ``processor.apply_chat_template``: Gemma 3's template writes ``<start_of_image>`` and the trimmed
  text, so no newline follows ``<end_of_image>`` beyond the image sequence's own.

``auto`` picks ``tokenizer`` when the (HF) tokenizer has a chat template, else ``llama3``.

**Label policy** (``label_policy``): ``answers`` (default) as below; ``all_but_world`` labels every
token of ``input_ids`` (world markers, image sequence and prompts included), as TheWorld's forward
does (``_forward_with_world``: its labels are ``input_ids`` with -100 only on the inserted world
embeddings, which the recipe inserts with -100 too).

Labels (int32, same length as ``input_ids``, not shifted: the model shifts, HF convention) copy
``input_ids`` on trained tokens and are ``-100`` elsewhere. Trained: the assistant turns at or
after ``start_index`` (all assistant turns without one), as in Higgs-Audio.

* **Label spans come from the template's structure, never from searching for the content.** With
  ``tokenizer``, turn ``i`` (a trained assistant turn) spans the characters between the
  conversation so far rendered with the template's generation prompt (``turns[:i]``,
  ``add_generation_prompt=True``: everything up to and including the assistant header) and the
  conversation rendered up to turn ``i`` inclusive (``turns[:i + 1]``), minus the whitespace the
  template puts after the turn's end token (Gemma 3's and ChatML's ``"\\n"`` after
  ``<end_of_turn>`` / ``<|im_end|>``). So whatever the template does to the content (Llama 3 and
  Gemma 3 ``trim`` it) the span is what the template rendered: the answer and its end token. A
  token is trained when it starts inside a span (character offsets of one tokenization of the
  whole text). Templates whose rendering of earlier turns changes when turns are added, or whose
  generation prompt is not where the assistant turn starts, are refused (``ValueError``; the row
  is rejected ``encode_failed`` naming the reason). With ``llama3`` the spans are the pieces:
  content and ``<|eot_id|>``/``<|eom_id|>`` of a trained turn.
* **Media placeholders** (Higgs-Audio's convention, ``prepare_chatml_sample``): the three
  audio-out tokens ``<|audio_out_bos|><|AUDIO_OUT|><|audio_eos|>`` of a trained assistant turn are
  trained like its text, so the ``<|AUDIO_OUT|>`` placeholder carries its own id as label (Boson's
  ``HiggsAudioSampleCollator`` reads that label to decide which audio items are targets, and masks
  it itself); ``<|AUDIO|>`` (input audio) and the image placeholder are never trained.
* **No sample without targets**: a conversation whose trained turns hold no content (no text that
  is not whitespace, no media), or that renders without a single trained token (no assistant turn
  at or after ``start_index``), raises :class:`~shards.errors.CorruptSample` ``no_targets``.

World tokens (TheWorld, ``python/theworld/modeling/theworld.py`` ``_inject_world_tokens``): with
``world_tokens`` configured, every sample with images gets ``<start_of_world><end_of_world>`` once
per image right after its BOS token (at position 0 when the rendering has no BOS), labels -100; the
model puts an image's world embeddings between its pair.

The token strings (:class:`ChatTokens`) come from the stage-one config; their defaults are
:mod:`shards.tokens`. A job needs only the tokens of what its manifest holds
(:func:`needed_tokens`): an image-only job its image placeholder, an audio job the audio tokens of
the directions it has; :func:`ensure_tokens` refuses a tokenizer that lacks one, or adds them as
special tokens when the config says so (recorded in ``manifest.json`` ``text``, :func:`describe`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from shards import schema
from shards.errors import CorruptSample
from shards.tokens import (AUDIO_BOS, AUDIO_EOS, AUDIO_IN, AUDIO_IN_TOKENS, AUDIO_OUT, AUDIO_OUT_BOS,  # noqa: F401
                           AUDIO_OUT_TOKENS, BEGIN_OF_TEXT, END_HEADER, EOM, EOT, IGNORE_INDEX, IMAGE,
                           PLACEHOLDERS, RECIPIENT, SPECIAL_TOKENS, START_HEADER)

from .conversation import Conversation
from .encoders.capabilities import text_capabilities_of

#: the values of the options ``chat_template`` (:func:`resolve_template`) and ``label_policy`` (module docstring)
CHAT_TEMPLATES, LABEL_POLICIES = ("auto", "llama3", "tokenizer", "theworld"), ("answers", "all_but_world")
#: media kinds a job can need tokens for (:func:`needed_kinds`)
KINDS = ("audio_in", "audio_out", "image")


@dataclass(frozen=True)
class ChatTokens:
    """The token strings a conversation is rendered with.

    ``image``: the placeholder of one image (``<image>``; Gemma 3: ``<start_of_image>``);
    ``world``: TheWorld's ``(start, end)`` world-token markers, or None (no world tokens);
    ``image_sequence``: the text each image placeholder is expanded into before tokenizing, or None
    (one placeholder token per image). Gemma 3: ``Gemma3Processor.full_image_sequence``,
    ``"\\n\\n<start_of_image>" + mm_tokens_per_image x "<image_soft_token>" + "<end_of_image>\\n\\n"``,
    which its processor substitutes for every ``<start_of_image>`` of the text (so the cache's ids
    are the processor's); ``image_inner``: the tokens of that sequence other than the placeholder
    (``<image_soft_token>``, ``<end_of_image>``), never trained and recorded in ``special_token_ids``.
    The audio tokens are Higgs-Audio's (:mod:`shards.tokens`).
    """

    image: str = IMAGE
    world: tuple[str, str] | None = None
    image_sequence: str | None = None
    image_inner: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg: Any) -> "ChatTokens":
        """From a :class:`~precompute.config.PrecomputeConfig` (``image_token``, ``world_tokens``)."""
        return cls(cfg.image_token, tuple(cfg.world_tokens) if cfg.world_tokens else None)

    @property
    def placeholders(self) -> tuple[str, str, str]:
        """``(<|AUDIO|>, <|AUDIO_OUT|>, image)``: one token per media item."""
        return AUDIO_IN, AUDIO_OUT, self.image

    def all(self) -> tuple[str, ...]:
        """Every special string of the layouts: :data:`SPECIAL_TOKENS`, the image placeholder, the markers."""
        return tuple(dict.fromkeys(SPECIAL_TOKENS + (self.image,) + (self.world or ()) + tuple(self.image_inner)))

    def expand(self, text: str) -> tuple[str, list[int]]:
        """``text`` with every image placeholder replaced by :attr:`image_sequence` (as
        ``Gemma3Processor`` does: ``ProcessorMixin._process_images`` / ``replace_image_token``, one
        plain substitution per occurrence), and the start offsets of the placeholders in ``text``
        (to move character positions; :meth:`moved`). Without a sequence: ``text`` unchanged."""
        if not self.image_sequence:
            return text, []
        at, i = [], text.find(self.image)
        while i >= 0:
            at.append(i)
            i = text.find(self.image, i + len(self.image))
        return text.replace(self.image, self.image_sequence), at

    def moved(self, pos: int, at: list[int]) -> int:
        """Character position ``pos`` of the text before :meth:`expand` in the expanded text."""
        return pos + bisect.bisect_left(at, pos) * (len(self.image_sequence or self.image) - len(self.image))


DEFAULT_TOKENS = ChatTokens()


def media_text(role: str, kind: str, tokens: ChatTokens = DEFAULT_TOKENS) -> str:
    """Placeholder text of one media item in a turn of ``role``."""
    if kind == "image":
        return tokens.image
    return "".join(AUDIO_OUT_TOKENS if role == "assistant" else AUDIO_IN_TOKENS)


def llama3_pieces(conv: Conversation, tokens: ChatTokens = DEFAULT_TOKENS) -> list[tuple[str, bool]]:
    """The Llama-3 / Higgs-Audio rendering as ``[(text, trained)]`` pieces in order."""
    out: list[tuple[str, bool]] = []
    n = len(conv.turns)
    for i, turn in enumerate(conv.turns):
        trained = conv.trained(i)
        out.append(((BEGIN_OF_TEXT if i == 0 else "") + f"{START_HEADER}{turn.role}{END_HEADER}\n\n", False))
        if turn.recipient:
            if turn.role != "assistant":
                raise ValueError(f"turn {i} ({turn.role}) has a recipient: Higgs-Audio renders a recipient only on "
                                 "assistant turns (prepare_chatml_sample)")
            out.append((f"{turn.recipient}{RECIPIENT}", True))   # labelled whatever start_index says, as Boson
        for p in turn.parts:
            text = p.text if p.type == "text" else media_text(turn.role, p.type, tokens)
            if p.type == "image" and tokens.image_sequence:
                text = tokens.image_sequence
            if text:
                out.append((text, trained))
        eom = turn.role == "assistant" and i + 1 < n and conv.turns[i + 1].role == "assistant"
        out.append((EOM if eom else EOT, trained))
    return out


def turn_messages(conv: Conversation, tokens: ChatTokens = DEFAULT_TOKENS, items: bool = False) -> list[dict]:
    """``[{role, content}]`` with media as placeholder text, for ``apply_chat_template``. ``items``
    (``theworld``): content as a list, one ``{"type": "image"}`` per image first, then the other parts
    as one ``{"type": "text"}`` item (audio as its placeholder text)."""
    if items:
        return [{"role": t.role, "content": [{"type": "image"} for p in t.parts if p.type == "image"] + [
            {"type": "text", "text": "".join(p.text if p.type == "text" else media_text(t.role, p.type, tokens)
                                             for p in t.parts if p.type != "image")}]} for t in conv.turns]
    return [{"role": t.role, "content": "".join(p.text if p.type == "text" else media_text(t.role, p.type, tokens)
                                               for p in t.parts)} for t in conv.turns]


def special_ids(tokenizer, tokens: ChatTokens = DEFAULT_TOKENS) -> dict[str, int]:
    """Ids of the layouts' special strings (:meth:`ChatTokens.all`) that ``tokenizer`` has as one token."""
    out = {}
    for tok in tokens.all():
        i = tokenizer.token_to_id(tok)
        if i is not None:
            out[tok] = int(i)
    return out


# -- what a job needs ----------------------------------------------------------------------------

def needed_kinds(conversations: Iterable[Conversation | None]) -> set[str]:
    """The media kinds (:data:`KINDS`) the conversations hold: ``audio_in`` (audio in a user/system
    turn), ``audio_out`` (in an assistant turn), ``image``."""
    kinds: set[str] = set()
    for conv in conversations:
        if conv is None:
            continue
        kinds |= {"audio_out" if a.direction == "out" else "audio_in" for a in conv.audio}
        if conv.images:
            kinds.add("image")
        if kinds == set(KINDS):
            break
    return kinds


def needed_tokens(kinds: Iterable[str] | None = None, tokens: ChatTokens = DEFAULT_TOKENS) -> list[str]:
    """The strings that must be single tokens for a job holding media ``kinds`` (None: every kind):
    the audio tokens of each audio direction, the image placeholder, and the world markers when
    configured and the job has images."""
    kinds = set(KINDS if kinds is None else kinds)
    need: list[str] = []
    if "audio_in" in kinds:
        need += AUDIO_IN_TOKENS
    if "audio_out" in kinds:
        need += AUDIO_OUT_TOKENS
    if "image" in kinds:
        need += [tokens.image, *tokens.image_inner, *(tokens.world or ())]
    return list(dict.fromkeys(need))


def check_tokenizer(tokenizer, kinds: Iterable[str] | None = None, tokens: ChatTokens = DEFAULT_TOKENS
                    ) -> dict[str, int]:
    """The special-token ids, raising ``ValueError`` when a token the job needs
    (:func:`needed_tokens`) is not a single token of ``tokenizer``.

    A tokenizer without ``<|AUDIO_OUT|>`` etc. would split them into ordinary tokens and the
    trainer could not find the media positions: add them (``add_missing_tokens: true``, then the
    LM's embeddings are resized to the ``vocab_size`` the manifest records).
    """
    ids = special_ids(tokenizer, tokens)
    missing = [t for t in needed_tokens(kinds, tokens) if t not in ids]
    if missing:
        raise ValueError(f"text tokenizer has no single-token ids for {missing}: set add_missing_tokens: true "
                         "(they are added as special tokens and the LM's embeddings resized to the cache's "
                         "vocab_size), add them to the tokenizer yourself, or use the bytes tokenizer")
    return ids


def ensure_tokens(tokenizer, kinds: Iterable[str] | None, tokens: ChatTokens, add: bool) -> dict[str, int]:
    """:func:`check_tokenizer`, after adding the missing tokens as special tokens when ``add``.

    Returns ``{token: id}`` of the tokens added (empty when none was missing). Raises
    ``ValueError`` when tokens are missing and ``add`` is False, or the tokenizer cannot add tokens
    (a plug-in without ``add_tokens``).
    """
    have = special_ids(tokenizer, tokens)
    missing = [t for t in needed_tokens(kinds, tokens) if t not in have]
    if missing and add:
        if not text_capabilities_of(tokenizer).adds_tokens:
            raise ValueError(f"add_missing_tokens: {type(tokenizer).__name__} has no add_tokens() to add {missing}")
        tokenizer.add_tokens(missing)
    check_tokenizer(tokenizer, kinds, tokens)
    return {t: int(tokenizer.token_to_id(t)) for t in missing} if add else {}


def resolve_template(name: str, tokenizer) -> str:
    """``auto`` -> ``tokenizer`` when it has a chat template, else ``llama3``. Raises ``ValueError``."""
    if name not in CHAT_TEMPLATES:
        raise ValueError(f"chat_template: expected one of {CHAT_TEMPLATES}, got {name!r}")
    has = text_capabilities_of(tokenizer).chat_template is not None
    if name == "auto":
        return "tokenizer" if has else "llama3"
    if name in ("tokenizer", "theworld") and not has:
        raise ValueError(f"chat_template: {name}, but the text tokenizer has no chat template")
    return name


# -- rendering -----------------------------------------------------------------------------------

def _finish(ids: list[int], trained: list[bool], never: set[int]) -> tuple[np.ndarray, np.ndarray]:
    input_ids = np.asarray(ids, dtype=np.int32)
    labels = np.where(np.asarray(trained, dtype=bool), input_ids, IGNORE_INDEX).astype(np.int32)
    if never and len(labels):
        labels[np.isin(input_ids, list(never))] = IGNORE_INDEX
    return input_ids, labels


def render(conv: Conversation, tokenizer, template: str, tokens: ChatTokens = DEFAULT_TOKENS,
           label_policy: str = "answers") -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, labels)``, both int32 ``(L,)``, of ``conv`` (see the module docstring).

    ``template``: ``llama3``, ``tokenizer`` or ``theworld`` (already resolved). ``label_policy``:
    ``answers`` | ``all_but_world`` (labels = ``input_ids``).

    Raises:
        CorruptSample: ``no_targets``: no trained turn has content, or no token is trained.
        ValueError: the number of placeholder tokens differs from the number of media items (a
            placeholder string inside the text itself, say); the tokenizer's template is not
            prefix-stable or its generation prompt does not start the assistant turn.
    """
    specials = special_ids(tokenizer, tokens)
    never = {specials[t] for t in (AUDIO_IN, tokens.image, *tokens.image_inner) if t in specials}  # never trained
    if not _has_targets(conv):
        raise CorruptSample(schema.NO_TARGETS, _no_targets_detail(conv), conv.sources[0] if conv.sources else "")
    if template == "llama3":
        ids: list[int] = []
        trained: list[bool] = []
        for text, tr in llama3_pieces(conv, tokens):
            piece = tokenizer.encode(text, add_special_tokens=False).tolist()
            ids += piece
            trained += [tr] * len(piece)
        input_ids, labels = _finish(ids, trained, never)
    else:
        input_ids, labels = _render_hf(conv, tokenizer, never, tokens, items=template == "theworld")
    _check_placeholders(conv, specials, input_ids, tokens)
    if tokens.world and conv.images:
        input_ids, labels = _insert_world(input_ids, labels, tokenizer, specials, tokens.world, len(conv.images))
    if label_policy == "all_but_world":   # TheWorld: every input token (the world embeddings are the recipe's)
        labels = input_ids.copy()
    if not (labels != IGNORE_INDEX).any():
        raise CorruptSample(schema.NO_TARGETS, f"the rendered conversation has no trained token (labels all "
                            f"{IGNORE_INDEX})", conv.sources[0] if conv.sources else "")
    return input_ids, labels


def _has_targets(conv: Conversation) -> bool:
    """Whether a trained turn holds content: text that is not only whitespace, or a media item."""
    return any(conv.trained(i) and any(p.type != "text" or p.text.strip() for p in t.parts)
               for i, t in enumerate(conv.turns))


def _no_targets_detail(conv: Conversation) -> str:
    roles = [t.role for t in conv.turns]
    if "assistant" not in roles:
        return f"no assistant turn (roles {roles})"
    if not any(conv.trained(i) for i in range(len(roles))):
        return f"no assistant turn at or after start_index {conv.start_index} (roles {roles})"
    return "every trained assistant turn is empty (no text but whitespace, no media)"


def _render_hf(conv: Conversation, tokenizer, never: set[int], tokens: ChatTokens, items: bool = False
               ) -> tuple[np.ndarray, np.ndarray]:
    tok = tokenizer.tokenizer
    if any(t.recipient for t in conv.turns):
        raise ValueError("a message has a recipient, which the tokenizer's chat template does not render: "
                         "use chat_template: llama3 (renders it as Higgs-Audio's prepare_chatml_sample)")
    msgs = turn_messages(conv, tokens, items)

    def text_of(n: int, prompt: bool = False) -> str:
        return tok.apply_chat_template(msgs[:n], tokenize=False, add_generation_prompt=prompt)

    spans: list[tuple[int, int]] = []  # trained character ranges
    prev = ""
    for i in range(len(msgs)):
        cur = text_of(i + 1)
        if not cur.startswith(prev):
            raise ValueError("the tokenizer's chat template is not prefix-stable (rendering turn "
                             f"{i + 1} changes the text of the turns before it); use chat_template: llama3")
        if conv.trained(i):
            if i == 0:
                raise ValueError("a conversation that starts with a trained assistant turn has no generation "
                                 "prompt to locate the turn in the tokenizer's template; use chat_template: llama3")
            head = text_of(i, prompt=True)  # the turns before + the template's assistant header
            if not (head.startswith(prev) and cur.startswith(head)):
                raise ValueError(f"turn {i}: the chat template's generation prompt is not where it renders the "
                                 "assistant turn, so its label span cannot be located; use chat_template: llama3")
            end = len(cur.rstrip())  # the whitespace after the turn's end token belongs to the layout
            if end > len(head):
                spans.append((len(head), end))
        prev = cur
    prev, at = tokens.expand(prev)  # Gemma 3's image sequence, as its processor expands it before tokenizing
    spans = [(tokens.moved(a, at), tokens.moved(b, at)) for a, b in spans]
    enc = tok(prev, add_special_tokens=False, return_offsets_mapping=True)
    starts = [s for s, _ in spans]
    trained = []
    for a, b in enc["offset_mapping"]:
        k = bisect.bisect_right(starts, a) - 1
        trained.append(k >= 0 and a < spans[k][1] and b > a)
    return _finish(list(enc["input_ids"]), trained, never)


def _insert_world(input_ids: np.ndarray, labels: np.ndarray, tokenizer, specials: dict[str, int],
                  world: tuple[str, str], n_images: int) -> tuple[np.ndarray, np.ndarray]:
    """``world`` marker pairs (one per image) after the leading BOS (position 0 without one), label -100."""
    bos = {specials.get(BEGIN_OF_TEXT)}
    bos.add(text_capabilities_of(tokenizer).bos_id)
    at = 1 if len(input_ids) and int(input_ids[0]) in bos - {None} else 0
    pair = np.asarray([specials[world[0]], specials[world[1]]] * n_images, dtype=np.int32)
    ignore = np.full(len(pair), IGNORE_INDEX, dtype=np.int32)
    return (np.concatenate([input_ids[:at], pair, input_ids[at:]]),
            np.concatenate([labels[:at], ignore, labels[at:]]))


def _check_placeholders(conv: Conversation, ids: dict[str, int], input_ids: np.ndarray, tokens: ChatTokens) -> None:
    n_audio = int(np.isin(input_ids, [ids.get(AUDIO_IN, -1), ids.get(AUDIO_OUT, -1)]).sum())
    n_image = int((input_ids == ids.get(tokens.image, -1)).sum())
    if n_audio != len(conv.audio) or n_image != len(conv.images):
        raise ValueError(f"rendered text has {n_audio} audio and {n_image} image placeholder tokens for "
                         f"{len(conv.audio)} audio and {len(conv.images)} image items (is a placeholder "
                         "string part of the text itself?)")


def describe(template: str, tokenizer, tokens: ChatTokens = DEFAULT_TOKENS,
             added: dict[str, int] | None = None) -> dict[str, Any]:
    """What goes into ``manifest.json`` ``text``: template, vocab size, pad id, special-token ids,
    the placeholders (``{audio_in, audio_out, image}`` strings), the world markers, and the tokens
    added to the tokenizer by this job (``added_tokens`` ``{token: id}``; the LM's embeddings must
    be resized to ``vocab_size``, from ``base_vocab_size``)."""
    out = {"template": template, "vocab_size": int(tokenizer.vocab_size), "pad_id": int(tokenizer.pad_id),
           "special_token_ids": special_ids(tokenizer, tokens), "ignore_index": IGNORE_INDEX,
           "placeholders": dict(zip(("audio_in", "audio_out", "image"), tokens.placeholders)),
           # <|AUDIO_OUT|> of a trained turn labelled (Higgs-Audio's prepare_chatml_sample), spans from the template
           "label_convention": "prepare_chatml_sample"}
    if tokens.world:
        out["world_tokens"] = list(tokens.world)
    if tokens.image_sequence:  # each image placeholder expanded (Gemma 3's processor's full_image_sequence)
        out["image_sequence"] = tokens.image_sequence
    if added:
        out["added_tokens"] = dict(added)
        out["base_vocab_size"] = int(tokenizer.vocab_size) - len(added)
    return out
