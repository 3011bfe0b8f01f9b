"""Verifying a low-precision graph through its selections: near-ties a rounding may order either way.

A ``topk`` / ``sort`` / ``argmax`` (a mixture-of-experts router, a beam) picks *which* values go on,
and a pick is discontinuous: two candidates a hair apart in fp32 may swap once upstream values are
rounded to bf16, and everything downstream of the swap then differs by far more than bf16's error.
Comparing such an artifact with eager says "wrong" where the only difference is a tie that the
precision cannot resolve.  The rule (:func:`near_tie_reference`):

* the *declared perturbation* of a selection's ranked values is the tolerance the low-precision
  graph declares for them (:func:`~mlcomp.analysis.ranges.declared_at` the ranked input:
  ``1.5 x u(dtype) x sqrt(roundings on the path to it)``) times the largest magnitude among the
  values ranked together (one row along the selection's dim), as output verification measures it;
* in the fp32 reference (the captured graph), two neighbours in a row's order whose values differ
  by no more than that are a **near-tie**: the low-precision computation may order them either way;
* the artifact's picks cannot be read from outside it, so they are found by a greedy search:
  selection by selection in graph order, each near-tie (closest first) is swapped in the reference
  when that brings the reference's outputs closer to the artifact's (summed squared error, each
  output scaled by its largest value), at most :data:`MAX_TRIALS` reference runs in all;
* a swap only ever exchanges near-tied neighbours, and a swapped reference still computes every
  value from its own fp32 inputs (the picked values are gathered from its ranked input), so a wrong
  router (a pick beyond the perturbation) or a wrong op downstream still fails the comparison made
  next: the artifact against the swapped reference at the usual tolerance.

The number of swaps taken (near-tie selection rows) and the selections holding them go in the
verification record.  Run only when the plain comparison failed and the graph holds a selection.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mlcomp.analysis.ranges import declared_at
from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.interpreter import Interpreter

__all__ = ["MAX_TRIALS", "SELECTIONS", "NearTies", "near_tie_reference", "selection_nodes"]

MAX_TRIALS = 64          # reference runs the search may make
# selecting op (name, or name.overload) -> (its outputs in order, the argument saying "largest first", or
# the fixed answer)
SELECTIONS: dict[str, tuple[tuple[str, ...], str | bool]] = {
    "topk": (("values", "indices"), "largest"), "sort": (("values", "indices"), "descending"),
    "argsort": (("indices",), "descending"), "argmax": (("indices",), True), "argmin": (("indices",), False),
    "max.dim": (("values", "indices"), True), "min.dim": (("values", "indices"), False),
}

Swap = tuple[str, int, int]          # (selection node, row, rank j): ranks j and j+1 exchanged


@dataclass
class NearTies:
    """The reference outputs taking the artifact's order at near-ties, and which near-ties those were."""

    outputs: tuple[Any, ...]
    swaps: tuple[Swap, ...] = ()
    trials: int = 0

    @property
    def ties(self) -> int:
        return len(self.swaps)

    @property
    def nodes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, _, _ in self.swaps:
            out[name] = out.get(name, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"near_tie_selections": self.ties, "near_tie_nodes": self.nodes, "near_tie_trials": self.trials}


def _spec(node: Node) -> tuple[tuple[str, ...], str | bool] | None:
    op = node.op
    if op.is_structural or not isinstance(getattr(op, "name", None), str):
        return None
    if f"{op.name}.{op.overload}" in SELECTIONS:
        return SELECTIONS[f"{op.name}.{op.overload}"]
    return SELECTIONS.get(op.name) if op.overload in ("default", "stable") else None


def selection_nodes(graph: Graph) -> list[Node]:
    """The graph's selecting nodes (:data:`SELECTIONS`), in order."""
    return [n for n in graph.call_nodes() if _spec(n) is not None]


class _Rows:
    """One selection's ranked input as rows (its dim last), and its pick as ``[rows, k]`` indices."""

    def __init__(self, node: Node, ranked: torch.Tensor, value: Any) -> None:
        bound: dict[str, Any] = {}
        for i, arg in enumerate(node.op.resolve()._schema.arguments):
            if i < len(node.inputs):
                bound[arg.name] = node.inputs[i]
            elif arg.name in node.attrs:
                bound[arg.name] = node.attrs[arg.name]
            elif arg.has_default_value():
                bound[arg.name] = arg.default_value
        self.layout, direction = _spec(node)
        self.largest = bool(bound.get(direction)) if isinstance(direction, str) else direction
        self.flat = bound.get("dim") is None               # argmax without dim: the whole tensor is one row
        self.keep = self.flat or bool(bound.get("keepdim", True))
        self.dim = 0 if self.flat else bound["dim"] % max(1, ranked.dim())
        x = ranked.reshape(-1) if self.flat else ranked
        self.shape = x.movedim(self.dim, -1).shape
        self.x = x.movedim(self.dim, -1).reshape(-1, self.shape[-1])
        idx = value[self.layout.index("indices")] if len(self.layout) > 1 else value
        idx = idx.reshape(1) if self.flat else idx if self.keep else idx.unsqueeze(self.dim)
        self.k = idx.shape[self.dim]
        self.pick = idx.movedim(self.dim, -1).reshape(-1, self.k).clone()

    def near_ties(self, rtol: float) -> list[tuple[float, int, int]]:
        """``(gap, row, rank j)`` of neighbours j, j+1 of a row's order within the declared perturbation
        (none for integers: no rounding moves them)."""
        if not self.x.is_floating_point():
            return []
        x = self.x.double()
        ordered = x.sort(dim=-1, descending=self.largest, stable=True).values[:, :self.k + 1]
        gap = (ordered[:, :-1] - ordered[:, 1:]).abs()[:, :min(self.k, x.shape[-1] - 1)]
        allowed = rtol * x.abs().amax(dim=-1, keepdim=True)
        rows, ranks = (gap <= allowed).nonzero(as_tuple=True)
        return sorted((float(gap[r, j]), int(r), int(j)) for r, j in zip(rows.tolist(), ranks.tolist()))

    def swapped(self, swaps: Sequence[tuple[int, int]]) -> Any:
        """The op's output with ranks j, j+1 exchanged in each ``(row, j)``."""
        pick = self.pick
        for row in sorted({r for r, _ in swaps}):
            # the op's own pick first (its tie-breaking kept), then the rest in the row's order
            taken = pick[row].tolist()
            rest = [i for i in self.x[row].double().argsort(descending=self.largest, stable=True).tolist()
                    if i not in set(taken)]
            order = torch.tensor(taken + rest)
            for r, j in swaps:
                if r == row:
                    order[[j, j + 1]] = order[[j + 1, j]]
            pick[row] = order[:self.k]
        values = torch.gather(self.x, 1, pick).reshape(*self.shape[:-1], self.k)
        idx = pick.reshape(*self.shape[:-1], self.k)
        back = (lambda t: t.reshape(())) if self.flat else (
            lambda t: t.movedim(-1, self.dim) if self.keep else t.movedim(-1, self.dim).squeeze(self.dim))
        made = {"values": back(values), "indices": back(idx)}
        return tuple(made[k] for k in self.layout) if len(self.layout) > 1 else made["indices"]


def _error(expected: Sequence[Any], actual: Sequence[Any]) -> float:
    total = 0.0
    for e, a in zip(expected, actual):
        if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor) and e.is_floating_point() \
                and e.shape == a.shape and e.numel():
            e64, a64 = e.double(), a.double()
            total += float(((a64 - e64) ** 2).sum()) / max(float(e64.abs().max()), 1e-30) ** 2
    return total


def near_tie_reference(reference: Graph, lowered: Graph, inputs: Sequence[torch.Tensor],
                       actual: Sequence[Any]) -> NearTies | None:
    """The reference's outputs with the artifact's order at near-ties (module doc), found by comparing
    with ``actual`` (the artifact's flat outputs); ``None`` when ``lowered`` computes nothing in low
    precision or has no selection the reference also has."""
    chosen = [n for n in selection_nodes(lowered) if n.name in reference and reference.node(n.name).op == n.op
              and n.inputs and isinstance(n.inputs[0], Ref)]
    declared = declared_at(lowered, {n.inputs[0].name for n in chosen})
    rtol = {n.name: declared[n.inputs[0].name].rtol for n in chosen if n.inputs[0].name in declared}
    if not rtol:
        return None
    swaps: list[Swap] = []
    outputs, found = _run(reference, inputs, rtol, swaps)
    best, trials = _error(outputs, actual), 1
    for name in [n.name for n in chosen if n.name in rtol]:
        for _, row, rank in found.get(name, ()):
            if trials >= MAX_TRIALS:
                break
            trial_out, trial_found = _run(reference, inputs, rtol, swaps + [(name, row, rank)])
            trials += 1
            err = _error(trial_out, actual)
            if err < best:
                swaps.append((name, row, rank))
                best, outputs, found = err, trial_out, trial_found
    return NearTies(tuple(outputs), tuple(swaps), trials)


def _run(reference: Graph, inputs: Sequence[torch.Tensor], rtol: dict[str, float], swaps: list[Swap]
         ) -> tuple[tuple[Any, ...], dict[str, list[tuple[float, int, int]]]]:
    """The reference's outputs with ``swaps`` taken, and the near-ties each selection saw."""
    found: dict[str, list[tuple[float, int, int]]] = {}

    def hook(name: str):
        def take(args: tuple[Any, ...], value: Any) -> Any:
            rows = _Rows(reference.node(name), args[0], value)
            found[name] = rows.near_ties(rtol[name])
            mine = [(r, j) for n, r, j in swaps if n == name]
            return rows.swapped(mine) if mine else value
        return take

    with torch.no_grad():
        out = Interpreter(reference, check_inputs=False, after={n: hook(n) for n in rtol}).run(*inputs)
    return out, found
