"""No command writes a file of a cache but its writer (issue 49 item 4): each output a ``shards`` command
writes (export-audio's WAV, stats --plot's PNG, export-lhotse's folder) is checked on what is opened,
not on the path, so a hard link or a symlink into the cache is refused and the cache keeps every byte."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shards.cli import main


def digests(cache: Path) -> dict[str, str]:
    """sha256 of every file of the cache folder (and below): what must not change."""
    return {str(p.relative_to(cache)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(cache.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture
def cache(tmp_path) -> Path:
    from test_loaders import make_cache
    return make_cache(tmp_path / "c", (5, 4), image_every=3)


def first_key(cache: Path) -> str:
    return pq.read_table(cache / "index.parquet", columns=["key"]).column("key")[0].as_py()


def traps(cache: Path, out: Path, suffix: str) -> dict[str, Path]:
    """Output paths that all lead into the cache: a hard link and a symlink of its index, a new file
    in it, a new file through a symlinked folder, a new file in its parts/."""
    out.mkdir(exist_ok=True)
    hard = out / f"hard{suffix}"
    os.link(cache / "index.parquet", hard)
    soft = out / f"soft{suffix}"
    soft.symlink_to(cache / "index.parquet")
    folder = out / "into-cache"
    folder.symlink_to(cache)
    return {"hard link": hard, "symlink": soft, "inside": cache / f"new{suffix}",
            "through a symlinked folder": folder / f"new{suffix}", "parts": cache / "parts" / f"new{suffix}"}


def test_export_audio_writes_no_file_of_the_cache(cache, tmp_path, capsys):
    pytest.importorskip("soundfile")
    before = digests(cache)
    key = first_key(cache)
    for what, path in traps(cache, tmp_path / "out", ".wav").items():
        assert main(["export-audio", str(cache), key, str(path)]) == 2, what
        err = capsys.readouterr().err
        assert "cache" in err or "symlink" in err, (what, err)
        assert digests(cache) == before, what
    for new in ("new.wav", "parts/new.wav"):
        assert not (cache / new).exists()
    ok = tmp_path / "ok.wav"
    assert main(["export-audio", str(cache), key, str(ok)]) == 0
    assert ok.read_bytes()[:4] == b"RIFF" and digests(cache) == before
    ok.write_bytes(b"x" * 100000)  # an existing plain file is replaced, not appended to
    assert main(["export-audio", str(cache), key, str(ok)]) == 0
    import soundfile as sf
    assert sf.info(str(ok)).frames > 0


def test_stats_plot_writes_no_file_of_the_cache(cache, tmp_path, capsys):
    pytest.importorskip("duckdb")
    pytest.importorskip("matplotlib")
    before = digests(cache)
    for what, path in traps(cache, tmp_path / "out", ".png").items():
        assert main(["stats", str(cache), "--plot", str(path), "--max_samples", "0"]) == 2, what
        capsys.readouterr()
        assert digests(cache) == before, what
    ok = tmp_path / "ok.png"
    assert main(["stats", str(cache), "--plot", str(ok), "--max_samples", "0"]) == 0
    assert ok.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and digests(cache) == before


def test_export_lhotse_writes_no_folder_of_the_cache(cache, tmp_path, capsys):
    pytest.importorskip("lhotse")
    before = digests(cache)
    link = tmp_path / "into-cache"
    link.symlink_to(cache)
    (cache / "parts" / "empty").mkdir()  # an empty folder inside the cache: "exists and is empty"
    before = digests(cache)
    for what, out in {"a new folder inside": cache / "lhotse", "through a symlink": link / "lhotse",
                      "an empty folder inside": cache / "parts" / "empty", "the symlink's empty target":
                      _link_to(tmp_path / "to-empty", cache / "parts" / "empty")}.items():
        assert main(["export-lhotse", str(cache), str(out)]) == 2, what
        err = capsys.readouterr().err
        assert "inside" in err and "cache" in err, (what, err)
        assert digests(cache) == before, what
        assert not (cache / "lhotse").exists() and not list((cache / "parts" / "empty").iterdir())
    ok = tmp_path / "shar"
    assert main(["export-lhotse", str(cache), str(ok)]) == 0
    assert any(ok.glob("cuts.*.jsonl.gz")) and digests(cache) == before
    out = capsys.readouterr().out
    assert str(ok) in out and "/proc/self/fd" not in out


def _link_to(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link
