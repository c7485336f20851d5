"""The core install (`pip install shardcache`, no extra) is what a training node needs: `shards` and
`loaders` import no media or model library and read a cache; every `shards` command that needs no
extra runs there, and one that needs [inspect] exits 2 naming it. Issue 32 item 4, issue 40 item 4."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_support import REPO, base_env, make_cache

# what the extras bring ([precompute], [train], [inspect], [dev]); the core must not need any of them
NOT_CORE = ("librosa", "soundfile", "soxr", "PIL", "diffusers", "transformers", "safetensors", "joblib",
            "duckdb", "matplotlib", "peft", "webdataset", "lhotse", "datasets", "accelerate", "lightning",
            "skimage", "s3fs")
CORE_VENV = Path(os.environ.get("SHARDCACHE_CORE_VENV", REPO / "build" / "core-venv"))

READ = """
import json, sys
from loaders import ShardLoader, MixedLoader, Workers
from shardcache.ranks import Ranks
from shards import ShardReader
ld = ShardLoader(sys.argv[1], batch_size=4, seed=0, ranks=Ranks(0, 1), workers=Workers(num_workers=0))
keys = [k for batch in ld for k in batch["keys"]]
shapes = {k: list(v.shape) for k, v in next(iter(ld)).items() if hasattr(v, "shape")}
print(json.dumps({"keys": keys, "shapes": shapes, "mods": sorted(sys.modules)}))
"""

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in %r:
            raise ImportError(f"the core imported {name}")
sys.meta_path.insert(0, Block())
""" % (NOT_CORE,)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return make_cache(tmp_path_factory.mktemp("core") / "cache", n=12, n_shards=2)


def index_keys(cache: Path) -> list[str]:
    import pyarrow.parquet as pq
    return pq.read_table(cache / "index.parquet", columns=["key"]).column("key").to_pylist()


def read_with(python: str, cache: Path, prelude: str = "") -> dict:
    env = base_env()
    if python != sys.executable:
        env["PYTHONPATH"] = ""  # the venv's own installed copy, nothing of this checkout
    r = subprocess.run([python, "-c", prelude + READ, str(cache)], env=env, capture_output=True, text=True,
                       timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_loaders_and_shards_read_a_cache_without_any_extra(cache):
    """With every library of the extras made unimportable, the loader reads the whole cache."""
    out = read_with(sys.executable, cache, BLOCK)
    assert sorted(out["keys"]) == sorted(index_keys(cache))
    assert not {m.split(".")[0] for m in out["mods"]} & set(NOT_CORE)


def core_venv_python() -> Path:
    """build/core-venv's python, the venv made first when it is missing or older than the sources
    (`make core-venv`: ~1 min)."""
    r = subprocess.run(["make", "core-venv", f"CORE_VENV={CORE_VENV}", "PYTHON=python3"], cwd=REPO,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return CORE_VENV / "bin" / "python"


@pytest.mark.long
@pytest.mark.xdist_group("core_venv")  # one worker builds build/core-venv: two `pip install .` share build/
def test_a_venv_of_the_core_extra_only_reads_a_cache(cache):
    """`make core-venv` (build/core-venv: `pip install torch==2.13.0 .`, no system site-packages)
    holds none of the extras' libraries and reads the cache (built on first use, ~1 min)."""
    python = str(core_venv_python())
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True,
                            check=True).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert "shardcache" in names and not names & {n.lower() for n in NOT_CORE + ("pillow", "scikit-image")}
    out = read_with(python, cache)
    assert sorted(out["keys"]) == sorted(index_keys(cache))
    assert out["shapes"]["input_ids"][0] == 4


#: the shards commands the core install runs (a key of the cache is appended for `show`)
CORE_COMMANDS = (["info"], ["ls"], ["head", "-n", "2"], ["show"], ["verify"], ["rejects"])
#: the commands that need the [inspect] extra (DuckDB)
INSPECT_COMMANDS = (["query", "--count"], ["stats"])
SHARDS = "import sys\nfrom shardcache.cli import main\nsys.exit(main(['shards'] + sys.argv[1:]))\n"


def shards(python: str, cache: Path, args: list[str], prelude: str = "") -> subprocess.CompletedProcess:
    """``shardcache shards ARGS`` (the cache inserted after the command name) with ``python``."""
    env = base_env()
    if python != sys.executable:
        env["PYTHONPATH"] = ""
    argv = [args[0], str(cache)] + args[1:]
    if args[0] == "show":
        argv.append(index_keys(cache)[0])
    return subprocess.run([python, "-c", prelude + SHARDS] + argv, env=env, capture_output=True, text=True,
                          timeout=300, cwd="/")


def assert_core_commands_run_and_inspect_ones_name_the_extra(python: str, cache: Path, prelude: str = "") -> None:
    for args in CORE_COMMANDS:
        r = shards(python, cache, args, prelude)
        assert r.returncode == 0, f"shards {args[0]}: {r.stderr[-2000:]}"
        assert "Traceback" not in r.stderr
    r = shards(python, cache, ["show", "--json"], prelude)
    assert json.loads(r.stdout)[0]["key"] == index_keys(cache)[0]
    for args in INSPECT_COMMANDS:
        r = shards(python, cache, args, prelude)
        assert r.returncode == 2, f"shards {args[0]}: exit {r.returncode}: {r.stdout[-500:]} {r.stderr[-2000:]}"
        assert 'pip install "shardcache[inspect]"' in r.stderr and "duckdb" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr, r.stderr


def test_shards_commands_without_any_extra_run_and_inspect_ones_exit_2_naming_it(cache):
    """With every library of the extras made unimportable (what the core install lacks): info, ls,
    head, show, verify and rejects run (they died on `ModuleNotFoundError: joblib`); query and stats
    exit 2 naming `pip install "shardcache[inspect]"` (they printed a traceback)."""
    assert_core_commands_run_and_inspect_ones_name_the_extra(sys.executable, cache, BLOCK)


def test_a_full_install_without_duckdb_names_the_extra_too(cache):
    block = BLOCK.replace(repr(NOT_CORE), repr(("duckdb",)))
    for args in INSPECT_COMMANDS:
        r = shards(sys.executable, cache, args, block)
        assert r.returncode == 2 and 'pip install "shardcache[inspect]"' in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    plot = shards(sys.executable, cache, ["stats", "--plot", "/tmp/x.png"], BLOCK.replace(repr(NOT_CORE), repr(("matplotlib",))))
    assert plot.returncode == 2 and "--plot needs matplotlib" in plot.stderr and "shardcache[inspect]" in plot.stderr


@pytest.mark.long
@pytest.mark.xdist_group("core_venv")
def test_a_venv_of_the_core_extra_only_runs_the_shards_commands(demo_cache):
    """`make core-venv` runs info, ls, head, show, verify and rejects on a cache stage one wrote (with
    rejects); query and stats exit 2 naming the [inspect] extra."""
    assert_core_commands_run_and_inspect_ones_name_the_extra(str(core_venv_python()), demo_cache)
