"""One piece of text per ``input_ids`` token, from the text tokenizer the cache records; never online.

A cache records its text tokenizer twice: the spec stage one loaded it from (``manifest.json``
``config.text_tokenizer``: ``{name: bytes}``, or ``{name: hf, pretrained: DIR or hub id, ...}``)
and what it loaded (``encoders.text_tokenizer``: its ``config`` and fingerprint ``vocab_sha256``,
:func:`shards.tokens.vocab_sha256`). :func:`load_token_text` turns that into a :class:`TokenText`,
importing nothing of stage one:

* ``bytes``: the byte scheme as ``encoders.text_tokenizer.config`` records it (``offset``, pad, bos
  and eos ids, the special tokens in id order): nothing to load.
* ``hf``: the tokenizer's files are found on this machine only (:func:`tokenizer_folder`): the
  recorded path if it is absolute, else that path under the folder stage one ran in where the
  manifest records it (``working_dir``), else, for a hub id, the local Hugging Face cache
  (``huggingface_hub.try_to_load_from_cache``: no request is made; the command also sets
  ``HF_HUB_OFFLINE``). Its ``tokenizer.json`` is loaded with the ``tokenizers`` library (a fraction
  of a second: no ``transformers``, no ``torch``), the special tokens the manifest records and the
  tokenizer lacks are added as stage one's ``add_missing_tokens`` added them (in id order), and the
  fingerprint is computed by :func:`shards.tokens.vocab_sha256` over that pipeline, its vocabulary
  and the special-token map the manifest records. Only where it differs (a tokenizer whose
  ``transformers`` class changes its pipeline on load) is ``transformers.AutoTokenizer`` tried
  (``local_files_only``); the text is used **only when the fingerprint is the recorded one**.

Where none of that works (files not on this machine, another tokenizer at that path, neither
``tokenizers`` nor ``transformers`` installed, a plug-in tokenizer) every token is shown by its id
and the special tokens by the names the manifest records, and the page says which and why.

:class:`TokenTextLoader` runs :func:`load_token_text` in a background thread from the viewer's start,
so no page waits on it: a sample page asked for before it is done shows ids and says so.

Pieces (:meth:`TokenText.pieces`) are decoded as a streaming detokenizer does (Hugging Face TGI's
``decode_token``): each token's text is what decoding the ids up to it adds to the text before it,
so a word's leading space and a character split over several byte tokens come out right (a token
that ends inside a character has the empty piece; the next one carries the character). A special
token's piece is its name.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..manifest import CacheManifest
from . import background as background_threads

#: a Hugging Face hub repository id (``org/name`` or ``name``): what may be looked up in the local hub cache
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
#: the manifest key naming the folder stage one ran in (relative paths it recorded are relative to it)
WORKING_DIR_KEY = "working_dir"


@dataclass
class TokenText:
    """How a cache's token ids become text.

    Attributes:
        decode: ids -> text (special tokens of the manifest excluded from what it is given), or None:
            ids only.
        names: token id -> its name, for the special tokens (``text.special_token_ids``; with the
            byte tokenizer also its pad, bos and eos ids).
        how: one sentence for the page: which tokenizer renders the text, or why only ids are shown.
        special: the ids shown as special tokens: those of ``names`` and the tokenizer's own special
            added tokens (``<bos>``, ``<start_of_turn>``...).
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


def _recorded(manifest: CacheManifest) -> dict:
    enc = manifest.encoders.get("text_tokenizer") if isinstance(manifest.encoders, dict) else None
    return enc if isinstance(enc, dict) else {}


def tokenizer_folder(pretrained: str, manifest: CacheManifest) -> tuple[Path | None, str]:
    """``(folder, where)``: a folder of this machine holding the tokenizer stage one loaded from
    ``pretrained`` (see the module docstring; nothing is fetched), and how it was found; or
    ``(None, why not)``."""
    p = Path(pretrained).expanduser()
    if p.is_absolute():
        return (p, str(p)) if p.is_dir() else (None, f"{p} is not a folder on this machine")
    wd = manifest.to_dict().get(WORKING_DIR_KEY)
    tried = []
    if isinstance(wd, str) and wd:
        cand = Path(wd) / p
        if cand.is_dir():
            return cand, f"{cand} ({pretrained} under the folder stage one ran in)"
        tried.append(f"{cand} is not a folder on this machine")
    else:
        tried.append(f"{pretrained!r} is relative to the folder stage one ran in, which this cache does not "
                     f"record ({WORKING_DIR_KEY})")
    if HUB_ID.match(pretrained):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            tried.append("huggingface_hub is not installed to look in the local hub cache")
        else:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                got = try_to_load_from_cache(pretrained, name)
                if isinstance(got, str):
                    return Path(got).parent, f"{pretrained} (the local Hugging Face cache: {Path(got).parent})"
            tried.append(f"{pretrained} is not in the local Hugging Face cache (the viewer never downloads)")
    return None, "; ".join(tried)


class _Pipeline:
    """What :func:`shards.tokens.vocab_sha256` reads, for a ``tokenizers.Tokenizer`` and the
    special-token map the manifest records (a ``transformers`` tokenizer has these itself)."""

    def __init__(self, tok, special_tokens_map: dict):
        self.backend_tokenizer, self.special_tokens_map = tok, special_tokens_map

    def get_vocab(self) -> dict:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)


def _by_tokenizers(folder: Path, names: dict[int, str], recorded: dict):
    """``(decode, special ids, fingerprint)`` with the ``tokenizers`` library, or None when the folder
    has no ``tokenizer.json``. Raises ImportError without ``tokenizers``."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import AddedToken, Tokenizer

    from ..tokens import vocab_sha256
    tok = Tokenizer.from_file(str(path))
    lacking = sorted((i, t) for i, t in names.items() if tok.token_to_id(t) is None)
    if lacking:  # what stage one's add_missing_tokens added, in id order
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in lacking])
    config = recorded.get("config") if isinstance(recorded.get("config"), dict) else {}
    smap = config.get("special_tokens") if isinstance(config.get("special_tokens"), dict) else {}
    special = frozenset(int(i) for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return (lambda ids: tok.decode(list(ids), skip_special_tokens=False)), special, vocab_sha256(_Pipeline(tok, smap))


def _by_transformers(folder: Path, names: dict[int, str]):
    """``(decode, special ids, fingerprint)`` with ``transformers.AutoTokenizer`` (local files only)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from ..tokens import vocab_sha256
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    lacking = sorted((i, t) for i, t in names.items() if hf.convert_tokens_to_ids(t) in (None, hf.unk_token_id))
    if lacking:
        hf.add_tokens([AddedToken(t, special=True, normalized=False) for _, t in lacking], special_tokens=True)
    decode = lambda ids: hf.decode(list(ids), skip_special_tokens=False,  # noqa: E731
                                   clean_up_tokenization_spaces=False)
    return decode, frozenset(int(i) for i in hf.all_special_ids), vocab_sha256(hf)


def _bytes(manifest: CacheManifest, names: dict[int, str]) -> TokenText:
    """The byte scheme ``encoders.text_tokenizer.config`` records (UTF-8 bytes at ``offset``)."""
    cfg = _recorded(manifest).get("config")
    need = ("offset", "pad_id", "bos_id", "eos_id")
    if not isinstance(cfg, dict) or any(not isinstance(cfg.get(k), int) for k in need):
        return TokenText(None, names, "token ids shown: the cache records no byte scheme "
                                      "(encoders.text_tokenizer.config: offset, pad_id, bos_id, eos_id)")
    offset = int(cfg["offset"])
    specials = cfg.get("special_tokens") if isinstance(cfg.get("special_tokens"), list) else []
    names = {int(cfg["pad_id"]): "<pad>", int(cfg["bos_id"]): "<bos>", int(cfg["eos_id"]): "<eos>",
             **{256 + offset + i: str(t) for i, t in enumerate(specials)}, **names}

    def decode(ids: Sequence[int]) -> str:
        return bytes(i - offset for i in ids if offset <= i < offset + 256).decode("utf-8", errors="replace")

    return TokenText(decode, names, "text by the cache's byte tokenizer (UTF-8 bytes at offset "
                                    f"{offset}, as encoders.text_tokenizer.config records it)")


def load_token_text(manifest: CacheManifest) -> TokenText:
    """A :class:`TokenText` for the cache of ``manifest`` (see the module docstring). Never raises:
    a tokenizer that cannot be found or loaded, or is not the recorded one, gives ids only, saying why."""
    names = special_names(manifest)
    config = manifest.config if isinstance(manifest.config, dict) else {}
    spec = config.get("text_tokenizer")
    if not isinstance(spec, dict):
        return TokenText(None, names, "the cache records no text tokenizer (config.text_tokenizer): token ids shown")
    if "factory" in spec:
        return TokenText(None, names, f"token ids shown: the text tokenizer {spec['factory']} is a plug-in, and "
                                      "the TextTokenizer protocol declares no decode")
    kind = spec.get("name", "bytes")
    if kind == "bytes":
        return _bytes(manifest, names)
    if kind != "hf" or not isinstance(spec.get("pretrained"), str):
        return TokenText(None, names, f"token ids shown: the viewer cannot decode a {kind!r} text tokenizer")
    pretrained = spec["pretrained"]
    folder, where = tokenizer_folder(pretrained, manifest)
    if folder is None:
        return TokenText(None, names, f"token ids shown: the tokenizer files of {pretrained} are not on this machine "
                                      f"({where})")
    want = _recorded(manifest).get("vocab_sha256")
    tried = []
    for how, load in (("tokenizers", lambda: _by_tokenizers(folder, names, _recorded(manifest))),
                      ("transformers", lambda: _by_transformers(folder, names))):
        try:
            got = load()
        except ImportError as e:
            tried.append(f"{how}: {e.name or e} is not installed")
            continue
        except Exception as e:  # noqa: BLE001 - any failure to load means: show ids, and say why
            tried.append(f"{how}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if got is None:
            tried.append(f"{how}: no tokenizer.json in {folder}")
            continue
        decode, special, sha = got
        if want is not None and sha != want:
            tried.append(f"{how}: another tokenizer (vocab_sha256 {sha[:12]}..., recorded {str(want)[:12]}...)")
            continue
        check = "fingerprint matches the cache's" if want is not None else "the cache records no fingerprint to check it by"
        return TokenText(decode, names, f"text by the cache's tokenizer (hf: {where}; {check}; loaded with {how})",
                         special)
    return TokenText(None, names, f"token ids shown: the text tokenizer at {where} is not the one this cache was made "
                                  f"with, or cannot be loaded here ({'; '.join(tried)})")


class TokenTextLoader:
    """:func:`load_token_text` in a daemon thread started now (see the module docstring). Thread-safe.

    :meth:`get` returns the result once it is there, and until then (after waiting ``wait_s`` seconds
    at most) a :class:`TokenText` of ids only saying the tokenizer is still loading."""

    def __init__(self, manifest: CacheManifest):
        self.manifest = manifest
        self._value: TokenText | None = None
        self._done = threading.Event()
        self._started = time.monotonic()
        background_threads.start(self._load, "shardcache-view-tokenizer")

    def _load(self) -> None:
        try:
            self._value = load_token_text(self.manifest)
        except BaseException as e:  # noqa: BLE001 - load_token_text does not raise; a bug is still said
            self._value = TokenText(None, special_names(self.manifest), f"token ids shown: {type(e).__name__}: {e}")
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the tokenizer is loaded (or found unusable); whether it is."""
        return self._done.wait(timeout)

    def get(self, wait_s: float = 0.0) -> TokenText:
        if self._done.wait(wait_s):
            return self._value
        return TokenText(None, special_names(self.manifest),
                         f"token ids shown: the text tokenizer is still loading (for {time.monotonic() - self._started:.0f} s "
                         "so far); reload the page for the text")


__all__ = ["TokenText", "TokenTextLoader", "load_token_text", "special_names", "tokenizer_folder",
           "WORKING_DIR_KEY"]
