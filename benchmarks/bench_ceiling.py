"""Stage one's own ceiling: the real job with null encoders (:mod:`benchmarks.null_encoders`) on the
synthetic corpus (:mod:`benchmarks.synth_corpus`), per job kind.

    python -m benchmarks.run --only ceiling [--ceiling-n 2000]     # what make bench runs
    python -m benchmarks.bench_ceiling --n 200                      # this section alone, printed

For each job kind (``speech``: flat rows of one 10 s clip, TTS config; ``voice_clone``: ChatML,
two clips per conversation, TTS config; ``llava``: LLaVA conversations of one JPEG each, TheWorld
config: 512 px VAE grid + Gemma 3 image features):

1. **job**: ``shardcache precompute``'s :func:`precompute.job.run` over the whole corpus with one
   decode worker process, into a fresh cache. Wall time gives samples/s; the CPU time of this
   process and its (reaped) worker processes (``getrusage``) gives **CPU-seconds per sample**, so
   samples (and seconds of audio, or images) per second **per core** = 1 / that. CPU time, not
   wall time: on a shared machine a process waiting for a core accrues no CPU time, so the per-core
   figure holds where the wall-clock one does not.
2. **stages**: the same pipeline functions called one at a time over the first ``stage_n`` rows,
   each timed in thread CPU time: ``decode`` (audio file -> float32 at its own rate; JPEG -> RGB),
   ``resample`` (soxr to each rate the job stores; the image resize onto the VAE grid),
   ``tokenize`` (the chat template render), ``encode (null)`` (the producers with null encoders:
   value checks, casting, the json member), ``tar write`` (npy/npz serialisation + tar),
   ``checksum`` (:func:`shards.scan.scan_shard`: sha256 of the tar, XXH3 of every member) and
   ``index`` (the rest of the commit: index/rejects parts). Shares are of their sum.
   ``cpu_over_wall`` of this pass is the share of a core this single thread got: the noise gauge.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
NULL = "benchmarks.null_encoders"
STAGES = ("decode", "resample", "tokenize", "encode (null)", "tar write", "checksum", "index")
#: job kind -> (config file, manifest key of synth_corpus.write)
KINDS = {"speech": "precompute-tts.yaml", "voice_clone": "precompute-tts.yaml", "llava": "precompute-theworld.yaml"}


def config(kind: str, models: Path = MODELS, **kw):
    """The job kind's recipe config with null encoders (registered as plug-ins by factory spec)."""
    from precompute.config import load_config
    cfg = load_config(ROOT / "configs" / KINDS[kind], ["device=cpu"])
    if kind == "llava":
        cfg = dataclasses.replace(cfg, image_encoder={"factory": f"{NULL}:vae"}, image_features=None,
                                  extra_fields={"image_features": {"factory": f"{NULL}:image_features"}},
                                  text_tokenizer={"name": "hf", "pretrained": str(models / "gemma3-tiny")})
    else:
        cfg = dataclasses.replace(cfg, audio_tokenizer={"factory": f"{NULL}:codec"},
                                  text_tokenizer={"name": "hf", "pretrained": str(models / "higgs-tiny")})
    return dataclasses.replace(cfg, **kw)


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def job(manifest: Path, cfg, workers: int = 1) -> dict:
    """The real job over ``manifest``: wall and CPU seconds (this process + reaped workers)."""
    from precompute.job import run
    with tempfile.TemporaryDirectory() as d:
        c0, t0 = _cpu(), time.perf_counter()
        summary, _ = run(manifest, Path(d) / "c", dataclasses.replace(cfg, num_workers=workers), progress=False)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    n = summary.kept
    return {"workers": workers, "samples": n, "rejected": summary.rejected, "audio_s": round(summary.audio_seconds, 1),
            "setup_s": round(summary.setup_s, 2), "wall_s": round(wall, 2), "loop_wall_s": round(summary.wall_s, 2),
            "cpu_s": round(cpu, 2), "samples_per_s": round(n / summary.wall_s, 2),
            "cpu_s_per_sample": round(cpu / n, 5) if n else None}


def stages(manifest: Path, cfg, limit: int) -> dict:
    """CPU seconds of each stage (see the module docstring) over the first ``limit`` good rows."""
    import soundfile as sf

    from precompute import chat
    from precompute.audio import load_audio_windows, resample
    from precompute.encode import Summary
    from precompute.job import Job
    from precompute.images import decode_image, load_image
    from precompute.chunks import chunk_batches
    from precompute.manifests import read_requests
    from shards.scan import scan_shard
    from shards.writer import ShardWriter

    from precompute.pipeline import preload_decoders
    preload_decoders()
    reqs = [r for r in read_requests(manifest, fmt=cfg.manifest_format) if r.error is None][:limit]
    pipe = Job.build(cfg, "cpu", reqs)
    cpu: dict[str, float] = defaultdict(float)

    def timed(stage, fn, *a, **k):
        t = time.thread_time()
        out = fn(*a, **k)
        cpu[stage] += time.thread_time() - t
        return out

    w0, t0 = time.perf_counter(), time.thread_time()
    images = 0
    for req in reqs:  # the decode path piece by piece (what prepare() does in one call)
        conv = req.conversation
        timed("tokenize", chat.render, conv, pipe.enc.text, pipe.template, pipe.tokens)
        for a in conv.audio:
            sr = sf.info(a.source).samplerate
            got = timed("decode", load_audio_windows, a.source, [(a.offset_s, a.duration_s)], (sr,))
            for rate, directions in pipe.rates:
                if a.direction in directions:  # the rates the job reads this item at
                    timed("resample", resample, got[0][0][sr], sr, rate)
        for im in conv.images:
            images += 1
            d = timed("decode", decode_image, im.source, rgb=cfg.image_rgb)
            timed("resample", load_image, im.source, cfg.image_size, mode=cfg.image_resize,
                  multiple=pipe.image_multiple, rgb=cfg.image_rgb, decoded=d)
            if pipe.preparer.image_input is not None:  # Gemma 3's resize (the model's input), in the decode workers
                timed("resample", pipe.preparer.image_input, np.asarray(d, dtype=np.uint8))
    decode_cpu = sum(cpu.values())
    t = time.thread_time()
    prepared = [pipe.prepare(r) for r in reqs]  # the real call, to check the pieces add up
    prepare_cpu = time.thread_time() - t
    summary = Summary()
    out = []
    for batch in chunk_batches([0] * len(prepared), cfg.encoder_batch_size):
        out += timed("encode (null)", pipe.encode, [prepared[i] for i in batch], summary)
    with tempfile.TemporaryDirectory() as d:
        writer = ShardWriter(Path(d), "shard-000000.tar")
        for key, fields, reject in out:
            if reject:
                writer.reject(*reject)
            else:
                timed("tar write", writer.add, key, fields)
        t = time.thread_time()
        writer.commit({"rows": []})
        commit = time.thread_time() - t
        timed("checksum", scan_shard, Path(d) / "shard-000000.tar")
        cpu["index"] += max(0.0, commit - cpu["checksum"])
    wall, total_thread = time.perf_counter() - w0, time.thread_time() - t0
    total = sum(cpu.values())
    kept = sum(r is None for _, _, r in out)
    audio_s = sum(p.duration_s for p in prepared if p.error is None)
    return {"rows": len(reqs), "kept": kept, "images": images, "audio_s": round(audio_s, 1),
            "cpu_s": {k: round(cpu[k], 4) for k in STAGES},
            "share": {k: round(cpu[k] / total, 4) for k in STAGES},
            "cpu_s_per_sample": round(total / len(reqs), 5),
            "prepare_cpu_over_pieces": round(prepare_cpu / decode_cpu, 3) if decode_cpu else None,
            "cpu_over_wall": round(total_thread / wall, 3)}


def bench(kind: str, manifest: Path, stage_n: int = 200, workers: int = 1) -> dict:
    """One job kind: the job over the whole manifest and the stage pass over ``stage_n`` rows."""
    cfg = config(kind)
    s = stages(manifest, cfg, stage_n)  # first: the imports and first calls are then behind the job's figures
    j = job(manifest, cfg, workers)
    per = j["cpu_s_per_sample"]
    out = {"kind": kind, "manifest": manifest.name, "job": j, "stages": s,
           "samples_per_core_s": round(1 / per, 2) if per else None}
    if j["audio_s"]:
        out["audio_s_per_core_s"] = round(j["audio_s"] / j["cpu_s"], 1)
    if s["images"]:
        out["images_per_core_s"] = round(s["images"] / s["rows"] / per, 2) if per else None
    return out


def gemma_processor(manifest: Path, n: int = 50, size: int = 896) -> dict:
    """CPU ms per image of Gemma 3's image processor at the real ``size`` (896 px: gemma-3-4b's SigLIP) on
    the corpus's decoded JPEGs: the whole processor in one call (what the main process ran before), and
    its resize alone (:class:`precompute.producers.image_features.ProcessorResize`: what the decode
    workers run now; the rescale + normalise runs on the encoder's device). The null encoder's resize
    is Pillow's at the same size (:class:`benchmarks.null_encoders.SquareResize`); the tiny test
    model's processor is only configured with another size."""
    from transformers import AutoProcessor

    from precompute.images import decode_image
    from precompute.manifests import read_requests
    from precompute.producers.image_features import ProcessorResize
    ip = AutoProcessor.from_pretrained(MODELS / "gemma3-tiny").image_processor
    ip.size = {"height": size, "width": size}
    srcs = [im.source for r in read_requests(manifest)[:n] if r.error is None for im in r.conversation.images]
    imgs = [decode_image(x, rgb="convert") for x in srcs]
    ip(imgs[:2], return_tensors="pt")  # first call
    t = time.thread_time()
    for im in imgs:
        ip([im], return_tensors="pt")
    whole = (time.thread_time() - t) / len(imgs)
    resize, arrays = ProcessorResize(ip), [np.asarray(im, dtype=np.uint8) for im in imgs]
    t = time.thread_time()
    for a in arrays:
        resize(a)
    return {"images": len(imgs), "size": size, "cpu_ms_per_image": round(whole * 1e3, 1),
            "resize_cpu_ms_per_image": round((time.thread_time() - t) / len(imgs) * 1e3, 1)}


def first_job(manifest: Path, n: int = 64, workers: int = 2) -> dict:
    """In THIS process (call it in a fresh one): wall of two identical jobs of ``n`` rows with
    ``workers`` decode workers, and the import time of the decode libraries (what each worker
    process paid per job when the parent had not imported them)."""
    sub = manifest.parent / f"first-job-{n}.jsonl"  # beside the media (the default root)
    sub.write_text("".join(manifest.read_text().splitlines(keepends=True)[:n]))
    from precompute.pipeline import preload_decoders
    t, c = time.perf_counter(), time.process_time()
    preload_decoders()  # what each decode worker imported on its own, per job, before they were preloaded
    preload = {"wall_s": round(time.perf_counter() - t, 2), "cpu_s": round(time.process_time() - c, 2)}
    cfg = config("speech")
    walls = []
    for _ in range(2):
        r = job(sub, cfg, workers)
        walls.append({"wall_s": r["wall_s"], "setup_s": r["setup_s"], "loop_wall_s": r["loop_wall_s"]})
    return {"samples": n, "workers": workers, "jobs": walls, "decoder_imports": preload}


LABELS = {"speech": "speech (flat rows, one 10 s clip; TTS config)",
          "voice_clone": "ChatML voice cloning (two 10 s clips; TTS config)",
          "llava": "LLaVA (one JPEG; TheWorld config: 512 px VAE grid + Gemma 3 features)"}


def run_section(n: int, stage_n: int = 200) -> dict:
    """``make bench``'s ceiling section: the corpus (written or reused), every kind, and the
    first-job measurement in a fresh process. Load average before and after (shared machine)."""
    import subprocess
    import sys

    from benchmarks import synth_corpus
    load0 = os.getloadavg()
    manifests = synth_corpus.write(synth_corpus.default_dir(), n)
    for k in KINDS:  # one-off first calls (imports, pyarrow, tokenizers) out of every kind's figures
        stages(manifests[k], config(k), 8)
    rows = [bench(k, manifests[k], min(stage_n, n)) for k in KINDS]
    got = subprocess.run([sys.executable, "-m", "benchmarks.bench_ceiling", "--first-job", "--n", str(n)],
                         cwd=ROOT, check=True, capture_output=True, text=True)
    return {"n": n, "kinds": rows, "first_job": json.loads(got.stdout.strip().splitlines()[-1]),
            "gemma_processor": gemma_processor(manifests["llava"]),
            "loadavg_start": load0, "loadavg_end": os.getloadavg(), "cpus": os.cpu_count()}


def summary_lines(r: dict) -> list[str]:
    """The ceiling section of ``benchmarks/results/summary.md``."""
    out = [f"**Stage one's ceiling** (the real job with null encoders: the real models' output shapes, no compute; "
           f"synthetic corpus of {r['n']} samples per kind, `benchmarks/synth_corpus.py`; one decode worker; per core = "
           "per CPU-second of the job's processes, which holds on a shared machine where wall time does not):", "",
           "| job kind | samples | samples/s per core | audio s/s per core | images/s per core | CPU ms/sample "
           "(job) | CPU ms/sample (stages) | wall samples/s (this machine) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for x in r["kinds"]:
        j, s = x["job"], x["stages"]
        out.append(f"| {LABELS[x['kind']]} | {j['samples']} | {x['samples_per_core_s']} | "
                   f"{x.get('audio_s_per_core_s', '-')} | {x.get('images_per_core_s', '-')} | "
                   f"{j['cpu_s_per_sample'] * 1e3:.1f} | {s['cpu_s_per_sample'] * 1e3:.1f} | {j['samples_per_s']} |")
    out += ["", f"Share of the stages' CPU time (first {r['kinds'][0]['stages']['rows']} rows of each kind, each stage timed alone in thread "
            "CPU time):", "",
            "| job kind | " + " | ".join(STAGES) + " | CPU / wall of the pass |",
            "| --- | " + " | ".join("---" for _ in STAGES) + " | --- |"]
    for x in r["kinds"]:
        s = x["stages"]
        out.append(f"| {x['kind']} | " + " | ".join(f"{s['share'][k]:.0%}" for k in STAGES) +
                   f" | {s['cpu_over_wall']:.2f} |")
    f = r["first_job"]
    out += ["", f"First job vs second job in a fresh process ({f['samples']} speech rows, {f['workers']} decode workers): "
            + " vs ".join(f"{j['wall_s']:.2f} s" for j in f["jobs"]) + f" wall (setup "
            + " vs ".join(f"{j['setup_s']:.2f} s" for j in f["jobs"]) + "). Importing the decode libraries "
            f"(librosa/soxr, Pillow's plug-ins) took {f['decoder_imports']['cpu_s']:.2f} CPU-s "
            f"({f['decoder_imports']['wall_s']:.2f} s wall): what every decode worker paid at the start of every job "
            "before they were imported once in the parent (`precompute.pipeline.preload_decoders`). Load average "
            f"{r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f} on {r['cpus']} cores (shared machine)."]
    g = r.get("gemma_processor")
    if g:
        out += ["", f"Gemma 3's image processor at {g['size']} px (the real SigLIP's input) took {g['cpu_ms_per_image']} "
                f"CPU-ms per image in one call over {g['images']} of the corpus's JPEGs (what the main process ran "
                f"before); its resize alone, which the decode workers run now (the rest runs on the encoder's device), "
                f"{g.get('resize_cpu_ms_per_image', '-')} CPU-ms (in the stages above, the null encoder's: `resample`)."]
    out += [""]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="samples per job kind (>= 2000 in make bench)")
    ap.add_argument("--stage-n", type=int, default=200, help="rows of the stage pass")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--first-job", action="store_true", help="only the first-job measurement (fresh process)")
    ap.add_argument("--gemma-processor", action="store_true", help="only Gemma 3's image processor at 896 px")
    args = ap.parse_args(argv)
    from benchmarks import synth_corpus
    manifests = synth_corpus.write(synth_corpus.default_dir(), args.n)
    if args.gemma_processor:
        print(json.dumps(gemma_processor(manifests["llava"])))
        return 0
    if args.first_job:
        print(json.dumps(first_job(manifests["speech"])))
        return 0
    rows = [bench(k, manifests[k], min(args.stage_n, args.n)) for k in args.kinds.split(",")]
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
