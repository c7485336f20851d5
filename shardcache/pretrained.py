"""Where a ``pretrained`` value points: a local checkpoint directory or a Hugging Face hub id; and the text
tokenizer a checkpoint ships, as both stages see it.

Both stages load real checkpoints with ``from_pretrained`` (codecs and VAEs at stage one, the LM
at stage two); this module decides, once for both, whether a value is a local directory that
must exist (failing at once, with the command that builds the tiny test models) or a hub id.

A model's contract compares the cache's text tokenizer with the one its checkpoint was trained with:
:func:`tokenizer_identity` loads it (``AutoTokenizer``, ``transformers``' own resolution of the tokenizer
files, the chat template from ``tokenizer_config.json`` or ``chat_template.jinja``) and gives its fingerprint
(:func:`shards.tokens.vocab_sha256`, what stage one records), where it was read, and the sha256 of its chat
template (:func:`template_sha256`, what stage one records as ``chat_template_sha256``). The recipes
(``train.recipes``) and ``loaders.higgs.HiggsChatMLDataset`` use it alike.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

#: how to create local test models when a ``pretrained`` directory is missing
BUILD_HINT = ("To build small randomly initialised test models of the real architectures, in a source "
              "checkout run: make models (python -m tools.testing --out models)")


def resolve_pretrained(pretrained: Any, *, what: str) -> str:
    """Return ``pretrained`` as a string for ``from_pretrained``, failing early on missing local dirs.

    A value is a local path when it exists, is absolute, starts with ``.``/``~``, has more than one
    ``/``, its first component is an existing directory (``ckpt/dac`` when ``ckpt/``
    exists). Anything else (``org/name``, ``name``) is a Hugging Face hub id.

    Raises:
        ValueError: ``pretrained`` is empty.
        NotADirectoryError: it names a file.
        FileNotFoundError: a local path that does not exist (the message has :data:`BUILD_HINT`).
    """
    if pretrained is None or str(pretrained).strip() == "":
        raise ValueError(f"{what}: 'pretrained' (a local directory or hub id) is required. {BUILD_HINT}")
    text = os.fspath(pretrained) if isinstance(pretrained, os.PathLike) else str(pretrained)
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise NotADirectoryError(f"{what}: pretrained path {text!r} is a file; expected a model directory")
    looks_local = (
        isinstance(pretrained, os.PathLike)
        or path.is_absolute()
        or text.startswith((".", "~"))
        or text.count("/") > 1
        or Path(text.split("/", 1)[0]).is_dir()
        or (os.sep != "/" and os.sep in text)
    )
    if looks_local:
        raise FileNotFoundError(f"{what}: model directory {text!r} does not exist. {BUILD_HINT}")
    return text


def load_error(what: str, pretrained: str, err: Exception) -> Exception:
    """An ``OSError`` explaining that ``pretrained`` could not be loaded, chained by the caller."""
    return OSError(f"{what}: could not load {pretrained!r} as a local directory or Hugging Face hub id "
                   f"({type(err).__name__}: {err}). {BUILD_HINT}")


def load_tokenizer(checkpoint: Any, added: Iterable[str] = (), what: str = "model.kwargs.lm",
                   revision: str | None = None):
    """The ``transformers`` tokenizer shipped with ``checkpoint`` (a directory or hub id, at ``revision``:
    default ``main``), with ``added`` tokens added as stage one adds missing ones (special, never split:
    TheWorld's world markers); None when it ships no tokenizer files. (A training process calls it inside
    ``train.imports.blocked_imports``.) Raises :class:`shardcache.weights.LocalRevision` for a ``revision``
    with a local folder."""
    from .weights import checkpoint as checkpoint_of
    name = resolve_pretrained(checkpoint, what=what)
    checkpoint_of(name, revision=revision, what=f"the revision of {what}")   # a folder has no revisions: refused
    from tokenizers import AddedToken
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(name, revision=revision or None)
    except (OSError, ValueError):
        return None
    if added:
        tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in added], special_tokens=True)
    return tok


#: the options of Gemma 3's image processor that shape its pixel values, as its config file names them: its
#: class, resize (``size``, ``resample``), rescale, normalise and pan-and-scan (refused at stage one); what
#: stage one's ``image_features`` records and the ``theworld`` recipe compares (``feature_encoder.image_processor``)
GEMMA3_PIXEL_OPTIONS = ("image_processor_type", "do_resize", "size", "resample", "do_rescale", "rescale_factor",
                        "do_normalize", "image_mean", "image_std", "do_pan_and_scan")


def image_processor_options(checkpoint: Any, keys: Iterable[str], revision: str | None = None) -> dict[str, Any]:
    """``{key: value}`` of the image processor config of ``checkpoint`` (a directory or hub id, at ``revision``:
    default ``main``) for ``keys`` (those it sets), as ``transformers`` finds and reads it
    (``ImageProcessingMixin.get_image_processor_dict``: ``processor_config.json``'s ``image_processor``, or
    ``preprocessor_config.json``), without building the processor (which would need PIL or torchvision).
    Raises ``OSError`` (``transformers``' message) when it has none, or one that does not parse."""
    from transformers.image_processing_base import ImageProcessingMixin
    raw, _ = ImageProcessingMixin.get_image_processor_dict(resolve_pretrained(checkpoint, what="image processor"),
                                                           revision=revision or None)
    return {k: raw[k] for k in keys if k in raw}


def template_sha256(template: str | None) -> str:
    """sha256 (hex) of a Jinja chat template's text (``""`` for none): what stage one records as the text
    tokenizer's ``chat_template_sha256`` and a contract compares (``chat_template_sha256``)."""
    import hashlib
    return hashlib.sha256((template or "").encode()).hexdigest()


def tokenizer_identity(checkpoint: Any, named: Any = None, added: Iterable[str] = (), *, revision: str | None = None,
                       named_revision: str | None = None) -> tuple[Any, Any, Any]:
    """``(tokenizer, fingerprint, template)`` of the text tokenizer a model's checkpoint was trained with:
    ``named`` (``model.kwargs.tokenizer``, a directory or hub id, at ``named_revision``:
    ``model.kwargs.tokenizer_revision``) when given, else the one ``checkpoint`` ships (at ``revision``:
    ``model.kwargs.revision``; default ``main``). ``fingerprint`` is :func:`shards.tokens.vocab_sha256` after
    ``added``, as a :class:`shards.cache.Sourced` naming where the tokenizer was read; ``template`` the
    :func:`template_sha256` of its chat template. Never "any": when neither exists, ``(None, Unknown(...),
    Unknown(...))``, which no cache meets, naming ``model.kwargs.tokenizer``. Raises
    :class:`shardcache.weights.LocalRevision` for a revision with a local folder."""
    from shards.cache import Sourced, Unknown, source_text
    from shards.tokens import vocab_sha256

    from .weights import checkpoint as checkpoint_of
    from .weights import source
    if named_revision and not named:
        raise ValueError(f"model.kwargs.tokenizer_revision {named_revision!r} without model.kwargs.tokenizer: name "
                         "the tokenizer (a hub id) whose revision it is, or set model.kwargs.revision for the "
                         "checkpoint's own tokenizer")
    where = "model.kwargs.tokenizer" if named else "model.kwargs.lm"
    rev = named_revision if named else revision
    checkpoint_of(resolve_pretrained(named if named else checkpoint, what=where), revision=rev,
                  what="model.kwargs.tokenizer_revision" if named else "model.kwargs.revision")
    tok = load_tokenizer(named if named else checkpoint, added, where, revision=rev)
    if tok is None:
        what = f"model.kwargs.tokenizer {named}" if named else f"{checkpoint}"
        unknown = Unknown(f"{what} ships no tokenizer files: name the tokenizer the checkpoint was trained with in "
                          "model.kwargs.tokenizer (a directory or hub id)")
        return None, unknown, unknown
    src = source_text(source(resolve_pretrained(named if named else checkpoint, what=where), "tokenizer_config.json",
                             revision=rev))
    return tok, Sourced(vocab_sha256(tok), src), template_sha256(tok.chat_template)


def token_ids(tok: Any, names: Iterable[str]) -> dict[str, Any]:
    """``{token: the tokenizer's id}`` for each of ``names`` (Unknown for a token it lacks; every id
    Unknown without a tokenizer), as a contract's ``special_tokens``."""
    from shards.cache import Unknown
    out = {}
    for t in names:
        i = tok.convert_tokens_to_ids(t) if tok is not None else None
        unk = tok.unk_token_id if tok is not None else None
        ok = isinstance(i, int) and (i != unk or t == tok.unk_token)
        out[t] = int(i) if ok else Unknown(f"the model's tokenizer has no {t}" if tok is not None else
                                           "the model's tokenizer is not known (model.kwargs.tokenizer)")
    return out


def tokenizer_pad_id(tok: Any) -> Any:
    """The pad id stage one gives a tokenizer (``pad_token_id``, else ``eos_token_id``, else 0:
    :class:`precompute.encoders.text.HFTokenizer`), Unknown without a tokenizer."""
    from shards.cache import Unknown
    if tok is None:
        return Unknown("the model's tokenizer is not known (model.kwargs.tokenizer)")
    for v in (tok.pad_token_id, tok.eos_token_id):
        if v is not None:
            return int(v)
    return 0


__all__ = ["BUILD_HINT", "GEMMA3_PIXEL_OPTIONS", "image_processor_options", "resolve_pretrained", "load_error",
           "load_tokenizer", "template_sha256", "token_ids", "tokenizer_identity", "tokenizer_pad_id"]
