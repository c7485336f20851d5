"""YAML text read within limits: the one YAML reader of the project (:func:`load_yaml`; config files of both
stages, flag values, ``add-field --config``), so a document a user or a file hands over cannot hang or exhaust
a command (an alias bomb, a recursive alias, deep nesting, megabytes of text)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from shardcache.inputs import NotAFile, read_input

#: the most bytes of YAML read at once, and the most values a document may stand for with each alias
#: counted at every use (a "billion laughs" document is refused before anything walks it)
YAML_MAX_BYTES, YAML_MAX_VALUES = 1 << 20, 100_000
_FLOAT = re.compile(r"^[-+]?(\d[\d_]*)?\.?\d*[eE][-+]?\d+$")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 plus ``1e-4`` read as a number (YAML 1.2 does; 1.1 reads it as text)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _values(doc: Any, limit: int) -> int:
    """How many values ``doc`` stands for, a value reached through several aliases counted at every use (at
    most ``limit + 1``: a recursive alias stands for infinitely many). The loader builds each node once."""
    n, todo = 0, [doc]
    while todo and n <= limit:
        x, n = todo.pop(), n + 1
        todo.extend(x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())
    return n


class YAMLRefused(ValueError):
    """YAML refused: past a limit of :func:`load_yaml`, or a file :func:`read_yaml` cannot read as a mapping;
    ``where`` (what was read: an option, a file) and ``reason``."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


def load_yaml(text: str, where: str = "yaml") -> Any:
    """``text`` as YAML within :data:`YAML_MAX_BYTES` bytes and :data:`YAML_MAX_VALUES` values once
    aliases are expanded, no nesting deeper than the recursion limit: the one YAML reader of this
    project (config files, flag values, ``add-field --config``). Raises :class:`YAMLRefused` past a
    limit and ``yaml.YAMLError`` for text that is not YAML."""
    if (n := len(text.encode("utf-8", "surrogatepass"))) > YAML_MAX_BYTES:
        raise YAMLRefused(where, f"{n} bytes of YAML, more than the {YAML_MAX_BYTES} a config may have")
    try:
        doc = yaml.load(text, _Loader)  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise YAMLRefused(where, "refused: YAML nested too deeply") from None
    if _values(doc, YAML_MAX_VALUES) > YAML_MAX_VALUES:
        raise YAMLRefused(where, f"refused: its aliases expand to more than {YAML_MAX_VALUES} values "
                                 "(a YAML alias bomb or a recursive alias?); write the values out")
    return doc


def read_yaml(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """A YAML file (``flag``'s: ``--config``) as a mapping, read by :func:`load_yaml`; raises
    :class:`YAMLRefused` naming ``flag`` and the file, also for a file that is not YAML or not a mapping."""
    try:  # (a FIFO or device is refused, never waited on: shardcache.inputs)
        data = load_yaml(read_input(path, flag).decode("utf-8"), f"{flag} {path}") or {}
    except NotAFile as e:
        raise YAMLRefused(f"{flag} {path}", f"is {e.kind}, not a file: give a regular file") from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise YAMLRefused(f"{flag} {path}", " ".join(str(e).split()[:20])) from None
    if not isinstance(data, dict):
        raise YAMLRefused(f"{flag} {path}", "expected a mapping of option: value")
    return data
