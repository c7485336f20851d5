"""The configuration code stays small (issue 51, "one ground floor"): the ``*config*.py`` and ``*validate*.py``
files of the product packages hold at most :data:`BUDGET` lines, counted as the issue counts them::

    git ls-files '*config*.py' '*validate*.py' | grep -v '^tests/\\|^benchmarks/\\|^tools/\\|^scripts/' | xargs wc -l

and the whole mechanism, those files and the modules that hold parts of it (:data:`PARTS`: the YAML reader with
limits, the help text, the config's log line, stage one's effect vocabulary), at most :data:`TOTAL_BUDGET`, so
that moving code out of the first files does not make it smaller. A bad option is refused by the project's own
check of the declared options, not by reading the text of jsonargparse's errors (``shardcache/config.py``
imports no ``re``).
"""
from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the most lines the ``*config*.py`` and ``*validate*.py`` files may have
BUDGET = 760
#: the modules that hold the rest of the configuration mechanism
PARTS = ("shardcache/yaml_limits.py", "shardcache/helptext.py", "shardcache/changes.py", "precompute/effects.py")
#: the most lines the whole mechanism (those files and :data:`PARTS`) may have
TOTAL_BUDGET = 960
#: the folders whose files the count leaves out
NOT_PRODUCT = ("tests/", "benchmarks/", "tools/", "scripts/")


def config_files() -> list[str]:
    """The files the count reads, as ``git ls-files`` lists them (tracked files only)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the count is of the tracked files")
    out = subprocess.run(["git", "ls-files", "*config*.py", "*validate*.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    return [f for f in out if not f.startswith(NOT_PRODUCT)]


def test_the_configuration_code_is_within_its_budget():
    files = config_files()
    assert "shardcache/config.py" in files and "precompute/validate.py" in files, files
    lines = {f: len((ROOT / f).read_bytes().splitlines()) for f in files}  # what wc -l counts (newlines)
    assert sum(lines.values()) <= BUDGET, f"{sum(lines.values())} lines of configuration code, over {BUDGET}: {lines}"


def test_the_whole_mechanism_is_within_its_budget():
    files = config_files() + list(PARTS)
    lines = {f: len((ROOT / f).read_bytes().splitlines()) for f in files}
    assert sum(lines.values()) <= TOTAL_BUDGET, f"{sum(lines.values())} lines, over {TOTAL_BUDGET}: {lines}"


def test_no_regex_reads_the_librarys_errors():
    tree = ast.parse((ROOT / "shardcache" / "config.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "re" not in imported, "shardcache/config.py imports re"
