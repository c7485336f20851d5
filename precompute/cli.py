"""``shardcache precompute``: encode a manifest once into a shard cache (see :data:`DESCRIPTION`)."""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from shardcache import config as S
from shardcache.changes import changes_line
from shardcache.config import ConfigError
from shardcache.quiet import quiet_libraries
from shardcache.ranks import Ranks
from shardcache.weights import CheckpointUnreadable
from shards.errors import ShardcacheError, WriteRefused

from .config import CONFIG_ENV, PrecomputeConfig
from .faults import InfrastructureFault, Stopped, stop_on_sigterm
from .job import run
from .manifests import ManifestUnreadable
from .validate import check_config

log = logging.getLogger("precompute")
PROG = "shardcache precompute"
#: what a job that stopped before the end says: the way forward (docs/stage-one.md, "When a job fails")
RERUN = ("the cache {cache} keeps every chunk committed so far (the chunk in progress was dropped) and is not "
         "complete: run the same command again to complete it (it encodes only the rows not yet committed)")


def registries() -> str:
    """The names every registry accepts, for ``--help`` (derived from the registries themselves)."""
    from .encoders.registry import AUDIO_TOKENIZERS, IMAGE_ENCODERS, TEXT_TOKENIZERS
    from .manifests import FORMATS
    from .producers import PRODUCERS
    rows = [("codecs (audio_tokenizer.name)", AUDIO_TOKENIZERS), ("VAEs (image_encoder.name)", IMAGE_ENCODERS),
            ("text tokenizers (text_tokenizer.name)", TEXT_TOKENIZERS), ("manifest formats", FORMATS),
            ("producers (extra_fields, add-field)", PRODUCERS)]
    return "names:\n" + "\n".join(f"  {what}: {', '.join(sorted(names))}" for what, names in rows) + \
        "\n  (each also takes a plug-in: {factory: 'package.module:callable', kwargs: {...}})"


DESCRIPTION = """Encode a manifest once into a shard cache (stage one).

  shardcache precompute --manifest data/demo/samples.jsonl --cache cache/demo --config configs/precompute.yaml
  torchrun --nproc_per_node=8 -m shardcache precompute --manifest train.json --cache /data/cache
  srun --ntasks-per-node=8 python -m shardcache precompute ...   (or mpirun -np 16 ...)

Under any launcher (torchrun, srun, mpirun, mpiexec) each global rank encodes its own rows on
cuda:local_rank and writes its own shards;
rank 0 merges the index and manifest at the end. Options: the defaults below, then the config file
(--config FILE; else $SHARDCACHE_PRECOMPUTE_CONFIG; else none), then flags in their order
(--sample_rate 16000, --audio_tokenizer.name mimi, --encoder_batch_size=16); --print_config prints
the result. Bad options exit with status 2 before any model is loaded, each named; a failed job exits 1
(a process, the device or the disk that failed is named; the same command run again completes the cache);
a job stopped by SIGTERM exits 143 after releasing its processes, shared memory and the cache's lock.
Add or drop a field of an existing cache later: shardcache add-field / drop-field."""


def build_parser() -> argparse.ArgumentParser:
    """The job's inputs (``--manifest``, ``--cache``, ``--root``...), ``--config`` and
    one flag per option of :class:`~precompute.config.PrecomputeConfig`."""
    p = S.parser(PrecomputeConfig, PROG, DESCRIPTION, registries())
    g = p.add_argument_group("the job")
    g.add_argument("--manifest", required=True,
                   help="dataset manifest: JSONL (key,text,audio,image,speaker), Higgs-Audio ChatML JSON/JSONL, "
                        "LLaVA JSON, CSV/TSV or Parquet (format detected, or --manifest_format)")
    g.add_argument("--cache", required=True, help="cache directory to write shards, index.parquet, manifest.json into")
    g.add_argument("--root", default=None, help="folder media paths are relative to (default: the manifest's folder)")
    g.add_argument("--storage_options", type=Optional[dict[str, Any]], default=None, metavar="MAPPING",
                   help="with --cache s3://... (gs://, any fsspec URL): fsspec options as a JSON object, e.g. "
                        "'{client_kwargs: {endpoint_url: http://minio:9000}}' (YAML; JSON is YAML). Not written into the "
                        "cache (may hold secrets); credentials otherwise the store's usual way (AWS_* variables, "
                        "~/.aws, instance roles)")
    g.add_argument("--staging", default=None, metavar="DIR",
                   help="with a URL --cache: local folder chunks are written to before upload (default "
                        "$SHARDCACHE_STAGING, else ~/.cache/shardcache/staging)")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def config_from_args(argv: list[str]) -> tuple[PrecomputeConfig, argparse.Namespace]:
    """defaults < config file < flags; checked (raises :class:`ConfigError`)."""
    return S.parse(build_parser(), PrecomputeConfig, argv, CONFIG_ENV, check=check_config)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        build_parser().print_help()
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    quiet_libraries()
    # configuration errors stop here, before any model is loaded or any file written
    try:
        cfg, args = config_from_args(argv)
    except ConfigError as e:
        return e.report()
    try:
        ranks = Ranks.detect()
        barrier, close = ranks.barrier()  # the ranks only synchronise, never communicate
    except ValueError as e:  # a partial launcher environment, or no rendezvous for the barrier
        print(f"error: {e}", file=sys.stderr)
        return 2
    global_rank, world_size, local_rank = ranks.global_rank, ranks.world_size, ranks.local_rank
    if ranks.note and ranks.is_main:
        log.warning("%s", ranks.note)
    if global_rank == 0:
        log.info("config file: %s (%s)", args.config_file or "none", args.config_source)
        log.info("%s", changes_line(cfg))
    previous = stop_on_sigterm()  # SIGTERM (SLURM, torchrun) unwinds the job: its processes, memory and lock freed
    try:
        summary, manifest = run(args.manifest, args.cache, cfg, root=args.root, global_rank=global_rank,
                                world_size=world_size, local_rank=local_rank, barrier=barrier,
                                progress=not args.no_progress, storage_options=args.storage_options,
                                staging=args.staging)
    except (ManifestUnreadable, WriteRefused, CheckpointUnreadable) as e:
        # the manifest as a whole (its encoding...) or an encoder checkpoint's file (before its weights load)
        # cannot be read; another command writes the cache, or the folder holds other files: nothing was written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except InfrastructureFault as e:  # a process, the device or the disk failed: not the rows' fault
        print(f"error: {e}\n{RERUN.format(cache=args.cache)}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"{PROG}: {e}\n{RERUN.format(cache=args.cache)}", file=sys.stderr)
        return 128 + e.signum
    except (ShardcacheError, FileNotFoundError, ValueError, ImportError) as e:  # ImportError: a codec's dependency
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
        close()
    if summary.kept + summary.rejected == 0 and summary.skipped_rows:
        print(f"[rank {global_rank}] nothing to encode: the cache holds all {summary.skipped_rows} rows "
              f"({summary.setup_s:.1f} s)")
    else:
        print(f"[rank {global_rank}] kept {summary.kept}, rejected {summary.rejected}, skipped (already cached) "
              f"{summary.skipped_rows}, {summary.audio_seconds / 3600:.4f} h audio; setup {summary.setup_s:.1f} s, "
              f"encoding {summary.wall_s:.1f} s, encoder busy {summary.encoder_busy:.0%} of it")
    if manifest is not None:
        c = manifest["counts"]
        print(f"cache {args.cache}: {c['samples']} samples in {c['shards']} shards ({c['bytes'] / 1e6:.1f} MB), "
              f"{c['images']} with images, {c['audio_hours']:.4f} h audio; rejected {c['rejected']}")
        for reason, n in sorted(c["rejects_by_reason"].items()):
            print(f"  rejected {n:5d}  {reason}")
        empty = empty_cache_error(args.cache, manifest)
        if empty is not None:
            print(f"error: {empty}", file=sys.stderr)
            return 1
        for line in closing_lines(args.cache, args.manifest, c):
            print(line)
    return 0


def closing_lines(cache: str, manifest: str, counts: dict) -> list[str]:
    """What the summary ends with: the rejects that ``expected_rejects.json`` beside the manifest lists, when it
    lists them all (the bundled demo's and real-mini's rows broken on purpose: data/demo/README.md), where each
    reject is named (``shards rejects``), and how to look at the cache (``shards view``, ``make view``)."""
    from shards import read_rejects
    from shards.storage import is_url
    out = []
    expected = Path(manifest).parent / "expected_rejects.json"
    if counts.get("rejected") and not is_url(cache) and expected.is_file():
        try:
            listed = {(r["key"], r["reason"]) for r in json.loads(expected.read_text())}
        except (ValueError, KeyError, TypeError):
            listed = set()
        got = {(r["key"], r["reason"]) for r in read_rejects(cache).select(["key", "reason"]).to_pylist()}
        if got and got <= listed:
            out.append(f"  all {len(got)} rejects are rows {expected} lists as broken on purpose")
    if counts.get("rejected"):
        out.append(f"each reject's row and reason: shardcache shards rejects {cache}")
    out.append(f"look at the cache: shardcache shards view {cache}   (or: make view OUT={cache})")
    return out


def empty_cache_error(cache: str, manifest: dict) -> str | None:
    """Why a job whose cache ends with no sample failed (naming the reject reasons and counts), or
    None when the cache holds samples: an empty cache is never a success (exit 1)."""
    c = manifest["counts"]
    if c["samples"]:
        return None
    if not c["rejected"]:
        return f"the cache {cache} holds 0 samples: the manifest has no row to encode"
    reasons = ", ".join(f"{reason} ({n})" for reason, n in sorted(c["rejects_by_reason"].items(), key=lambda x: -x[1]))
    return (f"the cache {cache} holds 0 samples: every one of the manifest's {c['rejected']} row(s) was rejected"
            f"{': ' + reasons if reasons else ''} (rejects.parquet names each row and why; `shardcache shards rejects "
            f"{cache}` lists them)")


if __name__ == "__main__":
    sys.exit(main())
