"""Subcommands of the ``shards`` CLI, one module per command group.

Each module has ``register(subparsers, common)`` adding its subcommands; a subcommand's handler
takes the parsed ``argparse.Namespace`` and returns the exit code. Shared helpers (output in rich,
plain text or JSON; locating a cache; reading index columns) live in :mod:`._common`.
"""
from __future__ import annotations

from . import export_lhotse, overview, query, reindex, samples, stats, verify, view

#: modules in the order their subcommands appear in ``shards --help``
MODULES = (overview, samples, query, stats, view, verify, reindex, export_lhotse)
