"""What an encoder option takes, declared with what it does to a cache: :class:`Option`.

An encoder class declares each of its spec options once, in its ``OPTION_EFFECTS`` table: the option's
:class:`precompute.effects.Effect` (what changing it does to a cache, :mod:`precompute.identity`) and, in the
same entry, the values it takes (:func:`takes`: a type, bounds, choices, whether null means "the default").
The config check reads those declarations (:func:`precompute.encoders.registry.spec_problems`), so a bad
value (``processes: 0``, ``bucket_s: -1`` or ``.nan``, ``max_batch_size: 0``) stops the job with exit
status 2 naming the option before any model loads or any folder is made, instead of failing in the
constructor minutes later.

Where a bound depends on the checkpoint (``n_quantizers`` at most the model's codebooks), the constructor
still checks it when the model is loaded; the declaration holds what is known before.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

from ..effects import Effect

#: the device spellings every option that names a torch device accepts (the job's ``device`` also takes ``auto``)
DEVICE_PATTERN = re.compile(r"cpu|mps|meta|(cuda|xpu|npu|hpu)(:\d+)?")

#: type -> how it is named in a message
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}


@dataclasses.dataclass(frozen=True)
class Option(Effect):
    """An encoder option's :class:`~precompute.effects.Effect` and the values it takes (see the module docstring).

    Attributes beyond the effect's:
        type: ``int`` (not a bool), ``float`` (an int or a float, finite), ``bool``, ``str`` or ``list``.
        gt, ge, le, lt: bounds of a number.
        choices: the values it takes (after ``type``), or None.
        nullable: null (``None``) is accepted (the constructor's default).
        check: a further rule, ``value -> message or None`` (e.g. a dtype's spelling), run when the rest passed.
    """

    type: type = object
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple | None = None
    nullable: bool = False
    check: Callable[[Any], str | None] | None = dataclasses.field(default=None, compare=False)

    def expected(self) -> str:
        """What it takes, in words: ``an integer >= 1 and <= 64``."""
        what = _NAMES.get(self.type, self.type.__name__)
        if self.choices is not None:
            what = "one of " + ", ".join(map(str, self.choices))
        bounds = [f"{sym} {ref:g}" for sym, ref in ((">", self.gt), (">=", self.ge), ("<=", self.le), ("<", self.lt))
                  if ref is not None]
        return what + (" " + " and ".join(bounds) if bounds else "") + (" (or null)" if self.nullable else "")

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not one this option takes (a message naming the value), or None."""
        if value is None:
            return None if self.nullable else f"expected {self.expected()}, got null"
        number = self.type in (int, float)
        if isinstance(value, bool) and self.type is not bool or not _is(value, self.type):
            return f"expected {self.expected()}, got {value!r}"
        if number and not math.isfinite(value):
            return f"expected {self.expected()}, got {value!r}"
        if self.choices is not None and value not in self.choices:
            return f"expected {self.expected()}, got {value!r}"
        if number:
            for op, ref in ((float.__gt__, self.gt), (float.__ge__, self.ge), (float.__le__, self.le),
                            (float.__lt__, self.lt)):
                if ref is not None and not op(float(value), float(ref)):
                    return f"expected {self.expected()}, got {value!r}"
        return self.check(value) if self.check is not None else None


def _is(value: Any, tp: type) -> bool:
    if tp is float:
        return isinstance(value, (int, float))
    if tp is list:
        return isinstance(value, (list, tuple))
    return tp is object or isinstance(value, tp)


def takes(effect: Effect, type: type, *, gt: float | None = None, ge: float | None = None, le: float | None = None,
          lt: float | None = None, choices: tuple | None = None, nullable: bool = False,
          check: Callable[[Any], str | None] | None = None) -> Option:
    """``effect`` (:data:`precompute.effects.BYTES`, ``BATCH``...) declared with the values the option takes."""
    return Option(effect.kind, effect.via, effect.scope, effect.canonical, type=type, gt=gt, ge=ge, le=le, lt=lt,
                  choices=choices, nullable=nullable, check=check)


def device_problem(value: str) -> str | None:
    """A device option's spelling (:data:`DEVICE_PATTERN`)."""
    return None if DEVICE_PATTERN.fullmatch(value) else f"expected cpu, cuda, cuda:N (or mps, xpu:N...), got {value!r}"


def dtype_problem(value: str) -> str | None:
    """An encoder dtype's spelling (:data:`precompute.encoders._common.ENCODER_DTYPES`)."""
    from ._common import ENCODER_DTYPES
    if value.lower().replace("torch.", "") in ENCODER_DTYPES:
        return None
    return f"expected one of {', '.join(sorted(ENCODER_DTYPES))}, got {value!r}"


def range_problem(value: Any) -> str | None:
    """A pixel range: two finite numbers ``[lo, hi]``, ``lo < hi``."""
    ok = (len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                                  for v in value) and value[0] < value[1])
    return None if ok else f"expected two finite numbers [lo, hi] with lo < hi, got {list(value)!r}"


def problems(spec: dict, table: dict[str, Effect]) -> list[tuple[str, str]]:
    """``(".key", message)`` for each key of ``spec`` whose value its :class:`Option` in ``table`` refuses (keys
    ``table`` declares as a plain :class:`~precompute.effects.Effect` take any value)."""
    out = []
    for key, value in spec.items():
        decl = table.get(key)
        if isinstance(decl, Option) and (why := decl.problem(value)) is not None:
            out.append((f".{key}", why))
    return out


__all__ = ["Option", "takes", "problems", "DEVICE_PATTERN", "device_problem", "dtype_problem", "range_problem"]
