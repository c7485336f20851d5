"""One CLI convention (issue 40 item 5): every command's options are spelled with ``_`` inside their names, the
separator the YAML keys use; no option is shown in two spellings; every flag the README, docs/ and any
command's ``--help`` name is one the parser accepts.

The parsers are the commands' own (each command's ``build_parser``); ``--help`` runs in a subprocess for every
command and ``shards`` subcommand, as a user runs it.
"""
from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from conftest import ROOT

ENV = None
#: a flag as written: ``--name``, ``--section.option``, ``--model.kwargs.lm`` (no trailing punctuation; not a
#: placeholder in capitals such as ``--OPTION`` or ``--SECTION.OPTION``)
FLAG = re.compile(r"(?<![\w/-])--(?![A-Z_.]+\b)[A-Za-z][\w.-]*[\w]")
#: flags of other tools the docs name beside ours, and the tool
FOREIGN = {"--nproc_per_node": "torchrun", "--nnodes": "torchrun", "--node_rank": "torchrun", "--standalone":
           "torchrun", "--rdzv_backend": "torchrun", "--rdzv_endpoint": "torchrun", "--rdzv_id": "torchrun",
           "--master_addr": "torchrun", "--master_port": "torchrun", "--max_restarts": "torchrun",
           "--system-site-packages": "python -m venv", "--no-deps": "pip", "--index-url": "pip",
           "--extra-index-url": "pip", "--upgrade": "pip", "--only": "python -m tools.testing",
           "--out": "python -m tools.testing", "--check": "scripts/gen_docs.py", "--skip-bench": "scripts/gen_docs.py",
           "--gres": "sbatch", "--nodes": "sbatch", "--ntasks-per-node": "sbatch", "--cpus-per-task": "sbatch",
           "--time": "sbatch", "--signal": "sbatch", "--requeue": "sbatch", "--open-files-limit": "sbatch",
           "--no-cache-dir": "pip", "--user": "pip", "--quiet": "pip", "--max-restarts": "torchrun",
           "--output": "sbatch", "--real-mini": "docs/viewer/render.py", "--host-resolver-rules": "chromium", "--size": "python -m tools.testing", "--no-remote": "benchmarks/bench_loader.py",
           "--no-peers": "benchmarks/bench_loader.py", "--epochs": "benchmarks/bench_loader.py",
           "--n": "benchmarks/gpu_steady.py", "--distinct": "benchmarks/gpu_steady.py",
           "--alone": "benchmarks/gpu_steady.py", "--revision": "hf download",
           "--input_revision": "transformers' convert_higgs_audio_v2_to_hf.py",
           "--audio_tokenizer_path_or_repo": "transformers' convert_higgs_audio_v2_to_hf.py",
           "--audio_tokenizer_revision": "transformers' convert_higgs_audio_v2_to_hf.py",
           "--non-interactive": "energon prepare", "--split-parts": "energon prepare",
           "--sample-type": "energon prepare",
           **{f: "chromium (the viewer's browser tests)" for f in (
               "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--autoplay-policy", "--user-data-dir")}}


def _parsers() -> dict[str, tuple]:
    """command -> (parser, the dataclass of its options or None)."""
    from precompute.add_field import AddFieldOptions, build_add_parser, build_drop_parser
    from shardcache.commands.check import build_parser as check_parser
    from precompute.cli import build_parser as precompute_parser
    from precompute.config import PrecomputeConfig
    from shards.cli import build_parser as shards_parser
    from train.batch_size import build_finder_parser
    from train.cli import build_parser as train_parser
    from train.config import TrainConfig
    out = {"precompute": (precompute_parser(), PrecomputeConfig), "train": (train_parser(), TrainConfig),
           "find-batch-size": (build_finder_parser(), TrainConfig), "add-field": (build_add_parser(), AddFieldOptions),
           "drop-field": (build_drop_parser(), None), "check": (check_parser(), None)}
    sp = shards_parser()
    out["shards"] = (sp, None)
    sub = next(a for a in sp._actions if a.__class__.__name__ == "_SubParsersAction")
    out |= {f"shards {n}": (p, None) for n, p in sub.choices.items()}
    return out


PARSERS = _parsers()


def _is_mapping(tp) -> bool:
    parts = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, type(int | None)) else (tp,)
    return any((typing.get_origin(p) or p) is dict for p in parts)


def accepts(command: str, flag: str) -> bool:
    """Whether ``command``'s parser takes ``flag`` (an option, a key of a mapping option, or, for train, a flag of
    the Higgs-Audio launch line it translates)."""
    from shardcache.config import options
    p, cls = PARSERS[command]
    flag = flag.partition("=")[0]
    if flag in p._option_string_actions:  # noqa: SLF001 - argparse's table of flags
        return True
    if cls is not None:
        opts = options(cls)
        parts = flag[2:].split(".")
        for i in range(len(parts) - 1, 0, -1):  # --audio_tokenizer.pretrained, --model.kwargs.lm: a mapping's key
            head = ".".join(parts[:i])
            if head in opts:
                return _is_mapping(opts[head][0])
    if command in ("train", "find-batch-size"):
        from train.recipes.higgs_argv import translate
        return translate([flag, "x"]) != [flag, "x"]
    return False


def _help(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "shardcache", *args, "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (args, r.stderr[-2000:])
    return r.stdout


def test_every_option_has_one_spelling_with_underscores():
    """No command has an option with ``-`` inside its name, and none lists an option twice."""
    for command, (p, _) in PARSERS.items():
        names = [s for a in p._actions for s in a.option_strings]
        assert not [n for n in names if "-" in n[2:]], (command, [n for n in names if "-" in n[2:]])
        assert len(names) == len(set(names)), command


def test_every_command_runs_help_and_names_only_flags_it_accepts():
    """``--help`` of every command and shards subcommand exits 0 and every flag it names parses (train's
    ``--help_all`` too); the top-level ``shardcache --help`` names only flags some command accepts."""
    for command in PARSERS:
        text = _help(*command.split()) + (_help("train", "--help_all") if command == "train" else "")
        assert not _wrong_command_lines(text), (command, _wrong_command_lines(text))
        mine = [c for c in PARSERS if c == command or c.startswith(command + " ")]  # shards: its subcommands'
        bad = sorted({f for f in FLAG.findall(COMMAND_LINE.sub("", text))
                      if f not in FOREIGN and not any(accepts(c, f) for c in mine)})
        assert not bad, (command, bad)
    top = subprocess.run([sys.executable, "-m", "shardcache", "--help"], cwd=ROOT, capture_output=True, text=True)
    bad = sorted({f for f in FLAG.findall(top.stdout) if not any(accepts(c, f) for c in PARSERS)})
    assert top.returncode == 0 and not bad, bad


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: ``shardcache COMMAND`` (or ``-m shardcache COMMAND``) and the rest of its line
COMMAND_LINE = re.compile(r"(?:^|[\s`(])(?:shardcache|-m shardcache)\s+(precompute|train|add-field|drop-field|check|"
                          r"find-batch-size|shards\s+[\w-]+)((?:[^\n`|;&)]|\\\n)*)")


@pytest.mark.parametrize("doc", DOCS, ids=[p.name for p in DOCS])
def test_every_flag_the_docs_name_is_accepted(doc: Path):
    """Each flag in README.md and docs/*.md is accepted by a command (or belongs to another tool the page runs,
    :data:`FOREIGN`); each flag on a ``shardcache COMMAND ...`` line is accepted by that command."""
    text = doc.read_text()
    bad = sorted({f for f in FLAG.findall(text) if f not in FOREIGN and not any(accepts(c, f) for c in PARSERS)})
    assert not bad, (doc.name, bad)
    assert not _wrong_command_lines(text), (doc.name, _wrong_command_lines(text))


def _wrong_command_lines(text: str) -> list[tuple[str, str]]:
    """``(command, flag)`` for each flag on a ``shardcache COMMAND ...`` line that COMMAND does not accept."""
    wrong = []
    for m in COMMAND_LINE.finditer(text):
        command = " ".join(m[1].split())
        if command not in PARSERS:
            wrong.append((command, "no such command"))
            continue
        wrong += [(command, f) for f in FLAG.findall(m[2]) if f not in FOREIGN and not accepts(command, f)]
    return wrong


def test_a_dashed_spelling_is_refused_naming_the_one_to_use(capsys):
    """``--sample-rate`` (the other spelling) exits 2 naming ``--sample_rate``; one line per problem."""
    from precompute.cli import main
    rc = main(["--manifest", "m.jsonl", "--cache", "/nonexistent/c", "--sample-rate", "16000"])
    err = capsys.readouterr().err
    assert rc == 2 and err == "error: sample-rate: unknown option; options are spelled with '_': --sample_rate\n", err
