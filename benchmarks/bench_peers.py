"""The same samples read by the peers: LitData ``StreamingDataset`` and Mosaic ``StreamingDataset``.

Runs in the benchmark venv (``make bench-venv``: ``.venv-bench``, which has ``litdata`` and
``mosaicml-streaming`` and the same torch version as ``.venv``; they pin versions of numpy and
transformers this project does not use, hence a venv of their own). ``benchmarks/bench_loader.py``
exports the samples of its cache (one ``.npz`` per sample: ``audio`` int16, ``codes`` int16,
``input_ids`` int32, ``latents`` float16, exactly the arrays ShardLoader reads) and calls::

    .venv-bench/bin/python benchmarks/bench_peers.py --samples DIR --work DIR --out peers.json

For each peer: write the samples in its own format with its own writer (``litdata.optimize`` into
64 MB chunks; ``streaming.MDSWriter`` with ``ndarray`` columns into 64 MB shards), read every sample
once to fill the page cache, then ``--epochs`` epochs in this one process (no DataLoader, no
workers, no shuffling: each peer's fastest way through its own files), each sample delivered as the
peer delivers it (a dict of numpy arrays, not collated). With ``--cat FILES`` (bench_loader.py passes
ShardLoader's shards) each epoch follows one ``cat FILES > /dev/null``, and ``ratio_to_cat`` is the
median over the epochs of the epoch's rate over that ``cat``'s, as bench_loader.py measures ShardLoader:
the two are compared through ratios each measured a moment apart (this VM's memory speed changes by
2x from one minute to the next). Reports samples/s per epoch and their median, and checks the first
sample against the exported arrays (a peer that reads wrongly would flatter itself). Writes JSON.

torchvision: Mosaic's package imports ``torchvision`` at import time (its vision datasets); PyPI's
torchvision wheels for Linux are built for CUDA torch and fail to load with a CPU torch. When that
happens a stand-in module with the two names ``streaming`` imports is used; no torchvision code
runs in this benchmark either way.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

FIELDS = ("audio", "codes", "input_ids", "latents")


def load_samples(folder: Path) -> list[dict[str, np.ndarray]]:
    files = sorted(folder.glob("*.npz"))
    out = []
    for f in files:
        with np.load(f, allow_pickle=False) as z:
            out.append({k: z[k] for k in FIELDS})
    return out


#: files one ``cat`` reads before each epoch (``--cat``), or none
CAT: list[str] = []


def _timed_epochs(make_iter, epochs: int, n: int) -> dict:
    """Samples/s of ``epochs`` epochs (after a warm one), each after a ``cat`` of :data:`CAT`."""
    for _ in make_iter():  # warm: the page cache, the peer's own caches and index
        pass
    rates, cats = [], []
    for _ in range(epochs):
        if CAT:
            t0 = time.perf_counter()
            subprocess.run(["cat", *CAT], stdout=subprocess.DEVNULL, check=True)
            cats.append(n / (time.perf_counter() - t0))
        t0, k = time.perf_counter(), 0
        for _ in make_iter():
            k += 1
        rates.append(k / (time.perf_counter() - t0))
        assert k == n, f"read {k} samples of {n}"
    out = {"samples_s_epochs": rates, "samples_s": statistics.median(rates)}
    if cats:
        out.update(cat_samples_s_rounds=cats, ratio_to_cat=statistics.median(r / c for r, c in zip(rates, cats)))
    return out


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(np.asarray(a[k]), b[k]) and np.asarray(a[k]).dtype == b[k].dtype for k in FIELDS)


def bench_litdata(samples: list[dict], work: Path, epochs: int) -> dict:
    import litdata
    from litdata import StreamingDataset, optimize
    out = work / "litdata"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    optimize(fn=_litdata_item, inputs=[(str(work / "samples"), i) for i in range(len(samples))],
             output_dir=str(out), chunk_bytes="64MB", num_workers=1, verbose=False)
    write_s = time.perf_counter() - t0
    ds = StreamingDataset(str(out), shuffle=False)  # one dataset, iterated once per epoch (as ShardLoader)
    ok = _same(ds[0], samples[0])
    timed = _timed_epochs(lambda: iter(ds), epochs, len(samples))
    return {"version": litdata.__version__, "write_s": write_s, **timed, "first_sample_matches": bool(ok),
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}


def _litdata_item(arg):
    folder, i = arg
    with np.load(Path(folder) / f"{i:06d}.npz", allow_pickle=False) as z:
        return {k: z[k] for k in FIELDS}


def _import_streaming():
    try:
        import streaming  # noqa: F401
    except (RuntimeError, ImportError, OSError) as e:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.") or
                     m == "streaming" or m.startswith("streaming.")]:
            del sys.modules[name]
        tv = types.ModuleType("torchvision")
        tv.datasets = types.ModuleType("torchvision.datasets")
        tv.datasets.VisionDataset = type("VisionDataset", (), {})
        tv.transforms = types.ModuleType("torchvision.transforms")
        tv.transforms.functional = types.ModuleType("torchvision.transforms.functional")
        tv.transforms.functional.to_tensor = None
        for m in (tv, tv.datasets, tv.transforms, tv.transforms.functional):
            sys.modules[m.__name__] = m
        print(f"mosaic: torchvision does not load with this torch ({type(e).__name__}); using a stand-in",
              file=sys.stderr)
    import streaming
    return streaming


def bench_mosaic(samples: list[dict], work: Path, epochs: int) -> dict:
    streaming = _import_streaming()
    from streaming import MDSWriter, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    out = work / "mds"
    shutil.rmtree(out, ignore_errors=True)
    cols = {"audio": "ndarray:int16", "codes": "ndarray:int16", "input_ids": "ndarray:int32",
            "latents": "ndarray:float16"}
    t0 = time.perf_counter()
    with MDSWriter(out=str(out), columns=cols, size_limit=64 << 20) as w:
        for s in samples:
            w.write(s)
    write_s = time.perf_counter() - t0
    clean_stale_shared_memory()

    ds = StreamingDataset(local=str(out), shuffle=False, batch_size=1)  # iterated once per epoch
    ok = _same(ds[0], samples[0])
    timed = _timed_epochs(lambda: iter(ds), epochs, len(samples))
    return {"version": streaming.__version__, "write_s": write_s, **timed, "first_sample_matches": bool(ok),
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=Path, required=True, help="folder of NNNNNN.npz samples")
    ap.add_argument("--work", type=Path, required=True, help="scratch folder for the peers' files")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--cat", nargs="*", default=[], help="files to cat before each epoch (ratio_to_cat)")
    args = ap.parse_args(argv)
    CAT[:] = args.cat
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    samples = load_samples(args.samples)
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.work / "samples").exists():  # the folder litdata.optimize's workers read from
        os.symlink(args.samples.resolve(), args.work / "samples")
    result: dict = {"samples": len(samples), "python": sys.version.split()[0]}
    for name, fn in (("litdata", bench_litdata), ("mosaic", bench_mosaic)):
        try:
            result[name] = fn(samples, args.work, args.epochs)
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, the other still runs
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{name}: {result[name]}", file=sys.stderr)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
