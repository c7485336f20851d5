"""Each special token and ``IGNORE_INDEX`` spelled once (issue 51): :mod:`shards.tokens` names them, every
other product module uses its constants (a recipe's contract key ``special_tokens.<|audio_out_bos|>`` is
built from ``AUDIO_OUT_BOS``, a message naming ``<image>`` from ``IMAGE``, a pad value or a message's
"labels all -100" from ``IGNORE_INDEX``).

Read from the source (``ast``) of every module of the product packages but ``shards/tokens.py``: no string
constant, docstrings aside (module, class, function and attribute docstrings may say ``<image>`` or
``-100``), holds a token :mod:`shards.tokens` spells or any other ``<|name|>`` token, or the number -100;
no number constant is -100. The parts of an f-string are string constants too.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from shards import tokens

ROOT = Path(__file__).resolve().parents[1]
#: the product packages (what the wheel installs)
PACKAGES = ("shardcache", "shards", "precompute", "loaders", "train")
#: the one module that spells them
OWNER = ROOT / "shards" / "tokens.py"
#: every token shards.tokens spells (its upper-case string constants), and the form of any other Llama-3 token
TOKENS = sorted({v for k, v in vars(tokens).items() if k.isupper() and isinstance(v, str)})
PIPE_TOKEN = re.compile(r"<\|\w+\|>")
#: -100 written as a number inside a text (not -1000, not 1-100)
IGNORE_TEXT = re.compile(r"(?<![\w.])-100(?![\d.])")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings: a module's, class's or function's first
    statement, and every string standing alone as a statement (an attribute docstring)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}


def second_spellings(source: str, name: str = "<source>") -> list[str]:
    """``name:line: what`` for each token or -100 that ``source`` spells itself (see the module docstring)."""
    tree = ast.parse(source, name)
    docs, out = _docstrings(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
                and type(node.operand.value) in (int, float) and node.operand.value == 100:
            out.append(f"{name}:{node.lineno}: the number -100 (shards.tokens.IGNORE_INDEX)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found = [t for t in TOKENS if t in node.value] + PIPE_TOKEN.findall(node.value)
            found += ["-100"] if IGNORE_TEXT.search(node.value) else []
            out += [f"{name}:{node.lineno}: {t!r} in {node.value[:80]!r}" for t in dict.fromkeys(found)]
    return out


def test_the_scan_finds_a_second_spelling():
    """The scan itself: each form it must find is found, a docstring and the constants' names are not."""
    source = ('"""A module docstring may say <image> and -100."""\n'
              'from shards.tokens import AUDIO_OUT_BOS, IGNORE_INDEX\n'
              'KEY = "special_tokens.<|audio_out_bos|>"\n'
              'MSG = f"labels all -100 for {KEY}"\n'
              'PAD = -100\n'
              'WORLD = ("<start_of_world>", "x")\n'
              'OTHER = "<|some_new_token|>"\n'
              'ATTR = 1\n'
              '"""An attribute docstring: <|AUDIO_OUT|>."""\n'
              'GOOD = (f"special_tokens.{AUDIO_OUT_BOS}", IGNORE_INDEX, -1000, "pages 1-100")\n')
    found = second_spellings(source, "m.py")
    assert sorted(int(f.split(":")[1]) for f in found) == [3, 4, 5, 6, 7], found


def test_each_special_token_and_ignore_index_is_spelled_once():
    assert "<|audio_out_bos|>" in TOKENS and "<start_of_world>" in TOKENS and "<image>" in TOKENS
    modules = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if p != OWNER]
    assert len(modules) > 100, len(modules)
    found = [f for p in modules for f in second_spellings(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "spell these with the constants of shards/tokens.py:\n" + "\n".join(found)
