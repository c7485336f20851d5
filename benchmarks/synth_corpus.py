"""A synthetic stage-one corpus for the ceiling benchmark, written once into a cache folder outside
the repository and reused while its parameters are unchanged.

    python -m benchmarks.synth_corpus --n 2000 [--out DIR]

``DIR`` (default ``$SHARDCACHE_BENCH_CORPUS`` or ``~/.cache/shardcache/bench-corpus``) gets, per
``n`` (the samples per job kind):

* ``audio/clip-NNNNNN.{wav,flac,mp3}``: ``n`` speech-like clips of 10 s (a voiced source whose pitch
  glides around 100-220 Hz, three formants, syllables at ~4 Hz, breath noise), a third each as WAV
  (16-bit), FLAC and MP3, at 16, 44.1 and 48 kHz in turn (9 combinations), mono;
* ``images/img-NNNNNN.jpg``: ``n`` photo-like JPEGs (smooth colour fields, edges, texture noise;
  quality 90) of mixed sizes, 640 x 480 to 1920 x 1080, landscape and portrait;
* ``speech-N.jsonl``: one flat row per clip (key, text, audio, speaker);
* ``voice_clone-N.json``: ``n`` ChatML voice-cloning conversations (Higgs-Audio's layout: system,
  user text, assistant reference clip, user text, assistant target clip), two clips each;
* ``llava-N.json``: ``n`` LLaVA multi-turn conversations with one image each.

A folder holding a larger corpus serves a smaller ``n`` (the manifests name the first ``n``
files). Deterministic (seeded): the same files for the same ``n``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

VERSION = 2
CLIP_S = 10.0
#: (container, soundfile format, subtype) in turn
FORMATS = (("wav", "WAV", "PCM_16"), ("flac", "FLAC", "PCM_16"), ("mp3", "MP3", "MPEG_LAYER_III"))
RATES = (16000, 44100, 48000)
SIZES = ((640, 480), (1024, 768), (1280, 720), (1920, 1080), (480, 640), (768, 1024), (800, 800), (1600, 1200))
WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars rise above quiet hills and "
         "distant rivers carry cold water past old stone bridges").split()


def default_dir() -> Path:
    """``$SHARDCACHE_BENCH_CORPUS`` or ``~/.cache/shardcache/bench-corpus``."""
    return Path(os.environ.get("SHARDCACHE_BENCH_CORPUS") or Path.home() / ".cache" / "shardcache" / "bench-corpus")


def clip_format(i: int) -> tuple[str, str, str, int]:
    """``(suffix, format, subtype, sample_rate)`` of clip ``i``: the 9 combinations of 3 containers x 3 rates."""
    suffix, fmt, sub = FORMATS[i % 3]
    return suffix, fmt, sub, RATES[(i // 3) % 3]


@functools.lru_cache(maxsize=None)
def _speech_base(sr: int) -> np.ndarray:
    """float32 ``(4 * CLIP_S * sr,)``: a long speech-like signal per rate, made once per process."""
    rng = np.random.default_rng(sr)
    n = int(4 * CLIP_S * sr)
    t = np.arange(n) / sr
    f0 = 160 * (1 + 0.3 * np.sin(2 * np.pi * 0.37 * t) + 0.1 * np.sin(2 * np.pi * 1.3 * t))
    phase = 2 * np.pi * np.cumsum(f0) / sr
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    formants = sum(np.sin(2 * np.pi * f * t) for f in (650, 1500, 2800))
    syllables = np.clip(np.sin(2 * np.pi * 4.1 * t) + 0.3 * np.sin(2 * np.pi * 1.7 * t) + 0.3, 0, None)
    y = (0.6 * voiced + 0.1 * formants) * syllables + 0.02 * rng.standard_normal(n)
    return (y / np.max(np.abs(y))).astype(np.float32)


def speech_like(i: int, sr: int, seconds: float = CLIP_S) -> np.ndarray:
    """float32 ``(seconds * sr,)`` in [-1, 1]: a window of a speech-like signal (pitch gliding around
    110-210 Hz, three formants, syllables at ~4 Hz, breath noise), where and how loud seeded by ``i``."""
    rng = np.random.default_rng(i)
    base, n = _speech_base(sr), int(seconds * sr)
    start = int(rng.integers(0, len(base) - n))
    return (base[start:start + n] * rng.uniform(0.2, 0.6)).astype(np.float32)


def photo_like(i: int) -> np.ndarray:
    """uint8 ``(H, W, 3)``: smooth colour fields, a few edges and texture noise, of size ``SIZES[i % 8]``."""
    rng = np.random.default_rng(10_000_000 + i)
    w, h = SIZES[i % len(SIZES)]
    small = rng.uniform(0, 255, (6, 8, 3)).astype(np.float32)
    from PIL import Image
    base = np.asarray(Image.fromarray(small.astype(np.uint8)).resize((w, h), Image.BICUBIC), np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    for _ in range(3):  # a few hard edges (objects)
        a, b, c = rng.uniform(-1, 1, 3)
        base[(a * xx + b * yy + c * w) > 0] *= rng.uniform(0.6, 1.0)
    base += rng.normal(0, 6, (h, w, 1))
    return np.clip(base, 0, 255).astype(np.uint8)


def _write_clip(args) -> None:
    i, path = args
    import soundfile as sf
    _, fmt, sub, sr = clip_format(i)
    sf.write(path, speech_like(i, sr), sr, format=fmt, subtype=sub)


def _write_image(args) -> None:
    i, path = args
    from PIL import Image
    Image.fromarray(photo_like(i)).save(path, quality=90)


def _text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n))


def write(out: Path, n: int, jobs: int | None = None) -> dict[str, Path]:
    """Write (or reuse) the corpus for ``n`` samples per job kind under ``out``; return the manifest of
    each kind (``speech``, ``voice_clone``, ``llava``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "audio").mkdir(exist_ok=True)
    (out / "images").mkdir(exist_ok=True)
    clips = [out / "audio" / f"clip-{i:06d}.{clip_format(i)[0]}" for i in range(n)]
    images = [out / "images" / f"img-{i:06d}.jpg" for i in range(n)]
    stamp = out / "corpus.json"
    have = json.loads(stamp.read_text()) if stamp.exists() else {}
    if have.get("version") != VERSION or have.get("n", 0) < n:
        todo_a = [(i, str(p)) for i, p in enumerate(clips) if not p.exists()]
        todo_i = [(i, str(p)) for i, p in enumerate(images) if not p.exists()]
        with ProcessPoolExecutor(jobs or os.cpu_count()) as ex:
            list(ex.map(_write_clip, todo_a, chunksize=16))
            list(ex.map(_write_image, todo_i, chunksize=16))
        stamp.write_text(json.dumps({"version": VERSION, "n": max(n, have.get("n", 0))}) + "\n")
    rng = np.random.default_rng(n)
    manifests = {"speech": out / f"speech-{n}.jsonl", "voice_clone": out / f"voice_clone-{n}.json",
                 "llava": out / f"llava-{n}.json"}
    rows = [{"key": f"speech-{i:06d}", "text": _text(rng, 25), "audio": f"audio/{p.name}",
             "speaker": f"spk{i % 40}"} for i, p in enumerate(clips)]
    manifests["speech"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    system = ("Generate audio following instruction.\n\n<|scene_desc_start|>\nAudio is recorded from a quiet room."
              "\n<|scene_desc_end|>")
    convs = []
    for i in range(n):
        ref, tgt = clips[i], clips[(i + 1) % n]
        convs.append({"messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": _text(rng, 25)},
            {"role": "assistant", "content": {"type": "audio", "audio_url": f"audio/{ref.name}"}},
            {"role": "user", "content": _text(rng, 25)},
            {"role": "assistant", "content": {"type": "audio", "audio_url": f"audio/{tgt.name}"}}],
            "start_index": 4, "speaker": f"spk{i % 40}", "misc": {"key": f"clone-{i:06d}"}})
    manifests["voice_clone"].write_text(json.dumps(convs))
    llava = [{"id": f"llava-{i:06d}", "image": f"images/{p.name}", "conversations": [
        {"from": "human", "value": "<image>\nWhat is shown in this picture?"},
        {"from": "gpt", "value": _text(rng, 30)},
        {"from": "human", "value": "Describe the colours."},
        {"from": "gpt", "value": _text(rng, 20)}]} for i, p in enumerate(images)]
    manifests["llava"].write_text(json.dumps(llava))
    return manifests


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="samples per job kind (default 2000)")
    ap.add_argument("--out", type=Path, default=None, help="corpus folder (default: see above)")
    args = ap.parse_args(argv)
    for kind, path in write(args.out or default_dir(), args.n).items():
        print(f"{kind}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
