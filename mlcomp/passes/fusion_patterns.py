"""Pattern fusions: batch-norm folding, bias epilogues, attention, recomposed norms and GELU.

``fold-batchnorm`` (inference only) folds eval-mode batch norm into the
convolution before it::

    %convolution = aten.convolution(%x, %conv.weight, None, ...)            # conv
    %bn = aten._native_batch_norm_legit_no_training(%convolution, %bn.weight, %bn.bias,
                                                    %bn.running_mean, %bn.running_var, 0.1, 1e-05)
    %getitem = graph.getitem(%bn, 0)
  becomes
    %conv.weight_bnfold: f32[64, 3, 3, 3] = param                           # conv
    %conv.bias_bnfold: f32[64] = param                                      # conv
    %getitem = aten.convolution(%x, %conv.weight_bnfold, %conv.bias_bnfold, ...)

``fuse-attention``: ``bmm → [scale] → [+ mask] → softmax → bmm`` becomes one
``aten.scaled_dot_product_attention`` (on 4-d operands, adding a leading dim to
3-d ones); scalar multiplications of the queries and keys feeding the first
bmm are folded into its ``scale``.

``fold-bias``: ``bmm(x, expand(w))`` (a linear layer on 3-d input) becomes ``mm``
on the flattened input, and ``mm + bias`` / ``convolution + bias`` fold into
``addmm`` / the convolution's bias.

``recompose``: decomposed layer norm (``mean``/``var``/``rsqrt`` or ``sqrt``/``div``,
optional affine) becomes ``aten.native_layer_norm``; the erf and tanh forms of
GELU become ``aten.gelu``.

Every rewrite keeps the name of the value it replaces (see ``builder.substitute``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from mlcomp.passes import patterns as P

from mlcomp.base.errors import PassFailure
from mlcomp.ir import Graph, Mode, Node, Ref, TensorMeta
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.ir.ops import GETITEM, PARAM
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

# ---------------------------------------------------------------------------
# batch norm


@dataclass(frozen=True)
class FoldBatchNorm(Pass):
    """Fold eval-mode batch norm into the preceding convolution's weight and bias (inference only)."""

    name: ClassVar[str] = "fold-batchnorm"
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.INFERENCE})

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if graph.mode is Mode.TRAINING:
            raise PassFailure(
                f"fold-batchnorm folds the running statistics of eval-mode batch norm into the "
                f"convolution weights, but graph {graph.name} is a training graph: there the statistics "
                f"change every step and the weights are being learnt",
                hint="drop fold-batchnorm from the pipeline (fuse skips it on training graphs by itself), "
                     "or capture the model in inference mode")
        folded = 0
        for bn in graph.nodes(P.BATCH_NORM_EVAL):
            folded += _fold_one(graph, bn)
        return PassResult(graph, folded > 0, {"batchnorms_folded": folded})


def _fold_one(graph: Graph, bn: Node) -> int:
    x, gamma, beta, mean, var, _momentum, eps = bn.inputs[:7]
    conv = P.producer(graph, x, P.CONVOLUTION)
    if conv is None or conv.inputs[6] or not P.only_user(graph, conv.name, bn.name):
        return 0                                   # transposed or shared convolutions stay
    outs = graph.users(bn.name)
    if len(outs) != 1 or outs[0].op != GETITEM or outs[0].inputs[1] != 0:
        return 0
    consts = [conv.inputs[1], conv.inputs[2], gamma, beta, mean, var]
    if not all(v is None or P.producer(graph, v, PARAM) is not None for v in consts) or mean is None:
        return 0
    t = lambda v: None if v is None else graph.constants[v.name]  # noqa: E731
    weight, bias = t(conv.inputs[1]), t(conv.inputs[2])
    with torch.no_grad():
        scale = torch.rsqrt(t(var).double() + eps)
        if gamma is not None:
            scale = scale * t(gamma).double()
        shift = -t(mean).double() * scale
        if bias is not None:
            shift = shift + bias.double() * scale
        if beta is not None:
            shift = shift + t(beta).double()
        new_w = (weight.double() * scale.reshape(-1, *[1] * (weight.dim() - 1))).to(weight.dtype)
        new_b = shift.to(weight.dtype)
    prefix = conv.inputs[1].name.rpartition(".")[0]
    w_ref = graph.add_constant(graph.fresh_name(f"{prefix}.weight_bnfold"), new_w, origin=conv.origin)
    b_ref = graph.add_constant(graph.fresh_name(f"{prefix}.bias_bnfold"), new_b, origin=conv.origin)
    args = (conv.inputs[0], Ref(w_ref.name), Ref(b_ref.name), *conv.inputs[3:])
    substitute(graph, outs[0].name, P.CONVOLUTION, args, conv.attrs, origin=conv.origin)
    remove_dead(graph, [bn.name])
    return 1


# ---------------------------------------------------------------------------
# attention


@dataclass(frozen=True)
class FuseAttention(Pass):
    """Rewrite bmm → scale → [mask add] → softmax → bmm as scaled_dot_product_attention."""

    name: ClassVar[str] = "fuse-attention"
    fold_scales: bool = option(True, "fold scalar multiplications of queries and keys into the scale")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        fused = 0
        for node in graph.nodes(P.BMM):
            if node.name in graph and _attention(graph, node, self.fold_scales):
                fused += 1
        return PassResult(graph, fused > 0, {"attention_fused": fused})


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
        guard = _row_guard(graph, cond, sm.inputs[0])
        if guard is None:
            return None
        matched += [n.name, z.name, *guard]
        n = sm
    rank = len(n.meta.shape)
    if n.inputs[1] % rank != rank - 1 or (n.op == P.SOFTMAX and n.inputs[2]):
        return None
    matched.append(n.name)
    return n.inputs[0]


def _row_guard(graph: Graph, cond: Any, scores: Any) -> list[str] | None:
    """logical_not(any(logical_not(eq(scores, -inf)), -1, True)) → its node names."""
    chain = []
    n1 = P.producer(graph, cond, P.LOGICAL_NOT)
    n2 = n1 and P.producer(graph, n1.inputs[0], P.ANY_DIM)
    n3 = n2 and P.producer(graph, n2.inputs[0], P.LOGICAL_NOT)
    n4 = n3 and P.producer(graph, n3.inputs[0], P.EQ_SCALAR)
    if not n4 or n4.inputs[0] != scores or P.scalar(n4.inputs[1]) != -math.inf:
        return None
    chain += [n1.name, n2.name, n3.name, n4.name]
    return chain


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


def _attention(graph: Graph, pv: Node, fold_scales: bool) -> bool:
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
    origin = pv.origin
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
        substitute(graph, pv.name, P.SDPA, (q, k, v), attrs, origin=origin)
    remove_dead(graph, matched)
    return True


# ---------------------------------------------------------------------------
# recompose


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


# ---------------------------------------------------------------------------
# bias epilogues


@dataclass(frozen=True)
class FoldBias(Pass):
    """Turn bmm with a broadcast weight into mm, and fold bias adds into addmm/convolution."""

    name: ClassVar[str] = "fold-bias"

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        linear = linearize_bmm(graph)
        biases = fold_bias_adds(graph)
        return PassResult(graph, linear + biases > 0, {"bmm_linearized": linear, "biases_folded": biases})


def linearize_bmm(graph: Graph) -> int:
    """``bmm(a[B, M, K], expand(w[K, N]))`` (a linear layer on 3-d input) → ``mm`` on ``a`` as [B*M, K]."""
    count = 0
    for node in graph.nodes(P.BMM):
        a, b = node.inputs
        while (v := P.producer(graph, b, *P.SHAPE_OPS)) is not None and v.meta == P.meta_of(graph, v.inputs[0]):
            b = v.inputs[0]                          # identity views left by capture
        e = P.producer(graph, b, P.EXPAND)
        am, wm = P.meta_of(graph, a), P.meta_of(graph, e.inputs[0]) if e is not None else None
        if e is None or wm is None or am is None or am.is_dynamic or node.meta.is_dynamic \
                or not (len(wm.shape) == 2 or len(wm.shape) == 3 and wm.shape[0] == 1):
            continue
        (batch, m, k), n = am.shape, node.meta.shape[2]
        make = lambda op, *args, name: Ref(new_node(graph, op, args, name=name, origin=node.origin,  # noqa: E731
                                                    before=node.name).name)
        w = e.inputs[0] if len(wm.shape) == 2 else make(P.RESHAPE, e.inputs[0], [k, n], name="reshape")
        mm = make(P.MM, make(P.RESHAPE, a, [batch * m, k], name="reshape"), w, name="mm")
        substitute(graph, node.name, P.RESHAPE, (mm, [batch, m, n]), origin=node.origin)
        remove_dead(graph, [e.name])
        count += 1
    return count


def fold_bias_adds(graph: Graph) -> int:
    """``mm(a, b) [viewed] + t`` → ``addmm(t, a, b)``; ``convolution(x, w, None) + b[C, 1, 1]`` → conv with bias."""
    count = 0
    for node in graph.nodes(P.ADD[0]):
        if node.name not in graph or len(node.inputs) != 2 or node.attrs.get("alpha", 1) != 1:
            continue
        for i in (0, 1):
            if _fold_bias(graph, node, node.inputs[i], node.inputs[1 - i]):
                count += 1
                break
    return count


def _fold_bias(graph: Graph, add: Node, src: Any, bias: Any) -> bool:
    bm, out = P.meta_of(graph, bias), add.meta
    if bm is None or bm.dtype != out.dtype:
        return False
    views: list[str] = []                           # single-use reshapes between the matmul and the add
    reader, value = add.name, src
    while (v := P.producer(graph, value, *P.SHAPE_OPS)) is not None and P.only_user(graph, v.name, reader):
        views.append(v.name)
        reader, value = v.name, v.inputs[0]
    mm = P.producer(graph, value, P.MM, P.CONVOLUTION)
    if mm is None or not P.only_user(graph, mm.name, reader) or views and mm.op != P.MM:
        return False
    if tuple(P.meta_of(graph, src).shape) != tuple(out.shape) or views and out.is_dynamic:
        return False                                 # the bias must not broadcast the result bigger
    make = lambda op, *args, name: Ref(new_node(graph, op, args, name=name, origin=mm.origin,  # noqa: E731
                                                before=mm.name).name)
    if mm.op == P.MM and not views:
        substitute(graph, add.name, P.ADDMM, (bias, *mm.inputs[:2]), origin=mm.origin)
    elif mm.op == P.MM:                              # (mm viewed as [..., N]) + bias[N]
        n = mm.meta.shape[-1]
        if out.shape[-1] != n or any(d != 1 for d in bm.shape[:-1]) or bm.shape[-1] not in (1, n):
            return False
        flat = bias if len(bm.shape) == 1 else make(P.RESHAPE, bias, [bm.shape[-1]], name="reshape")
        fused = make(P.ADDMM, flat, *mm.inputs[:2], name="addmm")
        substitute(graph, add.name, P.RESHAPE, (fused, list(out.shape)), origin=mm.origin)
    else:
        channels = _channel_bias(bm.shape, out.shape)
        if mm.inputs[2] is not None or mm.inputs[6] or channels is None:
            return False
        flat = make(P.RESHAPE, bias, [channels], name="reshape")
        substitute(graph, add.name, P.CONVOLUTION, (mm.inputs[0], mm.inputs[1], flat, *mm.inputs[3:]),
                   mm.attrs, origin=mm.origin)
    remove_dead(graph, [*views, mm.name])
    return True


def _channel_bias(bias: tuple, out: tuple) -> int | None:
    """C if a tensor of shape ``bias`` broadcast to ``out`` (N, C, ...) varies along dim 1 only."""
    if len(bias) > len(out) or len(out) < 2:
        return None
    aligned = (1,) * (len(out) - len(bias)) + tuple(bias)
    if aligned[1] != out[1] or any(d != 1 for i, d in enumerate(aligned) if i != 1):
        return None
    return out[1]
