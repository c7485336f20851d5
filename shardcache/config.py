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
import json
import operator
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import yaml
from jsonargparse import (ActionConfigFile, ArgumentParser, DefaultHelpFormatter, Namespace, set_loader,
                          set_parsing_settings)
from jsonargparse.typing import registered_types, restricted_number_type

from shardcache.inputs import NotAFile, check_input, read_input


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


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file as a mapping (read by :func:`load_yaml`); every error names the file."""
    try:  # (a FIFO or device is refused, never waited on: shardcache.inputs)
        data = load_yaml(read_input(path, "--config").decode("utf-8"), f"--config {path}") or {}
    except NotAFile as e:
        raise ConfigError([(f"--config {path}", f"is {e.kind}, not a file: give a regular file")]) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError([(f"--config {path}", " ".join(str(e).split()[:20]))]) from None
    if not isinstance(data, dict):
        raise ConfigError([(f"--config {path}", "expected a mapping of option: value")])
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


def expected(tp: Any) -> str:
    """What an annotation accepts, in words: "an integer > 0 and <= 384000", "one of a, b or null"
    (jsonargparse's own messages name the Python types, a union's every branch on lines of their own)."""
    parts = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType"))\
        else (tp,)
    words, choices, null = [], [], False
    for p in parts:
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
    p = ArgumentParser(prog=prog, description=description, epilog=epilog, exit_on_error=False,
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


def _flag_value(argv: list[str], p: ArgumentParser, key: str) -> tuple[int | None, str | None]:
    """Where the last flag setting option ``key`` stands in ``argv`` and its value as given."""
    action = p._option_string_actions.get("--" + key)  # noqa: SLF001 - argparse's table of flags
    names = set(action.option_strings) if action is not None else {"--" + key}
    for i in range(len(argv) - 1, -1, -1):
        name, eq, val = argv[i].partition("=")
        if name in names:
            nxt = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            return i, val if eq else nxt
    return None, None


def _refuse_special_files(cls: type, args: list[str]) -> None:
    """Raise :class:`ConfigError` when ``--config`` or a section's flag (``--model FILE``: the parser
    reads a section's value as a YAML file) names a FIFO, a device or a socket: reading it would hang
    the command or read without end (:mod:`shardcache.inputs`)."""
    sections = {".".join(k.split(".")[:n]) for k in options(cls) for n in range(1, k.count(".") + 1)}
    for i, tok in enumerate(args):
        name, eq, value = tok[2:].partition("=") if tok.startswith("--") else ("", "", "")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        if (name == "config" or name in sections) and value:
            try:
                check_input(value, f"--{name}")
            except NotAFile as e:
                raise ConfigError([(f"--{name} {value}", f"is {e.kind}, not a file: give a regular file")]) from None
            except (FileNotFoundError, OSError, ValueError):
                pass  # (not a file name: the parser says what it is)


def parse(p: ArgumentParser, cls: type, argv: list[str], env_var: str,
          check: Callable[[Any], list[tuple[str, str]]] | None = None) -> tuple[Any, argparse.Namespace]:
    """``argv`` -> (``cls`` instance, the namespace of the other flags plus ``config_file`` and
    ``config_source``): defaults < the config file < flags in their order. Raises :class:`ConfigError`
    naming every bad flag (jsonargparse stops at the first: each is taken out and the rest parsed again) and
    every problem ``check(config)`` finds in what the rest gives (the rules the annotations cannot say)."""
    args, path, why = _config_first(list(argv), env_var)
    _refuse_special_files(cls, args)
    ns, problems = parse_flags(p, cls, args, path, raise_problems=False)
    cfg, rest = _instantiate(p, cls, ns, path, why)
    problems += check(cfg) if check is not None else []
    if problems:
        raise ConfigError(problems)
    return cfg, rest


def _instantiate(p: ArgumentParser, cls: type, ns: Namespace, path: str | None, why: str) -> tuple[Any, argparse.Namespace]:
    """The ``cls`` instance of a parsed namespace and the namespace of the other flags."""
    hints = typing.get_type_hints(cls)  # a section given a scalar or a list (``data: 3``) fails to instantiate
    if bad := [f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])
               and not isinstance(ns.get(f.name), Namespace)]:
        raise ConfigError([(k, f"expected a mapping of its options, got {ns.get(k)!r}") for k in bad])
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


def parse_flags(p: ArgumentParser, cls: type, args: list[str], path: str | None = None,
                raise_problems: bool = True) -> Any:
    """``p.parse_args(args)``, every bad flag named: jsonargparse stops at the first, so each is taken out
    and the rest parsed again. Raises :class:`ConfigError` (``path``: the config file, named in its errors);
    with ``raise_problems=False`` returns ``(namespace of the rest, problems)`` (raises only when nothing parses)."""
    args, problems = list(args), []
    while True:
        try:
            ns = p.parse_args(args)
        except argparse.ArgumentError as e:
            key, msg = error(p, cls, str(e), args, path)
        except ConfigError as e:  # a flag's value over the YAML limits (load_yaml, jsonargparse's loader)
            key, msg = _failing_value(args), e.problems[0][1]
        else:
            if problems and raise_problems:
                raise ConfigError(problems)
            return ns if raise_problems else (ns, problems)
        problems.append((f"--config {path}" if key == "--config" else key, msg))
        args = [a for a in args if a.partition("=")[0] != "--print_config"]  # no config printed after an error
        i, val = _flag_value(args, p, key)
        if i is None:
            raise ConfigError(problems) from None
        del args[i:i + (2 if "=" not in args[i] and val is not None else 1)]


def _failing_value(args: list[str]) -> str:
    """The option whose value :func:`load_yaml` refuses (the loader does not know whose value it reads)."""
    for i, a in enumerate(args):
        name, eq, val = a.partition("=")
        if name.startswith("--") and (eq or i + 1 < len(args)):
            try:
                load_yaml(val if eq else args[i + 1])
            except ConfigError:
                return name[2:]
            except yaml.YAMLError:
                continue
    return "command line"


def error(p: ArgumentParser, cls: type, text: str, argv: list[str], path: str | None) -> tuple[str, str]:
    """The library's message as ``(option, message)`` on one line. jsonargparse raises ``ArgumentError``
    with text only (no option attribute), so the option is read from the text; for an option of ``cls``
    the message says what the annotation accepts and the value given (from the flag, else the file)."""
    text = " ".join(text.split())
    if u := re.search(r"nrecognized arguments: --?([\w.-]+)|Group '([\w.]+)' does not accept option '(\w+)'|"
                      r"Option '([\w.]+)' is not accepted", text):
        key = u[1] or u[4] or f"{u[2]}.{u[3]}"
        hint = key.replace("-", "_")
        known = hint in options(cls) or "--" + hint in p._option_string_actions  # noqa: SLF001
        return key, "unknown option" + (f"; options are spelled with '_': --{hint}" if known and hint != key
                                        else "; see --help")
    if "Problems parsing config" in text:
        return "--config", re.sub(r".*Problems parsing config: (yaml: )?", "", text)
    if not (m := re.search(r'Parser key "([\w.]+)":? ?(.*)|argument --([\w.]+)(?:/\S+)?: (.*)', text)):
        return "command line", text or "invalid"
    key, msg, opts = m[1] or m[3], m[2] or m[4], options(cls)
    if got := re.match(r"Unable to load config '(.*?)' -", msg):  # --model tts: a section's flag reads a file
        return key, f"expected a YAML file of its options or a mapping (one option: --{key}.OPTION VALUE), got {got[1]!r}"
    action = p._option_string_actions.get("--" + key)  # noqa: SLF001 - a job flag's type: jsonargparse keeps it there
    tp = opts[key][0] if key in opts else getattr(action, "_typehint", None)
    if tp is not None and msg != "expected one argument":
        _, raw = _flag_value(argv, p, key)
        if raw is not None:
            try:
                value = load_yaml(raw) if raw.strip() else raw
            except ConfigError as e:  # over the YAML limits: what jsonargparse's loader refused
                return key, e.problems[0][1]
            except yaml.YAMLError:
                value = raw
        elif path is not None:
            try:
                value = operator.attrgetter(key)(_Attrs(read_yaml(path)))
            except (AttributeError, ConfigError):
                value = "?"
        else:
            value = "?"
        return key, f"expected {expected(tp)}, got {value!r}"
    return key, msg or "invalid"


class _Attrs:
    """A nested mapping read with dotted attribute paths (a config file's value of ``a.b``)."""

    def __init__(self, d: Mapping):
        self._d = d

    def __getattr__(self, k: str) -> Any:
        if not isinstance(self._d, Mapping) or k not in self._d:
            raise AttributeError(k)
        v = self._d[k]
        return _Attrs(v) if isinstance(v, Mapping) else v


def custom_problems(cfg: Any, custom: Mapping[str, Callable[[Any], list[tuple[str, str]]]]) -> list[tuple[str, str]]:
    """``custom[path](value)`` for the options of ``cfg`` that have a rule the annotation cannot say, as
    ``(option + suffix, message)``, in the order of the options."""
    return [(path + suffix, msg) for path in options(type(cfg)) if path in custom
            for suffix, msg in custom[path](operator.attrgetter(path)(cfg))]
