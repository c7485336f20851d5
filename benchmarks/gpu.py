"""``make bench-gpu``: stage one with real-size encoders and the recipes' data wait, on a CUDA GPU.

    python -m benchmarks.gpu [--steps 40] [--workers 0 2 8]

Without CUDA it prints that it needs a GPU and exits 0: no figure is written (none of this
project's figures was measured on a GPU unless ``benchmarks/results/gpu.md`` says so). On a CUDA
machine, with randomly initialised models of the real sizes (``python -m shardcache.testing --size
full``; built here on demand):

1. **encoders alone** (CUDA events around each call, after warm-up):

   * Wan 2.1 VAE (``wan-full``, what Cosmos-Predict2 uses): 512 x 512 RGB images in batches of 8,
     float32 and bfloat16: images/s and ms per image;
   * audio codecs: ``dac-full`` (Higgs Audio v2 shaped DAC), ``mimi-full`` and every other full-size
     codec :mod:`shardcache.testing` can build (``higgs`` once it can), 8 clips of 10 s at their
     sample rate per call, float32: seconds of audio encoded per second;

2. **stage one end to end** (:mod:`benchmarks.bench_precompute` with ``device=cuda``): the job's wall
   time over the encoder calls alone on the same batches, with decode workers (target <= 1.15);

3. **data wait** (:mod:`benchmarks.bench_data_wait`): ``shardcache train`` with the recipes that
   exist (``--model tts`` on a cache of real-mini's ``chatml_voice_clone.json``, ``--model vlm`` on
   one of ``llava_multiturn.json``, both with the Llama-3.2-1B-shaped ``lm-full``) and 0, 2 and 8
   loader workers: the median share of the step spent waiting for the batch (target < 2 %).

Writes ``benchmarks/results/gpu.json`` and ``gpu.md``. ``--smoke`` runs the same code on the CPU with
the tiny models and a few steps, to check it (nothing is written to the results).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run import MODELS, REAL_MINI, RESULTS, ROOT, corpora, machine  # noqa: E402

#: recipe -> (precompute config, real-mini manifest, train config)
RECIPES = {"tts": ("precompute-tts.yaml", "chatml_voice_clone.json", "train-tts.yaml"),
           "vlm": ("precompute-vlm.yaml", "llava_multiturn.json", "train-vlm.yaml")}


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _models(size: str, names: list[str]) -> dict[str, Path]:
    from shardcache.testing import MAKERS, build
    return {n: build(n, MODELS, size)[0] for n in names if n in MAKERS}


def _time_calls(fn, calls: int, device: str) -> list[float]:
    fn()  # warm-up: kernels, allocator, cudnn autotuning
    _sync(device)
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def bench_vae(path: Path, device: str, dtypes, side: int, batch: int, calls: int) -> list[dict]:
    import numpy as np
    from precompute.encoders.registry import load_image_encoder
    rows = []
    images = np.random.default_rng(0).integers(0, 256, (batch, side, side, 3), dtype=np.uint8)
    for dtype in dtypes:
        enc = load_image_encoder({"name": "wan", "pretrained": str(path), "dtype": dtype,
                                  "max_batch_size": batch}, device=device)
        s = statistics.median(_time_calls(lambda e=enc: e.encode(images), calls, device))
        rows.append({"encoder": "wan", "dtype": dtype, "image_px": side, "batch": batch,
                     "images_per_s": batch / s, "ms_per_image": s / batch * 1e3})
        del enc  # free the GPU memory before the next dtype
    return rows


def bench_codec(name: str, path: Path, device: str, seconds: float, batch: int, calls: int) -> dict:
    import numpy as np
    from precompute.encoders.registry import load_audio_tokenizer
    enc = load_audio_tokenizer({"name": name, "pretrained": str(path), "max_batch_size": batch}, device=device)
    n = int(seconds * enc.sample_rate)
    clips = [np.random.default_rng(i).uniform(-0.5, 0.5, n).astype(np.float32) for i in range(batch)]
    s = statistics.median(_time_calls(lambda: enc.encode(clips), calls, device))
    return {"encoder": name, "sample_rate": enc.sample_rate, "clip_s": seconds, "batch": batch,
            "audio_s_per_s": batch * seconds / s, "s_per_call": s}


def recipe_cache(recipe: str, size: str, device: str, work: Path) -> Path | None:
    """A cache of the recipe's real-mini manifest made with its precompute config (None without real-mini)."""
    import dataclasses
    from precompute.config import load_config
    from precompute.job import run
    pre, manifest, _ = RECIPES[recipe]
    if not (REAL_MINI / manifest).exists():
        return None
    cfg = load_config(ROOT / "configs" / pre, [f"device={device}"])
    models = {"audio_tokenizer": "dac", "image_encoder": "wan"}
    for key, model in models.items():
        spec = getattr(cfg, key)
        if spec:
            cfg = dataclasses.replace(cfg, **{key: dict(spec, pretrained=str(MODELS / f"{model}-{size}"))})
    text = dict(cfg.text_tokenizer or {})
    if text.get("pretrained"):
        cfg = dataclasses.replace(cfg, text_tokenizer=dict(text, pretrained=str(MODELS / "tokenizer-tiny")))
    out = work / f"{recipe}-cache"
    run(REAL_MINI / manifest, out, cfg, progress=False)
    return out


def bench_data_wait(recipe: str, cache: Path, size: str, device: str, workers, steps: int, work: Path) -> dict:
    from benchmarks.bench_data_wait import run_once
    _, _, train = RECIPES[recipe]
    kwargs = {"lm": str(MODELS / f"lm-{size}")}
    if recipe == "vlm":
        kwargs.update(freeze_lm=True, patch_size=2)
    extra = ("--model.kwargs", json.dumps(kwargs), "--dist.device", device)
    batch = 4 if recipe == "tts" else 2
    runs = [run_once(cache, w, steps, batch, work / f"{recipe}-w{w}", config=ROOT / "configs" / train, extra=extra)
            for w in workers]
    return {"recipe": recipe, "cache": cache.name, "batch_size": batch, "steps": steps, "lm": f"lm-{size}",
            "runs": runs}


def markdown(r: dict) -> str:
    lines = [f"**GPU** ({r['machine']['gpu']}; torch {r['machine']['torch']}; {r['machine']['date']}; random "
             "weights of the real model sizes; command: `make bench-gpu`):", "",
             "| encoder | dtype | input | throughput | per item |", "| --- | --- | --- | --- | --- |"]
    for v in r["vae"]:
        lines.append(f"| Wan 2.1 VAE | {v['dtype']} | {v['image_px']} px, batch {v['batch']} | "
                     f"{v['images_per_s']:.1f} images/s | {v['ms_per_image']:.1f} ms/image |")
    for c in r["codecs"]:
        lines.append(f"| {c['encoder']} | float32 | {c['batch']} x {c['clip_s']:.0f} s at {c['sample_rate']} Hz | "
                     f"{c['audio_s_per_s']:.1f} s of audio/s | |")
    lines += ["", "| stage one (corpus) | samples/s | wall / encoders alone |", "| --- | --- | --- |"]
    lines += [f"| {p['corpus']} | {p['samples_per_s']} | {p['wall_over_encoders_alone']} |" for p in r["precompute"]]
    lines += ["", "| recipe | num_workers | data wait (median, share of step) | data wait (max) | s/step (median) |",
              "| --- | --- | --- | --- | --- |"]
    for d in r["data_wait"]:
        lines += [f"| {d['recipe']} ({d['lm']}) | {x['num_workers']} | {x['data_wait_median']:.2%} | "
                  f"{x['data_wait_max']:.2%} | {x['step_s_median']:.3f} |" for x in d["runs"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="training steps per data-wait run")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2, 8])
    ap.add_argument("--smoke", action="store_true", help="check the code on the CPU with tiny models; no results")
    args = ap.parse_args(argv)
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("make bench-gpu needs a CUDA GPU: torch.cuda.is_available() is False on this machine. "
              "Nothing measured, no figures written.")
        return 0
    device, size = ("cpu", "tiny") if args.smoke else ("cuda", "full")
    calls = 2 if args.smoke else 10
    models = _models(size, ["wan", "dac", "mimi", "higgs", "lm"])
    if "tokenizer" not in models:
        models.update(_models("tiny", ["tokenizer"]))
    result: dict = {"machine": machine(), "device": device, "size": size}
    result["vae"] = bench_vae(models["wan"], device, ["float32"] if args.smoke else ["float32", "bfloat16"],
                              64 if args.smoke else 512, 2 if args.smoke else 8, calls)
    result["codecs"] = [bench_codec(n, models[n], device, 1.0 if args.smoke else 10.0, 2 if args.smoke else 8, calls)
                        for n in ("dac", "mimi", "higgs") if n in models]
    from benchmarks import bench_precompute
    result["precompute"] = [bench_precompute.bench(m, MODELS, size, device=device)
                            for m in corpora()[:1 if args.smoke else 2]]
    work = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    result["data_wait"] = []
    for recipe in RECIPES:
        cache = recipe_cache(recipe, "tiny" if args.smoke else size, device, work)
        if cache is None:
            print(f"{recipe}: real-mini's {RECIPES[recipe][1]} not found at {REAL_MINI}: data wait skipped")
            continue
        result["data_wait"].append(bench_data_wait(recipe, cache, size, device, [0, 2] if args.smoke else args.workers,
                                                   8 if args.smoke else args.steps, work))
    md = markdown(result)
    print(md)
    if not args.smoke:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "gpu.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / "gpu.md").write_text(md)
        print(f"wrote {RESULTS}/gpu.json and gpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
