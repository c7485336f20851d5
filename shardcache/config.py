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
import operator
import os
import sys
import types
import typing
from typing import Any, Callable, Literal, Mapping

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, set_loader, set_parsing_settings
from jsonargparse.typing import registered_types, restricted_number_type

from shardcache.helptext import HelpFormatter
from shardcache.yaml_limits import YAMLRefused, load_yaml, read_yaml


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


#: a bound's comparison -> its symbol
_OPERATORS = {operator.gt: ">", operator.ge: ">=", operator.le: "<=", operator.lt: "<"}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def bounded(tp: type, *, gt: float | None = None, ge: float | None = None, le: float | None = None,
            lt: float | None = None) -> type:
    """``int`` or ``float`` within bounds, as jsonargparse's restricted number type (it checks them as
    the config is read); named by its bounds (``int > 0 and <= 384000``), which ``--help`` shows, unless
    jsonargparse has a name for it already (``ClosedUnitInterval``)."""
    bounds = [(sym, tp(v)) for sym, v in ((">", gt), (">=", ge), ("<=", le), ("<", lt)) if v is not None]
    key = (tuple(sorted(bounds)), tp, "and")  # jsonargparse's registry key of a restricted number type
    if key in registered_types:
        return registered_types[key]
    return restricted_number_type(f"{tp.__name__} " + " and ".join(f"{s} {_num(v)}" for s, v in bounds), tp, bounds)


set_loader("shardcache", load_yaml, (yaml.YAMLError, YAMLRefused))
set_parsing_settings(docstring_parse_attribute_docstrings=True)


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict of ``cfg`` (tuples as lists): YAML / JSON ready."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


# ---- the words of an error ------------------------------------------------------------------------------

_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a mapping",
          tuple: "a list", list: "a list", type(None): "null"}


def _parts(tp: Any) -> tuple:
    """The branches of a union annotation (``int | None``: int, None), else ``(tp,)``."""
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def expected(tp: Any) -> str:
    """What an annotation accepts, in words: "an integer > 0 and <= 384000", "one of a, b or null"
    (jsonargparse's own messages name the Python types, a union's every branch on lines of their own)."""
    words, choices = [], []
    for p in _parts(tp):
        if typing.get_origin(p) is Literal:
            choices += [str(c) for c in typing.get_args(p)]
        elif hasattr(p, "_restrictions"):  # a bounded() type: "> 0 and <= 384000"
            words.append(f"{_WORDS[p._type]} " + " and ".join(f"{_OPERATORS[op]} {_num(v)}" for op, v in p._restrictions))
        elif p is not type(None):
            words.append(_WORDS.get(typing.get_origin(p) or p, getattr(p, "__name__", str(p))))
    text = " or ".join(words + ([f"one of {', '.join(choices)}"] if choices else []))
    return text + (" or null" if type(None) in _parts(tp) else "")


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


def _config_first(argv: list[str], env_var: str) -> tuple[list[str], str | None, str]:
    """The config file (``--config``, else ``$env_var``; ``none``: none) moved first, so it is the lowest
    layer wherever ``--config`` stands (jsonargparse applies it in place). Returns (argv, the file, why)."""
    out, rest, explicit = [], iter(argv), None
    for a in rest:
        name, eq, val = a.partition("=")
        if name == "--config":
            explicit = val if eq else next(rest, "")
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
        except YAMLRefused as e:
            return e.reason
    try:
        _one(tp).parse_args([f"--v={raw}"]) if raw is not None else _one(tp).parse_object({"v": value})
    except argparse.ArgumentError:
        return f"expected {expected(tp)}, got {value!r}"
    nullable = tp is Any or type(None) in _parts(tp)  # (jsonargparse takes a file's null for any type)
    return f"expected {expected(tp)}, got null" if raw is None and value is None and not nullable else None


def _unknown(p: ArgumentParser | None, cls: type, key: str) -> str:
    """``unknown option``, naming the spelling with ``_`` where that is an option of ``cls`` or a flag of ``p``."""
    hint = key.replace("-", "_")
    flags = p._option_string_actions if p is not None else {}  # noqa: SLF001 - argparse's table of flags
    known = hint != key and (hint in options(cls) or "--" + hint in flags)
    return "unknown option" + (f"; options are spelled with '_': --{hint}" if known else "; see --help")


def mapping_problems(cls: type, data: Mapping, where: str | None = None, prefix: str = "") -> list[tuple[str, str]]:
    """``(option, message)`` for every key of ``data`` (a config file's mapping, or a section's under
    ``prefix``) that is no option of ``cls`` or whose value its type refuses (``where``: the file, named)."""
    opts, at, out = options(cls), f" (in {where})" if where else "", []
    for k, v in data.items():
        key = f"{prefix}{k}"
        if any(o.startswith(key + ".") for o in opts):  # a section
            out += mapping_problems(cls, v, where, key + ".") if isinstance(v, Mapping) else [
                (key, f"expected a mapping of its options, got {v!r}{at}")]
        elif key not in opts:
            out.append((key, _unknown(None, cls, key) + at))
        elif why := refusal(opts[key][0], v):
            out.append((key, why + at))
    return out


def given_problems(cls: type, raw: str, flag: str, prefix: str, missing: tuple[str, str]) -> list[tuple[str, str]]:
    """The problems of a ``--config`` or ``--SECTION`` value: a YAML file (:func:`read_yaml`) or YAML text of a
    mapping, checked key by key (:func:`mapping_problems`); ``missing`` when it is neither."""
    try:
        if os.path.lexists(raw):
            return mapping_problems(cls, read_yaml(raw, flag), f"{flag} {raw}", prefix)
        data = load_yaml(raw, flag)
    except YAMLRefused as e:
        return [(e.where, e.reason)]
    except yaml.YAMLError:
        data = None
    return mapping_problems(cls, data, None, prefix) if isinstance(data, Mapping) else [missing]


def _key_type(opts: Mapping[str, tuple[Any, dataclasses.Field]], key: str) -> Any:
    """The type of ``key`` inside a mapping option (``model.kwargs.lm``: Any; ``extra_fields.audio_16k``: a
    mapping; a key deeper down: Any), None when it is inside none."""
    for head in (key.rsplit(".", n)[0] for n in range(1, key.count(".") + 1)):
        if maps := [t for t in _parts(opts[head][0]) if typing.get_origin(t) is dict] if head in opts else []:
            return typing.get_args(maps[0])[1] if head.count(".") + 1 == key.count(".") else Any
    return None


def flag_problems(p: ArgumentParser, cls: type, args: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """Every flag of ``args`` checked against the options of ``cls`` (and ``p``'s own typed flags) before
    jsonargparse reads them: a value by :func:`refusal`, a section's (``--model FILE``) key by key. Returns
    ``(args without the refused flags, nor --print_config after one, [(option, message)])``."""
    opts, actions, keep, problems, i = options(cls), p._option_string_actions, [], [], 0  # noqa: SLF001
    while i < len(args):
        name, eq, raw = args[i].partition("=")
        a = actions.get(name)
        key = a.dest if a is not None else name[2:]
        section = a is not None and any(o.startswith(key + ".") for o in opts)
        tp = opts[key][0] if key in opts else _key_type(opts, key) if a is None else \
            getattr(a, "_typehint", None)  # a typed flag of the parser's own: jsonargparse keeps its type there
        if not name.startswith("--") or a is not None and tp is None and not section:
            keep, i = keep + [args[i]], i + 1  # a value, --help, --print_config, an untyped flag: the parser's
            continue
        n = 1 if eq or i + 1 == len(args) or args[i + 1].startswith("--") else 2
        raw = raw if eq else args[i + 1] if n == 2 else None
        if a is None and tp is None:
            why = [(key, _unknown(p, cls, key))]
        elif raw is None:
            why = [] if tp is bool else [(key, "expected one argument")]
        elif section:
            why = given_problems(cls, raw, name, key + ".", (key, "expected a YAML file of its options or a mapping "
                                                                  f"(one option: --{key}.OPTION VALUE), got {raw!r}"))
        else:
            why = [(key, m)] if (m := refusal(tp, raw=raw)) else []
        keep, problems, i = keep + ([] if why else args[i:i + n]), problems + why, i + n
    return [a for a in keep if not problems or a.partition("=")[0] != "--print_config"], problems  # none printed


def parse(p: ArgumentParser, cls: type, argv: list[str], env_var: str,
          check: Callable[[Any], list[tuple[str, str]]] | None = None) -> tuple[Any, argparse.Namespace]:
    """``argv`` -> (``cls`` instance, the namespace of the other flags plus ``config_file`` and ``config_source``):
    defaults < the config file < flags in their order, each checked first (:func:`given_problems`,
    :func:`flag_problems`). Raises :class:`ConfigError` naming every problem, with ``check(config)``'s."""
    args, path, why = _config_first(list(argv), env_var)
    problems = given_problems(cls, path, "--config", "", (f"--config {path}", "no such file")) if path else []
    args, bad = flag_problems(p, cls, args)
    if problems:  # in the file: it cannot be read without them
        raise ConfigError(problems + bad)
    init = p.instantiate(parse_flags(p, cls, args, bad))
    names = [f.name for f in dataclasses.fields(cls)]
    cfg = plain_numbers(cls(**{n: getattr(init, n) for n in names}))
    if problems := bad + (check(cfg) if check is not None else []):
        raise ConfigError(problems)
    rest = {k: getattr(init, k) for k in vars(init) if "." not in k and k not in names + ["config"]}
    return cfg, argparse.Namespace(config_file=path, config_source=why, **rest)


def parse_flags(p: ArgumentParser, cls: type, args: list[str], problems: list[tuple[str, str]] | None = None) -> Namespace:
    """``p.parse_args(args)`` once each flag passed :func:`flag_problems` (``problems``: those it found already,
    raised with whatever else the parser refuses). Raises :class:`ConfigError`."""
    if problems is None and (problems := flag_problems(p, cls, args)[1]):
        raise ConfigError(problems)
    try:
        return p.parse_args(args)
    except argparse.ArgumentError as e:  # what no declaration says (a stray value, a required flag missing)
        raise ConfigError(problems + [("command line", " ".join(str(e).split()))]) from None


def plain_numbers(cfg: Any) -> Any:
    """``cfg`` with every bounded number as a plain ``int`` / ``float``: jsonargparse keeps an instance of the
    bounded type, which would travel into checkpoints (``torch.load`` with ``weights_only`` refuses it)."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            plain_numbers(v)
        elif isinstance(v, (int, float)) and type(v) not in (int, float, bool):
            setattr(cfg, f.name, (int if isinstance(v, int) else float)(v))
    return cfg
