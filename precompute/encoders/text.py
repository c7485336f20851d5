"""Text tokenizers behind :class:`TextTokenizer`: a dependency-free byte tokenizer and a Hugging Face wrapper."""
from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

from shardcache.pretrained import template_sha256

from ..effects import BYTES, IDENTITY, Effect
from ._common import canonical_json, load_error, resolve_pretrained
from .capabilities import Declares, TextCapabilities
from .options import takes


def _default_specials() -> tuple[str, ...]:
    from shards.tokens import SPECIAL_TOKENS
    return SPECIAL_TOKENS


class ByteTokenizer(Declares):
    """UTF-8 bytes as tokens: id = byte + 3; 0 = pad, 1 = bos, 2 = eos; then one id per special token.

    ``encode("hé")`` -> ``[1, 107, 198, 172, 2]`` (int32). Needs no files, so it is always available.
    The chat templates' special tokens (:data:`shards.tokens.SPECIAL_TOKENS`: ``<|begin_of_text|>``,
    ``<|AUDIO_OUT|>``, ``<image>``...) get ids ``259, 260, ...`` and are recognised in the text, as
    an HF tokenizer recognises its added special tokens; ``vocab_size`` = 259 + their number.

    Args:
        add_bos: prepend ``bos_id`` (default True).
        add_eos: append ``eos_id`` (default True).
        special_tokens: strings that become single ids (default: the chat templates' tokens).
    """

    name = "bytes"
    OPTIONS: tuple[str, ...] = ("add_bos", "add_eos", "special_tokens")
    #: built from files (``from_pretrained``) or from its options alone
    PRETRAINED = False
    #: what each option does to a cache (:class:`precompute.effects.Effect`)
    OPTION_EFFECTS: dict[str, Effect] = {"add_bos": takes(BYTES, bool), "add_eos": takes(BYTES, bool),
                                         "special_tokens": takes(BYTES, list, nullable=True)}
    pad_id = 0
    bos_id = 1
    eos_id = 2
    offset = 3
    chat_template = None  # rendered with precompute.chat's named templates

    def __init__(self, *, add_bos: bool = True, add_eos: bool = True,
                 special_tokens: tuple[str, ...] | list[str] | None = None) -> None:
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        specials = tuple(_default_specials() if special_tokens is None else special_tokens)
        if len(set(specials)) != len(specials) or any(not isinstance(t, str) or not t for t in specials):
            raise ValueError(f"special_tokens must be distinct non-empty strings, got {specials!r}")
        self.special_tokens = specials
        self._special_id = {t: 256 + self.offset + i for i, t in enumerate(specials)}
        self.vocab_size = 256 + self.offset + len(specials)
        longest_first = sorted(specials, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, longest_first)) + ")") if specials else None

    @property
    def capabilities(self) -> TextCapabilities:
        """Adds special tokens; no chat template of its own; BOS ``bos_id``."""
        return TextCapabilities(adds_tokens=True, chat_template=None, bos_id=self.bos_id)

    def token_to_id(self, token: str) -> int | None:
        """Id of a special token (None when it is not one)."""
        return self._special_id.get(token)

    def add_tokens(self, tokens: list[str]) -> int:
        """Append ``tokens`` (those not yet special) to the special tokens: ids ``vocab_size, ...``.
        Returns the number added. Raises ``ValueError`` for an empty or non-str token."""
        new = [t for t in dict.fromkeys(tokens) if t not in self._special_id]
        if new:
            self.__init__(add_bos=self.add_bos, add_eos=self.add_eos, special_tokens=self.special_tokens + tuple(new))
        return len(new)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> np.ndarray:
        """int32 ``(n,)`` ids of ``text``'s UTF-8 bytes, special tokens as their own ids.

        ``add_special_tokens``: None -> bos/eos per ``add_bos``/``add_eos``; False -> neither
        (what the chat templates use); True -> both.

        Raises:
            TypeError: ``text`` is not a str.
            UnicodeEncodeError: ``text`` holds lone surrogates (not encodable as UTF-8).
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        bos = self.add_bos if add_special_tokens is None else add_special_tokens
        eos = self.add_eos if add_special_tokens is None else add_special_tokens
        parts = [np.array([self.bos_id], dtype=np.int32)] if bos else []
        pieces = self._split.split(text) if self._split is not None else [text]
        for piece in pieces:
            if piece in self._special_id:
                parts.append(np.array([self._special_id[piece]], dtype=np.int32))
            elif piece:
                parts.append(np.frombuffer(piece.encode("utf-8"), dtype=np.uint8).astype(np.int32) + self.offset)
        if eos:
            parts.append(np.array([self.eos_id], dtype=np.int32))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def decode(self, ids: Any, errors: str = "strict") -> str:
        """Inverse of :meth:`encode`: special ids (< 3) are dropped, the remaining bytes decoded as UTF-8.

        Raises:
            ValueError: an id is outside ``[0, vocab_size)``.
            UnicodeDecodeError: the bytes are not valid UTF-8 (with ``errors="strict"``).
        """
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        if a.size and (a.min() < 0 or a.max() >= self.vocab_size):
            raise ValueError(f"ids must be in [0, {self.vocab_size})")
        a = a[(a >= self.offset) & (a < 256 + self.offset)]
        return (a - self.offset).astype(np.uint8).tobytes().decode("utf-8", errors=errors)

    def describe(self) -> dict:
        """``class``, ``name``, ``config`` and ``vocab_sha256`` (hash of the fixed id scheme)."""
        config = {
            "offset": self.offset,
            "pad_id": self.pad_id,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "vocab_size": self.vocab_size,
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "encoding": "utf-8",
            "special_tokens": list(self.special_tokens),
        }
        return {
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "name": self.name,
            "config": config,
            "vocab_sha256": hashlib.sha256(canonical_json(config).encode()).hexdigest(),
        }

    def __repr__(self) -> str:
        return f"ByteTokenizer(add_bos={self.add_bos}, add_eos={self.add_eos})"


class HFTokenizer(Declares):
    """A ``transformers`` tokenizer (``AutoTokenizer.from_pretrained``) behind :class:`TextTokenizer`.

    Args:
        tokenizer: a loaded transformers tokenizer.
        add_special_tokens: passed to the tokenizer (bos/eos as the tokenizer defines them).
        pad_id: id to pad with; default the tokenizer's ``pad_token_id``, else ``eos_token_id``, else 0.

    ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens).
    """

    name = "hf"
    OPTIONS: tuple[str, ...] = ("add_special_tokens", "pad_id", "trust_remote_code", "revision")
    PRETRAINED = True
    #: what each option does to a cache (:class:`precompute.effects.Effect`); trust_remote_code and revision (the
    #: hub revision of ``pretrained``) decide which tokenizer loads (its vocabulary sha256 is the identity)
    OPTION_EFFECTS: dict[str, Effect] = {"add_special_tokens": takes(BYTES, bool),
                                         "pad_id": takes(BYTES, int, ge=0, nullable=True),
                                         "trust_remote_code": takes(IDENTITY, bool),
                                         "revision": takes(IDENTITY, str, nullable=True)}

    def __init__(self, tokenizer, *, add_special_tokens: bool = True, pad_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.add_special_tokens = bool(add_special_tokens)
        self.vocab_size = int(len(tokenizer))
        if pad_id is None:
            pad_id = tokenizer.pad_token_id
        if pad_id is None:
            pad_id = tokenizer.eos_token_id
        self.pad_id = int(pad_id) if pad_id is not None else 0
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"pad_id {self.pad_id} outside [0, {self.vocab_size})")
        if self.vocab_size > np.iinfo(np.int32).max:
            raise ValueError("vocabulary too large for int32 ids")
        self.pretrained: str | None = None
        self.revision: str | None = None   #: the hub revision of ``pretrained`` it was loaded at (None: main)

    @classmethod
    def from_pretrained(cls, pretrained: Any, *, trust_remote_code: bool = False, revision: str | None = None,
                        **kwargs: Any) -> "HFTokenizer":
        """``AutoTokenizer.from_pretrained(pretrained, revision=revision)`` wrapped; a local directory or hub id
        (``revision``: its branch, tag or commit, default ``main``).

        Raises:
            FileNotFoundError: a local-looking path that does not exist.
            shardcache.weights.LocalRevision: a ``revision`` with a local folder.
            OSError: loading failed.
        """
        from transformers import AutoTokenizer

        from shardcache.weights import checkpoint
        path = resolve_pretrained(pretrained, what=cls.__name__)
        checkpoint(path, revision=revision, what="text_tokenizer.revision")   # a folder has no revisions: refused
        try:
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision or None)
        except (OSError, ValueError) as e:
            raise load_error(cls.__name__, path, e) from e
        obj = cls(tok, **kwargs)
        obj.pretrained, obj.revision = path, revision or None
        return obj

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template (Jinja), or None (``PreTrainedTokenizerBase.chat_template``)."""
        return self.tokenizer.chat_template

    @property
    def capabilities(self) -> TextCapabilities:
        """Adds special tokens; its own chat template (or None); its BOS (``bos_token_id``, or None)."""
        return TextCapabilities(adds_tokens=True, chat_template=self.chat_template, bos_id=self.tokenizer.bos_token_id)

    def add_tokens(self, tokens: list[str]) -> int:
        """Add ``tokens`` as special tokens (never split, not normalised), as TheWorld adds
        ``<start_of_world>``/``<end_of_world>`` to Gemma's tokenizer; ``vocab_size`` grows with them (the
        LM's embeddings must be resized to it). Returns the number added."""
        from tokenizers import AddedToken  # the form transformers 4 and 5 both take

        n = self.tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens],
                                      special_tokens=True)
        self.vocab_size = int(len(self.tokenizer))
        return int(n)

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` when the vocabulary has it as one token (None otherwise)."""
        i = self.tokenizer.convert_tokens_to_ids(token)
        unk = self.tokenizer.unk_token_id
        return None if i is None or (unk is not None and i == unk and token != self.tokenizer.unk_token) else int(i)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> np.ndarray:
        """int32 ``(n_tokens,)`` ids of ``text`` (bos/eos per ``add_special_tokens``, default the
        wrapper's option; False is what the chat templates use)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
        ids = self.tokenizer(text, add_special_tokens=add)["input_ids"]
        return np.asarray(ids, dtype=np.int32).reshape(-1)

    def decode(self, ids: Any) -> str:
        """Text of ``ids`` with special tokens removed."""
        return self.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=True)

    def _vocab_sha256(self) -> str:
        from shards.tokens import vocab_sha256
        return vocab_sha256(self.tokenizer)

    def describe(self) -> dict:
        """``class``, ``name``, ``config`` (tokenizer class, special tokens, options, ``chat_template_sha256``:
        :func:`shardcache.pretrained.template_sha256` of its chat template, what a contract compares where the
        conversations were rendered with it), ``vocab_sha256`` and, when read from a checkpoint,
        ``loaded_from`` (:func:`shardcache.weights.source`: recorded, left out of the fingerprint)."""
        tok = self.tokenizer
        config = {
            "tokenizer_class": type(tok).__name__,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "add_special_tokens": self.add_special_tokens,
            "special_tokens": {k: str(v) for k, v in tok.special_tokens_map.items()},
            "chat_template_sha256": template_sha256(self.chat_template),
        }
        out = {
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "name": self.name,
            "config": config,
            "vocab_sha256": self._vocab_sha256(),
        }
        if self.pretrained:   # where it was read (hub id and commit, or the folder): recorded, not fingerprinted
            from shardcache.weights import SOURCE_KEY, source
            out[SOURCE_KEY] = source(self.pretrained, "tokenizer_config.json", revision=self.revision)
        return out

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.tokenizer).__name__}, vocab_size={self.vocab_size}, pad_id={self.pad_id})"


#: registry name -> wrapper class
TEXT_TOKENIZERS: dict[str, type] = {
    "bytes": ByteTokenizer,
    "hf": HFTokenizer,
}
