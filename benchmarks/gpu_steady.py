"""Stage one at steady state on a CUDA GPU: the TTS and TheWorld jobs end to end with real-size
random encoders over thousands of synthetic samples, against their encoders alone.

    python -m benchmarks.gpu_steady [--n 3000] [--distinct 1500] [--jobs tts theworld] [--out DIR]
                                    [--set KEY=VALUE ...] [--suffix=-NAME]
    python -m benchmarks.gpu_steady --smoke        # the same code on the CPU, tiny models, no results

For each job (``tts``: ``configs/precompute-tts.yaml`` on ChatML voice-cloning conversations of two
10 s clips, Higgs-Audio v2's tokenizer; ``theworld``: ``configs/precompute-theworld.yaml`` on LLaVA
conversations of one JPEG, Wan 2.1 VAE at 512 px in bfloat16 + Gemma 3's SigLIP image features):

1. the corpus: :mod:`benchmarks.synth_corpus` writes ``--distinct`` clips and images on the machine;
   the job's manifest holds ``--n`` rows over them (rows past ``--distinct`` repeat a conversation
   under a new key: every row is decoded and encoded again, nothing is cached between rows);
2. ``job``: :func:`precompute.job.run` into a fresh cache with ``num_workers: auto`` (decode workers
   sized from the first batch), while a thread samples the GPU's utilisation (NVML, every 0.1 s)
   and the machine's busy CPU time (``/proc/stat``: the job is all that runs);
3. ``encoders alone``: the first ``--alone`` rows decoded beforehand, then only the encoder calls,
   batched as the job batches them (:class:`precompute.pipeline.EncodeStream`); seconds per row.
   ``wall / encoders alone`` = the job's processing wall (first batch to last commit: model loading
   and weight hashing are ``setup_s``) over ``n x`` those seconds per row. The encoder calls
   include what the encoders do on the host (Gemma 3's rescale + normalise; the codec's resample).
4. where the job's time went (:meth:`precompute.encode.Summary.split`): the encoder thread's busy
   time, of it the host's share (queueing: Python, kernel launches) and the device's (CUDA events
   around each batch); the main thread's waits for decoded rows, its host work (host-only producers,
   value checks, the json member), its waits for the encoder thread and for the shard writer.

Models: ``higgs-audio-tokenizer-full`` and ``wan-full`` (``python -m tools.testing --size full``)
and a Gemma 3 directory with ``google/gemma-3-4b-it``'s vision tower, projector and processor
(896 px, 256 tokens of 2560) over a one-layer language model with the tiny tokenizer's vocabulary
(:func:`gemma3_vision`): stage one only runs the image path, and the 4 B language model would
take minutes to build. **Random weights: real checkpoints run at the same speed (same shapes), not
to the same values.** ``--set KEY=VALUE`` (repeatable) overrides an option of every job's config as
``shardcache precompute --KEY=VALUE`` does (``--set audio_tokenizer.max_batch_size=8``); the benchmark's model
directories still replace each encoder's ``pretrained``. Writes ``gpu_steady<SUFFIX>.json`` and ``.md``
(the overrides recorded in both) to ``--out`` after each job.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.torchaudio_shim import install as install_torchaudio_shim  # noqa: E402

install_torchaudio_shim()  # only where the real torchaudio cannot load (the CPU smoke run)
from benchmarks.run import MODELS, RESULTS, ROOT, machine, write_result  # noqa: E402

#: job -> (synth_corpus manifest kind, precompute config, {config option: model of :func:`models`})
JOBS = {"tts": ("voice_clone", "precompute-tts.yaml", {"audio_tokenizer": "codec", "text_tokenizer": "higgs"}),
        "theworld": ("llava", "precompute-theworld.yaml",
                     {"image_encoder": "vae", "image_features": "gemma3", "text_tokenizer": "gemma3"})}


def gemma3_vision(out: Path) -> Path:
    """``OUT/gemma3-vision-full``: ``Gemma3ForConditionalGeneration`` with gemma-3-4b-it's vision
    config, projector and processor (896 px, 256 image tokens, text hidden 2560) and a one-layer
    text model over the tiny Gemma 3 tokenizer (320 ids); random, seeded, saved as float32."""
    dest = out / "gemma3-vision-full"
    if dest.is_dir():
        return dest
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from tools.testing.gemma3 import GEMMA3_EXTRA_TOKENS, Gemma3Bundle, gemma3_config, make_gemma3_processor
    full = gemma3_config("full")
    proc = make_gemma3_processor("tiny", 0, full.vision_config.image_size, full.mm_tokens_per_image)
    ids = {k: proc.tokenizer.convert_tokens_to_ids(v) for k, v in GEMMA3_EXTRA_TOKENS.items()}
    cfg = Gemma3Config(
        text_config=dict(hidden_size=full.text_config.hidden_size, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=320),
        vision_config=full.vision_config.to_dict(), mm_tokens_per_image=full.mm_tokens_per_image,
        boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"])
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # transformers initialises it to zeros: every feature would be 0
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, cfg.vision_config.hidden_size ** -0.5)
    tmp = out / f".{dest.name}.tmp"
    Gemma3Bundle(model, proc).save_pretrained(str(tmp))
    tmp.rename(dest)
    return dest


def models(size: str) -> dict[str, Path]:
    """The model directories :data:`JOBS` names (built when absent): the Higgs tokenizer (``codec``) and
    the Wan VAE (``vae``) of ``size``, the tiny Higgs text tokenizer, and Gemma 3 (:func:`gemma3_vision`
    on ``full``, ``gemma3-tiny`` on ``tiny``)."""
    from tools.testing import build
    return {"codec": build("higgs-audio-tokenizer", MODELS, size)[0], "higgs": build("higgs", MODELS, "tiny")[0],
            "vae": build("wan", MODELS, size)[0],
            "gemma3": gemma3_vision(MODELS) if size == "full" else build("gemma3", MODELS, "tiny")[0]}


def config(job: str, dirs: dict[str, Path], device: str, overrides: list[str] = ()):
    """The job's recipe config with ``overrides`` (``KEY=VALUE``, as ``--set`` takes them) and the
    benchmark's model directories as the encoders' ``pretrained``."""
    from precompute.config import load_config
    _, file, options = JOBS[job]
    cfg = load_config(ROOT / "configs" / file, [f"device={device}", *overrides])
    for opt, model in options.items():
        cfg = dataclasses.replace(cfg, **{opt: dict(getattr(cfg, opt), pretrained=str(dirs[model]))})
    return cfg


def manifest(kind: str, distinct: int, n: int) -> Path:
    """``n`` rows of the corpus's ``kind`` manifest over its ``distinct`` conversations (repeats get new keys)."""
    from benchmarks import synth_corpus
    corpus = synth_corpus.default_dir()
    rows = json.loads(synth_corpus.write(corpus, distinct)[kind].read_text())
    out = []
    for i in range(n):
        row = json.loads(json.dumps(rows[i % len(rows)]))
        if "misc" in row:
            row["misc"]["key"] += f"-{i}"
        else:
            row["id"] += f"-{i}"
        out.append(row)
    path = corpus / f"steady-{kind}-{n}-{distinct}.json"  # beside the media (the manifest's root)
    path.write_text(json.dumps(out))
    return path


class Monitor:
    """A thread sampling, every ``period`` seconds while in the ``with`` block, the GPU's utilisation
    (NVML: the share of the last sample period in which a kernel ran; none without NVML) and the
    machine's busy CPU time (``/proc/stat``); :meth:`window` summarises a span of the run."""

    def __init__(self, period: float = 0.1):
        self.period, self.samples, self._stop = period, [], threading.Event()

    @staticmethod
    def _cpu() -> tuple[float, float]:
        ticks = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # busy (all but idle and iowait), all

    def _run(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
            gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 - no NVML (the CPU smoke run)
            gpu = None
        while not self._stop.wait(self.period):
            util = pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu if gpu is not None else None
            self.samples.append((time.perf_counter() - self.t0, util, *self._cpu()))

    def __enter__(self) -> "Monitor":
        self.t0 = time.perf_counter()
        self.samples.append((0.0, None, *self._cpu()))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float) -> dict:
        """GPU utilisation (mean, median of the samples) and cores busy between ``start`` and ``end`` s."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        util = [s[1] for s in inside if s[1] is not None]
        cores = None
        if len(inside) >= 2 and inside[-1][3] > inside[0][3]:
            cores = (inside[-1][2] - inside[0][2]) / (inside[-1][3] - inside[0][3]) * os.cpu_count()
        return {"gpu_util_mean": round(statistics.mean(util), 1) if util else None,
                "gpu_util_median": statistics.median(util) if util else None, "gpu_util_samples": len(util),
                "cores_busy": round(cores, 2) if cores is not None else None}


def bench(job: str, dirs: dict[str, Path], device: str, n: int, distinct: int, alone: int,
          num_workers: str = "auto", overrides: list[str] = ()) -> dict:
    """One job (its config with ``overrides``): the job over ``n`` rows under :class:`Monitor`, then its
    encoders alone."""
    from benchmarks.bench_precompute import encoders_alone
    from precompute.job import run
    kind = JOBS[job][0]
    cfg = dataclasses.replace(config(job, dirs, device, overrides), num_workers=num_workers if num_workers == "auto"
                              else int(num_workers))
    path = manifest(kind, distinct, n)
    with tempfile.TemporaryDirectory() as d, Monitor() as mon:
        t0 = time.perf_counter()
        summary, _ = run(path, Path(d) / "cache", cfg, progress=False)
        total = time.perf_counter() - t0
    alone_enc, alone_rows = encoders_alone(path, cfg, alone)
    a = {"rows": alone_rows, "encoder_s": round(alone_enc, 3), "s_per_row": alone_enc / max(1, alone_rows)}
    alone_s = a["s_per_row"] * summary.kept
    return {"job": job, "overrides": list(overrides), "rows": n, "distinct_files": distinct, "kept": summary.kept, "rejected": summary.rejected,
            "reasons": summary.reasons, "audio_s": round(summary.audio_seconds, 1),
            "decode_workers": summary.decode_workers, "setup_s": round(summary.setup_s, 2), "wall_s": round(summary.wall_s, 2), "total_s": round(total, 2),
            "encoder_s_in_job": round(summary.encoder_s, 2), "encoder_busy": round(summary.encoder_busy, 3),
            "samples_per_s": round(summary.kept / summary.wall_s, 2) if summary.wall_s else None,
            "encoders_alone": a, "encoders_alone_s": round(alone_s, 2),
            "wall_over_encoders_alone": round(summary.wall_s / alone_s, 3) if alone_s else None,
            "split": summary.split(),
            **mon.window(summary.setup_s, summary.setup_s + summary.wall_s)}  # the processing loop


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"**Stage one at steady state on a GPU** ({m['gpu']}, {m['cores']} cores; torch {m['torch']}; {m['date']}; "
             "random weights of the real sizes; `python -m benchmarks.gpu_steady"
             + "".join(f" --set {o}" for o in r["overrides"]) + "`):", "",
             "| job | rows (distinct files) | samples/s | wall / encoders alone | encoder busy in job | GPU util "
             "(mean, median) | cores busy | decode workers | setup s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for j in r["jobs"]:
        util = f"{j['gpu_util_mean']}%, {j['gpu_util_median']}%" if j["gpu_util_mean"] is not None else "-"
        lines.append(f"| {j['job']} | {j['kept']} ({j['distinct_files']}) | {j['samples_per_s']} | "
                     f"{j['wall_over_encoders_alone']} | {j['encoder_busy']:.0%} | {util} | {j['cores_busy']} | "
                     f"{j['decode_workers']} | {j['setup_s']} |")
    lines += ["", "Where the time went (s over the processing wall): encoder thread busy (of it: queueing on the host, "
              "device time between CUDA events); main thread waiting for decoded rows, host work, waiting for the "
              "encoder thread, waiting for the shard writer:", "",
              "| job | wall | encoder busy | encoder host | encoder device | receive | host | wait encoder | wait writer |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for j in r["jobs"]:
        x = j["split"]
        lines.append(f"| {j['job']} | {x['wall_s']:.2f} | {x['encoder_s']:.2f} | {x['encoder_host_s']:.2f} | "
                     f"{x['encoder_device_s']:.2f} | {x['receive_s']:.2f} | {x['host_s']:.2f} | "
                     f"{x['collect_wait_s']:.2f} | {x['writer_wait_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="rows per job (default %(default)s)")
    ap.add_argument("--distinct", type=int, default=1500, help="distinct clips and images written (default %(default)s)")
    ap.add_argument("--alone", type=int, default=256, help="rows of the encoders-alone pass (default %(default)s)")
    ap.add_argument("--num-workers", default="auto", help="the jobs' num_workers (default %(default)s)")
    ap.add_argument("--jobs", nargs="+", choices=list(JOBS), default=list(JOBS))
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu_steady.json/.md (default %(default)s)")
    ap.add_argument("--suffix", default="", help="of the result files' names (gpu_steady<SUFFIX>.json; "
                    "one starting with '-' as --suffix=-NAME)")
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                    help="override an option of every job's config, as `shardcache precompute --KEY=VALUE` "
                    "(e.g. audio_tokenizer.max_batch_size=8); repeatable")
    ap.add_argument("--smoke", action="store_true", help="the CPU, tiny models, 24 rows: checks the code, writes nothing")
    args = ap.parse_args(argv)
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.gpu_steady needs a CUDA GPU: nothing measured, no figures written.")
        return 0
    size, device = ("tiny", "cpu") if args.smoke else ("full", "cuda")
    n, distinct, alone = (24, 12, 8) if args.smoke else (args.n, args.distinct, args.alone)
    t = time.perf_counter()
    dirs = models(size)
    result = {"machine": machine(), "overrides": args.overrides, "models_s": round(time.perf_counter() - t, 1),
              "jobs": []}
    print(f"models ready in {result['models_s']} s", flush=True)
    for job in args.jobs:
        result["jobs"].append(bench(job, dirs, device, n, distinct, alone, args.num_workers, args.overrides))
        print(json.dumps(result["jobs"][-1]), flush=True)
        write_result(None if args.smoke else args.out, f"gpu_steady{args.suffix}", result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
