"""Helpers for the train tests (no tests here): a tiny cache in the real format, a plug-in loader, launchers.

The cache is written with the real format code (``shards.ShardWriter`` + ``shards.merge_parts``) and
read by the real ``loaders.ShardLoader`` in the loop tests, so their batches have the real contract:
``input_ids``/``labels``/``attention_mask``, ``codes`` padded with -100 and ``codes_mask``, compact
int16 ``audio`` and float16 ``latents`` of two sizes (zero-padded per batch, ``latents_mask``).
:class:`FakeLoader` is a ``--data.loader module:class`` plug-in with the ShardLoader API (its own
order; batches from the real ``loaders.collate_fn``). :class:`SlowLoader` wraps ShardLoader and
sleeps per batch (stop-request tests).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
PY = sys.executable
N_CODEBOOKS, CODEBOOK_SIZE, VOCAB = 8, 1024, 259
TINY_MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "mlp_ratio": 2, "patch_size": 2}
REAL_LOADER = "loaders:ShardLoader"


def make_cache(out: Path, n: int = 24, n_shards: int = 2, seed: int = 0, image_every: int = 3) -> Path:
    """A cache of ``n`` samples in ``n_shards`` shards, in the format stage one writes: input_ids and
    labels int32 (labels -100 on the first half), codes int16 (8, F), audio int16, and on every
    ``image_every``-th sample latents float16 (16, 1, H, W) with (H, W) alternating (4, 4) and (6, 4)."""
    from shards import ShardWriter, merge_parts, shard_name

    rng = np.random.default_rng(seed)
    per = -(-n // n_shards)
    i = 0
    for s in range(n_shards):
        w = ShardWriter(out, shard_name(0, s))
        for _ in range(min(per, n - i)):
            frames = int(rng.integers(4, 16))
            sr = 24000
            n_audio = frames * 960
            ids = rng.integers(3, VOCAB, size=int(rng.integers(2, 10))).astype(np.int32)
            labels = ids.copy()
            labels[: len(ids) // 2] = -100
            fields = {
                "json": {"text": f"sample {i}", "speaker": f"spk{i % 3}", "sample_rate": sr,
                         "duration_s": n_audio / sr},
                "codes.npy": rng.integers(0, CODEBOOK_SIZE, size=(N_CODEBOOKS, frames)).astype(np.int16),
                "input_ids.npy": ids, "labels.npy": labels,
                "audio.npy": rng.integers(-3000, 3000, size=n_audio).astype(np.int16),
            }
            if image_every and i % image_every == 0:
                h = 4 if (i // image_every) % 2 == 0 else 6
                fields["latents.npy"] = rng.normal(size=(16, 1, h, 4)).astype(np.float16)
            w.add(f"s{i:04d}", fields)
            i += 1
        w.commit()
    merge_parts(out, {"encoders": {"audio": {"n_codebooks": N_CODEBOOKS, "codebook_size": CODEBOOK_SIZE},
                                   "text": {"vocab_size": VOCAB}},
                      "text": {"vocab_size": VOCAB, "pad_id": 0},
                      "n_codebooks": N_CODEBOOKS, "codebook_size": CODEBOOK_SIZE,
                      "text_vocab_size": VOCAB, "latent_channels": 16})
    return out


def cache_with_manifest(out: Path, manifest: dict, n: int = 2, Q: int = 2, vocab: int = 16,
                        latents: bool = False, image_features: bool = False) -> Path:
    """A small cache of ``n`` samples (codes int16 (Q, 3), input_ids/labels/audio_segments, latents and
    image_features when asked) whose ``manifest.json`` holds ``manifest`` (the keys stage one writes):
    for tests of what a cache declares (its codec, tokenizer, image preset, special token ids)."""
    from shards import ShardWriter, merge_parts, shard_name

    rng = np.random.default_rng(0)
    w = ShardWriter(out, shard_name(0, 0))
    for i in range(n):
        ids = rng.integers(0, vocab, size=6).astype(np.int32)
        fields = {"json": {"text": f"s{i}", "sample_rate": 24000, "duration_s": 0.12},
                  "codes.npy": rng.integers(0, 4, size=(Q, 3)).astype(np.int16),
                  "input_ids.npy": ids, "labels.npy": ids.copy(),
                  "audio_segments.npy": np.array([[0, 0, 1, 0, 3, -1]], dtype=np.int32)}
        if latents:
            fields["latents.npy"] = rng.normal(size=(4, 1, 2, 2)).astype(np.float16)
        if image_features:
            fields["image_features.npy"] = rng.integers(-100, 100, size=(1, 2, 4)).astype(np.int16)
        w.add(f"k{i:03d}", fields)
    w.commit()
    merge_parts(out, dict(manifest))
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The 24-sample training cache of :func:`make_cache`, built once per test module that imports it."""
    return make_cache(tmp_path_factory.mktemp("cache") / "c", n=24)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    """No torchrun variables inherited from the environment (the run is one process); one intra-op
    thread in the subprocesses a test starts."""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def collate(samples: list[dict], fields=None, compact: bool = False) -> dict[str, Any]:
    """The real collate (``loaders.collate_fn``) of ``shards.ShardReader.get`` samples."""
    from loaders import collate_fn
    return collate_fn(samples, fields, compact=compact)


class FakeLoader:
    """A plug-in loader with the ``loaders.ShardLoader`` API over ``shards.ShardReader``: a
    permutation of ``(seed, epoch)``; global step ``s`` takes samples ``[s*G, (s+1)*G)`` with
    ``G = world x batch``; rank ``r`` takes every ``world``-th of them; state ``(epoch, cursor)``."""

    def __init__(self, cache, batch_size, *, seed=0, fields=None, filters=None, ranks=None, order=None,
                 workers=None, reads=None, transform=None):
        import pyarrow as pa

        from shardcache.ranks import Ranks
        from shards import Cache, ShardReader
        from shards.filters import filter_rows

        cache = Cache.open(cache)
        ranks = ranks or Ranks.detect()
        index = cache.index if filters is None else cache.index.take(pa.array(filter_rows(cache.index, filters)))
        self.reader = ShardReader(cache.dir, index=index)
        self.batch_size, self.rank, self.world, self.seed = batch_size, ranks.global_rank, ranks.world_size, seed
        self.fields = tuple(fields or ("codes", "input_ids", "labels", "latents"))
        self.G = batch_size * self.world
        self.epoch, self.cursor = 0, 0

    def __len__(self) -> int:
        return len(self.reader) // self.G

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.cursor = int(epoch), 0

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.reader))
        end = len(self) * self.G
        while self.cursor + self.G <= end:
            ids = order[self.cursor:self.cursor + self.G][self.rank::self.world]
            self.cursor += self.G
            yield collate([self.reader.get(int(i)) for i in ids], self.fields)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "global_batch": self.G}

    def load_state_dict(self, sd: dict) -> None:
        assert sd["global_batch"] == self.G, "elastic resume needs the same global batch"
        self.epoch, self.cursor = int(sd["epoch"]), int(sd["cursor"])

    def close(self) -> None:
        self.reader.close()


class SlowLoader:
    """Wrap ``loaders:ShardLoader`` (the same arguments) and sleep :attr:`delay` s per batch."""

    delay = 0.25

    def __init__(self, cache_dir, batch_size, **kw):
        from loaders import ShardLoader
        self.inner = ShardLoader(cache_dir, batch_size, **kw)

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, e):
        self.inner.set_epoch(e)

    def __iter__(self):
        for b in self.inner:
            time.sleep(self.delay)
            yield b

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd):
        self.inner.load_state_dict(sd)

    def close(self):
        self.inner.close()


# ---- launching ranks -----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra or {})
    return env


#: the tests' short names of train options -> option path (test shorthand only: the product reads
#: nested sections and ``--section.option`` flags)
SHORT: dict[str, str] = {
    **{k: f"data.{k}" for k in ("cache", "val_cache", "val_fraction", "fields", "batch_size", "num_workers",
                                "loader", "loader_kwargs", "compact_batches", "seed")},
    "model": "model.name", "model_kwargs": "model.kwargs",
    **{k: f"model.{k}" for k in ("audio_tokenizer", "latent_loss", "latent_loss_weight", "init_from",
                                 "activation_checkpointing", "compile")},
    "lora": "lora.enabled", "lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "lora_targets": "lora.targets",
    **{k: f"optim.{k}" for k in ("lr", "weight_decay", "beta1", "beta2", "eps", "fused", "grad_clip",
                                 "grad_norm_warn")},
    "schedule": "schedule.name", "warmup_steps": "schedule.warmup_steps", "min_lr_ratio": "schedule.min_lr_ratio",
    **{k: f"training.{k}" for k in ("steps", "epochs", "grad_accum", "precision", "nonfinite_limit")},
    **{k: f"dist.{k}" for k in ("device", "backend", "pg_timeout_min", "bucket_cap_mb", "find_unused_parameters",
                                "threads")},
    "ckpt_every": "checkpoint.every", "keep": "checkpoint.keep", "resume": "checkpoint.resume",
    "out": "job.dir", "stop_file": "job.stop_file", "stop_at_step": "job.stop_at_step",
    "requeue_exit_code": "job.requeue_exit_code",
    "validation": "eval.enabled", "eval_every": "eval.every", "eval_batches": "eval.batches",
    "eval_batch_size": "eval.batch_size",
    "log_every": "metrics.every", "tensorboard": "metrics.tensorboard", "progress": "metrics.progress",
    "throughput_warn": "metrics.throughput_warn",
    "profile": "profile.enabled", "profile_wait": "profile.wait", "profile_warmup": "profile.warmup",
    "profile_active": "profile.active",
}


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"lr": 1e-3, "data.seed": 1, "optim": {...}}`` -> nested sections (short names of :data:`SHORT`,
    dotted option paths or sections)."""
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if isinstance(v, dict) and "." not in k and not k.endswith("kwargs"):  # a section
            out.setdefault(k, {}).update(v)
        else:
            sec, name = (SHORT.get(k) or k).split(".")
            out.setdefault(sec, {})[name] = v
    return out


def from_dict(flat: dict[str, Any]):
    """A validated config from the tests' short names (see :func:`nest`)."""
    return config_from_dict(nest(flat))


def config_from_dict(data: dict[str, Any]):
    """A nested mapping (as a config file holds) -> a validated ``TrainConfig``."""
    from shardcache import config as S
    from train.config import TrainConfig, check_config
    text = json.dumps(data, default=str)  # JSON is YAML: read as a config file is
    return S.parse(S.parser(TrainConfig, "test"), TrainConfig, ["--config", text], "", check=check_config)[0]


def flags(argv: list[str]) -> list[str]:
    """Command-line flags with the tests' short names (``--batch_size 4``, ``--no_progress``) as options
    (``--no_X``: ``--OPTION=false``)."""
    out = []
    for a in argv:
        name, eq, val = a.partition("=")
        key = name[2:] if name.startswith("--") else ""
        neg = key.startswith("no_") and key[3:] in SHORT
        if neg:
            a = "--" + SHORT[key[3:]] + "=false"
        elif key in SHORT:
            a = "--" + SHORT[key] + eq + val
        out.append(a)
    return out


def train_args(cache: Path, out: Path, **opts) -> list[str]:
    """CLI flags for a tiny CPU run; ``opts`` override (``foo_bar=1`` -> ``--foo_bar 1``, short names of :data:`SHORT`)."""
    base = dict(cache=str(cache), out=str(out), config="none", model_kwargs=json.dumps(TINY_MODEL),
                batch_size=4, steps=4, warmup_steps=2, lr=1e-3, ckpt_every=1000, keep=3,
                no_progress=True, threads=1)
    base.update(opts)
    args = []
    for k, v in base.items():
        flag = "--" + k
        if v is True:
            args.append(flag)
        elif v is not False and v is not None:
            args += [flag, str(v)]
    return flags(args)


def launch(nprocs: int, args: list[str], cwd: Path, env: dict | None = None,
           script: list[str] | None = None) -> list[subprocess.Popen]:
    """Start ``python -m shardcache train ARGS`` (or ``python SCRIPT... ARGS``) once per rank with the torchrun
    environment variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and no launcher
    process in between, so that what a test observes is the trainer's own behaviour."""
    port = free_port()
    procs = []
    for r in range(nprocs):
        e = base_env(env)
        e.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if nprocs == 1:
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                e.pop(k, None)
        procs.append(subprocess.Popen([PY, *(script or ["-m", "shardcache", "train"]), *flags(args)], cwd=cwd, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int | None], list[str]]:
    """Wait up to ``timeout`` s for every process; kill stragglers (their code is None)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    outs: list[str] = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            codes.append(None)
        outs.append(out)
    return codes, outs


def read_metrics(out: Path, split: str = "train") -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if r.get("split", "train") == split]


def load_params(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(ckpt_dir / "model.safetensors"))


# ---- plug-in models (for --model test_train_support:...) -------------------------------------------

class MeanCodesModel(torch.nn.Module):
    """A minimal plug-in: predicts every codebook's codes from a bias; returns a bare loss tensor."""

    def __init__(self, n_codebooks: int = 8, codebook_size: int = 1024, nan_at_calls: tuple = ()):
        super().__init__()
        self.n_codebooks = n_codebooks
        self.logits = torch.nn.Parameter(torch.zeros(n_codebooks, codebook_size))
        self.nan_at_calls, self.calls = set(nan_at_calls), 0

    def forward(self, batch):
        self.calls += 1
        codes = batch["codes"]
        B, Q, F = codes.shape
        logits = self.logits[None, :, None, :].expand(B, Q, F, -1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), codes.reshape(-1),
                                                 ignore_index=-100)
        if self.calls in self.nan_at_calls:
            loss = loss * float("nan")
        return loss


def make_mean_codes(n_codebooks: int = N_CODEBOOKS, codebook_size: int = CODEBOOK_SIZE, nan_at_calls: tuple = ()):
    """A plain ``module:factory`` plug-in: called with ``--model.kwargs`` only (the test cache's sizes by default)."""
    return MeanCodesModel(n_codebooks, codebook_size, tuple(nan_at_calls))


# ---- what a run logs and writes ----------------------------------------------------------------------

class Captured(logging.Handler):
    """Messages of the ``train`` logger while in a ``with`` block (the logger does not propagate:
    caplog would not see them)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        lg = logging.getLogger("train")
        self.level = lg.level
        lg.addHandler(self)
        lg.setLevel(logging.INFO)  # (train's setup_logging leaves a logger with handlers alone)
        return self

    def __exit__(self, *exc):
        lg = logging.getLogger("train")
        lg.removeHandler(self)
        lg.setLevel(self.level)

    @property
    def text(self) -> str:
        return "\n".join(self.messages)


def write_audit(root: str, writes: list[str]):
    """An audit hook (``sys.addaudithook``) appending ``"EVENT PATH"`` to ``writes`` for every file
    write, rename, removal or mkdir this process makes under the real path ``root``."""
    def hook(event, args):
        path = None
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1], args[2] if len(args) > 2 else 0
            if (mode and any(c in mode for c in "wax+")) or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                path = args[0]
        elif event in ("os.rename", "os.replace", "os.remove", "os.unlink", "os.mkdir", "os.rmdir",
                       "shutil.rmtree", "os.truncate", "shutil.move") and args:
            path = args[0]
        if path is not None and not isinstance(path, int):
            p = os.fsdecode(path)
            if os.path.realpath(p).startswith(root):
                writes.append(f"{event} {p}")
    return hook
