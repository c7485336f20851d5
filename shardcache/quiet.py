"""Library messages a shardcache user cannot act on, filtered by name.

Each entry of :data:`QUIET` names a library's logger and the start of one message it logs; :func:`quiet_libraries`
drops those records (a :class:`logging.Filter` on that logger, installed before the library is imported or after:
the logger is the same object). Everything else a library logs is kept. Both stages' commands call it at start.
"""
from __future__ import annotations

import logging

#: (logger name, start of the message): what is dropped, and why
QUIET: tuple[tuple[str, str, str], ...] = (
    ("diffusers.models.modeling_utils", "Cannot initialize model with low cpu memory usage because `accelerate`",
     "the VAE loads the same without accelerate; stage one does not use accelerate's loading"),
)


class _Drop(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_libraries() -> None:
    """Install the filters of :data:`QUIET` (once per logger)."""
    by_logger: dict[str, list[str]] = {}
    for name, start, _ in QUIET:
        by_logger.setdefault(name, []).append(start)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(tuple(starts)))


__all__ = ["QUIET", "quiet_libraries"]
