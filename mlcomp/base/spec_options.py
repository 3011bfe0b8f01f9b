"""Typed options of ``name{key=value}`` specs: declaration, ranges, conversion, canonical text.

An option is a dataclass field declared with :func:`option`: its default, one line
of help and, for numbers, the range it must lie in.  Each end of the range is open
or closed: ``gt``/``lt`` exclude the bound, ``ge``/``le`` include it (``min``/``max``
are ``ge``/``le``)::

    lr: float = option(0.01, "learning rate", gt=0)                 # (0, inf)
    momentum: float = option(0.0, "momentum factor", ge=0, lt=1)    # [0, 1)
    interval: int = option(2000, "clean steps before growing", ge=1)

The range applies to each item of a list option.  The same check runs when a spec
is parsed (:mod:`mlcomp.base.spec`) and when the dataclass is built in Python
(:func:`check_fields`), so both say the same words::

    >>> Range(gt=0, lt=1).problem(1.0)
    'must be in (0, 1)'
    >>> Range(ge=1).text()
    '>= 1'
    >>> format_value((0.9, 0.999)), format_value(True), format_value("a b")
    ('[0.9,0.999]', 'true', '"a b"')
    >>> convert_value(int | str, "8"), convert_value(int | str, "batches.pt"), type_text(int | str)
    (8, 'batches.pt', 'int or string')
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from mlcomp.base.errors import MlcompError

__all__ = ["OptionInfo", "Range", "check_fields", "convert_value", "format_value", "option", "options_of",
           "type_text"]


def _num(x: float) -> str:
    """``1.0`` → ``1``, ``0.5`` → ``0.5``: bounds read as written."""
    return str(int(x)) if isinstance(x, float) and x.is_integer() and abs(x) < 1e15 else str(x)


@dataclass(frozen=True)
class Range:
    """An interval whose ends are each open (``gt``/``lt``), closed (``ge``/``le``) or absent."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def __post_init__(self) -> None:
        if self.gt is not None and self.ge is not None or self.lt is not None and self.le is not None:
            raise ValueError("give one lower bound (gt or ge) and one upper bound (lt or le)")

    @property
    def low(self) -> float | None:
        return self.gt if self.gt is not None else self.ge

    @property
    def high(self) -> float | None:
        return self.lt if self.lt is not None else self.le

    def __bool__(self) -> bool:
        return self.low is not None or self.high is not None

    def text(self) -> str:
        """``in [0, 1)``, ``> 0``, ``<= 1``; empty when unbounded."""
        low, high = self.low, self.high
        if low is not None and high is not None:
            left, right = "(" if self.gt is not None else "[", ")" if self.lt is not None else "]"
            return f"in {left}{_num(low)}, {_num(high)}{right}"
        if low is not None:
            return f"{'>' if self.gt is not None else '>='} {_num(low)}"
        if high is not None:
            return f"{'<' if self.lt is not None else '<='} {_num(high)}"
        return ""

    def contains(self, value: float) -> bool:
        return not ((self.gt is not None and not value > self.gt) or (self.ge is not None and not value >= self.ge)
                    or (self.lt is not None and not value < self.lt) or (self.le is not None and not value <= self.le))

    def problem(self, value: Any) -> str | None:
        """Why ``value`` (a number, or a list of numbers) is outside, or ``None`` when inside or not a number."""
        items = value if isinstance(value, tuple) else (value,)
        numbers = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if all(self.contains(v) for v in numbers):
            return None
        low, high = self.low, self.high
        if low is not None and high is not None:
            rule = self.text()
        elif low is not None:
            rule = f"{'greater than' if self.gt is not None else 'at least'} {_num(low)}"
        else:
            rule = f"{'less than' if self.lt is not None else 'at most'} {_num(high)}"  # type: ignore[arg-type]
        return f"must have every item {rule}" if isinstance(value, tuple) else f"must be {rule}"


def option(default: Any, help: str, *, gt: float | None = None, ge: float | None = None,  # noqa: A002
           lt: float | None = None, le: float | None = None) -> Any:
    """An option field: its default, its one-line help and, for numbers, its range
    (``gt``/``lt``: open ends, ``ge``/``le``: closed ends)::

        max_group_size: int = option(32, "most nodes in one group", ge=1)
    """
    return field(default=default, metadata={"help": help, "range": Range(gt=gt, ge=ge, lt=lt, le=le)})


@dataclass(frozen=True)
class OptionInfo:
    """One typed option of a spec entry (a pass, an optimizer, a loss-scale mode)."""

    name: str
    type: Any
    default: Any
    help: str = ""
    range: Range = Range()

    def type_text(self) -> str:
        """``float > 0``, ``int in [1, 8]``, ``one of a|b``."""
        return " ".join(t for t in (type_text(self.type), self.range.text()) if t)

    def format_value(self, value: Any) -> str:
        """Canonical spec text for a value of this option."""
        return format_value(value)

    def example(self, owner: str) -> str:
        return f"for example {owner}{{{self.name}={self.format_value(self.default)}}}"

    def convert(self, value: Any, *, owner: str, noun: str, error: type[MlcompError] = MlcompError) -> Any:
        """``value`` (spec text, TOML value or Python value) as this option's type, inside its range;
        ``error`` (what, hint) names the option and its ``noun`` ``owner`` otherwise."""
        try:
            converted = convert_value(self.type, value)
        except (TypeError, ValueError) as exc:
            raise error(f"option {self.name!r} of {noun} {owner!r} expects {self.type_text()}, got {value!r}"
                        + (f" ({exc})" if str(exc) else ""), hint=self.example(owner)) from None
        problem = self.range.problem(converted)
        if problem:
            raise error(f"option {self.name!r} of {noun} {owner!r} {problem}, got {format_value(converted)}",
                        hint=self.example(owner))
        return converted


def options_of(cls: type) -> tuple[OptionInfo, ...]:
    """The :class:`OptionInfo` of every init field of the dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        out.append(OptionInfo(f.name, hints.get(f.name, type(default)), default, f.metadata.get("help", ""),
                              f.metadata.get("range") or Range()))
    return tuple(out)


def check_fields(obj: Any, *, owner: str, noun: str, error: type[MlcompError] = MlcompError,
                 hint: str | None = None) -> None:
    """Refuse a dataclass instance built in Python whose option lies outside its declared range
    (``hint``: what to do; by default an example with the option's default)."""
    for f in dataclasses.fields(obj):
        bounds = f.metadata.get("range")
        problem = bounds.problem(getattr(obj, f.name)) if bounds else None
        if problem:
            raise error(f"option {f.name!r} of {noun} {owner!r} {problem}, got {format_value(getattr(obj, f.name))}",
                        hint=hint or f"for example {owner}{{{f.name}={format_value(f.default)}}}")


# ---------------------------------------------------------------------------
# Types: their text, conversion and canonical form


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _optional_inner(tp: Any) -> Any | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _tuple_items(tp: Any) -> tuple[Any, int | None]:
    """``tuple[float, ...]`` → (float, None); ``tuple[float, float]`` → (float, 2)."""
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis or len(args) == 1:
        return args[0], None
    return args[0], len(args)


def _union(tp: Any) -> tuple[Any, ...]:
    """The members of ``int | str`` (an option that takes either, tried in order); ``()`` for other types."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and _optional_inner(tp) is None:
        return typing.get_args(tp)
    return ()


def type_text(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{type_text(inner)} or none"
    if _union(tp):
        return " or ".join(type_text(t) for t in _union(tp))
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + "|".join(str(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + "|".join(str(m.value) for m in tp)
    if typing.get_origin(tp) is tuple:
        item, count = _tuple_items(tp)
        return f"list of {'' if count is None else f'{count} '}{type_text(item)}"
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _choice(tp: Any, value: Any) -> Any:
    if typing.get_origin(tp) is typing.Literal:
        for c in typing.get_args(tp):
            if value == c or (isinstance(value, str) and str(c) == value):
                return c
        raise ValueError("")
    if isinstance(value, tp):
        return value
    for m in tp:
        if isinstance(value, str) and value.lower() in (str(m.value).lower(), m.name.lower()):
            return m
    raise ValueError("")


def _scalar(tp: Any, value: Any) -> Any:
    if isinstance(value, bool) and tp is not bool or tp is not str and isinstance(value, (list, tuple)):
        raise ValueError("")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
    elif tp is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            return int(value.replace("_", ""))
    elif tp is float:
        if isinstance(value, (int, float, str)):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"unsupported option type {tp!r}")
    raise ValueError("")


def convert_value(tp: Any, value: Any) -> Any:
    """``value`` (text, TOML or Python) as type ``tp``; ``ValueError`` when it is not one."""
    inner = _optional_inner(tp)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return convert_value(inner, value)
    for member in _union(tp):
        try:
            return convert_value(member, value)
        except (TypeError, ValueError):
            continue
    if _union(tp):
        raise ValueError("")
    if typing.get_origin(tp) is typing.Literal or isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _choice(tp, value)
    if typing.get_origin(tp) is tuple:
        item, count = _tuple_items(tp)
        values = value if isinstance(value, (list, tuple)) else [value]
        if count is not None and len(values) != count:
            raise ValueError(f"{len(values)} items")
        return tuple(convert_value(item, v) for v in values)
    return _scalar(tp, value)


def format_value(value: Any) -> str:
    """Canonical spec text of an option value (parsed back to the same value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    text = str(value)
    if text and all(c.isalnum() or c in "._-+/:" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
