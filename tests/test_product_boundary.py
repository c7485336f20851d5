"""The product packages (what the wheel ships) hold no test support: no test-model builder, no
stand-in modules put into ``sys.modules``, no import of ``tools`` (the repository's support code)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def product_packages() -> list[str]:
    """The packages pyproject.toml puts in the wheel."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return find_packages(str(ROOT), include=conf["tool"]["setuptools"]["packages"]["find"]["include"])


def test_the_wheel_ships_no_test_support():
    pkgs = product_packages()
    assert {"shards", "precompute", "loaders", "train", "shardcache"} <= set(pkgs)
    assert not [p for p in pkgs if p.startswith("tools") or p.endswith(".testing") or "shims" in p], pkgs


def test_product_code_neither_imports_tools_nor_fakes_modules():
    """(Blocking an import with ``sys.modules[name] = None`` is allowed: train.models.blocked_imports.)"""
    bad = []
    for pkg in product_packages():
        for f in (ROOT / pkg.replace(".", "/")).glob("*.py"):
            text = f.read_text()
            # (``sys.modules[spec.name] = module`` is importlib's recipe for a module of the product's own name:
            # precompute.encoders.higgs_resampler, whose SOXR_MODULE test_higgs_resampler.py checks)
            for pattern in (r"^\s*(from|import)\s+tools\b", r"sys\.modules\[(?!spec\.name\])[^\]]+\]\s*=\s*(?!\s|None\b)",
                            r"sys\.modules\.setdefault"):
                if re.search(pattern, text, re.M):
                    bad.append(f"{f.relative_to(ROOT)}: {pattern}")
    assert not bad, bad
