"""Caches of 10k to 10M tiny samples for the loader's scale benchmark, written once and reused.

    python -m benchmarks.scale_corpus --n 10000 100000 1000000 [--out DIR] [--jobs 2]

``DIR`` (default ``$SHARDCACHE_BENCH_SCALE`` or ``~/.cache/shardcache/bench-scale``) gets:

* ``pool/w<J>/``: the shards, written with :class:`shards.ShardWriter` (the format's own writer), each
  of :data:`PER_SHARD` samples; shard ``k`` is written by job ``k % jobs`` into its own folder (one
  writer per cache folder: the writer lock). Shards already there are kept.
* ``n<N>/``: a cache of the first ``N`` samples: hard links to the pool's first ``N / PER_SHARD``
  shards and their index parts, merged by :func:`shards.merge_parts` (index, manifest, integrity
  root). Kept while its integrity root matches its files (so a run measures, not rewrites).

A sample is what a speech cache's smallest row holds: ``codes`` int16 ``(8, 1..4)``, ``input_ids``
and ``labels`` int32 ``(3..6,)`` (labels -100 on the first token), a ``json`` with its speaker,
duration and rate; about 2.5 KB on disk with the tar headers. Deterministic: sample ``i`` is a pure
function of ``i``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

#: samples per shard (a 10M cache is 1000 shards of ~25 MB)
PER_SHARD = 10_000
N_CODEBOOKS, CODEBOOK_SIZE, VOCAB = 8, 1024, 259
#: the keys stage one's manifest records that the loader's value checks and collation read
MANIFEST = {"n_codebooks": N_CODEBOOKS, "codebook_size": CODEBOOK_SIZE, "frame_rate": 25.0,
            "codec_sample_rate": 24000, "text": {"vocab_size": VOCAB, "pad_id": 0}}


def default_dir() -> Path:
    """``$SHARDCACHE_BENCH_SCALE`` or ``~/.cache/shardcache/bench-scale``."""
    return Path(os.environ.get("SHARDCACHE_BENCH_SCALE") or Path.home() / ".cache" / "shardcache" / "bench-scale")


def shard_name(k: int) -> str:
    return f"shard-{k:06d}.tar"


def sample(i: int) -> dict:
    """Sample ``i``'s members (see the module docstring)."""
    frames, length = 1 + i % 4, 3 + (i // 4) % 4
    rng = np.random.default_rng(i % 997)  # a few hundred distinct arrays: cheap, still varied
    ids = rng.integers(3, VOCAB, size=length).astype(np.int32)
    labels = ids.copy()
    labels[0] = -100
    return {"json": {"speaker": f"spk{i % 100}", "duration_s": frames / 25.0, "sample_rate": 24000},
            "codes.npy": rng.integers(0, CODEBOOK_SIZE, size=(N_CODEBOOKS, frames)).astype(np.int16),
            "input_ids.npy": ids, "labels.npy": labels}


def _write_shard(folder: str, k: int) -> str:
    from shards import ShardWriter
    w = ShardWriter(folder, shard_name(k))
    for i in range(k * PER_SHARD, (k + 1) * PER_SHARD):
        w.add(f"s{i:09d}", sample(i))
    w.commit()
    return shard_name(k)


def pool_folder(root: Path, j: int, jobs: int) -> Path:
    return root / "pool" / f"w{j % jobs}"


def _write_shards(folder: str, ks: list[int]) -> int:
    for k in ks:
        _write_shard(folder, k)
    return len(ks)


def write_pool(root: Path, shards: int, jobs: int = 2, log=print) -> None:
    """Write the pool's first ``shards`` shards (those missing): ``jobs`` processes, each into a folder
    of its own (one writer per cache folder)."""
    todo = [k for k in range(shards) if not _pool_shard(root, k)]
    if not todo:
        return
    t0 = time.monotonic()
    step = max(1, jobs * 5)
    with ProcessPoolExecutor(jobs) as pool:
        for lo in range(0, len(todo), step):  # rounds of 5 shards per job: progress, and a cut run keeps them
            part = todo[lo:lo + step]
            list(pool.map(_write_shards, [str(pool_folder(root, j, jobs)) for j in range(jobs)],
                          [part[j::jobs] for j in range(jobs)]))
            log(f"scale corpus: {lo + len(part)}/{len(todo)} shards written ({time.monotonic() - t0:.0f} s)")


def _pool_shard(root: Path, k: int) -> Path | None:
    """The pool's shard ``k`` with its committed index part, whichever job folder holds it."""
    for w in sorted((root / "pool").glob("w*")):
        if (w / shard_name(k)).exists() and (w / "parts" / f"{shard_name(k)[:-4]}.index.parquet").exists():
            return w
    return None


def cache(n: int, root: Path | None = None, jobs: int = 2, log=print) -> Path:
    """The cache of the first ``n`` samples (``n`` a multiple of :data:`PER_SHARD`), written or reused."""
    from shards import merge_parts
    from shards.index import root_problems
    if n % PER_SHARD:
        raise ValueError(f"n={n}: a multiple of {PER_SHARD}")
    root = root or default_dir()
    out = root / f"n{n}"
    if (out / "integrity.json").exists() and not root_problems(out)[1]:
        return out
    shards = n // PER_SHARD
    write_pool(root, shards, jobs, log)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    first = _pool_shard(root, 0)
    if not (out / ".shardcache").exists():
        os.link(first / ".shardcache", out / ".shardcache")  # the cache marker first (shards.writing)
    for k in range(shards):
        w, stem = _pool_shard(root, k), shard_name(k)[:-4]
        for rel in (f"{stem}.tar", f"parts/{stem}.index.parquet", f"parts/{stem}.rejects.parquet"):
            if not (out / rel).exists():
                os.link(w / rel, out / rel)
    t0 = time.monotonic()
    merge_parts(out, dict(MANIFEST))
    log(f"scale corpus: n{n} merged in {time.monotonic() - t0:.1f} s")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    for n in args.n:
        print(cache(n, args.out, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
