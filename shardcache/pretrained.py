"""Where a ``pretrained`` value points: a local checkpoint directory or a Hugging Face hub id.

Both stages load real checkpoints with ``from_pretrained`` (codecs and VAEs at stage one, the LM
at stage two); this module decides, once for both, whether a value is a local directory that
must exist (failing at once, with the command that builds the tiny test models) or a hub id.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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


__all__ = ["BUILD_HINT", "resolve_pretrained", "load_error"]
