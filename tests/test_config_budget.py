"""The configuration code stays small (issue 51, "one ground floor"): the ``*config*.py`` and ``*validate*.py``
files of the product packages hold at most :data:`BUDGET` lines, counted as the issue counts them::

    git ls-files '*config*.py' '*validate*.py' | grep -v '^tests/\\|^benchmarks/\\|^tools/\\|^scripts/' | xargs wc -l

and a bad option is refused by the project's own check of the declared options, not by reading the text of
jsonargparse's errors (``shardcache/config.py`` imports no ``re``).
"""
from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the most lines the configuration code may have
BUDGET = 805
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


def test_no_regex_reads_the_librarys_errors():
    tree = ast.parse((ROOT / "shardcache" / "config.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "re" not in imported, "shardcache/config.py imports re"
