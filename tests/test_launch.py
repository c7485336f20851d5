"""Launchers: the command line `make precompute` / `make train` build (dry runs with a faked GPU
count), and the SLURM scripts run under a fake SLURM (stub srun/scontrol/python on PATH that record
their arguments and environment) to check the torchrun command every node gets."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "scripts" / "slurm"
BASH = shutil.which("bash")
MAKE = shutil.which("make")
needs_bash = pytest.mark.skipif(BASH is None, reason="bash is not installed")
HOSTS = ("gpu-a07", "gpu-b12")
RECOMMENDED_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "PYTORCH_ALLOC_CONF": "expandable_segments:True",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600",
    "OMP_NUM_THREADS": "8",  # 64 CPUs per task / 8 GPUs per node
}


# ---- make --------------------------------------------------------------------------------------

def _make_dry_run(*args: str, **env: str) -> str:
    if MAKE is None:
        pytest.skip("make is not installed")
    # a clean environment: no MAKEFLAGS from an outer make, no OUT/DATA/NPROC/... the Makefile would read;
    # FORCE=1: the command line even where this clone's cache is up to date (its stamp: test_make_precompute_*)
    e = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR") if k in os.environ} | {"FORCE": "1"} | env
    r = subprocess.run([MAKE, "-n", *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.replace("\\\n", " ")  # join continued recipe lines


def _line(out: str, module: str) -> str:
    """The line that runs ``shardcache MODULE`` (train's ``--dry_run`` check before it aside)."""
    lines = [ln for ln in out.splitlines() if f"-m shardcache {module} " in ln and "--dry_run" not in ln]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize("how", ["env", "make-variable"])
def test_make_precompute_starts_one_rank_per_gpu(how):
    args, env = (("precompute",), {"SHARDCACHE_FAKE_GPUS": "4"}) if how == "env" else \
        (("precompute", "SHARDCACHE_FAKE_GPUS=4"), {})
    line = _line(_make_dry_run(*args, **env), "precompute")
    assert "-m torch.distributed.run --standalone --nproc_per_node=4 -m shardcache precompute --manifest" in line


def test_make_precompute_without_gpus_runs_one_process():
    out = _make_dry_run("precompute", "train", SHARDCACHE_FAKE_GPUS="0")
    line = _line(out, "precompute")
    assert "torch.distributed.run" not in line and "nproc" not in line
    assert line.split() == [".venv/bin/python", "-m", "shardcache", "precompute", "--manifest",
                            "data/demo/samples.jsonl", "--cache", "cache/demo", "--config", "configs/precompute.yaml"]
    # train keeps its rule: 2 CPU processes without GPUs
    assert "--nproc_per_node=2 " in _line(out, "train")


def test_make_counts_gpus_for_train_too_and_overrides_win():
    out = _make_dry_run("precompute", "train", SHARDCACHE_FAKE_GPUS="4")
    assert "--nproc_per_node=4 " in _line(out, "train")
    out = _make_dry_run("precompute", "train", "PRECOMPUTE_NPROC=3", "NPROC=5", SHARDCACHE_FAKE_GPUS="0")
    assert "--nproc_per_node=3 -m shardcache precompute" in _line(out, "precompute")
    assert "--nproc_per_node=5 " in _line(out, "train")


def test_make_precompute_train_demo_commands_on_this_machine():
    """The README's `make precompute train`, with the GPU count torch reports here."""
    import torch
    n = torch.cuda.device_count()
    out = _make_dry_run("precompute", "train")
    pre, train = _line(out, "precompute"), _line(out, "train")
    assert ("--nproc_per_node=%d -m shardcache precompute" % n in pre) if n > 1 else \
        pre.startswith(".venv/bin/python -m shardcache precompute --manifest data/demo/samples.jsonl --cache cache/demo")
    assert f"--nproc_per_node={n or 2} " in train and "--config configs/train-demo.yaml" in train
    # first the one-process check of the same options (a bad one is one line, not one per rank + torchrun's)
    lines = out.splitlines()
    dry = [i for i, ln in enumerate(lines) if "-m shardcache train " in ln and ln.rstrip().endswith("--dry_run")]
    assert len(dry) == 1 and lines.index(train) == dry[0] + 1, out
    args = train.split("-m shardcache train", 1)[1].split()
    assert lines[dry[0]].split() == [".venv/bin/python", "-m", "shardcache", "train", *args, "--dry_run"]


def test_make_precompute_does_not_rerun_a_job_whose_inputs_are_unchanged(tmp_path):
    """The precompute target's stamp (build/stamps, keyed by OUT, DATA and CONFIG): after a run into OUT, `make
    precompute` says OUT is up to date until the manifest, the config or the models change, or OUT loses its
    integrity root; FORCE=1 runs it anyway."""
    import shutil
    if MAKE is None:
        pytest.skip("make is not installed")
    data, config, out = tmp_path / "m.jsonl", tmp_path / "c.yaml", tmp_path / "cache"
    data.write_text("{}\n")
    config.write_text("{}\n")
    args = [f"OUT={out}", f"DATA={data}", f"CONFIG={config}"]
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR") if k in os.environ}

    def commands(*extra: str) -> list[str]:
        r = subprocess.run([MAKE, "-n", "precompute", *args, *extra], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return [ln for ln in r.stdout.splitlines() if "-m shardcache precompute " in ln]

    stamp = ROOT / "build" / "stamps"
    before = set(stamp.glob("*")) if stamp.exists() else set()
    assert len(commands()) == 1                           # never run into OUT: it runs
    key = subprocess.run(["sh", "-c", f"printf '%s' '{out}|{data}|{config}' | cksum"], capture_output=True,
                         text=True).stdout.split()[0]
    path = ROOT / "build" / "stamps" / f"precompute-{key}"  # the stamp the Makefile names for these inputs
    try:
        out.mkdir()
        (out / "integrity.json").write_text("{}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()                                      # as the recipe leaves it after a run
        assert commands() == []                           # nothing changed: the job is not run
        assert len(commands("FORCE=1")) == 1
        os.utime(data, (path.stat().st_mtime + 5,) * 2)   # the manifest edited since
        assert len(commands()) == 1
        path.touch()
        os.utime(path, (data.stat().st_mtime + 5,) * 2)
        assert commands() == []
        (out / "integrity.json").unlink()                 # OUT holds no finished cache
        assert len(commands()) == 1
    finally:
        path.unlink(missing_ok=True)
        if not before and stamp.exists() and not any(stamp.iterdir()):
            shutil.rmtree(stamp)


# ---- SLURM scripts ----------------------------------------------------------------------------

@needs_bash
@pytest.mark.parametrize("script", ["precompute.sbatch", "train.sbatch"])
def test_sbatch_scripts_parse(script):
    r = subprocess.run([BASH, "-n", str(SLURM / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


@pytest.fixture
def fake_slurm(tmp_path):
    """A submit dir with a stand-in .venv, and stub srun / scontrol / python on PATH.

    srun starts its command once per node (in parallel, SLURM_NODEID/SLURM_PROCID/SLURMD_NODENAME
    set) and exits with the first non-zero status; python records argv and environment per call;
    with STUB_WAIT_STOP set it marks itself started, waits for $OUT/STOP, writes $OUT/REQUEUE on node 0
    and exits 1 (what torchrun reports when the trainer stops for a requeue)."""
    bin_, rec, submit = tmp_path / "bin", tmp_path / "rec", tmp_path / "submit"
    for d in (bin_, rec, submit / ".venv" / "bin"):
        d.mkdir(parents=True)
    (submit / ".venv" / "bin" / "activate").write_text(
        f'export VIRTUAL_ENV="{submit}/.venv"\nexport STUB_VENV_ACTIVE=1\n')
    _stub(bin_ / "srun", f"""
printf '%s\\0' "$@" > "{rec}/srun.argv"
while [ $# -gt 0 ] && [ "${{1#--}}" != "$1" ]; do shift; done   # srun's own options
node=0; pids=()
for host in {' '.join(HOSTS)}; do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURMD_NODENAME=$host "$@" &
    pids+=($!); node=$((node + 1))
done
rc=0
for p in "${{pids[@]}}"; do wait "$p" || {{ s=$?; [ "$rc" -ne 0 ] || rc=$s; }}; done
exit $rc
""")
    _stub(bin_ / "scontrol", f"""
printf '%s\\0' "$@" >> "{rec}/scontrol.argv"; printf '\\n' >> "{rec}/scontrol.argv"
# one host at a time, like a slow scontrol: `scontrol ... | head -n 1` would die of SIGPIPE (141)
if [ "$1 $2" = "show hostnames" ]; then for h in {' '.join(HOSTS)}; do echo "$h"; sleep 0.05; done; fi
""")
    _stub(bin_ / "python", f"""
f="{rec}/python.${{SLURM_PROCID:-batch}}"
printf '%s\\0' "$@" > "$f.argv"; env > "$f.env"; pwd > "$f.cwd"
if [ -n "${{STUB_WAIT_STOP:-}}" ]; then
    touch "$f.started"
    for _ in $(seq 600); do [ -e "$OUT/STOP" ] && break; sleep 0.1; done
    [ "${{SLURM_PROCID:-0}}" != 0 ] || echo '{{"step": 7}}' > "$OUT/REQUEUE"
    exit 1
fi
exit "${{STUB_RC:-0}}"
""")
    env = {
        "PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "sc-test", "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-a07,gpu-b12", "SLURM_GPUS_ON_NODE": "8",
        "SLURM_CPUS_PER_TASK": "64", "SLURM_SUBMIT_DIR": str(submit),
    }
    return {"rec": rec, "submit": submit, "env": env}


def _argv(path: Path) -> list[str]:
    return path.read_bytes().decode().split("\0")[:-1]


def _env(path: Path) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in path.read_text().splitlines() if "=" in ln)


def _torchrun_args(argv: list[str]):
    """The recorded `python -m torch.distributed.run ...` parsed by torchrun's own parser."""
    from torch.distributed.run import get_args_parser
    assert argv[:2] == ["-m", "torch.distributed.run"], argv
    return get_args_parser().parse_args(argv[2:])


def _check_nodes(fs, module: str, script_args: list[str]) -> None:
    rec = fs["rec"]
    for node in (0, 1):
        a = _torchrun_args(_argv(rec / f"python.{node}.argv"))
        assert (a.nnodes, a.nproc_per_node) == ("2", "8")
        assert (a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id) == ("c10d", f"{HOSTS[0]}:{a.rdzv_endpoint.split(':')[1]}",
                                                                "4242")
        assert a.rdzv_endpoint.split(":")[1].isdigit() and not a.standalone
        assert a.module and a.training_script == "shardcache" and a.training_script_args == [module, *script_args]
        env = _env(rec / f"python.{node}.env")
        for k, v in RECOMMENDED_ENV.items():
            assert env.get(k) == v, (k, env.get(k))
        assert env.get("STUB_VENV_ACTIVE") == "1"  # the submit dir's .venv was activated
        assert (rec / f"python.{node}.cwd").read_text().strip() == str(fs["submit"])
    srun = _argv(rec / "srun.argv")
    assert "--ntasks-per-node=1" in srun and "--nodes=2" in srun and "--cpus-per-task=64" in srun
    assert (fs["submit"] / "logs" / "sc-test-4242").is_dir()


@needs_bash
def test_precompute_sbatch_under_fake_slurm(fake_slurm):
    fs = fake_slurm
    r = subprocess.run([BASH, str(SLURM / "precompute.sbatch"), "/data/train.json", "/data/cache",
                        "configs/my.yaml", "--encoder_batch_size=32"],
                       env=fs["env"], cwd=fs["submit"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # 64 CPUs / 8 GPUs = 8 per rank, minus one for the rank's main process
    _check_nodes(fs, "precompute", ["--manifest", "/data/train.json", "--cache", "/data/cache", "--config",
                                    "configs/my.yaml", "--num_workers", "7", "--encoder_batch_size=32"])
    # the summary at the end, on the batch node
    assert _argv(fs["rec"] / "python.batch.argv") == ["-m", "shardcache", "shards", "info", "/data/cache"]
    for k, v in RECOMMENDED_ENV.items():
        assert f"  {k}={v}\n" in r.stdout  # echoed to the job log
    assert f"  HEAD_NODE={HOSTS[0]}\n" in r.stdout


@needs_bash
def test_precompute_sbatch_default_config_and_failure(fake_slurm):
    fs = fake_slurm
    r = subprocess.run([BASH, str(SLURM / "precompute.sbatch"), "m.jsonl", "out", "--encoder_batch_size", "4"],
                       env=fs["env"] | {"STUB_RC": "1"}, cwd=fs["submit"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0
    a = _torchrun_args(_argv(fs["rec"] / "python.0.argv"))
    assert a.training_script_args == ["precompute", "--manifest", "m.jsonl", "--cache", "out", "--config",
                                      "configs/precompute.yaml", "--num_workers", "7", "--encoder_batch_size", "4"]
    assert not (fs["rec"] / "python.batch.argv").exists()  # no summary after a failed srun


@needs_bash
def test_train_sbatch_under_fake_slurm(fake_slurm):
    fs = fake_slurm
    out = fs["submit"] / "runs" / "exp1"
    r = subprocess.run([BASH, str(SLURM / "train.sbatch"), "--cache", "/data/cache", "--training.steps", "100"],
                       env=fs["env"] | {"OUT": str(out)}, cwd=fs["submit"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    _check_nodes(fs, "train", ["--config", "configs/train.yaml", "--job.dir", str(out), "--checkpoint.resume", "auto",
                               "--job.stop_file", str(out / "STOP"), "--job.requeue_exit_code", "3",
                               "--metrics.progress=false", "--cache", "/data/cache", "--training.steps", "100"])
    for k, v in RECOMMENDED_ENV.items():
        assert f"  {k}={v}\n" in r.stdout
    assert not (fs["rec"] / "scontrol.argv").read_text().count("requeue")
    # the flags the script passes are understood by the trainer's own parser
    from train.cli import parse_args
    args = _torchrun_args(_argv(fs["rec"] / "python.0.argv")).training_script_args[1:]
    args[args.index("--config") + 1] = str(ROOT / "configs" / "train.yaml")
    cfg, _ = parse_args(args)
    assert (cfg.job.dir, cfg.checkpoint.resume, cfg.job.stop_file) == (str(out), "auto", str(out / "STOP"))
    assert cfg.metrics.progress is False and cfg.training.steps == 100 and cfg.data.cache == "/data/cache"


@needs_bash
def test_train_sbatch_requeues_after_sigusr1(fake_slurm):
    """SIGUSR1 to the batch shell -> STOP file -> the trainer stops (REQUEUE marker, torchrun exit 1)
    -> `scontrol requeue JOBID` and exit 0."""
    fs = fake_slurm
    out = fs["submit"] / "runs" / "exp1"
    p = subprocess.Popen([BASH, str(SLURM / "train.sbatch")], env=fs["env"] | {"OUT": str(out), "STUB_WAIT_STOP": "1"},
                         cwd=fs["submit"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not all((fs["rec"] / f"python.{n}.started").exists() for n in (0, 1)):
            assert time.monotonic() < deadline and p.poll() is None, "the stub trainers did not start"
            time.sleep(0.05)
        p.send_signal(signal.SIGUSR1)
        stdout, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, stdout
    assert "SIGUSR1" in stdout and (out / "STOP").exists() and not (out / "REQUEUE").exists()
    calls = [c.split("\0")[:-1] for c in (fs["rec"] / "scontrol.argv").read_text().split("\n") if c]
    assert ["requeue", "4242"] in calls, calls
