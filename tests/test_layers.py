"""The layers of the product (docs/layers.md): which package may import which, read from the source.

The module import graph of the product packages is built from every ``import`` statement of every
module, at module level and inside functions (``ast``; an import guarded by ``TYPE_CHECKING`` counts
too), then checked:

* ``shards`` (the format) imports nothing from the stages (``precompute``, ``loaders``, ``train``):
  what a valid cache is, and every command that reads one, is decided below both stages;
* no stage imports a command (``shardcache.cli``, ``shards.cli``, ``shards.commands``,
  ``shards.viewer``) or a module of the command layer (``shardcache.commands``);
* no import cycle joins modules of two packages (a cycle inside one package is that package's
  business).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the product packages (what the wheel installs)
PACKAGES = ("shardcache", "shards", "precompute", "loaders", "train")
#: the stages (shards must import none of them)
STAGES = ("precompute", "loaders", "train")
#: the command layer: above both stages
COMMANDS = ("shardcache.cli", "shardcache.__main__", "shardcache.commands", "shards.cli", "shards.commands",
            "shards.viewer")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The product modules module ``name`` (file ``path``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # a name imported from a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[:len(up) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def package(m: str) -> str:
    return m.split(".")[0]


def in_layer(m: str, prefixes: tuple[str, ...]) -> bool:
    return any(m == p or m.startswith(p + ".") for p in prefixes)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


@pytest.fixture(scope="module")
def g() -> dict[str, set[str]]:
    return graph()


def test_the_graph_sees_function_level_imports(g):
    """(So a test below can fail: an import inside a function is an edge. shards.cli imports its
    commands inside build_parser; train.data imports loaders.device at module level.)"""
    assert "shards.commands" in g["shards.cli"] and "loaders.device" in g["train.data"]


def test_shards_imports_no_stage(g):
    bad = sorted((m, t) for m, ts in g.items() if package(m) == "shards" for t in ts if package(t) in STAGES)
    assert not bad, "shards imports the stages: " + ", ".join(f"{m} -> {t}" for m, t in bad)


def test_no_stage_imports_a_command(g):
    bad = sorted((m, t) for m, ts in g.items() if package(m) in STAGES for t in ts if in_layer(t, COMMANDS))
    assert not bad, "a stage imports a command: " + ", ".join(f"{m} -> {t}" for m, t in bad)


def test_no_import_cycle_crosses_a_package(g):
    crossing = [c for c in cycles(g) if len({package(m) for m in c}) > 1]
    assert not crossing, "import cycles across packages: " + "; ".join(" <-> ".join(c) for c in crossing)
