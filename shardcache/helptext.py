"""Help text from docstrings: the one rule every command line of both stages formats its help with."""
from __future__ import annotations

import re


def plain(doc: str | None) -> str:
    """A docstring as plain help text: ``x`` and :role:`x` (Sphinx/RST markup) as x."""
    return re.sub(r"(?::\w+:)?`+([^`]+)`+", r"\1", doc or "")


__all__ = ["plain"]
