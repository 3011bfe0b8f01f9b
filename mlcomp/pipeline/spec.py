"""Pipelines as data, and the pass manager that runs them with its instruments.

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

``run_pipeline`` runs the passes in order.  The manager, not the passes, owns
the instruments: ``Graph.verify()`` after every pass, timing and stats, IR/dot
dumps (``dump_after``), numerical verification against the input graph with the
first pass and the first node that broke the numbers (``verify``), and a per-pass
diff that points back at module paths (``explain``).
"""
from __future__ import annotations

import os
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from mlcomp.base.errors import IRError, MlcompError, PassFailure, PipelineSpecError
from mlcomp.ir import Graph
from mlcomp.pipeline.instruments import PassDiff, PassRecord, PipelineReport, Reference, dump_graph, snapshot
from mlcomp.pipeline.pass_base import REGISTRY, Pass, PassContext, PassRegistry

__all__ = ["PassSpec", "Pipeline", "PRESETS", "run_pipeline", "PipelineReport", "PassRecord"]

# Presets are pipelines written the same way as user pipelines.
PRESETS: dict[str, str] = {
    "O0": "",
    "O1": "cleanup",
    "O2": "cleanup,fuse,cleanup",
    "O3": "cleanup{fold_max_bytes=16777216},"
          "fuse{max_group_size=128,peak_slack=0.5,tile_min_elements=262144},"
          "cleanup{fold_max_bytes=16777216}",
}


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
        from mlcomp.pipeline.pass_base import _format_value

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
    """Options in field order, without those equal to their default."""
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
        if _preset_key(name) is not None and not name.startswith("-"):
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


# ---------------------------------------------------------------------------
# The pass manager


def run_pipeline(graph: Graph, pipeline: "Pipeline | str | None", *,
                 example_inputs: Sequence[torch.Tensor] | None = None, verify: bool = False,
                 dump_after: str | Iterable[str] | None = None, dump_dir: str | os.PathLike[str] | None = None,
                 explain: bool = False, check_ir: bool = True, tolerance: float | None = None,
                 hardware: Any = None, registry: PassRegistry | None = None) -> tuple[Graph, PipelineReport]:
    """Run ``pipeline`` on a copy of ``graph``; returns the new graph and a :class:`PipelineReport`.

    * ``check_ir``: ``Graph.verify()`` after every pass (a broken graph → :class:`PassFailure`);
    * ``verify``: compare every value with the interpreter on the input graph after each
      pass (on ``example_inputs``, random ones from the input metas if not given); a
      mismatch raises :class:`VerificationError` naming the pass and the first diverging node;
    * ``dump_after``: a pass name, ``"all"`` or several names; writes the IR text and a dot
      file per dumped pass into ``dump_dir``;
    * ``explain``: record a per-pass diff (nodes added/removed, op histogram, groups,
      bytes moved) in the report; ``report.format()`` prints it.
    """
    pipe = Pipeline.coerce(pipeline, registry=registry)
    passes = pipe.build(registry)
    dumps = _dump_selection(pipe, dump_after, dump_dir)
    inputs = tuple(example_inputs) if example_inputs is not None else None
    reference = Reference(graph, inputs, tolerance) if verify else None
    ctx = PassContext(hardware=hardware, example_inputs=inputs or (reference.inputs if reference else None))
    report = PipelineReport(pipe.spec, pipe.target, nodes_before=len(graph))
    work = graph.copy()
    if dumps:
        report.dumps.extend(dump_graph(dump_dir, 0, "input", work))
    start = time.perf_counter()
    for index, (spec, p) in enumerate(zip(pipe.passes, passes), 1):
        before = snapshot(work) if explain else None
        n_before = len(work)
        t0 = time.perf_counter()
        try:
            result = p.run(work, ctx)
        except PassFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is reported the same way
            raise _failure(pipe, index, exc) from exc
        seconds = time.perf_counter() - t0
        new = result.graph
        if check_ir:
            try:
                new.verify()
            except IRError as exc:
                raise PassFailure(
                    f"pass {spec.name!r} ({_position(pipe, index)}) produced an invalid graph: {exc.what}",
                    where=exc.where, hint="this is a bug in the pass; rerun with --dump-after all to see "
                                          "the IR it wrote") from exc
        record = PassRecord(index, spec.name, spec.text, seconds, bool(result.changed), dict(result.stats),
                            n_before, len(new))
        if reference is not None:
            record.max_error = reference.check(new, spec.name, _position(pipe, index))
        if before is not None:
            record.diff = PassDiff.between(before, snapshot(new), result.stats)
        if spec.name in dumps or "all" in dumps:
            report.dumps.extend(dump_graph(dump_dir, index, spec.name, new))
        report.records.append(record)
        work = new
    report.seconds = time.perf_counter() - start
    report.nodes_after = len(work)
    report.verified = reference is not None
    return work, report


def _position(pipe: Pipeline, index: int) -> str:
    before = [p.name for p in pipe.passes[:index - 1]]
    where = f"pass {index} of {len(pipe)}"
    return where + (f", after {', '.join(before)}" if before else ", the first")


def _failure(pipe: Pipeline, index: int, exc: BaseException) -> PassFailure:
    name = pipe.passes[index - 1].name
    detail = exc.message if isinstance(exc, MlcompError) else f"{type(exc).__name__}: {exc}"
    return PassFailure(f"pass {name!r} ({_position(pipe, index)}) failed: {detail.rstrip('.')}",
                       hint="run the passes before it alone (mlcomp compile -p ...) and report the model "
                            "if the failure is not explained above")


def _dump_selection(pipe: Pipeline, dump_after: str | Iterable[str] | None,
                    dump_dir: str | os.PathLike[str] | None) -> set[str]:
    if dump_after is None:
        return set()
    names = {s.strip() for s in (dump_after.split(",") if isinstance(dump_after, str) else dump_after)}
    names.discard("")
    if dump_dir is None:
        raise PipelineSpecError("dump_after needs a dump_dir to write the IR into",
                                hint="pass --dump-dir DIR (or dump_dir=)")
    unknown = sorted(names - set(pipe.names) - {"all"})
    if unknown:
        raise PipelineSpecError(f"--dump-after names {', '.join(unknown)}, which the pipeline "
                                f"{pipe.spec or '(empty)'} does not run",
                                hint="use 'all' or one of: " + ", ".join(dict.fromkeys(pipe.names)))
    return names
