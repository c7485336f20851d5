"""One configuration mechanism for both stages (``precompute`` and ``train``).

A config is a dataclass whose fields are options or *sections* (nested dataclasses, e.g.
``TrainConfig.optim``). Each option is documented by the string literal right below it (an
attribute docstring, the convention torchtitan, tyro and jsonargparse read) and may declare its
own rules in :func:`option` (``choices``, bounds, ``merge`` for mappings). From that one
definition this module derives:

* the YAML file format: nested sections (``optim: {lr: 3.0e-4}``) or, for configs written before
  sections existed, the old flat keys (``lr: 3.0e-4``) through the stage's ``legacy`` table;
* dotted overrides ``--set optim.lr=3e-4`` (a path may continue into a mapping option:
  ``--set audio_tokenizer.pretrained=/ckpt/dac``; values are read as YAML);
* one command-line flag per option, ``--optim.lr`` (``--section.name``, dashes or underscores),
  plus the stage's aliases (``--lr``, ``--learning_rate``...) in the same argparse option;
* ``--help`` grouped by section with every option's docstring and default;
* a check of types (from the annotations) and rules, reporting **every** problem as
  ``option: message`` (:class:`ConfigError`); the CLIs print them and exit with status 2 before
  any work.

Precedence: dataclass defaults < config file < ``--set`` < flags. The config file is found by
:func:`config_path`: ``--config FILE`` (``--config none``: no file), else the file named by the
stage's environment variable (``SHARDCACHE_TRAIN_CONFIG`` / ``SHARDCACHE_PRECOMPUTE_CONFIG``),
else none (the dataclass defaults; ``configs/*.yaml`` document them). The working directory
never selects a file.

Why not tyro or jsonargparse (both evaluated, tyro 1.0.17 and jsonargparse 4.53): both read the
same dataclasses and attribute docstrings, and tyro's nested flags and aliases fit; but the
command lines this project must keep need glue around either: JSON values for mapping options
(``--model-kwargs '{"d_model": 128}'``, tyro wants ``KEY VALUE`` pairs), flags that set another
option to a constant (``--bf16``, ``--disable_evaluation``, ``--use_lora``), knowing which flags
were given (a dict flag updates the file's dict; a ``--model`` that differs from the file's drops
its ``model_kwargs``), ``--set a.b=v`` into mappings, old flat YAML keys, and messages in this
project's ``option: message`` form. jsonargparse has no flag aliases and spells booleans
``--lora true`` (``--no-progress`` and ``--use_lora`` would break). What is left after that glue
is this module (one file, no new dependency on training nodes); the dataclasses stay plain, so a
later switch to either library keeps them.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import os
import sys
import textwrap
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Union

import yaml

NONE_WORDS = ("none", "null", "")


class ConfigError(ValueError):
    """One or more invalid options; ``problems`` is ``[(option, message)]`` in field order."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        super().__init__("; ".join(f"{k}: {m}" for k, m in self.problems))

    def lines(self) -> list[str]:
        """One ``option: message`` line per problem (what the CLIs print after ``error: ``)."""
        return [f"{k}: {m}" for k, m in self.problems]

    def report(self, prog: str | None = None) -> int:
        """Write ``[PROG: ]error: option: message`` to stderr per problem; return 2 (the exit status
        of every CLI for bad options)."""
        head = f"{prog}: error" if prog else "error"
        for line in self.lines():
            sys.stderr.write(f"{head}: {line}\n")
        return 2


# ---- declaring options -----------------------------------------------------------------------------

def option(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,
           choices: Iterable[Any] | None = None, gt: float | None = None, ge: float | None = None,
           le: float | None = None, merge: bool = False, flag: bool = True,
           metavar: str | None = None) -> Any:
    """A dataclass field with rules checked by :func:`check`.

    ``choices``: the accepted values (for a ``X | None`` option None is accepted too); ``gt``/``ge``/
    ``le``: bounds of a number; ``merge``: a mapping given later (file, then ``--set``, then flags)
    updates the one below it instead of replacing it; ``flag=False``: no ``--name`` flag (the option
    is set through the file or ``--set``; for options that have a hand-written flag of the same name).
    Mutable defaults (dict, list) are copied per instance.
    """
    meta = {"choices": tuple(choices) if choices is not None else None, "gt": gt, "ge": ge, "le": le,
            "merge": merge, "flag": flag, "metavar": metavar}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type) -> Any:
    """A nested section (its own dataclass of options)."""
    return dataclasses.field(default_factory=cls)


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` from the string literals right below each field of ``cls`` (and its
    dataclass bases); {} when the source is not available (frozen apps)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:] + [None]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) and \
                    isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


@dataclass(frozen=True)
class Opt:
    """One option of a config class: its dotted ``path``, annotation, default, docstring, rules."""

    path: str
    type: Any
    default: Any
    doc: str
    meta: Mapping[str, Any]
    section: str  #: "" for top-level options

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    def rule(self, key: str) -> Any:
        return self.meta.get(key)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.lru_cache(maxsize=None)
def sections(cls: type) -> dict[str, type]:
    """``{section path: dataclass}`` of ``cls`` ("" for ``cls`` itself), in declaration order."""
    out = {"": cls}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            for sub, klass in sections(hints[f.name]).items():
                out[f.name + ("." + sub if sub else "")] = klass
    return out


@functools.lru_cache(maxsize=None)
def options(cls: type) -> dict[str, Opt]:
    """Every option of ``cls`` by dotted path, in declaration order (sections expanded)."""
    out: dict[str, Opt] = {}
    for prefix, klass in sections(cls).items():
        hints = typing.get_type_hints(klass)
        docs = field_docs(klass)
        for f in dataclasses.fields(klass):
            if _is_section(hints[f.name]):
                continue
            path = f"{prefix}.{f.name}" if prefix else f.name
            out[path] = Opt(path, hints[f.name], _default(f), docs.get(f.name, ""), dict(f.metadata), prefix)
    return out


# ---- values ------------------------------------------------------------------------------------------

def _args(tp: Any) -> tuple:
    origin = typing.get_origin(tp)
    return typing.get_args(tp) if origin in (Union, types.UnionType) else (tp,)


def _base(tp: Any) -> Any:
    o = typing.get_origin(tp)
    return o if o is not None else tp


def coerce(opt: Opt, value: Any, text: bool = False) -> Any:
    """``value`` (from YAML, or a command-line string when ``text``) as the option's type where
    that is lossless: ``"1e-4"`` -> 1e-4 for a float (YAML 1.1 reads it as text), ``"3"`` -> 3,
    ``"a,b"`` -> ``("a", "b")`` for a tuple, JSON/YAML text -> a mapping, ``none``/``null`` -> None
    for an optional option. A value that does not convert is returned as it is, for :func:`check`
    to report with the option's name."""
    kinds = _args(opt.type)
    optional = type(None) in kinds
    bases = {_base(k) for k in kinds if k is not type(None)}
    if isinstance(value, str):
        if optional and value.strip().lower() in NONE_WORDS and (str not in bases or value.strip().lower() != ""):
            return None
        if text and bases <= {str}:
            return value
        if tuple in bases and not value.strip().startswith("["):
            return tuple(s.strip() for s in value.split(",") if s.strip())
        if text:
            try:
                value = load_yaml(value, opt.path) if value.strip() else ("" if str in bases else {} if dict in bases else value)
            except yaml.YAMLError:
                return value
    if isinstance(value, str) and (float in bases or int in bases) and str not in bases:
        try:
            as_float = float(value)
        except ValueError:
            return value
        if int in bases and as_float.is_integer() and float not in bases:
            try:
                return int(value)
            except ValueError:
                return value
        return as_float if float in bases else value
    if tuple in bases and isinstance(value, list):
        return tuple(value)
    if float in bases and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if int in bases and bool not in bases and isinstance(value, float) and value.is_integer() and float not in bases:
        return int(value)
    if bool in bases and isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if str in bases and isinstance(value, (int, float)) and not isinstance(value, bool) and \
            not ({int, float} & bases):
        return value  # a number where text belongs: reported by check()
    return value


def show(v: Any) -> str:
    """``repr`` cut to 60 characters (for messages)."""
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def describe(tp: Any) -> str:
    """An annotation in words ("an integer", "a mapping", "a string or null"...)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any value"
    if origin in (Union, types.UnionType):
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin is dict or tp is dict:
        return "a mapping"
    if origin in (list, tuple) or tp in (list, tuple):
        return "a list"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def matches(v: Any, tp: Any) -> tuple[str, str] | None:
    """None when ``v`` fits the annotation ``tp``, else ``(where, message)``; ``where`` is "" or the
    ``.key`` / ``[i]`` inside ``v`` that does not fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return None
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        if any(a is not type(None) and matches(v, a) is None for a in args):
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:  # X | None: say what is wrong inside X
            bad = matches(v, inner[0])
            if bad is not None and bad[0]:
                return bad
        return "", f"expected {describe(tp)}, got {show(v)}"
    if origin is dict or tp is dict:
        if not isinstance(v, Mapping):
            return "", f"expected a mapping, got {show(v)}"
        for k, item in v.items() if args else ():
            if (bad := matches(k, args[0])) is not None:
                return "", f"key {show(k)}: {bad[1]}"
            if (bad := matches(item, args[1])) is not None:
                return f".{k}{bad[0]}", bad[1]
        return None
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(v, (list, tuple)):
            return "", f"expected a list, got {show(v)}"
        inner = args[0] if args else None
        for i, item in enumerate(v):
            if inner is not None and inner is not Ellipsis and (bad := matches(item, inner)) is not None:
                return f"[{i}]{bad[0]}", bad[1]
        return None
    ok = {bool: lambda: isinstance(v, bool), int: lambda: _is_int(v), float: lambda: _is_number(v),
          str: lambda: isinstance(v, str)}.get(tp, lambda: not isinstance(tp, type) or isinstance(v, tp))
    if ok():
        return None
    return "", f"expected {describe(tp) if tp in (bool, int, float, str) else tp.__name__}, got {show(v)}"


def _bounds_text(opt: Opt, integer: bool) -> str:
    gt, ge, le = opt.rule("gt"), opt.rule("ge"), opt.rule("le")
    noun = "an integer" if integer else "a number"
    if gt == 0 and ge is None:
        return ("a positive integer" if integer else "a positive number") + (f" <= {le:g}" if le is not None else "")
    if ge is not None and le is not None:
        return f"{noun} between {ge:g} and {le:g}"
    parts = [f"> {gt:g}" if gt is not None else "", f">= {ge:g}" if ge is not None else "",
             f"<= {le:g}" if le is not None else ""]
    return f"{noun} " + " and ".join(p for p in parts if p)


def check_option(opt: Opt, v: Any) -> tuple[str, str] | None:
    """The first problem of value ``v`` for ``opt`` (type, choices, bounds), or None."""
    kinds = _args(opt.type)
    optional = type(None) in kinds
    if v is None and optional:
        return None
    choices, bounded = opt.rule("choices"), any(opt.rule(k) is not None for k in ("gt", "ge", "le"))
    integer = int in kinds and float not in kinds
    if bounded:
        ok_type = _is_int(v) if integer else _is_number(v)
        in_range = ok_type and not ((opt.rule("gt") is not None and v <= opt.rule("gt")) or
                                    (opt.rule("ge") is not None and v < opt.rule("ge")) or
                                    (opt.rule("le") is not None and v > opt.rule("le")))
        if in_range or (choices and v in choices):
            return None
        alt = (" or " + " or ".join(repr(c) for c in choices)) if choices else ""
        hint = ""
        if isinstance(v, str) and not integer:
            try:
                float(v)
                hint = f" (YAML reads {v} as text; write it with a dot, e.g. {float(v)!r})"
            except ValueError:
                pass
        return "", f"expected {_bounds_text(opt, integer)}{alt}{' or null' if optional else ''}, got {show(v)}{hint}"
    if choices:
        if isinstance(v, typing.Hashable) and v in choices and matches(v, opt.type) is None:
            return None
        return "", (f"expected one of {', '.join(str(c) for c in choices)}{' or null' if optional else ''}, "
                    f"got {show(v)}")
    return matches(v, opt.type)


def get(cfg: Any, path: str) -> Any:
    """The value at dotted ``path`` of ``cfg``."""
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check(cfg: Any, custom: Mapping[str, Callable[[Any], list[tuple[str, str]]]] | None = None) -> list[tuple[str, str]]:
    """Every problem of ``cfg`` as ``(option, message)`` in field order: types, choices and bounds of
    each option, then ``custom[path](value)`` (``(suffix, message)`` pairs) where the option's
    generic checks passed."""
    out: list[tuple[str, str]] = []
    for path, opt in options(type(cfg)).items():
        v = get(cfg, path)
        bad = check_option(opt, v)
        if bad is not None:
            out.append((path + bad[0], bad[1]))
        elif custom and path in custom:
            out.extend((path + suffix, msg) for suffix, msg in custom[path](v))
    return out


# ---- building a config -------------------------------------------------------------------------------

def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict of ``cfg`` (tuples as lists): YAML / JSON ready."""
    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v
    return plain(dataclasses.asdict(cfg))


def dump(cfg: Any) -> str:
    """``cfg`` as nested YAML (what ``--print-config`` prints and a run logs)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def _resolve_path(cls: type, dotted: str, legacy: Mapping[str, str]) -> tuple[str, tuple[str, ...]] | None:
    """A user's dotted key -> (option path, keys inside a mapping option), or None if unknown.
    Dashes count as underscores; the first component may be a legacy flat name."""
    opts = options(cls)
    parts = dotted.split(".")
    found = None
    for i in range(len(parts), 0, -1):
        head = ".".join(p.replace("-", "_") for p in parts[:i])
        if head in opts:
            found = head, tuple(parts[i:])
            break
    if found is None and parts[0].replace("-", "_") in legacy:
        found = legacy[parts[0].replace("-", "_")], tuple(parts[1:])
    if found is None:
        return None
    head, rest = found
    if rest and _base(next(k for k in _args(opts[head].type) if k is not type(None))) is not dict:
        return None
    return head, rest


def flatten(data: Mapping[str, Any], cls: type, legacy: Mapping[str, str] | None = None,
            source: str = "config") -> dict[str, Any]:
    """A nested (sections) or flat (legacy names) mapping -> ``{option path: value}``; unknown keys
    raise :class:`ConfigError` naming them and ``source``."""
    legacy = legacy or {}
    secs, out, unknown = sections(cls), {}, []

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for k, v in node.items():
            key = str(k).replace("-", "_")
            path = f"{prefix}.{key}" if prefix else key
            if path in secs and isinstance(v, Mapping):
                walk(v, path)
                continue
            if not prefix and path in legacy:
                path = legacy[path]
            if path in options(cls):
                out[path] = v
            else:
                unknown.append(f"{prefix + '.' if prefix else ''}{k}")

    if not isinstance(data, Mapping):
        raise ConfigError([(source, "expected a mapping of option: value")])
    walk(data, "")
    if unknown:
        raise ConfigError([(source, f"unknown option(s) {unknown}; see --help")])
    return out


#: the most bytes of YAML read at once (a config file, one command-line value)
YAML_MAX_BYTES = 1 << 20
#: the most values a YAML document may stand for, each alias counted at every place it is used: a
#: "billion laughs" document (9 aliases of 9 aliases...: 10**9 values from a few hundred bytes) is
#: refused here, before anything walks it
YAML_MAX_VALUES = 100_000


def _yaml_values(root: yaml.Node, limit: int) -> int | str:
    """The number of values ``root`` expands to (aliases counted at each use, stopping at
    ``limit + 1``), or the reason it cannot be expanded (a recursive alias)."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = [] if isinstance(node, yaml.ScalarNode) else \
            [x for kv in node.value for x in kv] if isinstance(node, yaml.MappingNode) else list(node.value)
        if done:
            on_path.discard(id(node))
            size[id(node)] = min(limit + 1, 1 + sum(size[id(k)] for k in kids))
            continue
        if id(node) in size:
            continue
        if id(node) in on_path:
            return "a recursive alias (an anchor used inside itself)"
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)
        if any(id(k) in on_path for k in kids):
            return "a recursive alias (an anchor used inside itself)"
    return size[id(root)]


def load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)`` within limits: at most :data:`YAML_MAX_BYTES` bytes and
    :data:`YAML_MAX_VALUES` values once aliases are expanded, no recursive alias, no nesting deeper
    than Python's recursion limit. The one YAML reader of this project (config files, ``--set``
    and flag values, ``add-field --config``).

    Raises :class:`ConfigError` ``(where, reason)`` past a limit and ``yaml.YAMLError`` for text
    that is not YAML.
    """
    n = len(text.encode("utf-8", "surrogatepass"))
    if n > YAML_MAX_BYTES:
        raise ConfigError([(where, f"{n} bytes of YAML, more than the {YAML_MAX_BYTES} a config may have")])
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            values = _yaml_values(node, YAML_MAX_VALUES)
            if isinstance(values, str):
                raise ConfigError([(where, f"refused: {values}")])
            if values > YAML_MAX_VALUES:
                raise ConfigError([(where, f"refused: its aliases expand to more than {YAML_MAX_VALUES} values "
                                           "(a YAML alias bomb?); write the values out")])
            return loader.construct_document(node)
        except RecursionError:
            raise ConfigError([(where, "refused: YAML nested too deeply")]) from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML config file as a mapping (read by :func:`load_yaml`); errors name the file."""
    try:
        data = load_yaml(Path(path).read_text(), f"--config {path}")
    except OSError as e:
        raise ConfigError([("--config", f"{path}: {e.strerror or e}")]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([("--config", f"{path}: not UTF-8 text ({e})")]) from None
    except yaml.YAMLError as e:
        raise ConfigError([("--config", f"{path}: not valid YAML ({str(e).splitlines()[0]})")]) from None
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError([(str(path), "expected a mapping of option: value")])
    return data


def parse_set(items: Iterable[str], cls: type, legacy: Mapping[str, str] | None = None) -> list[tuple[str, tuple, Any]]:
    """``["optim.lr=3e-4", "audio_tokenizer.pretrained=/ckpt"]`` -> ``[(path, keys in a mapping,
    text)]``; bad syntax or an unknown option raises :class:`ConfigError`."""
    out, problems = [], []
    for item in items:
        if "=" not in item:
            problems.append(("--set", f"expects key=value, got {item!r}"))
            continue
        dotted, value = item.split("=", 1)
        where = _resolve_path(cls, dotted.strip(), legacy or {})
        if where is None:
            problems.append((dotted, "unknown option; see --help"))
            continue
        out.append((where[0], where[1], value))
    if problems:
        raise ConfigError(problems)
    return out


def apply(cfg: Any, updates: Mapping[str, Any] | Iterable[tuple[str, tuple, Any]], text: bool = False) -> Any:
    """``cfg`` with ``updates`` (``{path: value}`` or :func:`parse_set` triples) applied; values
    are coerced (:func:`coerce`), a mapping option with ``merge`` updates its mapping."""
    opts = options(type(cfg))
    items = updates.items() if isinstance(updates, Mapping) else updates
    values: dict[str, Any] = {}
    for item in items:
        if isinstance(updates, Mapping):
            path, keys, value = item[0], (), item[1]
        else:
            path, keys, value = item
        opt = opts[path]
        current = values.get(path, get(cfg, path))
        if keys:  # --set audio_tokenizer.pretrained=x: into the mapping
            node = dict(current) if isinstance(current, Mapping) else {}
            root = node
            for k in keys[:-1]:
                nxt = node.get(k)
                node[k] = dict(nxt) if isinstance(nxt, Mapping) else {}
                node = node[k]
            node[keys[-1]] = load_yaml(value, ".".join((path,) + keys)) if (text and isinstance(value, str)) else value
            values[path] = root
            continue
        new = coerce(opt, value, text=text)
        if opt.rule("merge") and isinstance(new, Mapping) and isinstance(current, Mapping):
            new = {**current, **new}
        values[path] = new
    return replace(cfg, values)


def replace(cfg: Any, values: Mapping[str, Any]) -> Any:
    """A copy of ``cfg`` with ``{path: value}`` set (sections copied where they change)."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for path, v in values.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = v
        else:
            top[head] = v
    for head, sub in nested.items():
        top[head] = replace(getattr(cfg, head), sub)
    return dataclasses.replace(cfg, **top)


def config_path(explicit: str | None, env_var: str) -> tuple[str | None, str]:
    """The config file to read and why: ``--config FILE`` (``none``: no file), else ``$env_var``
    when set, else none. Never a file of the working directory."""
    if explicit is not None:
        return (None, "--config none") if explicit.lower() == "none" else (explicit, "--config")
    env = os.environ.get(env_var, "")
    if env:
        return (None, f"${env_var}=none") if env.lower() == "none" else (env, f"${env_var}")
    return None, f"no --config and no ${env_var}: the built-in defaults"


# ---- command line ------------------------------------------------------------------------------------

def flag_of(path: str) -> str:
    """``optim.weight_decay`` -> ``--optim.weight-decay``."""
    return "--" + path.replace("_", "-")


def _shown(v: Any) -> str:
    if isinstance(v, tuple):
        return ",".join(map(str, v))
    if isinstance(v, dict):
        return yaml.safe_dump(v, default_flow_style=True).strip() if v else "{}"
    return "null" if v is None else str(v)


def add_flags(parser: argparse.ArgumentParser, cls: type, aliases: Mapping[str, str] | None = None,
              exclude: Iterable[str] = (), titles: Mapping[str, str] | None = None) -> None:
    """One flag per option of ``cls`` (``--section.name``; booleans also ``--no-...``) plus
    ``aliases`` (``{"--lr": "optim.lr"}``) in the same argparse option, grouped by section. Given
    flags land in the namespace under their option path (``vars(ns)["optim.lr"]``)."""
    by_path: dict[str, list[str]] = {}
    for flag, path in (aliases or {}).items():
        by_path.setdefault(path, []).append(flag)
    excluded = set(exclude)
    groups: dict[str, Any] = {}
    no_flag: dict[str, list[str]] = {}
    for path, opt in options(cls).items():
        if path in excluded:
            continue
        sec = opt.section
        if sec not in groups:
            doc = inspect.getdoc(sections(cls)[sec]) if sec else None
            title = (titles or {}).get(sec, f"{sec} options" if sec else "options")
            groups[sec] = parser.add_argument_group(title, doc.splitlines()[0] if doc and sec else None)
        g = groups[sec]
        if not opt.meta.get("flag", True):  # listed in the group's description instead
            no_flag.setdefault(sec, []).append(f"{path}: {opt.doc} (default: {_shown(opt.default)})")
            continue
        flags = [flag_of(path)] + [f for f in by_path.get(path, []) if f != flag_of(path)]
        bounded = any(opt.rule(k) is not None for k in ("gt", "ge", "le"))
        accepted = f"; {_bounds_text(opt, int in _args(opt.type) and float not in _args(opt.type))}" if bounded else ""
        help_ = f"{opt.doc} (default: {_shown(opt.default)}{accepted})".replace("%", "%%")
        kinds = {_base(k) for k in _args(opt.type) if k is not type(None)}
        if kinds == {bool}:
            g.add_argument(*flags, dest=path, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=help_)
        else:
            names = [k.__name__.upper() for k in kinds if isinstance(k, type) and k is not str]
            chosen = list(map(str, opt.rule("choices") or ()))
            if chosen and len(chosen) <= 5:
                metavar = "|".join(names + chosen)
            else:
                metavar = "|".join(names) or "STR"
            metavar = opt.rule("metavar") or metavar
            g.add_argument(*flags, dest=path, default=argparse.SUPPRESS, metavar=metavar, help=help_)
    for sec, lines in no_flag.items():
        head = groups[sec].description or ""
        groups[sec].description = (head + "\n" if head else "") + \
            "Set in the config file or with --set KEY=VALUE / --set KEY.SUBKEY=VALUE:\n" + \
            "\n".join(textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False) for line in lines)


def normalize_argv(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Accept ``--optim.weight_decay`` for ``--optim.weight-decay`` (and the reverse) where only
    one spelling is registered."""
    known = set(parser._option_string_actions)  # noqa: SLF001 - argparse has no public accessor
    out = []
    for tok in argv:
        if tok == "--":
            out.extend(argv[len(out):])
            break
        if tok.startswith("--"):
            name, eq, val = tok.partition("=")
            if name not in known:
                for alt in (name[:2] + name[2:].replace("_", "-"), name[:2] + name[2:].replace("-", "_")):
                    if alt in known:
                        tok = alt + eq + val
                        break
        out.append(tok)
    return out


def given(ns: argparse.Namespace, cls: type) -> dict[str, str]:
    """The option values given as flags, ``{path: text}``."""
    opts = options(cls)
    return {k: v for k, v in vars(ns).items() if k in opts}
