"""Stage one as a job: real-mini corpus, resume after SIGKILL, incremental runs, 2 ranks, fingerprints."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shards import read_index, read_rejects
from shards.errors import FingerprintMismatch

from conftest import DEMO, ROOT

pytestmark = pytest.mark.xdist_group("precompute_jobs")  # one worker builds the module's fixtures


REASON_OF = {  # expected_rejects.json wording -> our reason codes
    "image too large": "image_too_large", "zero-byte file": "unreadable_audio", "not an image": "image_unreadable",
    "non-finite": "non_finite", "no audio frames": "zero_frames", "not audio": "unreadable_audio",
    "longer than": "too_long", "truncated image": "image_truncated", "header cut short": "unreadable_audio",
    "zero-byte image": "image_unreadable", "missing file": "missing_file", "duplicate key": "duplicate_key",
    "empty text": "empty_text",
}


def _cli_args(tiny_models: Path, *extra: str) -> list[str]:
    return ["--config", str(ROOT / "configs" / "precompute.yaml"),
            f"--audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}",
            f"--image_encoder.pretrained={tiny_models / 'wan-tiny'}",
            "--image_size=64", "--device=cpu", "--no_progress", *extra]


def _samples(cache: Path) -> dict[str, str]:
    return {r["key"]: r["sha256"] for r in read_index(cache).select(["key", "sha256"]).to_pylist()}


def test_real_mini_keeps_exactly_the_good_samples(real_mini, tiny_config, tmp_path):
    import dataclasses
    from precompute.job import run
    cfg = dataclasses.replace(tiny_config, samples_per_shard=64)
    summary, manifest = run(real_mini / "samples_with_corrupt.jsonl", tmp_path / "c", cfg, progress=False)
    good = {json.loads(line)["key"] for line in (real_mini / "samples.jsonl").read_text().splitlines()}
    assert len(good) == 268
    keys = set(read_index(tmp_path / "c").column("key").to_pylist())
    assert keys == good
    rejects = read_rejects(tmp_path / "c").to_pylist()
    got = {(r["key"], r["reason"]) for r in rejects}
    for bad in json.loads((real_mini / "expected_rejects.json").read_text()):
        code = next(v for k, v in REASON_OF.items() if k in bad["reason"])
        assert (bad["key"], code) in got, bad
    assert sum(r["reason"] == "malformed_row" for r in rejects) == 1
    assert manifest["counts"]["samples"] == 268 and manifest["counts"]["images"] > 0


def test_fingerprint_mismatch_is_refused(tiny_config, tmp_path):
    import dataclasses
    from precompute.job import run
    run(DEMO / "samples.jsonl", tmp_path / "c", tiny_config, progress=False)
    with pytest.raises(FingerprintMismatch, match="image_size|preprocessing"):
        run(DEMO / "samples.jsonl", tmp_path / "c", dataclasses.replace(tiny_config, image_size=32), progress=False)


def test_store_posterior_writes_logvar_for_images_only(tiny_config, demo_cache, tmp_path, capsys):
    import dataclasses
    import shutil
    import numpy as np
    import torch
    from loaders import Order, ShardLoader
    from precompute.identity import preprocessing_of
    from precompute.job import run
    from shards import ShardReader
    from shards.cli import main
    cfg = dataclasses.replace(tiny_config, store_posterior=True)
    assert preprocessing_of(cfg) != preprocessing_of(tiny_config)
    _, manifest = run(DEMO / "samples.jsonl", tmp_path / "post", cfg, progress=False)
    rows = read_index(tmp_path / "post").to_pylist()
    assert len(rows) == len(_samples(demo_cache)) and sum(r["has_image"] for r in rows) >= 2
    for r in rows:
        members = {m["name"]: m for m in r["members"]}
        assert ("latents_logvar.npy" in members) == r["has_image"] == ("latents.npy" in members)
        if r["has_image"]:
            assert members["latents_logvar.npy"]["shape"] == members["latents.npy"]["shape"]
            assert members["latents_logvar.npy"]["dtype"] == "<f2"
    # the mean is what the plain run stores (Wan's mode is its mean)
    plain, post = ShardReader(demo_cache), ShardReader(tmp_path / "post")
    pos = {k: i for i, k in enumerate(plain.keys)}
    for i, k in enumerate(post.keys):
        a, b = post.get(i), plain.get(pos[k])
        assert ("latents" in a) == ("latents" in b)
        if "latents" in a:
            np.testing.assert_array_equal(a["latents"], b["latents"])
            assert np.isfinite(a["latents_logvar"]).all()
    fields = ("codes", "latents", "latents_logvar")
    n_img = sum(r["has_image"] for r in rows)
    batch = next(iter(ShardLoader(tmp_path / "post", n_img, fields=fields, filters={"has_image": True}, order=Order(shuffle=False))))
    assert batch["latents_logvar"].shape == batch["latents"].shape and batch["has_image"].all()
    j = {k: i for i, k in enumerate(post.keys)}[batch["keys"][0]]
    assert torch.equal(batch["latents_logvar"][0], torch.from_numpy(post.get(j)["latents_logvar"].astype(np.float32)))
    assert "latents_logvar" not in next(iter(ShardLoader(tmp_path / "post", 4, order=Order(shuffle=False))))
    # the CLI handles the new member generically
    assert main(["verify", str(tmp_path / "post"), "--deep"]) == 0
    key = next(r["key"] for r in rows if r["has_image"])
    capsys.readouterr()
    assert main(["show", str(tmp_path / "post"), key]) == 0
    assert "latents_logvar.npy" in capsys.readouterr().out
    # fingerprints differ: neither cache accepts the other setting
    old = Path(shutil.copytree(demo_cache, tmp_path / "old"))
    with pytest.raises(FingerprintMismatch, match="preprocessing"):
        run(DEMO / "samples.jsonl", old, cfg, progress=False)
    with pytest.raises(FingerprintMismatch, match="preprocessing"):
        run(DEMO / "samples.jsonl", tmp_path / "post", tiny_config, progress=False)
    assert _samples(old) == _samples(demo_cache)
    assert manifest["config"]["store_posterior"] is True


def test_incremental_rerun_encodes_only_new_rows(tiny_config, demo_cache, tmp_path):
    from precompute.job import run
    lines = (DEMO / "samples.jsonl").read_text().splitlines()
    part = tmp_path / "samples.jsonl"
    part.write_text("\n".join(lines[:12]) + "\n")
    first, _ = run(part, tmp_path / "c", tiny_config, root=DEMO, progress=False)
    part.write_text("\n".join(lines) + "\n")
    second, _ = run(part, tmp_path / "c", tiny_config, root=DEMO, progress=False)
    assert second.skipped_rows == 12 and first.kept + second.kept == len(_samples(demo_cache))
    assert _samples(tmp_path / "c") == _samples(demo_cache)


# The cache is a pure function of (manifest, config, weights): chunks of 6 rows with encoder batches
# of 4 split batches at chunk boundaries; the demo manifest has images (VAE batches) and bad rows.
DETERMINISM = ("--samples_per_shard=6", "--encoder_batch_size=4")


def _layout(cache: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(sample key -> sha256, shard name -> sha256): every byte that was written."""
    m = json.loads((cache / "manifest.json").read_text())
    return _samples(cache), {s["path"]: s["sha256"] for s in m["shards"]}


def _precompute_cmd(tiny_models, out, *extra, nproc: int = 0, restarts: int = 0):
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}"] if nproc else [sys.executable]
    return head + ["-m", "shardcache", "precompute", "--manifest", str(DEMO / "samples.jsonl"), "--cache", str(out),
                   *_cli_args(tiny_models, *DETERMINISM, "--num_workers=0", *extra)]


def _wait_for_parts(out: Path, n: int, proc, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "parts").glob("*.index.parquet"))) >= n:
            return
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "c"
    subprocess.run(_precompute_cmd(tiny_models, out), cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                   check=True, capture_output=True, timeout=300)
    names = sorted(p.name for p in out.glob("shard-*.tar"))
    assert names[0] == "shard-000000.tar" and len(names) >= 4  # named by chunk, not by rank
    return _layout(out)


@pytest.mark.long  # make test-long; test_cache_trust's kill -9 and immediate rerun covers a kill in make test
def test_killed_three_times_and_resumed_writes_the_same_bytes(tiny_models, reference, tmp_path):
    out = tmp_path / "killed"
    cmd = _precompute_cmd(tiny_models, out)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for kill in range(1, 4):
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_parts(out, kill, proc)
        time.sleep(0.05 * kill)  # land mid-chunk
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (out / "index.parquet").exists()  # killed before the end every time
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    assert _layout(out) == reference
    assert not list(out.glob("*.tmp")) and not list((out / "parts").glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_stage_one's slot rows equal in-process decoding in make test
def test_decode_workers_do_not_change_the_bytes(tiny_models, reference, tmp_path):
    subprocess.run(_precompute_cmd(tiny_models, tmp_path / "w", "--num_workers=2"), cwd=ROOT,
                   env=dict(os.environ, OMP_NUM_THREADS="1"), check=True, capture_output=True, timeout=300)
    assert _layout(tmp_path / "w") == reference


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.long  # make test-long; the demo's make precompute and test_stage_one's job tests cover the job in make test; tests/test_one_writer.py ranks under one lock
def test_two_ranks_equal_one_rank(tiny_models, reference, tmp_path):
    out = tmp_path / "two"
    subprocess.run(_precompute_cmd(tiny_models, out, nproc=2), cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                   check=True, capture_output=True, timeout=300)
    assert _layout(out) == reference


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.long  # make test-long; test_cache_trust's kill -9 and immediate rerun covers a killed job in make test
def test_rank_killed_mid_chunk_is_restarted_by_torchrun(tiny_models, reference, tmp_path):
    """torchrun's own elasticity: a worker dies, --max-restarts restarts the group, the new ranks
    share the chunks not yet committed, and the bytes equal an uninterrupted run. (3 restarts
    allowed: on this loaded 2-core machine gloo's re-rendezvous is sometimes refused once.)"""
    out = tmp_path / "elastic"
    proc = subprocess.Popen(_precompute_cmd(tiny_models, out, nproc=2, restarts=3), cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    _wait_for_parts(out, 1, proc)
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert children, "no torchrun worker found"
    os.kill(int(children[-1]), signal.SIGKILL)  # one rank dies mid-job
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    assert "exitcode: -9" in log, log[-3000:]  # torchrun saw the killed worker and restarted the group
    assert _layout(out) == reference


@pytest.mark.long  # make test-long; the higgs_caches fixture (ChatML) and tests/test_theworld.py (LLaVA) run both shapes in make test
def test_chatml_and_llava_manifests_end_to_end(real_mini, tiny_config, tmp_path):
    from precompute.job import run
    chat, _ = run(real_mini / "train_chatml_samples.json", tmp_path / "chat", tiny_config, progress=False)
    n_chat = len(json.loads((real_mini / "train_chatml_samples.json").read_text()))
    assert chat.kept == n_chat and chat.rejected == 0
    index = read_index(tmp_path / "chat").to_pylist()
    assert sum(r["has_image"] for r in index) == 8 and all(r["n_frames"] > 0 for r in index)
    from shards import ShardReader
    sample = ShardReader(tmp_path / "chat").get(0)
    turns = sample["json"]["conversation"]["turns"]  # the whole conversation is kept
    assert [t["role"] for t in turns] == ["system", "user", "assistant"]
    llava, _ = run(real_mini / "llava_captions.json", tmp_path / "llava", tiny_config, progress=False)
    rows = read_index(tmp_path / "llava").to_pylist()
    assert llava.kept == len(rows) > 0 and all(r["has_image"] and r["n_frames"] == 0 for r in rows)


def test_plugin_codec_and_bad_sample_in_batch_costs_only_itself(tiny_config, demo_cache, tmp_path):
    import dataclasses
    from precompute.job import run
    cfg = dataclasses.replace(tiny_config, encoder_batch_size=8, audio_tokenizer={
        "factory": "plugin_codec:make", "kwargs": {"poison_s": 2.5}})
    summary, manifest = run(DEMO / "samples.jsonl", tmp_path / "c", cfg, progress=False)
    durations = dict(zip(*read_index(demo_cache).select(["key", "duration_s"]).to_pydict().values()))
    long_keys = {k for k, d in durations.items() if d > 2.5}
    failed = {r["key"] for r in read_rejects(tmp_path / "c").to_pylist() if r["reason"] == "encode_failed"}
    assert failed == long_keys and 0 < len(failed) < len(durations) // 2
    kept = set(read_index(tmp_path / "c").column("key").to_pylist())
    assert kept == set(durations) - failed
    assert manifest["n_codebooks"] == 4 and manifest["codec_sample_rate"] == 16000
    assert manifest["encoders"]["audio_tokenizer"]["class"] == "plugin_codec.EnergyCodec"


def test_chunks_are_balanced_and_named_by_position():
    import numpy as np
    from precompute.chunks import passes, plan_chunks
    plan = plan_chunks(268, 256)
    assert [(c.name, len(c)) for c in plan] == [("shard-000000.tar", 134), ("shard-000001.tar", 134)]
    assert [len(c) for c in plan_chunks(10, 4)] == [3, 3, 4]
    # resume: a committed chunk is skipped, the others keep their names and rows
    covered = np.zeros(268, bool)
    covered[plan[0].positions] = True
    assert [(c.name, len(c)) for c in plan_chunks(268, 256, covered, ["shard-000000"])] == [("shard-000001.tar", 134)]
    # rows added after chunk 0 and 1 were committed (300 rows then): rows 300-399 sit under committed chunk 1's
    # name and go to a new chunk after every other; a rank reads them in a pass of their own when they lie
    # between its other chunks' rows
    covered = np.zeros(600, bool)
    covered[:300] = True
    grown = plan_chunks(600, 256, covered, ["shard-000000", "shard-000001"])
    assert [(c.name, int(c.positions[0]), int(c.positions[-1])) for c in grown] == [
        ("shard-000002.tar", 400, 599), ("shard-000003.tar", 300, 399)]
    assert [[c.name for c in p] for p in passes(grown)] == [["shard-000003.tar", "shard-000002.tar"]]
    covered[450:460] = True  # a hole: the new chunk's rows 300-399 and the row after the hole
    left = plan_chunks(600, 200, covered, ["shard-000000", "shard-000001", "shard-000002"])
    names = [[c.name for c in p] for p in passes(left)]
    assert sorted(n for p in names for n in p) == sorted(c.name for c in left)
    for p in passes(left):  # each pass reads its chunks' rows in manifest order, chunk after chunk
        rows = np.concatenate([c.positions for c in p])
        assert (np.diff(rows) > 0).all()
