"""Lowering an ExportedProgram to core ATen, op by op when torch's decomposition table fails.

``ep.run_decompositions()`` lowers every op kind at once; one broken
decomposition (a user's ``torch.library`` op whose decomposition raises, or a
decomposition that gives a value other strides than eager so a later ``view``
fails) loses the whole model.  :func:`decompose` instead

1. runs the default table (one run when nothing fails);
2. on a ``view`` stride failure, applies the corrected decomposition we have:
   every ``view`` becomes ``reshape`` (equal wherever the view was legal);
3. if it still fails, bisects over the k op kinds of the program that the
   table would decompose (each probe: the default table minus a prefix of
   them), keeps the op whose decomposition fails undecomposed, and repeats for
   the next culprit: O(log k) runs per culprit.

What was kept, and why, is a :class:`Decomposition` (``kept``: op → reason)::

    run_decompositions() alone: raises "decomposition of mlcomp_t::twice is broken"
    decompose(ep): → (program with addmm, permute, mlcomp_t::twice,
            Decomposition(kept={"mlcomp_t::twice.default": "its decomposition fails:
            RuntimeError: decomposition of mlcomp_t::twice is broken"}, runs=4))
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from mlcomp.frontend.extra_decomps import extra_decompositions

VIEW_FIX = "aten.view.default"
_VIEW_FIX_REASON = ("decomposed values can have other strides than eager's, so a view that was legal in "
                    "eager fails; lowered as reshape (the same value wherever the view was legal)")


@dataclass
class Decomposition:
    """How a program reached core ATen: ops kept undecomposed (op → why) and what it cost."""

    kept: dict[str, str] = field(default_factory=dict)
    runs: int = 0            # run_decompositions calls (1 when nothing failed)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"kept": dict(self.kept), "runs": self.runs, "seconds": round(self.seconds, 4)}


class DecompositionFailed(Exception):
    """Even with every op kind of the program kept, ``run_decompositions`` fails (``cause``: the first error)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()


def _is_view_stride_error(exc: BaseException) -> bool:
    text = str(exc)
    return any(k in text for k in ("view size is not compatible", "Use .reshape", "Cannot view a tensor"))


def _op_kinds(ep: "torch.export.ExportedProgram", decomposable: set[Any]) -> list[Any]:
    """Op overloads of the program the table would decompose, in order of first use."""
    seen: dict[Any, None] = {}
    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function" and node.target in decomposable:
            seen.setdefault(node.target, None)
    return list(seen)


def _qualname(op: Any) -> str:
    ns = getattr(op, "namespace", "")
    name = f"{op._opname}.{op._overloadname}" if hasattr(op, "_opname") else str(op)
    return f"aten.{name}" if ns == "aten" else f"{ns}::{name}"


def decompose(ep: "torch.export.ExportedProgram", extra: Mapping[Any, Callable[..., Any]] | None = None
              ) -> tuple["torch.export.ExportedProgram", Decomposition]:
    """``ep`` at core ATen, keeping only the ops whose decomposition fails (see the module docstring).

    ``extra``: the user's decompositions (op overload → function), over torch's default
    table and mlcomp's (:mod:`mlcomp.frontend.extra_decomps`; e.g. for a ``torch.library`` op no target knows).  Raises :class:`DecompositionFailed` if no choice of kept ops lowers it.  ``ep``'s
    views may be rewritten to reshapes in place (the same values).
    """
    report = Decomposition()
    t0 = time.perf_counter()
    try:
        return _lower(ep, report, dict(extra or {}))
    finally:
        report.seconds = time.perf_counter() - t0


def lowering_table(extra: Mapping[Any, Callable[..., Any]] | None = None) -> Any:
    """The table capture lowers with: torch's default (core ATen), mlcomp's, then ``extra`` (the user's)."""
    decomps = torch.export.default_decompositions()
    decomps.update(extra_decompositions())
    decomps.update(dict(extra or {}))
    return decomps


def _lower(ep: "torch.export.ExportedProgram", report: Decomposition, extra: dict[Any, Callable[..., Any]]
           ) -> tuple["torch.export.ExportedProgram", Decomposition]:
    def attempt(keep: tuple[Any, ...]) -> tuple[Any, BaseException | None]:
        decomps = lowering_table(extra)
        for op in keep:
            decomps.pop(op, None)
        report.runs += 1
        try:
            return ep.run_decompositions(decomps), None
        except Exception as exc:  # noqa: BLE001 - the failure is what is being located
            return None, exc

    done, first = attempt(())
    if done is not None:
        return done, report
    if _is_view_stride_error(first) and _views_as_reshape(ep):
        report.kept[VIEW_FIX] = _VIEW_FIX_REASON
        done, error = attempt(())
        if done is not None:
            return done, report
        first = error
    suspects = _op_kinds(ep, set(lowering_table(extra).keys()))
    done = _bisect(attempt, suspects, first, report)
    return done, report


def _bisect(attempt: Callable[[tuple[Any, ...]], tuple[Any, BaseException | None]], suspects: list[Any],
            first: BaseException, report: Decomposition) -> Any:
    """Keep culprits one at a time: the shortest prefix of ``suspects`` whose keeping lowers the program
    ends in a culprit (keeping more never breaks a decomposition); the others lie before it."""
    kept: tuple[Any, ...] = ()
    full, _ = attempt(tuple(suspects))
    if full is None:
        raise DecompositionFailed(first)
    errors: dict[int, BaseException] = {0: first}
    results: dict[int, Any] = {len(suspects): full}
    while True:
        lo, hi = 1, len(suspects)
        while lo < hi:
            mid = (lo + hi) // 2
            done, error = attempt(kept + tuple(suspects[:mid]))
            if done is not None:
                hi, results[mid] = mid, done
            else:
                lo, errors[mid] = mid + 1, error
        culprit = suspects[hi - 1]
        kept += (culprit,)
        cause = errors.get(hi - 1, first)
        report.kept[_qualname(culprit)] = f"its decomposition fails: {_summary(cause)}"
        suspects = suspects[:hi - 1]
        if not suspects:
            return results[hi]
        done, error = attempt(kept)
        if done is not None:
            return done
        errors, results = {0: error}, {len(suspects): results[hi]}


def _views_as_reshape(ep: "torch.export.ExportedProgram") -> bool:
    views = [n for n in ep.graph_module.graph.nodes
             if n.op == "call_function" and n.target is torch.ops.aten.view.default]
    for node in views:
        node.target = torch.ops.aten.reshape.default
    if views:
        ep.graph_module.recompile()
    return bool(views)


__all__ = ["Decomposition", "DecompositionFailed", "decompose", "lowering_table"]
