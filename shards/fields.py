"""The field registry: one declaration per tensor field of a cached sample.

**A new field is one declaration** (a :class:`Field` here, or :func:`register` from a plug-in
module) **plus one producer** that computes it at stage one (:mod:`precompute.producers`, shared
by ``shardcache precompute`` and ``shardcache add-field``). A field points at its *kind*
(:mod:`shards.kinds`), which owns its value checks, batch layout (pad value, lengths/mask keys,
dtypes) and its move to the device; everything else is derived from the entries here:

* :data:`shards.schema.TENSOR_DTYPES` (member name -> dtype; the writer and ``verify`` check stored
  dtypes with it),
* the index columns a field contributes (:data:`INDEX_FIELD_COLUMNS`, hence
  :data:`shards.index.INDEX_SCHEMA`, ``shards verify``'s row checks and the loaders' filters),
  filled by :func:`shards.scan.scan_shard` from member shapes,
* the member rank the reader checks (:attr:`Field.ndim`), what a loader reads by default, which
  fields every sample must hold, and where each is stored (packed in ``tensors.npz``, its own
  member, or a sidecar tar).

Name rules (no entry needed): ``audio_<name>`` / ``audio_<name>_starts`` are extra waveform fields
(``extra_fields`` of producer ``waveform``); ``codes_<name>`` (e.g. ``codes_mimi``, made by
``shardcache add-field``) is a field of kind ``codes`` stored in sidecar tars. Fields of plug-in
modules: :func:`register` them at import; modules named in ``$SHARDCACHE_PLUGINS`` (comma-separated)
are imported at the first lookup of an unknown name, so DataLoader workers and ``torchrun`` ranks
know them too.

This module imports nothing from either stage (from the rest of :mod:`shards` only its kinds and tokens).
"""
from __future__ import annotations

import importlib
import os
import re
import threading
from dataclasses import dataclass, replace
from typing import Callable

from . import kinds as K
from .kinds import PAD_LAST, PAD_TEXT, FieldKind  # noqa: F401 (re-exported)
from .tokens import IGNORE_INDEX  # pad value of codes and labels

#: default pad of ``input_ids`` (the cache's ``text.pad_id`` wins)
TEXT_PAD_ID = 0


@dataclass(frozen=True)
class IndexColumn:
    """One scalar ``index.parquet`` column a field contributes, computed from the member's shape.

    ``value(shape)`` for a sample holding the member; ``default`` for one without it. When several
    fields contribute the same column the first field of :data:`FIELDS` the sample holds wins.
    """

    name: str
    type: str                                 #: arrow type name: int32 | int64 | bool | float64 | string
    value: Callable[[tuple], object]
    default: object = 0


@dataclass(frozen=True)
class Field:
    """Declaration of one tensor member ``KEY.<name>.npy`` of a cached sample.

    Attributes:
        name: field name (batch key, ``ShardReader.views(name)``).
        dtype: numpy dtype it is stored with.
        ndim: rank of the stored array.
        kind: its :class:`shards.kinds.FieldKind` (values, batch layout, device move).
        pad: pad value in a batch, or :data:`PAD_TEXT` / :data:`PAD_LAST` (see the kind).
        lengths: batch key of the per-sample lengths (None: none); mask: of the bool mask.
        present_key: batch key of a bool ``(B,)`` "sample holds it" (``has_image``); None: none.
        index_columns: the scalar index columns computed from its shape.
        optional: may be absent on some samples (e.g. codes on a sample without audio).
        every_sample: a loader asking for it requires it on every sample.
        default_read: read by a loader when no ``fields`` are given (if the cache holds it).
        paired_with: a field whose samples must hold this one exactly where they hold that one,
            with the same shape (``latents_logvar`` with ``latents``).
        stage: who writes it: ``precompute`` (stage one) or ``add-field`` (a sidecar).
        sidecar: stored in sidecar tars ``shard-XXXXXX.<name>.tar`` (fields made by add-field).
        packed: stored inside the sample's ``tensors.npz`` member (:mod:`shards.npz`)
            rather than as a ``NAME.npy`` member of its own. Latents are not packed: they are large
            (a 512-byte tar header is < 2 % of them), and Hugging Face ``datasets`` cannot convert
            arrays of 3 or more dimensions nested in a struct (pyarrow: "Can only convert
            1-dimensional array values") while it reads a 4-D ``.npy`` member.
        doc: one line for the docs.
    """

    name: str
    dtype: str
    ndim: int
    kind: FieldKind
    pad: object = 0
    lengths: str | None = None
    mask: str | None = None
    present_key: str | None = None
    index_columns: tuple[IndexColumn, ...] = ()
    optional: bool = True
    every_sample: bool = False
    default_read: bool = True
    paired_with: str | None = None
    stage: str = "precompute"
    sidecar: bool = False
    packed: bool = True
    doc: str = ""

    @property
    def suffix(self) -> str:
        """Tar member suffix: ``KEY.<suffix>``."""
        return f"{self.name}.npy"

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """Every key this field puts into a batch (data, lengths, mask, present flag)."""
        return tuple(k for k in (self.name, self.lengths, self.mask, self.present_key) if k)


def _codes(name: str, **kw) -> Field:
    return Field(name=name, dtype="int16", ndim=2, kind=K.CODES, pad=IGNORE_INDEX,
                 lengths=f"{name}_lengths", mask=f"{name}_mask", **kw)


def _waveform(name: str, **kw) -> Field:
    return Field(name=name, dtype="int16", ndim=1, kind=K.WAVEFORM, pad=0, lengths=f"{name}_lengths",
                 mask=f"{name}_mask", **kw)


def _starts(name: str, **kw) -> Field:
    return Field(name=name, dtype="int32", ndim=1, kind=K.OFFSETS, pad=PAD_LAST, **kw)


def _shape0(shape: tuple) -> int:
    return int(shape[0]) if len(shape) >= 1 else 0


#: THE REGISTRY, in read order (this order is also the order of the index columns they contribute).
FIELDS: tuple[Field, ...] = (
    _waveform("audio", index_columns=(IndexColumn("num_samples", "int64", _shape0),),
              doc="every item's mono PCM at sample_rate, concatenated (int16, x * 32768)"),
    _starts("audio_starts", doc="item k is audio[starts[k]:starts[k+1]]"),
    _codes("codes", index_columns=(
        IndexColumn("n_frames", "int32", lambda s: int(s[1]) if len(s) == 2 else 0),
        IndexColumn("n_codebooks", "int32", lambda s: int(s[0]) if len(s) == 2 else 0)),
        doc="codec tokens of every audio item, concatenated along frames"),
    Field("audio_segments", "int32", 2, K.SEGMENTS, pad=-1, lengths="audio_segments_count",
          doc="per audio item: item, turn, direction, code start, code frames, speaker"),
    Field("input_ids", "int32", 1, K.TOKENS, pad=PAD_TEXT, lengths="input_lengths", mask="attention_mask",
          every_sample=True, index_columns=(IndexColumn("n_text_tokens", "int32", _shape0),),
          doc="the conversation through the chat template"),
    Field("labels", "int32", 1, K.LABELS, pad=IGNORE_INDEX, every_sample=True,
          doc=f"input_ids on trained tokens, {IGNORE_INDEX} elsewhere (not shifted)"),
    Field("latents", "float16", 4, K.LATENTS, pad=0.0, mask="latents_mask", present_key="has_image", packed=False,
          index_columns=(IndexColumn("has_image", "bool", lambda s: True, False),),
          doc="VAE latents (C, n_images, H/8, W/8); image samples only"),
    Field("latents_logvar", "float16", 4, K.LATENTS, pad=0.0, mask="latents_mask", present_key="has_image",
          default_read=False, packed=False, paired_with="latents",
          doc="VAE posterior log-variance; only with store_posterior"),
    Field("image_features", "int16", 3, K.BF16_BITS, pad=0, lengths="image_features_count",
          mask="image_features_mask", default_read=False, packed=False,
          doc="Gemma 3 vision tower + projector output (n_images, tokens, hidden), bfloat16 bits; "
              "only with image_features"),
)

#: name -> Field of the fixed entries and of registered plug-in fields
BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}
#: the plug-in fields (:func:`register`), in registration order
REGISTERED: dict[str, Field] = {}
#: environment variable: comma-separated plug-in modules imported at the first unknown name
PLUGINS_ENV = "SHARDCACHE_PLUGINS"
_plugins_loaded = False
_plugins_lock = threading.RLock()  # reentrant: a plug-in module registers while being imported
#: base fields whose kind a field named ``<base>_<name>`` inherits (made by ``precompute add-field``)
DERIVABLE = ("codes",)
#: index columns contributed by fields, in schema order (first contributor of each name)
INDEX_FIELD_COLUMNS: tuple[IndexColumn, ...] = tuple(
    {c.name: c for f in reversed(FIELDS) for c in f.index_columns}[n]
    for n in dict.fromkeys(c.name for f in FIELDS for c in f.index_columns))

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_WAVE = re.compile(r"^audio_[A-Za-z0-9_]+$")
_DERIVED = re.compile(r"^(" + "|".join(DERIVABLE) + r")_([A-Za-z0-9_]+)$")
#: suffixes of batch keys, never field names
_RESERVED = ("_lengths", "_mask", "_count")


def register(field: Field) -> Field:
    """Declare a plug-in field (e.g. in the module of its producer). Registering the same
    declaration again is a no-op; another declaration under a known name raises ``ValueError``."""
    if not isinstance(field, Field) or not _NAME.match(field.name) or field.name.endswith(_RESERVED):
        raise ValueError(f"not a valid field declaration: {field!r}")
    if field.index_columns:
        raise ValueError(f"field {field.name!r}: a plug-in field cannot add index columns (the index schema "
                         "is part of the format)")
    old = BY_NAME.get(field.name) or _rule(field.name)
    if old is not None and old != field:
        raise ValueError(f"field {field.name!r} is already declared ({old.kind.name}, {old.dtype}); choose another name")
    BY_NAME[field.name] = REGISTERED[field.name] = field
    return field


def _load_plugins() -> None:
    """Import the modules of ``$SHARDCACHE_PLUGINS`` once (thread-safe: a thread that looks a name
    up while another imports them waits, instead of seeing the field missing)."""
    global _plugins_loaded
    with _plugins_lock:  # threads (shards verify checks shards in a pool) wait for the import
        if _plugins_loaded:
            return
        try:
            for mod in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
                importlib.import_module(mod)
        finally:
            _plugins_loaded = True


def lookup(name: str) -> Field | None:
    """The :class:`Field` of ``name`` (fixed entry, plug-in or name rule), or None for an unknown name."""
    f = BY_NAME.get(name)
    if f is not None:
        return f
    if not isinstance(name, str) or not _NAME.match(name) or name.endswith(_RESERVED):
        return None
    f = _rule(name)
    if f is None and os.environ.get(PLUGINS_ENV):
        _load_plugins()
        return BY_NAME.get(name)
    return f


def _rule(name: str) -> Field | None:
    """The field a name rule gives ``name`` (``codes_<x>``, ``audio_<x>``, ``audio_<x>_starts``)."""
    if not isinstance(name, str) or not _NAME.match(name) or name.endswith(_RESERVED):
        return None
    m = _DERIVED.match(name)
    if m:
        return derived_field(name, m.group(1))
    if _WAVE.match(name):
        if name.endswith("_starts"):
            return _starts(name, stage="precompute")
        if name.endswith("_segments"):
            return None
        return _waveform(name)
    return None


def derived_field(name: str, base: str) -> Field:
    """A sidecar field ``name`` that inherits the kind (dtype, rank, pad...) of field ``base``."""
    b = BY_NAME[base]
    return replace(b, name=name, lengths=b.lengths and f"{name}{b.lengths[len(base):]}",
                   mask=b.mask and f"{name}{b.mask[len(base):]}", index_columns=(), optional=True,
                   default_read=True, stage="add-field", sidecar=True, doc=f"{b.doc} (sidecar, like {base})")


def get(name: str) -> Field:
    """:func:`lookup` that raises ``KeyError`` naming the known fields."""
    f = lookup(name)
    if f is None:
        raise KeyError(f"unknown field {name!r}; known: {', '.join(BY_NAME)} (plus audio_<name>, "
                       f"audio_<name>_starts and {', '.join(b + '_<name>' for b in DERIVABLE)})")
    return f


def field_of_member(member: str) -> Field | None:
    """The field stored as tar member ``member`` (e.g. ``codes.npy``), or None."""
    if not isinstance(member, str) or not member.endswith(".npy"):
        return None
    return lookup(member[:-4])


def ndim(name: str) -> int:
    """Rank of field ``name`` (1 for unknown names)."""
    f = lookup(name)
    return f.ndim if f is not None else 1


def kind(name: str) -> FieldKind | None:
    """The kind of field ``name`` (None for an unknown name)."""
    f = lookup(name)
    return f.kind if f is not None else None


def tensor_dtypes() -> dict[str, str]:
    """Member name -> dtype of the fixed and registered entries."""
    return {f.suffix: f.dtype for f in BY_NAME.values()}


#: each field-derived index column: (its name, its default, [(member, the IndexColumn of that field)]) in
#: FIELDS order: the first field a sample holds gives the value (what the scanner computes per sample)
_COLUMN_SOURCES = tuple((c.name, c.default, tuple((f.suffix, x) for f in FIELDS for x in f.index_columns
                                                  if x.name == c.name)) for c in INDEX_FIELD_COLUMNS)


def index_column_values(shapes: dict[str, tuple]) -> dict[str, object]:
    """The field-derived index columns of one sample from its member shapes (``{"codes.npy": (8, 50)}``)."""
    out: dict[str, object] = {}
    for name, default, sources in _COLUMN_SOURCES:
        out[name] = default
        for member, col in sources:
            if member in shapes:
                out[name] = col.value(tuple(shapes[member]))
                break
    return out


#: the fields a reader reads by default (those of them the cache holds), in read order
DEFAULT_READ = tuple(f.name for f in FIELDS if f.default_read)
#: fields read only when named: ``latents_logvar``, ``image_features``
OPTIONAL_READ = tuple(f.name for f in FIELDS if not f.default_read)


def selection(names) -> tuple[str, ...]:
    """A field selection (a name or names) checked and ordered: the fixed fields in :data:`FIELDS` order,
    then other known fields (name rules, plug-ins), sorted. Raises ``ValueError`` for an unknown or
    empty selection."""
    if isinstance(names, str):
        names = (names,)
    names = tuple(names)
    bad = [f for f in names if lookup(f) is None]
    if bad or not names:
        raise ValueError(f"unknown fields {bad} (or none given); choose from {DEFAULT_READ + OPTIONAL_READ} "
                         "(plus extra waveforms such as audio_16k, added fields such as codes_mimi, "
                         "and fields registered by plug-ins)")
    fixed = DEFAULT_READ + OPTIONAL_READ
    return tuple(f for f in fixed if f in names) + tuple(sorted(f for f in names if f not in fixed))


def held(member_names, requested: bool = False) -> tuple[str, ...]:
    """The fields among ``member_names`` (an index's member names, ``codes.npy``...) a reader reads when
    no fields are named: :data:`DEFAULT_READ` ones in order, then the others a name rule or plug-in
    declares (``audio_16k``, ``codes_mimi``...), sorted; ``requested``: also :data:`OPTIONAL_READ`."""
    names = set(member_names)
    have = [f for f in (DEFAULT_READ + OPTIONAL_READ if requested else DEFAULT_READ) if f + ".npy" in names]
    extra = sorted(n[:-4] for n in names if n.endswith(".npy") and n[:-4] not in BY_NAME
                   and lookup(n[:-4]) is not None)
    return tuple(have) + tuple(extra)


def sidecar_name(shard: str, field_name: str) -> str:
    """Sidecar tar of ``field_name`` for main shard ``shard``: ``shard-000003.tar`` ->
    ``shard-000003.codes_mimi.tar``."""
    if not shard.endswith(".tar"):
        raise ValueError(f"not a shard name: {shard!r}")
    return f"{shard[:-4]}.{field_name}.tar"


_SIDECAR = re.compile(r"^(shard-(?:r\d{4}-)?\d{6})\.([A-Za-z][A-Za-z0-9_]*)\.tar$")


def parse_sidecar_name(name: str) -> tuple[str, str] | None:
    """``(main shard name, field)`` of a sidecar tar name, or None for any other name."""
    m = _SIDECAR.match(name) if isinstance(name, str) else None
    return (m.group(1) + ".tar", m.group(2)) if m else None


__all__ = ["Field", "IndexColumn", "FIELDS", "BY_NAME", "REGISTERED", "DERIVABLE", "INDEX_FIELD_COLUMNS", "lookup",
           "get", "register", "field_of_member", "ndim", "kind", "tensor_dtypes", "index_column_values",
           "sidecar_name", "parse_sidecar_name", "derived_field", "selection", "held", "DEFAULT_READ", "OPTIONAL_READ", "IGNORE_INDEX", "TEXT_PAD_ID", "PAD_TEXT",
           "PAD_LAST"]
