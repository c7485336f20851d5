"""Regenerate the tables of docs/ that are derived from the code's registries (the fields and their
kinds, the encoder / manifest / producer names, what each option does to a cache) and from ``make bench``
(docs/benchmarks.md).

    python scripts/gen_docs.py            # rewrite the generated blocks in place
    python scripts/gen_docs.py --check    # exit 1 when a block is out of date (tests/test_docs.py)

A generated block sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``; the
text around it is written by hand.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cell(x) -> str:
    return str(x).replace("|", "\\|")


def fields_table() -> str:
    from shards import fields
    from shards.kinds import PAD_LAST, PAD_TEXT
    rows = ["| field | kind | stored dtype, rank | batch keys | pad | stored as | what |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for f in fields.FIELDS:
        pad = {PAD_TEXT: "the cache's pad id", PAD_LAST: "last offset"}.get(f.pad, f.pad) if isinstance(f.pad, str) \
            else f.pad
        where = "own member" if not f.packed else "tensors.npz"
        rows.append(f"| `{f.name}` | {f.kind.name} | {f.dtype}, {f.ndim}-D | "
                    f"{', '.join(f'`{k}`' for k in f.batch_keys)} | {_cell(pad)} | {where} | {_cell(f.doc)} |")
    rows.append("| `audio_<name>`, `audio_<name>_starts` | waveform, offsets | int16 1-D, int32 1-D | as `audio` | "
                "0, last offset | tensors.npz | `extra_fields` producer `waveform` (e.g. `audio_16k`) |")
    rows.append("| `codes_<codec>` | codes | int16, 2-D | `codes_<codec>`, `_lengths`, `_mask` | -100 | sidecar tar | "
                "added later with `shardcache add-field` |")
    return "\n".join(rows)


def kinds_table() -> str:
    from shards.kinds import KINDS
    rows = ["| kind | the model sees | lengths axis | mask axes | fixed axes | counts tokens | what |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for k in KINDS.values():
        first = " ".join((type(k).__doc__ or "").split("\n\n")[0].split()).replace("``", "`")
        rows.append(f"| {k.name} | {k.model_dtype or 'its storage dtype'} | {k.lengths_axis} | {k.mask_axes or '-'} | "
                    f"{k.fixed_axes or '-'} | {'yes' if k.counts_tokens else 'no'} | {_cell(first)} |")
    return "\n".join(rows)


def names_table() -> str:
    from precompute.encoders.registry import AUDIO_TOKENIZERS, IMAGE_ENCODERS, TEXT_TOKENIZERS
    from precompute.manifests import FORMATS
    from precompute.producers import PRODUCERS
    rows = ["| what | names | option |", "| --- | --- | --- |",
            f"| codecs | {', '.join(f'`{n}`' for n in sorted(AUDIO_TOKENIZERS))} | `audio_tokenizer.name` |",
            f"| image VAEs | {', '.join(f'`{n}`' for n in sorted(IMAGE_ENCODERS))} | `image_encoder.name` |",
            f"| text tokenizers | {', '.join(f'`{n}`' for n in sorted(TEXT_TOKENIZERS))} | `text_tokenizer.name` |",
            f"| manifest formats | {', '.join(f'`{n}`' for n in FORMATS)} | `manifest_format` (else detected) |",
            f"| producers | {', '.join(f'`{n}`' for n in PRODUCERS)} | `extra_fields`, `add-field --producer` |"]
    return "\n".join(rows)


def effects_table() -> str:
    """docs/trust.md's table: each option and what it does to a cache, from the options' declarations
    (:func:`precompute.identity.effects_table`)."""
    from precompute.identity import effects_table as table
    return table()


def bench_summary() -> str:
    p = ROOT / "benchmarks" / "results" / "summary.md"
    return p.read_text().strip() if p.exists() else "(run `make bench`)"


def loader_headline() -> str:
    """The README's loader table: ShardLoader beside ``cat``, the one-copy ceiling and the peers,
    from the last ``make bench`` (``benchmarks/results/loader.json``)."""
    import json
    p = ROOT / "benchmarks" / "results" / "loader.json"
    if not p.exists():
        return "(run `make bench`)"
    r = json.loads(p.read_text())
    cat = r["cat"]["samples_s"]
    lit = ((r.get("peers") or {}).get("litdata") or {}).get("ratio_to_cat")
    rows = [f"Batches of {r['batch_size']} padded, collated samples of ~{r['cache']['KiB_per_sample']:.0f} KiB "
            f"from the page cache, one `make bench` run on {r['machine']['cpus']} cores (peers: per-sample "
            "dicts, no collation; ratios measured within rounds that each open with a `cat`, see "
            "[benchmarks.md](docs/benchmarks.md)):", "",
            "| reader | samples/s | x `cat` | x LitData |", "| --- | --- | --- | --- |",
            f"| `cat` > /dev/null | {cat:.0f} | 1.00 | |"]

    def row(label, v, to_cat=None):
        to_cat = v / cat if to_cat is None else to_cat
        lx = f"{to_cat / lit:.2f}" if lit else ""
        rows.append(f"| {label} | {v:.0f} | {to_cat:.2f} | {lx} |")

    if "batch" in (r.get("copy_ceiling") or {}):
        row("one `preadv` per sample into a batch buffer (one-copy ceiling)", r["copy_ceiling"]["batch"]["samples_s"])
    keep = ("one process, compact", "one process, compact, read on demand", "one process, float32",
            "2 workers, compact")
    for x in r["shardloader"]:
        if x["label"] in keep:
            row(f"ShardLoader, {x['label']}", x["samples_s"], x.get("ratio_to_cat"))
    for name, label in (("litdata", "LitData `StreamingDataset`"), ("mosaic", "Mosaic `StreamingDataset`")):
        v = (r.get("peers") or {}).get(name) or {}
        if v.get("samples_s"):
            row(f"{label}, one process", v["samples_s"], v.get("ratio_to_cat"))
    row("webdataset `.decode()`", r["webdataset"]["samples_s"])
    return "\n".join(rows)


def stage_one_headline() -> str:
    """The README's stage-one line: the null-encoder ceiling per core of the last ``make bench``
    (``benchmarks/results/ceiling.json``, :mod:`benchmarks.bench_ceiling`)."""
    import json
    p = ROOT / "benchmarks" / "results" / "ceiling.json"
    if not p.exists():
        return "(run `make bench`)"
    r = json.loads(p.read_text())
    k = {x["kind"]: x for x in r["kinds"]}
    parts = []
    for kind, label in (("speech", "speech clips"), ("voice_clone", "ChatML voice-cloning conversations"),
                        ("llava", "LLaVA conversations")):
        if kind in k:
            x = k[kind]
            unit = (f"{x['audio_s_per_core_s']:.0f} s of audio" if x.get("audio_s_per_core_s")
                    else f"{x.get('images_per_core_s', 0):.0f} images")
            parts.append(f"{x['samples_per_core_s']:.0f} {label}/s ({unit}/s)")
    return (f"Stage one's own ceiling (null encoders, {r['n']} synthetic samples per kind, one `make bench` "
            f"run on {r['cpus']} cores): per CPU core, " + ", ".join(parts) +
            "; how many cores a GPU needs: [benchmarks.md](docs/benchmarks.md#throughput-model).")


#: what the stages' CPU time of the main process is (the rest runs in the decode processes)
#: the stages of the ceiling's stage pass that run in each process of a rank (see the throughput model)
DECODE_STAGES = ("decode", "resample", "tokenize")
MAIN_STAGES = ("encode (null)",)
WRITER_STAGES = ("tar write", "checksum", "index")


def throughput_model() -> str:
    """docs/benchmarks.md's throughput model, on the pipeline's structure: per rank, decode processes,
    a main process (its main thread and the encoder thread) and a writer process, all overlapped. The
    CPU figures are the ceiling's stage pass (``ceiling.json``, this VM); the GPU figure is each
    recipe's encoders alone at its default settings on one H200 (``gpu_steady-new.json``,
    ``gpu_steady-tw.json``); see the text around it for what is measured and what assumed."""
    import json
    import math
    res = ROOT / "benchmarks" / "results"
    need = ("ceiling.json", "gpu_steady-new.json", "gpu_steady-tw.json")
    if not all((res / f).exists() for f in need):
        return "(run `make bench` and `make bench-gpu`)"
    c = json.loads((res / "ceiling.json").read_text())
    kinds = {x["kind"]: x for x in c["kinds"]}
    card, gpu_s = None, {}
    for f, kind in (("gpu_steady-new.json", "voice_clone"), ("gpu_steady-tw.json", "llava")):
        g = json.loads((res / f).read_text())
        card = card or g["machine"]["gpu"]
        gpu_s[kind] = g["jobs"][0]["encoders_alone"]["s_per_row"]
    gpu_s["speech"] = gpu_s["voice_clone"] / 2  # one 10 s clip per row against two: derived, not measured
    rows = [f"| job | GPU s per sample ({card}, defaults) | samples/s one GPU | decode CPU ms per sample | main thread CPU "
            "ms per sample | writer CPU ms per sample | decode cores per GPU | 8 GPUs + 64 cores: samples/s, bound | "
            "8 GPUs + 128 cores: samples/s, bound |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    node: dict[str, dict[int, float]] = {}
    for kind, label in (("speech", "TTS, flat 10 s clips (Higgs tokenizer, clip by clip)"),
                        ("voice_clone", "TTS, ChatML voice cloning, 2 x 10 s (Higgs tokenizer, clip by clip)"),
                        ("llava", "TheWorld, LLaVA, 1 image (Wan VAE bf16 512 px + SigLIP 896 px)")):
        x = kinds.get(kind)
        if x is None:
            continue
        st = x["stages"]
        per = {name: sum(st["cpu_s"][k] for k in stages) / st["rows"]
               for name, stages in (("decode", DECODE_STAGES), ("main", MAIN_STAGES), ("writer", WRITER_STAGES))}
        gpu_rate = 1 / gpu_s[kind]
        cells = []
        for cores in (64, 128):
            bounds = {"GPUs": 8 * gpu_rate, "decode cores": (cores - 16) / per["decode"],
                      "main threads": 8 / per["main"], "writers": 8 / per["writer"]}
            what = min(bounds, key=bounds.get)
            node.setdefault(kind, {})[cores] = bounds[what]
            cells.append(f"{bounds[what]:,.0f}, {what}")
        rows.append(f"| {label} | {gpu_s[kind] * 1e3:.1f} ms | {gpu_rate:.1f} | {per['decode'] * 1e3:.1f} | "
                    f"{per['main'] * 1e3:.1f} | {per['writer'] * 1e3:.1f} | {math.ceil(gpu_rate * per['decode'])} | "
                    f"{cells[0]} | {cells[1]} |")
    out = "\n".join(rows)
    corp = []
    if "llava" in node:
        n = 1.2e6
        for cores in (64, 128):
            wall = n / (2 * node["llava"][cores])
            corp.append(f"1.2 M images (TheWorld job), 2 nodes of 8 {card} with {cores} cores each: {wall / 3600:.2f} h "
                        f"wall, {16 * wall / 3600:.1f} GPU-hours held ({n * gpu_s['llava'] / 3600:.1f} GPU-hours of "
                        "encoder work)")
    if "speech" in node:
        x = kinds["speech"]
        clip = x["job"]["audio_s"] / x["job"]["samples"]
        n = 10_000 * 3600 / clip
        for cores in (64, 128):
            wall = n / (2 * node["speech"][cores])
            corp.append(f"10,000 h of audio in {clip:.0f} s clips (TTS job), 2 nodes of 8 {card} with {cores} cores each: "
                        f"{wall / 3600:.2f} h wall, {16 * wall / 3600:.1f} GPU-hours held "
                        f"({n * gpu_s['speech'] / 3600:.1f} GPU-hours of encoder work)")
    return out + "\n\n" + "\n".join(f"- {x}" for x in corp)


def gpu_summary() -> str:
    """``make bench-gpu``'s tables (``benchmarks/results/gpu.md``), or the line saying none ran."""
    md = ROOT / "benchmarks" / "results" / "gpu.md"
    if not md.exists():
        return "No `make bench-gpu` results: nothing here was measured on a GPU."
    return md.read_text().rstrip("\n")


def contract_table() -> str:
    """docs/training.md's contract table: which recipe checks which item (a recipe's ``contract_items``:
    :class:`train.recipes.base.Recipe`), every item a contract can set (:class:`shards.cache.Contract`)."""
    from dataclasses import fields

    from shards.cache import PARTS, Contract
    from train.recipes import RECIPES, recipe_class
    recipes = {name: recipe_class(name).contract_items for name in RECIPES}
    tokens = [k for items in recipes.values() for k in items if k.startswith("special_tokens.")]
    order = ["fields", *dict.fromkeys(tokens)]
    for f in fields(Contract):
        if f.name in PARTS:
            order += [f"{f.name}.{a.name}" for a in fields(PARTS[f.name])]
        elif f.name not in ("model", "fields", "optional_fields", "special_tokens"):
            order.append(f.name)
    rows = ["| item | " + " | ".join(f"`{n}`" for n in recipes) + " |", "| --- |" + " --- |" * len(recipes)]
    for item in order:
        rows.append(f"| `{_cell(item)}` | " + " | ".join(_cell(items.get(item, "any")) for items in recipes.values()) + " |")
    return "\n".join(rows)


BLOCKS = {"docs/format.md": {"fields": fields_table, "kinds": kinds_table},
          "docs/training.md": {"contract": contract_table},
          "docs/configuration.md": {"names": names_table},
          "docs/trust.md": {"effects": effects_table},
          "docs/benchmarks.md": {"bench": bench_summary, "gpu": gpu_summary, "model": throughput_model},
          "README.md": {"loader": loader_headline, "stage-one": stage_one_headline}}
#: the blocks copied from ``make bench``'s results (``--skip-bench`` leaves them alone)
BENCH_BLOCKS = {"bench", "loader", "gpu", "stage-one", "model"}


def render(text: str, blocks: dict) -> str:
    for name, fn in blocks.items():
        pat = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- /generated:{name} -->)", re.S)
        if not pat.search(text):
            raise SystemExit(f"no generated:{name} block")
        text = pat.sub(lambda m: m.group(1) + fn() + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only report blocks that are out of date (exit 1)")
    p.add_argument("--skip-bench", action="store_true",
                   help="leave the tables copied from make bench alone (docs/benchmarks.md, the README's loader table)")
    args = p.parse_args(argv)
    stale = []
    for rel, blocks in BLOCKS.items():
        if args.skip_bench:
            blocks = {k: v for k, v in blocks.items() if k not in BENCH_BLOCKS}
            if not blocks:
                continue
        path = ROOT / rel
        old = path.read_text()
        new = render(old, blocks)
        if new != old:
            stale.append(rel)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"out of date (run python scripts/gen_docs.py): {', '.join(stale)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
