"""Smoothing: a linear's input channels divided by a per-channel factor its weight takes on instead.

One activation is quantized on one per-tensor grid, so its channel with the widest range
sets every channel's step; the weight is quantized per output channel, so its input
channels can take on some of that range.  For each activation read only as the input
of linears with constant weights (a layer norm's output read by attention's ``Q``, ``K``
and ``V`` projections, a GELU's output), :func:`smooth` measures each input channel's
``max |x_j|`` on the calibration samples and ``max |W_ij|`` over the group's weights,
and with ``s_j = max|x_j|^α / max|W_j|^(1−α)`` rewrites ``x·Wᵀ`` as ``(x/s)·(W·s)ᵀ``
(the same function; ``α`` near 1 moves nearly all of the activation's spread into the
weights)::

    %addmm = addmm(%q.bias, %ln, permute(%q.weight))          # %ln also read by the residual add
                 ↓ smooth (α = 0.95)
    %ln_s = mul(%ln, %ln.smooth)                               # f32[768]: 1/s, per channel
    %addmm = addmm(%q.bias, %ln_s, permute(%q.weight))         # %q.weight's columns times s

The multiply stays a float op before the activation's quantize (OpenVINO folds it: no
layer of its own in the executed graph).  Which targets smooth, and how much, is the
:data:`SMOOTHING` row (``quantize{smooth=α}`` sets it, 0 turns it off).  Float readers of the
activation (the residual add) keep reading it unscaled; an activation with fewer than
:data:`MIN_ROWS` rows over the samples is not smoothed (its per-channel maxima are those of a
few rows: a classifier's input at batch 2).  O(samples × graph + weights).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.builder import new_node
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.passes.quantize.bias import rows_per_channel
from mlcomp.passes.quantize.policy import Int8Rule
from mlcomp.passes.quantize.write import weight_param

__all__ = ["SMOOTHING", "MIN_ROWS", "smoothing_for", "smooth"]

MIN_ROWS = 64
"""Fewest rows per channel over the calibration samples for an activation's maxima to be smoothed by."""

SMOOTHING: Mapping[str, float] = MappingProxyType({"openvino": 0.95})
"""Target -> α of :func:`smooth` by default (a target without a row: no smoothing; ``quantize{smooth=α}``
sets it, 0 turns it off).  openvino: BERT-base's top-1 agreement at batch 32 0.977 → 0.983 and max error
0.0118 → 0.0104 with attention quantized whole; its activations stay uint8 (``grids.PLAIN_GRIDS``).
onnxruntime has no row."""

_LINEARS = frozenset({aten("addmm"), aten("mm")})
_FLOOR = 1e-5


def smoothing_for(target: str | None) -> float:
    """The default α on ``target``.

    >>> smoothing_for("openvino"), smoothing_for("onnxruntime")
    (0.95, 0.0)
    """
    return SMOOTHING.get(target or "", 0.0)


def _groups(graph: Graph, layers: Sequence[tuple[Node, Int8Rule]]) -> dict[str, list[tuple[Node, Node, int]]]:
    """Activation -> its linears (node, weight PARAM, the PARAM's input-channel axis), when every int8 reader
    of the activation is such a linear whose weight nothing else reads."""
    groups: dict[str, list[tuple[Node, Node, int]]] = {}
    spoiled: set[str] = set()
    for node, rule in layers:
        acts = [node.inputs[i] for i in rule.activations if isinstance(node.inputs[i], Ref)]
        found = weight_param(graph, node.inputs[rule.weight]) if rule.weight is not None else None
        ok = node.op in _LINEARS and found is not None and len(acts) == 1 and _only_reader(graph, node, found)
        for a in acts:
            if not ok:
                spoiled.add(a.name)
                continue
            param, transposed = found
            axis = rule.weight_axis if transposed else 1 - rule.weight_axis     # the input channels' axis
            groups.setdefault(a.name, []).append((node, param, axis))
    return {a: g for a, g in groups.items() if a not in spoiled}


def _only_reader(graph: Graph, node: Node, found: tuple[Node, bool]) -> bool:
    param, transposed = found
    readers = graph.users(param.name)
    if len(readers) != 1:
        return False
    return readers[0].name == node.name or (transposed and [u.name for u in graph.users(readers[0].name)]
                                            == [node.name])


def _channel_absmax(graph: Graph, samples: Sequence[tuple[torch.Tensor, ...]], names: Sequence[str]
                    ) -> dict[str, torch.Tensor]:
    """``max |x|`` per last-axis channel of each value in ``names`` over the samples (float runs)."""
    out: dict[str, torch.Tensor] = {}
    interp = Interpreter(graph)
    with torch.no_grad():
        for sample in samples:
            env = interp.run_all(*sample)
            for n in names:
                v = env[n].detach().abs().reshape(-1, env[n].shape[-1]).amax(0).float()
                out[n] = v if n not in out else torch.maximum(out[n], v)
    return out


def smooth(graph: Graph, layers: Sequence[tuple[Node, Int8Rule]], samples: Sequence[tuple[torch.Tensor, ...]],
           alpha: float) -> list[dict[str, Any]]:
    """Smooth every activation group of ``layers`` with ``alpha`` in place (see the module docstring); one record
    per activation smoothed.  ``layers``' nodes are stale afterwards: read them from the graph again."""
    groups = _groups(graph, layers)
    if alpha <= 0 or not groups:
        return []
    rows = {a: rows_per_channel(graph.node(a).tensor_meta.shape, -1) * len(samples) for a in groups}
    groups = {a: g for a, g in groups.items() if rows[a] >= MIN_ROWS}
    amax = _channel_absmax(graph, samples, list(groups))
    position = {n.name: i for i, n in enumerate(graph.nodes())}
    records = []
    for name, linears in groups.items():
        wmax = torch.stack([graph.constants[p.name].detach().abs().float().amax(dim=1 - axis)
                            for _, p, axis in linears]).amax(0)
        if wmax.shape != amax[name].shape:
            continue
        s = (amax[name].clamp(min=_FLOOR) ** alpha / wmax.clamp(min=_FLOOR) ** (1 - alpha)).clamp(min=_FLOOR)
        for _, param, axis in linears:
            w = graph.constants[param.name]
            graph.constants[param.name] = (w.float() * (s if axis == 1 else s[:, None])).to(w.dtype)
        inv = graph.add_constant(graph.fresh_name(f"{name}.smooth"), (1 / s).to(torch.float32))
        first = min((n for n, _, _ in linears), key=lambda n: position[n.name])
        mul = new_node(graph, aten("mul.Tensor"), (Ref(name), Ref(inv.name)), name=graph.fresh_name(f"{name}_s"),
                       before=first.name, origin=first.origin)
        readers = {n.name for n, _, _ in linears}
        graph.replace_all_uses(name, Ref(mul.name), only=lambda u: u.name in readers)
        records.append({"value": name, "layers": sorted(readers), "alpha": alpha,
                        "factor_min": float(s.min()), "factor_max": float(s.max())})
    return records
