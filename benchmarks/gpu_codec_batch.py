"""Whether an audio codec gives the same codes batched on CUDA as clip by clip: Higgs-Audio v2's and DAC.

Codecs encode clip by clip unless ``max_batch_size`` says otherwise (:mod:`precompute.encoders.audio`);
DAC's batching was once measured bit-identical on the CPU only. Results: docs/benchmarks.md.

    python -m benchmarks.gpu_codec_batch [--batch-sizes 1 8 16] [--repeats 16] [--out DIR]
    python -m benchmarks.gpu_codec_batch --variants 1 8:1.0 p2 8:1.0:p2 --seconds 10 4.2 7.3 12.9 2.6
    python -m benchmarks.gpu_codec_batch --smoke [--out DIR]   # the CPU, tiny models, 6 short clips

Each codec is loaded through the precompute registry as its recipe configures it (``higgs``: the
``audio_tokenizer`` of ``configs/precompute-tts.yaml``, ``dac``: of ``configs/precompute.yaml``) on
its random model of the real size (``python -m tools.testing --size full``, built on demand), once per
``max_batch_size``. The clips: ``--repeats`` speech-like clips (:func:`benchmarks.synth_corpus.speech_like`)
of each of ``--seconds`` at the codec's sample rate, interleaved (10 s, 5 s, 7.3 s, 10 s...): groups of
equal length, which is what ``max_batch_size > 1`` batches. Per batch size, one ``encode`` of the whole
list (the warm-up), then ``--calls`` timed ones (CUDA synchronised), and:

* ``vs_batch_1``: the warm-up call's codes against ``max_batch_size 1``'s: clips ``identical`` of
  ``total``, ``equal_codes`` (fraction of code positions equal), ``max_frames_differing`` (the most
  frames of one clip where any codebook differs);
* ``repeat``: the last timed call against the warm-up call (run-to-run determinism), the same counts;
* ``audio_s_per_s``: seconds of audio encoded per second (median call);
* ``composition`` (also alone with ``--composition-only``): :func:`composition`, whether a clip's codes
  in a batch depend on the other clips or on its place in the batch;
* ``places``: :func:`places`, at every place of a fixed-shape call, whether a clip's codes with zero
  slots beside it (what ``shardcache check`` rebuilds from the recorded place and shape) equal its codes
  with real clips beside it, and whether they change with the place.

``--variants`` replaces ``--batch-sizes``: each ``B[:BUCKET_S][:pN]`` (``8:1.0:p2``: ``max_batch_size`` 8,
``bucket_s`` 1.0, ``processes`` 2); a variant with ``processes`` > 1 is also compared with the same
variant in one process (``vs_one_process``: identical codes expected).

**Random weights**: trained codebooks have fewer near ties than random ones, so a flip here is an
upper bound of what a real checkpoint shows. Writes ``gpu_codec_batch.json`` and ``gpu_codec_batch.md``
to ``--out`` after each codec (``--smoke``: only when ``--out`` is given).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu import CODECS, _models, _time_calls  # noqa: E402  (installs the torchaudio shim)
from benchmarks.run import RESULTS, ROOT, machine, write_result  # noqa: E402

#: codec -> the recipe config whose ``audio_tokenizer`` options it is loaded with
RECIPE_CONFIGS = {"higgs": "precompute-tts.yaml", "dac": "precompute.yaml"}


def spec(codec: str, path: Path, batch: int, **options) -> dict:
    """The ``audio_tokenizer`` spec of the codec's recipe config with ``pretrained=path``, ``max_batch_size=batch``
    (and ``options``: ``bucket_s``, ``processes``)."""
    from precompute.config import load_config
    return dict(load_config(ROOT / "configs" / RECIPE_CONFIGS[codec]).audio_tokenizer,
                pretrained=str(path), max_batch_size=batch, **options)


def variant(text: str) -> dict:
    """``B[:BUCKET_S][:pN]`` -> ``{"max_batch_size": B, "bucket_s": ..., "processes": N}`` (see the module docstring)."""
    out: dict = {}
    for i, part in enumerate(text.split(":")):
        if part.startswith("p"):
            out["processes"] = int(part[1:])
        elif i == 0:
            out["max_batch_size"] = int(part)
        else:
            out["bucket_s"] = float(part)
    out.setdefault("max_batch_size", 1)
    return out


def clip_set(sample_rate: int, seconds: list[float], repeats: int) -> list:
    """float32 speech-like clips, ``repeats`` of each length in ``seconds`` (at ``sample_rate`` Hz), interleaved;
    clip ``i`` is seeded by ``i`` (the same list for the same arguments)."""
    from benchmarks.synth_corpus import speech_like
    return [speech_like(r * len(seconds) + k, sample_rate, s) for r in range(repeats) for k, s in enumerate(seconds)]


def compare(ref: list, got: list) -> dict:
    """Codes ``got`` against ``ref`` clip by clip (int arrays ``(n_codebooks, frames)``): clips ``identical``
    of ``total``, ``equal_codes`` (fraction of ``ref``'s code positions equal in ``got``; none of a clip of
    another shape) and ``max_frames_differing`` (the most frames of one clip in which any codebook differs;
    a clip of another shape counts all its frames)."""
    if len(ref) != len(got):
        raise ValueError(f"{len(got)} clips of codes compared with {len(ref)}")
    identical = equal = positions = worst = 0
    for a, b in zip(ref, got):
        positions += a.size
        if a.shape != b.shape:
            worst = max(worst, a.shape[-1])
            continue
        frames = int((a != b).any(axis=0).sum())
        equal += int((a == b).sum())
        identical += frames == 0
        worst = max(worst, frames)
    return {"identical": identical, "total": len(ref), "equal_codes": equal / positions if positions else 1.0,
            "max_frames_differing": worst}


def bench_codec(codec: str, path: Path, device: str, seconds: list[float], repeats: int,
                batch_sizes: list, calls: int) -> dict:
    """One codec at each of ``batch_sizes`` (ints, or :func:`variant` dicts; the first is the reference:
    give clip by clip first)."""
    from precompute.encoders import load_audio_tokenizer
    rows, ref, info, one_process = [], None, {}, {}
    for v in batch_sizes:
        options = v if isinstance(v, dict) else {"max_batch_size": v}
        batch = options["max_batch_size"]
        extra = {k: x for k, x in options.items() if k != "max_batch_size"}
        enc = load_audio_tokenizer(spec(codec, path, batch, **extra), device=device)
        if ref is None:
            clips = clip_set(enc.sample_rate, seconds, repeats)
            d = enc.describe()
            info = {"sample_rate": enc.sample_rate, "n_codebooks": enc.n_codebooks, "resampler": d.get("resampler"),
                    "clips": len(clips), "audio_s": round(sum(c.size for c in clips) / enc.sample_rate, 2)}
        runs: list = []
        s = statistics.median(_time_calls(lambda e=enc: runs.append(e.encode(clips)), calls, device))
        ref = runs[0] if ref is None else ref
        key = (batch, extra.get("bucket_s", 0.0))
        row = {"max_batch_size": batch, **extra, "s_per_call": round(s, 4), "audio_s_per_s": round(info["audio_s"] / s, 1),
               "vs_batch_1": compare(ref, runs[0]), "repeat": compare(runs[0], runs[-1])}
        if extra.get("processes", 1) == 1:
            one_process[key] = runs[0]
        elif key in one_process:
            row["vs_one_process"] = compare(one_process[key], runs[0])
        rows.append(row)
        print(json.dumps({"codec": codec, **rows[-1]}), flush=True)
        if enc._pool is not None:
            enc._pool.close()
        del enc  # free its GPU memory before the next batch size
    return {"codec": codec, "model": path.name, **info, "runs": rows}


def places(codec: str, path: Path, device: str, seconds: float, batch: int, bucket_s: float = 0.0) -> dict:
    """At each place ``p`` of a fixed-shape call of ``batch`` clips (``seconds`` long, ``bucket_s``), clip 0's
    codes with the other clips beside it against its codes with zero slots beside it
    (:meth:`precompute.encoders.audio.HFCodecTokenizer.encode_placed`, what ``shardcache check`` rebuilds),
    and against its codes at place 0. Batching can be reproducible and checkable only where the first
    comparison is identical at every place."""
    from precompute.encoders import load_audio_tokenizer
    from precompute.encoders.batching import Call
    enc = load_audio_tokenizer(spec(codec, path, batch, bucket_s=bucket_s), device=device)
    clips = clip_set(enc.sample_rate, [seconds], batch)
    (call,) = enc.plan([c.size for c in clips])
    rows, at0 = [], None
    for p in range(batch):
        order = clips[1:p + 1] + [clips[0]] + clips[p + 1:]
        real = enc.submit(order, [Call(batch, call.length, tuple(range(batch)))]).result()[p]
        zero = enc.encode_placed(clips[0], batch, call.length, p)
        at0 = real if at0 is None else at0
        rows.append({"place": p, "zero_vs_real": compare([real], [zero]), "vs_place_0": compare([at0], [real])})
    out = {"codec": codec, "batch": batch, "length": call.length, "bucket_s": bucket_s, "seconds": seconds,
           "places": rows, "zero_equals_real_everywhere": all(r["zero_vs_real"]["identical"] for r in rows)}
    print(json.dumps(out), flush=True)
    return out


def composition(codec: str, path: Path, device: str, seconds: float, batch: int) -> dict:
    """Does a clip's code in a batch of ``batch`` equal-length clips depend on the other clips? Clip 0
    (``seconds`` long) encoded in four calls of ``batch`` clips: with clips 1..batch-1, with other clips,
    with silent (zero) clips, and moved to the last place; each compared with the first (``compare``), and
    clip 0 alone (``max_batch_size`` 1) with the first. A function of the clip alone at a fixed batch shape
    would make batched codes reproducible by padding every call to ``batch`` clips."""
    import numpy as np
    from precompute.encoders import load_audio_tokenizer
    enc = load_audio_tokenizer(spec(codec, path, batch), device=device)
    clips = clip_set(enc.sample_rate, [seconds], 2 * batch)
    first = enc.encode(clips[:batch])[0]
    calls = {"other_clips": [clips[0], *clips[batch:2 * batch - 1]], "silent_clips": [clips[0]] + [
             np.zeros_like(clips[0])] * (batch - 1), "moved_last": [*clips[1:batch], clips[0]]}
    out = {k: compare([first], [enc.encode(v)[0 if k != "moved_last" else -1]]) for k, v in calls.items()}
    alone = load_audio_tokenizer(spec(codec, path, 1), device=device).encode([clips[0]])[0]
    out = {"codec": codec, "batch": batch, "seconds": seconds, **out, "alone": compare([first], [alone])}
    print(json.dumps(out), flush=True)
    return out


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [f"**Codec codes batched vs clip by clip** ({m['gpu'] or 'CPU'}; torch {m['torch']}; {m['date']}; "
             f"random weights of the {r['size']} size; {r['repeats']} clips each of {r['seconds']} s; "
             "`python -m benchmarks.gpu_codec_batch`):", "",
             "| codec | max_batch_size | bucket_s | processes | s of audio/s | clips identical to batch 1 | equal codes "
             "| max frames differing | repeat identical |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in r["codecs"]:
        for x in c["runs"]:
            v, rep = x["vs_batch_1"], x["repeat"]
            lines.append(f"| {c['codec']} | {x['max_batch_size']} | {x.get('bucket_s', 0.0)} | {x.get('processes', 1)} | "
                         f"{x['audio_s_per_s']} | {v['identical']}/{v['total']} | "
                         f"{v['equal_codes']:.6f} | {v['max_frames_differing']} | {rep['identical']}/{rep['total']} |")
    if r.get("composition"):
        lines += ["", "Clip 0's codes in a batch of equal-length clips, against its codes in the first batch "
                  "(:func:`composition`): identical?", "",
                  "| codec | batch | other clips | silent clips | moved last | alone |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {c['codec']} | {c['batch']} | " + " | ".join(
            "yes" if c[k]["identical"] else f"no ({c[k]['equal_codes']:.4f})"
            for k in ("other_clips", "silent_clips", "moved_last", "alone")) + " |" for c in r["composition"]]
    for c in r.get("places") or []:
        lines += ["", f"{c['codec']}: clip 0 at each place of a call of {c['batch']} x {c['length']} samples: with zero "
                  "slots beside it (what check rebuilds) vs with real clips; and vs place 0:", "",
                  "| place | zero = real companions | equal to place 0 |", "| --- | --- | --- |"]
        lines += [f"| {x['place']} | {'yes' if x['zero_vs_real']['identical'] else 'no (%.4f)' % x['zero_vs_real']['equal_codes']} "
                  f"| {'yes' if x['vs_place_0']['identical'] else 'no (%.4f)' % x['vs_place_0']['equal_codes']} |"
                  for x in c["places"]]
    if any("vs_one_process" in x for c in r["codecs"] for x in c["runs"]):
        lines += ["", "Two codec processes vs one (the same batch policy): clips identical", ""]
        lines += [f"- {c['codec']} max_batch_size {x['max_batch_size']} bucket_s {x.get('bucket_s', 0.0)} processes "
                  f"{x['processes']}: {x['vs_one_process']['identical']}/{x['vs_one_process']['total']}, "
                  f"{x['audio_s_per_s']} s of audio/s" for c in r["codecs"] for x in c["runs"] if "vs_one_process" in x]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codecs", nargs="+", choices=list(RECIPE_CONFIGS), default=list(RECIPE_CONFIGS))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16],
                    help="max_batch_size values; the first is the reference (default %(default)s)")
    ap.add_argument("--seconds", type=float, nargs="+", default=[10.0, 5.0, 7.3], help="clip lengths, s (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=16, help="clips of each length (default %(default)s)")
    ap.add_argument("--calls", type=int, default=3, help="timed encode calls per batch size (default %(default)s)")
    ap.add_argument("--out", type=Path, default=None, help=f"folder for gpu_codec_batch.json/.md (default {RESULTS}; "
                    "--smoke: none)")
    ap.add_argument("--composition-only", action="store_true", help="only the composition probe (:func:`composition`)")
    ap.add_argument("--variants", nargs="+", default=None, metavar="B[:BUCKET_S][:pN]",
                    help="codec options to time instead of --batch-sizes (e.g. 1 8:1.0 p2 8:1.0:p2)")
    ap.add_argument("--places", type=int, default=0, metavar="B", help="also the place probe with calls of B clips")
    ap.add_argument("--places-bucket", type=float, default=1.0, help="bucket_s of the place probe (default %(default)s)")
    ap.add_argument("--smoke", action="store_true", help="the CPU, tiny models, 2 clips each of 1, 0.5 and 0.73 s, "
                    "batch sizes 1 and 2: checks the code")
    args = ap.parse_args(argv)
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.gpu_codec_batch needs a CUDA GPU: nothing measured, no figures written.")
        return 0
    device, size = ("cpu", "tiny") if args.smoke else ("cuda", "full")
    seconds, repeats, batch_sizes = ([1.0, 0.5, 0.73], 2, [1, 2]) if args.smoke else \
        (args.seconds, args.repeats, args.batch_sizes)
    if args.variants:
        batch_sizes = [variant(v) for v in args.variants]
    out = args.out if args.smoke else args.out or RESULTS
    dirs = _models(size, [CODECS[c] for c in args.codecs])
    result = {"machine": machine(), "device": device, "size": size, "seconds": seconds, "repeats": repeats,
              "calls": args.calls, "codecs": []}
    for codec in args.codecs:
        if not args.composition_only:
            result["codecs"].append(bench_codec(codec, dirs[CODECS[codec]], device, seconds, repeats, batch_sizes,
                                                args.calls))
        if not args.variants:
            result.setdefault("composition", []).append(composition(codec, dirs[CODECS[codec]], device, seconds[0],
                                                                    batch_sizes[-1]))
        if args.places:
            result.setdefault("places", []).append(places(codec, dirs[CODECS[codec]], device, seconds[0], args.places,
                                                          args.places_bucket))
        write_result(out, "gpu_codec_batch", result, markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
