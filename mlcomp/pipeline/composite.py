"""Composite passes as data: ``Sequential`` and ``FixedPoint`` over registered passes.

A composite pass (``cleanup``, ``fuse``) keeps its typed options but has no
private loop: :meth:`CompositePass.body` maps the options onto a structure of
child passes, and the pass manager walks that structure itself, so every
instrument (``--verify``, ``--dump-after``, ``--explain``) sees the innermost
pass::

    before (a private loop)                    after (data the manager walks)
    def run(self, graph, ctx):                 def body(self):
        for _ in range(self.max_iterations):       return FixedPoint(Sequential(
            for p in (Simplify(), ...):                Simplify(), FoldConstants(...),
                graph = p.run(graph, ctx).graph        CommonSubexpressionElimination(),
        ...                                            DeadCodeElimination()), self.max_iterations)

A child whose declared ``modes`` do not include the graph's mode is skipped
with a recorded reason (``fold-batchnorm`` inside ``fuse`` on a training
graph); at the top level of a pipeline the manager refuses the same mismatch
up front.  The composite's own result sums its children's numeric stats
(zeros dropped) and adds ``rounds`` for a fixed point.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Union

from mlcomp.base.errors import InputSpecError, MlcompError, PassFailure, VerificationError
from mlcomp.base.spec_options import format_value as _format_value
from mlcomp.ir import Graph
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult

__all__ = ["Step", "Sequential", "FixedPoint", "CompositePass", "Position", "Observer", "execute", "children",
           "walk", "pass_text", "describe"]


@dataclass(frozen=True)
class Step:
    """One child of a composite; ``label`` is the stats key a skipped child is reported under."""

    pass_: Pass
    label: str | None = None

    @property
    def key(self) -> str:
        return self.label or self.pass_.name


@dataclass(frozen=True, init=False)
class Sequential:
    """Children run in order (a nested Sequential is flattened into this one)."""

    steps: tuple["Step | FixedPoint", ...]

    def __init__(self, *steps: "Pass | Step | Sequential | FixedPoint") -> None:
        flat: list[Step | FixedPoint] = []
        for s in steps:
            if isinstance(s, Sequential):
                flat.extend(s.steps)
            elif isinstance(s, (Step, FixedPoint)):
                flat.append(s)
            elif isinstance(s, Pass):
                flat.append(Step(s))
            else:
                raise TypeError(f"a Sequential holds passes, Steps and FixedPoints, not {s!r}")
        object.__setattr__(self, "steps", tuple(flat))


@dataclass(frozen=True)
class FixedPoint:
    """Run ``body`` until a round changes nothing, at most ``max_iterations`` rounds."""

    body: Sequential
    max_iterations: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.body, Sequential):
            object.__setattr__(self, "body", Sequential(self.body))
        if self.max_iterations < 1:
            raise ValueError(f"FixedPoint needs max_iterations >= 1, got {self.max_iterations}")


Body = Union[Sequential, FixedPoint]


class CompositePass(Pass):
    """A pass made of registered passes; subclasses define :meth:`body` from their options."""

    def body(self) -> Body:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        """Run the children without instruments (the pass manager walks them itself)."""
        return execute(self, graph, ctx, Position(self.name, 1, 1), Observer())


# ---------------------------------------------------------------------------
# Where a pass runs


BEFORE_SHOWN = 2     # passes named in "after ...": a position's text stays short whatever the pipeline's length


@dataclass(frozen=True)
class Position:
    """Where a pass runs: its index among its siblings, the fixed-point round, the enclosing composite."""

    name: str
    index: int
    total: int
    before: tuple[str, ...] = ()       # the last BEFORE_SHOWN siblings run before it (a bounded text per pass)
    round: int | None = None
    parent: "Position | None" = None
    segment: str = ""                  # this pass's part of the dump file name

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    @property
    def slug(self) -> str:
        """A unique, stable file-name stem: ``02-fuse``, ``02-fuse.fold-batchnorm``, ``01-cleanup.r2.dce``."""
        if self.parent is None:
            return f"{self.index:02d}-{self.name}"
        return self.parent.slug + "." + (f"r{self.round}." if self.round else "") + (self.segment or self.name)

    @property
    def names(self) -> tuple[str, ...]:
        """Pass names from the top level down to this one (``("fuse", "fold-batchnorm")``)."""
        return (self.parent.names if self.parent else ()) + (self.name,)

    def describe(self) -> str:
        """``pass 2 of 3, after cleanup`` or ``inside fuse, pass 2 of 3, after cleanup; step 1 of 5 of fuse, ...``."""
        more = "…, " if self.index - 1 > len(self.before) else ""      # only the last passes are named
        after = f", after {more}{', '.join(self.before)}" if self.before else ", the first"
        if self.parent is None:
            return f"pass {self.index} of {self.total}{after}"
        rnd = f" in round {self.round}" if self.round else ""
        return (f"inside {self.parent.name}, {self.parent.describe()}; step {self.index} of {self.total} "
                f"of {self.parent.name}{rnd}{after}")


class Observer:
    """What the walker reports to; the pass manager's observer runs instruments and builds records."""

    def enter(self, p: Pass, graph: Graph, ctx: PassContext, at: Position) -> None:
        """``p`` is about to run at ``at``."""

    def leave(self, p: Pass, result: PassResult, at: Position) -> None:
        """``p`` ran at ``at`` (for a composite: after all of its children)."""

    def skip(self, p: Pass, reason: str, graph: Graph, at: Position) -> None:
        """Child ``p`` of a composite does not run on this graph (``reason``: ``"training graph"``)."""

    def failure(self, p: Pass, at: Position, exc: Exception) -> MlcompError:
        """The error to raise when ``p.run`` raised ``exc`` (not a PassFailure)."""
        detail = exc.message if isinstance(exc, MlcompError) else f"{type(exc).__name__}: {exc}"
        return PassFailure(f"pass {p.name!r} ({at.describe()}) failed: {detail.rstrip('.')}",
                           hint="run the passes before it alone (mlcomp compile -p ...) and report the model "
                                "if the failure is not explained above")


# ---------------------------------------------------------------------------
# Running


def execute(p: Pass, graph: Graph, ctx: PassContext, at: Position, observer: Observer) -> PassResult:
    """Run ``p`` (walking its children if it is a composite), reporting every pass to ``observer``."""
    observer.enter(p, graph, ctx, at)
    if isinstance(p, CompositePass):
        result = _run_body(p.body(), graph, ctx, at, observer, None)
    else:
        try:
            result = p.run(graph, ctx)
        except (PassFailure, InputSpecError, VerificationError):
            raise       # already says whose fault it is: the user's data, or a declared accuracy target missed
        except Exception as exc:  # noqa: BLE001 - every other failure is reported the same way
            raise observer.failure(p, at, exc) from exc
    observer.leave(p, result, at)
    return result


def _run_body(body: Body, graph: Graph, ctx: PassContext, owner: Position, observer: Observer,
              rnd: int | None) -> PassResult:
    if isinstance(body, FixedPoint):
        stats: dict[str, Any] = {}
        changed = False
        rounds = 0
        for rounds in range(1, body.max_iterations + 1):
            result = _run_body(body.body, graph, ctx, owner, observer, rounds)
            graph = result.graph
            _merge(stats, result.stats)
            changed |= result.changed
            if not result.changed:
                break
        stats = _nonzero(stats)
        stats["rounds"] = stats.get("rounds", 0) + rounds
        return PassResult(graph, changed, stats)
    stats = {}
    changed = False
    segments = _segments(body)
    for i, step in enumerate(body.steps):
        before = tuple(_step_name(s) for s in body.steps[max(0, i - BEFORE_SHOWN):i])
        if isinstance(step, FixedPoint):
            result = _run_body(step, graph, ctx, owner, observer, rnd)
        else:
            child = step.pass_
            at = Position(child.name, i + 1, len(body.steps), before, rnd, owner, segments[i])
            if graph.mode not in child.modes:
                reason = f"{graph.mode.value} graph"
                observer.skip(child, reason, graph, at)
                stats[step.key] = f"skipped ({reason})"
                continue
            result = execute(child, graph, ctx, at, observer)
        graph = result.graph
        changed |= result.changed
        _merge(stats, result.stats)
    return PassResult(graph, changed, _nonzero(stats))


def _merge(into: dict[str, Any], stats: Any) -> None:
    """Numbers add up; anything else (a skip reason, a table) is replaced by the later value."""
    for k, v in dict(stats).items():
        old = into.get(k)
        numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
        if numeric and isinstance(old, (int, float)) and not isinstance(old, bool):
            into[k] = old + v
        else:
            into[k] = v


def _nonzero(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if v}


def _step_name(step: "Step | FixedPoint") -> str:
    if isinstance(step, Step):
        return step.pass_.name
    return "fixed point of " + "+".join(_step_name(s) for s in step.body.steps)


def _segments(seq: Sequential) -> list[str]:
    """Dump-name segment of each step: its pass name, numbered where a name repeats."""
    names = [_step_name(s) for s in seq.steps]
    counts: dict[str, int] = {}
    seen: dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if counts[n] == 1 else f"{n}-{seen[n]}")
    return out


# ---------------------------------------------------------------------------
# Looking inside without running


def children(body: Body) -> Iterator[Step]:
    """Every direct child step of a composite's body (through fixed points), in order."""
    seq = body.body if isinstance(body, FixedPoint) else body
    for s in seq.steps:
        if isinstance(s, FixedPoint):
            yield from children(s)
        else:
            yield s


def walk(p: Pass, parents: tuple[str, ...] = ()) -> Iterator[tuple[Pass, tuple[str, ...]]]:
    """``p`` and every pass inside it, each with the names of the composites around it."""
    yield p, parents
    if isinstance(p, CompositePass):
        for step in children(p.body()):
            yield from walk(step.pass_, parents + (p.name,))


def pass_text(p: Pass) -> str:
    """Canonical spec text of a pass instance: its name and the options that differ from their defaults."""
    opts = []
    for f in dataclasses.fields(p):  # type: ignore[arg-type]
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        value = getattr(p, f.name)
        if value != default:
            opts.append(f"{f.name}={_format_value(value)}")
    return p.name + ("{" + ",".join(opts) + "}" if opts else "")


def describe(body: Body) -> str:
    """One line for ``mlcomp passes``: ``fixed point (at most 4 rounds) of simplify, cse, dce``."""
    if isinstance(body, FixedPoint):
        return f"fixed point (at most {body.max_iterations} rounds) of " + describe(body.body)
    parts = []
    for s in body.steps:
        if isinstance(s, FixedPoint):
            parts.append("[" + describe(s) + "]")
            continue
        modes = s.pass_.modes
        only = f" ({'/'.join(sorted(m.value for m in modes))} only)" if len(modes) == 1 else ""
        parts.append(pass_text(s.pass_) + only)
    return ", ".join(parts)
