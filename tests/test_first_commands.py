"""A new user's first hour (issue 40 items 1, 4, 6): every command the README names exists and runs its
`--help` (`make` targets as a dry run), the test-model builder works in a fresh process that imported
transformers first without the tests' torchaudio stand-in, `make inspect` reinstalls nothing in a venv
that holds an install, and a second `make train` into the same RUN is refused naming the make variables."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_support import REPO, base_env, make_cache
from tools.torchaudio_shim import SHIMS

README = REPO / "README.md"


def _spans(text: str) -> list[str]:
    """The README's commands: inline code spans (may wrap lines) and lines of fenced bash blocks,
    whitespace collapsed, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        out += [line.split("#")[0].strip() for line in block.splitlines()]
        out += re.findall(r"`([^`]+)`", block)  # `shards query / ...` inside a comment
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out += [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]
    return [s for s in out if s]


def readme_commands() -> dict[str, set]:
    """``{"make": {command lines}, "shardcache": {subcommands}, "shards": {subcommands}}`` named in README.md."""
    found: dict[str, set] = {"make": set(), "shardcache": set(), "shards": set()}
    for span in _spans(README.read_text()):
        if span.startswith("make "):
            found["make"].add(span)
            continue
        m = re.match(r"(?:python -m )?shardcache (.+)", span)
        if m:
            for part in m.group(1).split("|"):
                words = part.split()
                if words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
                    found["shardcache"].add(words[0])
                    if words[0] == "shards" and len(words) > 1 and re.fullmatch(r"[a-z][a-z-]*", words[1]):
                        found["shards"].add(words[1])
            continue
        m = re.match(r"shards ([a-z-]+(?: / [a-z-]+)*)", span)
        if m:
            found["shards"].update(m.group(1).split(" / "))
    return found


def test_the_readme_names_the_commands_this_test_checks():
    found = readme_commands()
    assert {"make precompute train", "make test", "make inspect", "make core-venv"} <= found["make"]
    assert {"precompute", "add-field", "drop-field", "check", "train", "find-batch-size", "shards"} <= found["shardcache"]
    assert {"query", "stats"} <= found["shards"]


@pytest.mark.parametrize("name", sorted(readme_commands()["shardcache"]))
def test_every_shardcache_command_the_readme_names_runs(name):
    r = subprocess.run([sys.executable, "-m", "shardcache", name, "--help"], cwd=REPO, env=base_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage" in r.stdout.lower(), f"shardcache {name} --help: {r.stderr[-2000:]}"


def test_every_shards_command_the_readme_names_exists():
    """`shards samples` was named (for the [inspect] extra) but never existed."""
    from shards.cli import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    names = readme_commands()["shards"]
    assert names and not names - set(sub.choices), f"README names shards {sorted(names - set(sub.choices))}"


@pytest.mark.parametrize("line", sorted(readme_commands()["make"]))
def test_every_make_command_the_readme_names_is_a_target(line):
    """Each `make ...` line of the README, as a dry run (`make -n`): its targets and variables exist."""
    r = subprocess.run(line.split()[:1] + ["-n"] + line.split()[1:], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env=base_env({"SHARDCACHE_FAKE_GPUS": "0"}))
    assert r.returncode == 0, f"{line}: {r.stderr[-2000:]}"


def test_shards_help_examples_match_the_shards_stage_one_writes(tmp_path):
    """`shards --help` showed `ls 'cache/shard-r0000-*.tar'`, which matches no shard stage one writes
    (shard-NNNNNN.tar): every glob of its examples matches a shard name of the schema."""
    from fnmatch import fnmatch

    from shards.cli import EPILOG
    from shards.schema import chunk_shard_name
    globs = re.findall(r"'cache/([^']*\*[^']*)'", EPILOG)
    assert globs
    for g in globs:
        assert fnmatch(chunk_shard_name(0), g), g


def _own_make() -> dict[str, str]:
    """This environment without what a calling make passes down (``make test`` runs these tests: a make
    started from it is a sub-make, which prints "Entering directory" lines and inherits its flags)."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}


def _venv_with(tmp_path: Path, *stamps: str) -> Path:
    venv = tmp_path / "venv"
    venv.mkdir()
    for s in stamps:
        (venv / s).touch()  # newer than pyproject.toml: that install is up to date
    return venv


def test_make_inspect_installs_nothing_in_a_venv_that_holds_an_install(tmp_path):
    """After `make precompute train` (the [precompute] and [train] installs), `make inspect` reinstalled
    the package (31 s before a 1 s summary): every extra includes the core."""
    venv = _venv_with(tmp_path, ".installed-train")
    r = subprocess.run(["make", "-n", "inspect", f"VENV={venv}", "OUT=cache/demo"], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env=_own_make())
    assert r.returncode == 0 and r.stdout.splitlines() == [f"{venv}/bin/python -m shardcache shards info cache/demo"]
    fresh = subprocess.run(["make", "-n", "inspect", f"VENV={tmp_path / 'none'}"], cwd=REPO, capture_output=True,
                           text=True, timeout=60, env=_own_make())
    assert "pip install" in fresh.stdout  # a venv with no install gets the core


def test_a_second_make_train_into_the_same_run_names_the_make_variables(tmp_path):
    cache = make_cache(tmp_path / "cache", n=8, n_shards=1)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    venv = _venv_with(tmp_path, ".installed-train")
    r = subprocess.run(["make", "train", f"VENV={venv}", f"PY={sys.executable}", f"OUT={cache}", f"RUN={run}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=base_env())
    assert r.returncode != 0
    assert "already holds a run" in r.stderr and "RESUME=auto" in r.stderr and "RESUME=fresh" in r.stderr, r.stderr
    assert "--checkpoint.resume auto" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_the_tiny_higgs_audio_tokenizer_builds_in_a_fresh_process_that_imported_transformers_first(tmp_path):
    """Issue 40 item 1: `make models` died on the Higgs audio tokenizer ("requires the torchaudio
    library") once transformers had decided, earlier in the process, that torchaudio was missing. Here
    transformers decides first, and the tests' stand-in (tools/shims, which tests/conftest.py puts on
    PYTHONPATH) is off the path."""
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep)
                                        if p and Path(p).resolve() != SHIMS)
    code = ("import runpy, sys\n"
            "import transformers\n"
            "from transformers.utils import is_torchaudio_available\n"
            "print('torchaudio available to transformers:', is_torchaudio_available())\n"
            f"sys.argv = ['tools.testing', '--out', {str(tmp_path / 'models')!r}, '--only', 'higgs-audio-tokenizer']\n"
            "runpy.run_module('tools.testing', run_name='__main__', alter_sys=True)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert str(SHIMS) not in r.stdout
    assert (tmp_path / "models" / "higgs-audio-tokenizer-tiny" / "config.json").is_file()
