"""Issue 41 item 4: media opened under ``--root`` are checked on the opened file descriptor, not on
the path beforehand: a symlink swapped after the manifest was read must not escape the root."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import DEMO, ROOT

AUDIO = sorted((DEMO / "audio").glob("*.flac"))
IMAGE = next(p for p in sorted((DEMO / "images").glob("*")) if p.suffix.lower() in (".png", ".jpg", ".jpeg"))


@pytest.fixture()
def media(tmp_path) -> tuple[Path, Path]:
    """``(root, outside)``: a media root holding ``inside.flac`` and ``a.flac`` (a symlink to it), and a
    different recording outside the root."""
    root = tmp_path / "media"
    root.mkdir()
    shutil.copy(AUDIO[0], root / "inside.flac")
    shutil.copy(AUDIO[2], root / "b.flac")
    (root / "a.flac").symlink_to(root / "inside.flac")
    outside = tmp_path / "secret.flac"
    shutil.copy(AUDIO[1], outside)
    return root, outside


@pytest.mark.slow
def test_a_symlink_swapped_during_the_job_does_not_escape_the_root(media, tiny_models, tmp_path, monkeypatch):
    """The root check ran when the manifest was read and the file was opened later: a symlink
    changed in between made the job encode a file outside --root. Now the opened file is checked:
    the row is a malformed_row naming the file it opened, the other row is kept."""
    import pyarrow.parquet as pq
    import precompute.job as job
    from precompute.config import load_config
    root, outside = media
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"key": k, "text": "Hello.", "audio": f"{k}.flac"}) + "\n" for k in "ab"))
    planned = job.check_root

    def plan_then_swap(plan, *args):          # the manifest is read and planned (and checked); then the link changes
        planned(plan, *args)
        (root / "a.flac").unlink()
        (root / "a.flac").symlink_to(outside)

    monkeypatch.setattr(job, "check_root", plan_then_swap)
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        f"audio_tokenizer.pretrained={tiny_models / 'dac-tiny'}", "image_encoder=null", "num_workers=0",
        "device=cpu", "allow_outside_root=false"])
    summary, man = job.run(manifest, tmp_path / "cache", cfg, root=root, progress=False)
    assert summary.kept == 1
    rejects = {r["key"]: r for r in pq.read_table(tmp_path / "cache" / "rejects.parquet").to_pylist()}
    assert rejects["a"]["reason"] == "malformed_row", rejects
    assert "outside the media root" in rejects["a"]["detail"] and str(outside) in rejects["a"]["detail"]


def test_media_paths_are_checked_on_the_descriptor(media, tmp_path):
    """The decoders' own opens (audio windows, the header read for the duration cap, images) refuse a
    MediaPath whose file is outside its root once opened, and never wait on a FIFO."""
    from precompute.audio import header_seconds, load_audio_windows
    from precompute.conversation import MediaRoot
    from precompute.images import decode_image
    from shards.errors import CorruptSample
    root, outside = media
    base = MediaRoot(root)
    a = base.resolve("a.flac", "audio")
    got = load_audio_windows(a, [(0.0, None)], [24000])[0]
    assert not isinstance(got, CorruptSample) and header_seconds(a) > 0    # inside: read
    (root / "a.flac").unlink()
    (root / "a.flac").symlink_to(outside)
    got = load_audio_windows(a, [(0.0, None)], [24000])[0]
    assert isinstance(got, CorruptSample) and got.reason == "malformed_row" and "outside the media root" in got.detail
    assert header_seconds(a) is None
    shutil.copy(IMAGE, root / "pic" )
    (root / "img").symlink_to(root / "pic")
    img = base.resolve("img", "image")
    assert decode_image(img).size[0] > 0
    shutil.copy(IMAGE, tmp_path / "secret-image")
    (root / "img").unlink()
    (root / "img").symlink_to(tmp_path / "secret-image")
    with pytest.raises(CorruptSample, match="outside the media root") as e:
        decode_image(img)
    assert e.value.reason == "malformed_row"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo")
def test_a_fifo_in_place_of_a_media_file_is_refused_at_once(tmp_path):
    from precompute.sources import MediaPath, MediaRefused, open_media
    fifo = tmp_path / "x.flac"
    os.mkfifo(fifo)
    with pytest.raises(MediaRefused, match="FIFO"):
        open_media(MediaPath(str(fifo), os.path.realpath(tmp_path)))
