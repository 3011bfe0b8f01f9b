"""Writing ``quantize``'s pairs into the graph.

:class:`Writer` gives each quantized value one shared pair (a value read by two
int8 ops is quantized once), folds weights and biases into integer constants with
their scale and zero-point constants, and records per layer what it chose.
:func:`drop_softmax_guard` removes a safe softmax's all-``-inf``-row guard once the
softmax reads a dequantized (hence finite) input, leaving the plain ``Softmax`` that
ORT fuses into ``QLinearSoftmax``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.builder import new_node, remove_dead
from mlcomp.ir.ops import PARAM, aten
from mlcomp.ir.quant import DEQUANTIZE, DYNAMIC_QUANTIZE, QUANTIZE
from mlcomp.passes import patterns as P
from mlcomp.passes.quantize.absorb import ELEMENT_MOVES
from mlcomp.passes.quantize.grids import Grid, grid_params
from mlcomp.passes.quantize.observe import int8_weight
from mlcomp.passes.quantize.policy import Int8Rule

__all__ = ["Writer", "Plan", "plan", "weight_param", "activations", "output_value", "drop_softmax_guard",
           "ranges_through_moves", "outputs_read_in_int8", "moved_from", "reader_grids", "operand_grids_of"]

_TRANSPOSES = (aten("permute"), aten("t"), aten("transpose.int"))
_MOVES = ELEMENT_MOVES
_RELU = aten("relu")


class Writer:
    """Inserts the pairs of one graph; ``layer`` does one int8 op and returns its record."""

    def __init__(self, graph: Graph, ranges: dict[str, tuple[float, float]], per_channel: bool,
                 products: tuple[Grid, Grid] = (Grid.MINMAX, Grid.MINMAX), paired: set[str] | None = None,
                 out_grids: dict[str, Grid] | None = None, plain: Grid = Grid.MINMAX, levels: int = 127) -> None:
        self.graph, self.ranges, self.per_channel, self.products = graph, ranges, per_channel, products
        self.levels = levels    # int8 weights and signed grids on [-levels, levels]
        self.plain = plain      # what a MINMAX pair is written on (the target's plain_grid)
        self.paired = paired    # outputs read in int8; a float-output op's others get no pair (None: all do)
        self.out_grids = out_grids or {}    # output -> the one grid its int8 readers read it on (reader_grids)
        self.position = {n.name: i for i, n in enumerate(graph.nodes())}   # the original order, once
        # (value, grid) -> (its dequantized ref, scale, zero)
        self.pairs: dict[tuple[str, Grid], tuple[Ref, float, int]] = {}
        self.weights: dict[str, tuple[Ref, torch.Tensor]] = {}  # param -> (its dequantized ref, scales)
        self.dynamic: dict[str, Ref] = {}                       # value -> its per-call quantized ref

    def _const(self, name: str, value: torch.Tensor) -> Ref:
        node = self.graph.add_constant(self.graph.fresh_name(name), value)
        return Ref(node.name)

    def _pair(self, value: Ref, before: str, origin: Any, grid: Grid = Grid.MINMAX) -> tuple[Ref, float, int]:
        if (value.name, grid) not in self.pairs:
            scale, zero, dtype = grid_params(*self.ranges[value.name], self.plain if grid is Grid.MINMAX else grid,
                                             self.levels)
            s = self._const(f"{value.name}.scale", torch.tensor(scale, dtype=torch.float32))
            z = self._const(f"{value.name}.zero", torch.tensor(zero, dtype=dtype))
            q = new_node(self.graph, QUANTIZE, (value, s, z, 1), name=self.graph.fresh_name(f"{value.name}_q"),
                         before=before, origin=origin)
            dq = new_node(self.graph, DEQUANTIZE, (Ref(q.name), s, z, 1),
                          name=self.graph.fresh_name(f"{value.name}_dq"), before=before, origin=origin)
            self.pairs[value.name, grid] = (Ref(dq.name), scale, zero)
        return self.pairs[value.name, grid]

    def _weight(self, param: Node, axis: int) -> tuple[Ref, torch.Tensor]:
        if param.name not in self.weights:
            scales, q = int8_weight(self.graph.constants[param.name], axis if self.per_channel else None,
                                    self.levels)
            s = self._const(f"{param.name}.scale", scales)
            z = self._const(f"{param.name}.zero", torch.zeros(scales.shape, dtype=torch.int8))
            w = self._const(f"{param.name}.int8", q)
            dq = new_node(self.graph, DEQUANTIZE, (w, s, z, axis), name=f"{param.name}_dq",
                          before=self._first_user(param.name), origin=param.origin)
            self.graph.replace_all_uses(param.name, Ref(dq.name), only=lambda u: u.name != dq.name)
            remove_dead(self.graph, [param.name])
            self.weights[param.name] = (Ref(dq.name), scales)
        return self.weights[param.name]

    def _first_user(self, name: str) -> str:
        """The reader of ``name`` that runs first (readers of values being paired are original nodes)."""
        return min(self.graph.users(name), key=lambda u: self.position.get(u.name, len(self.position))).name

    def layer(self, node: Node, rule: Int8Rule, plan: "Plan") -> dict[str, Any]:
        """Quantize ``node`` as ``plan`` (made on the float graph, before any layer was written) says:
        a weight shared by several ops (a recurrent cell's, unrolled) is folded once and reused."""
        g = self.graph
        args = list(node.inputs)
        acts, found = plan
        record: dict[str, Any] = {"node": node.name, "op": str(node.op), "module": node.origin.module_path}
        in_scale = 1.0
        grids = operand_grids_of(rule, plan, self.products)
        for i, value in enumerate(args):
            if isinstance(value, Ref) and any(a.name == value.name for a in acts):
                grid = grids[min(i, 1)]
                args[i], in_scale, zero = self._pair(value, node.name, node.origin, grid)
                record.setdefault("inputs", []).append({"value": value.name, "dq": args[i].name, "scale": in_scale,
                                                        "zero_point": zero, "grid": grid.value})
        if found is not None:
            param, transposed = found
            axis = (1 - rule.weight_axis) if transposed else rule.weight_axis
            _, scales = self._weight(param, axis)
            record["weight"] = {"param": param.name, "axis": axis if self.per_channel else None,
                                "scale_min": float(scales.min()), "scale_max": float(scales.max())}
            args = _merge(args, g.node(node.name).inputs, rule.weight)
            if rule.bias is not None:
                args[rule.bias] = self._bias(args[rule.bias], scales * in_scale) or args[rule.bias]
        old = [r.name for r in g.node(node.name).inputs if isinstance(r, Ref)]
        g.replace(g.node(node.name).with_(inputs=tuple(args)))
        remove_dead(g, old)            # the float weight and bias, now read by nobody
        out = Ref(output_value(g, node))
        if g.users(out.name) and (self.paired is None or out.name in self.paired or not rule.float_output):
            dq, scale, zero = self._pair(out, self._first_user(out.name), g.node(out.name).origin,
                                         self.out_grids.get(out.name, Grid.MINMAX))
            q_name = g.node(dq.name).inputs[0].name
            g.replace_all_uses(out.name, dq, only=lambda u: u.name not in (q_name, dq.name))
            record["output"] = {"value": out.name, "scale": scale, "zero_point": zero}
        return record

    def dynamic_layer(self, node: Node, rule: Int8Rule, plan: "Plan") -> dict[str, Any]:
        """Quantize ``node``'s weight as :meth:`layer` does and its activation on each call
        (``mlcomp.dynamic_quantize_linear``); the bias stays float, the output is not quantized."""
        g = self.graph
        acts, (param, transposed) = plan
        args = list(g.node(node.name).inputs)
        record: dict[str, Any] = {"node": node.name, "op": str(node.op), "module": node.origin.module_path,
                                  "inputs": []}
        for i, value in enumerate(node.inputs):
            if isinstance(value, Ref) and any(a.name == value.name for a in acts):
                if value.name not in self.dynamic:
                    self.dynamic[value.name] = Ref(new_node(g, DYNAMIC_QUANTIZE, (value,), name=f"{value.name}_dyn",
                                                            before=node.name, origin=node.origin).name)
                args[i] = self.dynamic[value.name]
                record["inputs"].append({"value": value.name, "dq": args[i].name, "scale": None, "zero_point": None})
        axis = (1 - rule.weight_axis) if transposed else rule.weight_axis
        _, scales = self._weight(param, axis)
        record["weight"] = {"param": param.name, "axis": axis if self.per_channel else None,
                            "scale_min": float(scales.min()), "scale_max": float(scales.max())}
        g.replace(g.node(node.name).with_(inputs=tuple(_merge(args, g.node(node.name).inputs, rule.weight))))
        remove_dead(g, [param.name])
        return record

    def _bias(self, value: Any, scales: torch.Tensor) -> Ref | None:
        """The bias as int32 at ``scales`` (input scale × weight scale) with its dequantize, if a 1-D constant."""
        g = self.graph
        if not isinstance(value, Ref) or g.node(value.name).op != PARAM:
            return None
        b = g.constants[value.name].detach().float()
        if b.dim() != 1:
            return None
        scales = scales.expand(b.shape).to(torch.float32).contiguous() if scales.dim() else scales
        q = torch.clamp(torch.round(b / scales), -2 ** 31, 2 ** 31 - 1).to(torch.int32)
        s = self._const(f"{value.name}.scale", scales)
        z = self._const(f"{value.name}.zero", torch.zeros(scales.shape, dtype=torch.int32))
        w = self._const(f"{value.name}.int32", q)
        dq = new_node(g, DEQUANTIZE, (w, s, z, 0), name=f"{value.name}_dq", before=self._first_user(value.name))
        return Ref(dq.name)


def _merge(args: list[Any], current: Sequence[Any], weight: int) -> list[Any]:
    """``args`` with the weight argument as the graph now has it (its param rewired to the dequantize)."""
    out = list(args)
    out[weight] = current[weight]
    return out


Plan = tuple[list[Ref], "tuple[Node, bool] | None"]
"""What one int8 op quantizes: its per-tensor activations, and the weight PARAM (with whether it is read
through a transpose) folded to int8, if any."""


def plan(graph: Graph, node: Node, rule: Int8Rule) -> Plan:
    """``node``'s :data:`Plan` on the float graph."""
    found = weight_param(graph, node.inputs[rule.weight]) if rule.weight is not None else None
    return activations(graph, node, rule), found


def weight_param(graph: Graph, value: Any) -> tuple[Node, bool] | None:
    """The PARAM a weight argument reads (directly, or through one 2-D transpose: ``True``), else ``None``."""
    if not isinstance(value, Ref):
        return None
    node = graph.node(value.name)
    if node.op == PARAM:
        return node, False
    if node.op in _TRANSPOSES and isinstance(node.inputs[0], Ref):
        src = graph.node(node.inputs[0].name)
        if src.op == PARAM and len(src.tensor_meta.shape) == 2:
            return src, True
    return None


def activations(graph: Graph, node: Node, rule: Int8Rule) -> list[Ref]:
    """The arguments quantized per tensor: the rule's activations and a weight that is not a constant."""
    picks = list(rule.activations)
    if rule.weight is not None and weight_param(graph, node.inputs[rule.weight]) is None:
        picks.append(rule.weight)
    return [node.inputs[i] for i in picks if isinstance(node.inputs[i], Ref)]


def output_value(graph: Graph, node: Node) -> str:
    """The value an int8 op's output pair goes on: a ReLU that is its only reader (ONNX Runtime then drops
    the ReLU: quantizing to a grid whose zero point is 0 clips negatives exactly as ReLU does), else the op."""
    users = graph.users(node.name)
    return users[0].name if len(users) == 1 and users[0].op == _RELU else node.name


def drop_softmax_guard(graph: Graph, softmax: Node) -> int:
    """``where(row all -inf, 0, softmax(x))`` → ``softmax(x)`` for the guards of ``softmax`` (whose input will
    be read through a quantize/dequantize pair: finite, so no row is all ``-inf``); the guards removed."""
    done = 0
    for where in [u for u in graph.users(softmax.name) if u.op == P.WHERE]:
        cond, zeros, soft = where.inputs
        full = P.producer(graph, zeros, P.FULL_LIKE)
        chain = P.row_guard(graph, cond, softmax.inputs[0])
        if soft != Ref(softmax.name) or full is None or P.scalar(full.inputs[1]) != 0.0 or chain is None:
            continue
        graph.replace_all_uses(where.name, Ref(softmax.name))
        remove_dead(graph, [where.name, full.name, *chain])
        done += 1
    return done


def moved_from(graph: Graph, name: str, longest: int = 8, scaled: bool = False) -> str:
    """The value ``name`` only moves the elements of (through views and permutes, at most ``longest``; with
    ``scaled``, multiplies by a positive scalar too, which ``absorb_scalar_muls`` folds into a scale)."""
    node, steps = graph.node(name), 0
    while (node.op in _MOVES or scaled and _positive_scaling(node)) and steps < longest and node.inputs \
            and isinstance(node.inputs[0], Ref):
        node, steps = graph.node(node.inputs[0].name), steps + 1
    return node.name


def _positive_scaling(node: Node) -> bool:
    c = P.scalar(node.inputs[1]) if node.op in P.MUL and len(node.inputs) > 1 else None
    return c is not None and c > 0


def ranges_through_moves(graph: Graph, values: Sequence[str], outputs: Sequence[str],
                         ranges: dict[str, tuple[float, float]]) -> int:
    """Give each activation in ``values`` that only moves the elements of an int8 op's output (views,
    permutes) that output's range, in place; how many changed.

    Its elements already lie on that output's grid, so its pair then has the same scale and zero point and
    is an identity ONNX Runtime removes (a softmax's probabilities, on the fixed grid [0, 1], reshaped for
    ``P·V``: otherwise dequantized, reshaped and quantized again on the observed [0, max], two passes over
    the largest tensor of an attention layer and a second rounding)."""
    produced, changed = set(outputs), 0
    for name in values:
        src = moved_from(graph, name)
        if src != name and src in produced and src in ranges and ranges.get(name) != ranges[src]:
            ranges[name] = ranges[src]
            changed += 1
    return changed


def outputs_read_in_int8(graph: Graph, values: Sequence[str], outputs: Sequence[str]) -> set[str]:
    """The int8 ops' outputs (``outputs``) that an int8 op reads, directly or through moves (``values``: the
    int8 ops' activations).  A linear's output read only in float (a residual add, a GELU, the graph's
    output) gets no pair: ONNX Runtime's ``QGemm`` and ``MatMulIntegerToFloat`` and OpenVINO's
    ``FullyConnected`` write float, and a pair there would only round it (ops whose ORT kernel must write
    int8, ``QLinearConv``, ``QLinearAdd``…, keep theirs: :attr:`Int8Rule.float_output`)."""
    produced = set(outputs)
    return {src for src in (moved_from(graph, v, scaled=True) for v in values) if src in produced}


def operand_grids_of(rule: Int8Rule, plan: Plan, products: tuple[Grid, Grid]) -> tuple[Grid, Grid]:
    """The grids of an int8 op's first and further activation arguments: ``products`` for a product of two
    activations (no constant weight), else min-max."""
    return products if rule.product and plan[1] is None else (Grid.MINMAX, Grid.MINMAX)


def reader_grids(graph: Graph, layers: Sequence[tuple[Node, Int8Rule, Plan]], outputs: Sequence[str],
                 products: tuple[Grid, Grid]) -> dict[str, Grid]:
    """Each int8 op's output (``outputs``) that int8 ops read, through moves and positive scalings, on one
    grid only: that grid.  Its output pair then goes on that grid, and the readers' pairs (same range, same
    grid) are identities: on openvino the input projection of attention writes ``Q``, ``K`` and ``V``
    symmetric int8 as its ``MatMul`` operands take them, instead of uint8 quantized a second time to int8
    (a pass over each, and a second rounding).  A value read on two grids keeps min-max."""
    produced, wants = set(outputs), {}
    for node, rule, plan_ in layers:
        grids, names = operand_grids_of(rule, plan_, products), {a.name for a in plan_[0]}
        for i, value in enumerate(node.inputs):
            src = moved_from(graph, value.name, scaled=True) if isinstance(value, Ref) and value.name in names \
                else None
            if src in produced:
                wants.setdefault(src, set()).add(grids[min(i, 1)])
    return {src: next(iter(g)) for src, g in wants.items() if len(g) == 1}
