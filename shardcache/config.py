"""One configuration mechanism for both stages: dataclasses of documented options and sections, read by
jsonargparse (config file, a flag per option, the types with their choices (``Literal``) and bounds
(:func:`bounded`), mappings merged from ``--OPTION.KEY VALUE``, ``--help``, ``--print_config``; why not
tyro: docs/configuration.md). Each option also declares its effect on a cache (:class:`Effect`), the one
place stage one derives its identity from (:mod:`precompute.identity`).

What is added here, each because jsonargparse does not do it: the config file as the lowest layer
wherever ``--config`` stands and ``$ENV`` naming one; a bare boolean flag meaning true; a short alias of an
option (train's ``--cache``); every bad flag named at once, each as one line ``option: message`` (exit 2);
a YAML reader with limits."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import operator
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import yaml
from jsonargparse import (ActionConfigFile, ArgumentParser, DefaultHelpFormatter, Namespace, set_loader,
                          set_parsing_settings)
from jsonargparse.typing import registered_types, restricted_number_type

from shardcache.inputs import NotAFile, read_input


class ConfigError(ValueError):
    """One or more invalid options; ``problems`` is ``[(option, message)]``."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        super().__init__("; ".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"{k}: {m}" for k, m in self.problems]

    def report(self, prog: str | None = None) -> int:
        """Write ``[PROG: ]error: option: message`` per problem to stderr; return 2."""
        sys.stderr.writelines(f"{prog + ': ' if prog else ''}error: {line}\n" for line in self.lines())
        return 2


# ---- what an option does to a cache ----------------------------------------------------------------------

#: the kinds of effect (docs/trust.md's option table): what changing the option does to a cache
KINDS = ("bytes", "filter", "batch", "operational", "spec")
#: which rows a ``filter`` decides: rows with audio, rows with images, every row, the reading of the
#: manifest itself (its decision is in the row as read), or the rows a rerun finds no longer in the manifest
SCOPES = ("audio", "image", "row", "read", "rerun")


@dataclasses.dataclass(frozen=True)
class Effect:
    """What changing an option does to a cache, declared with the option (:func:`option`, an encoder's
    ``OPTION_EFFECTS``, a producer's), from which stage one and add-field derive identity:

    * ``bytes``: changes stored bytes. ``via="fingerprint"``: the value itself is in the cache's
      fingerprint (a rerun with another value is refused, ``FingerprintMismatch``); ``via="identity"``:
      through what it loads (a path to weights, a tokenizer), so the encoder's ``describe()`` (weights
      sha256, config, vocabulary) is what the fingerprint holds, not the value.
    * ``filter``: decides which rows are kept; its value is in the digest of every row of ``scope``
      (:data:`SCOPES`), so a rerun re-decides exactly those rows. ``scope="read"``: decided while the
      manifest is read; the row as read is in its digest.
    * ``batch``: how encoder calls are formed and run (batch sizes, chunking, device type): recorded
      when a cache is started and compared on every resume (another policy is refused: on a GPU a
      clip's codes depend on its batch).
    * ``operational``: changes no stored byte and no row's decision (workers, progress, checks).
    * ``spec``: a mapping whose keys are declared by the class it names (an encoder's
      ``OPTION_EFFECTS``, a producer's): :mod:`precompute.identity` walks them.

    ``canonical``: the form the fingerprint records (aliases of one value give one fingerprint).
    """

    kind: str
    via: str = ""
    scope: str = ""
    canonical: Callable[[Any], Any] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS or (self.kind == "filter") != bool(self.scope) or self.scope not in ("", *SCOPES):
            raise ValueError(f"not an effect: {self}")
        if self.kind == "bytes" and self.via not in ("fingerprint", "identity"):
            raise ValueError(f"a bytes effect goes into the fingerprint or the encoder's identity, got {self.via!r}")

    def words(self) -> str:
        """One cell of docs/trust.md's table: the kind and where it goes."""
        return {"bytes": f"bytes (in the {'fingerprint' if self.via == 'fingerprint' else 'encoder identity'})",
                "filter": {"read": "filter (the row as read: in its digest)",
                           "rerun": "filter (rows no longer in the manifest: decided by every rerun)"}.get(
                    self.scope, f"filter ({self.scope} rows: in their digests)"),
                "batch": "batch policy (recorded, compared on resume)", "operational": "operational (no byte)",
                "spec": "per key (below)"}[self.kind]


BYTES = Effect("bytes", via="fingerprint")
IDENTITY = Effect("bytes", via="identity")
BATCH = Effect("batch")
OPERATIONAL = Effect("operational")
SPEC = Effect("spec")


def filter_(scope: str) -> Effect:
    """A ``filter`` effect on the rows of ``scope`` (:data:`SCOPES`)."""
    return Effect("filter", scope=scope)


def option(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,
           effect: Effect | None = None) -> Any:
    """A dataclass field with its :class:`Effect` (stage one's options must declare one; a test walks them).
    Types, choices (``Literal``) and bounds (:func:`bounded`) are the annotation's, checked by jsonargparse
    as the config is read. A mutable default is a ``factory``."""
    return dataclasses.field(default=default, default_factory=factory or dataclasses.MISSING,
                             metadata={"effect": effect})


def effect_of(f: dataclasses.Field) -> Effect | None:
    """The declared :class:`Effect` of a field made by :func:`option` (None: none declared)."""
    return f.metadata.get("effect")


def options(cls: type, prefix: str = "") -> dict[str, tuple[Any, dataclasses.Field]]:
    """Every option of ``cls`` by dotted path -> (annotation, field), sections expanded."""
    out: dict[str, tuple[Any, dataclasses.Field]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(options(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = (hints[f.name], f)
    return out


#: comparison -> its symbol
_SYMBOLS = {"gt": ">", "ge": ">=", "le": "<=", "lt": "<"}
_OPERATORS = {operator.gt: ">", operator.ge: ">=", operator.le: "<=", operator.lt: "<"}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def bounds_text(tp: type) -> str:
    """The bounds of a :func:`bounded` type in words: ``> 0 and <= 384000``."""
    return " and ".join(f"{_OPERATORS[op]} {_num(ref)}" for op, ref in tp._restrictions)


def bounded(tp: type, *, gt: float | None = None, ge: float | None = None, le: float | None = None,
            lt: float | None = None) -> type:
    """``int`` or ``float`` within bounds, as jsonargparse's restricted number type (it checks them as
    the config is read); named by its bounds (``int > 0 and <= 384000``), which ``--help`` shows, unless
    jsonargparse has a name for it already (``ClosedUnitInterval``)."""
    given = {"gt": gt, "ge": ge, "le": le, "lt": lt}
    bounds = [(sym, tp(given[k])) for k, sym in _SYMBOLS.items() if given[k] is not None]
    key = (tuple(sorted(bounds)), tp, "and")  # jsonargparse's registry key of a restricted number type
    if key in registered_types:
        return registered_types[key]
    return restricted_number_type(f"{tp.__name__} " + " and ".join(f"{s} {_num(v)}" for s, v in bounds), tp, bounds)


# ---- YAML, within limits -------------------------------------------------------------------------------

#: the most bytes of YAML read at once, and the most values a document may stand for with each alias
#: counted at every use (a "billion laughs" document is refused before anything walks it)
YAML_MAX_BYTES, YAML_MAX_VALUES = 1 << 20, 100_000
_FLOAT = re.compile(r"^[-+]?(\d[\d_]*)?\.?\d*[eE][-+]?\d+$")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 plus ``1e-4`` read as a number (YAML 1.2 does; 1.1 reads it as text)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _values(doc: Any, limit: int) -> int:
    """How many values ``doc`` stands for, a value reached through several aliases counted at every use (at
    most ``limit + 1``: a recursive alias stands for infinitely many). The loader builds each node once."""
    n, todo = 0, [doc]
    while todo and n <= limit:
        x, n = todo.pop(), n + 1
        todo.extend(x.values() if isinstance(x, dict) else x if isinstance(x, list) else ())
    return n


def load_yaml(text: str, where: str = "yaml") -> Any:
    """``text`` as YAML within :data:`YAML_MAX_BYTES` bytes and :data:`YAML_MAX_VALUES` values once
    aliases are expanded, no nesting deeper than the recursion limit: the one YAML reader of this
    project (config files, flag values, ``add-field --config``). Raises :class:`ConfigError`
    ``(where, reason)`` past a limit and ``yaml.YAMLError`` for text that is not YAML."""
    if (n := len(text.encode("utf-8", "surrogatepass"))) > YAML_MAX_BYTES:
        raise ConfigError([(where, f"{n} bytes of YAML, more than the {YAML_MAX_BYTES} a config may have")])
    try:
        doc = yaml.load(text, _Loader)  # noqa: S506 - a SafeLoader
    except RecursionError:
        raise ConfigError([(where, "refused: YAML nested too deeply")]) from None
    if _values(doc, YAML_MAX_VALUES) > YAML_MAX_VALUES:
        raise ConfigError([(where, f"refused: its aliases expand to more than {YAML_MAX_VALUES} values "
                                   "(a YAML alias bomb or a recursive alias?); write the values out")])
    return doc


def read_yaml(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """A YAML file as a mapping (read by :func:`load_yaml`); every error names ``flag`` and the file."""
    try:  # (a FIFO or device is refused, never waited on: shardcache.inputs)
        data = load_yaml(read_input(path, flag).decode("utf-8"), f"{flag} {path}") or {}
    except NotAFile as e:
        raise ConfigError([(f"{flag} {path}", f"is {e.kind}, not a file: give a regular file")]) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError([(f"{flag} {path}", " ".join(str(e).split()[:20]))]) from None
    if not isinstance(data, dict):
        raise ConfigError([(f"{flag} {path}", "expected a mapping of option: value")])
    return data


set_loader("shardcache", load_yaml, (yaml.YAMLError, ConfigError))
set_parsing_settings(docstring_parse_attribute_docstrings=True)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict of ``cfg`` (tuples as lists): YAML / JSON ready."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def dump(cfg: Any) -> str:
    """``cfg`` as nested YAML (what a run logs)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def changes(cfg: Any, default: Any = None, prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted option, value)`` of every option of ``cfg`` (a config dataclass, or its :func:`to_dict`) that
    differs from ``default`` (the class's defaults), mappings compared key by key (``audio_tokenizer.pretrained``;
    a key the defaults have and ``cfg`` lacks: ``"(removed)"``)."""
    if dataclasses.is_dataclass(cfg):
        cfg, default = to_dict(cfg), to_dict(type(cfg)())
    if not (isinstance(cfg, dict) and isinstance(default, dict)):
        return [] if cfg == default else [(prefix[:-1], cfg)]
    return [c for k in [*default, *(k for k in cfg if k not in default)]
            for c in changes(cfg.get(k, "(removed)"), default.get(k, "(removed)"), f"{prefix}{k}.")]


def changes_line(cfg: Any, limit: int = 400) -> str:
    """One log line naming :func:`changes` (``name=value``, values as compact JSON), cut at about ``limit``
    characters with a count of the rest; ``--print_config`` prints the whole config."""
    parts = [f"{k}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}" for k, v in changes(cfg)]
    n = next((i for i in range(len(parts)) if len(", ".join(parts[:i + 1])) > limit), len(parts)) or 1
    more = f" (+{len(parts) - n} more)" if n < len(parts) else ""
    return f"config, where it differs from the defaults: {', '.join(parts[:n]) or 'nothing'}{more} " \
           "(--print_config prints all of it)"


# ---- the words of an error ------------------------------------------------------------------------------

_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
          tuple: "a list", list: "a list", type(None): "null"}


def _parts(tp: Any) -> tuple:
    """The branches of a union annotation (``int | None``: int, None), else ``(tp,)``."""
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def expected(tp: Any) -> str:
    """What an annotation accepts, in words: "an integer > 0 and <= 384000", "one of a, b or null"
    (jsonargparse's own messages name the Python types, a union's every branch on lines of their own)."""
    words, choices, null = [], [], False
    for p in _parts(tp):
        if p is type(None):
            null = True
        elif typing.get_origin(p) is Literal:
            choices += [str(c) for c in typing.get_args(p)]
        elif hasattr(p, "_restrictions"):  # a bounded() type
            words.append(f"{_WORDS[p._type]} {bounds_text(p)}")
        else:
            words.append(_WORDS.get(typing.get_origin(p) or p, getattr(p, "__name__", str(p))))
    text = " or ".join(words + ([f"one of {', '.join(choices)}"] if choices else []))
    return text + (" or null" if null else "")


# ---- the command line ------------------------------------------------------------------------------------

class HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, the description's line breaks kept (its example commands)."""


def parser(cls: type, prog: str, description: str | None = None, epilog: str | None = None,
           aliases: Mapping[str, str] | None = None) -> ArgumentParser:
    """``--config FILE``, ``--print_config`` and one flag per option of ``cls`` (``aliases``: a short flag ->
    the option it sets, e.g. ``{"--cache": "data.cache"}``); callers add their own job flags. Bad values raise
    ``argparse.ArgumentError`` (see :func:`parse`)."""
    p = ArgumentParser(prog=prog, description=description, epilog=epilog, exit_on_error=False, allow_abbrev=False,
                       parser_mode="shardcache", formatter_class=HelpFormatter,
                       usage="%(prog)s [--config FILE] [--OPTION VALUE ...]")
    p.add_argument("--config", action=ActionConfigFile, help="YAML config file (nested sections); 'none': no file")
    add_options(p, cls)
    actions = p._option_string_actions  # noqa: SLF001 - argparse's table of flags; it has no public one
    for flag, path in (aliases or {}).items():  # argparse adds a second name only when the flag is made
        actions["--" + path].option_strings.append(flag)
        actions[flag] = actions["--" + path]
    return p


def add_options(p: ArgumentParser, cls: type) -> None:
    """A flag per option of ``cls`` (jsonargparse's), a boolean's value optional: jsonargparse gives a bool
    one required value, and a bare ``--flag`` means true."""
    p.add_class_arguments(cls, None)
    for path, (tp, _) in options(cls).items():
        if tp is bool:
            action = p._option_string_actions["--" + path]  # noqa: SLF001 - argparse's table of flags
            action.nargs, action.const = "?", True


def short_help(p: ArgumentParser, paths: Iterable[str], footer: str) -> str:
    """``p``'s help showing only ``--help``, ``--config`` and the options ``paths``, then ``footer``
    (``p``'s other actions lose their help: give it a parser built for this)."""
    for a in p._actions:  # noqa: SLF001 - argparse lists its actions nowhere else
        a.help = a.help if a.dest in {"help", "config", *paths} else argparse.SUPPRESS
    p.epilog = footer
    return p.format_help()


def _config_first(argv: list[str], env_var: str) -> tuple[list[str], str | None, str]:
    """The config file (``--config``, else ``$env_var``; ``none``: none) moved first, so it is the lowest
    layer wherever ``--config`` stands (jsonargparse applies it in place). Returns (argv, the file, why)."""
    out, rest, explicit = [], list(argv), None
    while rest:
        a = rest.pop(0)
        name, eq, val = a.partition("=")
        if name == "--config":
            explicit = val if eq else (rest.pop(0) if rest else "")
        else:
            out.append(a)
    given, why = (explicit, "--config") if explicit is not None else (os.environ.get(env_var, ""), f"${env_var}")
    path = given if given and given.lower() != "none" else None  # "none": no file
    why = why if path else f"{why} none" if given else f"no --config and no ${env_var}: the built-in defaults"
    return (["--config", path] if path else []) + out, path, why


@functools.cache
def _one(tp: Any) -> ArgumentParser:
    """A parser of the one flag ``--v`` of type ``tp``: jsonargparse's rules for what ``tp`` accepts, asked
    value by value, so a refusal is known to be that option's (the library's errors carry text only)."""
    p = ArgumentParser(exit_on_error=False, parser_mode="shardcache")
    p.add_argument("--v", type=tp)
    return p


def refusal(tp: Any, value: Any = None, raw: str | None = None) -> str | None:
    """Why an option of type ``tp`` refuses ``value`` (a file's: YAML already) or ``raw`` (a flag's text, YAML
    unless the type is a string), as ``expected WHAT, got VALUE``; None: it takes it."""
    if raw is not None:
        try:
            value = load_yaml(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        except ConfigError as e:  # over the YAML limits
            return e.problems[0][1]
    try:
        if tp is not Any:
            _one(tp).parse_args([f"--v={raw}"]) if raw is not None else _one(tp).parse_object({"v": value})
    except argparse.ArgumentError:
        return f"expected {expected(tp)}, got {value!r}"
    nullable = tp is Any or type(None) in _parts(tp)  # (jsonargparse takes a file's null for any type)
    return f"expected {expected(tp)}, got null" if raw is None and value is None and not nullable else None


def _sections(cls: type) -> set[str]:
    """The dotted paths of the sections of ``cls`` (``data``, ``precision_tolerance``)."""
    return {".".join(k.split(".")[:n]) for k in options(cls) for n in range(1, k.count(".") + 1)}


def _unknown(p: ArgumentParser | None, cls: type, key: str) -> str:
    hint = key.replace("-", "_")
    known = hint != key and (hint in options(cls) or p is not None and "--" + hint in p._option_string_actions)  # noqa: SLF001
    return "unknown option" + (f"; options are spelled with '_': --{hint}" if known else "; see --help")


def mapping_problems(cls: type, data: Mapping, where: str | None = None, prefix: str = "") -> list[tuple[str, str]]:
    """``(option, message)`` for every key of ``data`` (a config file's mapping, or a section's under
    ``prefix``) that is no option of ``cls`` or whose value its type refuses (``where``: the file, named)."""
    opts, sections, at, out = options(cls), _sections(cls), f" (in {where})" if where else "", []
    for k, v in data.items():
        key = f"{prefix}{k}"
        if key in sections:
            out += mapping_problems(cls, v, where, key + ".") if isinstance(v, Mapping) else [
                (key, f"expected a mapping of its options, got {v!r}{at}")]
        elif key not in opts:
            out.append((key, _unknown(None, cls, key) + at))
        elif why := refusal(opts[key][0], v):
            out.append((key, why + at))
    return out


def _mapping_of(raw: str, flag: str) -> tuple[Mapping | None, str | None]:
    """What a ``--config`` or ``--SECTION`` value stands for: a YAML file (:func:`read_yaml`) or YAML text
    of a mapping; ``(mapping or None, the file as messages name it)``. Raises :class:`ConfigError`."""
    if os.path.lexists(raw):
        return read_yaml(raw, flag), f"{flag} {raw}"
    try:
        data = load_yaml(raw, flag)
    except yaml.YAMLError:
        data = None
    return data if isinstance(data, Mapping) else None, None


def _is_value(tok: str) -> bool:
    """Whether the token after a flag is its value (argparse's rule: not ``-x``; ``-1`` is a number)."""
    try:
        return not tok.startswith("-") or " " in tok or float(tok) is not None
    except ValueError:
        return False


def _key_type(opts: Mapping[str, tuple[Any, dataclasses.Field]], key: str) -> Any:
    """The type of a key inside a mapping option (``model.kwargs.lm``: Any; ``extra_fields.audio_16k``: a
    mapping), None when ``key`` is inside no mapping option."""
    parts = key.split(".")
    head = next((i for i in range(len(parts) - 1, 0, -1) if ".".join(parts[:i]) in opts), None)
    tp = opts[".".join(parts[:head])][0] if head else None
    for _ in parts[head or len(parts):]:
        maps = [] if tp is Any else [t for t in _parts(tp) if typing.get_origin(t) is dict]
        tp = Any if tp is Any else (typing.get_args(maps[0]) or (str, Any))[1] if maps else None
    return tp


def flag_problems(p: ArgumentParser, cls: type, args: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Every flag of ``args`` checked against the options of ``cls`` (or a typed flag of ``p``'s own) before
    jsonargparse reads them: ``(args without the refused flags, [(option, message)])``. A flag's value is
    judged by :func:`refusal`, a section's (``--model FILE``) key by key; other tokens are the parser's."""
    opts, sections, actions = options(cls), _sections(cls), p._option_string_actions  # noqa: SLF001
    keep, problems, i = [], [], 0
    while i < len(args):
        tok, i = args[i], i + 1
        name, eq, raw = tok.partition("=")
        action = actions.get(name)
        dest = action.dest if action is not None else name[2:]
        tp = opts[dest][0] if dest in opts else _key_type(opts, dest) if action is None else \
            getattr(action, "_typehint", None)  # a typed flag of the parser's own: jsonargparse keeps its type there
        if not name.startswith("--") or action is not None and tp is None and dest not in sections:
            keep.append(tok)  # a value, --help, --print_config, an untyped flag of the parser's: its own
            continue
        given = [tok]
        if not eq and i < len(args) and _is_value(args[i]) and (action is None or action.nargs != 0):
            raw, i = args[i], i + 1
            given.append(raw)
        elif not eq:
            raw = None
        if action is None and tp is None:
            why = [(dest, _unknown(p, cls, dest))]
        elif raw is None:
            why = [] if tp is bool or action is not None and action.nargs == 0 else [(dest, "expected one argument")]
        elif action is not None and action.nargs == 0:
            why = [(dest, f"takes no value, got {raw!r}")]
        elif dest in sections:
            try:
                data, where = _mapping_of(raw, "--" + dest)
                why = mapping_problems(cls, data, where, dest + ".") if data is not None else [(dest, (
                    f"expected a YAML file of its options or a mapping (one option: --{dest}.OPTION VALUE), got {raw!r}"))]
            except ConfigError as e:
                why = e.problems
        else:
            why = [(dest, m)] if (m := refusal(tp, raw=raw)) else []
        problems, keep = problems + why, keep + ([] if why else given)
    return keep, problems


def parse(p: ArgumentParser, cls: type, argv: list[str], env_var: str,
          check: Callable[[Any], list[tuple[str, str]]] | None = None) -> tuple[Any, argparse.Namespace]:
    """``argv`` -> (``cls`` instance, the namespace of the other flags plus ``config_file`` and
    ``config_source``): defaults < the config file < flags in their order. The file's keys and every flag
    are checked against the options of ``cls`` first (:func:`mapping_problems`, :func:`flag_problems`);
    raises :class:`ConfigError` naming every problem, with those ``check(config)`` finds in what the
    good flags give (the rules the annotations cannot say)."""
    args, path, why = _config_first(list(argv), env_var)
    try:
        data, where = _mapping_of(path, "--config") if path else ({}, None)
        problems = [(f"--config {path}", "no such file")] if data is None else mapping_problems(cls, data, where)
    except ConfigError as e:
        problems = e.problems
    args, bad = flag_problems(p, cls, args)
    if problems or bad:
        args = [a for a in args if a.partition("=")[0] != "--print_config"]  # no config printed after an error
    if problems:  # a file's problem: the file cannot be read without it
        raise ConfigError(problems + bad)
    cfg, rest = _instantiate(p, cls, parse_flags(p, cls, args, bad), path, why)
    if problems := bad + (check(cfg) if check is not None else []):
        raise ConfigError(problems)
    return cfg, rest


def parse_flags(p: ArgumentParser, cls: type, args: list[str], problems: list[tuple[str, str]] | None = None) -> Namespace:
    """``p.parse_args(args)`` once each flag passed :func:`flag_problems` (``problems``: those found already,
    raised with whatever the parser refuses). Raises :class:`ConfigError`."""
    if problems is None:
        args, problems = flag_problems(p, cls, args)
        if problems:
            raise ConfigError(problems)
    try:
        return p.parse_args(args)
    except argparse.ArgumentError as e:  # what the declarations do not say (a stray value, a flag required)
        raise ConfigError(problems + [("command line", " ".join(str(e).split()))]) from None


def _instantiate(p: ArgumentParser, cls: type, ns: Namespace, path: str | None, why: str) -> tuple[Any, argparse.Namespace]:
    """The ``cls`` instance of a parsed namespace and the namespace of the other flags."""
    init = p.instantiate(ns)
    names = [f.name for f in dataclasses.fields(cls)]
    rest = {k: getattr(init, k) for k in vars(init) if "." not in k and k not in names + ["config"]}
    return plain_numbers(cls(**{n: getattr(init, n) for n in names})), \
        argparse.Namespace(config_file=path, config_source=why, **rest)


def plain_numbers(cfg: Any) -> Any:
    """``cfg`` with every bounded number as a plain ``int`` / ``float`` (jsonargparse keeps the value as an
    instance of the bounded type, a subclass, which then travels into checkpoints: ``torch.load`` with
    ``weights_only`` refuses a class it does not know)."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            plain_numbers(v)
        elif isinstance(v, (int, float)) and type(v) not in (int, float, bool):
            setattr(cfg, f.name, (int if isinstance(v, int) else float)(v))
    return cfg


def custom_problems(cfg: Any, custom: Mapping[str, Callable[[Any], list[tuple[str, str]]]]) -> list[tuple[str, str]]:
    """``custom[path](value)`` for the options of ``cfg`` that have a rule the annotation cannot say, as
    ``(option + suffix, message)``, in the order of the options."""
    return [(path + suffix, msg) for path in options(type(cfg)) if path in custom
            for suffix, msg in custom[path](operator.attrgetter(path)(cfg))]
