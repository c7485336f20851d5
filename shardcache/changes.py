"""What a run logs of its configuration at start: the options that differ from the defaults, on one line
(:func:`changes_line`; ``--print_config`` prints the whole config), by both stages."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from shardcache.config import to_dict


def changes(cfg: Any, default: Any = None, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted option, value)`` of every option of ``cfg`` (a config dataclass, or its :func:`to_dict`) that
    differs from ``default`` (the class's defaults), mappings compared key by key (``audio_tokenizer.pretrained``;
    a key the defaults have and ``cfg`` lacks: ``"(removed)"``)."""
    if dataclasses.is_dataclass(cfg):
        cfg, default = to_dict(cfg), to_dict(type(cfg)())
    if not (isinstance(cfg, dict) and isinstance(default, dict)):
        return [] if cfg == default else [(prefix[:-1], cfg)]
    return [c for k in [*default, *(k for k in cfg if k not in default)]
            for c in changes(cfg.get(k, "(removed)"), default.get(k, "(removed)"), f"{prefix}{k}.")]


def changes_line(cfg: Any, limit: int = 400) -> str:
    """One log line naming :func:`changes` (``name=value``, values as compact JSON), cut at about ``limit``
    characters with a count of the rest; ``--print_config`` prints the whole config."""
    parts = [f"{k}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}" for k, v in changes(cfg)]
    n = next((i for i in range(len(parts)) if len(", ".join(parts[:i + 1])) > limit), len(parts)) or 1
    more = f" (+{len(parts) - n} more)" if n < len(parts) else ""
    return f"config, where it differs from the defaults: {', '.join(parts[:n]) or 'nothing'}{more} " \
           "(--print_config prints all of it)"
