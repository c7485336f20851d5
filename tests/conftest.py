"""Shared fixtures: tiny random models of the real architectures, and the demo cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
REAL_MINI = Path(os.environ.get("SHARDCACHE_REAL_MINI", ROOT.parent / "shared" / "data" / "real-mini"))

# one thread per process keeps the 2-core CI machine responsive under DataLoader workers
os.environ.setdefault("OMP_NUM_THREADS", "1")
# nothing contacts the hub: a hub id is read from the hub cache only (the tests' own, tools/testing/hub_cache.py),
# never retried against the network (before huggingface_hub is imported: it reads the variable once)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Where the real torchaudio cannot load (no build for the CPU torch here), the tests' stand-in
# (tools/shims/torchaudio, soxr) lets transformers import the Higgs audio tokenizer, in this process
# and in subprocesses (PYTHONPATH); installed before any test imports transformers.
from tools.torchaudio_shim import install as install_torchaudio_shim  # noqa: E402

install_torchaudio_shim()


@pytest.fixture(scope="session", autouse=True)
def _index_stores(tmp_path_factory):
    """The index stores of the caches the tests open (shards.columns) under the run's own folder, not
    ~/.cache (the tests' subprocesses inherit it), unless the caller chose a folder."""
    if not os.environ.get("SHARDCACHE_INDEX_CACHE"):
        os.environ["SHARDCACHE_INDEX_CACHE"] = str(tmp_path_factory.getbasetemp() / "index-stores")
    yield


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """In-process training/encoding sets torch's thread count (e.g. --threads 1); restore it after each test."""
    import torch
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _restore_train_logger():
    """An in-process training run configures the ``train`` logger (its own handler, no propagation);
    give each test the logger as Python made it (no handler, level unset, propagating), so its ``caplog``
    sees the records whatever a module's fixture ran before it (a training run in a fixture configures it
    too), and leave it so."""
    import logging
    log = logging.getLogger("train")
    pristine = ([], logging.NOTSET, True)
    log.handlers[:], log.level, log.propagate = pristine
    yield
    log.handlers[:], log.level, log.propagate = pristine


def _built_once(tmp_path_factory, name: str, only: str) -> Path:
    """``python -m tools.testing --only ONLY`` into a folder every pytest-xdist worker of this run shares:
    the first worker to get here builds it (under a file lock), the others wait and reuse it. The
    models are read-only to the tests (each writes its caches elsewhere)."""
    from filelock import FileLock
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder under xdist
    out = shared / f"shared-{name}"
    with FileLock(str(out) + ".lock"):
        if not (out / ".built").exists():
            subprocess.run([sys.executable, "-m", "tools.testing", "--out", str(out), "--only", only],
                           check=True, cwd=ROOT, capture_output=True)
            (out / ".built").write_text("")
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """The tiny random test models (dac, wan, mimi, tokenizer, lm), built once per run by
    ``python -m tools.testing`` (shared by the xdist workers)."""
    return _built_once(tmp_path_factory, "models", "dac,wan,mimi,tokenizer,lm")


@pytest.fixture(scope="session")
def higgs_models(tmp_path_factory) -> Path:
    """The tiny random Higgs-Audio v2 models (``higgs-tiny``: model + text tokenizer;
    ``higgs-audio-tokenizer-tiny``), built once per run by ``python -m tools.testing`` (shared by the
    xdist workers). The in-process tests that run the audio tokenizer need :func:`higgs_codec` too."""
    return _built_once(tmp_path_factory, "higgs-models", "higgs,higgs-audio-tokenizer")


@pytest.fixture(scope="session")
def higgs_codec(higgs_models) -> Path:
    """``higgs_models``, with ``import torchaudio`` working in this process for the tiny Higgs audio
    tokenizer (the tests' stand-in where the real torchaudio cannot load: tools.torchaudio_shim)."""
    return higgs_models


BOSON_VENV = Path(os.environ.get("SHARDCACHE_BOSON_VENV", ROOT / "build" / "boson-venv"))


@pytest.fixture(scope="session")
def boson_python() -> str:
    """The python of the boson-multimodal 0.1.1 venv (Boson's own code, transformers 4.46: it cannot be
    imported beside transformers 5): ``$SHARDCACHE_BOSON_VENV`` or ``build/boson-venv``, built on first
    use only with ``SHARDCACHE_BUILD_BOSON`` (``make test-long``); the test skips, saying why, otherwise."""
    py = BOSON_VENV / "bin" / "python"
    if not (BOSON_VENV / ".installed").exists():
        if not os.environ.get("SHARDCACHE_BUILD_BOSON"):  # minutes of installs: `make test-long` does it
            pytest.skip(f"{BOSON_VENV} not built: `make test-long` (or `make boson-venv`) builds it and runs "
                        "this test")
        try:
            r = subprocess.run(["make", "-s", "boson-venv", f"PYTHON={sys.executable}", f"BOSON_VENV={BOSON_VENV}"],
                               cwd=ROOT, capture_output=True, text=True, timeout=1500)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(f"could not build {BOSON_VENV} (make boson-venv): {e}")
        if r.returncode != 0:
            pytest.skip(f"could not build {BOSON_VENV} (make boson-venv): {(r.stdout + r.stderr)[-800:]}")
    return str(py)


#: Higgs-Audio ChatML manifests -> samples used (the first N)
HIGGS_MANIFESTS = {"voice_clone": ("chatml_voice_clone.json", 6), "understanding": ("chatml_audio_understanding.json", 5),
             "train": ("train_chatml_samples.json", 8)}


def _absolute(rec: dict, base: Path) -> dict:
    rec = json.loads(json.dumps(rec))
    for m in rec["messages"]:
        items = m["content"] if isinstance(m["content"], list) else [m["content"]]
        for it in items:
            if isinstance(it, dict):
                for k in ("audio_url", "image_url"):
                    if isinstance(it.get(k), str):
                        it[k] = str(base / it[k])
    return rec


@pytest.fixture(scope="session")
def higgs_caches(real_mini, higgs_codec, tmp_path_factory) -> dict:
    """The first samples of each real-mini ChatML manifest (:data:`HIGGS_MANIFESTS`) precomputed with
    configs/precompute-tts.yaml and the tiny Higgs models: ``{name: (cache dir, {key: ChatML record})}``;
    the records (paths made absolute) are in ``<cache>.json`` beside each cache."""
    from precompute.config import load_config
    from precompute.job import run

    out = tmp_path_factory.mktemp("higgs-caches")
    cfg = load_config(ROOT / "configs" / "precompute-tts.yaml", [
        f"audio_tokenizer.pretrained={higgs_codec / 'higgs-audio-tokenizer-tiny'}",
        f"text_tokenizer.pretrained={higgs_codec / 'higgs-tiny'}", "device=cpu", "num_workers=0",
        "allow_outside_root=true"])
    got = {}
    for name, (file, n) in HIGGS_MANIFESTS.items():
        recs = [_absolute(r, real_mini) for r in json.loads((real_mini / file).read_text())[:n]]
        manifest = out / f"{name}.json"
        manifest.write_text(json.dumps(recs))
        summary, _ = run(manifest, out / name, cfg, progress=False)
        assert summary.kept >= 4
        got[name] = (out / name, {r["misc"]["key"]: r for r in recs})
    return got


@pytest.fixture(scope="session")
def tiny_config(tiny_models):
    """A PrecomputeConfig pointing at the tiny models, small images and shards for fast tests
    (``allow_outside_root``: test manifests in tmp folders name the repo's demo files)."""
    from precompute.config import load_config
    return load_config(ROOT / "configs" / "precompute.yaml", [
        f"audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}",
        f"image_encoder.pretrained={tiny_models / 'wan-tiny'}",
        "image_size=64", "samples_per_shard=8", "num_workers=0", "device=cpu", "allow_outside_root=true"])


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory, tiny_config) -> Path:
    """The bundled demo manifest precomputed once per test session."""
    from precompute.job import run
    out = tmp_path_factory.mktemp("cache") / "demo"
    run(DEMO / "samples.jsonl", out, tiny_config, progress=False)
    return out


@pytest.fixture(scope="session")
def real_mini() -> Path:
    if not (REAL_MINI / "samples_with_corrupt.jsonl").exists():
        pytest.skip(f"real-mini corpus not found at {REAL_MINI}")
    return REAL_MINI


# hypothesis (tests/test_hostile_rows.py): a bounded number of examples in CI, many in `make test-long`
try:
    from hypothesis import settings as _hsettings
except ImportError:  # the property tests skip themselves
    pass
else:
    _hsettings.register_profile("ci", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 20)),
                                deadline=None, database=None, derandomize=True, print_blob=True)
    _hsettings.register_profile("long", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 400)),
                                deadline=None, print_blob=True)
    _hsettings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
