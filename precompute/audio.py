"""Audio decoding: one open per file, duration from the header, only the requested window decoded.

A file is opened once (:func:`precompute.sources.open_media`: a regular file inside its media root,
checked on the opened descriptor) and that file object is given to libsndfile
(soundfile), which reads the header (frames, rate, channels) from it: WAV, FLAC, Ogg Vorbis/Opus,
MP3 (libsndfile >= 1.1), AIFF... A window (``offset_s``/``duration_s``, or the whole file) that is
longer than ``max_duration`` is rejected ``too_long`` and one that starts past the end
``zero_frames`` *before anything is decoded*; otherwise the reader seeks to the window and decodes
only its frames, so the memory of a decode is bounded by ``max_duration``, not by the file's length
(a 40-minute WAV costs no more than a 1-second one). :func:`load_audio_windows` reads several
windows of one file (e.g. the turns of a conversation, or a base64 ``raw_audio`` item held as
``bytes``) through that one open.

Containers libsndfile cannot read (M4A/AAC/MP4/WMA/WebM/AMR) go through audioread (ffmpeg): the
duration comes from the container, then one streaming pass keeps only the windows' frames.
Every rate in ``sample_rates`` is resampled (soxr) from the same decoded window, so a codec at
24 kHz and a Whisper-style encoder at 16 kHz never cause two reads.
"""
from __future__ import annotations

import io
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Sequence

import librosa  # imported here, once: forked decode workers inherit it instead of each importing it
import numpy as np
import soundfile as sf

from shards import schema
from shards.kinds import WAVEFORM
from shards.errors import CorruptSample

from .sources import MISSING, MediaRefused, fd_path, file_problem, open_media

#: containers libsndfile cannot read; decoded with audioread (ffmpeg) from the path
FALLBACK_SUFFIXES = (".m4a", ".aac", ".mp4", ".wma", ".webm", ".amr")

#: a decoded window: ``({rate: mono float32 (n,)}, duration_s, orig_sr)``
Decoded = tuple[dict[int, np.ndarray], float, int]
#: ``(offset_s, duration_s or None)``; None = to the end of the file
Window = tuple[float, float | None]

_UNKNOWN_FRAMES = 1 << 62  # libsndfile reports SF_COUNT_MAX when a stream's length is unknown
_BLOCK = 1 << 16  # frames per read when streaming a file of unknown length
_OBJECT_REPR = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>|<_io\.[^<>]*>")


def _clean(e: BaseException) -> str:
    """An exception's message without object reprs (``<_io.BytesIO object at 0x...>``)."""
    msg = getattr(e, "error_string", None) or str(e) or type(e).__name__
    msg = _OBJECT_REPR.sub("", msg)
    msg = re.sub(r"Error opening\s*:?\s*", "", msg).strip(" :")
    return msg or type(e).__name__


def _fail(reason: str, label: str, what: str) -> CorruptSample:
    return CorruptSample(reason, f"{Path(label).name if os.sep in label else label}: {what}", label)


def _seconds(x: float) -> str:
    return f"{x:g}"


def _check_window(window: Sequence, label: str) -> tuple[float, float | None]:
    """``(offset_s, duration_s)`` validated; ``malformed_row`` for negative/zero/non-numeric values."""
    try:
        offset, duration = window
    except (TypeError, ValueError):
        raise _fail(schema.MALFORMED_ROW, label, f"window {window!r:.60} is not (offset_s, duration_s)") from None
    offset = 0.0 if offset is None else offset
    for name, v in (("offset", offset), ("duration", duration)):
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
            raise _fail(schema.MALFORMED_ROW, label, f"{name} {v!r:.40} is not a finite number of seconds")
    if offset < 0:
        raise _fail(schema.MALFORMED_ROW, label, f"offset {_seconds(offset)} s is negative")
    if duration is not None and duration <= 0:
        raise _fail(schema.MALFORMED_ROW, label, f"duration {_seconds(duration)} s is not positive")
    return float(offset), None if duration is None else float(duration)


def _span(offset: float, duration: float | None, sr: int, frames: int | None, label: str,
          max_duration: float | None) -> tuple[int, int | None]:
    """Frames ``[start, stop)`` of a window, checked against the header before decoding.

    ``frames`` None = length unknown (then ``stop`` may be None: to the end). Raises ``zero_frames``
    for an empty file or a window starting at/after the end, ``too_long`` for a window longer than
    ``max_duration``.
    """
    start = int(round(offset * sr))
    stop = None if duration is None else start + int(round(duration * sr))
    if frames is not None:
        if frames <= 0:
            raise _fail(schema.ZERO_FRAMES, label, "no audio frames")
        if start >= frames:
            raise _fail(schema.ZERO_FRAMES, label,
                        f"offset {_seconds(offset)} s is at or beyond the end ({frames / sr:.3f} s)")
        stop = frames if stop is None else min(stop, frames)
    if stop is not None:
        if stop <= start:
            raise _fail(schema.ZERO_FRAMES, label, f"window of {_seconds(duration)} s holds no frame at {sr} Hz")
        n = stop - start
        if max_duration is not None and n / sr > max_duration:
            whole = offset == 0 and duration is None
            raise _fail(schema.TOO_LONG, label, f"{n / sr:.2f} s{'' if whole else ' window'} > max_duration "
                                                f"{max_duration} s (from the header, not decoded)")
    return start, stop


def _max_frames(sr: int, max_duration: float | None) -> int | None:
    return None if max_duration is None else int(math.floor(max_duration * sr)) + 1


def _too_long_streamed(label: str, sr: int, max_duration: float) -> CorruptSample:
    return _fail(schema.TOO_LONG, label, f"more than max_duration {max_duration} s (stopped decoding at "
                                         f"{max_duration} s; length not in the header)")


def _finish(y: np.ndarray, sr: int, label: str, sample_rates: Sequence[int], min_duration: float,
            max_duration: float | None, silence_rms: float | None) -> Decoded:
    """Checks on the decoded window ``(frames, channels)``, mono downmix, resampling."""
    if y.shape[0] == 0:
        raise _fail(schema.ZERO_FRAMES, label, "no audio frames")
    if not np.isfinite(y).all():
        raise _fail(schema.NON_FINITE, label, "NaN or Inf samples")
    duration = y.shape[0] / sr
    if duration < min_duration:
        raise _fail(schema.TOO_SHORT, label, f"{duration:.3f} s < min_duration {min_duration} s")
    if max_duration is not None and duration > max_duration:
        raise _fail(schema.TOO_LONG, label, f"{duration:.2f} s > max_duration {max_duration} s")
    mono = y.mean(axis=1) if y.shape[1] > 1 else y[:, 0]
    mono = np.clip(mono, -1.0, 1.0).astype(np.float32, copy=False)
    if silence_rms is not None:
        rms = float(np.sqrt(np.mean(np.square(mono, dtype=np.float64))))
        if rms < silence_rms:
            raise _fail(schema.SILENT, label, f"RMS {rms:.2e} < silence_rms {silence_rms}")
    return {int(r): resample(mono, sr, int(r)) for r in dict.fromkeys(sample_rates)}, duration, sr


# -- libsndfile ---------------------------------------------------------------------------------
def _sf_window(snd: sf.SoundFile, label: str, offset: float, duration: float | None,
               max_duration: float | None) -> np.ndarray:
    """Decode one window from an open SoundFile: seek + read only its frames."""
    sr = snd.samplerate
    frames = snd.frames if 0 <= snd.frames < _UNKNOWN_FRAMES else None
    start, stop = _span(offset, duration, sr, frames, label, max_duration)
    try:
        if snd.seekable():
            snd.seek(start)
        elif snd.tell() <= start:
            skip = start - snd.tell()
            while skip > 0:
                got = snd.read(min(skip, _BLOCK), dtype="float32", always_2d=True).shape[0]
                if got == 0:
                    raise _fail(schema.ZERO_FRAMES, label, f"offset {_seconds(offset)} s is beyond the end")
                skip -= got
        else:
            raise _fail(schema.UNREADABLE_AUDIO, label, "stream cannot seek back to an earlier window")
        if stop is not None:
            return snd.read(stop - start, dtype="float32", always_2d=True)
        # length unknown: read in blocks, never more than max_duration (+1 frame) of it
        cap = _max_frames(sr, max_duration)
        blocks, n = [], 0
        while True:
            b = snd.read(_BLOCK, dtype="float32", always_2d=True)
            if b.shape[0] == 0:
                break
            blocks.append(b)
            n += b.shape[0]
            if cap is not None and n > cap:
                raise _too_long_streamed(label, sr, max_duration)
        return np.concatenate(blocks) if blocks else np.zeros((0, snd.channels), np.float32)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError, OSError) as e:
        raise _fail(schema.UNREADABLE_AUDIO, label, f"decoding failed: {_clean(e)}") from None


# -- audioread (ffmpeg) fallback ------------------------------------------------------------------
def _audioread_windows(path: str, label: str, spans: list[tuple[int, tuple[float, float | None]]],
                       results: list, sample_rates, min_duration, max_duration, silence_rms) -> None:
    """Open ``path`` once with audioread; duration from the container, then one pass keeping only
    the windows' frames (each capped at ``max_duration``)."""
    import audioread

    try:
        aro = audioread.audio_open(path)
    except Exception as e:  # audioread raises many unrelated types (NoBackendError, DecodeError...)
        raise _fail(schema.UNREADABLE_AUDIO, label, f"audioread/ffmpeg could not open it: {_clean(e)}") from None
    with aro:
        sr, channels = int(aro.samplerate), int(aro.channels)
        frames = int(round(aro.duration * sr)) if aro.duration and aro.duration > 0 else None
        cap = _max_frames(sr, max_duration)
        todo = []  # [slot, start, stop (None = end), blocks, n]
        for slot, (offset, duration) in spans:
            try:
                start, stop = _span(offset, duration, sr, frames, label, max_duration)
            except CorruptSample as e:
                results[slot] = e
                continue
            if frames is not None and stop == frames and duration is None:
                stop = None  # the container's duration is approximate: read to the real end
            todo.append([slot, start, stop, [], 0])
        if not todo:
            return
        pos, last = 0, (None if any(t[2] is None for t in todo) else max(t[2] for t in todo))
        try:
            for buf in aro:
                y = WAVEFORM.from_storage(np.frombuffer(buf, "<i2")).reshape(-1, channels)
                b0, b1 = pos, pos + y.shape[0]
                pos = b1
                for t in todo:
                    if t[0] is None:
                        continue
                    lo, hi = max(b0, t[1]), b1 if t[2] is None else min(b1, t[2])
                    if hi > lo:
                        t[3].append(y[lo - b0:hi - b0].copy())
                        t[4] += hi - lo
                        if t[2] is None and cap is not None and t[4] > cap:
                            results[t[0]] = _too_long_streamed(label, sr, max_duration)
                            t[0], t[3] = None, []
                if last is not None and pos >= last or all(t[0] is None for t in todo):
                    break
        except Exception as e:
            err = _fail(schema.UNREADABLE_AUDIO, label, f"audioread/ffmpeg decoding failed: {_clean(e)}")
            for t in todo:
                if t[0] is not None:
                    results[t[0]] = err
            return
    for slot, start, _stop, blocks, _n in todo:
        if slot is None:
            continue
        if not blocks and start >= pos:
            results[slot] = _fail(schema.ZERO_FRAMES, label, f"offset {_seconds(start / sr)} s is beyond the end")
            continue
        y = np.concatenate(blocks) if blocks else np.zeros((0, channels), np.float32)
        try:
            results[slot] = _finish(y, sr, label, sample_rates, min_duration, max_duration, silence_rms)
        except CorruptSample as e:
            results[slot] = e


#: magic bytes of containers only the fallback reads (for ``bytes`` sources, which have no suffix)
def _fallback_container(head: bytes) -> bool:
    return (head[4:8] == b"ftyp"  # MP4 / M4A / AAC in MP4
            or head[:4] == b"\x1a\x45\xdf\xa3"  # Matroska / WebM
            or head[:16] == bytes.fromhex("3026b2758e66cf11a6d900aa0062ce6c")  # ASF / WMA
            or head[:5] == b"#!AMR"
            or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0))  # ADTS AAC


# -- public API -----------------------------------------------------------------------------------
def resample(y: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample mono float32 ``(frames,)`` from ``orig_sr`` to ``target_sr`` Hz with soxr (HQ)."""
    if orig_sr == target_sr:
        return y
    return librosa.resample(y, orig_sr=orig_sr, target_sr=target_sr, res_type="soxr_hq").astype(np.float32, copy=False)


def load_audio_windows(source: str | Path | bytes, windows: Sequence[Window], sample_rates: Sequence[int], *,
                       min_duration: float = 0.0, max_duration: float | None = None,
                       silence_rms: float | None = None, name: str | None = None
                       ) -> list[Decoded | CorruptSample]:
    """Decode several windows of one audio source, opened once.

    ``source``: a path, or the encoded file's ``bytes`` (e.g. a base64-decoded ``raw_audio``).
    ``windows``: ``[(offset_s, duration_s or None)]``. Returns one entry per window, in order:
    ``({rate: mono float32 (n,) in [-1, 1]}, duration_s, orig_sr)`` or the :class:`CorruptSample`
    that rejects that window (``malformed_row`` for a negative offset or a duration <= 0,
    ``zero_frames``, ``too_long`` (both from the header, before decoding), ``non_finite``,
    ``too_short``, ``silent``). A file-level error (``missing_file``, ``unreadable_audio``) is
    returned in every slot. ``name`` labels the source in reject details (default: the path, or
    ``raw_audio (N bytes)``). Never raises :class:`CorruptSample`.
    """
    is_bytes = isinstance(source, (bytes, bytearray, memoryview))
    label = name or (f"raw_audio ({len(source)} bytes)" if is_bytes else str(source))
    results: list[Decoded | CorruptSample | None] = [None] * len(windows)
    spans: list[tuple[int, tuple[float, float | None]]] = []
    for i, w in enumerate(windows):
        try:
            spans.append((i, _check_window(w, label)))
        except CorruptSample as e:
            results[i] = e
    if not spans:
        return results  # type: ignore[return-value]
    kw = dict(min_duration=min_duration, max_duration=max_duration, silence_rms=silence_rms)
    try:
        if is_bytes:
            data = bytes(source)
            if not data:
                raise _fail(schema.UNREADABLE_AUDIO, label, "zero-byte audio")
            if _fallback_container(data[:16]):
                with tempfile.NamedTemporaryFile(suffix=".m4a") as tmp:  # audioread/ffmpeg need a path
                    tmp.write(data)
                    tmp.flush()
                    _audioread_windows(tmp.name, label, spans, results, sample_rates, **kw)
            else:
                _sf_windows(io.BytesIO(data), label, spans, results, sample_rates, **kw)
        else:
            path = Path(source)
            problem = file_problem(path)
            if problem is not None:  # a directory, FIFO or socket is named as such
                raise _fail(schema.MISSING_FILE if problem == MISSING else schema.UNREADABLE_AUDIO, label, problem)
            with _open(source, label) as f:  # the one open of this file, checked on its descriptor
                if os.fstat(f.fileno()).st_size == 0:
                    raise _fail(schema.UNREADABLE_AUDIO, label, "zero-byte file")
                if path.suffix.lower() in FALLBACK_SUFFIXES:  # ffmpeg reads the very file opened
                    _audioread_windows(fd_path(f.fileno(), path), label, spans, results, sample_rates, **kw)
                else:  # libsndfile reads through it
                    _sf_windows(f, label, spans, results, sample_rates, **kw)
    except CorruptSample as e:
        for i, r in enumerate(results):
            if r is None:
                results[i] = e
    return results  # type: ignore[return-value]


def _open(source: str | os.PathLike, label: str):
    """``source`` opened for reading (:func:`precompute.sources.open_media`: a regular file, inside its
    media root, checked on the descriptor), as a binary file object; :class:`CorruptSample` otherwise
    (``malformed_row`` for a file outside the root, ``missing_file``, ``unreadable_audio``)."""
    try:
        return os.fdopen(open_media(source), "rb")
    except MediaRefused as e:
        raise _fail(schema.MALFORMED_ROW if e.outside else schema.UNREADABLE_AUDIO, label, e.detail) from None
    except FileNotFoundError:
        raise _fail(schema.MISSING_FILE, label, MISSING) from None
    except OSError as e:
        raise _fail(schema.UNREADABLE_AUDIO, label, f"cannot open: {e.strerror or _clean(e)}") from None


def _sf_windows(f, label: str, spans, results: list, sample_rates, *, min_duration, max_duration,
                silence_rms) -> None:
    try:
        snd = sf.SoundFile(f)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as e:
        raise _fail(schema.UNREADABLE_AUDIO, label, f"not readable audio: {_clean(e)}") from None
    with snd:
        for slot, (offset, duration) in spans:
            try:
                y = _sf_window(snd, label, offset, duration, max_duration)
                results[slot] = _finish(y, snd.samplerate, label, sample_rates, min_duration, max_duration,
                                        silence_rms)
            except CorruptSample as e:
                results[slot] = e


def header(source: str | Path | bytes) -> "sf._SoundFileInfo | None":
    """libsndfile's header of the audio file ``source`` (a path, or the file's bytes; nothing decoded), or None
    where there is none to read: a container read through audioread (:data:`FALLBACK_SUFFIXES`), a path that is
    not a readable regular file, bytes or a file libsndfile does not read (decoding reports those)."""
    try:
        if isinstance(source, bytes):
            return sf.info(io.BytesIO(source))
        if Path(source).suffix.lower() in FALLBACK_SUFFIXES or file_problem(source) is not None:
            return None
        with os.fdopen(open_media(source), "rb") as f:  # checked on its descriptor, as decoding opens it
            return sf.info(f)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError, OSError, MediaRefused):
        return None


def header_seconds(path: str | Path) -> float | None:
    """Length in seconds of the audio file ``path`` from its header (frames / sample rate, :func:`header`), or
    None where the header does not say: no header (:func:`header`), a stream of unknown length."""
    info = header(path)
    if info is None or not 0 <= info.frames < _UNKNOWN_FRAMES or info.samplerate <= 0:
        return None
    return info.frames / info.samplerate


def load_audio(path: str | Path, sample_rates: tuple[int, ...] | list[int], *, offset_s: float = 0.0,
               duration_s: float | None = None, min_duration: float = 0.0,
               max_duration: float | None = None, silence_rms: float | None = None
               ) -> Decoded:
    """Decode one window of ``path`` (opened once) and return
    ``({rate: mono float32 (n,) in [-1, 1]}, duration_s, orig_sr)``.

    ``offset_s``/``duration_s`` (seconds) select the window (default: the whole file); only its
    frames are decoded. Raises :class:`CorruptSample` with reason ``missing_file``,
    ``unreadable_audio``, ``malformed_row`` (negative offset, duration <= 0), ``zero_frames``,
    ``too_long`` (these two from the header, before decoding), ``non_finite``, ``too_short`` or
    ``silent`` (when ``silence_rms`` is set and the RMS of the signal is below it).
    """
    out = load_audio_windows(path, [(offset_s, duration_s)], sample_rates, min_duration=min_duration,
                             max_duration=max_duration, silence_rms=silence_rms)[0]
    if isinstance(out, CorruptSample):
        raise out
    return out

