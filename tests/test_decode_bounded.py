"""Decoding with bounded memory and one open per file; 16-bit images scaled, not stretched.

* A file's duration comes from its header: a window longer than ``max_duration`` is rejected
  before decoding, and only the requested window is decoded, so the peak RSS of a decode does not
  grow with the file's length (measured in fresh subprocesses).
* Each audio file is opened exactly once (counted at the OS level with strace when installed).
* ``load_audio_windows``: several windows of one path or ``bytes`` source through one open, one
  result (or reject) per window.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from precompute import audio as audio_mod
from precompute.audio import load_audio, load_audio_windows
from precompute.images import load_image
from shards import schema
from shards.errors import CorruptSample

from conftest import ROOT

SR = 48000
_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def _ramp(start: int, stop: int) -> np.ndarray:
    """int16 stereo frames ``[start, stop)`` of a deterministic pattern (each frame is unique)."""
    i = np.arange(start, stop, dtype=np.int64)
    return np.stack([(i * 7) % 65536 - 32768, (i * 13 + 5) % 65536 - 32768], 1).astype(np.int16)


def _expected_mono(start: int, stop: int) -> np.ndarray:
    """What load_audio returns for those frames: int16 / 32768 as float32, mean of the channels."""
    y = _ramp(start, stop).astype(np.float32) / np.float32(32768.0)
    return y.mean(axis=1).astype(np.float32)


def _write_ramp_wav(path, seconds: float) -> float:
    """Write ``seconds`` of the ramp at 48 kHz stereo PCM_16 in 1 Mi-frame blocks (never held in memory)."""
    t0 = time.perf_counter()
    n, block = int(seconds * SR), 1 << 20
    with sf.SoundFile(path, "w", SR, 2, "PCM_16") as f:
        for s in range(0, n, block):
            f.write(_ramp(s, min(n, s + block)))
    return time.perf_counter() - t0


_PROBE = r"""
import json, resource, sys
import numpy as np
from precompute.audio import load_audio
from shards.errors import CorruptSample


def rss_kb(key):  # VmRSS (now) / VmHWM (peak) of this process
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])


path, offset, duration, out = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
try:  # reset the peak to the current RSS, so the peak below is the decode's, not the imports'
    open("/proc/self/clear_refs", "w").write("5")
    reset = rss_kb("VmHWM") <= rss_kb("VmRSS") + 1024
except OSError:
    reset = False
before = rss_kb("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    y, dur, sr = load_audio(path, (48000,), offset_s=offset, duration_s=None if duration == "-" else float(duration),
                            max_duration=30.0)
    result = {"duration": dur, "sr": sr}
    if out != "-":
        np.save(out, y[48000])
except CorruptSample as e:
    result = {"reason": e.reason, "detail": e.detail}
peak = rss_kb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps(dict(result, before_kb=before, peak_kb=peak, peak_reset=reset)))
"""


def _probe(path, offset=0.0, duration=None, out="-") -> dict:
    dur = "-" if duration is None else str(duration)
    r = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(offset), dur, str(out)], cwd=ROOT,
                       capture_output=True, text=True, check=True, env=_ENV)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_peak_rss_does_not_grow_with_file_length(tmp_path):
    # 40 minutes of 48 kHz stereo 16-bit = 460 MB on disk (written in ~3 s here). The old decoder
    # read the whole file and decoded all of it (1.43 GB peak) before rejecting it too_long.
    long_wav, short_wav = tmp_path / "long_40min.wav", tmp_path / "short_1s.wav"
    _write_ramp_wav(long_wav, 40 * 60)
    _write_ramp_wav(short_wav, 1.0)
    try:
        short = _probe(short_wav)
        assert short["duration"] == pytest.approx(1.0) and short["sr"] == SR
        rejected = _probe(long_wav)
        assert rejected["reason"] == schema.TOO_LONG and "not decoded" in rejected["detail"]
        window = _probe(long_wav, offset=600, duration=2, out=tmp_path / "win.npy")
    finally:
        long_wav.unlink()
    assert window["duration"] == pytest.approx(2.0)
    got = np.load(tmp_path / "win.npy")
    np.testing.assert_allclose(got, _expected_mono(600 * SR, 602 * SR), rtol=0, atol=1e-6)
    for r in (rejected, window):
        print(f"peak RSS {r['peak_kb'] / 1024:.1f} MiB (after imports {r['before_kb'] / 1024:.1f} MiB) vs 1 s file "
              f"{short['peak_kb'] / 1024:.1f} MiB ({short['before_kb'] / 1024:.1f} MiB)")
        assert r["peak_kb"] <= 1.5 * short["peak_kb"]
        # growth over the imports: a 2 s window is ~1 MB; the whole file would be 460 MB+
        assert (r["peak_kb"] - r["before_kb"]) - (short["peak_kb"] - short["before_kb"]) < 32 * 1024


def test_window_read_returns_exactly_that_window(tmp_path):
    path = tmp_path / "ramp.wav"
    _write_ramp_wav(path, 5.0)
    out, duration, sr = load_audio(path, (SR,), offset_s=1.25, duration_s=0.5)
    assert sr == SR and duration == pytest.approx(0.5)
    np.testing.assert_allclose(out[SR], _expected_mono(60000, 84000), rtol=0, atol=1e-6)
    # a window running past the end is cut at the end
    out, duration, _ = load_audio(path, (SR,), offset_s=4.5, duration_s=10.0)
    assert duration == pytest.approx(0.5)
    np.testing.assert_allclose(out[SR], _expected_mono(216000, 240000), rtol=0, atol=1e-6)


def test_too_long_rejected_from_the_header_without_decoding(tmp_path, monkeypatch):
    path = tmp_path / "long.flac"
    sf.write(path, np.zeros(16000 * 40, np.int16), 16000, format="FLAC")

    def no_read(*a, **k):
        raise AssertionError("decoded a file whose header already says it is too long")

    monkeypatch.setattr(sf.SoundFile, "read", no_read)
    with pytest.raises(CorruptSample) as e:
        load_audio(path, (16000,), max_duration=30.0)
    assert e.value.reason == schema.TOO_LONG and e.value.detail.startswith("long.flac: 40.00 s")
    # a window longer than max_duration is rejected the same way; beyond the end: zero_frames
    with pytest.raises(CorruptSample, match=schema.TOO_LONG):
        load_audio(path, (16000,), offset_s=2.0, duration_s=31.0, max_duration=30.0)
    with pytest.raises(CorruptSample) as e:
        load_audio(path, (16000,), offset_s=45.0, duration_s=1.0, max_duration=30.0)
    assert e.value.reason == schema.ZERO_FRAMES and "beyond the end" in e.value.detail


@pytest.mark.parametrize("offset,duration,message", [
    (-5, None, "offset -5 s is negative"), (0, 0, "duration 0 s is not positive"),
    (1, -2.5, "duration -2.5 s is not positive"), (float("nan"), 1, "offset nan is not a finite number"),
])
def test_bad_windows_are_malformed_rows(tmp_path, offset, duration, message):
    path = tmp_path / "ok.wav"
    _write_ramp_wav(path, 1.0)
    with pytest.raises(CorruptSample) as e:
        load_audio(path, (SR,), offset_s=offset, duration_s=duration)
    assert e.value.reason == schema.MALFORMED_ROW and message in e.value.detail and "ok.wav" in e.value.detail


def test_windows_of_one_path_and_of_bytes(tmp_path):
    path = tmp_path / "ramp.flac"
    sf.write(path, _ramp(0, 3 * SR), SR, format="FLAC", subtype="PCM_16")
    windows = [(0.5, 1.0), (-1, 1.0), (2.5, None), (7.0, 1.0), (0, None), (1.0, 0.001)]
    for source in (path, path.read_bytes()):
        res = load_audio_windows(source, windows, (SR, 16000), min_duration=0.01, max_duration=2.0)
        assert len(res) == len(windows)
        np.testing.assert_allclose(res[0][0][SR], _expected_mono(24000, 72000), rtol=0, atol=1e-6)
        assert res[0][0][16000].shape == (16000,) and res[0][1] == pytest.approx(1.0) and res[0][2] == SR
        assert res[1].reason == schema.MALFORMED_ROW
        np.testing.assert_allclose(res[2][0][SR], _expected_mono(120000, 144000), rtol=0, atol=1e-6)
        assert res[3].reason == schema.ZERO_FRAMES
        assert res[4].reason == schema.TOO_LONG  # the whole file: 3 s > 2 s
        assert res[5].reason == schema.TOO_SHORT
    assert "raw_audio (" in load_audio_windows(b"RIFF", [(0, None)], (SR,))[0].detail


def test_file_level_errors_fill_every_slot(tmp_path):
    res = load_audio_windows(tmp_path / "missing.wav", [(0, None), (1, 1)], (SR,))
    assert [r.reason for r in res] == [schema.MISSING_FILE] * 2
    for data in (b"", b"<html>not audio</html>" * 20):
        res = load_audio_windows(data, [(0, None), (1, 1), (-1, 1)], (SR,))
        assert [r.reason for r in res] == [schema.UNREADABLE_AUDIO] * 2 + [schema.MALFORMED_ROW]
        assert " at 0x" not in res[0].detail and "<_io" not in res[0].detail and "object" not in res[0].detail


def test_reject_details_name_the_file_without_object_reprs(real_mini):
    for name in ("random_bytes.wav", "text_as.flac", "truncated_header.wav", "empty.wav", "too_long_40s.wav"):
        with pytest.raises(CorruptSample) as e:
            load_audio(real_mini / "corrupt" / name, (24000,), max_duration=30.0)
        assert e.value.detail.startswith(f"{name}: ") and " at 0x" not in e.value.detail and "<" not in e.value.detail


def test_audioread_fallback_reads_windows(tmp_path, monkeypatch):
    """The fallback path (M4A/AAC... via audioread) on a WAV: audioread's own WAV reader takes it."""
    path = tmp_path / "ramp.wav"
    _write_ramp_wav(path, 3.0)
    monkeypatch.setattr(audio_mod, "FALLBACK_SUFFIXES", (".wav",))
    res = load_audio_windows(path, [(0.5, 1.0), (2.5, None), (9.0, 1.0), (0, None)], (SR,), max_duration=2.0)
    np.testing.assert_allclose(res[0][0][SR], _expected_mono(24000, 72000), rtol=0, atol=1e-6)
    np.testing.assert_allclose(res[1][0][SR], _expected_mono(120000, 144000), rtol=0, atol=1e-6)
    assert res[2].reason == schema.ZERO_FRAMES and res[3].reason == schema.TOO_LONG


_OPENS = r"""
import sys
from precompute.audio import load_audio
for p in sys.argv[1:]:
    load_audio(p, (24000, 16000), offset_s=0.1, duration_s=0.5)
"""


def test_each_audio_file_is_opened_once(tmp_path):
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    flac, wav = tmp_path / "one.flac", tmp_path / "two.wav"
    sf.write(flac, _ramp(0, SR), SR, format="FLAC", subtype="PCM_16")
    _write_ramp_wav(wav, 1.0)
    log = tmp_path / "strace.log"
    r = subprocess.run(["strace", "-f", "-e", "trace=openat", "-o", str(log), sys.executable, "-c", _OPENS,
                        str(flac), str(wav)], cwd=ROOT, capture_output=True, text=True,
                       env=_ENV)
    if r.returncode != 0 and "ptrace" in r.stderr.lower():
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines()
    for p in (flac, wav):
        opens = [ln for ln in lines if f'"{p}"' in ln]
        assert len(opens) == 1, opens


# -- 16-bit images ---------------------------------------------------------------------------------
def _png16(path, arr: np.ndarray) -> None:
    """Write a 16-bit PNG (gray (H, W) or RGB (H, W, 3) uint16) by hand: Pillow cannot write 48-bit RGB."""
    h, w = arr.shape[:2]
    color_type = 2 if arr.ndim == 3 else 0
    raw = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("name,values", [
    ("white", np.full((64, 64), 65535, np.uint16)),
    ("black", np.zeros((64, 64), np.uint16)),
    ("ramp", np.rint(np.linspace(0, 65535, 64 * 64)).astype(np.uint16).reshape(64, 64)),
    ("dark", np.full((64, 64), 1000, np.uint16)),  # constant but not 0: 1000 / 257 -> 4, not black or white
])
def test_16bit_gray_png_scaled_to_8_bits(tmp_path, name, values):
    path = tmp_path / f"{name}.png"
    Image.fromarray(values).save(path)  # numpy uint16 -> Pillow I;16 -> 16-bit grayscale PNG
    with Image.open(path) as im:
        assert im.mode in ("I;16", "I")
    out = load_image(path, 64)
    expected = np.rint(values / 257.0).astype(np.uint8)
    assert out.shape == (64, 64, 3)
    for c in range(3):
        np.testing.assert_array_equal(out[..., c], expected)


def test_16bit_gray_png_written_by_hand_and_int32_mode(tmp_path):
    values = np.rint(np.linspace(0, 65535, 64 * 64)).astype(np.uint16).reshape(64, 64)
    _png16(tmp_path / "g.png", values)
    np.testing.assert_array_equal(load_image(tmp_path / "g.png", 64)[..., 0], np.rint(values / 257.0))
    from shards.pixels import to_rgb as _to_rgb
    as_i = Image.fromarray(values.astype(np.int32))  # mode I (older Pillow opens 16-bit PNGs so)
    assert as_i.mode == "I"
    np.testing.assert_array_equal(np.asarray(_to_rgb(as_i))[..., 1], np.rint(values / 257.0))


def test_48bit_rgb_png(tmp_path):
    """Pillow itself reduces 16-bit RGB PNGs to 8 bits (high byte): exact at 0, 65535 and 257 * k."""
    k = np.arange(64 * 64).reshape(64, 64) % 256
    rgb = np.stack([np.full((64, 64), 65535), np.zeros((64, 64)), k * 257], -1).astype(np.uint16)
    _png16(tmp_path / "rgb48.png", rgb)
    out = load_image(tmp_path / "rgb48.png", 64)
    assert (out[..., 0] == 255).all() and (out[..., 1] == 0).all()
    np.testing.assert_array_equal(out[..., 2], k)
    ramp = np.rint(np.linspace(0, 65535, 64 * 64)).astype(np.uint16).reshape(64, 64)
    _png16(tmp_path / "ramp48.png", np.stack([ramp] * 3, -1))
    diff = load_image(tmp_path / "ramp48.png", 64).astype(int) - np.rint(ramp / 257.0)[..., None]
    assert np.abs(diff).max() <= 1  # floor(x / 256) vs round(x / 257)


def test_bytes_source_for_a_higgs_raw_audio_item():
    buf = io.BytesIO()
    sf.write(buf, _ramp(0, SR // 2), SR, format="WAV", subtype="PCM_16")
    (out, duration, sr), = load_audio_windows(buf.getvalue(), [(0.1, 0.2)], (SR,))
    assert sr == SR and duration == pytest.approx(0.2)
    np.testing.assert_allclose(out[SR], _expected_mono(4800, 14400), rtol=0, atol=1e-6)
