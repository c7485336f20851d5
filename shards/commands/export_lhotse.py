"""``shards export-lhotse CACHE OUT``: write a cache's audio as a Lhotse Shar ``CutSet``.

One cut per audio item (a sample with a single audio item gives one cut whose id is the sample key;
a sample with ``n > 1`` items gives cuts ``KEY_item0`` ... ``KEY_item{n-1}``; items without samples
and samples without ``audio.npy``, e.g. image-only ones, give none). Each cut has:

* ``recording``: the item's cached int16 waveform (``audio[starts[k]:starts[k + 1]]`` at the
  cache's ``sample_rate``, usually 24 kHz), written as 16-bit FLAC (or WAV) in the Shar tars; it
  loads back as float32 ``int16 / 32768`` exactly.
* one supervision over the whole cut: ``speaker`` (the item's, else the sample's), ``text`` (see
  :func:`item_text`), ``custom`` ``{key, item, turn, direction}``;
* ``codes``: the item's codec tokens ``codes[:, code_start:code_start + code_frames]``, stored
  transposed as int16 ``(frames, n_codebooks)`` (Lhotse's layout: time first, ``temporal_dim=0``;
  lhotse's array readers slice axis 0) with ``frame_shift = 1 / frame_rate`` (``manifest.json``).
  ``cut.codes.load()`` returns every frame exactly (``.T`` gives the cache's layout);
  ``cut.load_codes()`` follows Lhotse's duration rule and returns
  ``round_half_up(duration / frame_shift)`` frames, which drops the codec's last, partial frame
  when ``num_samples / hop`` has a fractional part below one half (frames = ``ceil``).
* ``cut.custom["key"]``: the sample key in the cache.

Read it back with ``lhotse.CutSet.from_shar(in_dir=OUT)``. Written with lhotse's own
:class:`lhotse.shar.SharWriter` (the writer ``CutSet.to_shar`` uses), so it needs ``lhotse``.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path
from typing import Any

import numpy as np

from ._common import NotFound, Out, UsageError, load_manifest, output_folder, readable
from .needs import Needs

AUDIO_FORMATS = ("flac", "wav")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "export-lhotse", parents=[common], help="write the cache's audio + codes as Lhotse Shar",
        description="Write a Lhotse Shar CutSet (cuts.NNNNNN.jsonl.gz, recording.NNNNNN.tar, "
                    "codes.NNNNNN.tar): one cut per audio item with the cached waveform, a "
                    "supervision (text, speaker) and the codec tokens as a temporal array "
                    "(frame_shift = 1 / frame_rate). Read it with "
                    "lhotse.CutSet.from_shar(in_dir=OUT). Needs `pip install lhotse`.")
    p.add_argument("dir", metavar="DIR", help="cache directory")
    p.add_argument("output", metavar="OUT", type=Path, help="output directory (created; must be empty)")
    p.add_argument("--shard_size", type=int, default=1000, metavar="N",
                   help="cuts per Shar shard (default: 1000)")
    p.add_argument("--audio_format", choices=AUDIO_FORMATS, default="flac",
                   help="how recordings are stored (lossless 16-bit; default: flac)")
    p.set_defaults(func=cmd_export_lhotse, needs=Needs(("lhotse", "soundfile")))


# ----------------------------------------------------------------------------------- library

def _turn_text(turn: dict) -> str:
    parts = turn.get("parts") or []
    return "\n".join(p["text"] for p in parts if isinstance(p, dict) and p.get("type") == "text"
                     and isinstance(p.get("text"), str))


def item_text(meta: dict, item: dict | None) -> str:
    """Supervision text of an audio item.

    * No conversation (single-utterance caches): the sample's ``text``.
    * The item's turn has text parts: that text (e.g. a user question next to its audio).
    * An audio-only turn (an assistant's spoken answer in Higgs-Audio ChatML TTS / voice cloning):
      the text of the nearest earlier turn that has text and is not the system prompt, i.e. the
      words the audio speaks; else the sample's ``text``.
    """
    conv = meta.get("conversation") if isinstance(meta, dict) else None
    turns = conv.get("turns") if isinstance(conv, dict) else None
    fallback = str(meta.get("text") or "") if isinstance(meta, dict) else ""
    if not turns or not item or not isinstance(item.get("turn"), int) or not 0 <= item["turn"] < len(turns):
        return fallback
    t = item["turn"]
    own = _turn_text(turns[t])
    if own:
        return own
    for prev in range(t - 1, -1, -1):
        if turns[prev].get("role") == "system":
            continue
        text = _turn_text(turns[prev])
        if text:
            return text
    return fallback


def _wav_bytes(audio: np.ndarray, sr: int) -> bytes:
    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, audio, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def sample_cuts(sample: dict[str, Any], sr: int, frame_rate: float | None) -> list[tuple]:
    """``[(cut, codes or None)]`` of one cache sample (``ShardReader.get`` output); ``[]`` without
    audio. ``codes`` int16 ``(frames, n_codebooks)``; the cut's ``codes`` is its Shar placeholder."""
    from lhotse import MonoCut, Recording, SupervisionSegment
    from lhotse.array import Array, TemporalArray
    from lhotse.audio import AudioSource

    audio = sample.get("audio")
    if audio is None or audio.ndim != 1 or audio.size == 0:
        return []
    key = sample["__key__"]
    meta = sample.get("json") if isinstance(sample.get("json"), dict) else {}
    items_meta = meta.get("audio_items") or []
    starts = sample.get("audio_starts")
    if starts is None:  # single-utterance cache: the whole waveform is one item
        starts = np.array([0, audio.shape[0]])
    segments = sample.get("audio_segments")
    codes = sample.get("codes")
    n = len(starts) - 1
    live = [k for k in range(n) if starts[k + 1] > starts[k]]
    cuts = []
    for k in live:
        cut_id = key if len(live) == 1 else f"{key}_item{k}"
        wave = np.ascontiguousarray(audio[starts[k]:starts[k + 1]])
        item = items_meta[k] if k < len(items_meta) and isinstance(items_meta[k], dict) else None
        rec = Recording(id=cut_id, sampling_rate=sr, num_samples=int(wave.shape[0]),
                        duration=wave.shape[0] / sr,
                        sources=[AudioSource(type="memory", channels=[0], source=_wav_bytes(wave, sr))])
        speaker = (item or {}).get("speaker") or meta.get("speaker")
        direction = (item or {}).get("direction")
        sup = SupervisionSegment(
            id=cut_id, recording_id=cut_id, start=0.0, duration=rec.duration, channel=0,
            text=item_text(meta, item), speaker=str(speaker) if speaker is not None else None,
            custom={"key": key, "item": k, "turn": (item or {}).get("turn"), "direction": direction})
        cut = MonoCut(id=cut_id, start=0.0, duration=rec.duration, channel=0, recording=rec,
                      supervisions=[sup], custom={"key": key})
        item_codes = None
        if codes is not None and codes.ndim == 2 and frame_rate:
            if segments is not None and segments.ndim == 2 and k < segments.shape[0]:
                c0, nf = int(segments[k, 3]), int(segments[k, 4])
                item_codes = codes[:, c0:c0 + nf]
            elif n == 1:
                item_codes = codes
            if item_codes is not None and item_codes.shape[1] == 0:
                item_codes = None
        if item_codes is not None:
            # frames first: lhotse's array readers slice axis 0 whatever temporal_dim says
            item_codes = np.ascontiguousarray(item_codes.T)
            cut.custom["codes"] = TemporalArray(
                array=Array(storage_type="shar", storage_path="", storage_key="",
                            shape=list(item_codes.shape)),
                temporal_dim=0, frame_shift=1.0 / float(frame_rate), start=0.0)
        cuts.append((cut, item_codes))
    return cuts


def export_lhotse(cache: str | Path, out_dir: str | Path, *, shard_size: int = 1000,
                  audio_format: str = "flac") -> dict[str, Any]:
    """Write the cache at ``cache`` as Lhotse Shar into ``out_dir`` (see the module docstring).

    Returns ``{cuts, samples, samples_without_audio, shards: {field: [paths]}, out}``.
    """
    from lhotse.shar import ArrayTarWriter, SharWriter

    from ..reader import ShardReader

    cache, out_dir = Path(cache), Path(out_dir)
    if audio_format not in AUDIO_FORMATS:
        raise UsageError(f"--audio_format must be one of {AUDIO_FORMATS}, not {audio_format!r}")
    if shard_size < 1:
        raise UsageError("--shard_size must be >= 1")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UsageError(f"{out_dir}: exists and is not empty")
    manifest = load_manifest(cache)
    frame_rate = manifest.get("frame_rate")
    reader = ShardReader(cache, manifest=manifest)
    try:
        folder_fd = output_folder(out_dir, cache)  # refuses, by descriptor, the cache folder and what it holds
    except BaseException:
        reader.close()
        raise
    # lhotse writes by path: through the descriptor's /proc path every file lands in the folder checked
    proc = f"/proc/self/fd/{folder_fd}"
    base = proc if os.path.isdir(proc) else str(out_dir)
    has_codes = bool(frame_rate) and manifest.get("n_codebooks")
    fields = {"recording": audio_format}
    n_cuts = skipped = 0
    seen: set[str] = set()
    try:
        # SharWriter would write codes as cut.load_codes(), cut to round(duration / frame_shift)
        # frames (losing the codec's last, partial frame): write every frame with lhotse's
        # ArrayTarWriter, shard for shard in step with SharWriter (one entry or placeholder per cut)
        codes_writer = (ArrayTarWriter(f"{base}/codes.%06d.tar", shard_size=shard_size,
                                       compression="numpy") if has_codes else None)
        with contextlib.ExitStack() as stack:
            writer = stack.enter_context(SharWriter(base, fields=fields, shard_size=shard_size,
                                                    warn_unused_fields=False))
            if codes_writer is not None:
                stack.enter_context(codes_writer)
            for i in range(len(reader)):
                sample = reader.get(i)
                meta = sample.get("json") if isinstance(sample.get("json"), dict) else {}
                sr = int(meta.get("sample_rate") or manifest.get("sample_rate") or 0)
                if sample.get("audio") is not None and sr <= 0:
                    raise NotFound(f"sample {sample['__key__']!r} has no sample rate")
                cuts = sample_cuts(sample, sr, frame_rate if has_codes else None)
                if not cuts:
                    skipped += 1
                for cut, codes in cuts:
                    if cut.id in seen:
                        raise UsageError(f"cut id {cut.id!r} occurs twice (sample key clash)")
                    seen.add(cut.id)
                    writer.write(cut)
                    if codes_writer is not None:
                        if codes is None:
                            codes_writer.write_placeholder(cut.id)
                        else:
                            codes_writer.write(cut.id, codes, manifest=cut.custom["codes"])
                    n_cuts += 1
            shards = {k: [_shown(p, base, out_dir) for p in v] for k, v in writer.output_paths.items()}
        if codes_writer is not None:
            shards["codes"] = [_shown(p, base, out_dir) for p in codes_writer.output_paths]
            fields["codes"] = "numpy"
    finally:
        reader.close()
        os.close(folder_fd)
    return dict(out=str(out_dir), cuts=n_cuts, samples=len(reader), samples_without_audio=skipped,
                fields=fields, shards=shards)


def _shown(p: Any, base: str, out_dir: Path) -> str:
    """A path lhotse wrote under ``base`` (the checked folder's descriptor path), as under ``out_dir``."""
    p = str(p)
    return str(out_dir / p[len(base):].lstrip("/")) if p.startswith(base) else p


def cmd_export_lhotse(args: argparse.Namespace) -> int:
    out = Out(args)
    d = readable(args.dir)
    result = export_lhotse(d, args.output, shard_size=args.shard_size, audio_format=args.audio_format)
    if out.json:
        out.emit_json(result)
    else:
        out.line(f"wrote {result['cuts']} cuts from {result['samples']} samples "
                 f"({result['samples_without_audio']} without audio) to {result['out']} "
                 f"(fields: {', '.join(result['fields'])}); read with "
                 f"lhotse.CutSet.from_shar(in_dir={result['out']!r})")
    return 0
