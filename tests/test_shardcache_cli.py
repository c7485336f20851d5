"""The ``shardcache`` command: subcommands dispatch to each stage's own CLI, one vocabulary."""
from __future__ import annotations

import subprocess
import sys

from conftest import DEMO, ROOT


def _run(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardcache", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})


def test_help_lists_the_subcommands_and_each_has_its_own(capsys):
    import pytest
    from shardcache.cli import main
    r = _run("--help")  # python -m shardcache
    assert r.returncode == 0
    for name in ("precompute", "add-field", "drop-field", "train", "find-batch-size", "shards"):
        assert f"  {name}" in r.stdout
    assert main(["nope"]) == 2 and main([]) == 2
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--optim.lr" in out and "--cache" in out and "--help_all" in out
    assert main(["shards", "--help"]) == 0 and "verify" in capsys.readouterr().out


COMMANDS = ("precompute", "add-field", "drop-field", "check", "train", "find-batch-size", "shards")


def _help(capsys, *args: str) -> str:
    from shardcache.cli import main
    try:
        assert main([*args, "--help"]) == 0
    except SystemExit as e:  # argparse's own --help
        assert e.code == 0
    return capsys.readouterr().out


def test_help_is_plain_text_with_shardcache_usage_lines(capsys):
    """Every subcommand's --help: a usage line that says ``shardcache COMMAND`` and no Sphinx/RST
    markup (double backquotes, :class:`...` roles); ``train --help`` is short, ``--help_all`` has every option."""
    import re
    for cmd in COMMANDS:
        text = _help(capsys, cmd)
        assert text.startswith(f"usage: shardcache {cmd} "), (cmd, text[:80])
        assert "``" not in text and not re.search(r":(class|func|mod|data|meth|attr):`", text), cmd
    short, every = _help(capsys, "train"), _help(capsys, "train", "--help_all")
    from shardcache.config import options
    from train.config import TrainConfig
    assert len(short.splitlines()) < 100 < len(every.splitlines())
    assert all(f"--{path} " in every for path in options(TrainConfig)) and "--help_all" in short


def test_bad_option_exits_2_before_any_model_is_loaded(tmp_path):
    """``--cache`` is the cache in both stages; a bad value stops
    with status 2 naming the option (no model is loaded: the job would fail on the missing dirs)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"audio_tokenizer: {{name: dac, pretrained: {tmp_path / 'missing'}}}\n")
    r = _run("precompute", "--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "out"),
             "--config", str(cfg), "--sample_rate=abc", cwd=tmp_path)
    assert r.returncode == 2 and "sample_rate: expected an integer > 0 and <= 384000, got 'abc'" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    from shardcache.cli import main
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["train", "--config", "none", "--cache", str(tmp_path), "--optim.lr", "fast"]) == 2
    assert "optim.lr: expected a number >= 0 and <= 100, got 'fast'" in err.getvalue()


def test_console_script_is_registered():
    import importlib
    import tomllib
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    mod, _, func = scripts["shardcache"].partition(":")
    assert callable(getattr(importlib.import_module(mod), func))


def test_one_console_script_and_one_module_entry():
    """``shardcache`` is the only console script and ``python -m shardcache`` the only ``-m`` entry:
    the stages' packages have no ``__main__`` of their own."""
    import tomllib
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"] == {
        "shardcache": "shardcache.cli:main"}
    assert (ROOT / "shardcache" / "__main__.py").is_file()
    for path in ("precompute/__main__.py", "train/__main__.py", "shards/__main__.py", "train/find_batch_size.py"):
        assert not (ROOT / path).exists(), path


def test_version():
    """``shardcache --version`` (and ``shardcache shards --version``): the installed distribution's
    version and the cache format written (read independently: importlib.metadata, shards.schema)."""
    from importlib.metadata import version

    from shards.schema import FORMAT_VERSION
    want = f"shardcache {version('shardcache')} (cache format {FORMAT_VERSION})"
    for args in (["--version"], ["shards", "--version"]):
        r = _run(*args)
        assert r.returncode == 0 and r.stdout.strip() == want, (args, r.stdout, r.stderr)
