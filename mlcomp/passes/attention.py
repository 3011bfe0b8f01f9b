"""``fuse-attention``: scaled dot-product attention recovered from its decomposition.

``bmm → [scale] → [+ mask] → softmax → bmm`` becomes one
``aten.scaled_dot_product_attention`` (on 4-d operands, adding a leading dim to
3-d ones); scalar multiplications of the queries and keys feeding the first
bmm are folded into its ``scale``::

    %scores = aten.bmm(%q, %k_t);  %scaled = aten.mul(%scores, 0.125)
    %probs = aten._softmax(%scaled, -1, False);  %out = aten.bmm(%probs, %v)
  becomes
    %out = aten.scaled_dot_product_attention(%q4, %k4, %v4, None, 0.0, False, scale=0.125)

Where the bmm operands are views of 4-d (or higher) q, k, v with the heads
merged into the batch, and all three share those leading dims, the attention
takes them at their own rank (no views, one permute for the keys), which is the
layout runtimes fuse (OpenVINO's attention subgraph)::

    %q3 = aten.view(%q, [8, 8, 16]);  %kt = aten.reshape(aten.transpose(%k, -2, -1), [8, 16, 8]) ...
  becomes
    %sdpa = aten.scaled_dot_product_attention(%q, %k, %v, scale=0.25, attn_mask=%mask)   # [2, 4, 8, 16]
    %out = aten.reshape(%sdpa, [8, 8, 16])

The rewrite keeps the name of the value it replaces (see ``builder.substitute``).  It is shared
(:func:`fuse_attention`): ``quantize`` recovers attention first on a target that quantizes it whole.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.passes import patterns as P
from mlcomp.passes.layouts import fold_run, layout_step
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["FuseAttention", "fuse_attention"]


@dataclass(frozen=True)
class FuseAttention(Pass):
    """Rewrite bmm → scale → [mask add] → softmax → bmm as scaled_dot_product_attention."""

    name: ClassVar[str] = "fuse-attention"
    fold_scales: bool = option(True, "fold scalar multiplications of queries and keys into the scale")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        fused = fuse_attention(graph, self.fold_scales)
        return PassResult(graph, fused > 0, {"attention_fused": fused})


def fuse_attention(graph: Graph, fold_scales: bool = True, leave: Callable[[Node], bool] | None = None) -> int:
    """Rewrite every decomposed attention of ``graph`` in place (see the module docstring); how many.
    ``leave``: an attention any of whose matched nodes it names stays decomposed (``quantize``'s ``exclude``)."""
    fused = 0
    for node in graph.nodes(P.BMM):
        if node.name in graph and _attention(graph, node, fold_scales, leave):
            fused += 1
    return fused


def _through_views(graph: Graph, value: Any, matched: list[str]) -> Any:
    """Follow view/reshape/identity-expand producers that keep the last two dims."""
    while True:
        n = P.producer(graph, value, *P.SHAPE_OPS, P.EXPAND)
        src = P.meta_of(graph, n.inputs[0]) if n is not None else None
        if n is None or src is None or tuple(src.shape[-2:]) != tuple(n.meta.shape[-2:]) \
                or (n.op == P.EXPAND and src.shape != n.meta.shape):
            return value
        matched.append(n.name)
        value = n.inputs[0]


def _softmax_of(graph: Graph, value: Any, matched: list[str]) -> Any:
    """Scores under a (safe) softmax over the last dim, or None."""
    n = P.producer(graph, value, P.SOFTMAX, P.SAFE_SOFTMAX, P.WHERE)
    if n is None:
        return None
    if n.op == P.WHERE:                            # where(all -inf row, 0, softmax(s)): a safe softmax
        cond, zero, sm_ref = n.inputs
        sm = P.producer(graph, sm_ref, P.SOFTMAX)
        z = P.producer(graph, zero, P.FULL_LIKE)
        if sm is None or z is None or P.scalar(z.inputs[1]) != 0.0:
            return None
        guard = P.row_guard(graph, cond, sm.inputs[0])
        if guard is None:
            return None
        matched += [n.name, z.name, *guard]
        n = sm
    rank = len(n.meta.shape)
    if n.inputs[1] % rank != rank - 1 or (n.op == P.SOFTMAX and n.inputs[2]):
        return None
    matched.append(n.name)
    return n.inputs[0]


def _scaled_bmm(graph: Graph, value: Any) -> tuple[Node, float, list[str]] | None:
    """``bmm(q, k)`` [times or divided by a number], through views: (bmm, scale, nodes)."""
    names: list[str] = []
    scale = 1.0
    mul = P.producer(graph, value, *P.MUL, *P.DIV)
    if mul is not None and P.scalar(mul.inputs[1]) is not None:
        c = P.scalar(mul.inputs[1])
        scale = 1.0 / c if mul.op in P.DIV else c
        names.append(mul.name)
        value = mul.inputs[0]
    value = _through_views(graph, value, names)
    qk = P.producer(graph, value, P.BMM)
    return None if qk is None else (qk, scale, names + [qk.name])


def _strip(graph: Graph, value: Any, *, scales: bool, swaps: bool) -> tuple[Any, float, bool]:
    """Walk back from a bmm operand through leading-dim reshapes, identity expands, scalar
    multiplications (``scales``) and last-two-dim transposes (``swaps``).

    Returns (the value underneath, the product of the scalars, whether an odd number of
    transposes was crossed).  Reshapes must keep the last two dims, so the operand is the
    underlying value (transposed back if needed) viewed with other leading dims.
    """
    scale, odd = 1.0, False
    while (n := P.producer(graph, value)) is not None:
        src = P.meta_of(graph, n.inputs[0]) if n.inputs else None
        rank = len(n.meta.shape) if isinstance(n.meta, TensorMeta) else 0
        if n.op in P.SHAPE_OPS or n.op == P.EXPAND:
            if src is None or list(src.shape[-2:]) != list(n.meta.shape[-2:]) or \
                    n.op == P.EXPAND and src.shape != n.meta.shape:
                break
        elif n.op in P.PERMUTE_OPS and swaps and rank >= 2 and \
                P.perm_of(n, rank) == list(range(rank - 2)) + [rank - 1, rank - 2]:
            odd = not odd
        elif n.op in P.MUL and scales and P.scalar(n.inputs[1]) is not None and src is not None:
            scale *= P.scalar(n.inputs[1])
        else:
            break
        value = n.inputs[0]
    return value, scale, odd


def _operand(graph: Graph, value: Any, origin: Any, before: str, fold_scales: bool, *,
             keys: bool) -> tuple[Ref, float]:
    """The bmm operand without scalar factors; for the keys, transposed back to (..., S, E)."""
    base, c, odd = _strip(graph, value, scales=fold_scales, swaps=keys)
    shape = list(P.meta_of(graph, value).shape)
    if keys:
        shape = shape[:-2] + [shape[-1], shape[-2]]         # k is (B, S, E) where kᵀ was (B, E, S)
    make = lambda op, *args: Ref(new_node(graph, op, args, name=op.name.strip("_"), origin=origin,  # noqa: E731
                                          before=before).name)
    reshaped = lambda v, s: v if list(P.meta_of(graph, v).shape) == s else make(P.RESHAPE, v, s)  # noqa: E731
    if keys and odd:                           # the keys were transposed on the way: undo it
        return reshaped(base, shape), c
    if keys:
        kt = value if c == 1.0 else reshaped(base, shape[:-2] + [shape[-1], shape[-2]])
        return make(P.TRANSPOSE, kt, -2, -1), c
    return (value if c == 1.0 else reshaped(base, shape)), c


def _attention(graph: Graph, pv: Node, fold_scales: bool, leave: Callable[[Node], bool] | None = None) -> bool:
    matched: list[str] = []
    probs, v = pv.inputs
    s = _softmax_of(graph, _through_views(graph, probs, matched), matched)
    if s is None:
        return False
    s = _through_views(graph, s, matched)
    add = P.producer(graph, s, P.ADD[0])
    options: list[tuple[Any, Any]] = [(s, None)]
    if add is not None and all(P.meta_of(graph, a) is not None for a in add.inputs[:2]):
        options = [(add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])]
        matched.append(add.name)
    for scores, mask in options:
        found = _scaled_bmm(graph, scores)
        if found is not None:
            break
    else:
        return False
    qk, scale, names = found
    matched += names
    if any(P.meta_of(graph, Ref(n)).is_dynamic for n in (qk.name, pv.name)):
        return False                          # the operands are rebuilt with static shapes
    if mask is not None and P.meta_of(graph, mask).dtype != qk.meta.dtype:
        return False
    if not P.internal(graph, matched + [pv.name], pv.name):
        return False
    if leave is not None and any(leave(graph.node(n)) for n in matched + [pv.name]):
        return False
    origin = pv.origin
    native = _native(graph, qk, pv, fold_scales)
    if native is not None:
        v_view = pv.inputs[1]
        sdpa = _rewrite_native(graph, qk, pv, add, mask, scale, native)
        remove_dead(graph, matched + [v_view.name] if isinstance(v_view, Ref) else matched)
        _fold_around(graph, sdpa)
        return True
    q, c_q = _operand(graph, qk.inputs[0], origin, qk.name, fold_scales, keys=False)
    k, c_k = _operand(graph, qk.inputs[1], origin, qk.name, fold_scales, keys=True)
    scale *= c_q * c_k
    attrs: dict[str, Any] = {"scale": scale}
    if mask is not None:
        scores = P.meta_of(graph, Ref(qk.name))
        mask_meta = P.meta_of(graph, mask)
        if tuple(mask_meta.shape[-2:]) != tuple(scores.shape[-2:]) or len(mask_meta.shape) > len(scores.shape):
            full = P.meta_of(graph, Ref(add.name)).shape
            mask = Ref(new_node(graph, P.EXPAND, (mask, list(full)), name="expand", origin=origin,
                                before=qk.name).name)
            mask = Ref(new_node(graph, P.RESHAPE, (mask, list(scores.shape)), name="reshape", origin=origin,
                                before=qk.name).name)
        attrs["attn_mask"] = mask
    if len(P.meta_of(graph, q).shape) == 3:      # 4-d attention is what every exporter understands
        q, k, v = (Ref(new_node(graph, P.UNSQUEEZE, (t, 0), name="unsqueeze", origin=origin,
                                before=qk.name).name) for t in (q, k, v))
        sdpa = new_node(graph, P.SDPA, (q, k, v), attrs, name="scaled_dot_product_attention", origin=origin,
                        before=pv.name)
        substitute(graph, pv.name, P.SQUEEZE_DIMS, (Ref(sdpa.name), [0]), origin=origin)
    else:
        sdpa = substitute(graph, pv.name, P.SDPA, (q, k, v), attrs, origin=origin)
    remove_dead(graph, matched)
    _fold_around(graph, sdpa)
    return True


def _fold_around(graph: Graph, sdpa: Node) -> None:
    """The layout runs into the attention's q, k, v and out of it, each as at most reshape → permute →
    reshape (:func:`~mlcomp.passes.layouts.fold_run`).  At batch 1 a head split ``reshape [s, h, d] →
    permute [1, 0, 2] → unsqueeze 0`` becomes ``reshape [1, s, h, d] → permute [0, 2, 1, 3]``, the layout
    the runtimes take into their attention kernel, as at any other batch (``squeeze`` after it the same)."""
    for value in sdpa.inputs[:3]:
        if isinstance(value, Ref) and value.name in graph:
            fold_run(graph, graph.node(value.name))
    end = graph.node(sdpa.name)
    while len(users := graph.users(end.name)) == 1 and layout_step(users[0]) is not None:
        end = users[0]
    if end.name != sdpa.name:
        fold_run(graph, end)


def _native(graph: Graph, qk: Node, pv: Node, fold_scales: bool) -> tuple[Any, Any, Any, float] | None:
    """``(q, k, v, scale)`` at the rank they were computed in, where the bmm operands are views of them with
    the leading dims merged (heads into the batch) and all three share those leading dims; else None."""
    q, c_q, _ = _strip(graph, qk.inputs[0], scales=fold_scales, swaps=False)
    k, c_k, odd = _strip(graph, qk.inputs[1], scales=fold_scales, swaps=True)
    v, _, _ = _strip(graph, pv.inputs[1], scales=False, swaps=False)
    metas = [P.meta_of(graph, t) for t in (q, k, v)]
    if any(m is None or len(m.shape) < 4 or m.is_dynamic for m in metas):
        return None
    lead = list(metas[0].shape[:-2])
    k_shape = list(metas[1].shape) if odd else [*metas[1].shape[:-2], metas[1].shape[-1], metas[1].shape[-2]]
    if list(metas[2].shape[:-2]) != lead or k_shape[:-2] != lead or math.prod(lead) != qk.meta.shape[0] \
            or k_shape[-1] != metas[0].shape[-1] or k_shape[-2] != metas[2].shape[-2]:
        return None
    if not odd:                                # k arrived as kᵀ: the attention takes k (one permute, not two)
        rank = len(metas[1].shape)
        swap = list(range(rank - 2)) + [rank - 1, rank - 2]
        made = P.producer(graph, k, *P.PERMUTE_OPS)
        perm = P.perm_of(made, rank) if made is not None else None
        base, perm = (made.inputs[0], [perm[i] for i in swap]) if perm is not None else (k, swap)
        k = Ref(new_node(graph, P.PERMUTE, (base, perm), name="permute", origin=pv.origin, before=qk.name).name)
    return q, k, v, c_q * c_k


def _rewrite_native(graph: Graph, qk: Node, pv: Node, add: Node | None, mask: Any, scale: float,
                    native: tuple[Any, Any, Any, float]) -> Node:
    """``pv`` becomes a view of one attention over ``native``'s q, k, v (the mask viewed to match)."""
    q, k, v, c = native
    origin = pv.origin
    lead = list(P.meta_of(graph, q).shape[:-2])
    attrs: dict[str, Any] = {"scale": scale * c}
    if mask is not None:
        scores = list(P.meta_of(graph, Ref(qk.name)).shape)
        want = lead + scores[-2:]
        shape = list(P.meta_of(graph, mask).shape)
        full = list(P.meta_of(graph, Ref(add.name)).shape)
        kept = len(shape) == 2 or shape[0] == 1 and len(shape) == 3 or _broadcasts(shape, full, want)
        if shape != want and not kept:
            if shape != full:
                mask = Ref(new_node(graph, P.EXPAND, (mask, full), name="expand", origin=origin,
                                    before=qk.name).name)
            mask = Ref(new_node(graph, P.RESHAPE, (mask, want), name="reshape", origin=origin,
                                before=qk.name).name)
        attrs["attn_mask"] = mask
    sdpa = new_node(graph, P.SDPA, (q, k, v), attrs, name="scaled_dot_product_attention", origin=origin,
                    before=pv.name)
    substitute(graph, pv.name, P.RESHAPE, (Ref(sdpa.name), list(pv.meta.shape)), origin=origin)
    return sdpa


def _broadcasts(shape: list[Any], full: list[Any], want: list[Any]) -> bool:
    """Whether a mask of ``shape`` added to the scores at the attention's own rank (``full == want``) broadcasts
    as it is: the attention broadcasts its mask the same way (a ``[b, 1, s, s]`` mask stays that size, not one
    copy per head)."""
    return full == want and len(shape) == len(want) and all(a == 1 or a == b for a, b in zip(shape, want))

