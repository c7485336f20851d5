"""Every option declares its effect, and stage one honours it (issue 41 item 1).

The walk: every option of :class:`precompute.config.PrecomputeConfig` (sections expanded), every key of the
encoder specs of the walk's config (the tiny DAC codec, the tiny Wan VAE, the byte tokenizer) and of its
``extra_fields`` producer, and every option of ``shardcache add-field``, is changed to another value and the
cache made with the first value is rerun with it. Whatever the option declares, the rerun either refuses
(``FingerprintMismatch`` / ``BatchPolicyMismatch``, the cache untouched) or gives the cache a fresh run with the
new value gives, row for row; and by its declaration:

* ``bytes``: refused (unless the fingerprint's record of the value is the same: an alias), or through the
  encoder's identity the same bytes (a copy of the same weights elsewhere) with nothing re-encoded;
* ``filter``: never refused; only rows of its scope are re-decided (chunks of one row here);
* ``batch``: refused, unless the recorded policy is the same (``device: auto`` on a CPU machine);
* ``operational``: never refused, nothing re-encoded, the shards byte for byte the same.

An option without a declaration fails the walk (its collection, :func:`precompute.identity.walk`); an
option the walk has no other value for fails too (add it to :data:`OTHER`). Encoder classes the walk's
config does not load (EnCodec, Higgs, Cosmos, Gemma 3, the HF tokenizer) are checked on their declarations:
each option of ``OPTIONS`` is declared, and a changed ``bytes`` / ``batch`` key changes the fingerprint /
the batch policy (:func:`test_every_class_declares_every_option`).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from conftest import DEMO, ROOT
from shards import ShardReader, read_rejects
from shards.errors import FingerprintMismatch

#: the walk's manifest: a short clip, a clip with an image (wide, half transparent: every image option
#: changes its latents), text with a 0.6 s clip, one row that is a 0.35 s window of a recording; chunks of one
#: row (each row's fate is visible)
ROWS = [
    {"key": "short", "text": "A short clip.", "audio": "audio/spk-us-0001.flac", "offset": 0.2, "duration": 0.3},
    {"key": "image", "text": "A cat on a chair.", "audio": "audio/img-chelsea.flac", "offset": 0.0,
     "duration": 0.4, "image": "images/rgba.png"},
    {"key": "long", "text": "A longer clip of speech.", "audio": "audio/spk-gb-0003.flac", "offset": 0.0,
     "duration": 0.6},
    {"key": "window", "text": "one two three", "audio": "audio/img-camera.flac", "offset": 0.5, "duration": 0.35},
]
#: which rows each filter scope applies to
SCOPE_ROWS = {"audio": {"short", "image", "long", "window"}, "image": {"image"},
              "row": {"short", "image", "long", "window"}}


class Change(dict):
    """Several options changed together (path -> value): a value alone would not load (another codec needs
    its own weights; marker tokens the tokenizer lacks need add_missing_tokens)."""


def _other(models: Path, tmp: Path) -> dict[str, object]:
    """Option path -> the other value the walk gives it (a :class:`Change`: several options together)."""
    from shards.tokens import SPECIAL_TOKENS
    dac2, wan2 = tmp / "dac-copy", tmp / "wan-copy"
    if not dac2.exists():
        shutil.copytree(models / "dac-tiny", dac2)
        shutil.copytree(models / "wan-tiny", wan2 / "vae")
    return {
        "sample_rate": 16000, "min_duration": 0.32, "max_duration": 0.5, "silence_rms": 0.5, "image_size": 32,
        "image_resize": "pad", "image_rgb": "convert", "image_pixel_range": "0..255", "image_token": "<|eom_id|>",
        "world_tokens": Change({"world_tokens": ["<start_of_world>", "<end_of_world>"], "add_missing_tokens": True}),
        "add_missing_tokens": True,
        "store_posterior": True, "max_image_pixels": 1000, "min_image_side": 1000, "samples_per_shard": 2,
        "encoder_batch_size": 2, "num_workers": 1, "stall_timeout_s": 30.0, "device": "auto", "encoder_dtype": "fp32",
        "precision_samples": 1, "precision_tolerance.latents_rel_err": 0.5, "precision_tolerance.codes_agreement": 0.5,
        "chat_template": "llama3", "label_policy": "all_but_world", "manifest_format": "jsonl",
        "columns": {"text": "caption"}, "allow_outside_root": False, "source_digest": "content",
        "keep_removed_rows": True, "max_text_tokens": 20, "max_audio_items": 1, "max_total_duration_s": 0.5,
        "max_images": 1, "image_features": {"name": "gemma3", "pretrained": str(tmp / "no-gemma")},
        "audio_tokenizer": None, "image_encoder": None,
        "text_tokenizer": {"name": "hf", "pretrained": str(models / "tokenizer-tiny")},
        "extra_fields": {},
        "audio_tokenizer.name": Change({"audio_tokenizer.name": "mimi",
                                        "audio_tokenizer.pretrained": str(models / "mimi-tiny")}),
        "audio_tokenizer.pretrained": str(dac2), "audio_tokenizer.device": "cpu", "audio_tokenizer.dtype": "bfloat16",
        "audio_tokenizer.max_batch_size": 2, "audio_tokenizer.max_batch_samples": 1000,
        "audio_tokenizer.bucket_s": 0.5, "audio_tokenizer.processes": 2,
        "audio_tokenizer.n_quantizers": 2,
        "image_encoder.name": "cosmos", "image_encoder.pretrained": str(wan2 / "vae"),
        "image_encoder.device": "cpu", "image_encoder.dtype": "bfloat16", "image_encoder.normalize": True,
        "image_encoder.max_batch_size": 2,
        "image_encoder.subfolder": Change({"image_encoder.pretrained": str(wan2), "image_encoder.subfolder": "vae"}),
        "image_encoder.input_range": [0.0, 255.0],
        "text_tokenizer.name": Change({"text_tokenizer.name": "hf",
                                       "text_tokenizer.pretrained": str(models / "tokenizer-tiny")}),
        "text_tokenizer.add_bos": False, "text_tokenizer.add_eos": False,
        "text_tokenizer.special_tokens": [*SPECIAL_TOKENS, "<x>"],
        "extra_fields.audio_16k.producer": "latents", "extra_fields.audio_16k.sample_rate": 8000,
        "extra_fields.audio_16k.direction": "in",
    }


#: bytes options whose other value changes no stored byte of the walk's rows, and why (declared bytes all the
#: same: they do change bytes elsewhere, so a rerun with another value is refused)
NO_EFFECT_HERE = {
    "chat_template": "with the byte tokenizer auto is llama3 (theworld and tokenizer need a tokenizer's template)",
    "text_tokenizer.add_bos": "the chat templates encode each piece without the tokenizer's bos/eos",
    "text_tokenizer.add_eos": "the chat templates encode each piece without the tokenizer's bos/eos",
    "text_tokenizer.special_tokens": "an added special token the rows do not use changes the vocabulary size only",
}
#: options whose other value the walk cannot run here, and why (checked on their declarations instead)
STATIC = {"image_features": "needs the Gemma 3 test model (tools.testing gemma3), not built for this test",
          "image_encoder.name": "the other VAE (cosmos) has no test model here",
          "extra_fields.audio_16k.producer": "another producer makes another kind of field: refused by the config "
                                             "check (audio_<name> is a waveform field)"}


def _base(models: Path):
    from precompute.config import load_config
    return load_config(ROOT / "configs" / "precompute.yaml", [
        f"audio_tokenizer.pretrained={models / 'dac-tiny'}", f"image_encoder.pretrained={models / 'wan-tiny'}",
        "image_size=64", "samples_per_shard=1", "num_workers=0", "device=cpu", "allow_outside_root=true",
        "extra_fields={audio_16k: {producer: waveform, sample_rate: 16000, direction: all}}"])


def _walk_paths() -> list[str]:
    """Every option path of the walk's config (collection fails on an undeclared one)."""
    from precompute.config import load_config
    from precompute.identity import walk
    cfg = load_config(ROOT / "configs" / "precompute.yaml", [
        "image_size=64", "extra_fields={audio_16k: {producer: waveform, sample_rate: 16000, direction: in}}",
        "audio_tokenizer={name: dac, pretrained: x, device: cpu, dtype: float32, max_batch_size: 1, "
        "max_batch_samples: 10, n_quantizers: 1}",
        "image_encoder={name: wan, pretrained: x, device: cpu, dtype: float32, normalize: false, max_batch_size: 1, "
        "subfolder: v, input_range: [-1, 1]}",
        "text_tokenizer={name: bytes, add_bos: true, add_eos: true, special_tokens: [a]}"])
    paths = [p for p, *_ in walk(cfg)]
    return paths + [p.rpartition(".")[0] for p in paths if p.count(".") == 1 and p.split(".")[0] in (
        "audio_tokenizer", "image_encoder", "text_tokenizer", "extra_fields")] + ["image_features"]


WALK = list(dict.fromkeys(_walk_paths()))


def _with(cfg, change: dict):
    from precompute.config import load_config
    from shardcache.config import to_dict
    d = to_dict(cfg)
    for path, value in change.items():
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return load_config(d)


def _media(root: Path) -> Path:
    """The walk's media folder: the demo clips and a wide RGBA image (alpha, so ``image_rgb`` matters)."""
    from PIL import Image
    (root / "images").mkdir(parents=True, exist_ok=True)
    shutil.copytree(DEMO / "audio", root / "audio", dirs_exist_ok=True)
    px = np.zeros((48, 80, 4), np.uint8)
    px[..., 0] = np.arange(80)[None, :] * 3
    px[..., 1] = np.arange(48)[:, None] * 5
    px[..., 3] = 128
    Image.fromarray(px, "RGBA").save(root / "images" / "rgba.png")
    return root


MEDIA: list[Path] = []
from precompute.encode import load_encoders as _LOAD  # noqa: E402  (the real one, wrapped by _load_encoders)


#: loaded codecs and VAEs by spec: the walk runs the job some 200 times (the text tokenizer, which a job may
#: grow with added tokens, is loaded each time)
_ENCODERS: dict[str, object] = {}


def _load_encoders(cfg, device, dtype=None):
    from precompute import encode
    from precompute.encoders import load_text_tokenizer
    key = json.dumps([cfg.audio_tokenizer, cfg.image_encoder, cfg.image_pixel_range, dtype or cfg.encoder_dtype, device],
                     sort_keys=True, default=str)
    if key not in _ENCODERS:
        _ENCODERS[key] = _LOAD(cfg, device, dtype)
    enc = _ENCODERS[key]
    return encode.Encoders(enc.audio, enc.image, load_text_tokenizer(cfg.text_tokenizer))


def _run(manifest: Path, cache: Path, cfg):
    from precompute import encode
    from precompute.job import run
    with mock.patch.object(encode, "load_encoders", _load_encoders):
        return run(manifest, cache, cfg, root=MEDIA[0], progress=False)[0]


def _read(cache: Path) -> tuple[dict, set]:
    samples = {}
    if (cache / "index.parquet").exists():
        r = ShardReader(cache)
        assert len(r.keys) == len(set(r.keys))
        for i, k in enumerate(r.keys):
            s = dict(r.get(i))
            s["json"] = {j: v for j, v in s["json"].items() if j != "row"}
            samples[k] = s
    return samples, {(x["key"], x["reason"]) for x in read_rejects(cache).to_pylist()}


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        (a[k] == b[k]) if k == "json" else np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def _files(cache: Path) -> dict[str, bytes]:
    """The cache's shards and parts, by name (what a refused rerun must leave as it was)."""
    return {str(p.relative_to(cache)): p.read_bytes() for p in sorted(cache.rglob("*"))
            if p.is_file() and (p.suffix == ".tar" or p.parent.name == "parts") and p.name != "writer.lock"}


@pytest.fixture(scope="module")
def walk_setup(tiny_models, tmp_path_factory):
    """The manifest, the base config, and the cache a first run made with it."""
    tmp = tmp_path_factory.mktemp("walk")
    MEDIA[:] = [_media(tmp / "media")]
    manifest = tmp / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = _base(tiny_models)
    base = tmp / "base"
    _run(manifest, base, cfg)
    return {"tmp": tmp, "manifest": manifest, "cfg": cfg, "base": base, "read": _read(base), "files": _files(base),
            "other": _other(tiny_models, tmp)}


def _effect(cfg, path: str):
    from precompute.identity import walk
    from precompute.effects import BYTES
    found = {p: e for p, _, e, _ in walk(cfg)}
    return found.get(path, BYTES)  # a whole spec (or null): its presence is in the fingerprint


@pytest.mark.parametrize("path", WALK)
def test_every_option_changes_exactly_what_it_declares(walk_setup, path, tmp_path):
    from precompute.identity import BatchPolicyMismatch, batch_policy, fingerprint_options
    from precompute.validate import check_config
    s = walk_setup
    if path in STATIC:
        pytest.skip(STATIC[path])
    assert path in s["other"], f"{path}: the walk has no other value for this option: add one to OTHER"
    other = s["other"][path]
    change = other if isinstance(other, Change) else {path: other}
    cfg = _with(s["cfg"], change)
    assert check_config(cfg) == [], (path, check_config(cfg))
    effect = _effect(cfg if path.count(".") else s["cfg"], path)
    fresh = tmp_path / "fresh"
    _run(s["manifest"], fresh, cfg)
    want = _read(fresh)
    if effect.kind == "bytes" and effect.via == "fingerprint" and fingerprint_options(cfg) != fingerprint_options(s["cfg"]):
        assert path in NO_EFFECT_HERE or not _same_cache(want, s["read"]), \
            f"{path}: the walk's other value changes no byte: choose another"
    cache = tmp_path / "cache"
    shutil.copytree(s["base"], cache)
    try:
        summary = _run(s["manifest"], cache, cfg)
    except (FingerprintMismatch, BatchPolicyMismatch) as e:
        assert effect.kind in ("bytes", "batch"), f"{path} ({effect.kind}) was refused: {e}"
        if effect.kind == "batch":
            assert isinstance(e, BatchPolicyMismatch) and batch_policy(cfg, "cpu") != batch_policy(s["cfg"], "cpu")
        assert _files(cache) == s["files"], f"{path}: the refused rerun changed the cache"
        return
    got = _read(cache)
    assert set(got[0]) == set(want[0]) and got[1] == want[1], (path, sorted(got[0]), sorted(want[0]), got[1] ^ want[1])
    for k in want[0]:
        assert _same(got[0][k], want[0][k]), (path, k)
    counts = summary.rerun
    redone = counts["reencoded"] + counts["reencoded_with_chunk"] + counts["added"]
    if effect.kind == "operational" or effect.kind == "batch" or (effect.kind == "filter" and effect.scope == "rerun"):
        assert redone == 0 and summary.kept == summary.rejected == 0, (path, counts)
        if effect.kind == "operational":
            assert _files(cache) == s["files"] or path in ("samples_per_shard",), f"{path}: bytes changed"
    elif effect.kind == "bytes":
        same = fingerprint_options(cfg) == fingerprint_options(s["cfg"])
        assert effect.via == "identity" or same, f"{path}: a bytes option changed and the rerun was not refused"
        assert redone == 0 and _same_samples(got[0], s["read"][0]), f"{path}: kept as the same bytes, but differ"
    elif effect.kind == "filter" and effect.scope in SCOPE_ROWS:
        assert redone <= len(SCOPE_ROWS[effect.scope]) and counts["kept"] >= len(ROWS) - len(SCOPE_ROWS[effect.scope])


def _same_samples(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)


def _same_cache(a: tuple, b: tuple) -> bool:
    """Two :func:`_read` results hold the same samples and rejects."""
    return _same_samples(a[0], b[0]) and a[1] == b[1]


def test_every_class_declares_every_option():
    """Each encoder class of every registry (and the vision encoder of image_features) declares the effect of
    each option it accepts, and the declarations reach identity: a changed ``bytes`` key changes the
    fingerprint's record, a changed ``batch`` key the batch policy, an ``operational`` one neither."""
    from precompute.config import PrecomputeConfig
    from precompute.identity import _tables, batch_policy, fingerprint_options, spec_effects
    from precompute.producers import PRODUCERS
    assert all(cls.OPTION_EFFECTS.get("producer") is not None for cls in PRODUCERS.values())  # one table, declared
    for option, (table, _) in _tables().items():
        for name, cls in table.items():
            effects = spec_effects(option, {"name": name})  # raises for an option without a declaration
            assert set(effects) == {"name", "pretrained", *cls.OPTIONS}, (option, name)
            for key, effect in effects.items():
                if key in ("name", "pretrained"):
                    continue
                spec = {"name": name, "pretrained": "x"}
                a, b = dict(spec, **{key: "one"}), dict(spec, **{key: "two"})
                if option == "image_features":
                    ca, cb = PrecomputeConfig(image_features=a), PrecomputeConfig(image_features=b)
                else:
                    ca, cb = PrecomputeConfig(**{option: a}), PrecomputeConfig(**{option: b})
                fp = fingerprint_options(ca) != fingerprint_options(cb)
                bp = batch_policy(ca, "cpu") != batch_policy(cb, "cpu")
                assert (fp, bp) == ({"bytes": effect.via == "fingerprint", "batch": False, "operational": False}
                                    [effect.kind], effect.kind == "batch"), (option, name, key, effect)


def test_an_undeclared_option_fails_the_walk():
    """A new option without ``effect=`` (or a spec key a class does not declare) is refused by the walk,
    so by the collection of the test above and by the config check."""
    from precompute.config import PrecomputeConfig
    from precompute.identity import UndeclaredOption, undeclared, walk
    from shardcache.config import option

    @dataclasses.dataclass
    class Grown(PrecomputeConfig):
        new_option: int = option(3)  # no effect declared

    with pytest.raises(UndeclaredOption, match="new_option"):
        list(walk(Grown()))
    cfg = PrecomputeConfig(audio_tokenizer={"name": "dac", "pretrained": "x", "new_key": 1})
    with mock.patch("precompute.encoders.audio.DacTokenizer.OPTIONS", ("device", "dtype", "max_batch_size",
                                                                        "max_batch_samples", "n_quantizers", "new_key")):
        assert undeclared(cfg) and undeclared(cfg)[0][0] == "audio_tokenizer"


# ---- batch options where codes depend on the batch (as on a GPU) -------------------------------------------

class BatchCodec:
    """A codec whose codes depend on what each clip is batched with (as a GPU's kernels make them do): each
    clip's codes are its frame energy plus the size of the call it came in (tests only)."""

    sample_rate, n_codebooks, codebook_size, hop_length = 16000, 2, 256, 320
    frame_rate = sample_rate / hop_length

    def encode(self, waveforms):
        out = []
        for w in waveforms:
            frames = -(-len(w) // self.hop_length)
            padded = np.zeros(frames * self.hop_length, np.float32)
            padded[:len(w)] = w
            e = np.minimum((np.sqrt((padded.reshape(frames, -1) ** 2).mean(1)) * 1000).astype(np.int64), 200)
            out.append(np.stack([e, e + len(waveforms)]).astype(np.int16))
        return out

    def describe(self):
        return {"class": "test_option_effects.BatchCodec", "name": "batch", "config": {}, "weights_sha256": "0" * 64}


def make_batch_codec(device: str = "cpu") -> BatchCodec:
    return BatchCodec()


def _plain_options() -> list[str]:
    """Every option of the schema but the specs (their keys are walked above)."""
    from precompute.config import PrecomputeConfig
    from shardcache.config import effect_of, options
    return [p for p, (_, f) in options(PrecomputeConfig).items() if effect_of(f).kind != "spec"]


@pytest.mark.parametrize("path", _plain_options())
def test_with_codes_that_depend_on_the_batch_every_option_is_refused_or_exact(walk_setup, path, tmp_path):
    """With a codec whose codes depend on the batch (as on a GPU), every option of the schema changed between
    runs is refused, or the rerun equals a fresh run with the new value: an option that forms batches (an encoder
    batch size, the chunking) declared anything but ``batch`` would keep chunks of the old batches and fail
    here (the tiny codecs above give the same codes batched or not)."""
    from precompute.identity import BatchPolicyMismatch
    s = walk_setup
    base = _with(s["cfg"], {"audio_tokenizer": {"factory": "test_option_effects:make_batch_codec"},
                            "image_encoder": None, "extra_fields": {}, "encoder_batch_size": 4,
                            "samples_per_shard": 3})  # one chunk: batches of 3 clips
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in ROWS if "image" not in r))
    other = s["other"][path]
    cfg = _with(base, dict(other) if isinstance(other, Change) else {path: other})
    fresh = tmp_path / "fresh"
    _run(manifest, fresh, cfg)
    cache = tmp_path / "cache"
    _run(manifest, cache, base)
    before = _files(cache)
    try:
        _run(manifest, cache, cfg)
    except (BatchPolicyMismatch, FingerprintMismatch):
        assert _files(cache) == before
        return
    assert _same_cache(_read(cache), _read(fresh)), path


# ---- add-field's options ---------------------------------------------------------------------------------------

#: add-field option -> (the walk's other value, or why it is checked on its declaration only)
ADD_FIELD_OTHER = {
    "field": "another name is another field (added beside it): nothing to compare",
    "producer": "another producer makes another kind of field (refused by the field's name rule)",
    "revision": "a hub revision needs a hub id (with a folder it is refused): test_hub_checkpoints.py::"
                "test_add_field_at_a_revision_is_identity",
    "spec.audio_tokenizer.revision": "as revision (test_hub_checkpoints.py::test_add_field_at_a_revision_is_identity)",
}


@pytest.fixture(scope="module")
def field_setup(walk_setup, tiny_models):
    """A copy of the walk's cache with a codes_mimi field added (the tiny Mimi codec, its options walked)."""
    from precompute.add_field import add_field
    tmp = walk_setup["tmp"]
    plain = tmp / "for-fields"
    shutil.copytree(walk_setup["base"], plain)
    with_field = tmp / "with-field"
    shutil.copytree(plain, with_field)
    spec = {"producer": "codes", "audio_tokenizer": {"name": "mimi", "pretrained": str(tiny_models / "mimi-tiny")}}
    add_field(with_field, "codes_mimi", spec, progress=False, batch_size=8)
    mimi2 = tmp / "mimi-copy"
    shutil.copytree(tiny_models / "mimi-tiny", mimi2)
    yaml_cfg = tmp / "codec.yaml"
    yaml_cfg.write_text(f"audio_tokenizer: {{name: mimi, pretrained: {tiny_models / 'mimi-tiny'}, max_batch_size: 2}}\n")
    return {"plain": plain, "cache": with_field, "models": tiny_models, "mimi2": mimi2, "yaml": yaml_cfg}


def _add_field_walk() -> list[str]:
    from precompute.add_field import AddFieldOptions
    from precompute.encoders.audio import MimiTokenizer
    from shardcache.config import options
    return list(options(AddFieldOptions)) + [f"spec.audio_tokenizer.{k}" for k in MimiTokenizer.OPTIONS]


@pytest.mark.parametrize("path", _add_field_walk())
def test_every_add_field_option_changes_exactly_what_it_declares(field_setup, path, tmp_path):
    """``shardcache add-field`` run again on a cache holding the field, with one option changed: refused (the
    field's fingerprint or batch policy differs; the cache untouched) for ``bytes`` / ``batch`` options; else
    the field equals a fresh add-field's with that option; ``operational`` ones change no byte."""
    from precompute.add_field import AddFieldOptions, FieldError, add_field, producer_spec
    from precompute.identity import spec_effects
    from shardcache.config import effect_of
    f = field_setup
    if isinstance(ADD_FIELD_OTHER.get(path), str):
        pytest.skip(ADD_FIELD_OTHER[path])
    base = {"field": "codes_mimi", "audio_tokenizer": "mimi", "pretrained": str(f["models"] / "mimi-tiny")}
    other = {"options": {"audio_tokenizer": {"name": "mimi", "pretrained": str(f["models"] / "mimi-tiny"),
                                             "num_quantizers": 2}},
             "audio_tokenizer": Change({"audio_tokenizer": "dac", "pretrained": str(f["models"] / "dac-tiny")}),
             "pretrained": str(f["mimi2"]), "config": Change({"config": str(f["yaml"]), "audio_tokenizer": None,
                                                             "pretrained": None}),
             "device": "cpu:0", "encoder_batch_size": 2, "replace": True, "no_progress": True,
             "spec.audio_tokenizer.device": "cpu", "spec.audio_tokenizer.dtype": "bfloat16",
             "spec.audio_tokenizer.max_batch_size": 2, "spec.audio_tokenizer.max_batch_samples": 1000,
             "spec.audio_tokenizer.bucket_s": 0.5, "spec.audio_tokenizer.processes": 2,
             "spec.audio_tokenizer.num_quantizers": 2}
    assert path in other, f"{path}: the walk has no other value for this add-field option: add one"
    opts = dict(base)
    if path.startswith("spec."):
        key = path.rpartition(".")[2]
        opts["options"] = {"audio_tokenizer": {"name": "mimi", "pretrained": str(f["models"] / "mimi-tiny"),
                                               key: other[path]}}
        opts["producer"] = "codes"
        opts.pop("audio_tokenizer"), opts.pop("pretrained")
        effect = spec_effects("audio_tokenizer", {"name": "mimi"})[key]
    else:
        opts |= other[path] if isinstance(other[path], Change) else {path: other[path]}
        effect = effect_of(AddFieldOptions.__dataclass_fields__[path])
    args = AddFieldOptions(**{k: v for k, v in opts.items() if v is not None})
    spec = producer_spec(args)
    cache = tmp_path / "cache"
    shutil.copytree(f["cache"], cache)
    before = _files(cache)
    kw = dict(device=args.device, replace=args.replace, progress=not args.no_progress,
              batch_size=args.encoder_batch_size)
    try:
        add_field(cache, args.field, spec, **kw)
    except FieldError as e:
        assert effect.kind in ("bytes", "batch", "spec"), f"{path} ({effect.kind}) was refused: {e}"
        assert _files(cache) == before, f"{path}: the refused add-field changed the cache"
        return
    fresh = tmp_path / "fresh"
    shutil.copytree(f["plain"], fresh)
    add_field(fresh, args.field, spec, **dict(kw, replace=False))
    got, want = ShardReader(cache), ShardReader(fresh)
    assert got.keys == want.keys
    for i in range(len(want.keys)):
        a, b = got.get(i).get(args.field), want.get(i).get(args.field)
        assert (a is None and b is None) or np.array_equal(np.asarray(a), np.asarray(b)), (path, want.keys[i])
    if effect.kind in ("operational", "batch") or effect.via == "identity":
        assert _files(cache) == before, f"{path} ({effect.kind}): a byte changed"


@pytest.mark.parametrize("path", ["encoder_batch_size", "device"])
def test_add_field_completes_a_field_only_with_its_batch_policy(walk_setup, path, tmp_path):
    """A field whose sidecar of one shard is missing (an interrupted add-field), completed with another batch
    policy, with a codec whose codes depend on the batch: refused (the field would mix two policies), or the
    same policy (``cpu:0`` is a cpu) and the field equals a fresh add-field's."""
    from precompute.add_field import FieldError, add_field
    s = walk_setup
    cfg = _with(s["cfg"], {"samples_per_shard": 2, "extra_fields": {}})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in ROWS if "image" not in r) +
                        json.dumps(dict(ROWS[0], key="short2", offset=0.6)) + "\n")
    plain = tmp_path / "plain"
    _run(manifest, plain, cfg)
    spec = {"producer": "codes", "audio_tokenizer": {"factory": "test_option_effects:make_batch_codec"}}
    cache = tmp_path / "cache"
    shutil.copytree(plain, cache)
    from precompute import add_field as module
    real, calls = module.write_sidecar, []

    def killed_after_one(*a, **k):  # the run is killed after its first sidecar
        if calls:
            raise KeyboardInterrupt
        calls.append(real(*a, **k))
        return calls[-1]

    with mock.patch.object(module, "write_sidecar", killed_after_one), pytest.raises(KeyboardInterrupt):
        add_field(cache, "codes_batch", spec, progress=False, batch_size=2)
    assert len(list((cache / "parts").glob("*.codes_batch.sidecar.parquet"))) == 1
    before = _files(cache)
    other = {"encoder_batch_size": dict(batch_size=1), "device": dict(batch_size=2, device="cpu:0")}[path]
    try:
        add_field(cache, "codes_batch", spec, progress=False, **other)
    except FieldError as e:
        assert "batch policy" in str(e) and _files(cache) == before
        assert path == "encoder_batch_size"
        return
    fresh = tmp_path / "fresh"
    shutil.copytree(plain, fresh)
    add_field(fresh, "codes_batch", spec, progress=False, **other)
    got, want = ShardReader(cache), ShardReader(fresh)
    for i in range(len(want.keys)):
        np.testing.assert_array_equal(got.get(i)["codes_batch"], want.get(i)["codes_batch"], err_msg=path)
