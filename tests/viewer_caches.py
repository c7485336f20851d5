"""Real caches for the viewer's tests (tests/test_viewer*.py), made from real-mini with the tiny random
models of the real architectures, the way a user makes them (the repo's configs, stage one's job).

* :func:`voice_clone`: Higgs-Audio ChatML voice cloning (configs/precompute-tts.yaml: the tiny Higgs
  audio tokenizer and Higgs-Audio v2's text tokenizer, waveforms kept, ``audio_16k`` extra field), two audio
  items a conversation (a reference, an input, and the target, an output); one row names a corrupt
  clip (a reject), one user turn holds :data:`HOSTILE`.
* :func:`llava`: LLaVA multi-turn (configs/precompute-theworld.yaml: the tiny Wan VAE's latents, the
  tiny Gemma 3's tokenizer and image features, 64 px); one row names a corrupt image (a reject), one
  question holds :data:`HOSTILE`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: markup a hostile manifest puts into a conversation: a viewer that does not escape it changes the title
HOSTILE = '<script>document.title="pwned"</script><img src=x onerror="document.title=\'pwned\'"><b>bold?</b>'


def models(out: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """The tiny random models ``names`` (``python -m tools.testing``'s builders), saved under ``out``;
    ``higgs-text-tokenizer`` is the text tokenizer of ``higgs`` alone (what a Higgs cache records,
    without building the model around it)."""
    from tools.testing import build
    from tools.testing.higgs import make_text_tokenizer
    got = {}
    for n in names:
        if n == "higgs-text-tokenizer":
            got[n] = out / "higgs-text-tokenizer-tiny"
            if not got[n].exists():
                make_text_tokenizer("tiny").save_pretrained(str(got[n]))
        else:
            got[n] = build(n, out)[0]
    return got


def _abs(path: str, base: Path) -> str:
    return str(base / path)


def voice_clone(real_mini: Path, model_dir: Path, out: Path, n: int = 3) -> Path:
    """The first ``n`` records of real-mini's ``chatml_voice_clone.json`` (+ one naming a corrupt clip)
    precomputed into ``out`` (returned); record 0's first user turn is :data:`HOSTILE`."""
    from precompute.config import load_config
    from precompute.job import run

    m = models(model_dir, ("higgs-text-tokenizer", "higgs-audio-tokenizer"))
    recs = json.loads((real_mini / "chatml_voice_clone.json").read_text())[:n + 1]
    for r in recs:
        for msg in r["messages"]:
            if isinstance(msg["content"], dict) and "audio_url" in msg["content"]:
                msg["content"]["audio_url"] = _abs(msg["content"]["audio_url"], real_mini)
    recs[0]["messages"][1]["content"] = HOSTILE
    bad = recs[n]
    bad["misc"]["key"] = "clone-corrupt"
    bad["messages"][-1]["content"]["audio_url"] = _abs("corrupt/random_bytes.wav", real_mini)
    manifest = out.parent / f"{out.name}.json"
    manifest.write_text(json.dumps(recs))
    cfg = load_config(ROOT / "configs" / "precompute-tts.yaml", [
        f"audio_tokenizer.pretrained={m['higgs-audio-tokenizer']}", f"text_tokenizer.pretrained={m['higgs-text-tokenizer']}",
        "device=cpu", "num_workers=0", "allow_outside_root=true", "precision_samples=0"])
    summary, _ = run(manifest, out, cfg, progress=False)
    assert summary.kept == n and summary.rejected == 1, summary.reasons
    return out


def llava(real_mini: Path, model_dir: Path, out: Path, n: int = 3) -> Path:
    """The first ``n`` records of real-mini's ``llava_multiturn.json`` (+ one naming a corrupt image)
    through configs/precompute-theworld.yaml at 64 px into ``out`` (returned); record 0's first
    question holds :data:`HOSTILE`."""
    from precompute.config import load_config
    from precompute.job import run
    from precompute.validate import validate_config

    m = models(model_dir, ("wan", "gemma3"))
    recs = json.loads((real_mini / "llava_multiturn.json").read_text())[:n + 1]
    for r in recs:
        r["image"] = _abs(r["image"], real_mini)
    recs[0]["conversations"][0]["value"] = "<image>\n" + HOSTILE + " What is shown?"
    recs[n]["id"] = "mt-corrupt"
    recs[n]["image"] = _abs("corrupt/truncated.jpg", real_mini)
    manifest = out.parent / f"{out.name}.json"
    manifest.write_text(json.dumps(recs))
    cfg = validate_config(load_config(ROOT / "configs" / "precompute-theworld.yaml", [
        f"image_encoder.pretrained={m['wan']}", f"text_tokenizer.pretrained={m['gemma3']}",
        f"image_features.pretrained={m['gemma3']}", "image_size=64", "device=cpu", "num_workers=0",
        "allow_outside_root=true",
        # answers only: the viewer's tests want trained and untrained text tokens side by side (the preset's
        # all_but_world, TheWorld's own objective, trains every input token but the world embeddings)
        "label_policy=answers"]))
    summary, _ = run(manifest, out, cfg, progress=False)
    assert summary.kept == n and summary.rejected == 1, summary.reasons
    return out


#: the conversations of :func:`relative_tokenizer`'s cache (one user turn each)
TEXTS = ("The quick brown fox jumps.", "Grüße aus Köln, 日本語 and emoji 🎧 too.", "A first line\nand a second line.")


def relative_tokenizer(model_dir: Path, out: Path, *, working_dir: bool = True) -> Path:
    """A cache written with the shard writer directly whose manifest records its (Higgs-Audio v2 tiny)
    text tokenizer as stage one records a path given relative to the folder it ran in:
    ``pretrained: <model_dir's name>/higgs-text-tokenizer-tiny``, and, with ``working_dir``, that
    folder (``working_dir``: ``model_dir``'s parent). Three samples :data:`TEXTS`, tokenized by that
    tokenizer, the second half of each trained. Returns ``out``."""
    import numpy as np

    from precompute.encoders import load_text_tokenizer
    from shards.merge import merge_parts
    from shards.schema import shard_name
    from shards.writer import ShardWriter

    folder = models(model_dir, ("higgs-text-tokenizer",))["higgs-text-tokenizer"]
    tok = load_text_tokenizer({"name": "hf", "pretrained": str(folder)})
    with ShardWriter(out, shard_name(0, 0)) as w:
        for i, text in enumerate(TEXTS):
            ids = tok.encode(text).astype(np.int32)
            labels = ids.copy()
            labels[: len(ids) // 2] = -100
            w.add(f"text-{i}", {"json": {"text": text, "conversation": {"turns": [
                {"role": "user", "parts": [{"type": "text", "text": text}]}]}},
                "input_ids.npy": ids, "labels.npy": labels})
        w.commit()
    relative = f"{model_dir.name}/{folder.name}"
    manifest = {"config": {"text_tokenizer": {"name": "hf", "pretrained": relative}},
                "encoders": {"text_tokenizer": tok.describe()},
                "text": {"vocab_size": tok.vocab_size, "pad_id": tok.pad_id, "special_token_ids": {}}}
    if working_dir:
        manifest["working_dir"] = str(model_dir.parent)
    merge_parts(out, manifest)
    return out


@pytest.fixture(autouse=True, scope="module")
def viewer_cache_dir(tmp_path_factory):
    """The viewer's own cache folder (the side table of text) under the module's tmp folder, for each viewer
    test module (imported there: ``from viewer_caches import viewer_cache_dir``)."""
    old = os.environ.get("SHARDCACHE_VIEWER_CACHE")
    os.environ["SHARDCACHE_VIEWER_CACHE"] = str(tmp_path_factory.mktemp("viewer-cache"))
    yield
    if old is None:
        os.environ.pop("SHARDCACHE_VIEWER_CACHE", None)
    else:
        os.environ["SHARDCACHE_VIEWER_CACHE"] = old
