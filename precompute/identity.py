"""A cache's identity, derived from what every option declares (:class:`precompute.effects.Effect`).

Each option of :class:`precompute.config.PrecomputeConfig` (``option(effect=...)``), each key of an encoder
spec (the encoder class's ``OPTION_EFFECTS``, plus :data:`SPEC_KEYS`), of a producer spec (the producer
class's ``OPTION_EFFECTS``, :data:`precompute.producers.PRODUCERS`) and of a plug-in spec (:data:`PLUGIN_KEYS`)
says what changing it does to a cache. Which options hold specs is declared too (``effect=SPEC``): an option
whose name is an encoder registry's (:func:`encoder_options`) holds one encoder spec, any other one a mapping of
named producer specs (``extra_fields``). From those declarations, and nothing else:

* :func:`fingerprint_options`: the values of every ``bytes`` option the fingerprint holds itself (nested
  specs reduced to their ``bytes`` keys); ``bytes`` options ``via="identity"`` (a ``pretrained`` path) reach
  the fingerprint through the loaded encoder's ``describe()`` instead;
* :func:`filter_values`: the ``filter`` options of each row scope, put into every such row's digest
  (:class:`precompute.plan.ManifestPlan`), so a rerun re-decides exactly the rows a changed filter applies to;
* :func:`batch_policy`: the ``batch`` options (encoder batch sizes, chunking, the device type), recorded in
  ``parts/job.json`` when a cache is started and compared on every resume (:func:`check_job_record`);
* ``operational`` options are in none of them.

:func:`walk` lists every declared option of a config (spec keys included) and raises
:class:`UndeclaredOption` for one without a declaration; ``shardcache add-field`` derives its field's
identity from the same declarations (:func:`spec_fingerprint`, :func:`spec_batch_policy`). docs/trust.md's
option table is generated from them (:func:`effects_table`).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import operator
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

from shardcache.config import effect_of, options
from shardcache.weights import numeric_policy
from shards.errors import FingerprintMismatch
from shards.index import PARTS_DIR, write_json_atomic

from .effects import BATCH, BYTES, IDENTITY, SPEC, Effect

#: keys every built-in encoder spec takes besides its class's ``OPTIONS`` (:func:`~.encoders.registry.spec_problems`)
SPEC_KEYS: dict[str, Effect] = {"name": BYTES, "pretrained": IDENTITY}
#: the keys of a plug-in spec: a plug-in declares nothing finer, so all of it is in the fingerprint
PLUGIN_KEYS: dict[str, Effect] = {"factory": BYTES, "kwargs": BYTES}
#: spec keys whose value the job supplies when the spec does not give one (not the constructor's default)
JOB_SUPPLIED = ("device",)
JOB_FILE = "job.json"


class UndeclaredOption(TypeError):
    """An option (or a key of an encoder / producer spec) without a declared effect: a bug in the code
    that added it (declare it: ``option(effect=...)``, the encoder's or the producer's ``OPTION_EFFECTS``)."""


class BatchPolicyMismatch(FingerprintMismatch):
    """A resume with another batch policy than the one the cache was started with."""


def _tables() -> dict[str, tuple[Mapping[str, type], str]]:
    """Encoder spec option -> (its registry of built-in classes, the default name)."""
    from .encoders.registry import SPECS
    from .producers.image_features import VISION_ENCODERS
    return dict(SPECS) | {"image_features": (VISION_ENCODERS, "gemma3")}


def spec_options(cls: type) -> list[str]:
    """The options of the config class ``cls`` declared ``effect=SPEC`` (they hold specs), in order."""
    return [path for path, (_, f) in options(cls).items() if effect_of(f) is not None and effect_of(f).kind == "spec"]


def encoder_options(cls: type) -> list[str]:
    """The spec options of ``cls`` that hold one encoder spec: those an encoder registry is named for
    (:func:`_tables`); the others hold named producer specs."""
    return [o for o in spec_options(cls) if o in _tables()]


def encoder_class(option: str, spec: Mapping) -> type | None:
    """The built-in class an encoder spec names (None: a plug-in, or an unknown name the config check refuses)."""
    table, default = _tables()[option]
    return None if "factory" in spec else table.get(spec.get("name", default))


def spec_effects(option: str, spec: Mapping) -> dict[str, Effect]:
    """Every key an encoder spec of ``option`` may hold -> its declared effect (:data:`SPEC_KEYS` plus the
    class's ``OPTION_EFFECTS``; a plug-in: :data:`PLUGIN_KEYS`). Raises :class:`UndeclaredOption` for a class
    option without a declaration."""
    if "factory" in spec:
        return dict(PLUGIN_KEYS)
    cls = encoder_class(option, spec)
    if cls is None:
        return dict(SPEC_KEYS)
    declared = dict(cls.OPTION_EFFECTS)  # every registered class declares its table (tests walk them)
    if missing := [k for k in cls.OPTIONS if k not in declared]:
        raise UndeclaredOption(f"{option}: {cls.__module__}.{cls.__qualname__}.OPTION_EFFECTS declares no effect "
                               f"for {missing}")
    return SPEC_KEYS | declared


def producer_effects(spec: Mapping) -> dict[str, Effect]:
    """Every key of an ``extra_fields`` / add-field producer spec -> its declared effect (the producer class's
    ``OPTION_EFFECTS``)."""
    from .producers import PRODUCERS
    if "factory" in spec:
        return dict(PLUGIN_KEYS)
    name = spec.get("producer")
    if name not in PRODUCERS or not PRODUCERS[name].OPTION_EFFECTS:
        raise UndeclaredOption(f"extra_fields: producer {name!r} declares no OPTION_EFFECTS "
                               "(precompute.producers.PRODUCERS)")
    own = dict(PRODUCERS[name].OPTION_EFFECTS)
    if own.pop("*", None) is not None:  # the spec itself is an encoder spec too (image_features)
        inner = {k: v for k, v in spec.items() if k not in own}
        own |= spec_effects(name, inner)
    return own


def _defaults(cls: Any) -> dict[str, Any]:
    """The default of each keyword of ``cls``'s constructor (``from_pretrained`` too): what an omitted key means."""
    out: dict[str, Any] = {}
    fns = [cls] if inspect.isfunction(cls) else [k.__dict__[m] for k in reversed(cls.__mro__)  # subclasses win
                                                   for m in ("__init__", "from_pretrained", "from_spec")
                                                   if m in k.__dict__]
    for fn in fns:
        fn = fn.__func__ if isinstance(fn, classmethod) else fn
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # a builtin's __init__ (object)
            continue
        out |= {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    return out


def _spec_walk(path: str, option: str, spec: Any, effects: dict[str, Effect], cls: Any = None
               ) -> Iterator[tuple[str, Any, Effect, Any]]:
    """``(path, value, effect, default)`` of every key of a spec given (nested specs walked too)."""
    defaults = _defaults(cls) if cls is not None else {}
    for key, value in spec.items():
        if key not in effects:
            raise UndeclaredOption(f"{path}.{key}: unknown key (no declared effect); known: {', '.join(sorted(effects))}")
        effect = effects[key]
        if effect.kind == "spec":  # a producer's encoder spec (codes: audio_tokenizer, latents: image_encoder)
            yield from _encoder_walk(f"{path}.{key}", key, value)
        else:
            yield f"{path}.{key}", value, effect, defaults.get(key, inspect.Parameter.empty)


def _encoder_walk(path: str, option: str, spec: Any) -> Iterator[tuple[str, Any, Effect, Any]]:
    if not isinstance(spec, Mapping):  # null: no such encoder (its absence is in the fingerprint)
        yield path, spec, BYTES, inspect.Parameter.empty
        return
    yield from _spec_walk(path, option, spec, spec_effects(option, spec), encoder_class(option, spec))


def walk(cfg: Any) -> Iterator[tuple[str, Any, Effect, Any]]:
    """``(option path, value, effect, default)`` for every option of ``cfg`` and every key of its specs
    (``audio_tokenizer.max_batch_size``, ``extra_fields.audio_16k.sample_rate``); ``default`` is what an
    omitted spec key means (``inspect.Parameter.empty`` where none). Raises :class:`UndeclaredOption`."""
    encoders = encoder_options(type(cfg))
    for path, (_, f) in options(type(cfg)).items():
        effect, value = effect_of(f), operator.attrgetter(path)(cfg)
        if effect is None:
            raise UndeclaredOption(f"{type(cfg).__name__}.{path}: no declared effect (option(effect=...))")
        if effect.kind != "spec":
            yield path, value, effect, inspect.Parameter.empty
        elif path not in encoders:  # named producer specs (extra_fields)
            for name, spec in (value or {}).items():
                if not isinstance(spec, Mapping):
                    yield f"{path}.{name}", spec, BYTES, inspect.Parameter.empty
                    continue
                cls = None
                if "factory" not in spec:
                    from .producers import PRODUCERS
                    cls = PRODUCERS.get(spec.get("producer"))
                yield from _spec_walk(f"{path}.{name}", spec.get("producer", ""), spec, producer_effects(spec), cls)
        else:
            yield from _encoder_walk(path, path, value)


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


def _canonical(effect: Effect, value: Any) -> Any:
    return effect.canonical(value) if effect.canonical is not None else value


def fingerprint_options(cfg: Any) -> dict[str, Any]:
    """What the fingerprint holds of ``cfg`` itself: each ``bytes`` option (``via="fingerprint"``), its
    canonical value, nested as the config is (a spec reduced to its ``bytes`` keys given with another
    value than the default: an omitted key and its default make the same bytes). ``via="identity"`` keys
    are left to the encoders' ``describe()``."""
    out: dict[str, Any] = {}
    for path, value, effect, default in walk(cfg):
        if effect.kind == "bytes" and effect.via == "fingerprint" and value != default:
            _set(out, path, json.loads(json.dumps(_canonical(effect, value), default=str)))
    for option in spec_options(type(cfg)):
        out.setdefault(option, {} if getattr(cfg, option) is not None else None)  # a spec of defaults only
    return out


def preprocessing_of(cfg: Any) -> dict[str, Any]:
    """What the cache's fingerprint holds of a :class:`~precompute.config.PrecomputeConfig`: every ``bytes``
    option's value as declared (:func:`fingerprint_options`), the stored dtypes and ``sample_layout`` (the
    conversation rendering of :mod:`precompute.chat`: label spans from the template's structure)."""
    return fingerprint_options(cfg) | {"audio_format": "pcm_s16le", "latents_dtype": "float16",
                                       "sample_layout": "conversation-2"}


def filter_values(cfg: Any) -> dict[str, dict[str, Any]]:
    """Row scope (``audio``, ``image``, ``row``) -> ``{option: value}`` of the ``filter`` options that decide
    the rows of that scope (put into each such row's digest: :class:`precompute.plan.ManifestPlan`). The
    ``read`` and ``rerun`` scopes need no value there: the row as read is in its digest, and a rerun decides
    the rows no longer in the manifest each time."""
    out: dict[str, dict[str, Any]] = {"audio": {}, "image": {}, "row": {}}
    for path, value, effect, _ in walk(cfg):
        if effect.kind == "filter" and effect.scope in out:
            out[effect.scope][path] = value
    return out


def batch_policy(cfg: Any, device: str) -> dict[str, Any]:
    """The ``batch`` options of ``cfg`` as run: their canonical values (``device``: the type of the device
    the job resolved, ``cuda`` / ``cpu``), a spec's batch keys with the default where not given (except
    :data:`JOB_SUPPLIED` ones, recorded only when given)."""
    out: dict[str, Any] = {}
    for path, value, effect, default in walk(cfg):
        if effect.kind != "batch":
            continue
        _set(out, path, _canonical(effect, device if path == "device" else value))
    for option in encoder_options(type(cfg)):  # batch keys left at their default
        spec = getattr(cfg, option)
        if isinstance(spec, Mapping):
            _defaults_into(out, option, spec, spec_effects(option, spec), encoder_class(option, spec))
    return out


def _defaults_into(out: dict, path: str, spec: Mapping, effects: Mapping[str, Effect], cls: Any) -> None:
    defaults = _defaults(cls) if cls is not None else {}
    for key, effect in effects.items():
        if effect.kind == "batch" and key not in spec and key not in JOB_SUPPLIED and key in defaults:
            _set(out, f"{path}.{key}", defaults[key])


def options_batch_policy(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """The ``batch`` options of the dataclass ``cls`` (add-field's :class:`~precompute.add_field.AddFieldOptions`)
    as run: ``values[option]`` canonical, for each option declared ``batch`` (a KeyError names one the caller
    does not give: a new batch option must reach the record)."""
    return {path: _canonical(effect_of(f), values[path]) for path, (_, f) in options(cls).items()
            if effect_of(f) is not None and effect_of(f).kind == "batch"}


def spec_fingerprint(spec: Mapping) -> dict[str, Any]:
    """The ``bytes`` keys of an add-field producer spec, as :func:`fingerprint_options` reduces a spec."""
    out: dict[str, Any] = {}
    for path, value, effect, default in _producer_walk(spec):
        if effect.kind == "bytes" and effect.via == "fingerprint" and value != default:
            _set(out, path, json.loads(json.dumps(value, default=str)))
    return out


def spec_batch_policy(spec: Mapping) -> dict[str, Any]:
    """The ``batch`` keys of an add-field producer spec (nested encoder specs with their defaults)."""
    out: dict[str, Any] = {}
    for path, value, effect, _ in _producer_walk(spec):
        if effect.kind == "batch":
            _set(out, path, value)
    nested = [k for k, e in producer_effects(spec).items() if e.kind == "spec"] if "factory" not in spec else []
    for key in nested:  # the producer's own encoder specs (codes: audio_tokenizer, latents: image_encoder)
        inner = spec.get(key)
        if isinstance(inner, Mapping):
            _defaults_into(out, f"spec.{key}", inner, spec_effects(key, inner), encoder_class(key, inner))
    return out


def _producer_walk(spec: Mapping) -> Iterator[tuple[str, Any, Effect, Any]]:
    from .producers import PRODUCERS
    cls = None if "factory" in spec else PRODUCERS.get(spec.get("producer"))
    yield from _spec_walk("spec", spec.get("producer", ""), spec, producer_effects(spec), cls)


def undeclared(cfg: Any) -> list[tuple[str, str]]:
    """``(option, message)`` for a key of a spec with no declared effect (the config check lists them before
    any work: a key no encoder declares is a typo or an option this version does not know)."""
    try:
        for _ in walk(cfg):
            pass
    except UndeclaredOption as e:
        path, _, msg = str(e).partition(": ")
        return [(path, msg)]
    return []


# ---- the record of a cache's identity (parts/job.json) ------------------------------------------------------

def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted paths where two nested mappings differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in sorted(set(a) | set(b)) for p in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".") or "(all)"]


def _at(tree: Any, path: str) -> Any:
    for k in path.split("."):
        tree = tree.get(k) if isinstance(tree, dict) else None
    return tree


def check_job_record(out_dir: Path, fp: str, describe: dict, batch: dict, global_rank: int) -> bool:
    """Refuse to add to a cache made with other encoders / bytes options (:class:`FingerprintMismatch`) or
    another batch policy (:class:`BatchPolicyMismatch`), each naming what differs; record ours on first use
    (returns True when this call wrote ``parts/job.json``)."""
    path = out_dir / PARTS_DIR / JOB_FILE
    if path.exists():
        old = json.loads(path.read_text())
        _check_batch(out_dir, old.get("batch"), batch)  # first: a batched encoder's policy is in the fingerprint too
        if old.get("fingerprint") != fp:
            ours = json.loads(json.dumps(describe))
            diff = _diff(old.get("describe", {}), ours)
            raise FingerprintMismatch(
                f"{out_dir} was written with fingerprint {old.get('fingerprint')}, this job has {fp} "
                f"(differs in: {', '.join(diff) or 'encoder weights'}). Write to a new --cache directory, "
                "or delete the old cache; mixing latents/codes from different encoders is refused.")
    elif global_rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic({"fingerprint": fp, "describe": describe, "batch": batch}, path)
        return True
    return False


def check_batch_record(out_dir: Path, batch: dict) -> None:
    """Refuse a resume with another batch policy than ``parts/job.json`` records (:class:`BatchPolicyMismatch`,
    naming each option and both values); nothing when the cache records none yet. Loads no encoder: the
    first check of a rerun (:func:`check_job_record` makes it again with the fingerprint)."""
    path = out_dir / PARTS_DIR / JOB_FILE
    if path.exists():
        _check_batch(out_dir, json.loads(path.read_text()).get("batch"), batch)


def _check_batch(out_dir: Path, recorded: Any, batch: dict) -> None:
    ours = json.loads(json.dumps(batch))
    if recorded != ours:
        diff = _diff(recorded or {}, ours)
        was = ", ".join(f"{p} {_at(recorded, p)!r} (now {_at(ours, p)!r})" for p in diff)
        raise BatchPolicyMismatch(
            f"{out_dir} was started with another batch policy: {was or 'none recorded'}. On a GPU a clip's "
            "codes and an image's latents depend on what they are batched with, so a cache written with two "
            "policies mixes them: resume with the recorded values (--OPTION VALUE for each), or write to a "
            "new --cache directory.")


# ---- what the fingerprint comes from, known without loading an encoder -------------------------------------

#: stage one's code that makes the fingerprint (the encoders' describe(), the preprocessing): a change to it makes
#: the next run load its encoders once to compute the fingerprint again
FINGERPRINT_CODE = ("precompute/config.py", "precompute/identity.py", "precompute/chat.py", "precompute/encode.py",
                    "precompute/job.py", "precompute/encoders", "precompute/producers", "shardcache/weights.py")
#: the libraries whose versions are part of it (a model's config as a library writes it is in describe())
FINGERPRINT_LIBRARIES = ("shardcache", "torch", "transformers", "diffusers", "tokenizers", "numpy")
#: the spec key that names a checkpoint (:data:`SPEC_KEYS`: through the encoder's identity)
CHECKPOINT_KEY = "pretrained"


def _tree_signature(folder: str) -> list | None:
    """``[relative path, size, mtime_ns]`` of every file under ``folder`` (links followed), None when unreadable."""
    out = []
    try:
        for dirpath, dirs, files in os.walk(folder, followlinks=True):
            dirs.sort()
            for name in sorted(files):
                full = os.path.join(dirpath, name)
                st = os.stat(full)
                out.append([os.path.relpath(full, folder), st.st_size, st.st_mtime_ns])
    except OSError:
        return None
    return out


def checkpoint_signature(pretrained: str) -> list | None:
    """What identifies a checkpoint without reading its weights: every file of its folder with its size and
    modification time; a hub id through its snapshot in the local Hugging Face cache (never the network;
    the snapshot's folder names the commit). None when it cannot be told (not cached, unreadable)."""
    if os.path.isdir(pretrained):
        return _tree_signature(pretrained)
    if os.path.isfile(pretrained):
        st = os.stat(pretrained)
        return [[os.path.basename(pretrained), st.st_size, st.st_mtime_ns]]
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(pretrained, local_files_only=True)
    except Exception:  # noqa: BLE001 - not a cached hub id (or no huggingface_hub): unknown without loading
        return None
    sig = _tree_signature(folder)
    return None if sig is None else [os.path.basename(folder), *sig]


def _module_source(factory: str) -> str | None:
    """sha256 of the source file of a plug-in factory's module (``package.module:callable``), found without
    importing the module itself; None when it cannot be found."""
    import importlib.util
    try:
        spec = importlib.util.find_spec(str(factory).partition(":")[0])
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()


def _code_signature() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in FINGERPRINT_CODE:
        p = root / rel
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            if f.exists():
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for name in FINGERPRINT_LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def input_identity(cfg: Any, kinds: Any, device: str = "cpu") -> str | None:
    """sha256 of everything the cache's fingerprint is made from, known without loading an encoder: every
    ``bytes`` option and spec key (both kinds: the fingerprint's and the encoders' identity, the checkpoint
    paths among them), each checkpoint's files with their sizes and modification times
    (:func:`checkpoint_signature`), each plug-in factory's module source, with ``add_missing_tokens`` the media
    ``kinds`` the manifest's rows hold (they decide the tokens added to the tokenizer), the numerics of
    ``device`` as they are now (:func:`shardcache.weights.numeric_policy` but the dtype, an option: the device
    type, ATen's CPU kernels, the TF32 and cuDNN switches, each part of every encoder's identity), stage one's
    code that makes the fingerprint (:data:`FINGERPRINT_CODE`) and the versions of :data:`FINGERPRINT_LIBRARIES`. Equal identities give equal
    fingerprints, so a rerun whose identity is the one ``parts/job.json`` records needs no encoder to know
    the cache is its own. None when a checkpoint or plug-in cannot be told apart without loading it (the
    job then loads its encoders and compares the fingerprint itself)."""
    values, checkpoints, plugins = {}, {}, {}
    for path, value, effect, _ in walk(cfg):
        if effect.kind != "bytes":
            continue
        values[path] = json.loads(json.dumps(_canonical(effect, value), default=str))
        key = path.rpartition(".")[2]
        if key == CHECKPOINT_KEY and isinstance(value, str):
            if (sig := checkpoint_signature(value)) is None:
                return None
            checkpoints[path] = sig
        elif key == "factory":
            if (src := _module_source(value)) is None:
                return None
            plugins[path] = src
    # the media kinds decide the tokens added to a tokenizer (add_missing_tokens), else nothing of the fingerprint
    ident = {"options": values, "checkpoints": checkpoints, "plugins": plugins,
             "kinds": sorted(kinds) if cfg.add_missing_tokens else None,
             "numerics": {k: v for k, v in numeric_policy(None, device).items() if k != "dtype"},
             "code": _code_signature(), "versions": _versions()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def recorded_inputs(out_dir: Path) -> str | None:
    """The :func:`input_identity` ``parts/job.json`` records (None: none)."""
    path = out_dir / PARTS_DIR / JOB_FILE
    return json.loads(path.read_text()).get("inputs") if path.exists() else None


def record_inputs(out_dir: Path, inputs: str | None) -> bool:
    """Record ``inputs`` (:func:`input_identity`) in ``parts/job.json`` after the fingerprint was checked
    against it (rank 0); True when the file changed."""
    path = out_dir / PARTS_DIR / JOB_FILE
    if inputs is None or not path.exists():
        return False
    record = json.loads(path.read_text())
    if record.get("inputs") == inputs:
        return False
    write_json_atomic(record | {"inputs": inputs}, path)
    return True


# ---- docs/trust.md's table -------------------------------------------------------------------------------

def effects_table() -> str:
    """docs/trust.md's table (option -> effect), from the declarations: stage one's options, then the keys
    of each built-in encoder and producer spec, then add-field's options."""
    from .add_field import AddFieldOptions
    from .config import PrecomputeConfig
    from .producers import PRODUCERS
    rows = ["| option | effect |", "| --- | --- |"]
    for path, (_, f) in options(PrecomputeConfig).items():
        rows.append(f"| `{path}` | {effect_of(f).words()} |")
    for option, (table, _) in _tables().items():
        for name, cls in sorted(table.items()):
            for key, effect in spec_effects(option, {"name": name}).items():
                rows.append(f"| `{option}.{key}` ({name}) | {effect.words()} |")
        rows.append(f"| `{option}` plug-in `factory`, `kwargs` | {BYTES.words()} |")
    for name, cls in PRODUCERS.items():
        for key, effect in cls.OPTION_EFFECTS.items():
            if key != "*":
                rows.append(f"| `extra_fields.NAME.{key}` (producer {name}) | {effect.words()} |")
    for path, (_, f) in options(AddFieldOptions).items():
        rows.append(f"| `add-field --{path}` | {effect_of(f).words()} |")
    return "\n".join(rows)


__all__ = ["SPEC_KEYS", "PLUGIN_KEYS", "UndeclaredOption", "BatchPolicyMismatch", "spec_effects", "producer_effects",
           "spec_options", "encoder_options",
           "walk", "fingerprint_options", "filter_values", "batch_policy", "spec_fingerprint", "spec_batch_policy",
           "undeclared", "check_job_record", "check_batch_record", "input_identity", "recorded_inputs", "record_inputs",
           "checkpoint_signature", "effects_table", "BATCH", "SPEC"]
