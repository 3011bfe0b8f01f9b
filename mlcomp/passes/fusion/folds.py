"""Pattern folds: batch-norm folding and bias epilogues.

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

``fold-bias``: ``bmm(x, expand(w))`` (a linear layer on 3-d input) becomes ``mm``
on the flattened input, and ``mm + bias`` / ``convolution + bias`` fold into
``addmm`` / the convolution's bias::

    %mm = aten.mm(%x, %w_t);  %add = aten.add(%mm, %bias)
  becomes
    %add = aten.addmm(%bias, %x, %w_t)

Attention fusion lives in :mod:`mlcomp.passes.attention`, recomposed norms and
GELU in :mod:`mlcomp.passes.fusion.recompose`.  Every rewrite keeps the name of the
value it replaces (see ``builder.substitute``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mlcomp.base.errors import PassFailure
from mlcomp.ir import Graph, Mode, Node, Ref
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.ir.ops import GETITEM, PARAM
from mlcomp.passes import patterns as P
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult


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
