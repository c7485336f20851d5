"""Audio decoding: one read per file, mono downmix, soxr resampling to every configured rate.

Each file is opened exactly once: its bytes are read, libsndfile (soundfile) decodes them from
memory (WAV, FLAC, Ogg Vorbis/Opus, MP3 with libsndfile >= 1.1, AIFF, ...). Only containers that
libsndfile cannot read (M4A/AAC/MP4/WMA...) go through librosa's audioread/ffmpeg fallback,
which opens the path itself. Every rate in ``sample_rates`` is resampled from the same decoded
array, so a codec at 24 kHz and a Whisper-style encoder at 16 kHz never cause two reads.
"""
from __future__ import annotations

import io
from pathlib import Path

import librosa  # imported here, once: forked decode workers inherit it instead of each importing it
import numpy as np
import soundfile as sf

from shards import schema
from shards.errors import CorruptSample

#: containers libsndfile cannot read; decoded with librosa (audioread / ffmpeg) from the path
FALLBACK_SUFFIXES = (".m4a", ".aac", ".mp4", ".wma", ".webm", ".amr")


def _decode(path: Path) -> tuple[np.ndarray, int]:
    """Decode to float32 ``(frames, channels)`` and the file's rate in Hz."""
    if path.suffix.lower() in FALLBACK_SUFFIXES:
        try:
            y, sr = librosa.load(str(path), sr=None, mono=False)
        except Exception as e:  # audioread raises many unrelated types
            raise CorruptSample(schema.UNREADABLE_AUDIO, f"librosa could not decode: {e}", str(path)) from e
        y = np.atleast_2d(y).T  # librosa gives (channels, frames)
        return np.ascontiguousarray(y, dtype=np.float32), int(sr)
    data = path.read_bytes()
    if not data:
        raise CorruptSample(schema.UNREADABLE_AUDIO, "zero-byte file", str(path))
    try:
        y, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as e:
        raise CorruptSample(schema.UNREADABLE_AUDIO, f"not readable audio: {e}", str(path)) from e
    return y, int(sr)


def resample(y: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Resample mono float32 ``(frames,)`` from ``orig_sr`` to ``target_sr`` Hz with soxr (HQ)."""
    if orig_sr == target_sr:
        return y
    return librosa.resample(y, orig_sr=orig_sr, target_sr=target_sr, res_type="soxr_hq").astype(np.float32, copy=False)


def load_audio(path: str | Path, sample_rates: tuple[int, ...] | list[int], *, offset_s: float = 0.0,
               duration_s: float | None = None, min_duration: float = 0.0,
               max_duration: float | None = None, silence_rms: float | None = None
               ) -> tuple[dict[int, np.ndarray], float, int]:
    """Decode ``path`` once and return ``({rate: mono float32 (n,) in [-1, 1]}, duration_s, orig_sr)``.

    ``offset_s``/``duration_s`` (seconds) slice the decoded audio before resampling.
    Raises :class:`CorruptSample` with reason ``missing_file``, ``unreadable_audio``,
    ``zero_frames``, ``non_finite``, ``too_short``, ``too_long`` or ``silent`` (when
    ``silence_rms`` is set and the RMS of the signal is below it).
    """
    path = Path(path)
    if not path.is_file():
        raise CorruptSample(schema.MISSING_FILE, "file does not exist", str(path))
    y, sr = _decode(path)
    if offset_s or duration_s is not None:
        start = int(round(offset_s * sr))
        stop = None if duration_s is None else start + int(round(duration_s * sr))
        y = y[start:stop]
    if y.shape[0] == 0:
        raise CorruptSample(schema.ZERO_FRAMES, "no audio frames", str(path))
    if not np.isfinite(y).all():
        raise CorruptSample(schema.NON_FINITE, "NaN or Inf samples", str(path))
    duration = y.shape[0] / sr
    if duration < min_duration:
        raise CorruptSample(schema.TOO_SHORT, f"{duration:.3f} s < min_duration {min_duration} s", str(path))
    if max_duration is not None and duration > max_duration:
        raise CorruptSample(schema.TOO_LONG, f"{duration:.2f} s > max_duration {max_duration} s", str(path))
    mono = y.mean(axis=1) if y.shape[1] > 1 else y[:, 0]
    mono = np.clip(mono, -1.0, 1.0).astype(np.float32, copy=False)
    if silence_rms is not None:
        rms = float(np.sqrt(np.mean(np.square(mono, dtype=np.float64))))
        if rms < silence_rms:
            raise CorruptSample(schema.SILENT, f"RMS {rms:.2e} < silence_rms {silence_rms}", str(path))
    return {int(r): resample(mono, sr, int(r)) for r in dict.fromkeys(sample_rates)}, duration, sr


def to_pcm16(y: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> int16 PCM (full scale 32767, rounded, clipped)."""
    return np.clip(np.rint(y * 32767.0), -32768, 32767).astype(np.int16)
