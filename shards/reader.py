"""Random access to cached samples: mmap each shard once, read members at indexed byte offsets.

No tar header and no ``.npy`` header is parsed at read time, and nothing is ever unpickled: the
index records where each array's raw bytes sit, and :meth:`ShardReader.get` returns
``np.frombuffer`` views of the memory-mapped tar (zero copy; the collate step does the one copy
into batch tensors).
"""
from __future__ import annotations

import json
import mmap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import ShardCorrupt, UnsafeMember
from .index import read_index
from .schema import JSON_MEMBER, PICKLE_EXTENSIONS


class ShardReader:
    """Read samples of a cache by row number of its ``index.parquet``.

    Args:
        cache_dir: the cache directory (holds ``index.parquet`` and the shard tars).
        index: an already loaded (possibly filtered) index table; default: read it from
            ``cache_dir``.

    ``get(i)`` returns ``{"__key__": str, "json": dict, "codes": int16 (n_codebooks, frames),
    "audio": int16 (num_samples,), "text_ids": int32 (n_tokens,), "latents": float16 (C,T,H,W)}``
    (``latents`` only for image samples; ``latents_logvar`` float16 (C,T,H,W) too where the cache
    stores the posterior) as read-only numpy views. Raises :class:`UnsafeMember`
    at construction if the index lists a member that would need unpickling, and
    :class:`ShardCorrupt` when a member lies outside its shard file.
    """

    def __init__(self, cache_dir: str | Path, index: pa.Table | None = None):
        self.cache_dir = Path(cache_dir)
        self.index = read_index(self.cache_dir) if index is None else index
        self.keys: list[str] = self.index.column("key").to_pylist()
        shards = self.index.column("shard")
        self.shard_names: list[str] = pc.unique(shards).to_pylist()
        sid = {s: i for i, s in enumerate(self.shard_names)}
        self.shard_of = np.array([sid[s] for s in shards.to_pylist()], dtype=np.int32)
        members = self.index.column("members").combine_chunks()
        self._bounds = members.offsets.to_numpy()
        flat = members.flatten()
        self._name = flat.field("name").to_pylist()
        self._offset = flat.field("offset").to_numpy()
        self._size = flat.field("size").to_numpy()
        self._dtype = [None if d in ("json", "bytes") else np.dtype(d)
                       for d in flat.field("dtype").to_pylist()]
        self._shape = [tuple(s) for s in flat.field("shape").to_pylist()]
        for j, name in enumerate(self._name):
            if ("." + name.lower()).endswith(PICKLE_EXTENSIONS):
                row = int(np.searchsorted(self._bounds, j, side="right") - 1)
                raise UnsafeMember(
                    f"{self.shard_names[self.shard_of[row]]}: sample {self.keys[row]!r} has member "
                    f"{name!r} that would need unpickling; shardcache never unpickles shard data")
        self._maps: dict[int, mmap.mmap] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def _map(self, shard_id: int) -> mmap.mmap:
        mm = self._maps.get(shard_id)
        if mm is None:
            path = self.cache_dir / self.shard_names[shard_id]
            try:
                with open(path, "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError as e:
                raise ShardCorrupt(f"{path}: listed in the index but missing; run `shards verify`") from e
            self._maps[shard_id] = mm
        return mm

    def get(self, i: int) -> dict[str, Any]:
        """Sample at index row ``i`` as numpy views (see the class docstring)."""
        mm = self._map(int(self.shard_of[i]))
        out: dict[str, Any] = {"__key__": self.keys[i]}
        for j in range(self._bounds[i], self._bounds[i + 1]):
            name, off, size = self._name[j], int(self._offset[j]), int(self._size[j])
            if off + size > len(mm):
                raise ShardCorrupt(f"{self.shard_names[self.shard_of[i]]}: sample {self.keys[i]!r} "
                                   f"member {name} lies past the end of the file (truncated shard?)")
            if name == JSON_MEMBER:
                out["json"] = json.loads(mm[off:off + size])
            elif self._dtype[j] is not None:
                dt, shape = self._dtype[j], self._shape[j]
                if int(np.prod(shape)) * dt.itemsize != size:
                    raise ShardCorrupt(f"{self.shard_names[self.shard_of[i]]}: sample {self.keys[i]!r} member "
                                       f"{name}: index says shape {shape} {dt} but {size} bytes")
                arr = np.frombuffer(mm, dtype=dt, count=size // dt.itemsize, offset=off)
                out[name[:-4] if name.endswith(".npy") else name] = arr.reshape(shape)
            else:
                out[name] = bytes(mm[off:off + size])
        return out

    def close(self) -> None:
        """Close every memory map (views returned earlier must not be used afterwards)."""
        for mm in self._maps.values():
            try:
                mm.close()
            except BufferError:
                pass  # a view is still alive; the map closes when it is garbage collected
        self._maps.clear()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_maps"] = {}  # maps are reopened lazily in each DataLoader worker
        return state
