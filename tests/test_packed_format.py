"""The cache format: a sample's arrays packed in one ``KEY.tensors.npz`` member (shards.npz), read
by offset like the arrays stored as members of their own (latents, sidecar fields)."""
from __future__ import annotations

import io
import json
import shutil
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

import shards
from loaders import ShardLoader
from shards import npz
from shards.cli import main
from shards.errors import ShardCorrupt
from shards.reader import ShardReader
from shards.schema import chunk_shard_name


def sample(i: int) -> dict:
    """A conversation-shaped sample: one audio item, small token arrays, an image on even i."""
    rng = np.random.default_rng(i)
    n_tok = 20 + i
    fields = {
        "json": {"text": f"sample {i}", "speaker": f"spk{i % 2}", "sample_rate": 16000, "duration_s": 0.125},
        "audio.npy": rng.integers(-20000, 20000, size=2000).astype(np.int16),
        "audio_starts.npy": np.array([0, 2000], np.int32),
        "codes.npy": rng.integers(0, 1024, size=(4, 7 + i)).astype(np.int16),
        "audio_segments.npy": np.array([[0, 1, 1, 0, 7 + i, 0]], np.int32),
        "input_ids.npy": rng.integers(3, 259, size=n_tok).astype(np.int32),
        "labels.npy": np.where(np.arange(n_tok) > 5, rng.integers(3, 259, size=n_tok), -100).astype(np.int32),
    }
    if i % 2 == 0:
        fields["latents.npy"] = rng.normal(size=(16, 1, 4, 4)).astype(np.float16)
    return fields


def build(out: Path, n: int = 10) -> Path:
    for chunk, keys in enumerate((range(0, 6), range(6, n))):
        with shards.ShardWriter(out, chunk_shard_name(chunk)) as w:
            for i in keys:
                w.add(f"s{i:02d}", sample(i))
            w.commit()
    shards.merge_parts(out, {"codebook_size": 1024, "text_vocab_size": 259, "n_codebooks": 4})
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("packed") / "packed")


def test_npz_member_is_a_standard_npz_with_aligned_payloads():
    arrays = {k[:-4]: v for k, v in sample(0).items() if k.endswith(".npy")}
    blob = npz.pack(arrays)
    zf = zipfile.ZipFile(io.BytesIO(blob))
    assert zf.testzip() is None
    assert [i.filename for i in zf.infolist()] == [f"{k}.npy" for k in arrays]
    assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
    loaded = np.load(io.BytesIO(blob), allow_pickle=False)
    for k, a in arrays.items():
        assert loaded[k].dtype == a.dtype and np.array_equal(loaded[k], a)
    for name, off, size, dtype, shape in npz.entries(blob):
        assert off % npz.ALIGN == 0, (name, off)
        got = np.frombuffer(blob, dtype=dtype, count=size // np.dtype(dtype).itemsize, offset=off)
        assert np.array_equal(got.reshape(shape), arrays[name])
    assert npz.pack(arrays) == blob  # reproducible


def test_a_sample_is_json_plus_one_packed_member(packed):
    with tarfile.open(packed / chunk_shard_name(0)) as tf:
        members = tf.getmembers()
    names = [i.name for i in members]
    assert names[:3] == ["s00.json", "s00.latents.npy", "s00.tensors.npz"]  # latents stay a member
    assert names[3:5] == ["s01.json", "s01.tensors.npz"]

    def blocks(sizes):  # bytes of tar headers + member data padded to 512-byte blocks
        return sum(512 + -(-n // 512) * 512 for n in sizes)
    # one .npy member per array (as numpy.save writes them) would take a header and padding each
    one_per_array = blocks([len(json.dumps(sample(i)["json"]).encode()) for i in range(6)]
                           + [len(npz.npy_bytes(v)) for i in range(6) for k, v in sample(i).items() if k != "json"])
    assert blocks([i.size for i in members]) < 0.75 * one_per_array, (blocks([i.size for i in members]), one_per_array)
    assert json.loads((packed / "manifest.json").read_text())["format_version"] == shards.FORMAT_VERSION == 1


def test_packed_cache_reads_the_arrays_written(packed):
    r = ShardReader(packed, verify_reads=True)
    assert r.keys == [f"s{i:02d}" for i in range(10)]
    for i, key in enumerate(r.keys):
        want = {k[:-4]: v for k, v in sample(int(key[1:])).items() if k.endswith(".npy")}
        got = r.get(i)
        assert set(got) - {"__key__", "json"} == set(want), key
        for k, v in want.items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (key, k)
    loaded = list(ShardLoader(packed, 5, seed=1, fields=None))
    assert sorted(k for b in loaded for k in b["keys"]) == r.keys
    for b in loaded:
        for j, key in enumerate(b["keys"]):
            ids = sample(int(key[1:]))["input_ids.npy"]
            assert np.array_equal(b["input_ids"][j, :len(ids)].numpy(), ids), key


def test_verify_and_verify_reads_catch_a_flipped_byte_inside_the_packed_member(packed, tmp_path, capsys):
    cache = Path(shutil.copytree(packed, tmp_path / "c"))
    assert main(["verify", str(cache), "--deep"]) == 0
    r = ShardReader(cache)
    row = r.keys.index("s03")
    m = next(m for m in r.index.column("members")[row].as_py() if m["name"] == "input_ids.npy")
    assert m["member"] == "tensors.npz"
    path = cache / chunk_shard_name(0)
    data = bytearray(path.read_bytes())
    data[m["offset"] + 1] ^= 0x01  # inside input_ids: still in range, so only a hash can tell
    path.write_bytes(bytes(data))
    with pytest.raises(ShardCorrupt, match="sha256 mismatch"):
        ShardReader(cache, verify_reads=True, checksums=False).get(row)
    with pytest.raises(ShardCorrupt, match="'s03' member input_ids.npy: checksum mismatch"):
        ShardReader(cache).get(row)  # the member checksum, on by default
    capsys.readouterr()
    assert main(["verify", str(cache), "--deep"]) == 1
    assert "s03" in capsys.readouterr().out


def test_a_compressed_npz_member_is_refused_naming_the_sample(tmp_path):
    buf = io.BytesIO()
    np.savez_compressed(buf, codes=np.zeros((4, 8), np.int16))
    data = buf.getvalue()
    with tarfile.open(tmp_path / "shard-000000.tar", "w") as tf:
        info = tarfile.TarInfo("bad.tensors.npz")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    with pytest.raises(ShardCorrupt, match="bad.*compressed"):
        shards.scan_shard(tmp_path / "shard-000000.tar")


def test_npy_headers_parse_in_threads_while_finalizers_run():
    """shards verify scans shards in threads; numpy parses each .npy header with ast.literal_eval,
    whose CPython 3.11 recursion counter is shared by the threads: a garbage collection running a
    Python finalizer between two parses raised ``SystemError: AST constructor recursion depth
    mismatch`` (seen in the suite). npy_header must parse in any number of threads."""
    import gc
    import sys
    import threading

    from shards.npz import npy_bytes, npy_header

    blob = npy_bytes(np.zeros(55632, np.int16))

    class Finalized:
        def __del__(self):
            [0] * 10  # Python code run by the collector, in whichever thread triggered it

    class Cycle:  # only the cyclic collector frees it: collections run mid-parse
        def __init__(self):
            self.me, self.fin = self, Finalized()

    errors: list[BaseException] = []

    def parse_many():
        try:
            for _ in range(3000):
                assert npy_header(blob)[1:] == ("<i2", (55632,))
                Cycle()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    old, switch = gc.get_threshold(), sys.getswitchinterval()
    gc.set_threshold(20, 2, 2)
    sys.setswitchinterval(1e-6)  # the GIL changes hands as often as it can
    try:
        threads = [threading.Thread(target=parse_many) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*old)
        sys.setswitchinterval(switch)
    assert not errors, errors[:1]
