"""Stage one at scale and in daily use (issues 48, 50): the manifest is read as a stream and never held whole,
a rerun with nothing to do loads no encoder, the progress bar counts rows written, codec processes start with
the job, the cache records its paths absolute, the logs are short.

No speed is asserted here (make bench's scale_stage_one section measures it, as ratios)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import weakref
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
CLIP = DEMO / "audio" / "spk-us-0001.flac"


class _Alive:
    """Counts the instances of a class alive at once (its most)."""

    def __init__(self):
        self.now = self.most = self.made = 0

    def born(self, obj) -> None:
        self.now += 1
        self.made += 1
        self.most = max(self.most, self.now)
        weakref.finalize(obj, self._died)

    def _died(self) -> None:
        self.now -= 1


@pytest.fixture
def counted_requests(monkeypatch):
    """Every Request the manifest reader makes is counted while it lives."""
    import precompute.manifests as M
    alive = _Alive()

    class Counted(M.Request):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            alive.born(self)

    monkeypatch.setattr(M, "Request", Counted)
    return alive


def _rows(n: int, encoded: int, folder: Path) -> list[dict]:
    """``n`` flat rows naming one clip, the rows after the first ``encoded`` without text (rejected unread)."""
    shutil.copy(CLIP, folder / "clip.flac")
    return [{"key": f"row-{i:05d}", "text": "Hello there." if i < encoded else "", "audio": "clip.flac"}
            for i in range(n)]


@pytest.mark.parametrize("shape", ["jsonl", "json list"])
def test_a_manifest_larger_than_a_block_is_read_without_holding_it(shape, tmp_path, monkeypatch, counted_requests):
    """Planning reads the manifest a block at a time: of 3,000 rows (blocks of 64 rows, a text window of 4 KiB)
    no more than one Request lives at once, the JSON list's text window stays a few blocks long, and the rows
    read again for encoding come one at a time, each the row it was."""
    import precompute.plan as P
    import precompute.readers as R
    from precompute.manifests import ManifestReader
    monkeypatch.setattr(P, "BLOCK_ROWS", 64)
    monkeypatch.setattr(R, "BLOCK", 4096)
    widest = [0]
    fill = R._Window.fill

    def measured(self, *a):
        got = fill(self, *a)
        widest[0] = max(widest[0], len(self.buf))
        return got

    monkeypatch.setattr(R._Window, "fill", measured)
    rows = _rows(3000, 3000, tmp_path)
    path = tmp_path / ("m.jsonl" if shape == "jsonl" else "m.json")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) if shape == "jsonl" else
                    "[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    assert path.stat().st_size > 40 * 4096
    with P.ManifestPlan.build(ManifestReader(path)) as plan:
        assert counted_requests.made == 3000 and counted_requests.most <= 2
        assert plan.n == 3000 and len(list(plan._folder.iterdir())) == 1  # the columns + one spill file
        keys = [req.key for _, req in plan.requests(range(0, 3000, 7))]
        assert keys == [f"row-{i:05d}" for i in range(0, 3000, 7)]
        assert counted_requests.most <= 2
    if shape == "json list":
        assert 0 < widest[0] <= 4 * 4096 + 200  # the window, never the file (the longest record is ~70 bytes)


def test_the_job_streams_its_rows_and_writes_them_all(tmp_path, monkeypatch, counted_requests):
    """The whole job over 1,000 rows (blocks of 64, chunks of 50): the rows decoded, encoded and written come
    from the manifest as the loader asks for them, so far fewer than the manifest's rows are alive at once,
    and every row is in the cache or its rejects."""
    import precompute.plan as P
    from precompute.config import load_config
    from precompute.job import run
    from shards import read_index, read_rejects
    monkeypatch.setattr(P, "BLOCK_ROWS", 64)
    rows = _rows(1000, 12, tmp_path)
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(ROOT / "configs" / "precompute.yaml", ["audio_tokenizer=null", "image_encoder=null",
                                                              "samples_per_shard=50", "num_workers=0", "device=cpu"])
    summary, manifest = run(tmp_path / "m.jsonl", tmp_path / "cache", cfg, progress=False)
    assert summary.kept == 12 and summary.rejected == 988
    assert counted_requests.made >= 2000  # planned, then read again to encode
    assert counted_requests.most < 150    # the loader's batches, the length window, the writer's queue: not 1,000
    assert sorted(read_index(tmp_path / "cache").column("key").to_pylist()) == [f"row-{i:05d}" for i in range(12)]
    assert len(read_rejects(tmp_path / "cache")) == 988 and manifest["counts"]["shards"] == 1


def _codec_config(tmp_path: Path, **codec):
    from precompute.config import load_config
    return load_config(ROOT / "configs" / "precompute.yaml", [
        "image_encoder=null", "num_workers=0", "device=cpu", "samples_per_shard=8",
        "audio_tokenizer=" + json.dumps({"factory": "plugin_codec:make", "kwargs": codec})])


def test_a_rerun_with_nothing_to_encode_loads_no_encoder(tmp_path, monkeypatch):
    """A second run on an unchanged manifest plans from the manifest and the cache and loads no encoder (the
    factory is not called); the fingerprint is still refused when it changes (another codec option), and a
    checkpoint touched since makes the job load once, find the same fingerprint and go on."""
    import plugin_codec
    import precompute.job as job
    from shards.errors import FingerprintMismatch
    loads = []
    real = job.load_encoders
    monkeypatch.setattr(job, "load_encoders", lambda *a, **k: loads.append(1) or real(*a, **k))
    made = []
    monkeypatch.setattr(plugin_codec, "make", lambda **k: made.append(k) or plugin_codec.EnergyCodec(k["poison_s"]))
    manifest = DEMO / "samples.jsonl"
    cfg = _codec_config(tmp_path, poison_s=1e9)
    first, _ = job.run(manifest, tmp_path / "c", cfg, progress=False)
    assert first.kept == 18 and len(loads) == 1 and len(made) == 1  # (no image encoder: the 6 image rows are rejects)
    again, man = job.run(manifest, tmp_path / "c", cfg, progress=False)
    assert len(loads) == 1 and len(made) == 1                       # nothing loaded
    assert again.kept == 0 and again.rerun["kept"] == 32 and man["counts"]["samples"] == 18
    with pytest.raises(FingerprintMismatch):                        # another codec: still refused
        job.run(manifest, tmp_path / "c", _codec_config(tmp_path, poison_s=2.5), progress=False)
    assert len(loads) == 2
    record = tmp_path / "c" / "parts" / "job.json"  # a cache that records no identity (an older version's)
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "inputs"}))
    job.run(manifest, tmp_path / "c", cfg, progress=False)
    assert len(loads) == 3                                          # loaded once: the same fingerprint, recorded
    job.run(manifest, tmp_path / "c", cfg, progress=False)
    assert len(loads) == 3


def test_a_no_change_rerun_of_real_checkpoints_loads_nothing(tiny_config, demo_cache, tmp_path, monkeypatch):
    """The same with the tiny DAC and Wan VAE: the identity from the config and the checkpoints' files stands
    for their weights; rows removed from the manifest drop their chunk and merge the index again, still
    without an encoder; a checkpoint file touched since makes the job load once and go on."""
    import precompute.job as job
    from shards import read_index
    cache = shutil.copytree(demo_cache, tmp_path / "c")
    models = shutil.copytree(Path(tiny_config.audio_tokenizer["pretrained"]), tmp_path / "dac-tiny")
    cfg = dataclasses.replace(tiny_config, audio_tokenizer=dict(tiny_config.audio_tokenizer, pretrained=str(models)))
    job.run(DEMO / "samples.jsonl", cache, cfg, progress=False)  # another path, the same weights: loads, records
    real = job.load_encoders
    monkeypatch.setattr(job, "load_encoders", lambda *a, **k: pytest.fail("an encoder was loaded"))
    summary, man = job.run(DEMO / "samples.jsonl", cache, cfg, progress=False)
    assert summary.kept == 0 and summary.rerun["kept"] == 32
    lines = (DEMO / "samples.jsonl").read_text().splitlines()
    part = tmp_path / "samples.jsonl"
    part.write_text("\n".join(lines[:cfg.samples_per_shard * 3]) + "\n")  # the first three chunks' rows
    summary, man = job.run(part, cache, cfg, root=DEMO, progress=False)
    assert summary.rerun["removed"] == 8 and summary.kept == 0
    assert len(read_index(cache)) == man["counts"]["samples"] < 24
    weights = next(p for p in models.iterdir() if p.suffix == ".safetensors")
    os.utime(weights, (weights.stat().st_mtime + 5,) * 2)
    loads = []
    monkeypatch.setattr(job, "load_encoders", lambda *a, **k: loads.append(1) or real(*a, **k))
    job.run(part, cache, cfg, root=DEMO, progress=False)
    assert loads == [1]                                   # the same fingerprint: no refusal, the identity recorded
    job.run(part, cache, cfg, root=DEMO, progress=False)
    assert loads == [1]


def test_the_progress_bar_counts_the_rows_written(tiny_config, tmp_path, monkeypatch):
    """One bar for the job: its total is this rank's rows, it moves when rows are handed to the shard writer
    (never ahead of them: not when they are read), and ends at the rows written."""
    import precompute.job as job
    bars, puts = [], [0]

    class Bar:
        def __init__(self, total, disable=False, **kw):
            self.total, self.n, self.disable, self.ahead = total, 0, disable, 0
            bars.append(self)

        def update(self, k):
            self.n += k
            self.ahead = max(self.ahead, self.n - puts[0])

        def set_postfix(self, **kw):
            self.postfix = kw

        def close(self):
            pass

    class Writer(job.ChunkWriter):
        def put(self, *a):
            puts[0] += 1
            return super().put(*a)

    monkeypatch.setattr(job, "tqdm", Bar)
    monkeypatch.setattr(job, "ChunkWriter", Writer)
    cfg = dataclasses.replace(tiny_config, encoder_batch_size=4, samples_per_shard=8)
    summary, _ = job.run(DEMO / "samples.jsonl", tmp_path / "c", cfg, progress=True)
    (bar,) = bars
    assert not bar.disable and bar.total == bar.n == puts[0] == summary.kept + summary.rejected == 32
    assert bar.ahead == 0 and bar.postfix["read"] == 32 and bar.postfix["rejected"] == summary.rejected


@pytest.mark.slow
def test_codec_processes_start_with_the_job_all_at_once(tiny_models, monkeypatch):
    """``audio_tokenizer.processes: 2``: Job.build starts both processes, then waits for both (they load at
    once), before any call."""
    import precompute.encoders.processes as PR
    from precompute.config import load_config
    from precompute.job import Job
    events = []
    init, ready = PR._Worker.__init__, PR._Worker.ready
    monkeypatch.setattr(PR._Worker, "__init__", lambda self, *a: (init(self, *a), events.append("started"))[0])
    monkeypatch.setattr(PR._Worker, "ready", lambda self: (events.append("waits"), ready(self))[1])
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        "audio_tokenizer=" + json.dumps({"name": "dac", "pretrained": str(tiny_models / "dac-tiny"), "processes": 2}),
        "image_encoder=null", "device=cpu"])
    job = Job.build(cfg, "cpu")
    try:
        assert events == ["started", "started", "waits", "waits"]
        assert all(w.process.is_alive() for w in job.enc.audio._pool.workers)
    finally:
        job.enc.audio._pool.close()


def test_the_cache_records_its_paths_absolute(tiny_models, tmp_path, monkeypatch):
    """Run from the models' folder with relative paths: manifest.json records the manifest, the media root and
    each local checkpoint as absolute paths (the cache reads the same from any folder)."""
    from precompute.config import load_config
    from precompute.job import run
    (tmp_path / "data").mkdir()
    shutil.copy(CLIP, tmp_path / "data" / "a.flac")
    (tmp_path / "data" / "m.jsonl").write_text(json.dumps({"key": "a", "text": "Hi.", "audio": "a.flac"}) + "\n")
    monkeypatch.chdir(tmp_path)
    os.symlink(tiny_models / "dac-tiny", tmp_path / "dac-tiny")
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        "audio_tokenizer.pretrained=dac-tiny", "image_encoder=null", "num_workers=0", "device=cpu"])
    _, man = run(Path("data/m.jsonl"), Path("cache"), cfg, progress=False)
    assert man["source_manifest"] == str(tmp_path / "data" / "m.jsonl")
    assert man["media_root"] == str(tmp_path / "data")
    assert man["config"]["audio_tokenizer"]["pretrained"] == str(tmp_path / "dac-tiny")


def test_the_logs_name_the_config_as_its_changes(tmp_path, monkeypatch, caplog, capsys):
    """`shardcache precompute` logs the options that differ from the defaults on one short line (the whole
    config: --print_config); the train config's line is the same function's."""
    from precompute import cli
    from precompute.encode import Summary
    from shardcache.changes import changes_line
    from train.config import TrainConfig
    monkeypatch.setattr(cli, "run", lambda *a, **k: (Summary(), None))
    with caplog.at_level(logging.INFO, logger="precompute"):
        assert cli.main(["--manifest", str(DEMO / "samples.jsonl"), "--cache", str(tmp_path / "c"), "--config", "none",
                         "--image_size=64", "--image_encoder=null", "--no_progress"]) == 0
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config, where")]
    assert line == ("config, where it differs from the defaults: image_size=64, image_encoder=null "
                    "(--print_config prints all of it)")
    with pytest.raises(SystemExit):
        cli.main(["--manifest", "m", "--cache", "c", "--config", "none", "--print_config"])
    full = capsys.readouterr().out
    assert "precision_tolerance" in full and "max_text_tokens" in full  # every option
    cfg = TrainConfig()
    cfg.optim.lr = 1e-3
    assert changes_line(cfg) == ("config, where it differs from the defaults: optim.lr=0.001 "
                                 "(--print_config prints all of it)")
    assert changes_line(TrainConfig()).endswith("defaults: nothing (--print_config prints all of it)")


def test_a_library_message_the_user_cannot_act_on_is_dropped_by_name():
    """shardcache.quiet: diffusers' "install accelerate" warning is dropped; its other warnings are kept (seen by
    a handler on diffusers' own logger, which diffusers keeps from propagating)."""
    from shardcache.quiet import quiet_libraries
    quiet_libraries()
    log = logging.getLogger("diffusers.models.modeling_utils")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    try:
        log.warning("Cannot initialize model with low cpu memory usage because `accelerate` was not found in the "
                    "environment. Defaulting to `low_cpu_mem_usage=False`.")
        log.warning("Passed `torch_dtype` x is not a `torch.dtype`. Defaulting to `torch.float32`.")
    finally:
        log.removeHandler(handler)
    assert [m[:6] for m in seen] == ["Passed"]


def test_the_summary_says_the_demos_rejects_are_meant_and_how_to_look(demo_cache, tmp_path):
    """The closing lines: the demo's rejects are the rows its expected_rejects.json lists (broken on purpose),
    the command that names each, and the viewer; a manifest whose rejects are not all listed says nothing of it."""
    from precompute.cli import closing_lines
    counts = json.loads((demo_cache / "manifest.json").read_text())["counts"]
    lines = closing_lines(str(demo_cache), str(DEMO / "samples.jsonl"), counts)
    assert lines[0] == f"  all 8 rejects are rows {DEMO / 'expected_rejects.json'} lists as broken on purpose"
    assert lines[-1] == f"look at the cache: shardcache shards view {demo_cache}   (or: make view OUT={demo_cache})"
    listed = json.loads((DEMO / "expected_rejects.json").read_text())
    (tmp_path / "expected_rejects.json").write_text(json.dumps(listed[1:]))
    assert not any("on purpose" in ln for ln in closing_lines(str(demo_cache), str(tmp_path / "m.jsonl"), counts))


@pytest.mark.long  # make test-long; the streaming tests above check the bounded structure in make test
def test_the_scale_section_runs_and_reports_ratios(tmp_path, monkeypatch):
    """make bench's scale_stage_one section end to end at small sizes (300 and 600 rows, 40 encoded): each
    size's fresh job keeps the encoded rows and rejects the others, its no-change rerun keeps every row and
    loads nothing, and the summary names the ratios to the smallest size and the targets."""
    from benchmarks import bench_scale_stage_one as B
    monkeypatch.setenv("SHARDCACHE_BENCH_CORPUS", str(tmp_path))
    monkeypatch.setattr(B, "ENCODED", 40)
    r = B.run_section([300, 600])
    assert [x["rows"] for x in r["runs"]] == [300, 600]
    for x in r["runs"]:
        assert x["fresh"]["kept"] == 40 and x["fresh"]["rejected"] == x["rows"] - 40
        assert x["rerun"]["rerun"]["kept"] == x["rows"] and not x["rerun"]["merged"]
    assert r["runs"][0]["ratio_to_smallest"]["peak_rss_MiB"] == 1.0 and set(r["met"]) == set(r["targets"])
    lines = B.summary_lines(r)
    assert lines[0].startswith("**Stage one at scale**") and any(ln.startswith("| 600 |") for ln in lines)
