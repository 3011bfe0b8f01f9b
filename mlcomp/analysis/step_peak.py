"""The peak of a whole training step: forward, backward and the optimizer update, and what is live there.

A compiled training step (:mod:`mlcomp.training.step`) runs the joint graph's
nodes in their order, freeing each value after its last reader, then hands the
gradients (graph outputs: live to the end of the graph) to the optimizer.  Its
optimizer adds scratch while it runs (``scratch``: bytes per byte of trainable
parameters; Adam's ``sqrt(v)`` is one parameter-sized temporary).  With
``fused=True`` every parameter is updated inside the backward instead, at the
point :func:`update_points` names (after its gradient is complete and after its
last reader), and its gradient is freed there, so gradients never all coexist.

:func:`step_memory` is :func:`mlcomp.analysis.liveness.liveness` over that
execution with those two changes; :class:`StepMemory` says where the peak is,
which values are live there, of which kind and from which module::

    >>> import torch
    >>> from mlcomp.frontend.joint import LossKind, capture_joint
    >>> from mlcomp.models import mlp
    >>> graph = capture_joint(mlp(), (torch.randn(4, 512),), torch.tensor([0, 1, 1, 0]),
    ...                       loss=LossKind.CROSS_ENTROPY)
    >>> unfused, fused = step_memory(graph), step_memory(graph, fused=True)
    >>> unfused.peak_bytes, unfused.at, fused.peak_bytes < unfused.peak_bytes
    (662028, 'sum_3', True)
    >>> sorted(unfused.by_kind())
    ['backward temporary', 'gradient', 'output']

Kinds (:data:`KINDS`): a *gradient* is a parameter's gradient (a graph output);
a *saved activation* a forward value the backward still holds; *recomputed* a
copy the ``remat`` pass added; *forward*/*backward temporary* everything else of
that phase; *output* the loss and new buffer values; *optimizer scratch* the
update's temporaries; *kernel scratch* what a kernel holds inside its own call
(``workspace``, :mod:`mlcomp.analysis.workspace`).  The kinds at a step sum to
its bytes.  Everything is O(n log n).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlcomp.analysis.liveness import Liveness, liveness
from mlcomp.analysis.training_graph import value_modules
from mlcomp.base.units import fmt_bytes
from mlcomp.ir import Graph
from mlcomp.ir.node import Phase
from mlcomp.ir.ops import PARAM

__all__ = ["KINDS", "LiveValue", "OPTIMIZER", "StepMemory", "grad_params", "step_memory", "update_points"]

GRAD = "grad:"               # the joint graph's gradient outputs (mlcomp.frontend.joint)
OPTIMIZER = "<optimizer>"    # the step after the graph (unfused update) and the scratch's name
KINDS = ("saved activation", "recomputed", "gradient", "forward temporary", "backward temporary", "output",
         "optimizer scratch", "kernel scratch")


@dataclass(frozen=True)
class LiveValue:
    """One buffer live at a step: its root value, bytes, kind (:data:`KINDS`) and module."""

    name: str
    nbytes: int
    kind: str
    module: str


def grad_params(graph: Graph) -> dict[str, str]:
    """Parameter → the node holding its gradient, from the joint graph's output names."""
    names = graph.output_node.attrs.get("names")
    refs = graph.output_refs
    names = list(names) if names is not None else [r.name for r in refs]
    return {n[len(GRAD):]: r.name for n, r in zip(names, refs) if n.startswith(GRAD)}


def update_points(graph: Graph, schedule: Sequence[str] | None = None) -> dict[str, str]:
    """Parameter → the node after which its update may run: the later of its gradient's node and the
    last node reading the parameter (directly or through a view: an in-place update changes both)."""
    live = liveness(graph, schedule, count_params=True)
    step_of, storage = live.step_of, live.storage
    last: dict[str, int] = {}
    for names in live.schedule:
        for name in names:
            node = graph.node(name)
            for s in node.input_names():
                root = storage[s]
                if graph.node(root).op == PARAM:
                    last[root] = max(last.get(root, -1), step_of[name])
    out: dict[str, str] = {}
    for param, grad in grad_params(graph).items():
        step = max(step_of[grad], last.get(param, -1))
        out[param] = live.schedule[step][-1]
    return out


@dataclass(frozen=True)
class StepMemory:
    """Bytes live at each step of a training step (the graph's steps, then the update when unfused)."""

    graph: Graph
    live: Liveness
    live_bytes: tuple[int, ...]       # per graph step, then one more for the unfused update
    dies: Mapping[str, int]           # counted root -> last step holding it (gradients: their update)
    scratch: Mapping[int, int]        # step -> optimizer scratch bytes held during it
    fused: bool

    @property
    def peak_bytes(self) -> int:
        return max(self.live_bytes, default=0)

    @property
    def peak_step(self) -> int:
        return self.live_bytes.index(self.peak_bytes) if self.live_bytes else 0

    @property
    def at(self) -> str:
        """The node running at the peak (:data:`OPTIMIZER` for the update after the graph)."""
        step = self.peak_step
        return self.live.schedule[step][0] if step < len(self.live.schedule) else OPTIMIZER

    def live_at(self, step: int) -> list[LiveValue]:
        """Buffers held while ``step`` runs, largest first."""
        live, graph = self.live, self.graph
        mods = value_modules(graph)
        grads = {live.storage[g] for g in grad_params(graph).values()}
        outputs = {live.storage[r.name] for r in graph.output_refs}
        backward = {r for r in live.born if graph.node(r).ann.phase is Phase.BACKWARD}
        read_by_backward = {live.storage[s] for r in backward for s in graph.node(r).input_names()}
        saving = step >= _first_backward(live, graph)        # the backward has begun: what it reads is saved
        out = []
        for r, born in live.born.items():
            if born <= step <= self.dies[r]:
                node = graph.node(r)
                kind = ("gradient" if r in grads else "output" if r in outputs
                        else "recomputed" if ".remat" in r
                        else "backward temporary" if r in backward
                        else "saved activation" if r in read_by_backward and saving
                        else "forward temporary")
                out.append(LiveValue(r, live.sizes[r], kind, mods.get(node.name, "<root>")))
        if self.scratch.get(step):
            out.append(LiveValue(OPTIMIZER, self.scratch[step], "optimizer scratch", OPTIMIZER))
        rest = self.live_bytes[step] - sum(v.nbytes for v in out)    # the kernel's own scratch at its step
        if rest > 0 and step < len(live.schedule):
            at = live.schedule[step][0]
            out.append(LiveValue(f"scratch of {at}", rest, "kernel scratch", mods.get(at, "<root>")))
        return sorted(out, key=lambda v: -v.nbytes)

    def by_kind(self, step: int | None = None) -> dict[str, int]:
        """Bytes live at ``step`` (default: the peak) per kind."""
        return _grouped(self.live_at(self.peak_step if step is None else step), lambda v: v.kind)

    def by_module(self, step: int | None = None) -> dict[str, int]:
        """Bytes live at ``step`` (default: the peak) per module, largest first."""
        return _grouped(self.live_at(self.peak_step if step is None else step), lambda v: v.module)

    def format(self, top: int = 8) -> str:
        """The peak, its moment and what is live there (by kind, by module, the largest values)."""
        n = len(self.live.schedule)
        lines = [f"peak {fmt_bytes(self.peak_bytes)} at %{self.at} (step {self.peak_step} of {n}"
                 f"{', optimizer in the backward' if self.fused else ''})",
                 "  by kind:   " + ", ".join(f"{k} {fmt_bytes(b)}" for k, b in self.by_kind().items()),
                 "  by module: " + ", ".join(f"{m} {fmt_bytes(b)}" for m, b in list(self.by_module().items())[:top])]
        lines += [f"    %{v.name}: {fmt_bytes(v.nbytes)} ({v.kind}, {v.module})"
                  for v in self.live_at(self.peak_step)[:top]]
        return "\n".join(lines)


def _first_backward(live: Liveness, graph: Graph) -> int:
    return next((i for i, names in enumerate(live.schedule)
                 if graph.node(names[0]).ann.phase is Phase.BACKWARD), len(live.schedule))


def _grouped(values: list[LiveValue], key) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[key(v)] = out.get(key(v), 0) + v.nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def step_memory(graph: Graph, schedule: Sequence[str] | None = None, *, workspace: Mapping[str, int] | None = None,
                scratch: float = 0.0, fused: bool = False) -> StepMemory:
    """Bytes live over a whole training step of joint ``graph`` run in ``schedule`` (default: its order).

    ``scratch``: the optimizer's temporaries per byte of parameter it updates
    (:meth:`mlcomp.runtime.optim.OptimizerSpec.scratch`); ``fused``: each update runs
    at its :func:`update_points` node and frees the parameter's gradient there.
    """
    live = liveness(graph, schedule, workspace=workspace)
    grads = grad_params(graph)
    nbytes = {p: graph.node(p).tensor_meta.nbytes(graph.symbols) for p in grads}
    n = len(live.schedule)
    delta = [0] * (n + 2)
    dies = dict(live.dies)
    scratch_at: dict[int, int] = {}
    if fused:
        last_read = _last_reads(graph, live)
        for param, point in update_points(graph, schedule).items():
            u = live.step_of[point]
            root = live.storage[grads[param]]
            scratch_at[u] = scratch_at.get(u, 0) + int(scratch * nbytes[param])
            if root in live.born and dies[root] == n - 1:
                end = max(u, last_read.get(root, -1))
                delta[end + 1] -= live.sizes[root]     # freed after its update instead of at the end
                dies[root] = end
    else:                             # the update runs after the graph: what it returned is held through it
        scratch_at[n] = int(scratch * sum(nbytes.values()))
        dies.update({r: n for r, d in live.dies.items() if d == n - 1})
    run, out = 0, []
    for i, b in enumerate(live.live_bytes):
        run += delta[i]
        out.append(b + run + scratch_at.get(i, 0))
    if not fused:                     # the update: every output still held, plus the optimizer's scratch
        out.append(sum(live.sizes[r] for r in live.born if live.dies[r] == n - 1) + scratch_at[n])
    return StepMemory(graph, live, tuple(out), dies, scratch_at, fused)


def _last_reads(graph: Graph, live: Liveness) -> dict[str, int]:
    """Root → the last step reading it (the output node aside)."""
    out: dict[str, int] = {}
    for i, names in enumerate(live.schedule):
        for name in names:
            if name == graph.output_node.name:
                continue
            for s in graph.node(name).input_names():
                r = live.storage[s]
                out[r] = max(out.get(r, -1), i)
    return out
