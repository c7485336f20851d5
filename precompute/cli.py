"""``python -m precompute``: encode a manifest once into a shard cache.

Single process::

    python -m precompute --manifest data/demo/samples.jsonl --out cache/demo

Many GPUs / nodes (each global rank encodes its own rows on ``cuda:LOCAL_RANK`` and writes its
own shards; rank 0 merges the index and manifest at the end)::

    torchrun --nproc_per_node=8 -m precompute --manifest train.json --out /data/cache

Add / drop a field of an existing cache later (sidecar tars; see precompute.add_field)::

    python -m precompute add-field CACHE --field codes_mimi --audio-tokenizer mimi [--pretrained DIR]
    python -m precompute drop-field CACHE codes_mimi
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml

from shards.errors import ShardcacheError

from .config import load_config
from .job import run
from .ranks import make_barrier
from .validate import ConfigError, validate_config

log = logging.getLogger("precompute")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m precompute", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", required=True,
                   help="dataset manifest: JSONL (key,text,audio,image,speaker), Higgs-Audio ChatML JSON/JSONL, "
                        "LLaVA JSON, CSV/TSV or Parquet (format detected, or --set manifest_format=...)")
    p.add_argument("--out", required=True, help="cache directory to write shards, index.parquet, manifest.json into")
    p.add_argument("--root", default=None, help="folder media paths are relative to (default: the manifest's folder)")
    p.add_argument("--config", default="configs/precompute.yaml" if os.path.exists("configs/precompute.yaml") else None,
                   help="YAML config with the defaults of precompute.config.PrecomputeConfig (default: %(default)s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set batch_size=16 --set audio_tokenizer.pretrained=/ckpt/dac")
    p.add_argument("--audio-tokenizer", default=None, metavar="NAME|module:factory",
                   help="codec: dac | encodec | mimi, or a plug-in factory module:factory")
    p.add_argument("--image-encoder", default=None, metavar="NAME|module:factory",
                   help="VAE: wan | cosmos, or a plug-in factory module:factory")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default from config: auto)")
    p.add_argument("--num-workers", default=None, help="decode worker processes, or auto (default from config)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per encoder call")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _plugin(spec: str | None, current: dict) -> dict | None:
    if spec is None:
        return None
    return {"factory": spec} if ":" in spec else dict(current, name=spec)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("add-field", "drop-field"):  # python -m precompute add-field CACHE --field ...
        from . import add_field
        return (add_field.main_add if argv[0] == "add-field" else add_field.main_drop)(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:  # load_config may validate too
        for line in e.lines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError, yaml.YAMLError) as e:  # TypeError: --set a.b=v on a null a
        print(f"error: {e}", file=sys.stderr)
        return 2
    num_workers = args.num_workers
    if isinstance(num_workers, str) and num_workers.isdigit():
        num_workers = int(num_workers)
    for name, value in (("audio_tokenizer", _plugin(args.audio_tokenizer, cfg.audio_tokenizer or {})),
                        ("image_encoder", _plugin(args.image_encoder, cfg.image_encoder or {})),
                        ("device", args.device), ("num_workers", num_workers), ("batch_size", args.batch_size)):
        if value is not None:
            setattr(cfg, name, value)
    # configuration errors stop here, before any model is loaded or any file written
    try:
        validate_config(cfg)
    except ConfigError as e:
        for line in e.lines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    global_rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    barrier, close = make_barrier(world_size, global_rank)  # the ranks only synchronise, never communicate
    if global_rank == 0:
        log.info("config: %s", cfg.to_dict())
    try:
        summary, manifest = run(args.manifest, args.out, cfg, root=args.root, global_rank=global_rank,
                                world_size=world_size, local_rank=local_rank, barrier=barrier,
                                progress=not args.no_progress)
    except (ShardcacheError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        close()
    print(f"[rank {global_rank}] kept {summary.kept}, rejected {summary.rejected}, skipped (already cached) "
          f"{summary.skipped_rows}, {summary.audio_seconds / 3600:.4f} h audio; setup {summary.setup_s:.1f} s, "
          f"encoding {summary.wall_s:.1f} s, encoder busy {summary.encoder_busy:.0%} of it")
    if manifest is not None:
        c = manifest["counts"]
        print(f"cache {args.out}: {c['samples']} samples in {c['shards']} shards ({c['bytes'] / 1e6:.1f} MB), "
              f"{c['images']} with images, {c['audio_hours']:.4f} h audio; rejected {c['rejected']}")
        for reason, n in sorted(c["rejects_by_reason"].items()):
            print(f"  rejected {n:5d}  {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
