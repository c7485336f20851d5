"""Stage two: collated torch batches per second vs ``cat`` and the peers, on the same samples.

Builds a realistic synthetic cache in a temporary directory (default 1000 samples in 8 shards:
7 s of 16 kHz int16 audio, (8, 175) int16 codes, (16, 1, 64, 64) float16 latents, ~60 text ids,
about 350 KiB per sample; the manifest records codebook and vocabulary sizes, as stage one's does),
then measures in one run, everything from the page cache:

1. ``cat``: ``cat shards > /dev/null`` (MB/s, median of 3): the ceiling for reading these bytes.
   Next to it the one-copy ceiling (:func:`bench_copy_ceiling`): each sample's bytes read by one
   ``preadv`` into its place in a reused batch-sized buffer, no other work. ``cat`` reads into a
   128 KiB buffer that never leaves the core's cache; a loader's destination is a batch of
   megabytes, and on this shared VM that copy runs from 0.3x to 1.0x ``cat``'s rate depending on
   the moment, so this row says how much of the gap to ``cat`` is the machine's and how much ours.
2. ``shardloader``: :class:`loaders.ShardLoader` delivering padded, collated batches, one process
   (``num_workers=0``: two read-ahead threads, and one, "read on demand") and with persistent
   workers: ``compact`` (int16 audio, float16 latents as stored, widened on the GPU) and float32
   (widened on the host); one process compact also with ``checks="values"`` (the value checks every
   read did before checksums) and ``checks="none"`` (nothing checked), so the cost of the checksum
   is in every run. The loaders are built once and their epochs interleaved round by round, each
   round opened by one ``cat`` of the shards: samples/s is the median over ``--epochs`` rounds after
   a warm-up epoch, and every ratio (to ``cat``, between configurations) is the median over the
   rounds of the ratio within the round. This VM's memory speed changes by 2x from one minute to the
   next (``cat`` itself: 15,000-25,000 samples/s on one day), so only rates measured a moment apart
   compare; LitData and Mosaic are compared the same way, through their ratio to a ``cat`` run
   right before each of their epochs.
3. the peers on the same samples: LitData and Mosaic Streaming ``StreamingDataset`` in one process,
   per-sample dicts of numpy arrays, no collation (``benchmarks/bench_peers.py``, run in the
   benchmark venv ``.venv-bench``: ``make bench-venv``; skipped with a message without it).
4. ``webdataset``: ``webdataset.WebDataset(shards, shardshuffle=False).decode()``, per-sample dicts.
5. startup (build the loader from the index) and resume latency: a fresh loader, ``load_state_dict``
   at 10 % and 90 % of an epoch, until the first batch arrives, next to iterating to that point.
6. RSS over 3 epochs with persistent workers (``RssAnon``: what a leak grows; ``RssFile``).
7. forkserver workers (the start method when CUDA is initialised): the first batch of three loaders
   made one after the other in a fresh process, with :data:`loaders.context.FORKSERVER_PRELOAD` and
   without it (each worker then imports torch and the loaders itself).

Prints a table and writes ``benchmarks/results/loader.json``. CPU time (``process_time``) is
reported next to wall time for the one-process runs: on a shared machine the wall rate depends on
the neighbours.

Usage: ``python benchmarks/bench_loader.py [--samples 1000] [--shards 8] [--batch-size 16]``
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loaders import Reads, ShardLoader, Workers  # noqa: E402
from shards import Cache, ShardWriter, merge_parts, shard_name  # noqa: E402

#: the settings of the configurations below that are loaders.Workers' (the others are loaders.Reads')
WORKERS = ("num_workers", "read_threads", "prefetch_factor")


def build_cache(out: Path, n: int, n_shards: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    per = -(-n // n_shards)
    k = 0
    for s in range(n_shards):
        with ShardWriter(out, shard_name(0, s)) as w:
            for _ in range(min(per, n - k)):
                T = 7 * 16000  # the same sample shape as in earlier runs, so the figures compare;
                # conversation caches made by precompute are measured separately (--real-cache)
                w.add(f"utt{k:07d}", {
                    "json": {"sample_rate": 16000, "duration_s": T / 16000, "speaker": f"spk{k % 50}",
                             "text": "a synthetic utterance of about sixty tokens"},
                    "codes.npy": rng.integers(0, 1024, (8, 175), dtype=np.int16),
                    "audio.npy": (rng.standard_normal(T) * 3000).astype(np.int16),
                    "input_ids.npy": rng.integers(1, 32000, int(rng.integers(50, 70)), dtype=np.int32),
                    "latents.npy": rng.standard_normal((16, 1, 64, 64)).astype(np.float16),
                })
                k += 1
            w.commit()
    # the sizes a real cache records: reads of a cache without checksums check values against them
    merge_parts(out, {"benchmark": "bench_loader", "codebook_size": 1024, "n_codebooks": 8,
                      "text": {"vocab_size": 32000, "pad_id": 0}})
    return out


def _timed(fn, repeat: int = 1) -> tuple[float, float, object]:
    """Best (wall, cpu) seconds over ``repeat`` calls of ``fn`` and its last result."""
    best_w = best_c = float("inf")
    res = None
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        res = fn()
        best_w, best_c = min(best_w, time.perf_counter() - w0), min(best_c, time.process_time() - c0)
    return best_w, best_c, res


def bench_cat(files: list[Path], min_bytes: int = 256 << 20) -> dict:
    """``cat`` to /dev/null: median wall time of 3, and its CPU time (user + sys of the child).

    Small caches are listed several times in one ``cat`` call (at least ``min_bytes`` in all), so
    the process start does not count as reading time.
    """
    once = sum(f.stat().st_size for f in files)
    reps = max(1, -(-min_bytes // max(once, 1)))
    nbytes = once * reps
    cmd = ["cat", *map(str, files * reps)]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)  # warm the page cache
    walls, cpus = [], []
    for _ in range(3):
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
        walls.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime))
    wall, cpu = statistics.median(walls), max(statistics.median(cpus), 1e-3)
    return {"bytes": once, "wall_s": wall, "cpu_s": cpu, "MB_s": nbytes / wall / 1e6,
            "MB_s_cpu": nbytes / cpu / 1e6, "MB_s_runs": [nbytes / w / 1e6 for w in walls]}


def bench_copy_ceiling(cache: Path, batch_size: int, repeat: int = 3) -> dict:
    """What this machine's memory allows any reader that hands out a batch in memory, measured in the
    same run as ``cat`` and the loaders. Each sample's bytes (its first member to its last, tar
    headers included) in random order, by one ``os.preadv`` per sample and no other Python:

    * ``batch``: into the sample's place in a reused buffer of ``batch_size`` samples (the one copy
      a loader makes: its destination is a batch, megabytes, larger than a core's L2 cache);
    * ``l2``: into one 128 KiB buffer reused for every read (``cat``'s way: its destination never
      leaves the core's cache; a sample larger than it is read in pieces).

    Returns samples/s (median of ``repeat`` passes) of each. The ratio batch / ``cat`` bounds what a
    one-copy loader can reach on this machine at this moment."""
    import pyarrow.compute as pc
    from shards import read_index
    t = read_index(cache)
    members = t.column("members").combine_chunks()
    flat = pc.list_flatten(members)
    parent = pc.list_parent_indices(members).to_numpy()
    off = pc.struct_field(flat, "offset").to_numpy()
    end = off + pc.struct_field(flat, "size").to_numpy()
    first = np.full(t.num_rows, np.iinfo(np.int64).max)
    last = np.zeros(t.num_rows, np.int64)
    np.minimum.at(first, parent, off)
    np.maximum.at(last, parent, end)
    first -= 512  # the first member's tar header
    shards = t.column("shard").to_pylist()
    fds = {name: os.open(cache / name, os.O_RDONLY) for name in set(shards)}
    order = np.random.default_rng(0).permutation(t.num_rows).tolist()
    size = (last - first).tolist()
    start, fd = first.tolist(), [fds[x] for x in shards]
    per = max(size)
    batch = np.empty(per * batch_size, dtype=np.uint8)
    slots = [memoryview(batch)[k * per:(k + 1) * per] for k in range(batch_size)]
    small = memoryview(np.empty(128 << 10, dtype=np.uint8))

    def into_batch():
        for k, i in enumerate(order):
            os.preadv(fd[i], [slots[k % batch_size][:size[i]]], start[i])

    def into_l2():
        for i in order:
            done, n = 0, size[i]
            while done < n:
                done += os.preadv(fd[i], [small[:min(len(small), n - done)]], start[i] + done)

    out = {}
    try:
        for name, fn in (("batch", into_batch), ("l2", into_l2)):
            fn()
            walls = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                walls.append(time.perf_counter() - t0)
            out[name] = {"samples_s": len(order) / statistics.median(walls)}
    finally:
        for x in fds.values():
            os.close(x)
    return out


#: the loader configurations every run measures: (label, ShardLoader keyword arguments)
CONFIGS = [
    ("one process, compact", dict(num_workers=0, compact=True)),
    ("one process, compact, read on demand", dict(num_workers=0, compact=True, read_threads=1)),
    ("one process, compact, checks=values", dict(num_workers=0, compact=True, checks="values")),
    ("one process, compact, checks=none", dict(num_workers=0, compact=True, checks="none")),
    ("one process, compact, read on demand, checks=none", dict(num_workers=0, compact=True, read_threads=1,
                                                              checks="none")),
    ("one process, float32", dict(num_workers=0, compact=False)),
    ("1 worker, compact", dict(num_workers=1, compact=True)),
    ("2 workers, compact", dict(num_workers=2, compact=True)),
    ("2 workers, compact, prefetch_factor=4", dict(num_workers=2, compact=True, prefetch_factor=4)),
    ("2 workers, float32", dict(num_workers=2, compact=False)),
]


def cat_rate(files: list[Path], n_samples: int) -> float:
    """Samples/s of one ``cat files > /dev/null`` (the page cache's rate right now)."""
    t0 = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    return n_samples / (time.perf_counter() - t0)


def bench_loaders(cache: Path | str, batch_size: int, shard_bytes: int, n_total: int, epochs: int = 3,
                  configs=CONFIGS) -> list[dict]:
    """Each configuration's loader built once (persistent workers), one warm-up epoch each, then
    ``epochs`` rounds: one ``cat`` of the shards (:func:`cat_rate`), then one epoch per loader in
    turn (in the opposite order every other round). samples/s = median over the rounds;
    ``ratio_to_cat`` = median over the rounds of the epoch's rate over that round's ``cat`` (this
    VM's memory speed changes by 2x from one minute to the next: a ratio measured a second apart
    holds, one against a ``cat`` of another minute does not); ``samples_s_epochs`` /
    ``cat_samples_s_rounds`` keep the rounds for paired ratios."""
    loaders = [(label, kw, ShardLoader(cache, batch_size, seed=0, workers=Workers(**{k: v for k, v in kw.items() if k in WORKERS}),
                                       reads=Reads(**{k: v for k, v in kw.items() if k not in WORKERS})))
               for label, kw in configs]
    walls = {label: [] for label, _ in configs}
    cpus = {label: [] for label, _ in configs}
    counts = {}
    files = sorted(Path(cache).glob("shard-*.tar"))
    cats = []

    def one_epoch(loader, e):
        loader.set_epoch(e)
        return sum(len(b["keys"]) for b in loader)

    for _, _, ld in loaders:
        one_epoch(ld, 0)
    for e in range(1, epochs + 1):
        cats.append(cat_rate(files, n_total))
        for label, _, ld in (loaders if e % 2 else loaders[::-1]):  # every other round backwards: no order bias
            w0, c0 = time.perf_counter(), time.process_time()
            counts[label] = one_epoch(ld, e)
            walls[label].append(time.perf_counter() - w0)
            cpus[label].append(time.process_time() - c0)
    out = []
    for label, kw, ld in loaders:
        ld.close()
        n, wall, cpu = counts[label], statistics.median(walls[label]), statistics.median(cpus[label])
        mb = shard_bytes * n / n_total / 1e6
        one = kw.get("num_workers", 0) == 0
        rates = [n / w for w in walls[label]]
        out.append({"label": label, "num_workers": kw.get("num_workers", 0), "compact": bool(kw.get("compact")),
                    "checks": kw.get("checks", "checksums"), "read_threads": kw.get("read_threads", 2),
                    "samples": n, "wall_s": wall, "cpu_s": cpu,
                    "samples_s": n / wall, "samples_s_epochs": rates, "cat_samples_s_rounds": cats,
                    "ratio_to_cat": statistics.median(r / c for r, c in zip(rates, cats)),
                    "MB_s": mb / wall, "MB_s_cpu": mb / cpu if one else None})
    return out


def paired(rows: list[dict], a: str, b: str) -> float:
    """Median over the rounds of configuration ``a``'s rate over ``b``'s (epochs of one round run
    back to back)."""
    by = {r["label"]: r["samples_s_epochs"] for r in rows}
    return statistics.median(x / y for x, y in zip(by[a], by[b]))


def export_samples(cache: Path, out: Path) -> Path:
    """The cache's samples as ``NNNNNN.npz`` (audio, codes, input_ids, latents): the input of the
    peers' own writers (``bench_peers.py``)."""
    from shards import ShardReader
    out.mkdir(parents=True, exist_ok=True)
    r = ShardReader(cache)
    for i in range(len(r)):
        s = r.get(i)
        np.savez(out / f"{i:06d}.npz", **{k: s[k] for k in ("audio", "codes", "input_ids", "latents")})
    r.close()
    return out


def bench_venv_python() -> Path | None:
    """The benchmark venv's python (``$SHARDCACHE_BENCH_PYTHON``, else ``.venv-bench``), or None."""
    p = Path(os.environ.get("SHARDCACHE_BENCH_PYTHON", ROOT / ".venv-bench" / "bin" / "python"))
    return p if p.exists() else None


def bench_peers(cache: Path, work: Path, epochs: int = 3) -> dict:
    """LitData and Mosaic Streaming on the cache's samples (see ``bench_peers.py``); ``{"skipped":
    why}`` when the benchmark venv is missing or the run fails."""
    py = bench_venv_python()
    if py is None:
        return {"skipped": "no benchmark venv (.venv-bench): `make bench-venv` installs litdata and "
                           "mosaicml-streaming there"}
    samples = export_samples(cache, work / "samples")
    out = work / "peers.json"
    cat = [str(p) for p in sorted(cache.glob("shard-*.tar"))]
    r = subprocess.run([str(py), str(ROOT / "benchmarks" / "bench_peers.py"), "--samples", str(samples),
                        "--work", str(work / "peers"), "--out", str(out), "--epochs", str(epochs), "--cat", *cat],
                       cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=""))
    if r.returncode != 0 or not out.exists():
        return {"skipped": f"bench_peers.py failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}"}
    return json.loads(out.read_text())


def bench_remote(cache: Path, batch_size: int, shard_bytes: int, n_total: int, local_rate: float) -> dict:
    """The same cache streamed from a local S3 server (moto, its own process): the first epoch
    (every shard downloaded), the next (all held locally), and two epochs with ``cache_limit`` a
    quarter of the cache (shards evicted and fetched again every epoch). Rates as ratios to
    ``local_rate`` (the local loader, num_workers=0, compact, same run)."""
    from s3_server import s3_server
    out = {}
    with s3_server() as s3:
        url = s3.upload(cache, "s3://bench/cache")
        tmp = Path(tempfile.mkdtemp(prefix="bench_remote_"))
        try:
            ld = ShardLoader(Cache.open(url, storage_options=s3.options, local_dir=tmp / "a"), batch_size, seed=0, reads=Reads(compact=True))
            for e, name in ((0, "cold_epoch"), (1, "warm_epoch")):
                ld.set_epoch(e)
                t0 = time.perf_counter()
                n = sum(len(b["keys"]) for b in ld)
                dt = time.perf_counter() - t0
                out[name] = {"samples_s": n / dt, "ratio_to_local": n / dt / local_rate}
            ld.close()
            limit = shard_bytes // 4
            ld = ShardLoader(Cache.open(url, storage_options=s3.options, local_dir=tmp / "b"), batch_size, seed=0, reads=Reads(compact=True, cache_limit=limit))
            t0, n = time.perf_counter(), 0
            for e in range(2):
                ld.set_epoch(e)
                n += sum(len(b["keys"]) for b in ld)
            dt = time.perf_counter() - t0
            st = ld.prefetcher.stats
            out["cache_limited"] = {"cache_limit": limit, "samples_s": n / dt, "ratio_to_local": n / dt / local_rate,
                                    "downloaded_over_cache_bytes_per_epoch": st["bytes"] / shard_bytes / 2,
                                    "peak_local_bytes_over_limit": st["peak_bytes"] / limit, **st}
            ld.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def bench_webdataset(files: list[Path], shard_bytes: int) -> dict:
    import webdataset as wds

    def run():
        n = 0
        for _ in wds.WebDataset([str(f) for f in files], shardshuffle=False).decode():
            n += 1
        return n

    run()
    wall, cpu, n = _timed(run, 2)
    return {"samples": n, "wall_s": wall, "cpu_s": cpu, "samples_s": n / wall, "MB_s": shard_bytes / wall / 1e6}


def bench_resume(cache: Path, batch_size: int, num_workers: int) -> list[dict]:
    steps = len(ShardLoader(cache, batch_size, seed=0))
    out = []
    for frac in (0.1, 0.9):
        k = max(1, int(steps * frac))
        ref = ShardLoader(cache, batch_size, seed=0)
        t0 = time.perf_counter()
        it = iter(ref)
        for _ in range(k):
            next(it)
        replay = time.perf_counter() - t0
        sd = ref.state_dict()
        t0 = time.perf_counter()
        fresh = ShardLoader(cache, batch_size, seed=0, workers=Workers(num_workers=num_workers))
        t1 = time.perf_counter()
        fresh.load_state_dict(sd)
        first = next(iter(fresh))
        t2 = time.perf_counter()
        assert first["keys"] == next(it)["keys"]
        fresh.close()
        out.append({"fraction": frac, "step": k, "num_workers": num_workers, "construct_s": t1 - t0,
                    "resume_to_first_batch_s": t2 - t1, "iterate_to_same_point_s": replay})
    return out


def _mem(pid: int) -> dict:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) / 1024  # MiB
    except FileNotFoundError:
        pass
    return out


def _children(pid: int) -> list[int]:
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(d.name))
            except (FileNotFoundError, IndexError, ValueError):
                pass
    return kids


def bench_rss(cache: Path, batch_size: int, num_workers: int, epochs: int = 3) -> list[dict]:
    loader = ShardLoader(cache, batch_size, seed=0, workers=Workers(num_workers=num_workers))
    rows = []
    for e in range(epochs):
        loader.set_epoch(e)
        for _ in loader:
            pass
        main = _mem(os.getpid())
        workers = [_mem(p) for p in _children(os.getpid())]
        rows.append({"epoch": e, "main_MiB": main,
                     "workers_RssAnon_MiB": sum(w.get("RssAnon", 0) for w in workers),
                     "workers_RssFile_MiB": sum(w.get("RssFile", 0) for w in workers),
                     "workers_VmRSS_MiB": sum(w.get("VmRSS", 0) for w in workers), "n_workers": len(workers)})
    loader.close()
    return rows


_FORKSERVER_RUN = """
import json, sys, time
import loaders.context
from loaders import Reads, ShardLoader, Workers
if sys.argv[2] == "off":
    loaders.context.FORKSERVER_PRELOAD = ()
out = []
for _ in range(3):
    t = time.perf_counter()
    ld = ShardLoader(sys.argv[1], int(sys.argv[3]), seed=0, workers=Workers(num_workers=2, multiprocessing_context="forkserver"),
                     reads=Reads(compact=True, pin_memory=False))
    next(iter(ld))
    out.append(time.perf_counter() - t)
    ld.close()
print(json.dumps(out))
"""


def bench_forkserver(cache: Path, batch_size: int) -> dict:
    """Seconds to the first batch of 3 successive 2-worker forkserver loaders, preload on and off
    (each in a fresh process: one forkserver per process)."""
    got = {}
    for preload in ("on", "off"):
        r = subprocess.run([sys.executable, "-c", _FORKSERVER_RUN, str(cache), preload, str(batch_size)],
                           cwd=ROOT, capture_output=True, text=True, check=True)
        got[f"preload_{preload}_s"] = json.loads(r.stdout.strip().splitlines()[-1])
    return got


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16, help="samples per batch (the issue's table: 16)")
    ap.add_argument("--epochs", type=int, default=7, help="timed rounds: a cat, then an epoch per configuration")
    ap.add_argument("--no-remote", action="store_true", help="skip the local S3 server runs")
    ap.add_argument("--no-peers", action="store_true", help="skip LitData and Mosaic Streaming")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "loader.json")
    ap.add_argument("--keep", action="store_true", help="keep the temporary cache")
    ap.add_argument("--real-cache", type=Path, nargs="*", default=[],
                    help="caches made by precompute (e.g. real-mini conversations) to measure too")
    args = ap.parse_args(argv)

    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench_loader_"))
    try:
        t0 = time.perf_counter()
        cache = build_cache(tmp / "cache", args.samples, args.shards)
        build_s = time.perf_counter() - t0
        files = sorted(cache.glob("shard-*.tar"))
        from bench_cache import bytes_on_disk
        disk = bytes_on_disk(cache)
        cat = bench_cat(files)
        nbytes = cat["bytes"]
        ours = bench_loaders(cache, args.batch_size, nbytes, args.samples, epochs=args.epochs)
        ceiling = bench_copy_ceiling(cache, args.batch_size)
        peers = {"skipped": "--no-peers"} if args.no_peers else bench_peers(cache, tmp / "peers", args.epochs)
        if "skipped" in peers:
            print(f"peers skipped: {peers['skipped']}")
        web = bench_webdataset(files, nbytes)
        remote = None
        if not args.no_remote:
            try:
                remote = bench_remote(cache, args.batch_size, nbytes, args.samples, ours[0]["samples_s"])
            except (ImportError, RuntimeError) as e:
                print(f"remote runs skipped: {e}")
        resume = bench_resume(cache, args.batch_size, 0) + bench_resume(cache, args.batch_size, 2)
        rss = bench_rss(cache, args.batch_size, 2)
        forkserver = bench_forkserver(cache, args.batch_size)
        real = []
        for c in args.real_cache:  # small caches: as many epochs as make ~1000 samples
            rfiles = sorted(c.glob("shard-*.tar"))
            rcat = bench_cat(rfiles)
            n = len(__import__("shards").read_index(c))
            bs = min(8, n)
            r = bench_loaders(c, bs, rcat["bytes"], n, epochs=max(3, 1000 // n), configs=CONFIGS[:1])[0]
            real.append(dict(r, cache=c.name, cat_MB_s=rcat["MB_s"], KiB_per_sample=rcat["bytes"] / n / 1024,
                             batch_size=bs))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    cat_rate = statistics.median(ours[0]["cat_samples_s_rounds"])  # samples/s: the rounds' cats
    cat = dict(cat, MB_s=cat_rate * nbytes / args.samples / 1e6)
    best_peer = max((v["samples_s"], k) for k, v in peers.items() if isinstance(v, dict) and "samples_s" in v) \
        if any(isinstance(v, dict) and "samples_s" in v for v in peers.values()) else None
    lit = peers.get("litdata") if isinstance(peers.get("litdata"), dict) else {}
    rows = [dict(r, ratio_to_cat_cpu=(r["MB_s_cpu"] / cat["MB_s_cpu"]) if r["MB_s_cpu"] else None,
                 # both through their ratio to a cat a moment before (their own runs): see bench_peers.py
                 ratio_to_litdata=r["ratio_to_cat"] / lit["ratio_to_cat"] if lit.get("ratio_to_cat") else None,
                 ratio_to_litdata_raw=r["samples_s"] / lit["samples_s"] if lit.get("samples_s") else None)
            for r in ours]
    by = {r["label"]: r for r in rows}
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "cache": {"samples": args.samples, "shards": args.shards, "bytes": nbytes,
                  "disk_over_tensor": disk["disk_over_tensor"],
                  "KiB_per_sample": nbytes / args.samples / 1024, "build_s": build_s},
        "batch_size": args.batch_size, "epochs": args.epochs, "cat": dict(cat, samples_s=cat_rate),
        "copy_ceiling": {k: dict(v, ratio_to_cat=v["samples_s"] / cat_rate) for k, v in ceiling.items()},
        "shardloader": rows, "peers": peers,
        "webdataset": dict(web, ratio_to_cat=web["samples_s"] / cat_rate),
        "resume": resume, "rss": rss, "forkserver_first_batch": forkserver, "real_caches": real, "remote": remote,
        "targets": {  # (value, target): ratios of rates measured a moment apart (see bench_loaders)
            "compact_over_cat": (by["one process, compact"]["ratio_to_cat"], 0.6),
            "compact_over_litdata": (by["one process, compact"]["ratio_to_litdata"], 2.0),
            "float32_over_cat": (by["one process, float32"]["ratio_to_cat"], 0.4),
            "2_workers_over_one_process_compact": (paired(rows, "2 workers, compact", "one process, compact"), 1.8),
            "2_workers_over_one_thread_compact": (paired(rows, "2 workers, compact",
                                                         "one process, compact, read on demand"), 1.8),
            "2_workers_over_one_process_float32": (paired(rows, "2 workers, float32", "one process, float32"), 1.8),
            "checksums_over_none": (paired(rows, "one process, compact", "one process, compact, checks=none"), 0.95),
            "checksums_over_none_one_thread": (paired(rows, "one process, compact, read on demand",
                                                      "one process, compact, read on demand, checks=none"), 0.95),
            "checksums_over_values": (paired(rows, "one process, compact", "one process, compact, checks=values"),
                                      None),
        },
        "best_peer": None if best_peer is None else {"name": best_peer[1], "samples_s": best_peer[0]},
    }
    print(f"cache: {args.samples} samples, {args.shards} shards, {nbytes / 1e6:.0f} MB "
          f"({nbytes / args.samples / 1024:.0f} KiB/sample); batch {args.batch_size}; load avg "
          f"{load_start[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print(f"{'reader':<46}{'samples/s':>11}{'MB/s':>9}{'x cat':>8}{'x LitData':>11}")
    print(f"{'cat > /dev/null':<46}{cat_rate:>11.0f}{cat['MB_s']:>9.0f}{1:>8.2f}")
    for k, label in (("batch", "preadv per sample into a batch buffer"), ("l2", "preadv through 128 KiB (as cat)")):
        v = result["copy_ceiling"][k]
        print(f"{label:<46}{v['samples_s']:>11.0f}{v['samples_s'] * nbytes / args.samples / 1e6:>9.0f}"
              f"{v['ratio_to_cat']:>8.2f}")
    for r in rows:
        lit = f"{r['ratio_to_litdata']:>11.2f}" if r["ratio_to_litdata"] else ""
        print(f"{'ShardLoader, ' + r['label']:<46}{r['samples_s']:>11.0f}{r['MB_s']:>9.0f}"
              f"{r['ratio_to_cat']:>8.2f}{lit}")
    for name in ("litdata", "mosaic"):
        v = peers.get(name) or {}
        if "samples_s" in v:
            print(f"{name + ' StreamingDataset (no collate)':<46}{v['samples_s']:>11.0f}"
                  f"{v['samples_s'] * nbytes / args.samples / 1e6:>9.0f}"
                  f"{v.get('ratio_to_cat', v['samples_s'] / cat_rate):>8.2f}")
        elif v:
            print(f"{name}: {v}")
    w = result["webdataset"]
    print(f"{'webdataset .decode() (no collate)':<46}{w['samples_s']:>11.0f}{w['MB_s']:>9.0f}{w['ratio_to_cat']:>8.2f}")
    for k, (v, target) in result["targets"].items():
        if v is not None:
            print(f"  {k}: {v:.2f}" + (f" (target {target})" if target else ""))
    if remote:
        for k, v in remote.items():
            print(f"  remote (local S3 server) {k}: {v['samples_s']:.0f} samples/s = {v['ratio_to_local']:.2f} x local")
    print("startup / resume (fresh loader, load_state_dict -> first batch) vs iterating there:")
    for r in resume:
        print(f"  at {r['fraction']:.0%} (step {r['step']}), workers={r['num_workers']}: construct "
              f"{r['construct_s'] * 1e3:.0f} ms, first batch {r['resume_to_first_batch_s'] * 1e3:.0f} ms vs "
              f"{r['iterate_to_same_point_s'] * 1e3:.0f} ms")
    print("RSS with 2 persistent workers (MiB): epoch, main RssAnon/RssFile, workers RssAnon/RssFile")
    for r in rss:
        print(f"  {r['epoch']}: {r['main_MiB'].get('RssAnon', 0):.0f}/{r['main_MiB'].get('RssFile', 0):.0f}, "
              f"{r['workers_RssAnon_MiB']:.0f}/{r['workers_RssFile_MiB']:.0f}")
    print("forkserver workers (CUDA initialised), first batch of 3 successive loaders (ms): preload "
          + ", ".join(f"{x * 1e3:.0f}" for x in forkserver["preload_on_s"]) + "; without "
          + ", ".join(f"{x * 1e3:.0f}" for x in forkserver["preload_off_s"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp_out, args.out)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
