#!/usr/bin/env python
"""Generate the small demo data set in ``data/demo/`` (real speech, real photos, known-bad inputs).

Everything in the folder is made by this script, offline and deterministically:

* **Speech**: short English sentences written for this project, spoken by ``espeak-ng`` (several
  voices, speeds and pitches). espeak-ng writes 22050 Hz mono 16-bit WAV; the clips are trimmed,
  peak-normalised, resampled with soxr to 16000/22050/24000/44100/48000 Hz, some made stereo, and
  written as WAV (PCM_16, one PCM_24, one FLOAT) or FLAC (PCM_16) with soundfile.
* **Photos**: CC0 / public-domain photographs bundled with scikit-image (``astronaut``,
  ``chelsea``, ``coffee``, ``rocket``, ``camera``, ``coins``), resized with Pillow LANCZOS so the
  longest side is at most 512 px and saved as JPEG (quality 85) or PNG. Rows with a photo have a
  spoken caption describing it.
* **Known-bad inputs**: an empty ``.wav``, a WAV cut inside its header, a text file named
  ``.wav``, a truncated JPEG, plus manifest rows with a missing audio file, empty text, a duplicate
  key and one line of malformed JSON. ``expected_rejects.json`` lists each with the reject reason
  code from :mod:`shards.schema`.

Outputs (under ``--out``, default ``data/demo``)::

    samples.jsonl          one JSON object per line: key, text, audio, [image], speaker
    expected_rejects.json  [{"key", "audio", "image", "reason"}, ...] for every bad row
    README.md              contents, licences, how to regenerate
    audio/                 WAV and FLAC clips (and the corrupt audio files)
    images/                JPEG and PNG photos (and the truncated JPEG)

Usage::

    python scripts/make_demo_data.py [--out data/demo]

Requires ``espeak-ng`` on PATH and the Python packages numpy, soundfile, soxr, pillow and
scikit-image. Output is byte-identical on rerun with the same tool versions (no randomness is
used; espeak-ng, soxr, libsndfile and libjpeg are deterministic).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "data" / "demo"
MAX_BYTES = 3 * 1000 * 1000          # the folder must stay under 3 MB
MIN_DUR_S, MAX_DUR_S = 1.0, 4.0
ESPEAK_SR = 22050
PEAK = 0.89                          # about -1 dBFS

# Reason codes, copied from shards/schema.py so the script runs without the package importable;
# checked against it below when it is.
MISSING_FILE = "missing_file"
UNREADABLE_AUDIO = "unreadable_audio"
IMAGE_TRUNCATED = "image_truncated"
EMPTY_TEXT = "empty_text"
DUPLICATE_KEY = "duplicate_key"
MALFORMED_ROW = "malformed_row"


@dataclass(frozen=True)
class Clip:
    key: str
    text: str
    voice: str        # espeak-ng -v
    speed: int        # espeak-ng -s (words per minute)
    pitch: int        # espeak-ng -p (0-99)
    sr: int           # output sample rate
    channels: int     # 1 or 2
    fmt: str          # "wav" or "flac"
    subtype: str      # soundfile subtype
    image: str | None = None   # name of a photo in PHOTOS (caption rows)


# Sentences written for this demo. Keep them short: every clip must be 1-4 s after trimming.
CLIPS: list[Clip] = [
    Clip("spk-us-0001", "The train leaves at seven fifteen.", "en-us", 160, 50, 16000, 1, "flac", "PCM_16"),
    Clip("spk-us-0002", "Please close the window before it rains.", "en-us", 170, 45, 22050, 1, "wav", "PCM_16"),
    Clip("spk-gb-0003", "A cup of tea fixes most things.", "en-gb", 150, 55, 24000, 1, "flac", "PCM_16"),
    Clip("spk-gb-0004", "The library opens late on Thursdays.", "en-gb", 165, 40, 16000, 1, "wav", "PCM_16"),
    Clip("spk-usf-0005", "My sister painted the fence bright green.", "en-us+f3", 155, 70, 44100, 2, "flac", "PCM_16"),
    Clip("spk-rp-0006", "Numbers like forty two are easy to say.", "en-gb-x-rp", 175, 50, 22050, 1, "flac", "PCM_16"),
    Clip("spk-sc-0007", "The ferry was cancelled because of fog.", "en-gb-scotland", 160, 35, 24000, 1, "wav", "PCM_24"),
    Clip("spk-us-0008", "Turn left at the old bakery.", "en-us", 180, 60, 16000, 1, "flac", "PCM_16"),
    Clip("spk-gbm-0009", "We counted nine ducks on the pond.", "en-gb+m3", 150, 45, 48000, 1, "flac", "PCM_16"),
    Clip("spk-usf-0010", "Is this the right platform for Boston?", "en-us+f2", 165, 75, 22050, 1, "wav", "FLOAT"),
    Clip("spk-cb-0011", "Sunshine is expected after lunch.", "en-029", 155, 50, 16000, 1, "flac", "PCM_16"),
    Clip("spk-gb-0012", "Could you spell your surname, please?", "en-gb", 170, 55, 24000, 2, "flac", "PCM_16"),
    Clip("spk-us-0013", "The printer is out of paper again.", "en-us", 175, 40, 22050, 1, "flac", "PCM_16"),
    Clip("spk-rp-0014", "Quiet rivers run through the valley.", "en-gb-x-rp", 150, 30, 16000, 1, "wav", "PCM_16"),
    Clip("spk-usf-0015", "She whistled a tune while cooking.", "en-us+f3", 160, 65, 48000, 2, "flac", "PCM_16"),
    Clip("spk-sc-0016", "Bring a warm jacket and an umbrella.", "en-gb-scotland", 165, 50, 22050, 1, "flac", "PCM_16"),
    Clip("spk-gbm-0017", "The meeting moved to Tuesday morning.", "en-gb+m3", 170, 45, 44100, 1, "flac", "PCM_16"),
    Clip("spk-us-0018", "Zebras and yaks live in very different places.", "en-us", 180, 55, 16000, 1, "flac", "PCM_16"),
    # Photo + spoken caption rows.
    Clip("img-astronaut", "An astronaut smiles in front of an American flag.", "en-us", 170, 50, 24000, 1, "flac", "PCM_16", "astronaut"),
    Clip("img-chelsea", "A ginger cat looks up at the camera.", "en-gb", 160, 55, 22050, 1, "flac", "PCM_16", "chelsea"),
    Clip("img-coffee", "A cup of coffee on a wooden table.", "en-us+f2", 155, 70, 16000, 1, "wav", "PCM_16", "coffee"),
    Clip("img-rocket", "A rocket lifts off into a blue sky.", "en-gb-x-rp", 165, 45, 48000, 2, "flac", "PCM_16", "rocket"),
    Clip("img-camera", "A man with a camera on a tripod, in black and white.", "en-us", 180, 40, 16000, 1, "flac", "PCM_16", "camera"),
    Clip("img-coins", "Old silver coins on a grey background.", "en-gb+m3", 160, 50, 22050, 1, "flac", "PCM_16", "coins"),
]

# Clips used only by bad rows (valid audio, the row is bad for another reason).
TRUNC_IMG_CLIP = Clip("img-chelsea-truncated", "The same cat, but the picture file is cut short.",
                      "en-gb", 170, 55, 16000, 1, "flac", "PCM_16", None)

# name -> (skimage.data function, format, longest side)
PHOTOS = {
    "astronaut": ("astronaut", "jpg", 512),
    "chelsea": ("chelsea", "jpg", 451),
    "coffee": ("coffee", "jpg", 512),
    "rocket": ("rocket", "jpg", 512),
    "camera": ("camera", "png", 256),     # grayscale PNG, kept small
    "coins": ("coins", "jpg", 384),       # grayscale JPEG
}
JPEG_QUALITY = 85
TRUNCATE_FRACTION = 0.4

NOT_AUDIO_TEXT = (
    "This is not audio.\n"
    "It is a plain text file with a .wav name, made by scripts/make_demo_data.py to check\n"
    "that the precompute stage rejects it as unreadable_audio instead of crashing.\n"
)


def die(msg: str) -> None:
    print(f"make_demo_data: error: {msg}", file=sys.stderr)
    sys.exit(2)


def check_tools() -> str:
    exe = shutil.which("espeak-ng")
    if exe is None:
        die("espeak-ng was not found on PATH. It is needed to synthesise the demo speech.\n"
            "  Debian/Ubuntu: sudo apt-get update && sudo apt-get install espeak-ng\n"
            "  macOS:         brew install espeak-ng")
    return exe


def espeak(exe: str, clip: Clip, tmpdir: Path):
    import soundfile as sf

    wav = tmpdir / f"{clip.key}.espeak.wav"
    cmd = [exe, "-v", clip.voice, "-s", str(clip.speed), "-p", str(clip.pitch), "-w", str(wav),
           "--", clip.text]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or not wav.exists():
        die(f"espeak-ng failed for {clip.key}: {' '.join(cmd)}\n{res.stderr.strip()}")
    y, sr = sf.read(str(wav), dtype="float64", always_2d=False)
    if sr != ESPEAK_SR or y.ndim != 1:
        die(f"unexpected espeak-ng output for {clip.key}: sr={sr} shape={y.shape}")
    return y


def trim(y, sr: int):
    """Cut leading/trailing silence, keeping 50 ms before and 150 ms after the speech."""
    import numpy as np

    loud = np.flatnonzero(np.abs(y) > 0.02 * np.max(np.abs(y)))
    if loud.size == 0:
        die("espeak-ng produced silence")
    a = max(0, loud[0] - int(0.05 * sr))
    b = min(len(y), loud[-1] + int(0.15 * sr))
    return y[a:b]


def render_audio(exe: str, clip: Clip, tmpdir: Path, out: Path) -> str:
    """Synthesise ``clip`` and write it under ``out/audio``; returns the relative path."""
    import numpy as np
    import soundfile as sf
    import soxr

    y = trim(espeak(exe, clip, tmpdir), ESPEAK_SR)
    if clip.sr != ESPEAK_SR:
        y = soxr.resample(y, ESPEAK_SR, clip.sr, quality="HQ")
    y = y / np.max(np.abs(y)) * PEAK
    if clip.channels == 2:
        # A plausible stereo image: the right channel is quieter and 7 ms later.
        d = int(round(0.007 * clip.sr))
        right = np.concatenate([np.zeros(d), y[:-d]]) * 0.7
        y = np.stack([y, right], axis=1)
    dur = y.shape[0] / clip.sr
    if not MIN_DUR_S <= dur <= MAX_DUR_S:
        die(f"clip {clip.key} is {dur:.2f} s, outside [{MIN_DUR_S}, {MAX_DUR_S}] s; "
            "shorten or lengthen its sentence")
    rel = f"audio/{clip.key}.{clip.fmt}"
    fmt = {"wav": "WAV", "flac": "FLAC"}[clip.fmt]
    data = y.astype(np.float32) if clip.subtype == "FLOAT" else y
    sf.write(str(out / rel), data, clip.sr, subtype=clip.subtype, format=fmt)
    if clip.subtype == "FLOAT" and fmt == "WAV":
        zero_peak_timestamp(out / rel)
    return rel


def zero_peak_timestamp(path: Path) -> None:
    """libsndfile adds a ``PEAK`` chunk to float WAVs holding the current time; zero it so reruns
    give identical bytes. Chunk layout: b"PEAK", size, version (u32), timestamp (u32), peaks."""
    b = bytearray(path.read_bytes())
    pos = 12                                  # after b"RIFF" size b"WAVE"
    while pos + 8 <= len(b):
        cid, size = bytes(b[pos:pos + 4]), int.from_bytes(b[pos + 4:pos + 8], "little")
        if cid == b"PEAK":
            b[pos + 12:pos + 16] = bytes(4)
            path.write_bytes(bytes(b))
            return
        if cid == b"data":
            break
        pos += 8 + size + (size & 1)


def render_photo(name: str, out: Path) -> str:
    import numpy as np
    import skimage.data
    from PIL import Image

    func, ext, longest = PHOTOS[name]
    arr = np.asarray(getattr(skimage.data, func)())
    img = Image.fromarray(arr)
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    w, h = img.size
    scale = min(1.0, longest / max(w, h))
    if scale < 1.0:
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.LANCZOS)
    rel = f"images/{name}.{ext}"
    if ext == "jpg":
        img.save(out / rel, format="JPEG", quality=JPEG_QUALITY, optimize=True)
    else:
        img.save(out / rel, format="PNG", optimize=True)
    return rel


def row(key: str, text: str, audio: str, speaker: str, image: str | None = None) -> dict:
    r = {"key": key, "text": text, "audio": audio}
    if image is not None:
        r["image"] = image
    r["speaker"] = speaker
    return r


def speaker_of(clip: Clip) -> str:
    return "espeak-" + clip.voice.replace("+", "-")


def build(out: Path) -> None:
    import soundfile as sf

    exe = check_tools()
    (out / "audio").mkdir(parents=True)
    (out / "images").mkdir()

    good: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="demo-espeak-") as td:
        tmp = Path(td)
        photos = {name: render_photo(name, out) for name in PHOTOS}
        for clip in CLIPS:
            audio = render_audio(exe, clip, tmp, out)
            image = photos[clip.image] if clip.image else None
            good.append(row(clip.key, clip.text, audio, speaker_of(clip), image))
        trunc_audio = render_audio(exe, TRUNC_IMG_CLIP, tmp, out)

    # --- corrupt files -------------------------------------------------------------------------
    (out / "audio/bad-empty.wav").write_bytes(b"")
    ref = (out / good[1]["audio"]).read_bytes()            # a PCM_16 WAV written by soundfile
    assert ref[:4] == b"RIFF" and good[1]["audio"].endswith(".wav")
    (out / "audio/bad-truncated-header.wav").write_bytes(ref[:30])
    (out / "audio/bad-not-audio.wav").write_bytes(NOT_AUDIO_TEXT.encode("utf-8"))
    jpg = (out / photos["chelsea"]).read_bytes()
    (out / "images/bad-chelsea-truncated.jpg").write_bytes(jpg[: int(len(jpg) * TRUNCATE_FRACTION)])

    for p in ("audio/bad-empty.wav", "audio/bad-truncated-header.wav", "audio/bad-not-audio.wav"):
        try:
            sf.info(str(out / p))
        except Exception:
            pass
        else:
            die(f"{p} was supposed to be unreadable but soundfile opened it")

    # --- bad rows, in the order they are mixed in ----------------------------------------------
    # (row dict or raw line, expected reject). The duplicate's key is filled in after placement.
    bad: list[tuple[object, dict]] = [
        (row("bad-empty-wav", "This row points at an empty file.", "audio/bad-empty.wav", "none"),
         {"reason": UNREADABLE_AUDIO}),
        (row("bad-missing-audio", "This audio file does not exist.", "audio/does-not-exist.wav",
             "none"), {"reason": MISSING_FILE}),
        (row("bad-truncated-header", "The header of this file is cut short.",
             "audio/bad-truncated-header.wav", "none"), {"reason": UNREADABLE_AUDIO}),
        (row("bad-empty-text", "", good[3]["audio"], good[3]["speaker"]), {"reason": EMPTY_TEXT}),
        (row(TRUNC_IMG_CLIP.key, TRUNC_IMG_CLIP.text, trunc_audio, speaker_of(TRUNC_IMG_CLIP),
             "images/bad-chelsea-truncated.jpg"), {"reason": IMAGE_TRUNCATED}),
        ('{"key": "bad-malformed", "text": "this line is not valid JSON", "audio": ',
         {"reason": MALFORMED_ROW}),
        (row("DUP", "A second row that reuses an earlier key.", good[12]["audio"],
             good[12]["speaker"]), {"reason": DUPLICATE_KEY}),
        (row("bad-not-audio", "This .wav file is really plain text.", "audio/bad-not-audio.wav",
             "none"), {"reason": UNREADABLE_AUDIO}),
    ]

    # Spread the bad rows evenly among the good ones (deterministic positions).
    lines: list[object] = []
    rejects: list[dict] = []
    n_good, n_bad = len(good), len(bad)
    slots = {round((i + 1) * n_good / (n_bad + 1)): i for i in range(n_bad)}
    assert len(slots) == n_bad
    for gi, g in enumerate(good):
        lines.append(g)
        if gi + 1 in slots:
            item, rej = bad[slots[gi + 1]]
            if isinstance(item, dict) and rej["reason"] == DUPLICATE_KEY:
                item = dict(item, key=good[gi - 2]["key"])   # a key that already appeared above
            lines.append(item)
            lineno = len(lines)
            if isinstance(item, str):
                rejects.append({"key": f"line-{lineno}", "audio": None, "image": None, **rej})
            else:
                rejects.append({"key": item["key"], "audio": item["audio"],
                                "image": item.get("image"), **rej})

    with open(out / "samples.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for item in lines:
            f.write((item if isinstance(item, str) else json.dumps(item, ensure_ascii=False)) + "\n")
    with open(out / "expected_rejects.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(rejects, f, indent=2)
        f.write("\n")
    write_readme(out, good, rejects)


def espeak_version() -> str:
    """E.g. "espeak-ng 1.51" (from ``espeak-ng --version``)."""
    import re

    exe = shutil.which("espeak-ng")
    try:
        v = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    except Exception:
        return "espeak-ng"
    m = re.search(r"text-to-speech:\s*(\S+)", v)
    return f"espeak-ng {m.group(1)}" if m else "espeak-ng"


def write_readme(out: Path, good: list[dict], rejects: list[dict]) -> None:
    n_img = sum(1 for g in good if "image" in g)
    by_reason: dict[str, int] = {}
    for r in rejects:
        by_reason[r["reason"]] = by_reason.get(r["reason"], 0) + 1
    fmt_lines = []
    for c in CLIPS + [TRUNC_IMG_CLIP]:
        ch = "stereo" if c.channels == 2 else "mono"
        fmt_lines.append(f"| `{c.key}` | {c.fmt.upper()} {c.subtype} | {c.sr} | {ch} | `{c.voice}` -s {c.speed} -p {c.pitch} |")
    def cell(v):
        return "-" if v is None else f"`{v}`"

    rej_lines = [f"| {cell(r['key'])} | {cell(r['audio'])} | {cell(r['image'])} | {cell(r['reason'])} |"
                 for r in rejects]
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(by_reason.items()))
    text = f"""# Demo data

Small, real inputs for trying the precompute stage end to end: spoken English sentences, a few
photographs with spoken captions, and a handful of deliberately broken inputs. Everything here is
generated by `scripts/make_demo_data.py` (do not edit by hand); the folder is kept under 3 MB.

## Contents

* `samples.jsonl` - the manifest: one JSON object per line with `key`, `text`, `audio` (path
  relative to this folder), optional `image` (relative path) and `speaker`.
  {len(good)} good rows ({len(good) - n_img} speech only, {n_img} photo + spoken caption) and
  {len(rejects)} bad rows mixed in among them ({reasons}).
* `expected_rejects.json` - every bad row as `{{"key", "audio", "image", "reason"}}`, with the
  reject reason code from `shards/schema.py`. The malformed JSON line is listed as `line-N`, N
  being its 1-based line number in `samples.jsonl`. For `duplicate_key` the first row with that
  key is good and the later one is the reject.
* `audio/` - WAV and FLAC clips at 16000, 22050, 24000, 44100 and 48000 Hz, mostly mono 16-bit,
  four stereo, one 24-bit WAV and one 32-bit float WAV; plus the broken files `bad-empty.wav`
  (0 bytes), `bad-truncated-header.wav` (the first 30 bytes of a real WAV) and `bad-not-audio.wav`
  (plain text).
* `images/` - photos resized (Pillow LANCZOS) to a longest side of at most 512 px: JPEG
  (quality {JPEG_QUALITY}) and one PNG; `camera.png` and `coins.jpg` are grayscale.
  `bad-chelsea-truncated.jpg` is the first {int(TRUNCATE_FRACTION * 100)}% of `chelsea.jpg`: Pillow's
  `Image.open` still reads its header, but `.load()` raises `OSError: image file is truncated`.

### Clips

| key | format | Hz | channels | espeak-ng voice |
|---|---|---|---|---|
{chr(10).join(fmt_lines)}

### Bad rows

| key | audio | image | reason |
|---|---|---|---|
{chr(10).join(rej_lines)}

## Licences

* Speech: synthesised by {espeak_version()} speaking sentences written for this project; the
  sentences and the resulting audio are part of this project and share its licence (Apache-2.0).
  espeak-ng itself (GPL-3.0-or-later) is only used as a tool; none of it is included here.
* Photographs: from scikit-image's bundled data (`skimage.data`), all free of copyright
  restrictions: `astronaut` (NASA, public domain), `chelsea` (Stefan van der Walt, CC0), `coffee`
  (Rachel Michetti, CC0), `camera` (Lav Varshney, CC0), `rocket` (SpaceX, public domain),
  `coins` (Brooklyn Museum, no known copyright restrictions).

## Regenerating

```
python scripts/make_demo_data.py            # writes data/demo/
python scripts/make_demo_data.py --out DIR  # somewhere else
```

Needs `espeak-ng` on PATH (`apt-get install espeak-ng`) and numpy, soundfile, soxr, pillow and
scikit-image. No randomness is involved: with the same espeak-ng, libsndfile, soxr and libjpeg
versions a rerun gives identical bytes. `tests/test_demo_data.py` checks the committed files.
"""
    (out / "README.md").write_text(text, encoding="utf-8", newline="\n")


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Generate the demo data set (espeak-ng speech, scikit-image photos, known-bad "
                    "inputs) into --out. The folder is rebuilt from scratch.")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help=f"output folder (default: {DEFAULT_OUT.relative_to(REPO_ROOT)})")
    args = ap.parse_args(argv)
    check_tools()
    sys.path.insert(0, str(REPO_ROOT))
    try:
        from shards import schema
    except ImportError:
        schema = None
    if schema is not None:
        for code in (MISSING_FILE, UNREADABLE_AUDIO, IMAGE_TRUNCATED, EMPTY_TEXT, DUPLICATE_KEY,
                     MALFORMED_ROW):
            if code not in schema.REASONS:
                die(f"reason code {code!r} is not in shards.schema.REASONS")

    out: Path = args.out.resolve()
    if out.exists() and any(out.iterdir()) and not (out / "samples.jsonl").exists():
        die(f"{out} exists, is not empty and does not look like a demo folder (no samples.jsonl); "
            "refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=out.parent))
    try:
        build(stage)
        size = folder_bytes(stage)
        if size >= MAX_BYTES:
            die(f"generated data is {size} bytes, over the {MAX_BYTES} byte limit")
        if out.exists():
            shutil.rmtree(out)
        os.replace(stage, out)
        os.chmod(out, 0o755)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
    n = sum(1 for _ in open(out / "samples.jsonl", encoding="utf-8"))
    print(f"wrote {out}: {n} manifest lines, {folder_bytes(out)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
