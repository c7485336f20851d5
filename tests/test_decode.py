"""Audio and image decoding on real files: unusual-but-valid inputs are kept, broken ones rejected."""
from __future__ import annotations


import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from precompute.audio import load_audio
from shards.kinds import WAVEFORM
from precompute.images import load_image
from shards import schema
from shards.errors import CorruptSample

from conftest import DEMO


def _speech(sr: int) -> np.ndarray:
    y, file_sr = sf.read(DEMO / "audio" / "spk-us-0002.wav", dtype="float32")
    import librosa
    return librosa.resample(y, orig_sr=file_sr, target_sr=sr)


@pytest.mark.parametrize("subtype,sr,channels", [
    ("PCM_24", 44100, 1), ("FLOAT", 22050, 1), ("PCM_16", 48000, 6), ("PCM_16", 8000, 1),
    ("PCM_16", 96000, 2), ("DOUBLE", 16000, 1),
])
def test_unusual_valid_wavs_are_kept(tmp_path, subtype, sr, channels):
    y = _speech(sr)
    data = np.repeat(y[:, None], channels, axis=1) * 0.5
    path = tmp_path / f"x_{subtype}_{sr}_{channels}.wav"
    sf.write(path, data, sr, subtype=subtype)
    out, duration, orig = load_audio(path, (24000, 16000))
    assert orig == sr and abs(duration - len(y) / sr) < 1e-6
    assert set(out) == {24000, 16000}
    assert abs(len(out[24000]) - duration * 24000) <= 2 and abs(len(out[16000]) - duration * 16000) <= 2
    assert out[24000].dtype == np.float32 and np.abs(out[24000]).max() > 0.05


def test_mono_downmix_and_slicing(tmp_path):
    sr = 16000
    left = np.full(sr, 0.5, np.float32)
    right = np.full(sr, -0.1, np.float32)
    path = tmp_path / "st.wav"
    sf.write(path, np.stack([left, right], 1), sr, subtype="FLOAT")
    out, duration, _ = load_audio(path, (sr,), offset_s=0.25, duration_s=0.5)
    assert duration == pytest.approx(0.5) and np.allclose(out[sr], 0.2)
    assert WAVEFORM.to_storage(np.array([1.0, -1.0, 0.0, 0.5], np.float32)).tolist() == [32767, -32768, 0, 16384]


@pytest.mark.parametrize("make,reason", [
    (lambda p: p.write_bytes(b""), schema.UNREADABLE_AUDIO),
    (lambda p: p.write_bytes(b"<html>not audio</html>" * 20), schema.UNREADABLE_AUDIO),
    (lambda p: sf.write(p, np.zeros((0, 1), np.float32), 16000), schema.ZERO_FRAMES),
    (lambda p: sf.write(p, np.array([0.1, np.nan, 0.2] * 100, np.float32), 16000, subtype="FLOAT"), schema.NON_FINITE),
    (lambda p: sf.write(p, np.zeros(10, np.float32), 16000), schema.TOO_SHORT),
    (lambda p: sf.write(p, np.zeros(16000 * 31, np.int16), 16000), schema.TOO_LONG),
])
def test_broken_audio_rejected_with_reason(tmp_path, make, reason):
    path = tmp_path / "bad.wav"
    make(path)
    with pytest.raises(CorruptSample) as e:
        load_audio(path, (24000,), min_duration=0.05, max_duration=30.0)
    assert e.value.reason == reason and str(path) in str(e.value)


def test_silence_check_is_optional(tmp_path):
    path = tmp_path / "quiet.wav"
    sf.write(path, np.zeros(16000, np.float32), 16000)
    load_audio(path, (16000,))
    with pytest.raises(CorruptSample, match=schema.SILENT):
        load_audio(path, (16000,), silence_rms=1e-4)


def test_missing_file(tmp_path):
    with pytest.raises(CorruptSample) as e:
        load_audio(tmp_path / "nope.wav", (16000,))
    assert e.value.reason == schema.MISSING_FILE


def _photo() -> Image.Image:
    return Image.open(DEMO / "images" / "astronaut.jpg").convert("RGB")


def _save(im: Image.Image, path, **kw):
    im.save(path, **kw)
    return path


@pytest.mark.parametrize("name,make", [
    ("cmyk.jpg", lambda p: _save(_photo().convert("CMYK"), p)),
    ("gray16.png", lambda p: _save(Image.fromarray((np.asarray(_photo().convert("L"), np.uint16) * 257)), p)),
    ("palette_alpha.png", lambda p: _save(_photo().convert("P", palette=Image.Palette.ADAPTIVE), p, transparency=0)),
    ("rgba.png", lambda p: _save(_photo().convert("RGBA"), p)),
    ("photo.webp", lambda p: _save(_photo(), p)),
    ("gray.png", lambda p: _save(_photo().convert("L"), p)),
])
def test_unusual_valid_images_are_kept(tmp_path, name, make):
    path = make(tmp_path / name)
    img = load_image(path, 64)
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8 and img.std() > 1


def test_exif_rotation_applied(tmp_path):
    im = _photo().resize((80, 40))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    path = _save(im, tmp_path / "rot.jpg", exif=exif.tobytes())
    out = load_image(path, 32, mode="bucket")
    assert out.shape[0] > out.shape[1]  # displayed portrait


def test_resize_modes(tmp_path):
    path = _save(_photo().resize((200, 100)), tmp_path / "wide.png")
    assert load_image(path, 64, mode="center_crop").shape == (64, 64, 3)
    padded = load_image(path, 64, mode="pad")
    assert padded.shape == (64, 64, 3) and padded[0].max() == 0  # black bars top/bottom
    bucket = load_image(path, 64, mode="bucket")
    assert bucket.shape[1] > bucket.shape[0] and bucket.shape[0] % 8 == 0 and bucket.shape[1] % 8 == 0


def test_stretch_and_convert_are_pillows_bilinear_resize_and_convert(tmp_path):
    """TheWorld's preprocessing (``img.convert("RGB")`` then torchvision's bilinear resize of a PIL
    image, which is Pillow's) written out with Pillow here, on an RGBA image with transparency."""
    rgba = _photo().resize((200, 100)).convert("RGBA")
    a = np.asarray(rgba).copy()
    a[:50, :, 3] = 0                                    # the top half fully transparent
    path = _save(Image.fromarray(a), tmp_path / "half_transparent.png")
    want = np.asarray(Image.open(path).convert("RGB").resize((64, 64), Image.Resampling.BILINEAR))
    got = load_image(path, 64, mode="stretch", rgb="convert")
    np.testing.assert_array_equal(got, want)            # the whole image, aspect not kept, alpha dropped
    composite = load_image(path, 64, mode="stretch")    # default: transparency over white
    assert composite[:20].min() == 255 and not np.array_equal(composite, got)
    with pytest.raises(ValueError, match="rgb mode"):
        load_image(path, 64, rgb="bgr")


@pytest.mark.parametrize("make,reason", [
    (lambda p: p.write_bytes(b""), schema.IMAGE_UNREADABLE),
    (lambda p: p.write_bytes(b"<html><body>404</body></html>"), schema.IMAGE_UNREADABLE),
    (lambda p: p.write_bytes((DEMO / "images" / "chelsea.jpg").read_bytes()[:5000]), schema.IMAGE_TRUNCATED),
    (lambda p: _save(_photo().resize((8, 8)), p), schema.IMAGE_TOO_SMALL),
])
def test_broken_images_rejected_with_reason(tmp_path, make, reason):
    path = tmp_path / "bad.jpg"
    make(path)
    with pytest.raises(CorruptSample) as e:
        load_image(path, 64)
    assert e.value.reason == reason


def test_decompression_bomb_rejected_before_decoding(tmp_path):
    path = _save(Image.new("L", (3000, 3000)), tmp_path / "big.png")
    with pytest.raises(CorruptSample) as e:
        load_image(path, 64, max_pixels=1_000_000)
    assert e.value.reason == schema.IMAGE_TOO_LARGE


def test_real_mini_corrupt_files(real_mini):
    cases = {"empty.wav": schema.UNREADABLE_AUDIO, "random_bytes.wav": schema.UNREADABLE_AUDIO,
             "text_as.flac": schema.UNREADABLE_AUDIO, "truncated_header.wav": schema.UNREADABLE_AUDIO,
             "nan_float.wav": schema.NON_FINITE, "no_frames.wav": schema.ZERO_FRAMES,
             "too_long_40s.wav": schema.TOO_LONG}
    for name, reason in cases.items():
        with pytest.raises(CorruptSample) as e:
            load_audio(real_mini / "corrupt" / name, (24000,), max_duration=30.0)
        assert e.value.reason == reason, name
    images = {"bomb.png": schema.IMAGE_TOO_LARGE, "html_as.jpg": schema.IMAGE_UNREADABLE,
              "truncated.jpg": schema.IMAGE_TRUNCATED, "zero.png": schema.IMAGE_UNREADABLE}
    for name, reason in images.items():
        with pytest.raises(CorruptSample) as e:
            load_image(real_mini / "corrupt" / name, 64)
        assert e.value.reason == reason, name


def test_real_mini_compressed_formats_decode(real_mini):
    for name in ("s001.flac", "s002.mp3", "s003.ogg", "s004.wav"):
        out, duration, _ = load_audio(real_mini / "audio" / "speech" / name, (24000,))
        assert duration > 0.5 and np.abs(out[24000]).max() > 0.05, name


def test_ogg_opus_decodes_through_libsndfile(tmp_path):
    y, _ = sf.read(DEMO / "audio" / "spk-us-0002.wav", dtype="float32")
    path = tmp_path / "clip.opus"
    sf.write(path, y, 48000, format="OGG", subtype="OPUS")
    out, duration, orig = load_audio(path, (24000,))
    assert orig == 48000 and abs(duration - len(y) / 48000) < 0.05 and np.abs(out[24000]).max() > 0.05


def test_m4a_decodes_through_the_librosa_fallback(tmp_path):
    import shutil
    import subprocess
    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg is not installed (needed to make and to decode an M4A file)")
    src = DEMO / "audio" / "spk-us-0002.wav"
    path = tmp_path / "clip.m4a"
    subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(src), "-c:a", "aac", str(path)], check=True)
    out, duration, orig = load_audio(path, (24000,))
    assert abs(duration - sf.info(str(src)).duration) < 0.1 and np.abs(out[24000]).max() > 0.05
