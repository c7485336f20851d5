"""Stage one's spine (precompute.job.Job), its encoder thread, reproducible batched codes and the
process boundaries (decoded rows through shared-memory slots, the shard writer's process).

No speed is asserted here (``make bench``'s overlap section measures it): the tests check that
things run where they should, give the codes they should, and fail as they should.
"""
from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from precompute.encoders.batching import BatchPolicy, Call, plan_calls
from precompute.encoders.capabilities import Capabilities, capabilities_of

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo" / "samples.jsonl"


def chirp(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 24000
    return (0.4 * np.sin(2 * np.pi * (180 + 60 * seed) * t * (1 + t)) + 0.02 * rng.standard_normal(n)).astype(np.float32)


# -- the plan of fixed-shape calls -------------------------------------------------------------------

def test_plan_calls_fixed_shapes_buckets_and_zero_slots():
    canon = lambda n: -(-n // 10) * 10  # noqa: E731 - a codec with hop 10
    lengths = [35, 0, 12, 38, 90, 31, 40]
    one = plan_calls(lengths, canon, BatchPolicy(1), 0, 10**6)
    assert one == [Call(1, 40, (0,)), Call(1, 20, (2,)), Call(1, 40, (3,)), Call(1, 90, (4,)), Call(1, 40, (5,)),
                   Call(1, 40, (6,))]  # clip by clip, in input order, no clip of 0 samples
    got = plan_calls(lengths, canon, BatchPolicy(2, 0.0), 50, 10**6)  # buckets of 50 samples
    assert got == [Call(2, 50, (0, 2)), Call(2, 50, (3, 5)), Call(2, 50, (6, -1)), Call(2, 100, (4, -1))]
    exact = plan_calls(lengths, canon, BatchPolicy(3, 0.0), 0, 10**6)  # equal canonical lengths only
    assert exact == [Call(3, 20, (2, -1, -1)), Call(3, 40, (0, 3, 5)), Call(3, 40, (6, -1, -1)),
                     Call(3, 90, (4, -1, -1))]
    assert all(len(c.places) == c.size for c in got + exact)
    capped = plan_calls([35, 38], canon, BatchPolicy(4), 0, 80)  # 4 x 40 > 80: two places per call
    assert capped == [Call(2, 40, (0, 1))]
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchPolicy(0)
    with pytest.raises(ValueError, match="bucket_s"):
        BatchPolicy(2, -1.0)


# -- batched codes: place, shape, companions ----------------------------------------------------------

@pytest.fixture(scope="module")
def dac_models(tiny_models):
    return tiny_models / "dac-tiny"


def _dac(path: Path, **options):
    from precompute.encoders import load_audio_tokenizer
    return load_audio_tokenizer({"name": "dac", "pretrained": str(path), **options})


def test_a_batched_clips_codes_do_not_depend_on_its_companions(dac_models):
    """A clip at one place of a fixed-shape call gets the same codes with other clips, with silence or with
    zero slots beside it (on this CPU; whether a GPU agrees at every place is benchmarks/gpu_codec_batch.py's
    probe), and the codec records the policy in its identity (so in the fingerprint)."""
    codec = _dac(dac_models, max_batch_size=4, bucket_s=0.5)
    assert capabilities_of(codec).batching == BatchPolicy(4, 0.5)
    assert codec.describe()["batching"]["size"] == 4 and "batching" not in _dac(dac_models).describe()
    clip = chirp(20160, seed=1)
    step = 12 * 960  # 0.5 s rounded to the hop
    length = -(-20160 // step) * step
    others = [chirp(19000, seed=s) for s in (2, 3, 4)]
    for place in range(4):
        alone = codec.encode_placed(clip, 4, length, place)
        clips = others[:place] + [clip] + others[place:]
        call = Call(4, length, tuple(range(4)))
        with_real = codec.submit(clips, [call]).result()[place]
        with_silence = codec.submit([np.zeros(20000, np.float32)] * place + [clip]
                                    + [np.zeros(20000, np.float32)] * (3 - place), [call]).result()[place]
        np.testing.assert_array_equal(with_real, alone)
        np.testing.assert_array_equal(with_silence, alone)
        assert alone.shape == (8, 21)


def test_a_failed_clip_is_a_zero_slot_and_keeps_its_neighbours_places(dac_models):
    codec = _dac(dac_models, max_batch_size=4)
    clips = [chirp(9600, seed=1), np.full(9600, np.nan, np.float32), chirp(9600, seed=2)]
    calls = codec.plan([c.size for c in clips])
    assert calls == [Call(4, 9600, (0, 1, 2, -1))]
    got = codec.submit(clips, calls).result()
    assert isinstance(got[1], ValueError) and "NaN" in str(got[1])
    np.testing.assert_array_equal(got[2], codec.encode_placed(clips[2], 4, 9600, 2))
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(clips)  # the protocol's encode() raises, as before


def test_bucket_padding_changes_daces_tail_so_check_must_rebuild_the_call(dac_models):
    """Why the place and shape are recorded: with a length bucket DAC's last frames see the padding,
    so the clip's codes alone differ from its codes in the recorded call."""
    codec = _dac(dac_models, max_batch_size=2, bucket_s=2.0)
    clip = chirp(20160, seed=5)
    (call,) = codec.plan([clip.size])
    assert call.length == 48000 and call.size == 2
    batched = codec.submit([clip], [call]).result()[0]
    alone = _dac(dac_models).encode([clip])[0]
    assert batched.shape == alone.shape == (8, 21)
    assert (batched != alone).any()


def _batched_config(tiny_config, **options):
    spec = dict(tiny_config.audio_tokenizer, max_batch_size=4, bucket_s=1.0, **options)
    return dataclasses.replace(tiny_config, audio_tokenizer=spec, image_encoder=None, samples_per_shard=12,
                               encoder_batch_size=4)


def _voice_rows(tmp_path: Path) -> Path:
    """Flat rows of the demo's speech only (no images: the job has no VAE)."""
    rows = []
    for line in DEMO.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # the demo's malformed line
            continue
    speech = [r for r in rows if r.get("audio") and not r.get("image")]
    out = tmp_path / "speech.jsonl"
    out.write_text("".join(json.dumps(dict(r, audio=str(DEMO.parent / r["audio"]))) + "\n" for r in speech))
    return out


def test_a_batched_cache_records_each_clips_call_is_reproducible_and_passes_check(tiny_config, tmp_path):
    """A job with a batched codec (fixed calls of 4 clips x 1 s buckets): every audio item's call
    (size, length, place) is in the row's json; a second run writes the same bytes; ``shardcache
    check`` rebuilds each recorded call and finds every array equal, and finds the codes differ when
    a recorded place is moved to another bucket length."""
    from shardcache.commands.check import check
    from precompute.job import run
    from shards import ShardReader
    manifest = _voice_rows(tmp_path)
    cfg = _batched_config(tiny_config)
    run(manifest, tmp_path / "a", cfg, progress=False)
    run(manifest, tmp_path / "b", cfg, progress=False)
    a = {p.name: p.read_bytes() for p in (tmp_path / "a").glob("*.tar")}
    assert a and a == {p.name: p.read_bytes() for p in (tmp_path / "b").glob("*.tar")}
    reader = ShardReader(tmp_path / "a")
    calls = [reader.get(i)["json"]["codes_calls"] for i in range(len(reader.keys))]
    assert all(c is not None and c[0] == 4 and c[1] % 24000 == 0 and 0 <= c[2] < 4 for row in calls for c in row)
    assert len({c[2] for row in calls for c in row}) > 1  # clips really sat at several places
    r = check(tmp_path / "a", manifest, 100, overrides=[])
    assert r["checked"] == len(reader.keys) and not r["problems"], r["problems"]


def test_check_uses_the_recorded_call(tiny_config, tmp_path):
    """The same cache with one clip's recorded call shortened to the clip's own length (its bucket's zero
    padding gone): check re-derives that row's codes in the changed call and reports its codes, and only
    them (the codes depend on the call's shape: DAC's last frames see the padding)."""
    import math

    from shardcache.commands import check as C
    from precompute.job import run
    manifest = _voice_rows(tmp_path)
    run(manifest, tmp_path / "c", _batched_config(tiny_config), progress=False)
    real = C._recorded_calls
    changed = []

    def moved(cached_json):  # what check reads from a cached json, one clip's call changed
        got = real(cached_json)
        if not changed:
            size, length, place = got["codes"][0]
            own = math.ceil(round(cached_json["audio_items"][0]["duration_s"] * 24000) / 960) * 960
            if length - own >= 4800:  # at least 0.2 s of the bucket's padding
                got["codes"][0] = [size, own, place]
                changed.append(cached_json["row"])
        return got

    C._recorded_calls = moved
    try:
        r = C.check(tmp_path / "c", manifest, 100, overrides=[])
    finally:
        C._recorded_calls = real
    assert changed and [p["field"] for p in r["problems"]] == ["codes"], r["problems"]


# -- the job's spine ---------------------------------------------------------------------------------

def test_job_build_reads_declarations(tiny_config, tmp_path):
    """Job.build: the encoders' declared capabilities, per-direction audio rates (the 16 kHz field of
    input items is not made for output items), one preparer; with a clip-by-clip codec and images of one
    size, rows go on as they come (a window only where a batching encoder gets several lengths)."""
    from precompute.job import Job
    from precompute.manifests import read_requests
    cfg = dataclasses.replace(tiny_config, extra_fields={"audio_16k": {"producer": "waveform", "sample_rate": 16000,
                                                                       "direction": "in"}})
    audio = lambda name: {"type": "audio", "audio_url": str(DEMO.parent / "audio" / name)}  # noqa: E731
    clone = tmp_path / "clone.json"  # a voice-cloning conversation: a reference clip in, the answer out
    clone.write_text(json.dumps([{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Say it like this:"}, audio("spk-us-0001.flac")]},
        {"role": "assistant", "content": audio("spk-us-0002.wav")}], "misc": {"key": "clone-0"}}]))
    requests = read_requests(clone, allow_outside_root=True)
    job = Job.build(cfg, "cpu", requests)
    assert job.capabilities["audio_tokenizer"] == Capabilities(device="cpu", batching=BatchPolicy(1),
                                                               asynchronous=True, posterior="a codec has no posterior")
    assert job.capabilities["image_encoder"].batching.batched and job.window == cfg.encoder_batch_size  # one size
    assert Job.build(dataclasses.replace(cfg, image_resize="bucket"), "cpu").window == 8 * cfg.encoder_batch_size
    assert job.rates == ((24000, frozenset({"in", "out"})), (16000, frozenset({"in"})))
    p = job.prepare(requests[0])
    assert p.error is None and [a.direction for a in requests[0].conversation.audio] == ["in", "out"]
    assert [set(w) for w in p.audio] == [{24000, 16000}, {24000}]  # no 16 kHz copy of the answer
    import pickle
    assert pickle.loads(pickle.dumps(job.preparer)).rates == job.rates  # it goes to the decode workers


def test_a_synchronous_plugin_codec_runs_off_the_main_thread_and_overlaps_it(tiny_config, tmp_path, monkeypatch):
    """A plug-in codec with only encode() (it declares nothing) runs on the encoder thread, and while it
    works the main thread goes on: the codec waits for the main thread to run the host-only producer of
    its batch; were the two serial, the job would stop there (the codec gives up after 10 s and the
    rows are rejected encode_failed)."""
    import sys
    sys.path.insert(0, str(ROOT / "tests"))
    import plugin_codec

    from precompute import producers as P
    from precompute.job import run
    from shards import read_rejects
    seen = {"threads": set(), "host_calls": 0}
    host_ran = threading.Event()

    class Waiting(plugin_codec.EnergyCodec):
        def encode(self, waveforms):
            seen["threads"].add(threading.current_thread().name)
            if seen.get("timed_out") or not host_ran.wait(10):
                seen["timed_out"] = True  # the rest fail at once
                raise TimeoutError("the main thread did not run while the codec worked")
            host_ran.clear()
            return super().encode(waveforms)

    real = P.TextProducer.produce

    def produce(self, samples, timer):
        seen["host_calls"] += 1
        seen.setdefault("host_threads", set()).add(threading.current_thread().name)
        if seen["host_calls"] > 1:
            host_ran.set()  # this batch's host work happened while its codec call waited
        return real(self, samples, timer)

    monkeypatch.setattr(P.TextProducer, "produce", produce)
    monkeypatch.setattr(plugin_codec, "make", lambda **k: Waiting())
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = dataclasses.replace(tiny_config, audio_tokenizer={"factory": "plugin_codec:make"}, image_encoder=None,
                              encoder_batch_size=1, samples_per_shard=100)
    host_ran.set()  # the first call
    summary, _ = run(_voice_rows(tmp_path), tmp_path / "c", cfg, progress=False)
    assert seen["threads"] == {"encoders_0"} and seen["host_threads"] == {"MainThread"}
    assert summary.kept > 10 and "encode_failed" not in summary.reasons, read_rejects(tmp_path / "c").to_pylist()


# -- process boundaries -------------------------------------------------------------------------------

def test_decoded_rows_through_slots_equal_the_rows_decoded_in_process(tiny_config, tmp_path):
    """Two decode workers sending rows through reusable shared-memory slots: the job writes the same
    shards as decoding in the main process (num_workers 0)."""
    from precompute.job import run
    cfg = dataclasses.replace(tiny_config, samples_per_shard=12)
    run(DEMO, tmp_path / "w0", dataclasses.replace(cfg, num_workers=0), progress=False)
    run(DEMO, tmp_path / "w2", dataclasses.replace(cfg, num_workers=2), progress=False)
    a = {p.name: p.read_bytes() for p in (tmp_path / "w0").glob("*.tar")}
    assert a and a == {p.name: p.read_bytes() for p in (tmp_path / "w2").glob("*.tar")}


def test_slots_round_trip_and_release(monkeypatch):
    """The collate/unpack pair: arrays come back equal as views of a slot; the slot is free once they go."""
    import gc

    from precompute import slots
    from precompute.prepare import Prepared
    from precompute.manifests import Request
    rec, collate = slots.receiver(1, 2)
    monkeypatch.setattr("torch.utils.data.get_worker_info", lambda: type("I", (), {"id": 0})())
    rows = [Prepared(req=Request(row=i, key=f"k{i}"), chunk=0,
                     audio=[{24000: chirp(100 + i), 16000: chirp(50)}], images=[np.full((8, 8, 3), i, np.uint8)],
                     input_ids=np.arange(3, dtype=np.int32)) for i in range(3)]
    want = [([dict(w) for w in p.audio], list(p.images)) for p in rows]
    msg = collate(rows)
    del rows  # (in one process the message holds the very row objects)

    def compare(got):
        for p, (audio, images) in zip(got, want):
            assert [sorted(w) for w in p.audio] == [sorted(w) for w in audio]
            for w, v in zip(p.audio, audio):
                for rate in v:
                    np.testing.assert_array_equal(w[rate], v[rate])
            np.testing.assert_array_equal(p.images[0], images[0])
            np.testing.assert_array_equal(p.input_ids, np.arange(3))

    got = slots.unpack(msg)
    compare(got)
    assert int(rec.table.tokens[0].max()) != 0  # the slot is held by the rows
    del got, msg
    gc.collect()
    assert int(rec.table.tokens[0].max()) == 0  # and free once they are gone


def test_the_writer_process_writes_the_shards_its_thread_writes(tiny_config, tmp_path, monkeypatch):
    """The shard writer in a process of its own (a job on an accelerator) and in a thread (on the CPU):
    the same shards, index parts and rejects, byte for byte."""
    import precompute.job as job
    cfg = dataclasses.replace(tiny_config, samples_per_shard=10)
    job.run(DEMO, tmp_path / "thread", cfg, progress=False)
    monkeypatch.setattr(job, "writer_process", lambda device: True)
    job.run(DEMO, tmp_path / "process", cfg, progress=False)
    files = lambda d: {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))  # noqa: E731
                       if p.is_file() and p.suffix in (".tar", ".parquet") and p.name != "index.parquet"}
    a = files(tmp_path / "thread")
    assert any(k.endswith(".tar") for k in a) and a == files(tmp_path / "process")


@pytest.mark.parametrize("process", [False, True])
def test_a_writer_that_fails_stops_the_job_naming_why(tiny_config, tmp_path, monkeypatch, process):
    """The shard writer runs in its own process; when it fails (here: an unsafe member name sent to it)
    the job raises naming the writer's error instead of hanging or writing a partial cache."""
    from precompute import writer as W
    from precompute.job import run
    real = W._encode_row

    def bad(key, fields, reject):
        head, arrays = real(key, fields, reject)
        return head.replace(b'"codes.npy"', b'"no_such_member.npy"'), arrays

    monkeypatch.setattr(W, "_encode_row", bad)
    import precompute.job as job
    monkeypatch.setattr(job, "writer_process", lambda device: process)
    cfg = dataclasses.replace(tiny_config, image_encoder=None)
    with pytest.raises(RuntimeError, match="shard writer failed.*no_such_member"):
        run(_voice_rows(tmp_path), tmp_path / "c", cfg, progress=False)
    assert not list((tmp_path / "c").glob("*.tar"))


@pytest.mark.slow
@pytest.mark.long  # make test-long; test_option_effects' walk runs processes=2 and asserts the same cache bytes in make test
def test_two_codec_processes_give_the_codes_of_one(dac_models):
    """``processes: 2``: calls go to two processes holding the codec (4 clips x 0.5 s buckets); the codes
    are those of one process, bit for bit, and a failing clip stays its own."""
    clips = [chirp(n, seed=i) for i, n in enumerate((20160, 9600, 30000, 961, 19000, 9601, 48000, 960))]
    for options in ({"max_batch_size": 2, "bucket_s": 0.5},):
        one = _dac(dac_models, **options).encode(clips)
        two = _dac(dac_models, processes=2, **options)
        got = two.submit(clips + [np.full(960, np.inf, np.float32)]).result()
        assert two._pool is not None and len(two._pool.workers) == 2
        assert len({w.process.pid for w in two._pool.workers}) == 2
        for a, b in zip(one, got):
            np.testing.assert_array_equal(a, b)
        assert isinstance(got[-1], ValueError)
        two._pool.close()


def test_higgs_bucketed_calls_keep_each_clips_own_frame_count(higgs_codec):
    """The Higgs tokenizer encodes a clip unpadded; in a bucketed call its codes are cut to the frames the
    model gives the clip alone (:meth:`HiggsTokenizer.frames`, the model's own length arithmetic)."""
    import torch

    from precompute.encoders import load_audio_tokenizer
    spec = {"name": "higgs", "pretrained": str(higgs_codec / "higgs-audio-tokenizer-tiny")}
    tok = load_audio_tokenizer(spec)
    lengths = (961, 2400, 2401, 7777, 25449)
    with torch.inference_mode():
        for n in lengths:
            want = tok.model.encode(torch.zeros(1, 1, n), bandwidth=tok.bandwidth).audio_codes.shape[-1]
            assert tok.frames(n) == want, n
    batched = load_audio_tokenizer(dict(spec, max_batch_size=2, bucket_s=0.5))
    clips = [chirp(n, seed=n) for n in lengths]
    assert [c.shape for c in batched.encode(clips)] == [c.shape for c in tok.encode(clips)]
    assert all(c.length % (12 * 960) == 0 for c in batched.plan([len(c) for c in clips]))  # 0.5 s to the hop


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
def test_gemma_processor_split_gives_its_own_pixel_values(tiny_models, tmp_path, backend):
    """Gemma 3's image processor split in two (its resize in the decode workers, its rescale + normalise on
    the encoder's device) gives exactly the pixel_values of the processor in one call, with either of
    transformers' backends."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor

    from precompute.producers.image_features import ProcessorResize, normalize
    from tools.testing import build
    ip = AutoProcessor.from_pretrained(build("gemma3", tiny_models, "tiny")[0]).image_processor
    if backend == "torchvision":
        pytest.importorskip("torchvision")  # (not in the dev install: transformers then uses the PIL backend)
        from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
        ip = Gemma3ImageProcessor(**{k: v for k, v in ip.to_dict().items() if k in (
            "size", "resample", "image_mean", "image_std", "do_rescale", "rescale_factor", "do_normalize",
            "do_resize", "do_convert_rgb")})
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((37, 91), (120, 64), (64, 64))]
    want = ip([Image.fromarray(a) for a in images], return_tensors="pt")["pixel_values"]
    resize = ProcessorResize(ip)
    got = normalize(ip, torch.from_numpy(np.stack([resize(a) for a in images])))
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
