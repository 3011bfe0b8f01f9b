"""Pipelines as data: inline text, TOML files and presets, parsed to one :class:`Pipeline`.

A pipeline is written inline (MLIR style), in a TOML file, or named by a preset;
all three parse to one frozen :class:`Pipeline` checked against the pass
registry::

    >>> Pipeline.parse("cleanup, fuse{min_bytes_saved=4096 max_group_size=16}").spec
    'cleanup,fuse{min_bytes_saved=4096,max_group_size=16}'
    >>> Pipeline.parse("-O2").spec
    'cleanup,fuse,cleanup'

.. code-block:: toml

    target = "cpu"
    [[passes]]
    name = "fuse"
    min_bytes_saved = 4096

:mod:`mlcomp.pipeline.manager` runs a pipeline; this module only parses.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlcomp.base.errors import PipelineSpecError
from mlcomp.pipeline.pass_base import REGISTRY, Pass, PassRegistry, _format_value
from mlcomp.pipeline.presets import PRESET_TABLE, preset_text
from mlcomp.pipeline.target_facts import TargetFacts

__all__ = ["PassSpec", "Pipeline", "PRESETS"]

# Presets are pipelines written the same way as user pipelines (mlcomp.pipeline.presets:
# what each pass is for, and how a preset adapts to a target).
PRESETS: dict[str, str] = {name: preset_text(name) for name in PRESET_TABLE}


# ---------------------------------------------------------------------------
# Pipeline


@dataclass(frozen=True)
class PassSpec:
    """One pass of a pipeline: its name and the options that differ from their defaults."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def text(self) -> str:
        if not self.options:
            return self.name
        return self.name + "{" + ",".join(f"{k}={_format_value(v)}" for k, v in self.options) + "}"

    def build(self, registry: PassRegistry | None = None) -> Pass:
        return (registry or REGISTRY).get(self.name).make(dict(self.options))

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Pipeline:
    """An ordered list of passes (and optionally the target a TOML file names)."""

    passes: tuple[PassSpec, ...] = ()
    target: str | None = None

    @property
    def spec(self) -> str:
        """Canonical text: equal pipelines have equal specs (defaults are left out)."""
        return ",".join(p.text for p in self.passes)

    def __str__(self) -> str:
        return self.spec or "(empty)"

    def __len__(self) -> int:
        return len(self.passes)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def build(self, registry: PassRegistry | None = None) -> list[Pass]:
        return [p.build(registry) for p in self.passes]

    def check_target(self, target: str, registry: PassRegistry | None = None,
                     facts: "TargetFacts | None" = None) -> None:
        """Ask every pass whether ``target`` (a canonical name, and what it declares it builds:
        ``facts``) can run its output; before any capture."""
        for p in self.build(registry):
            p.check_target(target)
            if facts is not None:
                p.check_target_facts(facts)

    # -- construction -----------------------------------------------------
    @classmethod
    def parse(cls, text: str, *, registry: PassRegistry | None = None) -> "Pipeline":
        """Parse inline text (``"cleanup,fuse{min_bytes_saved=0}"``) or a preset (``"-O2"``)."""
        return cls(tuple(_Parser(text, registry or REGISTRY).pipeline()))

    @classmethod
    def preset(cls, name: str, *, registry: PassRegistry | None = None) -> "Pipeline":
        key = _preset_key(name)
        if key is None:
            raise PipelineSpecError(f"unknown preset {name!r}", hint=f"use one of {', '.join(PRESETS)}")
        return cls.parse(PRESETS[key], registry=registry)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], *, registry: PassRegistry | None = None) -> "Pipeline":
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise PipelineSpecError(f"cannot read pipeline file {p}: {exc.strerror or exc}") from None
        return cls.from_toml_text(text, source=str(p), registry=registry)

    @classmethod
    def from_toml_text(cls, text: str, *, source: str = "<toml>",
                       registry: PassRegistry | None = None) -> "Pipeline":
        reg = registry or REGISTRY
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PipelineSpecError(f"pipeline file {source} is not valid TOML: {exc}",
                                    hint="see https://toml.io; passes are [[passes]] tables with a name") from None
        unknown = sorted(set(data) - {"target", "passes", "pipeline"})
        if unknown:
            raise PipelineSpecError(f"pipeline file {source} has unknown top-level key(s) {', '.join(unknown)}",
                                    hint="allowed: target = \"...\", pipeline = \"...\" or [[passes]] tables")
        target = data.get("target")
        if target is not None and not isinstance(target, str):
            raise PipelineSpecError(f"pipeline file {source}: target must be a string, got {target!r}")
        if "pipeline" in data and "passes" in data:
            raise PipelineSpecError(f"pipeline file {source} has both pipeline = \"...\" and [[passes]]",
                                    hint="keep one of them")
        if "pipeline" in data:
            if not isinstance(data["pipeline"], str):
                raise PipelineSpecError(f"pipeline file {source}: pipeline must be a string")
            return cls(cls.parse(data["pipeline"], registry=reg).passes, target)
        specs: list[PassSpec] = []
        tables = data.get("passes", [])
        if not isinstance(tables, list):
            raise PipelineSpecError(f"pipeline file {source}: passes must be an array of tables ([[passes]])")
        for i, table in enumerate(tables, 1):
            if not isinstance(table, dict) or not isinstance(table.get("name"), str):
                raise PipelineSpecError(f"pipeline file {source}: pass #{i} needs name = \"...\"",
                                        hint="write [[passes]] followed by name = \"cleanup\"")
            name = table["name"]
            if _preset_key(name) is not None:
                specs.extend(cls.preset(name, registry=reg).passes)
                continue
            info = reg.get(name)
            given = {info.option(k).name: info.option(k).convert(v, pass_name=name)
                     for k, v in table.items() if k != "name"}
            specs.append(_spec_of(info, given))
        return cls(tuple(specs), target)

    @classmethod
    def coerce(cls, value: "Pipeline | str | os.PathLike[str] | None", *,
               registry: PassRegistry | None = None) -> "Pipeline":
        """A :class:`Pipeline` from a pipeline, inline text, a preset name or a ``.toml`` path."""
        if value is None:
            return cls()
        if isinstance(value, Pipeline):
            return value
        text = os.fspath(value)
        if text.strip().endswith(".toml"):
            return cls.from_toml(text.strip(), registry=registry)
        return cls.parse(text, registry=registry)


def _preset_key(text: str) -> str | None:
    key = text.strip().lstrip("-")
    return key if key in PRESETS else None


def _spec_of(info: Any, given: dict[str, Any]) -> PassSpec:
    """Options in field order, without those equal to their default; the pass is built once so
    checks across options (``Pass.__post_init__``) refuse a bad spec when it is parsed."""
    info.make(given)
    opts = tuple((o.name, given[o.name]) for o in info.options
                 if o.name in given and given[o.name] != o.default)
    return PassSpec(info.name, opts)


class _Parser:
    """``pipeline := item (',' item)*``; ``item := name ['{' key=value ((','|' ') key=value)* '}']``."""

    _STOP = set(",{}=[] \t\r\n\"'")

    def __init__(self, text: str, registry: PassRegistry) -> None:
        self.text = text
        self.i = 0
        self.registry = registry

    def error(self, what: str, at: int | None = None, hint: str | None = None) -> PipelineSpecError:
        at = self.i if at is None else at
        shown = self.text.replace("\n", " ")
        return PipelineSpecError(
            f"bad pipeline spec at column {at + 1}:\n    {shown}\n    {' ' * at}^ {what}",
            hint=hint or "write passes as name or name{key=value,...}, separated by commas "
                         "(see `mlcomp passes`)")

    def ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def pipeline(self) -> list[PassSpec]:
        if _preset_key(self.text) is not None:
            return list(Pipeline.parse(PRESETS[_preset_key(self.text)], registry=self.registry).passes)
        out: list[PassSpec] = []
        self.ws()
        if not self.peek():
            return out
        while True:
            out.extend(self.item())
            self.ws()
            c = self.peek()
            if not c:
                return out
            if c != ",":
                raise self.error(f"expected ',' or the end, found {c!r}")
            self.i += 1
            self.ws()

    def ident(self, what: str) -> tuple[str, int]:
        start = self.i
        while self.i < len(self.text) and (self.text[self.i].isalnum() or self.text[self.i] in "_-."):
            self.i += 1
        if self.i == start:
            found = repr(self.peek()) if self.peek() else "the end"
            raise self.error(f"expected {what}, found {found}")
        return self.text[start:self.i], start

    def item(self) -> list[PassSpec]:
        name, at = self.ident("a pass name")
        if _preset_key(name) is not None:    # a preset inside a list: "-O2,mixed-precision" or "O2,…"
            if self.peek() == "{":
                raise self.error(f"preset {name} takes no options")
            return list(Pipeline.parse(PRESETS[_preset_key(name)], registry=self.registry).passes)
        try:
            info = self.registry.get(name)
        except PipelineSpecError as exc:
            raise self.error(exc.what, at, exc.hint) from None
        self.ws()
        given: dict[str, Any] = {}
        if self.peek() == "{":
            self.i += 1
            self.ws()
            while self.peek() != "}":
                if not self.peek():
                    raise self.error("unterminated '{' (missing '}')")
                key, kat = self.ident("an option name")
                try:
                    opt = info.option(key)
                except PipelineSpecError as exc:
                    raise self.error(exc.what, kat, exc.hint) from None
                if opt.name in given:
                    raise self.error(f"option {key!r} of pass {name!r} is given twice", kat)
                self.ws()
                if self.peek() != "=":
                    raise self.error(f"expected '=' after option name {key!r}")
                self.i += 1
                self.ws()
                vat = self.i
                value = self.value()
                try:
                    given[opt.name] = opt.convert(value, pass_name=name)
                except PipelineSpecError as exc:
                    raise self.error(exc.what, vat, exc.hint) from None
                self.ws()
                if self.peek() == ",":
                    self.i += 1
                    self.ws()
                    if self.peek() == "}":
                        raise self.error("expected an option name after ','")
            self.i += 1
        return [_spec_of(info, given)]

    def value(self) -> Any:
        c = self.peek()
        if c in ("'", '"'):
            return self.quoted(c)
        if c == "[":
            self.i += 1
            items: list[Any] = []
            self.ws()
            while self.peek() != "]":
                if not self.peek():
                    raise self.error("unterminated '[' (missing ']')")
                items.append(self.value())
                self.ws()
                if self.peek() == ",":
                    self.i += 1
                    self.ws()
            self.i += 1
            return items
        start = self.i
        while self.i < len(self.text) and self.text[self.i] not in self._STOP:
            self.i += 1
        if self.i == start:
            found = repr(c) if c else "the end"
            raise self.error(f"expected a value, found {found}")
        return self.text[start:self.i]

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
