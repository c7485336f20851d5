"""One configuration mechanism for both stages: dataclasses of documented options and sections, read by
jsonargparse (a config file, a flag per option, the types with their choices (``Literal``) and bounds
(:func:`bounded`), mappings merged from ``--OPTION.KEY VALUE``, ``--help``, ``--print_config``; why not
tyro: docs/configuration.md). Added here, each because jsonargparse does not do it: the config file as the
lowest layer wherever ``--config`` stands, ``$ENV`` naming one; a bare boolean flag meaning true; short aliases
(train's ``--cache``); every key of the file and every flag checked against the declared options before the
library reads them, each bad one named on a line ``option: message`` (exit 2)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import types
import typing
from typing import Any, Callable, Literal, Mapping

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, set_loader, set_parsing_settings
from jsonargparse.typing import registered_types, restricted_number_type

from shardcache.helptext import HelpFormatter
from shardcache.yaml_limits import YAMLRefused, load_yaml, read_yaml


class ConfigError(ValueError):
    """One or more invalid options; ``problems`` is ``[(option, message)]``."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = list(problems)
        super().__init__("; ".join(self.lines()))

    def lines(self) -> list[str]:
        """Each problem as ``option: message``."""
        return [f"{k}: {m}" for k, m in self.problems]

    def report(self, prog: str | None = None) -> int:
        """Write ``[PROG: ]error: option: message`` per problem to stderr; return 2."""
        sys.stderr.writelines(f"{prog + ': ' if prog else ''}error: {line}\n" for line in self.lines())
        return 2


def option(default: Any = dataclasses.MISSING, *, factory: Callable[[], Any] | None = None, effect: Any = None) -> Any:
    """A dataclass field with its ``effect`` on a cache (stage one's options must declare one,
    :class:`precompute.effects.Effect`; a test walks them); types, choices (``Literal``) and bounds
    (:func:`bounded`) are the annotation's. A mutable default is a ``factory``."""
    return dataclasses.field(default=default, default_factory=factory or dataclasses.MISSING,
                             metadata={"effect": effect})


def effect_of(f: dataclasses.Field) -> Any:
    """The declared ``effect`` of a field made by :func:`option` (None: none declared)."""
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


#: a type in words (a message's "expected ...")
_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
          tuple: "a list", list: "a list"}
#: each :func:`bounded` type in words: "an integer > 0 and <= 384000"
_BOUNDED: dict[type, str] = {}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def bounded(tp: type, *, gt: float | None = None, ge: float | None = None, le: float | None = None,
            lt: float | None = None) -> type:
    """``int`` or ``float`` within bounds, as jsonargparse's restricted number type (it checks them as
    the config is read); named by its bounds (``int > 0 and <= 384000``), which ``--help`` shows, unless
    jsonargparse has a name for it already (``ClosedUnitInterval``)."""
    bounds = [(sym, tp(v)) for sym, v in ((">", gt), (">=", ge), ("<=", le), ("<", lt)) if v is not None]
    text = " and ".join(f"{s} {_num(v)}" for s, v in bounds)
    key = (tuple(sorted(bounds)), tp, "and")  # jsonargparse's registry key of a restricted number type
    out = registered_types.get(key) or restricted_number_type(f"{tp.__name__} {text}", tp, bounds)
    _BOUNDED[out] = f"{_WORDS[tp]} {text}"
    return out


set_loader("shardcache", load_yaml, (yaml.YAMLError, YAMLRefused))
set_parsing_settings(docstring_parse_attribute_docstrings=True)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict of ``cfg`` (tuples as lists): YAML / JSON ready."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def _parts(tp: Any) -> tuple:
    """The branches of a union annotation (``int | None``: int, None), else ``(tp,)``."""
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def expected(tp: Any) -> str:
    """What an annotation accepts, in words: "an integer > 0 and <= 384000", "one of a, b or null"
    (jsonargparse's own messages name the Python types, a union's every branch on lines of their own)."""
    parts = _parts(tp)
    choices = [str(c) for p in parts if typing.get_origin(p) is Literal for c in typing.get_args(p)]
    words = [_BOUNDED.get(p) or _WORDS.get(typing.get_origin(p) or p, str(p)) for p in parts
             if typing.get_origin(p) is not Literal and p is not type(None)]
    text = " or ".join(words + ([f"one of {', '.join(choices)}"] if choices else []))
    return text + (" or null" if type(None) in parts else "")


# ---- the command line ------------------------------------------------------------------------------------

def parser(cls: type, prog: str, description: str | None = None, epilog: str | None = None,
           aliases: Mapping[str, str] | None = None) -> ArgumentParser:
    """``--config FILE``, ``--print_config`` and one flag per option of ``cls`` (``aliases``: a short flag ->
    the option it sets, e.g. ``{"--cache": "data.cache"}``); callers add their own job flags."""
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


@functools.cache
def _one(tp: Any) -> ArgumentParser:
    """A parser of the one flag ``--v`` of type ``tp``: jsonargparse's rules for what ``tp`` accepts, asked
    value by value, so a refusal is known to be that option's (the library's errors carry text only)."""
    p = ArgumentParser(exit_on_error=False, parser_mode="shardcache")
    p.add_argument("--v", type=tp)
    return p


def refusal(tp: Any, value: Any, flag: bool = False) -> str | None:
    """Why an option of type ``tp`` refuses ``value`` (a flag's text when ``flag``, read as jsonargparse reads a
    flag; else YAML data: a file's), as ``expected WHAT, got VALUE``; None: it takes it."""
    if not flag and value is None:  # (jsonargparse takes a file's null for any type)
        return None if tp is Any or type(None) in _parts(tp) else f"expected {expected(tp)}, got null"
    try:
        shown = load_yaml(value) if flag and value.strip() else value
    except yaml.YAMLError:
        shown = value
    except YAMLRefused as e:
        return e.reason
    try:
        _one(tp).parse_args([f"--v={value}"]) if flag else _one(tp).parse_object({"v": value})
    except argparse.ArgumentError:
        return f"expected {expected(tp)}, got {shown!r}"
    return None


def _type(cls: type, key: str) -> Any:
    """The annotation of ``key`` in ``cls`` (``""``: ``cls`` itself): an option's, a section's (a dataclass), a
    mapping option's key's (``extra_fields.audio_16k``: the mapping's value type); None: no such option."""
    tp = cls
    for name in key.split(".") if key else ():
        if dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(name)
        elif tp is not Any:
            maps = [t for t in _parts(tp) if typing.get_origin(t) is dict]
            tp = typing.get_args(maps[0])[1] if maps else None
        if tp is None:
            return None
    return tp


def _check(p: ArgumentParser, cls: type, key: str, value: Any, where: str | None = None, flag: str | None = None,
           tp: Any = None) -> list[tuple[str, str]]:
    """``(option, message)`` for every problem of ``key`` (an option of ``cls``, a mapping option's key, a section;
    ``""``: the whole config) given ``value``: a flag's text (``flag``: the flag; None: none followed it),
    else YAML data (a file's: ``where`` names it). A section takes a mapping of its options (from a flag: or
    a YAML file of them), checked key by key; ``tp``: the type of a flag of the job's own."""
    tp, at = tp or _type(cls, key), f" (in {where})" if where else ""
    if tp is None:
        hint = "--" + key.replace("-", "_")
        known = hint != "--" + key and hint in p._option_string_actions  # noqa: SLF001 - argparse's table of flags
        return [(key, "unknown option" + (f"; options are spelled with '_': {hint}" if known else "; see --help") + at)]
    if flag and value is None:
        return [] if tp is bool else [(key, "expected one argument")]
    if dataclasses.is_dataclass(tp) and flag:  # a YAML file, else YAML text of a mapping
        is_file = os.path.lexists(value)
        try:
            data = read_yaml(value, flag) if is_file else load_yaml(value, flag)
        except YAMLRefused as e:
            return [(e.where, e.reason)]
        except yaml.YAMLError:
            data = None
        if isinstance(data, Mapping):
            return _check(p, cls, key, data, f"{flag} {value}" if is_file else None)
        return [(key, f"expected a YAML file of its options or a mapping (one option: --{key}.OPTION VALUE), got "
                      f"{value!r}") if key else (f"{flag} {value}", "no such file")]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            return [(key, f"expected a mapping of its options, got {value!r}{at}")]
        return [x for k, v in value.items() for x in _check(p, cls, f"{key}.{k}" if key else str(k), v, where)]
    why = refusal(tp, value, flag is not None)
    return [(key, why + at)] if why else []


def flag_problems(p: ArgumentParser, cls: type, args: list[str]) -> tuple[list[str], list[tuple[str, str]], str | None]:
    """Every flag of ``args`` checked by :func:`_check` before jsonargparse reads them (of the job's own flags,
    the typed ones: ``--storage_options``; ``--manifest``, ``--print_config``... are the parser's). Returns
    ``(args without the refused flags, nor --print_config after one, nor --config, [(option, message)],
    the value of the last --config (None: no --config))``."""
    actions, keep, problems, given, i = p._option_string_actions, [], [], None, 0  # noqa: SLF001 - argparse's
    while i < len(args):
        name, eq, raw = args[i].partition("=")
        a = actions.get(name)
        key = a.dest if a is not None else name[2:]
        tp = _type(cls, key) if name.startswith("--") and key else None
        if tp is None and a is not None:  # a typed flag of the job's own: jsonargparse keeps its type there
            tp = getattr(a, "_typehint", None)
        n = 1 if eq or i + 1 == len(args) or args[i + 1].startswith("--") else 2
        value = raw if eq else args[i + 1] if n == 2 else None
        if isinstance(a, ActionConfigFile):  # the config file: parse's
            given = value or ""
        elif tp is None and (a is not None or not name.startswith("--") or not key):  # a value, a flag of the job
            keep, n = keep + [args[i]], 1
        elif why := _check(p, cls, key, value, flag=name, tp=tp):
            problems += why
        else:
            keep += args[i:i + n]
        i += n
    return [a for a in keep if not problems or a.partition("=")[0] != "--print_config"], problems, given


def parse(p: ArgumentParser, cls: type, argv: list[str], env_var: str = "",
          check: Callable[[Any], list[tuple[str, str]]] | None = None) -> tuple[Any, argparse.Namespace]:
    """``argv`` -> (``cls`` instance, the namespace of the other flags plus ``config_file`` and ``config_source``):
    defaults < the config file (the last ``--config``, else ``$env_var``; ``none``: none) < flags in their order,
    each checked first (:func:`_check`). The file is moved first, so it is the lowest layer wherever ``--config``
    stands (jsonargparse applies it in place). Raises :class:`ConfigError` naming every problem, with
    ``check(config)``'s."""
    args, bad, given = flag_problems(p, cls, list(argv))
    given, why = (given, "--config") if given is not None else (os.environ.get(env_var, ""), f"${env_var}")
    path = given if given and given.lower() != "none" else None  # "none": no file
    why = why if path else f"{why} none" if given else f"no --config and no ${env_var}: the built-in defaults"
    if problems := _check(p, cls, "", path, flag="--config") if path else []:
        raise ConfigError(problems + bad)  # in the file: it cannot be read without them
    try:
        ns = p.parse_args((["--config", path] if path else []) + args)
    except argparse.ArgumentError as e:  # what no declaration says (a stray value, a required flag missing)
        raise ConfigError(bad + [("command line", " ".join(str(e).split()))]) from None
    init, names = p.instantiate(ns), [f.name for f in dataclasses.fields(cls)]
    cfg = cls(**{n: getattr(init, n) for n in names})
    for opt in options(cls):  # jsonargparse keeps a bounded number as its own type: a checkpoint holds plain numbers
        *head, name = opt.split(".")
        section = functools.reduce(getattr, head, cfg)
        if type(v := getattr(section, name)) in _BOUNDED:
            setattr(section, name, (int if isinstance(v, int) else float)(v))
    if problems := bad + (check(cfg) if check is not None else []):
        raise ConfigError(problems)
    rest = {k: getattr(init, k) for k in vars(init) if "." not in k and k not in names + ["config"]}
    return cfg, argparse.Namespace(config_file=path, config_source=why, **rest)
