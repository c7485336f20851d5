"""Help text from docstrings: the one rule every command line of both stages formats its help with."""
from __future__ import annotations

import argparse
import re
from typing import Iterable

from jsonargparse import ArgumentParser, DefaultHelpFormatter


def plain(doc: str | None) -> str:
    """A docstring as plain help text: ``x`` and :role:`x` (Sphinx/RST markup) as x."""
    return re.sub(r"(?::\w+:)?`+([^`]+)`+", r"\1", doc or "")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, the description's line breaks kept (its example commands)."""


def short_help(p: ArgumentParser, paths: Iterable[str], footer: str) -> str:
    """``p``'s help showing only ``--help``, ``--config`` and the options ``paths``, then ``footer``
    (``p``'s other actions lose their help: give it a parser built for this)."""
    for a in p._actions:  # noqa: SLF001 - argparse lists its actions nowhere else
        a.help = a.help if a.dest in {"help", "config", *paths} else argparse.SUPPRESS
    p.epilog = footer
    return p.format_help()


__all__ = ["plain", "HelpFormatter", "short_help"]
