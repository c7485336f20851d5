"""One configuration mechanism for both stages: dataclasses of documented options and sections, read by
jsonargparse (config file, a flag per option, types, ``--help``; why not tyro: docs/configuration.md). Added
here: :func:`option`'s rules, short flags, ``$ENV`` config files, a YAML reader with limits,
every problem as ``option: message`` (exit 2)."""
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
from typing import Any, Callable, Iterable, Mapping

import yaml
from jsonargparse import (ActionConfigFile, ArgumentParser, DefaultHelpFormatter, Namespace, set_loader,
                          set_parsing_settings)

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


def option(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None,
           choices: Iterable[Any] | None = None, gt: float | None = None, ge: float | None = None,
           le: float | None = None, merge: bool = False) -> Any:
    """A dataclass field with rules: ``choices`` (None is accepted too for an ``X | None`` option),
    bounds ``gt``/``ge``/``le`` of a number, ``merge``: a mapping option whose flags (the whole
    mapping or ``--OPTION.KEY VALUE``) update the file's mapping, values read as YAML, ``{}`` clears
    it. A mutable default is a ``factory``."""
    meta = {"choices": tuple(choices) if choices is not None else None, "gt": gt, "ge": ge, "le": le, "merge": merge}
    return dataclasses.field(default=default, default_factory=factory or dataclasses.MISSING, metadata=meta)


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
    """``cfg`` as nested YAML: what ``--print-config`` prints and a run logs."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


# ---- checks the annotations cannot say -------------------------------------------------------------------

_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "dict": "a mapping",
          "tuple": "a list", "list": "a list", "NoneType": "null", "None": "null"}
#: the bounds of :func:`option`: name -> (symbol, test a value passes)
_BOUNDS = {"gt": (">", operator.gt), "ge": (">=", operator.ge), "le": ("<=", operator.le)}


def expected(tp: Any, meta: Mapping[str, Any]) -> str:
    """What an option accepts, in words: "an integer > 0 and <= 384000", "one of a, b or null"."""
    names = [re.match(r"\W*(?:typing\.)?(?:class ')?(\w+)", p).group(1) for p in str(tp).split("|")]
    words = [_WORDS.get(n, n) for n in names if not (meta.get("choices") and n in ("str", "NoneType", "None"))]
    num = lambda x: str(int(x)) if float(x).is_integer() else f"{x:g}"  # noqa: E731
    bounds = [f"{sym} {num(meta[k])}" for k, (sym, _) in _BOUNDS.items() if meta.get(k) is not None]
    text = " or ".join(words) + (" " + " and ".join(bounds) if bounds else "")
    if meta.get("choices"):
        text = (text + " or " if words else "") + "one of " + ", ".join(map(str, meta["choices"]))
    return text + (" or null" if {"NoneType", "None"} & set(names) and meta.get("choices") else "")


def check(cfg: Any, custom: Mapping[str, Callable[[Any], list[tuple[str, str]]]] | None = None) -> list[tuple[str, str]]:
    """Every problem of the declared rules (choices, bounds) as ``(option, message)``, then
    ``custom[path](value)`` (``(suffix, message)`` pairs) where those passed."""
    out = []
    for path, (tp, f) in options(type(cfg)).items():
        v, m = operator.attrgetter(path)(cfg), f.metadata
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        bounded = not number or all(m.get(k) is None or test(v, m[k]) for k, (_, test) in _BOUNDS.items())
        if v is not None and v not in (m.get("choices") or ()) and (not bounded or not number and m.get("choices")):
            out.append((path, f"expected {expected(tp, m)}, got {v!r}"))
        elif custom and path in custom:
            out.extend((path + suffix, msg) for suffix, msg in custom[path](v))
    return out


# ---- the command line ------------------------------------------------------------------------------------

class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, the description's line breaks kept (its example commands)."""


def parser(cls: type, prog: str, description: str | None = None, epilog: str | None = None) -> ArgumentParser:
    """``--config FILE`` and one flag per option of ``cls``; callers add their own job flags. Bad values
    raise ``argparse.ArgumentError`` (see :func:`parse`)."""
    p = ArgumentParser(prog=prog, description=description, epilog=epilog, exit_on_error=False,
                       parser_mode="shardcache", formatter_class=_HelpFormatter,
                       usage="%(prog)s [--config FILE] [--OPTION VALUE ...]")
    p.add_argument("--config", action=ActionConfigFile, help="YAML config file (nested sections); 'none': no file")
    p.add_class_arguments(cls, None)
    return p


def short_help(p: ArgumentParser, paths: Iterable[str], footer: str) -> str:
    """``p``'s help showing only ``--help``, ``--config`` and the options ``paths``, then ``footer``
    (``p``'s other actions lose their help: give it a parser built for this)."""
    for a in p._actions:  # noqa: SLF001 - argparse lists its actions nowhere else
        a.help = a.help if a.dest in {"help", "config", *paths} else argparse.SUPPRESS
    p.epilog = footer
    return p.format_help()


def _argv(cls: type, argv: list[str], env_var: str, aliases: dict[str, str]) -> tuple[list[str], list, str | None, str]:
    """Short flags as the library's flags; dashes in option names as underscores; a
    boolean without a value (``--lora.enabled``, ``--no-metrics.progress``); the config file
    (``--config``, else ``$env_var``; ``none``: none) first. The flags of a ``merge`` option are taken out, as
    ``(option, mapping read as YAML)`` in their order. Returns (argv, merges, the file, why)."""
    opts, out, merges, rest, explicit = options(cls), [], [], list(argv), None
    while rest:
        name, eq, val = rest.pop(0).partition("=")
        name = aliases.get(name, name)
        dotted = name[2:].replace("-", "_")
        if name == "--config":
            explicit = val if eq else (rest.pop(0) if rest else "")
            continue
        if dotted.startswith("no_") and opts.get(dotted[3:], (None,))[0] is bool and not eq:
            dotted, eq, val = dotted[3:], "=", "false"
        elif opts.get(dotted, (None,))[0] is bool and not eq and (not rest or rest[0].startswith("--")):
            eq, val = "=", "true"
        whole, key = (dotted, None) if dotted in opts else (dotted.rpartition(".")[0], dotted.rpartition(".")[2])
        if name.startswith("--") and whole in opts:
            if opts[whole][1].metadata.get("merge"):
                value = load_yaml(val if eq else (rest.pop(0) if rest else ""), dotted)
                merges.append((whole, value if key is None else {key: value}))
                continue
            name = "--" + dotted
        out.append(name + (eq + val if eq else ""))
    given, why = (explicit, "--config") if explicit is not None else (os.environ.get(env_var, ""), f"${env_var}")
    path = given if given and given.lower() != "none" else None  # "none": no file
    why = why if path else f"{why} none" if given else f"no --config and no ${env_var}: the built-in defaults"
    return (["--config", path] if path else []) + out, merges, path, why


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
          aliases: dict[str, str] | None = None) -> tuple[Any, argparse.Namespace]:
    """``argv`` -> (``cls`` instance, the namespace of the other flags plus ``config_file`` and
    ``config_source``): defaults < the config file < flags in their order. Raises
    :class:`ConfigError` naming the option."""
    args, merges, path, why = _argv(cls, list(argv), env_var, aliases or {})
    _refuse_special_files(cls, args)
    try:
        ns = p.parse_args(args)
        hints = typing.get_type_hints(cls)  # a section given a scalar or a list (``data: 3``) fails to instantiate
        if bad := [f.name for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])
                   and not isinstance(ns.get(f.name), Namespace)]:
            raise ConfigError([(k, f"expected a mapping of its options, got {ns.get(k)!r}") for k in bad])
        init = p.instantiate(ns)
    except argparse.ArgumentError as e:
        err = error(cls, str(e))
        raise ConfigError([(f"--config {path}" if k == "--config" else k, m) for k, m in err.problems]) from None
    names = [f.name for f in dataclasses.fields(cls)]
    rest = {k: getattr(init, k) for k in vars(init) if "." not in k and k not in names + ["config"]}
    cfg = cls(**{n: getattr(init, n) for n in names})
    for opt, value in merges:
        if not isinstance(value, dict):
            raise ConfigError([(opt, f"expected a mapping, got {value!r}")])
        mapping = operator.attrgetter(opt)(cfg)
        mapping.update(value) if value else mapping.clear()
    return cfg, argparse.Namespace(config_file=path, config_source=why, **rest)


def error(cls: type, text: str) -> ConfigError:
    """The library's message as ``option: message``."""
    text = " ".join(text.split())
    if u := re.search(r"nrecognized arguments: --?([\w.-]+)|Option '([\w.]+)' is not accepted|"
                      r"Group '([\w.]+)' does not accept option '(\w+)'", text):
        return ConfigError([(u[1] or u[2] or f"{u[3]}.{u[4]}", "unknown option; see --help")])
    if "Problems parsing config" in text:
        return ConfigError([("--config", re.sub(r".*Problems parsing config: (yaml: )?", "", text))])
    if not (m := re.search(r'Parser key "([\w.]+)":? ?(.*)|argument --([\w.]+)(?:/\S+)?: (.*)', text)):
        return ConfigError([("command line", text or "invalid")])
    key, msg, opts = m[1] or m[3], m[2] or m[4], options(cls)
    if key in opts and (got := re.search(r"(?:Got|Given) value: (.*?)(?:$| - )", msg)):
        msg = f"expected {expected(opts[key][0], opts[key][1].metadata)}, got {got[1]!r}"
    elif got := re.match(r"Unable to load config '(.*?)' -", msg):  # --model tts: a section's flag reads a file
        msg = f"expected a YAML file of its options or a mapping (one option: --{key}.OPTION VALUE), got {got[1]!r}"
    return ConfigError([(key, msg or "invalid")])
