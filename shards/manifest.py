"""``manifest.json`` as a typed :class:`CacheManifest` (written by precompute, read by everyone).

The JSON keys are those stage one has always written (``format_version``, ``fingerprint``,
``encoders``, ``sample_rate``, ``codec_sample_rate``, ``n_codebooks``, ``codebook_size``,
``frame_rate``, ``latent_channels``, ``waveforms``, ``text``, ``text_vocab_size``,
``text_pad_id``, ``counts``, ``shards``, ``config``...), ``cache_id`` (the identity of the samples:
:func:`shards.merge.cache_id`), plus ``fields``: the fields added after
stage one (``shardcache add-field``), ``{name: {fingerprint, encoder, sidecar, base,
n_codebooks, codebook_size, frame_rate, codec_sample_rate, shards: [{path, shard, samples, bytes,
sha256}]}}``. Keys this class does not know are kept in ``extra`` and written back unchanged, so
``from_dict(d).to_dict() == d`` for every manifest.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import schema
from .errors import ManifestError, ShardCorrupt, UnsupportedFormat
from .schema import MANIFEST_FILE


def _int_rule(lo: int, hi: int | None = None):
    def ok(v: Any) -> str | None:
        if isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi):
            return None
        return f"expected an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "") + f", got {v!r:.60}"
    return ok


def _positive_number(v: Any) -> str | None:
    import math
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return None
    return f"expected a positive number, got {v!r:.60}"


def _kind(tp: type, words: str):
    return lambda v: None if isinstance(v, tp) else f"expected {words}, got {type(v).__name__}"


#: what each field of manifest.json must hold when present (training sizes its model from them)
FIELD_RULES = {
    "fingerprint": _kind(str, "a string"), "encoders": _kind(dict, "an object"),
    "sample_rate": _int_rule(1), "codec_sample_rate": _int_rule(1), "n_codebooks": _int_rule(1),
    "codebook_size": _int_rule(1, 32768),  # codes are int16
    "frame_rate": _positive_number, "latent_channels": _int_rule(1), "waveforms": _kind(dict, "an object"),
    "text": _kind(dict, "an object"), "text_vocab_size": _int_rule(1), "text_pad_id": _int_rule(0),
    "config": _kind(dict, "an object"), "counts": _kind(dict, "an object"), "shards": _kind(list, "a list"),
    "fields": _kind(dict, "an object"), "cache_id": _kind(str, "a string"),
}
TEXT_RULES = {"vocab_size": _int_rule(1), "pad_id": _int_rule(0), "special_token_ids": _kind(dict, "an object")}


def manifest_problems(d: Any) -> list[tuple[str, str]]:
    """Every field of a ``manifest.json`` object that has the wrong type or range, as
    ``(field, message)`` (``text.pad_id``, ``text.special_token_ids.<|AUDIO|>``...); absent and
    null fields are fine (a job without a codec writes no ``n_codebooks``)."""
    if not isinstance(d, dict):
        return [("", f"expected a JSON object, got {type(d).__name__}")]
    out = [(k, why) for k, rule in FIELD_RULES.items()
           if d.get(k) is not None and (why := rule(d[k])) is not None]
    text = d.get("text")
    if isinstance(text, dict):
        out += [(f"text.{k}", why) for k, rule in TEXT_RULES.items()
                if text.get(k) is not None and (why := rule(text[k])) is not None]
        ids = text.get("special_token_ids")
        if isinstance(ids, dict):
            out += [(f"text.special_token_ids.{k}", why) for k, v in ids.items()
                    if v is not None and (why := _int_rule(0)(v)) is not None]
    return out


@dataclass
class TextInfo:
    template: Any = None
    vocab_size: int | None = None
    pad_id: int | None = None
    special_token_ids: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Any) -> "TextInfo":
        d = d if isinstance(d, dict) else {}
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        sp = d.get("special_token_ids")
        return cls(template=d.get("template"), vocab_size=d.get("vocab_size"), pad_id=d.get("pad_id"),
                   special_token_ids=dict(sp) if isinstance(sp, dict) else {},
                   extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        out = {"template": self.template, "vocab_size": self.vocab_size, "pad_id": self.pad_id,
               "special_token_ids": dict(self.special_token_ids)}
        out.update(self.extra)
        return out


@dataclass
class FieldInfo:
    """A field added after stage one: who made it and where it is stored."""

    fingerprint: str
    encoder: dict[str, Any]
    sidecar: bool = True
    base: str | None = None                 #: the registry field whose kind it inherits
    n_codebooks: int | None = None
    codebook_size: int | None = None
    frame_rate: float | None = None
    codec_sample_rate: int | None = None
    shards: list[dict[str, Any]] = field(default_factory=list)  #: [{path, shard, samples, bytes, sha256}]
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FieldInfo":
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kw = {k: d[k] for k in known if k in d}
        kw.setdefault("fingerprint", "")
        kw.setdefault("encoder", {})
        return cls(**kw, extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out = {k: v for k, v in out.items() if v is not None}
        out.update(self.extra)
        return out


#: top-level keys, in the order they are written
_KEYS = ("format_version", "created", "fingerprint", "cache_id", "encoders", "sample_rate", "codec_sample_rate",
         "n_codebooks", "codebook_size", "frame_rate", "latent_channels", "waveforms", "text",
         "text_vocab_size", "text_pad_id", "config", "source_manifest", "world_size", "counts", "shards",
         "fields")


@dataclass
class CacheManifest:
    """Typed ``manifest.json``. ``None`` attributes are not written (e.g. ``n_codebooks`` when no
    audio tokenizer ran), unknown keys live in ``extra``."""

    format_version: int = 1
    created: str | None = None
    fingerprint: str | None = None
    encoders: dict[str, Any] | None = None
    sample_rate: int | None = None
    codec_sample_rate: int | None = None
    n_codebooks: int | None = None
    codebook_size: int | None = None
    frame_rate: float | None = None
    latent_channels: int | None = None
    waveforms: dict[str, Any] | None = None
    text: TextInfo | None = None
    text_vocab_size: int | None = None
    text_pad_id: int | None = None
    config: dict[str, Any] | None = None
    source_manifest: str | None = None
    world_size: int | None = None
    counts: dict[str, Any] | None = None
    shards: list[dict[str, Any]] | None = None
    fields: dict[str, FieldInfo] = field(default_factory=dict)
    cache_id: str | None = None             #: :func:`shards.merge.cache_id` of the index
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "CacheManifest":
        d = dict(d or {})
        kw: dict[str, Any] = {k: d[k] for k in _KEYS if k in d and k not in ("text", "fields")}
        if "text" in d and d["text"] is not None:
            kw["text"] = TextInfo.from_dict(d["text"])
        f = d.get("fields") or {}
        if not isinstance(f, dict):
            raise ShardCorrupt(f"manifest.json: 'fields' must be an object, got {type(f).__name__}")
        kw["fields"] = {name: FieldInfo.from_dict(v if isinstance(v, dict) else {}) for name, v in f.items()}
        return cls(**kw, extra={k: v for k, v in d.items() if k not in _KEYS})

    @classmethod
    def read(cls, cache_dir: str | Path) -> "CacheManifest":
        """Read and check ``cache_dir/manifest.json`` (empty when absent; see :func:`read_manifest`)."""
        return cls.from_dict(read_manifest(cache_dir))

    @classmethod
    def read_required(cls, cache_dir: str | Path) -> "CacheManifest":
        """``cache_dir/manifest.json``, which must exist, parse and have every field of the right type
        (:func:`manifest_problems`): what training reads before it sizes a model.

        Raises :class:`~shards.errors.ManifestError` naming the file and each bad field (also for a
        missing file: say how to write it again), :class:`~shards.errors.UnsupportedFormat`.
        """
        path = Path(cache_dir) / MANIFEST_FILE
        if not path.is_file():
            raise ManifestError(f"{path} is missing: the cache's sizes (n_codebooks, codebook_size, vocab size, "
                                "special token ids) are unknown without it. Rerun the same `shardcache "
                                "precompute ... --cache` (committed shards are kept; it writes the manifest again)")
        d = read_manifest(cache_dir)
        problems = manifest_problems(d)
        if problems:
            raise ManifestError(f"{path}: " + "; ".join(f"{k}: {m}" for k, m in problems) +
                                " (the file is damaged or was edited; rerun `shardcache precompute` on the same "
                                "--cache to write it again)")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in _KEYS:
            v = getattr(self, k)
            if k == "text":
                v = v.to_dict() if v is not None else None
            elif k == "fields":
                v = {n: fi.to_dict() for n, fi in v.items()} or None
            if v is not None:
                out[k] = v
        out.update(self.extra)
        return out

    def write(self, cache_dir: str | Path) -> None:
        from .index import write_json_atomic
        write_json_atomic(self.to_dict(), Path(cache_dir) / MANIFEST_FILE)

    # -- derived ------------------------------------------------------------------------------
    @property
    def sidecar_fields(self) -> dict[str, FieldInfo]:
        return {n: f for n, f in self.fields.items() if f.sidecar}

    def vocab_size(self) -> int | None:
        v = self.text.vocab_size if self.text is not None else None
        return v if v is not None else self.text_vocab_size

    def pad_id(self) -> int | None:
        v = self.text.pad_id if self.text is not None else None
        return v if v is not None else self.text_pad_id

    def codebook_size_of(self, name: str) -> int | None:
        """``codebook_size`` of a codes-kind field (``codes``: top level; added fields: their entry)."""
        if name in self.fields:
            return self.fields[name].codebook_size
        return self.codebook_size if name == "codes" else None

    def all_shard_entries(self) -> list[dict[str, Any]]:
        """Main shards plus every sidecar entry (each with ``path``, ``bytes``, ``sha256``)."""
        out = list(self.shards or [])
        for fi in self.fields.values():
            out.extend(fi.shards)
        return out


def check_format_version(manifest: dict[str, Any] | None, cache_dir: str | Path) -> int:
    """The cache's format version (1 when there is no manifest or it has no ``format_version``).

    Raises :class:`~shards.errors.UnsupportedFormat` naming the cache and the version when
    ``format_version`` is not an int, is < 1, or is newer than :data:`shards.schema.FORMAT_VERSION`
    (this code cannot read it safely: upgrade shardcache).
    """
    known = schema.FORMAT_VERSION
    reads = f"format version {known}" if known == 1 else f"format versions 1 to {known}"
    where = Path(cache_dir) / MANIFEST_FILE
    if not manifest or "format_version" not in manifest:
        return 1
    v = manifest["format_version"]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise UnsupportedFormat(f"{where}: format_version {v!r} is not a format version (a positive "
                                f"integer; this shardcache reads {reads}); the manifest is damaged or "
                                "not a shardcache manifest")
    if v > known:
        raise UnsupportedFormat(f"{where}: cache format_version {v} is newer than this shardcache "
                                f"understands (it reads {reads}); upgrade shardcache "
                                "(`pip install -U shardcache`) to read this cache")
    return v


def read_manifest(cache_dir: str | Path) -> dict[str, Any]:
    """``cache_dir/manifest.json`` as a dict (empty when absent), checked: a JSON object of a format
    version this code reads. The one reader of the file (:meth:`CacheManifest.read` types it).

    Raises :class:`ShardCorrupt` for a malformed file, :class:`UnsupportedFormat` (see
    :func:`check_format_version`).
    """
    p = Path(cache_dir) / MANIFEST_FILE
    if not p.exists():
        return {}
    try:
        manifest = json.loads(p.read_text())
    except ValueError as e:
        raise ShardCorrupt(f"{p}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise ShardCorrupt(f"{p}: expected a JSON object")
    check_format_version(manifest, cache_dir)
    return manifest
