"""``make bench-gpu``: stage one with real-size encoders and the recipes' data wait, on a CUDA GPU.

    python -m benchmarks.gpu [--steps 40] [--workers 0 2 8] [--sections ...] [--recipes ...] [--out DIR]

Without CUDA it prints that it needs a GPU and exits 0: no figure is written (none of this
project's figures was measured on a GPU unless ``benchmarks/results/gpu.md`` says so). On a CUDA
machine, with randomly initialised models of the real sizes (``python -m tools.testing --size
full``; built here on demand):

1. **encoders alone** (synchronised wall time of each call, median of 10 after a warm-up):

   * ``vae``: Wan 2.1 VAE (``wan-full``, what Cosmos-Predict2 uses), 512 x 512 RGB images in
     batches of 8, float32 and bfloat16: images/s and ms per image;
   * ``siglip``: TheWorld's Gemma 3 image path (SigLIP tower + projector of ``gemma-3-4b-it``'s
     shapes, 896 px, bfloat16, batch 8), built on the device without the 4 B LM;
   * ``codecs``: the audio tokenizers of :data:`CODECS` (DAC, Mimi, Higgs-Audio v2's), 8 clips of 10 s
     at their sample rate per call with ``max_batch_size`` 8 (an opt-in; the default, clip by clip, and
     the codes batching changes: :mod:`benchmarks.gpu_codec_batch`), float32: seconds of audio per second;

2. ``precompute``: stage one end to end (:mod:`benchmarks.bench_precompute`, ``device=cuda``), the
   job's wall time over the encoder calls alone on the same batches;

3. ``data_wait`` (:mod:`benchmarks.bench_data_wait`): ``shardcache train`` with 0, 2 and 8 loader
   workers for each of :data:`DATA_WAIT_RUNS` (recipe, LM size), on a cache of the recipe's real-mini
   manifest made with its own precompute config: the median share of the step spent waiting for the
   batch (target < 2 %). A run that fails is reported in ``errors``; the others still run.

Writes ``gpu.json`` and ``gpu.md`` to ``--out`` (default ``benchmarks/results``) after each
measurement, so a run cut short keeps what it finished. ``--smoke`` runs the same code on the CPU
with the tiny models and a few steps, to check it (nothing is written).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.torchaudio_shim import install as install_torchaudio_shim  # noqa: E402

install_torchaudio_shim()  # the higgs codec where the real torchaudio cannot load (random models only)
from benchmarks.run import MODELS, REAL_MINI, RESULTS, ROOT, corpora, machine, write_result  # noqa: E402

#: audio tokenizer name (precompute/encoders/registry.py) -> the random model that stands for its checkpoint
CODECS = {"dac": "dac", "mimi": "mimi", "higgs": "higgs-audio-tokenizer"}

@dataclass(frozen=True)
class Recipe:
    """One recipe's data-wait run: its configs, the real-mini manifest it reads, the random models."""

    precompute: str            #: configs/<name>: how its cache is made
    manifest: str              #: real-mini manifest (conversations of that recipe's shape)
    train: str                 #: configs/<name>: the training run
    models: dict               #: precompute config key -> random model standing for its checkpoint (tiny)
    lm: str                    #: the trainer's ``model.kwargs.lm``: a model directory under models/
    batch_size: int            #: per step (the recipe config's own)
    kwargs: dict = field(default_factory=dict)   #: more ``model.kwargs``
    #: ``model.kwargs`` naming a checkpoint -> the random model under models/ standing for it (tiny): TheWorld's
    #: ``vae`` and the vlm recipe's ``tokenizer`` (its LM ships none), which the contracts hash (the cache's own)
    kwargs_models: dict = field(default_factory=dict)


#: the recipes as configs/ has them, with their tiny models (the step a loader must keep up with is
#: then at its shortest: the harshest data-wait test), and the VLM recipe again on the Llama-3.2-1B-shaped LM
RECIPES = {
    "tts": Recipe("precompute-tts.yaml", "chatml_voice_clone.json", "train-tts.yaml",
                  {"audio_tokenizer": "higgs-audio-tokenizer", "text_tokenizer": "higgs"}, "higgs", 4),
    "theworld": Recipe("precompute-theworld.yaml", "llava_multiturn.json", "train-theworld.yaml",
                       {"image_encoder": "wan", "text_tokenizer": "gemma3", "image_features": "gemma3"}, "gemma3", 2,
                       kwargs_models={"vae": "wan"}),
    "vlm": Recipe("precompute-vlm.yaml", "llava_multiturn.json", "train-vlm.yaml",
                  {"image_encoder": "wan", "text_tokenizer": "tokenizer"}, "lm", 2, {"freeze_lm": True, "patch_size": 2},
                  kwargs_models={"tokenizer": "tokenizer"}),
}
#: (recipe, size of its LM) pairs measured on a GPU
DATA_WAIT_RUNS = (("tts", "tiny"), ("theworld", "tiny"), ("vlm", "tiny"), ("vlm", "full"))


def _sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _models(size: str, names: list[str]) -> dict[str, Path]:
    from tools.testing import MAKERS, build
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


def bench_siglip(device: str, size: str, batch: int, calls: int) -> dict:
    """TheWorld's Gemma 3 image path at stage one (what ``image_features: gemma3`` runs): the SigLIP
    ``vision_tower`` and ``multi_modal_projector`` of ``google/gemma-3-4b-it``'s shapes (896 px, 27
    layers, 256 tokens of 2560 per image), random, bfloat16, built on the device (the 4 B language model
    it would be loaded with is never needed)."""
    import torch
    from transformers import AutoModel
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    from tools.testing.gemma3 import gemma3_config
    cfg = gemma3_config(size)
    with torch.device(device):
        tower = AutoModel.from_config(cfg.vision_config).to(torch.bfloat16).eval()
        projector = Gemma3MultiModalProjector(cfg).to(torch.bfloat16).eval()
    side = cfg.vision_config.image_size
    x = torch.rand(batch, 3, side, side, device=device, dtype=torch.bfloat16)

    def features():
        with torch.inference_mode():
            return projector(tower(pixel_values=x).last_hidden_state)

    s = statistics.median(_time_calls(features, calls, device))
    return {"encoder": "gemma3-siglip", "dtype": "bfloat16", "image_px": side, "batch": batch,
            "images_per_s": batch / s, "ms_per_image": s / batch * 1e3}


def bench_codec(name: str, path: Path, device: str, seconds: float, batch: int, calls: int) -> dict:
    import numpy as np
    from precompute.encoders.registry import load_audio_tokenizer
    enc = load_audio_tokenizer({"name": name, "pretrained": str(path), "max_batch_size": batch}, device=device)
    n = int(seconds * enc.sample_rate)
    clips = [np.random.default_rng(i).uniform(-0.5, 0.5, n).astype(np.float32) for i in range(batch)]
    s = statistics.median(_time_calls(lambda: enc.encode(clips), calls, device))
    return {"encoder": name, "sample_rate": enc.sample_rate, "clip_s": seconds, "batch": batch,
            "audio_s_per_s": batch * seconds / s, "s_per_call": s}


def recipe_cache(name: str, device: str, work: Path) -> Path | None:
    """A cache of the recipe's real-mini manifest made with its precompute config and tiny models (None
    without real-mini)."""
    import dataclasses
    from precompute.config import load_config
    from precompute.job import run
    recipe = RECIPES[name]
    if not (REAL_MINI / recipe.manifest).exists():
        return None
    _models("tiny", list(recipe.models.values()))
    cfg = load_config(ROOT / "configs" / recipe.precompute, [f"device={device}", "allow_outside_root=true"])
    for key, model in recipe.models.items():
        cfg = dataclasses.replace(cfg, **{key: dict(getattr(cfg, key), pretrained=str(MODELS / f"{model}-tiny"))})
    out = work / f"{name}-cache"
    run(REAL_MINI / recipe.manifest, out, cfg, progress=False)
    return out


def bench_data_wait(name: str, cache: Path, size: str, device: str, workers, steps: int, work: Path) -> dict:
    from benchmarks.bench_data_wait import run_once
    recipe = RECIPES[name]
    lm = _models(size, [recipe.lm])[recipe.lm]
    kwargs = {"lm": str(lm), **recipe.kwargs, **{k: str(MODELS / f"{m}-tiny") for k, m in recipe.kwargs_models.items()}}
    extra = ("--model.kwargs", json.dumps(kwargs), "--dist.device", device)
    runs = [run_once(cache, w, steps, recipe.batch_size, work / f"{name}-{size}-w{w}",
                     config=ROOT / "configs" / recipe.train, extra=extra) for w in workers]
    return {"recipe": name, "cache": cache.name, "batch_size": recipe.batch_size, "steps": steps,
            "lm": lm.name, "runs": runs}


def markdown(r: dict) -> str:
    lines = [f"**GPU** ({r['machine']['gpu']}; torch {r['machine']['torch']}; {r['machine']['date']}; random "
             "weights of the real model sizes; command: `make bench-gpu`):", "",
             "| encoder | dtype | input | throughput | per item |", "| --- | --- | --- | --- | --- |"]
    for v in r["vae"]:
        lines.append(f"| Wan 2.1 VAE | {v['dtype']} | {v['image_px']} px, batch {v['batch']} | "
                     f"{v['images_per_s']:.1f} images/s | {v['ms_per_image']:.1f} ms/image |")
    for v in r.get("siglip", []):
        lines.append(f"| Gemma 3 SigLIP + projector | {v['dtype']} | {v['image_px']} px, batch {v['batch']} | "
                     f"{v['images_per_s']:.1f} images/s | {v['ms_per_image']:.1f} ms/image |")
    for c in r["codecs"]:
        lines.append(f"| {c['encoder']} | float32 | {c['batch']} x {c['clip_s']:.0f} s at {c['sample_rate']} Hz, "
                     f"one call (max_batch_size {c['batch']}) | "
                     f"{c['audio_s_per_s']:.1f} s of audio/s | |")
    lines += ["", "| stage one (corpus) | samples/s | wall / encoders alone |", "| --- | --- | --- |"]
    lines += [f"| {p['corpus']} | {p['samples_per_s']} | {p['wall_over_encoders_alone']} |" for p in r["precompute"]]
    lines += ["", "| recipe | num_workers | data wait (median, share of step) | data wait (max) | s/step (median) |",
              "| --- | --- | --- | --- | --- |"]
    for d in r["data_wait"]:
        lines += [f"| {d['recipe']} ({d['lm']}) | {x['num_workers']} | {x['data_wait_median']:.2%} | "
                  f"{x['data_wait_max']:.2%} | {x['step_s_median']:.3f} |" for x in d["runs"]]
    return "\n".join(lines) + "\n"


SECTIONS = ("vae", "siglip", "codecs", "precompute", "data_wait")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="training steps per data-wait run")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2, 8])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="what to measure (default: all, in this order)")
    ap.add_argument("--recipes", nargs="+", default=[f"{r}:{s}" for r, s in DATA_WAIT_RUNS],
                    choices=[f"{r}:{s}" for r, s in DATA_WAIT_RUNS],
                    help="data-wait runs as RECIPE:LM_SIZE (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="folder for gpu.json and gpu.md, rewritten after each measurement (default: %(default)s)")
    ap.add_argument("--smoke", action="store_true", help="check the code on the CPU with tiny models; no results")
    args = ap.parse_args(argv)
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("make bench-gpu needs a CUDA GPU: torch.cuda.is_available() is False on this machine. "
              "Nothing measured, no figures written.")
        return 0
    device, size = ("cpu", "tiny") if args.smoke else ("cuda", "full")
    out = None if args.smoke else args.out
    calls = 2 if args.smoke else 10
    result: dict = {"machine": machine(), "device": device, "size": size,
                    "vae": [], "siglip": [], "codecs": [], "precompute": [], "data_wait": []}
    if "vae" in args.sections:
        wan = _models(size, ["wan"])["wan"]
        result["vae"] = bench_vae(wan, device, ["float32"] if args.smoke else ["float32", "bfloat16"],
                                  64 if args.smoke else 512, 2 if args.smoke else 8, calls)
        write_result(out, "gpu", result, markdown(result))
    if "siglip" in args.sections:
        result["siglip"] = [bench_siglip(device, size, 2 if args.smoke else 8, calls)]
        write_result(out, "gpu", result, markdown(result))
    if "codecs" in args.sections:
        dirs = _models(size, list(CODECS.values()))
        for name, model in CODECS.items():
            result["codecs"].append(bench_codec(name, dirs[model], device, 1.0 if args.smoke else 10.0,
                                                2 if args.smoke else 8, calls))
            write_result(out, "gpu", result, markdown(result))
    if "precompute" in args.sections:
        from benchmarks import bench_precompute
        _models(size, ["dac", "wan"])
        _models("tiny", ["tokenizer"])
        for m in corpora()[:1 if args.smoke else 2]:
            result["precompute"].append(bench_precompute.bench(m, MODELS, size, device=device))
            write_result(out, "gpu", result, markdown(result))
    if "data_wait" in args.sections:
        work = Path(tempfile.mkdtemp(prefix="bench_gpu_"))
        caches: dict = {}
        for run in args.recipes:
            name, lm_size = run.split(":")
            if args.smoke and lm_size != "tiny":
                continue
            if name not in caches:
                caches[name] = recipe_cache(name, device, work)
            if caches[name] is None:
                print(f"{name}: real-mini's {RECIPES[name].manifest} not found at {REAL_MINI}: data wait skipped")
                continue
            try:
                result["data_wait"].append(bench_data_wait(name, caches[name], lm_size, device,
                                                           [0, 2] if args.smoke else args.workers,
                                                           8 if args.smoke else args.steps, work))
            except RuntimeError as e:  # one recipe's failure is reported; the others still run
                print(f"{name} with lm-{lm_size}: {e}", file=sys.stderr)
                result.setdefault("errors", []).append({"recipe": name, "lm_size": lm_size, "error": str(e)[-2000:]})
            write_result(out, "gpu", result, markdown(result))
    print(markdown(result))
    if out is not None:
        print(f"wrote {out}/gpu.json and gpu.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
