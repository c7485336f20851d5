"""What stage one wrote for the demo and real-mini, in a form that does not depend on where it ran.

``tests/golden/stage_one_outputs.json`` was recorded by this module from the code before stage one
streamed its manifest (commit 983c043) and ``tests/test_stage_one_bytes.py`` compares every run with it:
for each manifest, each shard's members in tar order, each member's sha256 (the json member with the
media folder written ``<ROOT>``: sources are absolute paths) and each reject (key, reason, detail, source).
The encoders are numpy stand-ins (``tests/plugin_codec.py``: frame energy codes, 8 x 8 mean-pool
latents) so the bytes depend on the pipeline (decoding, keys, chunks, json, rejects) and not on a
machine's convolution kernels.

    python tests/stage_one_golden.py --write      # record again (only when the output is meant to change)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
REAL_MINI = Path(os.environ.get("SHARDCACHE_REAL_MINI", ROOT.parent / "shared" / "data" / "real-mini"))
GOLDEN = ROOT / "tests" / "golden" / "stage_one_outputs.json"
#: name -> manifest (the demo and every real-mini manifest shape: flat rows with corrupt files, ChatML, LLaVA)
MANIFESTS = {"demo": DEMO / "samples.jsonl",
             **{f"real-mini/{n}": REAL_MINI / n for n in (
                 "samples_with_corrupt.jsonl", "chatml_voice_clone.json", "chatml_audio_understanding.json",
                 "train_chatml_samples.json", "llava_captions.json", "llava_multiturn.json")}}


def config():
    """The job: configs/precompute.yaml with the numpy stand-in encoders, 64 px images, chunks of 8 rows and
    encoder batches of 4 (batches split at chunk boundaries), decoding in this process, on the CPU."""
    from precompute.config import load_config
    return load_config(ROOT / "configs" / "precompute.yaml", [
        "audio_tokenizer={factory: 'plugin_codec:make'}", "image_encoder={factory: 'plugin_codec:make_vae'}",
        "image_size=64", "samples_per_shard=8", "encoder_batch_size=4", "num_workers=0", "device=cpu"])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record(cache: Path, media_root: Path) -> dict:
    """``{"shards": {shard: [member names in tar order]}, "members": {member: sha256}, "rejects": [[key,
    reason, detail, source]]}`` of ``cache``; ``media_root`` (the manifest's folder) written ``<ROOT>``."""
    import pyarrow.parquet as pq
    root = os.path.abspath(media_root)
    shards, members = {}, {}
    for tar in sorted(cache.glob("shard-*.tar")):
        names = []
        with tarfile.open(tar) as tf:
            for m in tf:
                data = tf.extractfile(m).read()
                if m.name.endswith(".json"):
                    data = data.decode("utf-8").replace(root, "<ROOT>").encode("utf-8")
                names.append(m.name)
                members[m.name] = _sha(data)
        shards[tar.name] = names
    rejects = [[r["key"], r["reason"], (r["detail"] or "").replace(root, "<ROOT>"),
                (r["source"] or "").replace(root, "<ROOT>")]
               for r in pq.read_table(cache / "rejects.parquet").to_pylist()]
    return {"shards": shards, "members": members, "rejects": sorted(rejects)}


def run_all(names=None) -> dict:
    """Run the job on each manifest (``names``: a subset of :data:`MANIFESTS`) into a temporary folder and
    return ``{name: record}``."""
    sys.path.insert(0, str(ROOT / "tests"))  # plugin_codec
    from precompute.job import run
    cfg = config()
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, manifest in MANIFESTS.items():
            if names is not None and name not in names:
                continue
            cache = Path(d) / name.replace("/", "_")
            run(manifest, cache, cfg, progress=False)
            out[name] = record(cache, manifest.parent)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help=f"write {GOLDEN.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    got = run_all()
    if args.write:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN} ({sum(len(r['members']) for r in got.values())} members)")
    else:
        print(json.dumps({k: len(v["members"]) for k, v in got.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
