"""One piece of text per ``input_ids`` token, from the text tokenizer the cache records.

A cache records its text tokenizer twice: the spec stage one loaded it from (``manifest.json``
``config.text_tokenizer``: ``{name: bytes}``, or ``{name: hf, pretrained: DIR or hub id, ...}``)
and its fingerprint (``encoders.text_tokenizer.vocab_sha256``, :func:`shards.tokens.vocab_sha256`).
:func:`load_token_text` loads that tokenizer, and nothing else (no model), with stage one's own
loader (:func:`precompute.encoders.load_text_tokenizer`), adds the special tokens the manifest
records and the tokenizer lacks (``text.special_token_ids``: what ``add_missing_tokens`` added, in
id order), and uses it only when its fingerprint is the recorded one. Where that cannot be done (no
``[precompute]`` extra, ``transformers`` missing, the files not reachable from this machine, another
tokenizer at that path), every token is shown by its id and the special tokens by the names the
manifest records, and the page says why.

Pieces (:meth:`TokenText.pieces`) are decoded as a streaming detokenizer does (Hugging Face TGI's
``decode_token``): each token's text is what decoding the ids up to it adds to the text before it,
so a word's leading space and a character split over several byte tokens come out right (a token
that ends inside a character has the empty piece; the next one carries the character). A special
token's piece is its name.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..manifest import CacheManifest


@dataclass
class TokenText:
    """How a cache's token ids become text.

    Attributes:
        decode: ids -> text (special tokens of the manifest excluded from what it is given), or None:
            ids only.
        names: token id -> its name, for the special tokens (``text.special_token_ids``; with the
            byte tokenizer also its pad, bos and eos ids).
        how: one sentence for the page: which tokenizer renders the text, or why only ids are shown.
        special: the ids shown as special tokens: those of ``names`` and the tokenizer's own
            (a Hugging Face tokenizer's ``all_special_ids``: ``<bos>``, ``<start_of_turn>``...).
    """

    decode: Callable[[Sequence[int]], str] | None
    names: dict[int, str] = field(default_factory=dict)
    how: str = ""
    special: frozenset[int] = frozenset()

    def is_special(self, token_id: int) -> bool:
        return token_id in self.names or token_id in self.special

    @property
    def has_text(self) -> bool:
        return self.decode is not None

    def pieces(self, ids: Sequence[int]) -> list[str] | None:
        """The text of each token of ``ids`` (see the module docstring); None without a tokenizer."""
        if self.decode is None:
            return None
        out: list[str] = []
        run: list[int] = []          # the ordinary ids since the last special token
        prefix = read = 0            # TGI's prefix_offset / read_offset into run
        for t in (int(x) for x in ids):
            name = self.names.get(t)
            if name is not None:
                out.append(name)
                run, prefix, read = [], 0, 0
                continue
            run.append(t)
            before = self.decode(run[prefix:read]) if read > prefix else ""
            text = self.decode(run[prefix:])
            if len(text) > len(before) and not text.endswith("\ufffd"):
                out.append(text[len(before):])
                prefix, read = read, len(run)
            else:
                out.append("")       # inside a character (or a token with no text of its own)
        return out


def special_names(manifest: CacheManifest) -> dict[int, str]:
    """``{id: token}`` of the special tokens ``manifest.json`` records (``text.special_token_ids``)."""
    ids = manifest.text.special_token_ids if manifest.text is not None else {}
    return {int(v): str(k) for k, v in ids.items() if isinstance(v, int) and not isinstance(v, bool)}


def load_token_text(manifest: CacheManifest) -> TokenText:
    """A :class:`TokenText` for the cache of ``manifest`` (see the module docstring). Never raises:
    a tokenizer that cannot be loaded or is not the recorded one gives ids only, saying why."""
    names = special_names(manifest)
    config = manifest.config if isinstance(manifest.config, dict) else {}
    spec = config.get("text_tokenizer")
    recorded = ((manifest.encoders or {}).get("text_tokenizer") or {}) if isinstance(manifest.encoders, dict) else {}
    want = recorded.get("vocab_sha256") if isinstance(recorded, dict) else None
    if not isinstance(spec, dict):
        return TokenText(None, names, "the cache records no text tokenizer (config.text_tokenizer): token ids shown")
    where = spec.get("pretrained") or spec.get("factory") or spec.get("name", "bytes")
    try:
        from precompute.encoders import load_text_tokenizer
    except ImportError as e:
        return TokenText(None, names, f"token ids shown: loading the text tokenizer needs the [precompute] extra "
                                      f"({e.name or e} is not installed here)")
    try:
        tok = load_text_tokenizer(spec)
        lacking = sorted((i, t) for i, t in names.items() if tok.token_to_id(t) is None)
        if lacking:  # what stage one's add_missing_tokens added, in id order
            tok.add_tokens([t for _, t in lacking])
        got = tok.describe().get("vocab_sha256")
    except ImportError as e:
        return TokenText(None, names, f"token ids shown: the text tokenizer {where} needs {e.name or e}, "
                                      "which is not installed here (pip install \"shardcache[precompute]\")")
    except Exception as e:  # noqa: BLE001 - any failure to load means: show ids, and say why
        return TokenText(None, names, f"token ids shown: the text tokenizer {where} cannot be loaded here "
                                      f"({type(e).__name__}: {str(e)[:300]})")
    if want is not None and got != want:
        return TokenText(None, names, f"token ids shown: the text tokenizer at {where} is not the one this cache was "
                                      f"made with (vocab_sha256 {str(got)[:12]}..., recorded {str(want)[:12]}...)")
    kind = spec.get("name", "bytes") if "factory" not in spec else None
    special: frozenset[int] = frozenset()
    if kind == "hf":
        hf = tok.tokenizer
        decode = lambda ids: hf.decode(list(ids), skip_special_tokens=False,  # noqa: E731
                                       clean_up_tokenization_spaces=False)
        special = frozenset(int(i) for i in hf.all_special_ids)
    elif kind == "bytes":  # its own decode drops its special ids; their names are added here
        names = {tok.pad_id: "<pad>", tok.bos_id: "<bos>", tok.eos_id: "<eos>", **names}
        decode = lambda ids: tok.decode(list(ids), errors="replace")  # noqa: E731
    else:
        return TokenText(None, names, f"token ids shown: the text tokenizer {where} is a plug-in, and the "
                                      "TextTokenizer protocol declares no decode")
    check = "fingerprint matches the cache's" if want is not None else "the cache records no fingerprint to check it by"
    return TokenText(decode, names, f"text by the cache's tokenizer ({kind}: {where}; {check})", special)


class LazyTokenText:
    """:func:`load_token_text`, called once, on first use (loading a tokenizer can take seconds:
    the viewer starts without waiting for it). Thread-safe."""

    def __init__(self, manifest: CacheManifest):
        self.manifest = manifest
        self._value: TokenText | None = None
        self._lock = threading.Lock()

    def get(self) -> TokenText:
        with self._lock:
            if self._value is None:
                self._value = load_token_text(self.manifest)
            return self._value


__all__ = ["TokenText", "LazyTokenText", "load_token_text", "special_names"]

