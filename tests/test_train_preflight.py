"""``shardcache train`` on a fresh clone: a missing or wrong cache is one line and exit 2 before
anything loads; a run directory that holds a run needs an explicit choice (resume or replace); the run
ends with a summary saying where checkpoints and metrics went. Issue 32 item 5."""
from __future__ import annotations

import json

import pytest

from shards.cache import Contract
from test_train_support import REAL_LOADER, make_cache, train_args
from train.cli import main
from train.recipes.base import Recipe


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("preflight") / "cache", n=16)


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "error" in line]


@pytest.mark.parametrize("case", ["missing", "empty dir", "file"])
def test_a_wrong_cache_path_is_one_line_and_exit_2(tmp_path, capsys, case):
    path = tmp_path / "cache"
    if case == "empty dir":
        path.mkdir()
    elif case == "file":
        path.write_text("x")
    assert main(train_args(path, tmp_path / "run")) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and "data.cache" in lines[0] and str(path) in lines[0]
    if case != "file":  # (a file is refused by the option's own check, with its own advice)
        assert "shardcache precompute --cache DIR" in lines[0] and "Rerun" not in err
    assert "effective config" not in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_run_dir_holding_a_run_needs_resume_or_fresh(cache, tmp_path, capfd):
    import logging
    # a handler an earlier fixture left on the `train` logger writes to that test's stderr: start clean
    # (the autouse _restore_train_logger puts the handlers back afterwards)
    logging.getLogger("train").handlers.clear()
    run = tmp_path / "run"
    opts = dict(loader=REAL_LOADER, steps=3, ckpt_every=1, keep=5, log_every=1)
    assert main(train_args(cache, run, **opts)) == 0
    err = capfd.readouterr().err
    summary = [line.split(" INFO ", 1)[1] for line in err.splitlines() if " INFO done:" in line]
    # the happy path of an input_ids cache is quiet: no "declares fields ... text_ids" (the legacy name)
    assert "declares fields" not in err and "text_ids" not in err
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert summary == [f"done: step 3 of 3 (3 this run), last loss {losses[-1]:.4g}; checkpoints in {run} "
                       f"(newest step-3); metrics in {run / 'metrics.jsonl'}"]
    assert main(train_args(cache, run, **opts)) == 2  # again, no choice made: refused, nothing touched
    (line,) = errors(capfd)
    assert "checkpoint.resume" in line and "already holds a run" in line and "step-3" in line
    assert "--checkpoint.resume auto" in line and "--checkpoint.resume fresh" in line
    assert sorted(p.name for p in run.glob("step-*")) == ["step-1", "step-2", "step-3"]

    assert main(train_args(cache, run, **dict(opts, steps=2, resume="fresh"))) == 0  # replace it
    assert sorted(p.name for p in run.glob("step-*")) == ["step-1", "step-2"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in x] == [1, 2]
    assert main(train_args(cache, run, **dict(opts, steps=3, resume="auto"))) == 0  # or continue it


def test_a_finding_equal_on_every_rank_is_said_by_rank_0_only(capfd):
    """``extra={"once": True}`` (the recipes' "N % trainable" warning): rank 0 says it, rank 1 does
    not; rank 1's other warnings still show."""
    import logging
    from train.dist import DistInfo
    from train.recipes.lm import ONCE
    from train.trainer import log, setup_logging
    saved = log.handlers[:], log.level, log.propagate
    for rank in (0, 1):
        log.handlers.clear()
        setup_logging(DistInfo(rank=rank, world_size=2))
        log.warning("%.1f %% of the parameters train", 11.6, extra=ONCE)
        log.warning("rank-specific %d", rank)
    log.handlers[:], log.level, log.propagate = saved
    err = capfd.readouterr().err
    assert err.count("11.6 % of the parameters train") == 1 and "[rank 0]" in err.split("11.6")[0].splitlines()[-1]
    assert "rank-specific 0" in err and "rank-specific 1" in err


class NeedsFeaturesRecipe(Recipe):
    """A plug-in recipe whose contract needs ``image_features`` (the test cache has none); building it fails
    the test: ``--dry_run`` stops at the contract."""

    @classmethod
    def contract(cls, kwargs):
        return Contract(model="needs-features", fields=("input_ids", "image_features"))

    @classmethod
    def from_cache(cls, cache, kwargs, **_):
        raise AssertionError("--dry_run built the model")


def test_dry_run_checks_the_cache_and_the_contract_and_loads_nothing(cache, tmp_path, capsys):
    """``--dry_run`` (``make train`` runs it before torchrun): the options, the cache, the run directory and the
    model's contract against the cache, in this process, then exit; no run directory is made, no model is built."""
    run = tmp_path / "run"
    assert main(train_args(cache, run, dry_run=True)) == 0
    out = capsys.readouterr().out
    from shards import read_cache_id
    assert f"id {read_cache_id(cache)}, 16 samples" in out and "nothing was loaded" in out
    assert not run.exists()
    args = train_args(cache, run, dry_run=True) + ["--model.name", f"{__name__}:NeedsFeaturesRecipe",
                                                   "--model.kwargs", "{}"]
    assert main(args) == 2
    (line,) = errors(capsys)
    assert "needs-features" in line and "image_features" in line and str(cache) in line
    assert not run.exists()
