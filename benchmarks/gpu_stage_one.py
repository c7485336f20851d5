"""Stage one's GPU checks in one call of about 5 minutes (``make bench-gpu-stage-one``).

    python -m benchmarks.gpu_stage_one [--out DIR] [--rows 600] [--skip places,codec,tts,theworld]
    python -m benchmarks.gpu_stage_one --smoke      # the same code on the CPU, tiny models, a few rows

In the order of what a short device lease must answer first, each piece writing
``gpu_stage_one.json`` and ``.md`` when done (a call cut short keeps what it finished):

1. ``places``: at every place of a fixed-shape call (8 clips x 1 s buckets), whether a clip's codes
   with zero slots beside it equal its codes with real clips beside it, for the Higgs tokenizer and
   DAC (:func:`benchmarks.gpu_codec_batch.places`): batched codes are checkable (``shardcache
   check`` rebuilds the recorded call with zero slots) only where they are, and batching can become
   the default only then;
2. ``codec``: the Higgs tokenizer's seconds of audio per second on clips of unequal lengths (2.6 to
   12.9 s): clip by clip, batched (8 x 1 s buckets), and each with ``processes: 2``; codes run to run
   and 2 processes against 1 (:func:`benchmarks.gpu_codec_batch.bench_codec`). Target: >= 2,000 s/s;
3. ``tts`` and ``theworld``: the recipes' jobs at their default settings at steady state, ``--rows``
   rows each, against their encoders alone, with where the time went (the encoder thread's host and
   device time, the main thread's waits: :func:`benchmarks.gpu_steady.bench`). Target: <= 1.10.

Random weights of the real sizes (``python -m tools.testing --size full``, built on demand).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpu_codec_batch as cb  # noqa: E402  (installs the torchaudio shim)
from benchmarks import gpu_steady  # noqa: E402
from benchmarks.run import RESULTS, machine, write_result  # noqa: E402

PIECES = ("places", "codec", "tts", "theworld")
#: the codec piece's clips: lengths (s) of unequal clips, as real speech is
SECONDS = [10.0, 4.2, 7.3, 12.9, 2.6, 8.8]


def markdown(r: dict) -> str:
    lines = [f"**Stage one on a GPU, issue 43's checks** ({r['machine']['gpu'] or 'CPU'}; torch {r['machine']['torch']}; "
             f"{r['machine']['date']}; random weights; `python -m benchmarks.gpu_stage_one`):", ""]
    if r.get("places") or r.get("codecs"):
        lines += cb.markdown({"machine": r["machine"], "size": r["size"], "repeats": r["repeats"], "seconds": SECONDS,
                              "codecs": r.get("codecs", []), "places": r.get("places", [])}).splitlines()[2:]
    if r.get("jobs"):
        lines += [""] + gpu_steady.markdown({"machine": r["machine"], "overrides": [], "jobs": r["jobs"]}).splitlines()
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu_stage_one.json/.md")
    ap.add_argument("--rows", type=int, default=600, help="rows of each steady-state job (default %(default)s)")
    ap.add_argument("--skip", default="", help=f"comma list of pieces to skip ({', '.join(PIECES)})")
    ap.add_argument("--smoke", action="store_true", help="the CPU, tiny models, a few rows: checks the code")
    args = ap.parse_args(argv)
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    import torch
    if not args.smoke and not torch.cuda.is_available():
        print("benchmarks.gpu_stage_one needs a CUDA GPU: nothing measured, no figures written.")
        return 0
    device, size = ("cpu", "tiny") if args.smoke else ("cuda", "full")
    rows, distinct, alone, repeats, batch = (16, 8, 8, 1, 2) if args.smoke else (args.rows, args.rows // 2, 128, 8, 8)
    skip = set(filter(None, args.skip.split(",")))
    out = None if args.smoke else args.out
    t0 = time.perf_counter()
    dirs = cb._models(size, [cb.CODECS[c] for c in ("higgs", "dac")])
    r = {"machine": machine(), "size": size, "repeats": repeats, "models_s": round(time.perf_counter() - t0, 1)}
    seconds = [s / 10 for s in SECONDS] if args.smoke else SECONDS
    if "places" not in skip:
        r["places"] = [cb.places(c, dirs[cb.CODECS[c]], device, seconds[0], batch, 1.0 if not args.smoke else 0.5)
                       for c in ("higgs", "dac")]
        write_result(out, "gpu_stage_one", r, markdown(r))
    if "codec" not in skip:
        variants = [cb.variant(v) for v in ("1", f"{batch}:1.0", "1:p2", f"{batch}:1.0:p2")]
        r["codecs"] = [cb.bench_codec("higgs", dirs[cb.CODECS["higgs"]], device, seconds, repeats, variants, 2)]
        write_result(out, "gpu_stage_one", r, markdown(r))
    steady = [j for j in ("tts", "theworld") if j not in skip]
    if steady:
        models = gpu_steady.models(size)
        r["jobs"] = []
        for job in steady:
            r["jobs"].append(gpu_steady.bench(job, models, device, rows, distinct, alone))
            print(json.dumps(r["jobs"][-1]), flush=True)
            write_result(out, "gpu_stage_one", r, markdown(r))
    r["total_s"] = round(time.perf_counter() - t0, 1)
    write_result(out, "gpu_stage_one", r, markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
