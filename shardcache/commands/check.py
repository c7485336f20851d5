"""``shardcache check CACHE --manifest M --samples N``: re-derive samples on the fly, compare with the cache.

A user trusts a cache before spending GPU-weeks on it: for ``N`` samples picked at random
(``--seed``) from the cache's index, the manifest row with the same key is decoded again from its
source files and encoded again with the encoders and preprocessing the cache's ``manifest.json``
records (its ``config``: codec, VAE, tokenizer and chat template, image policy, extra fields),
through the very code stage one runs (:class:`precompute.job.Job`), and every array is
compared with the cached one (a command above both stages: it reads the cache as ``shards verify``
does and runs stage one's encoders, so it lives in the command layer, docs/layers.md):

* token ids, labels, codes, segments, offsets, any integer field: exactly;
* waveforms (int16 PCM): within 1 LSB;
* float fields (latents, features): relative L2 error within the recorded tolerance
  (``precision_tolerance.latents_rel_err`` of the cache's config, 0.02 by default).

A batched codec's codes depend on each clip's place in its call and on the call's shape
(:mod:`precompute.encoders.batching`); the cache records both per audio item (the json's
``codes_calls``) and the codes are re-derived in that very call, zero slots beside the clip.

The cache itself is checked too, as ``shards verify`` checks it (every file the integrity root
covers, every shard's sha256, and the loader's own open: :func:`shards.commands.verify.verify_cache`;
reported as ``DAMAGED``), and every picked sample is read with the loader's checks (member
checksums, each field's value checks; ``REFUSED``): whatever the loader refuses, check reports
(exit 1), and a cache another command is writing right now is refused (exit 2, naming it).

The encoders' fingerprint is compared with the cache's first: a different one is reported (the
weights or the preprocessing changed since) and the comparison goes on, so the report names the
fields that differ. Fields added later with ``add-field`` are not re-derived (listed as skipped).
The manifest is read with the options stage one recorded (``manifest_format``, ``columns``,
``allow_outside_root``) and ``--root``. The report says how many samples were compared of how many
cached. Exit status 0 when every compared array matches, 1 naming each key and field that does not (or a
row that can no longer be decoded), or when nothing could be compared (no cached key is a readable
row of the manifest), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np

from precompute.config import PrecomputeConfig, load_config
from shardcache.helptext import plain
from shards import Cache
from shards import fields as registry
from shards.commands._common import UsageError, cache_dir as checked_cache_dir
from shards.errors import ShardcacheError, WriteRefused
from shards.manifest import CacheManifest
from shards.reader import ShardReader

log = logging.getLogger("shardcache.check")
PROG = "shardcache check"


def cache_config(man: CacheManifest, overrides: list[str] | None = None) -> PrecomputeConfig:
    """The :class:`PrecomputeConfig` a cache was made with (``manifest.json`` ``config``), with
    ``key=value`` overrides (e.g. ``device=cuda``, or a checkpoint moved elsewhere:
    ``audio_tokenizer.pretrained=/new/path``). Raises ``ValueError`` when the manifest has no config."""
    if not isinstance(man.config, dict) or not man.config:
        raise ValueError("manifest.json records no config (not written by shardcache precompute?); "
                         "nothing to re-derive the samples with")
    return load_config(man.config, overrides)


def compare(name: str, cached: np.ndarray | None, fresh: np.ndarray | None, rel_tol: float) -> str | None:
    """Why ``fresh`` (re-derived) differs from ``cached`` for field ``name``, or None when it matches
    (see the module docstring for the rule of each kind of array)."""
    if cached is None or fresh is None:
        return None if cached is None and fresh is None else \
            f"{'missing from the cache' if cached is None else 'not produced again'}"
    if cached.shape != fresh.shape:
        return f"shape {tuple(cached.shape)} in the cache, {tuple(fresh.shape)} re-derived"
    a, b = cached.astype(np.float64), fresh.astype(np.float64)
    if cached.dtype.kind == "f":
        err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))
        return None if err <= rel_tol else f"relative L2 error {err:.3g} > tolerance {rel_tol:g}"
    f = registry.lookup(name)
    limit = 1 if f is not None and f.kind.name == "waveform" else 0
    diff = np.abs(a - b)
    if float(diff.max(initial=0)) <= limit:
        return None
    n = int((diff > limit).sum())
    j = int(np.flatnonzero(diff.reshape(-1) > limit)[0])
    return (f"{n} of {a.size} values differ (first at flat index {j}: {int(a.reshape(-1)[j])} cached, "
            f"{int(b.reshape(-1)[j])} re-derived)")


def _recorded_calls(cached_json: dict) -> dict[str, list]:
    """The codec calls a cached sample's json records, by field (``{"codes": [[size, length, place] or None
    per audio item]}``; see :class:`precompute.producers.CodesProducer`): empty for a clip-by-clip codec."""
    return {key[:-len("_calls")]: list(v) for key, v in (cached_json or {}).items()
            if key.endswith("_calls") and isinstance(v, list)}


def check(cache_dir: str | Path, manifest: str | Path, samples: int = 8, *, root: str | Path | None = None,
          seed: int = 0, overrides: list[str] | None = None, device: str = "cpu") -> dict[str, Any]:
    """Re-derive ``samples`` random samples of the cache and compare them (see the module docstring).

    Returns ``{"fingerprint_matches", "checked" (samples compared), "asked" (``samples``), "cached"
    (samples in the cache), "matched_rows" (cached samples whose key the manifest has), "skipped_fields",
    "problems": [{key, field, why}], "missing_rows": [keys], "cache_problems": [what verify finds],
    "refused": [{key, why}] (picked samples the loader's read checks refuse)}``. The manifest is read with
    the options the cache's recorded config gives (``manifest_format``, ``columns``, ``allow_outside_root``)
    and ``root``, as stage one read it. Raises ``FileNotFoundError`` (no index), ``ValueError`` (no recorded
    config, bad overrides), :class:`shards.errors.ShardcacheError` (an unreadable cache).
    """
    import torch

    from precompute.encode import Summary
    from precompute.job import Job
    from precompute.manifests import read_requests
    from precompute.validate import validate_config

    cache_dir = Path(cache_dir)
    damage = cache_problems(cache_dir)  # what verify (and the loader) refuse of the cache's own files, first
    cache = Cache.open(cache_dir, strict=False)  # (read as far as it reads: what differs is reported below)
    man = cache.manifest
    cfg = validate_config(cache_config(man, overrides))
    # checksums=False: each value is compared with the one derived again, so a changed array is reported as
    # MISMATCH naming its field (`shardcache shards verify` is the tool for damaged bytes)
    reader = ShardReader(cache_dir, checksums=False)
    # the options stage one read the manifest with (its recorded config): the same rows, keys and media
    requests = read_requests(manifest, root=root, fmt=cfg.manifest_format, columns=cfg.columns,
                             allow_outside_root=cfg.allow_outside_root)
    by_key: dict[str, Any] = {}
    for r in requests:
        if r.error is None:  # rows rejected while reading (a duplicate key...) are not in the cache
            by_key.setdefault(r.key, r)
    rows = [i for i, k in enumerate(reader.keys) if k in by_key]
    missing = [k for k in reader.keys if k not in by_key]
    picked = sorted(random.Random(seed).sample(rows, min(samples, len(rows))))
    pipe = Job.build(cfg, device, requests)  # the same tokens added as the job did
    out: dict[str, Any] = {"fingerprint_matches": pipe.fingerprint == man.fingerprint, "checked": 0,
                           "asked": samples, "cached": len(reader.keys), "matched_rows": len(rows),
                           "skipped_fields": sorted(man.sidecar_fields), "problems": [], "missing_rows": missing[:20],
                           "cache_problems": damage, "refused": []}
    loader_view = ShardReader(cache_dir, checksums=True, value_checks=cache.value_checks())
    if not out["fingerprint_matches"]:
        log.warning("the encoders and preprocessing give fingerprint %s..., the cache has %s...: the weights or "
                    "settings changed since the cache was made", pipe.fingerprint[:16], str(man.fingerprint)[:16])
    rel_tol = cfg.precision_tolerance.latents_rel_err
    prepared = [pipe.prepare(by_key[reader.keys[i]]) for i in picked]
    for i, p in zip(picked, prepared):  # a batched codec's clips: rebuilt in the very calls the cache records
        p.calls = _recorded_calls(reader.get(i).get("json"))
    with torch.inference_mode():
        encoded = pipe.encode(prepared, Summary())
    for i, (key, members, reject) in zip(picked, encoded):
        out["checked"] += 1
        if reject is not None:
            out["problems"].append({"key": key, "field": "-", "why": f"rejected now: {reject[2]}: {reject[3]}"})
            continue
        try:  # as the loader reads it: every member's checksum and each field's value checks
            loader_view.get(i)
        except (ShardcacheError, ValueError) as e:
            out["refused"].append({"key": key, "why": str(e)})
        cached = reader.get(i)
        fresh = {k[:-4]: v for k, v in members.items() if k.endswith(".npy")}
        names = sorted((set(fresh) | {k for k in cached if registry.lookup(k) is not None}) - set(out["skipped_fields"]))
        for name in names:
            why = compare(name, cached.get(name), fresh.get(name), rel_tol)
            if why is not None:
                out["problems"].append({"key": key, "field": name, "why": why})
    reader.close()
    loader_view.close()
    return out


def cache_problems(cache_dir: Path) -> list[str]:
    """What ``shards verify`` finds wrong with ``cache_dir`` (quick mode: every file the root covers,
    every shard's sha256, the loader's own open), one line each. Raises
    :class:`shards.lock.CacheLocked` while another command writes the cache."""
    from shards.commands.verify import verify_cache
    problems, _, _, _ = verify_cache(cache_dir)
    return [str(p) for p in problems]


def build_parser() -> argparse.ArgumentParser:
    """``shardcache check``'s command line."""
    p = argparse.ArgumentParser(prog=PROG, description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cache", metavar="CACHE", help="the cache directory")
    p.add_argument("--manifest", required=True, help="the manifest the cache was made from")
    p.add_argument("--samples", type=int, default=8, metavar="N", help="samples to re-derive (default 8)")
    p.add_argument("--seed", type=int, default=0, help="which samples (default 0)")
    p.add_argument("--root", default=None, help="folder media paths are relative to (as for precompute)")
    p.add_argument("--device", default="cpu", help="device of the encoders (default cpu)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recorded option, e.g. --set audio_tokenizer.pretrained=/moved/dac")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.samples < 1:
        p.error("--samples must be >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    overrides = list(args.overrides) + [f"device={args.device}"]
    try:
        checked_cache_dir(args.cache)  # a folder that is no cache (or a stage-one job to rerun) is a usage error
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    try:
        r = check(args.cache, args.manifest, args.samples, root=args.root, seed=args.seed, overrides=overrides,
                  device=args.device)
    except (ShardcacheError, FileNotFoundError, ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (ValueError, WriteRefused)) else 1
    fp = "matches" if r["fingerprint_matches"] else "DIFFERS (encoders or preprocessing changed)"
    print(f"{args.cache}: re-derived {r['checked']} of {r['cached']} cached sample(s) from {args.manifest} "
          f"({r['matched_rows']} of them in the manifest, {r['asked']} asked for); encoder fingerprint {fp}")
    if r["skipped_fields"]:
        print(f"not re-derived (added later with add-field): {', '.join(r['skipped_fields'])}")
    if r["missing_rows"]:
        print(f"{len(r['missing_rows'])}+ cached key(s) not in the manifest (not checked), e.g. {r['missing_rows'][:3]}")
    for why in r["cache_problems"]:
        print(f"DAMAGED {args.cache}: {why}")
    for prob in r["refused"]:
        print(f"REFUSED {prob['key']}: the loader refuses to read it: {prob['why']}")
    for prob in r["problems"]:
        print(f"MISMATCH {prob['key']}: {prob['field']}: {prob['why']}")
    if r["problems"] or r["cache_problems"] or r["refused"]:
        print(f"FAILED: {len(r['cache_problems'])} problem(s) of the cache's own files (`shardcache shards verify "
              f"{args.cache}` reports the same), {len(r['refused'])} sample(s) the loader refuses, "
              f"{len(r['problems'])} mismatch(es) in {r['checked']} sample(s)")
        return 1
    if r["checked"] == 0:
        print(f"FAILED: nothing was compared: none of the {r['cached']} cached key(s) is a readable row of "
              f"{args.manifest} (the manifest the cache was made from? its media folder: --root)")
        return 1
    print(f"OK: every array of {r['checked']} sample(s) matches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
