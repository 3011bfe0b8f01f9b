"""Give ONNX Runtime and OpenVINO back the recurrent layers that core-ATen capture unrolled.

Capture decomposes ``nn.GRU`` into one ``addmm``/``sigmoid``/``tanh`` cell per
time step (a 32-step tagger: ~500 IR nodes).  Exported as is, ORT runs ~500
small kernels where a direct export runs one ``GRU`` node: half the speed, and
the exporter spends most of the compile time on the unrolled loop.  Before the
``onnxruntime`` target exports (and before the ``openvino`` target converts:
:mod:`mlcomp.targets.openvino.gru`), :func:`recompose_rnns` puts the layer back as
one ``aten.gru.input`` node, which torchlib translates to ONNX ``GRU``::

    before (per step t, 32 times):
      %squeeze_t = aten.squeeze.dims(aten.slice.Tensor(%add, 0, t, t+1), [0])      # gru
      %addmm_t   = aten.addmm.default(%gru.bias_hh_l0, %h_t, %permute_2)            # gru
      ... split_with_sizes, sigmoid ×2, tanh, sub, mul, add ...                     # gru
      %cat       = aten.cat.default([%h_1, …, %h_32])                               # gru
    after:
      %gru_rnn   = aten.gru.input(%embedding, %gru_h0, [%gru.weight_ih_l0, %gru.weight_hh_l0,
                                  %gru.bias_ih_l0, %gru.bias_hh_l0], True, 1, 0.0, False, False, True)
      %permute_35 = getitem(%gru_rnn, 0)     # the region's output takes over its old name

A region is every node whose origin is the same ``GRU`` module; its weights are
its ``PARAM`` inputs named ``<module>.weight_ih_l<k>[_reverse]`` and so on (a
region whose weights a pass folded away is left alone, with the reason).  The
caller (:func:`mlcomp.targets.onnx.patterns.ort_friendly`) checks the result
numerically against the original graph.  One pass over the nodes (O(n)).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from mlcomp.ir import Graph, Node, Ref, TensorMeta, refs_in
from mlcomp.ir.builder import new_node, remove_dead, rename
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM, aten

__all__ = ["RecomposeStats", "recompose_rnns"]

_WEIGHT = re.compile(r"^(weight_ih|weight_hh|bias_ih|bias_hh)_l(\d+)(_reverse)?$")
_RNN_TYPES = {"GRU": aten("gru", "input")}


@dataclass
class RecomposeStats:
    """What the ONNX-friendly rewrites did: RNN layers put back (or left alone, with the reason),
    pattern rewrites by kind, IR nodes before and after."""

    recomposed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    rewrites: dict[str, int] = field(default_factory=dict)
    nodes_before: int = 0
    nodes_after: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.recomposed or any(self.rewrites.values()))

    def to_json(self) -> dict[str, Any]:
        return {"recomposed": self.recomposed, "skipped": self.skipped, "rewrites": self.rewrites,
                "nodes_before": self.nodes_before, "nodes_after": self.nodes_after}


@dataclass
class _Region:
    path: str
    kind: str
    nodes: list[Node] = field(default_factory=list)


def _regions(graph: Graph) -> list[_Region]:
    found: dict[str, _Region] = {}
    for node in graph.nodes():
        if node.op in (INPUT, PARAM, OUTPUT) or node.origin.module_type not in _RNN_TYPES:
            continue
        region = found.setdefault(node.origin.module_path, _Region(node.origin.module_path, node.origin.module_type))
        region.nodes.append(node)
    return list(found.values())


def _weights(graph: Graph, region: _Region, outside: list[str]) -> tuple[list[Ref], int, bool, bool] | str:
    """``(flat params in torch's order, layers, bidirectional, has_biases)`` or why not."""
    table: dict[tuple[int, bool], dict[str, Ref]] = {}
    others: list[str] = []
    for name in outside:
        node = graph.node(name)
        if node.op != PARAM:
            continue
        prefix = f"{region.path}." if region.path else ""
        match = _WEIGHT.match(name[len(prefix):]) if name.startswith(prefix) else None
        if match is None:
            others.append(name)         # another constant (a folded initial state): read as data
            continue
        kind, layer, reverse = match.group(1), int(match.group(2)), bool(match.group(3))
        table.setdefault((layer, reverse), {})[kind] = Ref(name)
    also = f"; it reads other constants ({', '.join('%' + n for n in others)}: folded by a pass?)" if others else ""
    if not table:
        return "reads none of the layer's weights" + also
    layers = 1 + max(k for k, _ in table)
    bidirectional = any(r for _, r in table)
    has_biases = "bias_ih" in next(iter(table.values()))
    kinds = ("weight_ih", "weight_hh", "bias_ih", "bias_hh") if has_biases else ("weight_ih", "weight_hh")
    flat: list[Ref] = []
    for layer in range(layers):
        for reverse in ((False, True) if bidirectional else (False,)):
            entry = table.get((layer, reverse), {})
            if set(entry) != set(kinds):
                return (f"layer {layer}{' reverse' if reverse else ''} has weights {sorted(entry)}, expected {kinds}"
                        + also)
            flat.extend(entry[k] for k in kinds)
    return flat, layers, bidirectional, has_biases


def _one_state(states: list[str], graph: Graph) -> list[str]:
    """The initial state as the layer reads it.  Constants that are all zeros are no state at all (the
    module's ``hx=None``, folded per layer and direction into ``h0[l]`` and ``h0[l].view(batch, hidden)``):
    ``[]``.  Constants read in several shapes holding the same elements are one state: the first one of
    the highest rank.  Anything else is returned as is."""
    if not states or not all(graph.node(n).op == PARAM for n in states):
        return states
    if all(not graph.constants[n].any() for n in states):
        return []
    if len(states) < 2:
        return states
    first = graph.constants[states[0]].reshape(-1)
    same = all(torch.equal(graph.constants[n].reshape(-1), first) for n in states[1:])
    return sorted(states, key=lambda n: -len(graph.node(n).tensor_meta.shape))[:1] if same else states


def _check_and_rewrite(graph: Graph, region: _Region) -> str | None:
    """Replace one region by an RNN node; returns why not (graph untouched) or None."""
    inside = {n.name for n in region.nodes}
    seen: dict[str, None] = {}          # ordered set: what the region reads from outside
    for node in region.nodes:
        for ref in refs_in((node.inputs, dict(node.attrs))):
            if ref.name not in inside:
                seen.setdefault(ref.name)
    outside = list(seen)
    weights = _weights(graph, region, outside)
    if isinstance(weights, str):
        return weights
    flat, layers, bidirectional, has_biases = weights
    directions = 2 if bidirectional else 1
    hidden = graph.node(flat[1].name).tensor_meta.shape[1]
    weight_names = {r.name for r in flat}
    data = [n for n in outside if n not in weight_names]
    seq = [n for n in data if len(graph.node(n).tensor_meta.shape) == 3]
    inputs = [n for n in seq if graph.node(n).tensor_meta.shape[2] == graph.node(flat[0].name).tensor_meta.shape[1]]
    if len(inputs) != 1:
        return f"cannot tell the sequence input among {data}"
    x = inputs[0]
    data = [x, *_one_state([n for n in data if n != x], graph)]
    if len(data) > 2:
        return f"cannot tell the sequence input among {data}"
    batch_first = any(u.op == aten("permute") and list(u.inputs[1]) == [1, 0, 2]
                      for u in graph.users(x) if u.name in inside)
    x_meta = graph.node(x).tensor_meta
    batch, steps = (x_meta.shape[0], x_meta.shape[1]) if batch_first else (x_meta.shape[1], x_meta.shape[0])
    state_shape = (layers * directions, batch, hidden)
    if not all(isinstance(d, int) for d in (*x_meta.shape, hidden)):
        return "symbolic sizes (a dynamic batch): left to the exporter"
    hx_in = [n for n in data if n != x]
    if hx_in and tuple(graph.node(hx_in[0]).tensor_meta.shape) != state_shape:
        return f"%{hx_in[0]} is not an initial state of shape {state_shape}"
    out_shape = (batch, steps, directions * hidden) if batch_first else (steps, batch, directions * hidden)
    if out_shape == state_shape:
        return "the output and the final state have the same shape"
    produced: dict[str, int] = {}
    for node in region.nodes:
        read_outside = any(u.name not in inside for u in graph.users(node.name))
        if not read_outside:
            continue
        shape = tuple(node.tensor_meta.shape) if isinstance(node.meta, TensorMeta) else None
        if shape == out_shape:
            produced[node.name] = 0
        elif shape == state_shape:
            produced[node.name] = 1
        else:
            return f"%{node.name} ({shape}) is read outside the layer and is neither its output nor its state"
    first = region.nodes[0].name
    origin = region.nodes[0].origin
    if hx_in:
        hx = Ref(hx_in[0])
    else:
        dtype = x_meta.dtype
        hx = Ref(new_node(graph, aten("full"), [list(state_shape), 0.0], {"dtype": dtype},
                          name=f"{region.path or 'rnn'}_h0", origin=origin, before=first).name)
    rnn = new_node(graph, _RNN_TYPES[region.kind], [Ref(x), hx, flat, has_biases, layers, 0.0, False,
                                                  bidirectional, batch_first],
                   name=f"{region.path or 'rnn'}_rnn", origin=origin, before=first)
    for old, index in produced.items():
        item = new_node(graph, GETITEM, [Ref(rnn.name), index], name=f"{old}__rnn", origin=origin, before=first)
        graph.replace_all_uses(old, item.name)
    remove_dead(graph, [n.name for n in reversed(region.nodes)])
    for old in produced:
        rename(graph, f"{old}__rnn", old)
    return None


def recompose_rnns(graph: Graph, stats: RecomposeStats) -> None:
    """Put ``graph``'s unrolled GRU layers back as single nodes, in place; ``stats`` records what happened.

    A region that cannot be put back leaves ``graph`` untouched (each attempt runs on a copy
    only when its checks pass, the rewrite itself cannot fail half way).
    """
    for region in _regions(graph):
        why = _check_and_rewrite(graph, region)
        if why is None:
            stats.recomposed.append(region.path)
        else:
            stats.skipped[region.path] = why
