"""Module origins for the nodes of a joint (forward + loss + backward) graph.

The joint retrace in torch 2.13 keeps no ``nn_module_stack``, ``seq_nr`` or
``from_node`` that points back at the user's modules, so every joint node came out
with an empty origin.  This module restores them from two sources we do have:

* the pre-joint ``ExportedProgram`` (training IR, one node per ``linear``,
  ``conv2d``, ``relu_``, ``batch_norm`` …), whose ``nn_module_stack`` names the
  module of every high-level op (:func:`module_sequence`);
* the parameters each forward node reads.

Before / after, on ``Sequential(Linear, ReLU, Linear)``::

    %relu = aten.relu.default(%addmm)                    # {phase=forward}
    %threshold_backward = aten.threshold_backward(%mm, %relu, 0)   # {phase=backward}
    # after:
    %relu = aten.relu.default(%addmm)                    # 1 (ReLU)  {phase=forward}
    %threshold_backward = aten.threshold_backward(%mm, %relu, 0)   # 1 (ReLU)  {phase=backward}

Forward nodes, in order, walk along the high-level sequence: a node reading a
parameter (or a view of one) belongs to that parameter's module and moves the walk
to that module's first op; any other node belongs to the next high-level op (within
a short window) whose name contains or is contained in its own (``relu_`` /
``relu``, ``max_pool2d`` / ``max_pool2d_with_indices``), else to the op the walk
stands on.  A backward node belongs to the forward node it differentiates: the
parameter whose gradient it produces (through views and tuple items), else the
latest forward value it reads (through views), else its first backward input.
One pass each way; the walk's lookups are O(log n), so O(n log n) in all.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mlcomp.ir import Graph, Node
from mlcomp.ir.node import Origin, Phase
from mlcomp.ir.ops import GETITEM, PARAM
from mlcomp.ir.opsets import VIEW_LIKE

__all__ = ["bytes_by_origin", "joint_origins", "module_sequence"]

_WINDOW = 16     # how far ahead a forward node looks for a high-level op of its name
_VIEW_NAMES = frozenset(op.name for op in VIEW_LIKE)


def _clean(path: str) -> str:
    return path.replace("L['self'].", "").strip(".")


def module_sequence(ep: Any, strip: Callable[[str], str]) -> list[tuple[str, str, str]]:
    """``(op name, module path, module type)`` of the pre-joint program's call nodes, in order."""
    out: list[tuple[str, str, str]] = []
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        stack = node.meta.get("nn_module_stack") or {}
        path, kind = "", ""
        if stack:
            raw_path, qual = list(stack.values())[-1]
            path, kind = strip(_clean(str(raw_path))), str(qual).rsplit(".", 1)[-1]
            if path == "model":   # the model's root module ("" is the loss wrapper)
                path = ""
        name = getattr(getattr(node.target, "_schema", None), "name", str(node.target))
        out.append((name.removeprefix("aten::").rstrip("_"), path, kind))
    return out


def _is_view(node: Node) -> bool:
    return node.op == GETITEM or node.op.name in _VIEW_NAMES


def _related(a: str, b: str) -> bool:
    return len(a) >= 3 and len(b) >= 3 and (a in b or b in a)


def joint_origins(raw: Graph, phases: Mapping[str, Phase], modules: list[tuple[str, str, str]],
                  grad_of: Mapping[str, str]) -> dict[str, Origin]:
    """Origin of every compute node of ``raw`` (names as in ``raw``); ``grad_of``: output → parameter."""
    kinds = {path: kind for _, path, kind in modules if path}
    at: dict[str, list[int]] = {}
    for i, (_, path, _) in enumerate(modules):
        at.setdefault(path, []).append(i)
    module: dict[str, str] = {}
    param_only: dict[str, str] = {}   # values computed from one module's parameters only (weight views)
    order: dict[str, int] = {}
    pos = 0
    for index, node in enumerate(raw.nodes()):
        order[node.name] = index
        if node.op == PARAM:
            param_only[node.name] = node.name.rpartition(".")[0]
            continue
        phase = phases.get(node.name)
        if phase is None or phase is Phase.BACKWARD:
            continue
        srcs = node.input_names()
        if phase is Phase.LOSS:
            module[node.name] = ""
            continue
        owners = [param_only[s] for s in srcs if s in param_only]
        if owners:
            module[node.name] = owners[0]
            if all(s in param_only for s in srcs):
                param_only[node.name] = owners[0]
            hits = at.get(owners[0], [])
            k = bisect.bisect_left(hits, pos)
            if k < len(hits):
                pos = hits[k]
            continue
        name = node.op.name
        match = next((j for j in range(pos, min(pos + _WINDOW, len(modules))) if _related(modules[j][0], name)), None)
        if match is not None:
            pos = match
            module[node.name] = modules[match][1]
        elif pos < len(modules):
            module[node.name] = modules[pos][1]
    _backward(raw, phases, grad_of, module, order, param_only)
    return {n: Origin(m, kinds.get(m, "")) for n, m in module.items()}


def _backward(raw: Graph, phases: Mapping[str, Phase], grad_of: Mapping[str, str], module: dict[str, str],
              order: dict[str, int], param_only: Mapping[str, str]) -> None:
    """Backward nodes: the parameter they produce a gradient for, else the latest forward value they read."""
    produces: dict[str, str] = {}
    for out, param in grad_of.items():   # walk back through views / tuple items to the computing node
        name = out
        while True:
            produces.setdefault(name, param.rpartition(".")[0])
            node = raw.node(name)
            srcs = node.input_names()
            if not (_is_view(node) and srcs) or phases.get(srcs[0]) is not Phase.BACKWARD:
                break
            name = srcs[0]
    base: dict[str, str] = {}   # backward views of forward values → that forward value
    for node in raw.nodes():
        if phases.get(node.name) is not Phase.BACKWARD:
            continue
        srcs = node.input_names()
        if _is_view(node) and srcs:
            first = srcs[0]
            if phases.get(first) in (Phase.FORWARD, Phase.LOSS) or first in param_only:
                base[node.name] = first
            elif first in base:
                base[node.name] = base[first]
        if node.name in produces:
            module[node.name] = produces[node.name]
            continue
        read = [base.get(s, s) for s in srcs]
        forward = [s for s in read if s in module and phases.get(s) is Phase.FORWARD]
        if forward:
            module[node.name] = module[max(forward, key=order.__getitem__)]
            continue
        params = [param_only[s] for s in read if s in param_only]
        inherited = next((module[s] for s in srcs if s in module), None)
        if params:
            module[node.name] = params[0]
        elif inherited is not None:
            module[node.name] = inherited


def bytes_by_origin(graph: Graph, values: Iterable[Any]) -> dict[str, int]:
    """Bytes of ``values`` (``name``, ``nbytes``, ``module`` each, as
    :func:`mlcomp.analysis.training_graph.saved_activations` returns them) by the module path of
    their node's origin, largest first.  Values without an origin (graph inputs, loss
    values) keep the ``module`` they came with (``<input>``, ``<loss>``)."""
    out: dict[str, int] = {}
    for value in values:
        origin = graph.node(value.name).origin
        module = origin.module_path if origin is not None and origin.module_path else value.module
        out[module] = out.get(module, 0) + value.nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
