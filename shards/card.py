"""The dataset card (``OUT/README.md``) that lets Hugging Face ``datasets`` load a cache as is.

``datasets.load_dataset(CACHE_DIR)`` (streaming or not) reads the YAML front matter of the card:

* ``configs``: the ``train`` split is the main shard tars only, named by character-class patterns
  (``shard-[0-9][0-9][0-9][0-9][0-9][0-9].tar``), so ``index.parquet``, ``rejects.parquet``,
  ``parts/`` and future sidecar tars (``shard-000000.codes_mimi.tar``) are never read as data.
  Without the card, ``datasets`` picks the Parquet files and ignores the tars. The one config is
  named after the cache id (:func:`config_name`), so caches in folders of the same name never
  share what ``datasets`` prepared.
* ``dataset_info.features``: one feature per tar member, built from the ``members`` column of the
  index (name, dtype, number of dimensions), so ``datasets`` never infers types from the first few
  samples. The packed ``tensors.npz`` member (format 3) is a struct of its arrays; an array is
  nested lists of its numpy dtype (``codes`` int16 ``(n_codebooks, frames)`` is
  ``List(List(int16))``; ``latents.npy`` float16 ``(C, T, H, W)``, a member of its own, four levels
  deep). Members or arrays only some samples have (``latents.npy`` on image samples, ``codes`` and
  ``audio`` on audio samples) are declared and come back as ``None`` where a sample lacks them.
  The ``json`` member is ``Json()`` (stored as a JSON string, decoded to a dict on read) because
  its content (the original manifest row, null or string sources) differs between samples.

Feature names are what ``datasets``' WebDataset builder calls the fields: the member name after the
key, e.g. ``"tensors.npz"``, ``"latents.npy"``, ``"json"``, plus ``__key__`` and ``__url__``.
``Json()`` needs ``datasets>=5`` on the reading side. This module imports neither ``datasets`` nor
``yaml`` at import time; writing the card needs only PyYAML (``safe_dump``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np

CARD_FILE = "README.md"
#: the split every cache has
SPLIT = "train"
_MAIN_SHARD = re.compile(r"^shard-(?:r\d{4}-)?\d{6,}\.tar$")


def shard_patterns(shard_names: Iterable[str]) -> list[str]:
    """Glob patterns matching exactly the main shard tars among ``shard_names``.

    Each digit becomes ``[0-9]``: ``shard-000000.tar`` -> ``shard-[0-9]{x6}.tar`` written out, and
    ``shard-r0000-000000.tar`` -> ``shard-r[0-9]{x4}-[0-9]{x6}.tar``; a sidecar such as
    ``shard-000000.codes_mimi.tar`` matches neither. Names that are not main shards are ignored.
    """
    pats = {re.sub(r"\d", "[0-9]", n) for n in shard_names if _MAIN_SHARD.match(str(n))}
    return sorted(pats) or [re.sub(r"\d", "[0-9]", "shard-000000.tar")]


def _value_dtype(dtype: str) -> str:
    """``datasets`` Value dtype name of a numpy dtype string (``int16``, ``float16``, ``bool``...)."""
    dt = np.dtype(dtype)
    return "bool" if dt.kind == "b" else dt.name


def _array_feature(dtype: str, ndim: int) -> Any:
    """``datasets`` feature of an array: nested lists of its Value dtype (``ndim`` levels)."""
    spec: Any = _value_dtype(dtype)
    for _ in range(ndim):
        spec = {"list": spec}
    return spec


def member_features(members: Iterable[tuple[Any, Any, Any, int]]) -> list[dict[str, Any]]:
    """The ``dataset_info.features`` YAML list (``datasets``' own format) for an index's members.

    ``members``: the distinct ``(member, name, dtype, ndim)`` of the index's member entries in the order
    they first show (:func:`index_members`). ``__key__`` and
    ``__url__`` come first, then the tar members in sorted name order: ``json`` as ``Json()``,
    a ``NAME.npy`` member as nested lists, and the packed ``tensors.npz`` member (format 3,
    :mod:`shards.npz`) as a struct of its arrays (each nested lists of its dtype; an array only
    some samples hold comes back as ``None`` on the others). Raises ``ValueError`` when one array
    has two dtypes or numbers of dimensions in different samples.
    """
    seen: dict[tuple[str | None, str], tuple[str, int]] = {}  # (container, name) -> (dtype, ndim)
    for box, name, dtype, ndim in members:
        got = (str(dtype), int(ndim))
        old = seen.setdefault((box, name), got)
        if old != got:
            raise ValueError(f"member {name!r} is stored as {old} in some samples and {got} in "
                             "others: a cache has one dtype and rank per member")
    feats: list[dict[str, Any]] = [{"name": "__key__", "dtype": "string"},
                                   {"name": "__url__", "dtype": "string"}]
    for box, name in sorted((k for k in seen if k[0] is None), key=lambda k: k[1]):
        dtype, ndim = seen[(box, name)]
        if dtype == "json":
            feats.append({"name": name, "dtype": "json"})
        elif dtype == "npz":
            arrays = sorted(k[1] for k in seen if k[0] == name)
            feats.append({"name": name, "struct": [
                {"name": a[:-4], **_spec(_array_feature(*seen[(name, a)]))} for a in arrays]})
        elif dtype == "bytes":
            feats.append({"name": name, "dtype": "binary"})
        else:
            feats.append({"name": name, **_spec(_array_feature(dtype, ndim))})
    return feats


def index_members(index) -> list[tuple[Any, Any, Any, int]]:
    """The distinct ``(member, name, dtype, ndim)`` of the member entries of ``index`` (a ``pyarrow.Table``
    with a ``members`` column), in the order of their first entry: each part's dictionary code, the four made
    one integer, its first occurrences found by ``numpy.unique`` (one Python tuple per distinct entry, not per
    member of a sample; no Arrow query plan, which a merge would build once per part)."""
    import pyarrow.compute as pc
    if not index.num_rows:
        return []
    flat = index.column("members").combine_chunks().flatten()
    parts = []  # (codes per entry, the values they number)
    for name in ("member", "name", "dtype"):
        enc = pc.dictionary_encode(flat.field(name))
        parts.append((pc.fill_null(enc.indices, -1).to_numpy(zero_copy_only=False).astype(np.int64),
                      enc.dictionary.to_pylist()))
    ndim = pc.fill_null(pc.list_value_length(flat.field("shape")), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    key = np.zeros(len(flat), np.int64)
    for codes, values in parts:
        key = key * (len(values) + 1) + codes + 1  # (0: null)
    key = key * (int(ndim.max()) + 1) + ndim
    first = np.sort(np.unique(key, return_index=True)[1])
    return [tuple(values[c] if c >= 0 else None for c, values in ((codes[i], values) for codes, values in parts))
            + (int(ndim[i]),) for i in first.tolist()]


def _spec(feature: Any) -> dict[str, Any]:
    """A feature as the keys of its YAML entry: a Value is ``dtype: X``, a list ``list: ...``."""
    return feature if isinstance(feature, dict) else {"dtype": feature}


def _shard_names(out_dir: Path, manifest: dict[str, Any]) -> list[str]:
    names = [s["path"] for s in manifest.get("shards") or [] if isinstance(s, dict) and "path" in s]
    if not names:
        from .schema import is_main_shard_name
        names = sorted(p.name for p in Path(out_dir).glob("shard-*.tar") if is_main_shard_name(p.name))
    return names


def config_name(cache_id: str) -> str:
    """The card's one config: ``cache-<cache id>``. ``datasets`` keeps what it prepared under the
    folder's name and the config name, so two caches in folders of the same name (``a/cache``,
    ``b/cache``) must not share a config name: with ``default`` the second load returned the
    first cache's samples."""
    return f"cache-{cache_id}"


def card_metadata(manifest: dict[str, Any], members: Iterable[tuple], shard_names: Iterable[str], cache_id: str) -> dict[str, Any]:
    """The YAML front matter of the card as a dict: ``configs`` (one, :func:`config_name`, the
    default), ``dataset_info`` (of that config: ``datasets`` applies features to the config they
    name, ``default`` when they name none), ``tags``."""
    return {
        "configs": [{"config_name": config_name(cache_id), "default": True,
                     "data_files": [{"split": SPLIT, "path": shard_patterns(shard_names)}]}],
        "dataset_info": {"config_name": config_name(cache_id), "features": member_features(members)},
        "tags": ["webdataset", "shardcache"],
    }


def dataset_card(manifest: dict[str, Any], members: Iterable[tuple], shard_names: Iterable[str], cache_id: str) -> str:
    """The whole card: YAML front matter plus a short description of the cache (``members``: as
    :func:`member_features` takes them)."""
    import yaml
    shard_names = list(shard_names)
    meta = card_metadata(manifest, members, shard_names, cache_id)
    n = (manifest.get("counts") or {}).get("samples", 0)
    facts = {k: manifest[k] for k in ("format_version", "sample_rate", "frame_rate", "n_codebooks",
                                      "codebook_size", "latent_channels") if k in manifest}
    fields = ", ".join(f"`{f['name']}`" for f in meta["dataset_info"]["features"][2:])
    body = f"""# shardcache cache

Precomputed training tensors (WebDataset tars, one sample = the tar members sharing a key) written
by `shardcache precompute`. {n} samples in {len(shard_names)} shard tars.

Facts: `{json.dumps(facts, sort_keys=True)}`

Fields (`datasets` names them by member; the arrays but the latents are packed in
`tensors.npz`: `ds[0]["tensors.npz"]["codes"]`): {fields}.

```python
import datasets
ds = datasets.load_dataset("PATH/TO/THIS/FOLDER", split="train")                   # or streaming=True
ds = ds.with_format("numpy")  # arrays instead of nested lists
```

`index.parquet` (one row per sample, byte offsets of every array), `manifest.json` (encoders,
counts, shards with sha256) and `rejects.parquet` describe the cache; the `configs` above keep them
out of the data. Other readers (upstream `webdataset`, Lhotse Shar via `shards export-lhotse`,
Megatron-Energon): see `docs/readers.md` in shardcache.
"""
    front = yaml.safe_dump(meta, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return f"---\n{front}---\n\n{body}"


def write_dataset_card(out_dir: str | Path, manifest: dict[str, Any], members: Iterable[tuple]) -> Path:
    """Write ``OUT/README.md`` atomically (temp file, fsync, rename), mode 0644, and return its path.

    ``manifest``: the cache's manifest dict (its ``shards`` list names the tars; when absent the
    folder's ``shard-*.tar`` are used). ``members``: the index's distinct members (:func:`index_members`,
    or gathered table by table as :mod:`shards.merge` writes the index). The config is named after the cache id, ``manifest["cache_id"]`` (the id its
    writer, :func:`shards.merge.write_cache_files`, records there and in ``integrity.json``;
    :func:`config_name`). Raises ``KeyError`` for a manifest without one.
    """
    out_dir = Path(out_dir)
    text = dataset_card(manifest, members, _shard_names(out_dir, manifest), manifest["cache_id"])
    path = out_dir / CARD_FILE
    from .index import write_atomic  # (index imports this module) the cache's writing session, no symlink followed
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    return path
