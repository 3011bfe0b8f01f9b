"""Cleanup: dead-code elimination, common-subexpression elimination, no-op removal.

``simplify`` removes operations that do not change a value::

    before                                            after
    %view: f32[4, 8] = aten.view(%x, [4, 8])          (gone: %x already is f32[4, 8])
    %p1 = aten.permute(%x, [1, 0])                    (both gone: the permutes cancel)
    %p2 = aten.permute(%p1, [1, 0])
    %c = aten._to_copy(%x, dtype=f32)                 (gone: %x already is f32)
    %d = aten.clone(%y)                               (gone in inference graphs; in training graphs
                                                      when it gives back the same tensor: copies.py)
    %r = aten.relu(%d)                                %r = aten.relu(%y)

``cse`` merges nodes that compute the same pure op on the same arguments,
``dce`` drops nodes (and parameters) nobody reads, and ``cleanup`` runs
``simplify``, ``fold-constants``, ``cse`` and ``dce`` until nothing changes.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from mlcomp.passes import patterns as P
from mlcomp.passes.cleanup.copies import training_copy
from mlcomp.passes.cleanup.folding import FoldConstants

from mlcomp.ir import Graph, Mode, Node, Ref, TensorMeta
from mlcomp.ir.builder import remove_dead
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM, Category, category
from mlcomp.pipeline.composite import CompositePass, FixedPoint, Sequential
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option


@dataclass(frozen=True)
class DeadCodeElimination(Pass):
    """Remove nodes whose values nobody reads, and unused parameters."""

    name: ClassVar[str] = "dce"
    keep_params: bool = option(False, "keep parameters that no node reads")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        nodes = params = freed = 0
        for node in reversed(graph.nodes()):
            if node.op in (INPUT, OUTPUT) or graph.users(node.name):
                continue
            if node.op == PARAM:
                if self.keep_params:
                    continue
                params += 1
                freed += graph.constants[node.name].nbytes
            elif P.is_pure(node.op):
                nodes += 1
            else:
                continue
            graph.erase(node.name)
        return PassResult(graph, bool(nodes or params),
                          {"nodes_removed": nodes, "params_removed": params, "param_bytes_removed": freed})


@dataclass(frozen=True)
class CommonSubexpressionElimination(Pass):
    """Merge nodes that apply the same pure op to the same arguments."""

    name: ClassVar[str] = "cse"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        seen: dict[Any, str] = {}
        merged = 0
        for name in list(graph.order()):
            node = graph.node(name)
            if not P.is_pure(node.op):
                continue
            try:
                key = (node.op, _freeze(node.inputs), _freeze(dict(node.attrs)))
                hash(key)
            except TypeError:
                continue
            if key in seen:
                graph.replace_all_uses(name, seen[key])
                graph.erase(name)
                merged += 1
            else:
                seen[key] = name
        return PassResult(graph, merged > 0, {"nodes_merged": merged})


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, float):
        return ("float", value)          # 1.0 and 1 are different literals
    if isinstance(value, torch.Tensor):
        raise TypeError("tensor literal")
    return value


# ---------------------------------------------------------------------------
# simplify

# exact widening casts: every value of the first dtype is representable in the second
_EXACT = {
    torch.float16: {torch.float32, torch.float64}, torch.bfloat16: {torch.float32, torch.float64},
    torch.float32: {torch.float64},
    torch.int8: {torch.int16, torch.int32, torch.int64, torch.float32, torch.float64},
    torch.uint8: {torch.int16, torch.int32, torch.int64, torch.float32, torch.float64},
    torch.int16: {torch.int32, torch.int64, torch.float32, torch.float64},
    torch.int32: {torch.int64, torch.float64},
    torch.bool: {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64},
}


@dataclass(frozen=True)
class Simplify(Pass):
    """Remove no-ops: identity views/casts/permutes, cancelling pairs, eval-mode dropout and copies."""

    name: ClassVar[str] = "simplify"
    max_rounds: int = option(8, "sweeps over the graph before giving up on a fixed point", ge=1)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        stats: collections.Counter[str] = collections.Counter()
        rules = _rules(graph.mode)
        for _ in range(self.max_rounds):
            changed = False
            unread: list[str] = []                 # inputs of rewritten nodes: maybe dead now
            for name in list(graph.order()):
                if name not in graph:
                    continue
                node = graph.node(name)
                for kind, rule in rules:
                    if rule(graph, node):
                        stats[kind] += 1
                        changed = True
                        unread += node.input_names()
                        break
            remove_dead(graph, unread)
            if not changed:
                break
        return PassResult(graph, bool(stats), dict(stats))


Rule = Callable[[Graph, Node], bool]


def _rules(mode: Mode) -> list[tuple[str, Rule]]:
    rules: list[tuple[str, Rule]] = [
        ("copies_removed", _identity_op),
        ("reshapes_removed", _identity_shape),
        ("reshapes_removed", _unsqueeze_squeeze),
        ("reshapes_removed", _shape_chain),
        ("transposes_removed", _permutes),
        ("casts_removed", _same_dtype_cast),
        ("casts_removed", _cast_pair),
        ("arithmetic_removed", _arith_identity),
        ("slices_removed", _full_slice),
    ]
    if mode is Mode.INFERENCE:
        rules += [("copies_removed", _inference_copy), ("dropouts_removed", _dropout)]
    else:                   # a clone giving back the same tensor (a p=0 dropout's): mlcomp.passes.cleanup.copies
        rules.append(("copies_removed", training_copy))
    return rules


def _forward(graph: Graph, node: Node, value: Any) -> bool:
    """Make every user of ``node`` read ``value`` instead, then drop ``node``."""
    if not isinstance(value, Ref) or value.name == node.name:
        return False
    graph.replace_all_uses(node.name, value)
    graph.erase(node.name)
    return True


def _meta(node: Node) -> TensorMeta | None:
    return node.meta if isinstance(node.meta, TensorMeta) else None


def _same(graph: Graph, node: Node, value: Any) -> bool:
    a, b = _meta(node), P.meta_of(graph, value)
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype


def _identity_op(graph: Graph, node: Node) -> bool:
    return node.op in P.IDENTITY_OPS and _forward(graph, node, node.inputs[0])


def _identity_shape(graph: Graph, node: Node) -> bool:
    if node.op in P.SHAPE_OPS or node.op == P.EXPAND:
        return _same(graph, node, node.inputs[0]) and _forward(graph, node, node.inputs[0])
    return False


def _shape_chain(graph: Graph, node: Node) -> bool:
    """view(view(x, s1), s2) → view(x, s2) (reshape if either was a reshape); (un)squeezes count too."""
    reshapes = P.SHAPE_OPS | P.SQUEEZE_OPS | {P.UNSQUEEZE}
    if node.op not in reshapes:
        return False
    inner = P.producer(graph, node.inputs[0], *reshapes)
    if inner is None:
        return False
    op = P.RESHAPE if P.RESHAPE in (node.op, inner.op) else P.VIEW
    if node.op in P.SHAPE_OPS:
        shape = node.inputs[1]
    elif _meta(node) is not None and not _meta(node).is_dynamic:
        shape = list(_meta(node).shape)
    else:
        return False
    graph.replace(node.with_(op=op, inputs=(inner.inputs[0], shape), attrs={}))
    return True


def _permutes(graph: Graph, node: Node) -> bool:
    """Identity permutes vanish; permute(permute(x)) becomes one permute (or x)."""
    m = _meta(node)
    if node.op not in P.PERMUTE_OPS or m is None:
        return False
    rank = len(m.shape)
    perm = P.perm_of(node, rank)
    if perm == list(range(rank)):
        return _forward(graph, node, node.inputs[0])
    inner = P.producer(graph, node.inputs[0], *P.PERMUTE_OPS)
    if inner is None:
        return False
    total = P.compose_perms(P.perm_of(inner, rank), perm)
    if total == list(range(rank)):
        return _forward(graph, node, inner.inputs[0])
    graph.replace(node.with_(op=P.PERMUTE, inputs=(inner.inputs[0], total), attrs={}))
    return True


def _unsqueeze_squeeze(graph: Graph, node: Node) -> bool:
    if node.op not in P.SQUEEZE_OPS:
        return False
    inner = P.producer(graph, node.inputs[0], P.UNSQUEEZE)
    if inner is None or _meta(inner) is None:
        return False
    rank = len(_meta(inner).shape)
    dims = node.inputs[1] if isinstance(node.inputs[1], (list, tuple)) else [node.inputs[1]]
    if len(dims) == 1 and dims[0] % rank == inner.inputs[1] % rank:
        return _forward(graph, node, inner.inputs[0])
    return False


def _plain_cast(node: Node) -> bool:
    """A ``_to_copy`` that only changes dtype (no device/layout/memory format change)."""
    if node.op != P.TO_COPY or len(node.inputs) != 1 or "dtype" not in node.attrs:
        return False
    harmless = {"memory_format": torch.preserve_format, "non_blocking": False}
    return all(k == "dtype" or v is None or harmless.get(k, object()) == v for k, v in node.attrs.items())


def _same_dtype_cast(graph: Graph, node: Node) -> bool:
    if node.op != P.TO_COPY or not _plain_cast(node):
        return False
    return _same(graph, node, node.inputs[0]) and _forward(graph, node, node.inputs[0])


def _cast_pair(graph: Graph, node: Node) -> bool:
    """cast(cast(x: A → B) → C) with A → B exact: cast(x → C), or x when C is A."""
    if not _plain_cast(node):
        return False
    inner = P.producer(graph, node.inputs[0], P.TO_COPY)
    if inner is None or not _plain_cast(inner):
        return False
    src = P.meta_of(graph, inner.inputs[0])
    mid = _meta(inner)
    if src is None or mid is None or mid.dtype not in _EXACT.get(src.dtype, ()):
        return False
    if node.attrs["dtype"] == src.dtype:
        return _forward(graph, node, inner.inputs[0])
    graph.replace(node.with_(inputs=(inner.inputs[0],)))
    return True


def _arith_identity(graph: Graph, node: Node) -> bool:
    """x * 1, x / 1, x + 0, x - 0 (only when the result has x's shape and dtype)."""
    if len(node.inputs) < 2 or node.attrs.get("alpha", 1) != 1:
        return False
    s = P.scalar(node.inputs[1])
    neutral = 1.0 if node.op in P.MUL + P.DIV else 0.0 if node.op in P.ADD + P.SUB else None
    if neutral is None or s != neutral:
        return False
    return _same(graph, node, node.inputs[0]) and _forward(graph, node, node.inputs[0])


def _full_slice(graph: Graph, node: Node) -> bool:
    if node.op != P.SLICE:
        return False
    m = P.meta_of(graph, node.inputs[0])
    if m is None:
        return False
    dim = P.arg(node, 1, "dim", 0)
    start, end, step = P.arg(node, 2, "start", None), P.arg(node, 3, "end", None), P.arg(node, 4, "step", 1)
    size = m.shape[dim % len(m.shape)]
    if isinstance(size, int) and start in (None, 0) and step == 1 and (end is None or (isinstance(end, int)
                                                                                        and end >= size)):
        return _forward(graph, node, node.inputs[0])
    return False


def _inference_copy(graph: Graph, node: Node) -> bool:
    """detach and clone are copies of the value when no gradient flows.

    A removed clone may have been what made a later ``view`` legal (views need
    compatible strides), so views reached through view-like ops become reshapes;
    a later ``as_strided`` keeps the clone.
    """
    if node.op not in P.INFERENCE_IDENTITY_OPS:
        return False
    if node.op == P.CLONE:
        views = _strided_users(graph, node.name)
        if views is None:
            return False
        for name in views:
            v = graph.node(name)
            graph.replace(v.with_(op=P.RESHAPE, inputs=v.inputs[:2], attrs={}))
    return _forward(graph, node, node.inputs[0])


def _strided_users(graph: Graph, name: str) -> list[str] | None:
    """Views downstream of ``name`` that may see its strides (None if one needs real strides).

    Strides travel through view-like ops, through views themselves (a view of a
    permuted tensor is still permuted) and through elementwise ops, whose
    results copy their input's layout.
    """
    out: list[str] = []
    stack, seen = [name], {name}
    while stack:
        for user in graph.users(stack.pop()):
            if user.name in seen:
                continue
            seen.add(user.name)
            if user.op == P.AS_STRIDED:
                return None
            if user.op in (P.VIEW, P.UNSAFE_VIEW):
                out.append(user.name)
            if user.op in P.VIEW_LIKE or category(user.op) <= Category.BROADCAST:
                stack.append(user.name)
    return out


def _dropout(graph: Graph, node: Node) -> bool:
    """Dropout is the identity in eval mode (an inference graph is always eval)."""
    if node.op == P.DROPOUT:
        return _forward(graph, node, node.inputs[0])
    if node.op == P.NATIVE_DROPOUT:
        kept = [u for u in graph.users(node.name) if u.inputs[1] == 0]
        for u in kept:
            _forward(graph, u, node.inputs[0])
        return bool(kept)
    return False


# ---------------------------------------------------------------------------
# cleanup


@dataclass(frozen=True)
class Cleanup(CompositePass):
    """Run simplify, fold-constants, cse and dce until the graph stops changing."""

    name: ClassVar[str] = "cleanup"
    max_iterations: int = option(4, "rounds of the four passes before stopping", ge=1)
    fold: bool = option(True, "fold constant subgraphs (fold-constants)")
    fold_max_bytes: int = option(1 << 20, "largest folded constant that may be bigger than its inputs", ge=0)
    fold_params: bool = option(True, "also fold subgraphs that read only parameters (inference graphs)")

    def body(self) -> FixedPoint:
        fold = [FoldConstants(max_bytes=self.fold_max_bytes, params=self.fold_params)] if self.fold else []
        return FixedPoint(Sequential(Simplify(), *fold, CommonSubexpressionElimination(), DeadCodeElimination()),
                          self.max_iterations)


__all__ = ["DeadCodeElimination", "CommonSubexpressionElimination", "Simplify", "Cleanup"]
