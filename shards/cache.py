"""A cache opened once: :class:`Cache` (manifest, index, fields, id, encoders' identity) and
:meth:`Cache.require`, which refuses a model whose declared :class:`Contract` the cache does not meet.

Stage two reads ``manifest.json`` and ``index.parquet`` through here and nowhere else before it builds
a model: the trainer opens the cache once (:mod:`shards.opened`: integrity first, the index as
memory-mapped columns, a URL through a local mirror), checks the recipe's contract against it (before
any weight loads), builds the model from it and hands it to the loaders.

The encoders' identity (what a model needs to agree with) comes from the manifest as typed values
(stage one records it: each encoder's ``describe()``, the preprocessing, the text section):

=====================  ========================================================================================
``codec``              :class:`Codec`: ``name`` (``dac``, ``higgs``, ``encodec``, ``mimi``...),
                       ``sample_rate`` (Hz), ``frame_rate`` (frames/s), ``n_codebooks``, ``codebook_size``,
                       ``bandwidth`` (kbps, where the codec has one), ``weights`` (the tensors of the files
                       its library loads: ``checkpoint_sha256``), ``dtype``, ``tf32``
``text_tokenizer``     the tokenizer's fingerprint (``vocab_sha256`` of its vocabulary, pipeline and special
                       tokens, after the tokens the job added); ``pad_id``, the special token ids
``chat_template``      how conversations were rendered (``text.template``); ``chat_template_sha256`` the
                       sha256 of the tokenizer's own Jinja template they were rendered with (``tokenizer``,
                       ``theworld``); ``label_policy`` which tokens carry labels
``image``              :class:`ImagePreset`: the image encoder (``wan``, ``cosmos``...), ``size``, ``resize``,
                       ``rgb``, ``pixel_range``, ``latent_channels``, ``normalized``, ``dtype`` (the VAE's),
                       ``latents_dtype`` (stored), ``weights``, ``tf32``
``feature_encoder``    :class:`FeatureEncoder`: the image-feature encoder (``gemma3``), ``tokens_per_image``,
                       ``hidden_size``, ``dtype``, ``weights`` (the tower's and projector's tensors), ``tf32``,
                       ``image_processor`` (the processor options that shape its pixel values)
=====================  ========================================================================================

A :class:`Contract` names the values a model needs (``None``: any, :class:`Unknown`: needed but not
known, so never met); :meth:`Cache.require` refuses every unmet item in one ``ContractMismatch:`` line.
An item is compared only where the model reads the field it describes (:data:`ITEM_FIELDS`: a recipe whose
batch never reads the cached ``labels`` is not refused for their ``label_policy``).

Weights are compared by their hashes alone (:class:`Sourced`): the same files read from a hub id or from a
local folder are equal; a refusal names where each side's were read (hub id and snapshot commit, or folder).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields as dc_fields, replace
from typing import Any, Mapping

from .errors import ContractMismatch
from .manifest import CacheManifest  # noqa: F401 (named in the docstrings)
from .opened import CacheFiles


@dataclass(frozen=True)
class Unknown:
    """A contract value the model needs but cannot tell (a checkpoint that ships no tokenizer, names no
    audio tokenizer): never met by any cache, so the item is refused with ``why`` (what to name)."""

    why: str

    def __repr__(self) -> str:
        return f"<unknown: {self.why}>"


#: a contract value: the value the cache must hold, ``None`` (any) or :class:`Unknown` (refused, with why)
Want = Any


def source_text(loaded_from: Any) -> str:
    """Where weights were read, for people, from what an encoder records (``loaded_from``:
    :meth:`shardcache.weights.WeightFiles.source`): ``org/name@<commit>`` for the hub cache, the folder for a
    local one, with `` vae/`` for a subfolder; ``""`` when nothing is recorded."""
    if not isinstance(loaded_from, Mapping) or not loaded_from.get("pretrained"):
        return ""
    where = str(loaded_from["pretrained"])
    if loaded_from.get("revision"):
        where += f"@{loaded_from['revision']}"
    return where + (f" {str(loaded_from['subfolder']).strip('/')}/" if loaded_from.get("subfolder") else "")


class Sourced(str):
    """A hash (an encoder's ``weights``) with where its files were read (:func:`source_text`): equal to, hashed
    and written to JSON as the hash alone, so the hashes decide; its ``repr`` (what a refusal prints) adds the
    source: ``'3f2a...' (read from org/name@<commit>)``."""

    source: str

    def __new__(cls, value: str, source: str = "") -> "Sourced":
        obj = super().__new__(cls, value)
        obj.source = source
        return obj

    def __repr__(self) -> str:
        return f"{str.__repr__(self)} (read from {self.source})" if self.source else str.__repr__(self)


def _sourced(enc: Mapping) -> Sourced | None:
    h = enc.get("checkpoint_sha256")
    return Sourced(h, source_text(enc.get("loaded_from"))) if isinstance(h, str) else None


@dataclass(frozen=True)
class Codec:
    """An audio codec's identity. In a :class:`Contract` a ``None`` attribute means "any"."""

    name: str | None = None
    sample_rate: int | None = None       #: Hz of the audio the codec encodes
    frame_rate: float | None = None      #: code frames per second
    n_codebooks: int | None = None
    codebook_size: int | None = None
    bandwidth: float | None = None       #: kbps (codecs with a bandwidth setting: higgs, encodec)
    weights: str | None = None           #: sha256 of its checkpoint's tensors as stored (shardcache.weights)
    dtype: str | None = None             #: the dtype it computed in (``float32``, ``bfloat16``)
    tf32: bool | None = None             #: TF32 allowed when it ran (either switch on, or matmul precision < highest)


@dataclass(frozen=True)
class ImagePreset:
    """How images became latents: the encoder and the preprocessing. ``None`` in a contract: any."""

    encoder: str | None = None           #: the image encoder's name (``wan``, ``cosmos``...)
    size: int | None = None              #: ``image_size`` (pixels of the side the encoder saw)
    resize: str | None = None            #: ``image_resize`` (``center_crop``, ``stretch``...)
    rgb: str | None = None               #: ``image_rgb`` (``composite``, ``convert``)
    pixel_range: str | None = None       #: ``image_pixel_range`` (``-1..1``, ``0..255``)
    latent_channels: int | None = None
    normalized: bool | None = None       #: latents normalised with the VAE's ``latents_mean`` / ``latents_std``
    dtype: str | None = None             #: the dtype the VAE computed in (``encoder_dtype``)
    latents_dtype: str | None = None     #: the dtype the latents are stored in (``float16``)
    weights: str | None = None           #: sha256 of the VAE checkpoint's tensors as stored
    tf32: bool | None = None             #: as :attr:`Codec.tf32`


@dataclass(frozen=True)
class FeatureEncoder:
    """The encoder of the cached ``image_features`` (a VLM's own vision tower). ``None``: any."""

    name: str | None = None              #: ``gemma3``
    tokens_per_image: int | None = None
    hidden_size: int | None = None
    dtype: str | None = None             #: the dtype it computed in (and the features' values: ``bfloat16``)
    weights: str | None = None           #: sha256 of the tower's and projector's tensors in its checkpoint
    tf32: bool | None = None             #: as :attr:`Codec.tf32`
    #: the image processor's options that shape the pixel values (``{option: value}`` as its config file
    #: holds them; ``precompute.producers.image_features.Gemma3VisionEncoder.PIXEL_OPTIONS``)
    image_processor: Mapping | None = None


#: the encoder parts of a contract -> their class
PARTS = {"codec": Codec, "image": ImagePreset, "feature_encoder": FeatureEncoder}
#: the items whose mismatch ``--model.allow_other_encoder_weights`` waives (recorded in the run instead)
WEIGHT_ITEMS = tuple(f"{part}.weights" for part in PARTS)
#: the field each item (or part, or ``special_tokens.*``) describes: a contract compares an item only when the
#: model's batch reads that field (:attr:`Contract.reads`; None: every item)
ITEM_FIELDS = {"codec": "codes", "image": "latents", "feature_encoder": "image_features", "label_policy": "labels",
               "special_tokens": "input_ids", "pad_id": "input_ids", "text_tokenizer": "input_ids",
               "chat_template": "input_ids", "chat_template_sha256": "input_ids"}


@dataclass(frozen=True)
class Contract:
    """What a model needs from a cache (declared by its spec: :mod:`train.spec`).

    Every attribute but ``model``, ``fields``, ``optional_fields`` and ``reads`` is an item compared with the
    cache's value; ``None`` means any value, :class:`Unknown` a value the model cannot tell (always refused).

    Attributes:
        model: the model's name, for messages (``--model.name higgs``).
        fields: fields the cache must hold (some sample of it).
        optional_fields: fields read when the cache holds them (never required).
        reads: the fields the model's batch is built from (a recipe declares them: the ``higgs`` recipe's
            ``labels: processor`` batch never reads the cached ``labels``); an item describing another field
            (:data:`ITEM_FIELDS`) is not compared. None (a contract a user declares): every item is.
        special_tokens: token -> the id the model has for it, or ``None`` when any id will do but
            the cache must have the token.
        pad_id: the id ``input_ids`` are padded with.
        codec / image / feature_encoder: each set attribute must equal the cache's.
        text_tokenizer: the fingerprint (``vocab_sha256``) the cache's tokenizer must have.
        chat_template: how conversations were rendered (``text.template``: ``llama3``, ``tokenizer``,
            ``theworld``).
        chat_template_sha256: the sha256 of the Jinja template they were rendered with (the tokenizer's
            own: ``tokenizer`` and ``theworld`` render with it).
        label_policy: which tokens carry labels (``answers``, ``all_but_world``).

    Only the items of the fields the model reads are compared (:data:`ITEM_FIELDS`, :meth:`items`).
    """

    model: str
    fields: tuple[str, ...] = ()
    optional_fields: tuple[str, ...] = ()
    reads: tuple[str, ...] | None = None
    special_tokens: Mapping[str, Want] = field(default_factory=dict)
    pad_id: Want = None
    codec: Codec | None = None
    text_tokenizer: Want = None
    chat_template: Want = None
    chat_template_sha256: Want = None
    label_policy: Want = None
    image: ImagePreset | None = None
    feature_encoder: FeatureEncoder | None = None

    @property
    def read_fields(self) -> tuple[str, ...]:
        """Every field the model reads: ``fields`` then ``optional_fields``."""
        return tuple(self.fields) + tuple(f for f in self.optional_fields if f not in self.fields)

    def items(self) -> dict[str, Want]:
        """Every item this contract sets (not "any") of a field the model reads (:attr:`reads`,
        :data:`ITEM_FIELDS`), by its name in a refusal: ``fields``, ``special_tokens.<tok>``, ``pad_id``,
        ``codec.<attr>``, ``text_tokenizer``, ``chat_template``, ``chat_template_sha256``, ``label_policy``,
        ``image.<attr>``, ``feature_encoder.<attr>``."""
        out = self._set_items()
        if self.reads is None:
            return out
        described = {k: ITEM_FIELDS.get(k.partition(".")[0]) for k in out}
        return {k: v for k, v in out.items() if described[k] is None or described[k] in self.reads}

    def _set_items(self) -> dict[str, Want]:
        """Every item this contract sets, whatever the model reads."""
        out: dict[str, Want] = {"fields": tuple(self.fields)} if self.fields else {}
        out |= {f"special_tokens.{t}": v for t, v in self.special_tokens.items()}
        for f in dc_fields(self):
            v = getattr(self, f.name)
            if f.name in PARTS and v is not None:
                out |= {f"{f.name}.{a.name}": getattr(v, a.name) for a in dc_fields(v)
                        if getattr(v, a.name) is not None}
            elif f.name not in ("model", "fields", "optional_fields", "reads", "special_tokens") and v is not None:
                out[f.name] = v
        return out

    @classmethod
    def from_items(cls, model: str, items: Mapping[str, Want], fields: tuple[str, ...] = (),
                   optional_fields: tuple[str, ...] = (), reads: tuple[str, ...] | None = None) -> "Contract":
        """The contract of ``items`` (``{name: value}``, named as :meth:`items` names them; a ``None``
        value: any) for a model whose batch ``reads`` those fields (None: every item counts). The inverse of
        :meth:`items`. Raises ``ValueError`` naming an unknown item."""
        d: dict[str, Any] = {"fields": tuple(fields), "optional_fields": tuple(optional_fields)}
        for k, v in items.items():
            part, dot, attr = k.partition(".")
            if k == "fields":
                d["fields"] = tuple(dict.fromkeys(d["fields"] + tuple(v)))
            elif dot and part == "special_tokens":
                d.setdefault("special_tokens", {})[attr] = v
            elif dot:
                d.setdefault(part, {})[attr] = v
            else:
                d[k] = v
        c = cls.from_dict(model, d)
        return c if reads is None else replace(c, reads=tuple(reads))

    @classmethod
    def from_dict(cls, model: str, d: Mapping[str, Any]) -> "Contract":
        """A contract from a mapping (``--model.contract``: what a user declares for a plug-in model):
        ``fields``, ``optional_fields``, ``special_tokens`` ``{token: id or null}``, ``pad_id``,
        ``text_tokenizer``, ``chat_template``, ``chat_template_sha256``, ``label_policy`` and ``codec`` / ``image`` /
        ``feature_encoder`` mappings of their attributes. Raises ``ValueError`` naming unknown keys."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a contract is a mapping of items, got {d!r}")
        known = {f.name for f in dc_fields(cls)} - {"model", "reads"}
        bad = sorted(set(d) - known)
        kw: dict[str, Any] = {}
        for k, v in d.items():
            if k in PARTS:
                if not isinstance(v, Mapping):
                    bad.append(f"{k} (expected a mapping)")
                    continue
                attrs = {a.name for a in dc_fields(PARTS[k])}
                bad += [f"{k}.{a}" for a in sorted(set(v) - attrs)]
                kw[k] = PARTS[k](**{a: x for a, x in v.items() if a in attrs})
            elif k in ("fields", "optional_fields"):
                kw[k] = tuple(v)
            elif k == "special_tokens":
                kw[k] = dict(v)
            elif k in known:
                kw[k] = v
        if bad:
            raise ValueError(f"contract: unknown item(s) {bad}; known: {sorted(known)} "
                             f"({', '.join(f'{k}: {[a.name for a in dc_fields(c)]}' for k, c in PARTS.items())})")
        return cls(model, **kw)

    def merged(self, other: "Contract") -> "Contract":
        """This contract with ``other``'s items added where this one says "any" or cannot tell
        (:class:`Unknown`: ``other`` names it); fields and tokens united; every item ``other`` sets is
        compared (the fields they describe join :attr:`reads`). Raises ``ValueError`` naming an item both set
        to different values."""
        theirs_all = other.items()
        clash = [(k, v, theirs_all[k]) for k, v in self.items().items()
                 if k != "fields" and k in theirs_all and not isinstance(v, Unknown) and theirs_all[k] != v]
        if clash:
            raise ValueError(f"{self.model}: the contract already sets " + "; ".join(
                f"{k} to {a!r}, not {b!r}" for k, a, b in clash))
        def pick(mine: Any, theirs: Any) -> Any:
            return theirs if mine is None or (isinstance(mine, Unknown) and theirs is not None) else mine

        kw: dict[str, Any] = {"fields": tuple(dict.fromkeys(self.fields + tuple(other.fields))),
                              "optional_fields": tuple(dict.fromkeys(self.optional_fields + tuple(other.optional_fields))),
                              "special_tokens": {t: pick(self.special_tokens.get(t), other.special_tokens.get(t))
                                                 for t in {**other.special_tokens, **self.special_tokens}}}
        if self.reads is None:
            kw["reads"] = None
        else:   # what the other's items describe is read now
            theirs = other.reads if other.reads is not None else tuple(
                ITEM_FIELDS[k.partition(".")[0]] for k in theirs_all if k.partition(".")[0] in ITEM_FIELDS)
            kw["reads"] = tuple(dict.fromkeys(self.reads + tuple(theirs)))
        for f in dc_fields(self):
            if f.name in kw or f.name == "model":
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in PARTS and mine is not None and theirs is not None:
                kw[f.name] = PARTS[f.name](**{a.name: pick(getattr(mine, a.name), getattr(theirs, a.name))
                                              for a in dc_fields(mine)})
            else:
                kw[f.name] = pick(mine, theirs)
        return Contract(self.model, **kw)


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, Unknown):
        return False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    return a == b


class Cache(CacheFiles):
    """A cache opened once (see the module docstring). Build it with :meth:`open`
    (:meth:`shards.opened.CacheFiles.open`: the checks, the index as columns, a remote cache's mirror;
    :meth:`~shards.opened.CacheFiles.reader`, :meth:`~shards.opened.CacheFiles.problems`,
    :meth:`~shards.opened.CacheFiles.value_checks`).

    Attributes: ``source`` (the path or URL as given), ``dir`` (a local folder with the metadata:
    the cache itself, or the mirror of a URL's), ``manifest`` (:class:`CacheManifest`, checked:
    :meth:`CacheManifest.read_required`), ``index`` (the ``index.parquet`` table, read on first use),
    ``id`` (:func:`shards.index.read_cache_id`), ``fields`` (the fields some sample holds),
    ``storage_options``.
    """

    # -- sizes and ids of the text -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int | None:
        return self.manifest.vocab_size()

    @property
    def pad_id(self) -> int:
        """Pad id of ``input_ids`` (0 when the manifest does not say: the loaders' default)."""
        v = self.manifest.pad_id()
        return 0 if v is None else int(v)

    @property
    def latent_channels(self) -> int | None:
        return self.manifest.latent_channels

    def token_id(self, token: str) -> int | None:
        """The id of special token ``token`` in the cache's tokenizer (``text.special_token_ids``), or None."""
        ids = self.manifest.text.special_token_ids if self.manifest.text is not None else {}
        v = ids.get(token)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    @property
    def image_placeholder(self) -> str | None:
        """The image placeholder token of the cache's conversations (``text.placeholders.image``)."""
        ph = (self.manifest.text.extra.get("placeholders") if self.manifest.text is not None else None) or {}
        return ph.get("image")

    @property
    def world_tokens(self) -> tuple[str, str] | None:
        """TheWorld's world start / end markers (``text.world_tokens``), or None."""
        w = (self.manifest.text.extra.get("world_tokens") if self.manifest.text is not None else None) or ()
        return (str(w[0]), str(w[1])) if len(w) == 2 else None

    # -- the encoders' identity ----------------------------------------------------------------------
    def _encoder(self, name: str) -> dict:
        enc = (self.manifest.encoders or {}).get(name)
        return enc if isinstance(enc, dict) else {}

    @staticmethod
    def _tf32(enc: Mapping) -> bool | None:
        """Whether TF32 was allowed when an encoder ran (its ``numerics``), None when it did not say."""
        n = enc.get("numerics")
        if not isinstance(n, dict):
            return None
        return bool(n.get("tf32_matmul") or n.get("tf32_cudnn")
                    or n.get("float32_matmul_precision", "highest") != "highest")

    @property
    def codec(self) -> Codec | None:
        """The codec of the ``codes`` field, None when the cache has no codes."""
        m = self.manifest
        if m.n_codebooks is None:
            return None
        enc = self._encoder("audio_tokenizer")
        bw = enc.get("bandwidth")
        return Codec(name=enc.get("name"), sample_rate=m.codec_sample_rate, frame_rate=m.frame_rate,
                     n_codebooks=m.n_codebooks, codebook_size=m.codebook_size,
                     bandwidth=float(bw) if isinstance(bw, (int, float)) and not isinstance(bw, bool) else None,
                     weights=_sourced(enc), dtype=enc.get("dtype"), tf32=self._tf32(enc))

    @property
    def text_tokenizer(self) -> str | None:
        """The text tokenizer's fingerprint (``encoders.text_tokenizer.vocab_sha256``, a :class:`Sourced` naming
        where it was read), or None."""
        enc = self._encoder("text_tokenizer")
        v = enc.get("vocab_sha256")
        return Sourced(v, source_text(enc.get("loaded_from"))) if isinstance(v, str) else None

    @property
    def chat_template(self) -> str | None:
        """How the conversations were rendered (``text.template``: ``llama3``, ``tokenizer``, ``theworld``)."""
        return self.manifest.text.template if self.manifest.text is not None else None

    @property
    def chat_template_sha256(self) -> str | None:
        """The sha256 of the text tokenizer's own Jinja template (``encoders.text_tokenizer.config
        .chat_template_sha256``) when the conversations were rendered with it (``tokenizer``, ``theworld``);
        None for a named layout (``llama3``) or a tokenizer that records none."""
        if self.chat_template not in ("tokenizer", "theworld"):
            return None
        cfg = self._encoder("text_tokenizer").get("config")
        return cfg.get("chat_template_sha256") if isinstance(cfg, dict) else None

    @property
    def label_policy(self) -> str | None:
        """Which tokens carry labels (``encoders.preprocessing.label_policy``), None when not recorded."""
        return self._encoder("preprocessing").get("label_policy")

    @property
    def image(self) -> ImagePreset | None:
        """The image encoder and preprocessing of the ``latents`` field, None without an image encoder."""
        enc = self._encoder("image_encoder")
        if not enc.get("name"):
            return None
        pre = self._encoder("preprocessing")
        return ImagePreset(encoder=enc.get("name"), size=pre.get("image_size"), resize=pre.get("image_resize"),
                           rgb=pre.get("image_rgb"), pixel_range=pre.get("image_pixel_range"),
                           normalized=enc.get("normalize"), latent_channels=self.manifest.latent_channels,
                           dtype=enc.get("dtype"), latents_dtype=pre.get("latents_dtype"),
                           weights=_sourced(enc), tf32=self._tf32(enc))

    @property
    def feature_encoder(self) -> FeatureEncoder | None:
        """The encoder of the ``image_features`` field, None when the cache has none."""
        fi = self.manifest.fields.get("image_features")
        if fi is None:
            return None
        enc = fi.encoder.get("encoder") if isinstance(fi.encoder.get("encoder"), dict) else fi.encoder
        return FeatureEncoder(name=enc.get("name"), tokens_per_image=fi.extra.get("tokens_per_image"),
                              hidden_size=fi.extra.get("hidden_size"), dtype=enc.get("dtype"),
                              weights=_sourced(enc), tf32=self._tf32(enc),
                              image_processor=enc.get("pixel_options"))

    def value(self, item: str) -> Any:
        """The cache's value of contract item ``item`` (a name of :meth:`Contract.items`)."""
        if item == "fields":
            return list(self.fields)
        if item.startswith("special_tokens."):
            return self.token_id(item.partition(".")[2])
        part, _, attr = item.partition(".")
        if part in PARTS:
            have = getattr(self, part)
            return getattr(have, attr) if have is not None else None
        return {"pad_id": self.manifest.pad_id, "text_tokenizer": lambda: self.text_tokenizer,
                "chat_template": lambda: self.chat_template, "chat_template_sha256": lambda: self.chat_template_sha256,
                "label_policy": lambda: self.label_policy}[item]()

    # -- the contract ----------------------------------------------------------------------------------
    def mismatches(self, contract: Contract) -> list[tuple[str, Any, Any]]:
        """Every item of ``contract`` this cache does not meet, as ``(item, cache's value, model's
        value)``, in the contract's order; items are named as :meth:`Contract.items` names them. A
        special token is met when the cache has it (with the model's id, where the model gives one)."""
        out: list[tuple[str, Any, Any]] = []
        for item, want in contract.items().items():
            have = self.value(item)
            if item == "fields":
                if any(f not in self.fields for f in want):
                    out.append((item, have, list(want)))
            elif item.startswith("special_tokens."):
                if have is None or (want is not None and not _same(have, want)):
                    out.append((item, have, "any id" if want is None else want))
            elif not _same(have, want):
                out.append((item, have, want))
        return out

    def require(self, contract: Contract, allow_other_weights: bool = False) -> list[tuple[str, Any, Any]]:
        """Refuse a model whose contract this cache does not meet, before anything is built.

        ``allow_other_weights`` (``--model.allow_other_encoder_weights``): a mismatch of an encoder's
        weights (:data:`WEIGHT_ITEMS`) alone is not refused but returned, for the run to record (a model value
        that is not known, :class:`Unknown`, as its text). Returns the waived mismatches (empty when every
        item is met).

        Raises :class:`shards.errors.ContractMismatch` naming each item, the cache's value and the
        model's value (one line starting ``ContractMismatch:``); ``.item``, ``.cache_value``,
        ``.model_value`` are the first's.
        """
        bad = self.mismatches(contract)
        waived = [(i, c, repr(w) if isinstance(w, Unknown) else w) for i, c, w in bad
                  if allow_other_weights and i in WEIGHT_ITEMS]
        refused = [m for m in bad if not (allow_other_weights and m[0] in WEIGHT_ITEMS)]
        if refused:
            weights = any(m[0] in WEIGHT_ITEMS for m in refused)
            raise ContractMismatch(contract.model, str(self.source), refused, hint=(
                "precompute the cache with the model's encoders, template and preset, or pick the recipe that "
                "fits it" + ("; to train on encoder outputs of other weights on purpose: "
                             "--model.allow_other_encoder_weights" if weights else "")))
        return waived
