"""The generated tables of docs/ agree with the registries they come from (fields, kinds, names)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_doc_tables_are_up_to_date():
    r = subprocess.run([sys.executable, "scripts/gen_docs.py", "--check", "--skip-bench"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_field_and_kind_is_documented():
    from shards import fields
    from shards.kinds import KINDS
    text = (ROOT / "docs" / "format.md").read_text()
    assert all(f"| `{f.name}` |" in text for f in fields.FIELDS)
    assert all(f"| {k} |" in text for k in KINDS)
