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

The text is read by the spec grammar of :mod:`mlcomp.base.spec` (noun ``pass``, whole ``pipeline``);
:mod:`mlcomp.pipeline.manager` runs a pipeline; this module only parses.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from mlcomp.base.errors import PipelineSpecError
from mlcomp.base.spec import SpecItem
from mlcomp.pipeline.pass_base import PIPELINE_GRAMMAR, REGISTRY, Pass, PassRegistry
from mlcomp.pipeline.presets import PRESET_TABLE, preset_text
from mlcomp.pipeline.target_facts import TargetFacts

__all__ = ["PassSpec", "Pipeline", "PRESETS"]

# Presets are pipelines written the same way as user pipelines (mlcomp.pipeline.presets:
# what each pass is for, and how a preset adapts to a target).
PRESETS: dict[str, str] = {name: preset_text(name) for name in PRESET_TABLE}


# ---------------------------------------------------------------------------
# Pipeline


@dataclass(frozen=True)
class PassSpec(SpecItem):
    """One pass of a pipeline: its name and the options that differ from their defaults."""

    def build(self, registry: PassRegistry | None = None) -> Pass:
        return (registry or REGISTRY).get(self.name).make(dict(self.options))


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
        reg = registry or REGISTRY

        def expand(name: str) -> list[SpecItem] | None:
            key = _preset_key(name)
            return None if key is None else list(cls.parse(PRESETS[key], registry=reg).passes)

        items = PIPELINE_GRAMMAR.parse(text, reg.get, expand=expand)
        return cls(tuple(p if isinstance(p, PassSpec) else PassSpec(p.name, p.options) for p in items))

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
            given = dict(info.convert(k, v) for k, v in table.items() if k != "name")
            item = info.item(given)
            specs.append(PassSpec(item.name, item.options))
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
