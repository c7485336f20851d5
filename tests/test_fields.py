"""The field registry (shards.fields) and the typed manifest (shards.manifest)."""
from __future__ import annotations

import numpy as np

from shards import fields
from shards.manifest import CacheManifest


def test_derived_tables_agree_with_registry():
    from loaders.collate import ALL_FIELDS, NDIM
    from shards.filters import FILTER_COLUMNS
    from shards.commands.verify import ROW_FIELDS
    from shards.index import INDEX_SCHEMA
    from shards.schema import INDEX_COLUMNS, TENSOR_DTYPES
    assert set(ALL_FIELDS) == {f.name for f in fields.FIELDS}  # (plug-ins may have registered more)
    for f in fields.FIELDS:
        assert TENSOR_DTYPES[f.suffix] == f.dtype and NDIM[f.name] == f.ndim
        for c in f.index_columns:
            assert c.name in INDEX_COLUMNS and c.name in FILTER_COLUMNS and c.name in ROW_FIELDS
    assert tuple(INDEX_SCHEMA.names) == INDEX_COLUMNS
    assert INDEX_COLUMNS == ("key", "shard", "duration_s", "sample_rate", "num_samples", "n_frames", "n_codebooks",
                             "n_text_tokens", "has_image", "speaker", "bytes", "sha256", "members")


def test_name_rules():
    from shards.kinds import BatchContext
    f = fields.get("codes_mimi")
    assert (f.kind.name, f.dtype, f.ndim, f.pad, f.sidecar) == ("codes", "int16", 2, -100, True)
    assert (f.lengths, f.mask) == ("codes_mimi_lengths", "codes_mimi_mask")
    ids, starts = fields.get("input_ids"), fields.get("audio_16k_starts")
    assert (ids.kind.pad_value(ids, BatchContext(pad_id=7)), ids.lengths, ids.mask) == (7, "input_lengths",
                                                                                        "attention_mask")
    assert (starts.kind.pad_value(starts, BatchContext()), starts.lengths, starts.mask) == (None, None, None)
    assert fields.get("audio_16k").kind.name == "waveform"
    for bad in ("nope", "codes_mimi_lengths", "a.b", ""):
        assert fields.lookup(bad) is None
    from shards.schema import TENSOR_DTYPES
    assert "codes_mimi.npy" in TENSOR_DTYPES and TENSOR_DTYPES["codes_mimi.npy"] == "int16"
    assert fields.sidecar_name("shard-000003.tar", "codes_mimi") == "shard-000003.codes_mimi.tar"
    assert fields.parse_sidecar_name("shard-000003.codes_mimi.tar") == ("shard-000003.tar", "codes_mimi")
    assert fields.parse_sidecar_name("shard-000003.tar") is None


def test_index_columns_from_shapes():
    v = fields.index_column_values({"codes.npy": (8, 50), "input_ids.npy": (3,), "audio.npy": (100,)})
    assert v == dict(num_samples=100, n_frames=50, n_codebooks=8, n_text_tokens=3, has_image=False)
    v = fields.index_column_values({"input_ids.npy": (9,), "latents.npy": (16, 1, 4, 4)})
    assert v["n_text_tokens"] == 9 and v["has_image"] is True


def test_collate_codes_kind_field():
    from loaders.collate import collate_views
    a, b = np.ones((2, 3), np.int16), np.ones((2, 5), np.int16)
    batch = collate_views(["x", "y"], [24000, 24000], ("codes_mimi",), codes_mimi=[a, b])
    assert tuple(batch["codes_mimi"].shape) == (2, 2, 5)
    assert batch["codes_mimi_lengths"].tolist() == [3, 5] and (batch["codes_mimi"][0, :, 3:] == -100).all()


def test_manifest_round_trip():
    d = {"format_version": 1, "fingerprint": "f" * 64, "encoders": {"a": 1}, "sample_rate": 24000,
         "n_codebooks": 8, "codebook_size": 1024, "text": {"template": "t", "vocab_size": 300, "pad_id": 0,
                                                            "special_token_ids": {"<image>": 5}, "more": 1},
         "text_vocab_size": 300, "text_pad_id": 0, "counts": {"samples": 1}, "shards": [], "odd_key": [1],
         "fields": {"codes_mimi": {"fingerprint": "g", "encoder": {}, "sidecar": True, "shards": [], "x": 2}}}
    m = CacheManifest.from_dict(d)
    assert m.to_dict() == d
    assert m.fields["codes_mimi"].extra == {"x": 2} and m.extra == {"odd_key": [1]}
    assert m.vocab_size() == 300 and m.text.special_token_ids["<image>"] == 5
    assert m.codebook_size_of("codes") == 1024 and list(m.sidecar_fields) == ["codes_mimi"]


def test_to_device_widens_only_fields_in_their_storage_dtype():
    """Compact fields are widened by their kind; a model's own layout whose keys look like field names
    (Higgs' ``audio_input_ids`` matches the ``audio_<name>`` rule) is only moved."""
    import torch

    from loaders.device import to_device
    pcm = torch.tensor([[-32768, 0, 16384]], dtype=torch.int16)
    batch = {"audio": pcm, "codes": torch.tensor([[[1, 2]]], dtype=torch.int16),
             "input_ids": torch.tensor([[5, 6]], dtype=torch.int32),
             "audio_input_ids": torch.tensor([[[7, 1025]]], dtype=torch.int64), "keys": ["k"]}
    out = to_device(batch, "cpu")
    assert out["audio"].dtype == torch.float32 and out["audio"].tolist() == [[-1.0, 0.0, 0.5]]
    assert out["codes"].dtype == torch.int64 and out["input_ids"].dtype == torch.int64
    assert out["audio_input_ids"].dtype == torch.int64 and out["audio_input_ids"].tolist() == [[[7, 1025]]]
    assert out["keys"] == ["k"]
