"""Every launcher's real environment (issue 51 item 1): torchrun, SLURM's srun, OpenMPI's mpirun and
MPICH's mpiexec (PMI) each place a process by variables of their own; under srun or mpirun without
torchrun every process used to be rank 0 of 1 (a 4-process loader run read 48 samples for 12, exit 0;
stage one's processes each started the whole job on one cache). Here the loader, stage one and
add-field run under each launcher (torchrun, mpirun and mpiexec for real, srun with the environment
srun gives its tasks: tests/launchers.py) and the ranks' shares are checked to be disjoint and
complete; a partial environment is refused naming the variables; and no product module but
``shardcache/ranks.py`` reads a launcher's variable."""
from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from launchers import NAMES, clean_env, launch, srun_task_env
from shardcache.ranks import LAUNCHERS, Ranks
from test_train_support import REPO, TESTS, make_cache

pytestmark = pytest.mark.ddp
DEMO = REPO / "data" / "demo"
WORKER = str(TESTS / "launcher_worker.py")
#: processes per launcher in the loader test: srun's 4 tasks sit on 2 emulated nodes (local ranks repeat)
NPROC = {"torchrun": 2, "srun": 4, "mpirun": 4, "mpiexec": 4}


def _records(out: Path, mode: str, n: int) -> list[dict]:
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(n)]


# ---- Ranks.detect on each launcher's variables, as the launcher sets them ----------------------

def test_srun_tasks_on_two_nodes_are_four_ranks_with_repeating_local_ranks():
    got = [Ranks.detect(env=srun_task_env(r, 4)) for r in range(4)]
    assert [(x.global_rank, x.world_size, x.local_rank, x.local_world_size) for x in got] == \
        [(0, 4, 0, 2), (1, 4, 1, 2), (2, 4, 0, 2), (3, 4, 1, 2)]
    assert {x.launcher for x in got} == {"SLURM (srun)"}


def test_the_innermost_launcher_wins_srun_torchrun():
    """``srun torchrun`` on 2 nodes: each torchrun worker also sees its node's srun task (SLURM_PROCID =
    the node, of 2); torchrun's own variables describe the process (rank 3 of 4)."""
    env = {**srun_task_env(1, 2, nodes=2), "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "LOCAL_WORLD_SIZE": "2"}
    r = Ranks.detect(env=env)
    assert (r.global_rank, r.world_size, r.local_rank, r.local_world_size, r.launcher) == (3, 4, 1, 2, "torchrun")
    # mpirun inside an allocation: its ranks inherit the srun step of its daemons (one task per node)
    env = {**srun_task_env(0, 2, nodes=2), "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert str(Ranks.detect(env=env)) == "rank 5 of 8 (OpenMPI (mpirun))"


def test_an_sbatch_shell_without_srun_is_one_process_and_says_so():
    """The batch script has SLURM_PROCID=0 and the allocation's SLURM_NTASKS=8 but no job step: a
    command run there without srun is 0 of 1 (not rank 0 of 8 waiting for 7 processes never started)."""
    env = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "8", "SLURM_GTIDS": "0"}
    r = Ranks.detect(env=env)
    assert (r.global_rank, r.world_size, r.launcher) == (0, 1, "none")
    assert "srun" in r.note and "SLURM_NTASKS=8" in r.note


@pytest.mark.parametrize("env, named", [
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1"}, ["SLURM_PROCID"]),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"]),
    ({"PMI_RANK": "1"}, ["PMI_SIZE"]),
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "4"}, ["RANK"]),
])
def test_a_partial_family_is_refused_naming_its_variables(env, named):
    with pytest.raises(ValueError) as e:
        Ranks.detect(env=env)
    msg = str(e.value)
    assert all(f"{k}={v}" in msg for k, v in env.items()), msg
    assert f"{' and '.join(named)} unset" in msg, msg


@pytest.mark.parametrize("env, says", [
    ({"PMI_RANK": "2", "PMI_SIZE": "2"}, "PMI_RANK=2 is not a rank of PMI_SIZE=2"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, "local rank 0 of 4, world 2"),
    ({**srun_task_env(0, 2), "SLURM_STEP_NUM_TASKS": "two"}, "SLURM_STEP_NUM_TASKS='two' is not an integer"),
])
def test_a_contradictory_family_is_refused(env, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        Ranks.detect(env=env)


def test_a_multi_node_world_without_a_rendezvous_is_refused_naming_it():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        Ranks.detect(env=env).rendezvous(env)
    assert Ranks.detect(env=env).rendezvous({**env, "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}) == \
        {"MASTER_ADDR": "n1", "MASTER_PORT": "1234"}
    slurm = srun_task_env(2, 4, job_id=123)  # srun: srun's own address, the port from the job id (as Lightning)
    assert Ranks.detect(env=slurm).rendezvous(slurm) == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "15123"}


# ---- real processes under each launcher ------------------------------------------------------

@pytest.mark.parametrize("launcher", NAMES)
def test_every_process_of_a_launch_joins_one_process_group(launcher, tmp_path):
    """Each launcher's processes find their ranks and join one gloo group as ``shardcache train``
    does (Ranks.init_process_group): the all-reduced ranks sum to 0 + 1 (+ 2 + 3)."""
    n = 2
    r = launch(launcher, n, [WORKER, "group", str(tmp_path)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    recs = _records(tmp_path, "group", n)
    assert [x["global_rank"] for x in recs] == list(range(n)) and {x["world_size"] for x in recs} == {n}
    assert {x["rank_sum"] for x in recs} == {sum(range(n))}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return make_cache(tmp_path_factory.mktemp("launch") / "cache", n=24, n_shards=3)


@pytest.mark.parametrize("launcher", NAMES)
def test_the_loader_reads_disjoint_complete_shares_under_each_launcher(launcher, cache, tmp_path):
    """A ShardLoader built with no rank arguments in each process: rank r of N (not 0 of 1), the
    shares disjoint, together every sample of the cache once (24 samples, global batch 2N)."""
    n = NPROC[launcher]
    r = launch(launcher, n, [WORKER, "loader", str(cache), str(tmp_path)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    recs = _records(tmp_path, "loader", n)
    assert [x["loader"][:2] for x in recs] == [[i, n] for i in range(n)]
    keys = [k for x in recs for k in x["keys"]]
    assert len(keys) == len(set(keys)) == 24 // (2 * n) * 2 * n
    every = pq.read_table(cache / "index.parquet", columns=["key"]).column("key").to_pylist()
    assert set(keys) <= set(every) and len(set(every)) == 24


# ---- stage one and add-field -----------------------------------------------------------------

def _manifest(tmp: Path, n: int = 6) -> Path:
    """The demo's first ``n`` good rows (speech clips; paths made absolute)."""
    rows = [r for r in map(json.loads, (DEMO / "samples.jsonl").read_text().splitlines()[:12])
            if r["key"].startswith("spk-")][:n]
    for row in rows:
        row["audio"] = str(DEMO / row["audio"])
    out = tmp / "rows.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def _precompute_argv(tiny_models: Path, manifest: Path, cache: Path) -> list[str]:
    return ["-m", "shardcache", "precompute", "--manifest", str(manifest), "--cache", str(cache),
            "--config", str(REPO / "configs" / "precompute.yaml"),
            f"--audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}",
            f"--image_encoder.pretrained={tiny_models / 'wan-tiny'}", "--device=cpu", "--num_workers=0",
            "--samples_per_shard=2", "--no_progress", "--allow_outside_root=true"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [pytest.param(n, marks=[pytest.mark.long] if n in ("torchrun", "mpiexec") else [])
                                      for n in NAMES])  # torchrun, mpiexec: make test-long; srun, mpirun here
def test_stage_one_under_each_launcher_is_one_job_of_two_ranks(launcher, tiny_models, tmp_path):
    """Two processes of ``shardcache precompute``: one job of 2 ranks (each writes its chunks; rank 0
    merges), not two whole jobs on one cache: every row once, the manifest says world_size 2."""
    manifest = _manifest(tmp_path)
    out = tmp_path / "cache"
    r = launch(launcher, 2, _precompute_argv(tiny_models, manifest, out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["world_size"] == 2
    keys = pq.read_table(out / "index.parquet", columns=["key"]).column("key").to_pylist()
    assert sorted(keys) == sorted(json.loads(line)["key"] for line in manifest.read_text().splitlines())
    assert "[rank 0]" in r.stdout and "[rank 1]" in r.stdout


@pytest.fixture(scope="module")
def small_cache(tiny_models, tmp_path_factory) -> Path:
    import subprocess
    tmp = tmp_path_factory.mktemp("small")
    out = tmp / "cache"
    subprocess.run([sys.executable, *_precompute_argv(tiny_models, _manifest(tmp), out)], cwd=REPO, env=clean_env(),
                   check=True, capture_output=True, timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [pytest.param(n, marks=[pytest.mark.long] if n in ("torchrun", "mpirun") else [])
                                      for n in NAMES])  # torchrun, mpirun: make test-long; srun, mpiexec here
def test_add_field_under_each_launcher_deals_the_shards_to_two_ranks(launcher, small_cache, tmp_path):
    """``add-field`` in two processes: the shards dealt between 2 ranks, every sample gets the field."""
    cache = tmp_path / "c"
    shutil.copytree(small_cache, cache)
    r = launch(launcher, 2, ["-m", "shardcache", "add-field", str(cache), "--field", "audio_16k", "--producer",
                             "waveform", "--options", "{sample_rate: 16000}", "--no_progress"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    index = pq.read_table(cache / "index.parquet").to_pylist()
    with_field = [row["key"] for row in index if any(m["name"] == "audio_16k.npy" for m in row["members"])]
    assert sorted(with_field) == sorted(row["key"] for row in index)
    sidecars = sorted(p.name for p in cache.glob("shard-*.audio_16k.tar"))
    assert sidecars == sorted(p.name.replace(".tar", ".audio_16k.tar") for p in cache.glob("shard-??????.tar"))
    assert len(sidecars) >= 2


@pytest.mark.parametrize("command", ["precompute", "add-field", "train"])
def test_a_partial_environment_is_refused_by_every_command_naming_the_variables(command, cache, tmp_path):
    """``WORLD_SIZE=2`` and no ``RANK``: stage one died in torch's rendezvous with a traceback, add-field
    took rank 0 of 2; now every command exits 2 naming what is set and what is missing."""
    import subprocess
    argv = {"precompute": ["precompute", "--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "c")],
            "add-field": ["add-field", str(tmp_path / "c"), "--field", "audio_16k", "--producer", "waveform"],
            "train": ["train", "--cache", str(cache), "--run_dir", str(tmp_path / "run"), "--dry_run"]}[command]
    r = subprocess.run([sys.executable, "-m", "shardcache", *argv], cwd=REPO, capture_output=True, text=True,
                       env=clean_env({"WORLD_SIZE": "2", "LOCAL_RANK": "1"}), timeout=120)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    assert "WORLD_SIZE=2" in r.stderr and "RANK unset" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# ---- one reader of the launchers' variables ----------------------------------------------------

PRODUCT = ("shardcache", "shards", "precompute", "loaders", "train", "benchmarks")


def test_launcher_variables_are_read_in_one_product_module():
    """No string naming a variable that places a process (``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``,
    ``OMPI_COMM_WORLD_SIZE``...: each launcher's rank, size, local rank and local size) appears in the
    code of any product module but shardcache/ranks.py (docstrings and comments aside). Which *launch*
    a process belongs to (``SLURM_JOB_ID``, ``TORCHELASTIC_RUN_ID``: the holder of a cache's lock) is
    another fact, owned by shards/lock.py."""
    names = {v for launcher in LAUNCHERS for v in (launcher.rank, launcher.size, launcher.local_rank,
                                                   launcher.local_size) if v}
    found = []
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                          if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    hit = names & set(__import__("re").findall(r"[A-Z][A-Z_]+[A-Z]", node.value))
                    if hit and path.relative_to(REPO).as_posix() != "shardcache/ranks.py":
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {sorted(hit)}")
    assert not found, found
