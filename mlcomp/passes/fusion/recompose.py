"""``recompose``: decomposed layer norm and GELU back into single ATen ops.

Decomposed layer norm (``mean``/``var`` or ``var_mean``, ``rsqrt`` or
``sqrt``/``div``, optional affine) becomes ``aten.native_layer_norm``; the erf
and tanh forms of GELU become ``aten.gelu``::

    %mean = aten.mean.dim(%x, [-1], True);  %sub = aten.sub(%x, %mean)
    %var = aten.var.correction(%x, [-1], correction=0, keepdim=True)
    %rsqrt = aten.rsqrt(aten.add(%var, 1e-05));  %y = aten.mul(%sub, %rsqrt)
  becomes
    %y = graph.getitem(aten.native_layer_norm(%x, [512], None, None, 1e-05), 0)

The rewrite keeps the name of the value it replaces (see ``builder.substitute``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar


from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.ir.ops import GETITEM
from mlcomp.passes import patterns as P
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option


@dataclass(frozen=True)
class Recompose(Pass):
    """Recompose decomposed layer norm and GELU into single ATen ops."""

    name: ClassVar[str] = "recompose"
    layernorm: bool = option(True, "mean/var/rsqrt chains → native_layer_norm")
    gelu: bool = option(True, "erf and tanh GELU formulas → gelu")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        stats = {"layernorms_recomposed": 0, "gelus_recomposed": 0}
        for node in reversed(graph.call_nodes()):          # outermost candidates first
            if node.name not in graph:
                continue
            if self.layernorm and _layernorm(graph, node):
                stats["layernorms_recomposed"] += 1
            elif self.gelu and _gelu(graph, node):
                stats["gelus_recomposed"] += 1
        return PassResult(graph, any(stats.values()), stats)


def _other(node: Node, value: Any) -> Any:
    a, b = node.inputs[:2]
    return b if a == value else a if b == value else None


def _layernorm(graph: Graph, root: Node) -> bool:
    """``root`` is norm, norm * weight or norm * weight + bias (either operand order)."""
    attempts: list[tuple[Any, Any, Any, list[str]]] = []      # (norm value, weight, bias, affine nodes)
    if root.op == P.ADD[0] and len(root.inputs) == 2:
        for b_side in (0, 1):
            m = P.producer(graph, root.inputs[1 - b_side], *P.MUL)
            if m is not None and len(m.inputs) == 2:
                for w_side in (0, 1):
                    attempts.append((m.inputs[1 - w_side], m.inputs[w_side], root.inputs[b_side],
                                     [root.name, m.name]))
    if root.op in P.MUL and len(root.inputs) == 2:
        for w_side in (0, 1):
            attempts.append((root.inputs[1 - w_side], root.inputs[w_side], None, [root.name]))
    attempts.append((Ref(root.name), None, None, []))
    for value, weight, bias, affine in attempts:
        norm = _normalized(graph, value)
        if norm is None or any(isinstance(p, Ref) and p == value for p in (weight, bias)):
            continue
        x, k, eps, inner = norm
        xm = P.meta_of(graph, x)
        shape = list(xm.shape[len(xm.shape) - k:])
        if any(p is not None and (P.meta_of(graph, p) is None or list(P.meta_of(graph, p).shape) != shape
                                  or P.meta_of(graph, p).dtype != xm.dtype) for p in (weight, bias)):
            continue
        matched = list(dict.fromkeys([root.name, *affine, *inner]))
        if not P.internal(graph, matched, root.name):
            continue
        ln = new_node(graph, P.LAYER_NORM, (x, shape, weight, bias, eps), name="native_layer_norm",
                      origin=root.origin, before=root.name)
        substitute(graph, root.name, GETITEM, (Ref(ln.name), 0), origin=root.origin)
        remove_dead(graph, matched[1:])
        return True
    return False


def _normalized(graph: Graph, value: Any) -> tuple[Any, int, float, list[str]] | None:
    """(x, k, eps, nodes) if ``value`` is (x - mean) / sqrt(var + eps) over the last k dims."""
    n = P.producer(graph, value, *P.MUL, *P.DIV)
    if n is None or len(n.inputs) != 2:
        return None
    for centered, denom in ((n.inputs[0], n.inputs[1]), (n.inputs[1], n.inputs[0])):
        d = P.producer(graph, denom, P.SQRT if n.op in P.DIV else P.RSQRT)
        if d is None:
            continue
        a = P.producer(graph, d.inputs[0], *P.ADD)
        sub = P.producer(graph, centered, P.SUB[0])
        if a is None or sub is None or P.scalar(a.inputs[1]) is None:
            continue
        x = sub.inputs[0]
        mean_nodes = _mean_of(graph, sub.inputs[1], x)
        var_nodes = _var_of(graph, a.inputs[0], x, sub)
        if mean_nodes is None or var_nodes is None or mean_nodes[0] != var_nodes[0]:
            continue
        return x, mean_nodes[0], P.scalar(a.inputs[1]), [n.name, d.name, a.name, sub.name] + \
            mean_nodes[1] + var_nodes[1]
    return None


def _reduced_dims(graph: Graph, node: Node, x: Any, dims_at: int) -> int | None:
    xm = P.meta_of(graph, x)
    if xm is None or node.inputs[0] != x:
        return None
    keep = P.arg(node, dims_at + 1, "keepdim", False)
    return P.last_dims(node.inputs[dims_at], len(xm.shape)) if keep else None


def _var_mean_part(graph: Graph, item: Node, x: Any, index: int) -> tuple[int, list[str]] | None:
    """``var_mean(x, correction=0)[index]`` over the last dims: (dims reduced, nodes matched)."""
    vm = P.producer(graph, item.inputs[0], P.VAR_MEAN)
    if vm is None or item.inputs[1] != index or vm.attrs.get("correction", 1) != 0:
        return None
    k = _reduced_dims(graph, vm, x, 1)
    return None if k is None else (k, [item.name, vm.name])


def _mean_of(graph: Graph, value: Any, x: Any) -> tuple[int, list[str]] | None:
    n = P.producer(graph, value, P.MEAN_DIM, GETITEM)
    if n is None:
        return None
    if n.op == GETITEM:                                        # var_mean(x)[1]
        return _var_mean_part(graph, n, x, 1)
    k = _reduced_dims(graph, n, x, 1)
    return None if k is None else (k, [n.name])


def _var_of(graph: Graph, value: Any, x: Any, sub: Node) -> tuple[int, list[str]] | None:
    n = P.producer(graph, value, P.MEAN_DIM, P.VAR, GETITEM)
    if n is None:
        return None
    if n.op == GETITEM:                                        # var_mean(x)[0]
        return _var_mean_part(graph, n, x, 0)
    if n.op == P.VAR:
        if n.attrs.get("correction", 1) != 0:
            return None
        k = _reduced_dims(graph, n, x, 1)
        return None if k is None else (k, [n.name])
    sq = P.producer(graph, n.inputs[0], P.POW_SCALAR, P.MUL[0])   # mean((x - mean)^2)
    if sq is None:
        return None
    if sq.op == P.POW_SCALAR:
        ok = P.scalar(sq.inputs[1]) == 2.0 and P.same_value(graph, sq.inputs[0], Ref(sub.name))
    else:
        ok = all(P.same_value(graph, a, Ref(sub.name)) for a in sq.inputs[:2])
    if not ok:
        return None
    xm = P.meta_of(graph, x)
    k = P.last_dims(n.inputs[1], len(xm.shape)) if P.arg(n, 2, "keepdim", False) else None
    operands = sq.inputs[:1] if sq.op == P.POW_SCALAR else sq.inputs[:2]
    extra = [r.name for r in dict.fromkeys(operands) if isinstance(r, Ref) and r.name != sub.name]
    return None if k is None else (k, [n.name, sq.name] + extra)


def _gelu(graph: Graph, root: Node) -> bool:
    """0.5 * x * (1 + erf(x / sqrt 2)) or 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))."""
    factors = P.mul_factors(graph, Ref(root.name))
    if not factors or len(factors) != 3 or not P.close(P.scalar(factors[2]), 0.5):
        return False
    for x, h in ((factors[0], factors[1]), (factors[1], factors[0])):
        add = P.producer(graph, h, *P.ADD)
        if add is None or len(add.inputs) != 2:
            continue
        one = [i for i in (0, 1) if P.scalar(add.inputs[i]) == 1.0]
        if not one:
            continue
        f = P.producer(graph, add.inputs[1 - one[0]], P.ERF, P.TANH)
        if f is None:
            continue
        inner = _gelu_arg(graph, f, x)
        if inner is None:
            continue
        matched = P.mul_tree(graph, Ref(root.name)) + [add.name, f.name] + inner
        if not P.internal(graph, dict.fromkeys(matched), root.name):
            return False
        attrs = {"approximate": "tanh"} if f.op == P.TANH else {}
        substitute(graph, root.name, P.GELU, (x,), attrs, origin=root.origin)
        remove_dead(graph, matched[1:])
        return True
    return False


def _gelu_arg(graph: Graph, f: Node, x: Any) -> list[str] | None:
    """Names of the nodes computing erf's or tanh's argument from ``x`` (None if it is not GELU's)."""
    u = f.inputs[0]
    if f.op == P.ERF:
        d = P.producer(graph, u, *P.DIV)
        if d is not None and d.inputs[0] == x and P.close(P.scalar(d.inputs[1]), math.sqrt(2.0)):
            return [d.name]
        fs = P.mul_factors(graph, u)
        if fs and len(fs) == 2 and fs[0] == x and P.close(P.scalar(fs[1]), math.sqrt(0.5)):
            return P.mul_tree(graph, u)
        return None
    fs = P.mul_factors(graph, u)
    if not fs or len(fs) != 2 or not P.close(P.scalar(fs[1]), math.sqrt(2.0 / math.pi)):
        return None
    inner = P.producer(graph, fs[0], *P.ADD)
    if inner is None or x not in inner.inputs[:2]:
        return None
    cube = _other(inner, x)
    cf = P.mul_factors(graph, cube)
    if not cf or not P.close(P.scalar(cf[-1]), 0.044715):
        return None
    terms = cf[:-1]
    names = P.mul_tree(graph, u) + [inner.name] + P.mul_tree(graph, cube)
    if terms == [x, x, x]:
        return names
    p = P.producer(graph, terms[0], P.POW_SCALAR) if len(terms) == 1 else None
    if p is not None and p.inputs[0] == x and P.scalar(p.inputs[1]) == 3.0:
        return names + [p.name]
    return None
