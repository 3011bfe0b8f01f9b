"""One grammar for every ``name{key=value ...}`` spec: pipelines, optimizers, loss scales.

::

    spec   := item (',' item)*
    item   := name ['{' [option ((','|' ') option)*] '}']
    option := key '=' value
    value  := bare | "quoted" | 'quoted' | '[' [value (',' value)*] ']'     ('(' … ')' where a grammar allows)
    name, key := letters, digits, '_', '-', '.'

A :class:`Grammar` says what its items are called (its ``noun``: ``pass``,
``optimizer``, ``loss-scale mode``), what the whole text is called (``pipeline``,
``optimizer``, ``loss scale``), which error class it raises and how to write one.
Every message uses those words, and every syntax or lookup error points at the
character it is about, on one line: the column, the spec and the text from there,
what is wrong, and what to do (with the closest known name when there is one)::

    bad optimizer spec at column 12 of 'sgd{lr=0.1 momentm=0.9}' (at 'momentm=0.9}'): optimizer 'sgd'
    has no option 'momentm'; did you mean 'momentum'? Its options are: ...

Items are looked up by name (a :class:`SpecTable` of option dataclasses, or the
pass registry), their options converted and range-checked by
:mod:`mlcomp.base.spec_options`, and the entry is built once so checks across
options refuse a bad spec when it is parsed.  The result is a list of
:class:`SpecItem` that keep only the options that differ from their defaults::

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Step:
    ...     size: float = option(1.0, "step size", gt=0)
    >>> table = SpecTable(Grammar("stepper", MlcompError, "write step{size=...}"), {"step": Step})
    >>> [item.text for item in table.parse("step{size=0.5}, step")]
    ['step{size=0.5}', 'step']
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from mlcomp.base.errors import MlcompError
from mlcomp.base.registry import did_you_mean
from mlcomp.base.spec_options import OptionInfo, format_value, option, options_of

__all__ = ["Grammar", "SpecEntry", "SpecItem", "SpecTable", "option"]


@dataclass(frozen=True)
class SpecItem:
    """One parsed item: its name and the options that differ from their defaults (in field order)."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def text(self) -> str:
        if not self.options:
            return self.name
        return self.name + "{" + ",".join(f"{k}={format_value(v)}" for k, v in self.options) + "}"

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Grammar:
    """The words and rules of one kind of spec (see the module docstring)."""

    noun: str                               # one item: "pass"
    error: type[MlcompError]                # raised with (what, hint=)
    hint: str                               # how to write one, shown with syntax errors
    whole: str | None = None                # the whole text: "pipeline" (default: the noun)
    plural: str | None = None               # default: noun + "s" ("es" after an s)
    tuples: bool = False                    # '(' ... ')' is a list too ("betas=(0.9,0.99)")
    fold_case: bool = False                 # names and keys read case-insensitively
    cutoff: float = 0.6                     # closeness for "did you mean"
    macro: str = "preset"                   # what an expanded name is called

    @property
    def nouns(self) -> str:
        return self.plural or self.noun + ("es" if self.noun.endswith("s") else "s")

    @property
    def spec_name(self) -> str:
        return self.whole or self.noun

    # -- messages -------------------------------------------------------------
    def at(self, text: str, at: int, what: str, hint: str | None = None) -> MlcompError:
        """The error for ``what`` at column ``at`` (0-based) of ``text``, on one line: the column, the
        spec, and the text from that column on (up to 12 characters)."""
        rest = text[at:].replace("\n", " ")
        here = f"at {rest[:12] + ('...' if len(rest) > 12 else '')!r}" if rest.strip() else "at the end"
        return self.error(f"bad {self.spec_name} spec at column {at + 1} of {text!r} ({here}): {what}",
                          hint=hint or self.hint)

    def unknown(self, name: str, known: list[str], hint: str | None = None) -> MlcompError:
        close = did_you_mean(name, known, cutoff=self.cutoff)
        return self.error(f"unknown {self.noun} {name!r}" + (f"; did you mean {close!r}?" if close else ".")
                          + f" Known {self.nouns}: {', '.join(known)}", hint=hint or self.hint)

    def one(self, text: str, items: list[SpecItem]) -> SpecItem:
        """The single item of ``items``; an error naming how many ``text`` gave otherwise."""
        if len(items) != 1:
            raise self.error(f"{self.spec_name} spec {text!r} names {len(items)} {self.nouns}; give one",
                             hint=self.hint)
        return items[0]

    # -- parsing --------------------------------------------------------------
    def parse(self, text: str, lookup: Callable[[str], "SpecEntry"], *,
              expand: Callable[[str], list[SpecItem] | None] | None = None) -> list[SpecItem]:
        """``text`` as items, each looked up (``lookup`` raises an :class:`MlcompError` for an unknown
        name); ``expand`` turns a name into items (presets) or returns ``None``."""
        return _Parser(self, text, lookup, expand).items()


@dataclass(frozen=True)
class SpecEntry:
    """A name a spec may use: the dataclass its options build, one-line help, typed options."""

    name: str
    cls: type
    summary: str
    options: tuple[OptionInfo, ...]
    grammar: Grammar = field(compare=False, repr=False)

    @classmethod
    def of(cls, name: str, klass: type, grammar: Grammar) -> "SpecEntry":
        doc = getattr(klass, "summary", None)
        summary = doc() if callable(doc) else (klass.__doc__ or "").strip().split("\n")[0].rstrip(".")
        return cls(name, klass, summary, options_of(klass), grammar)

    def option(self, key: str) -> OptionInfo:
        wanted = key.replace("-", "_")
        for opt in self.options:
            if opt.name == wanted:
                return opt
        close = did_you_mean(wanted, [o.name for o in self.options])
        listing = ", ".join(f"{o.name} ({o.type_text()}, default {o.format_value(o.default)})"
                            for o in self.options) or "none"
        g = self.grammar
        raise g.error(f"{g.noun} {self.name!r} has no option {key!r}"
                      + (f"; did you mean {close!r}?" if close else ".") + f" Its options are: {listing}",
                      hint=g.hint)

    def convert(self, key: str, value: Any) -> tuple[str, Any]:
        """``(field name, value converted and range-checked)`` for option ``key``."""
        opt, g = self.option(key), self.grammar
        try:
            return opt.name, opt.convert(value, owner=self.name, noun=g.noun, error=g.error)
        except MlcompError as exc:     # the option's example, then how to write the whole spec
            raise g.error(exc.what, hint=f"{(exc.hint or '').rstrip('.')}; {g.hint}") from None

    def make(self, options: Mapping[str, Any]) -> Any:
        """The dataclass with ``options`` (already converted) applied."""
        return self.cls(**dict(options))

    def item(self, given: Mapping[str, Any]) -> SpecItem:
        """Options in field order without those equal to their default; built once, so checks across
        options (the dataclass's ``__post_init__``) refuse a bad item now."""
        self.make(given)
        return SpecItem(self.name, tuple((o.name, given[o.name]) for o in self.options
                                         if o.name in given and given[o.name] != o.default))


class SpecTable:
    """A fixed set of entries (name → option dataclass) read by one grammar."""

    def __init__(self, grammar: Grammar, classes: Mapping[str, type]) -> None:
        self.grammar = grammar
        self.entries = {name: SpecEntry.of(name, klass, grammar) for name, klass in classes.items()}

    def get(self, name: str) -> SpecEntry:
        if name not in self.entries:
            raise self.grammar.unknown(name, list(self.entries))
        return self.entries[name]

    def parse(self, text: str) -> list[SpecItem]:
        return self.grammar.parse(text, self.get)

    def parse_one(self, text: str) -> tuple[SpecItem, Any]:
        """The one item ``text`` names, and its built dataclass."""
        item = self.grammar.one(text, self.parse(text))
        return item, self.entries[item.name].make(dict(item.options))


_STOP = frozenset(",{}=[] \t\r\n\"'")
_CLOSE = {"[": "]", "(": ")"}


class _Parser:
    """Recursive descent over one spec text; ``self.i`` is the column being read."""

    def __init__(self, g: Grammar, text: str, lookup: Callable[[str], SpecEntry],
                 expand: Callable[[str], list[SpecItem] | None] | None) -> None:
        self.g, self.text, self.i, self.lookup, self.expand = g, text, 0, lookup, expand
        self.opens = "[(" if g.tuples else "["
        self.stop = _STOP | ({"(", ")"} if g.tuples else set())

    def error(self, what: str, at: int | None = None, hint: str | None = None) -> MlcompError:
        return self.g.at(self.text, self.i if at is None else at, what, hint)

    def ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def found(self) -> str:
        return repr(self.peek()) if self.peek() else "the end"

    def items(self) -> list[SpecItem]:
        out: list[SpecItem] = []
        self.ws()
        if not self.peek():
            return out
        while True:
            out.extend(self.item())
            self.ws()
            if not self.peek():
                return out
            if self.peek() != ",":
                raise self.error(f"expected ',' or the end, found {self.found()}")
            self.i += 1
            self.ws()

    def ident(self, what: str) -> tuple[str, int]:
        start = self.i
        while self.i < len(self.text) and (self.text[self.i].isalnum() or self.text[self.i] in "_-."):
            self.i += 1
        if self.i == start:
            raise self.error(f"expected {what}, found {self.found()}")
        name = self.text[start:self.i]
        return (name.lower() if self.g.fold_case else name), start

    def item(self) -> list[SpecItem]:
        name, at = self.ident(f"a {self.g.noun} name")
        expanded = self.expand(name) if self.expand else None
        if expanded is not None:
            if self.peek() == "{":
                raise self.error(f"{self.g.macro} {name} takes no options")
            return expanded
        try:
            entry = self.lookup(name)
        except MlcompError as exc:
            raise self.error(exc.what, at, exc.hint) from None
        self.ws()
        given: dict[str, Any] = {}
        if self.peek() == "{":
            self.i += 1
            self.options(entry, given)
        try:
            return [entry.item(given)]
        except MlcompError as exc:
            raise self.error(exc.what, at, exc.hint) from None

    def options(self, entry: SpecEntry, given: dict[str, Any]) -> None:
        self.ws()
        while self.peek() != "}":
            if not self.peek():
                raise self.error("unterminated '{' (missing '}')")
            key, kat = self.ident("an option name")
            try:
                opt = entry.option(key)
            except MlcompError as exc:
                raise self.error(exc.what, kat, exc.hint) from None
            if opt.name in given:
                raise self.error(f"option {key!r} of {self.g.noun} {entry.name!r} is given twice", kat)
            self.ws()
            if self.peek() != "=":
                raise self.error(f"expected '=' after option name {key!r}")
            self.i += 1
            self.ws()
            vat = self.i
            value = self.value()
            try:
                given[opt.name] = entry.convert(key, value)[1]
            except MlcompError as exc:
                raise self.error(exc.what, vat, exc.hint) from None
            self.ws()
            if self.peek() == ",":
                self.i += 1
                self.ws()
                if self.peek() == "}":
                    raise self.error("expected an option name after ','")
        self.i += 1

    def value(self) -> Any:
        c = self.peek()
        if c in ("'", '"'):
            return self.quoted(c)
        if c and c in self.opens:
            return self.listed(_CLOSE[c])
        start = self.i
        while self.i < len(self.text) and self.text[self.i] not in self.stop:
            self.i += 1
        if self.i == start:
            raise self.error(f"expected a value, found {self.found()}")
        return self.text[start:self.i]

    def listed(self, close: str) -> list[Any]:
        start = self.i
        self.i += 1
        items: list[Any] = []
        self.ws()
        while self.peek() != close:
            if not self.peek() or self.peek() in "{}":
                raise self.error(f"unterminated {self.text[start]!r} (missing {close!r})", start)
            items.append(self.value())
            self.ws()
            if self.peek() == ",":
                self.i += 1
                self.ws()
        self.i += 1
        return items

    def quoted(self, quote: str) -> str:
        start = self.i
        self.i += 1
        out = []
        while self.i < len(self.text) and self.text[self.i] != quote:
            if self.text[self.i] == "\\" and self.i + 1 < len(self.text):
                self.i += 1
            out.append(self.text[self.i])
            self.i += 1
        if self.i >= len(self.text):
            raise self.error("unterminated string", start)
        self.i += 1
        return "".join(out)
