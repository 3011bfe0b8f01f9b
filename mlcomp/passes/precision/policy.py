"""The mixed-precision policy: which precision each op computes in, per device kind.

Every op gets one :class:`Rule`:

* ``lower`` — compute in the low dtype (bf16/fp16); float inputs are cast down;
* ``follow`` — compute in the precision its inputs arrive in (pointwise ops, views,
  pooling); mixed inputs compute in fp32;
* ``keep-fp32`` — compute in fp32 and stay there; followers continue in fp32;
* ``widen`` — fp32 math, but the result goes back to the precision its inputs came in.

The table is seeded from the rules of ``../shared/seeds/004_*.txt`` ("Low/Mixed
Precision": matrix products and convolutions in low precision; pointwise ops follow
their inputs; ops where |f(x)| ≫ |x| (exp, square, log, pow), reductions, norms and
losses in fp32 math) and from torch's autocast op lists, which differ by device.  On
the CPU torch's reduced-precision kernels (softmax, layer norm, mean) accumulate in
fp32 internally (``at::opmath_type<BFloat16>`` is float) and autocast's CPU list
leaves them alone, so they *follow*; autocast's CUDA list runs them in fp32, so
there they *widen*::

    >>> rule_for(policy_table(PolicyName.DEFAULT, DeviceKind.CPU), aten("_softmax"))
    (<Rule.FOLLOW: 'follow'>, 'pointwise/data-movement op: computes in the precision of its inputs')
    >>> rule_for(policy_table(PolicyName.DEFAULT, DeviceKind.CUDA), aten("_softmax"))[0]
    <Rule.WIDEN: 'widen'>

``compute-only`` keeps everything fp32 except the ``lower`` ops and data movement
(what eager autocast does: a cast before and after every matrix product).  Ops the table does not know
and that are not pointwise or data movement keep fp32 (a kernel may lack a low-
precision variant).  Before/after of the default CPU table on a linear + softmax::

    %addmm: f32 = addmm(%b, %x, %w^T)           %x_bf16: bf16 = _to_copy(%x, dtype=bf16)
    %_softmax: f32 = _softmax(%addmm, -1)   →   %addmm: bf16 = addmm(%b, %x_bf16, %w^T)  {lower}
                                                %_softmax: bf16 = _softmax(%addmm, -1)  {follow}

Selections (``topk``, ``sort``, ``argmax`` …) choose by comparing values: a low-precision
rounding of near-equal values changes *which* are chosen (an MoE router picking another
expert), an error no tolerance covers.  :func:`ranking_products` finds the matrix products
that compute the values a selection ranks (walking back from its float input to the first
product on each path); the pass keeps them in fp32, so the router's logits are exact while
the experts' products stay low::

    %logits: f32 = mm(%h_f32, %router^T)   {fp32, selection}
    %probs = _softmax(%logits) -> %top = topk(%probs, 2)        (unchanged: fp32 math)
    %up: bf16 = mm(%h, %expert^T)          {bf16, policy}
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.ops import INPUT, PARAM, Category, Namespace, Op, aten, category

__all__ = ["Rule", "DeviceKind", "PolicyName", "PolicyTable", "fp32_operands", "policy_table", "rule_for",
           "SELECTIONS", "ranking_products"]


class Rule(enum.Enum):
    LOWER = "lower"
    FOLLOW = "follow"
    KEEP_FP32 = "keep-fp32"
    WIDEN = "widen"


class DeviceKind(enum.Enum):
    """The kind of device a policy is for (the target's device)."""

    CPU = "cpu"
    CUDA = "cuda"


class PolicyName(enum.Enum):
    DEFAULT = "default"            # the seed rules + autocast lists below
    COMPUTE_ONLY = "compute-only"  # only matrix products/convolutions in low precision (eager autocast)


_PRODUCTS = """mm addmm bmm baddbmm addbmm matmul linear convolution _convolution conv1d conv2d conv3d
conv_transpose1d conv_transpose2d conv_transpose3d convolution_backward scaled_dot_product_attention
_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_efficient_attention
_scaled_dot_product_flash_attention prelu""".split()
_GROWTH = """exp exp2 expm1 log log1p log2 log10 pow reciprocal rsqrt sinh cosh tan acos asin erfinv
softplus""".split()
_REDUCTIONS = """sum prod cumsum cumprod logsumexp norm linalg_vector_norm frobenius_norm var std var_mean
dist cdist renorm""".split()
_LOSSES = """nll_loss_forward nll_loss_backward nll_loss2d_forward nll_loss2d_backward mse_loss
mse_loss_backward binary_cross_entropy binary_cross_entropy_backward binary_cross_entropy_with_logits
l1_loss smooth_l1_loss smooth_l1_loss_backward huber_loss huber_loss_backward kl_div soft_margin_loss
_log_softmax _log_softmax_backward_data log_softmax""".split()
# normalisation with batch statistics (training) and the backward of every normalisation
_NORM_STATS = """native_batch_norm_backward native_layer_norm_backward native_group_norm_backward
native_group_norm embedding_dense_backward""".split()
_NORM_TRAIN = """native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional""".split()
# reductions whose CPU kernels accumulate in fp32 (opmath) and that autocast's CUDA list runs in fp32
_DEVICE_DEPENDENT = """_softmax _safe_softmax softmax native_layer_norm layer_norm _softmax_backward_data""".split()
_POINTWISE_EXTRA = """_native_batch_norm_legit_no_training threshold_backward sigmoid_backward tanh_backward
gelu_backward silu_backward hardtanh_backward leaky_relu_backward elu_backward hardswish_backward
native_dropout native_dropout_backward avg_pool2d_backward max_pool2d_with_indices_backward
_adaptive_avg_pool2d_backward mean amax amin max min avg_pool2d _adaptive_avg_pool2d adaptive_avg_pool2d
max_pool2d_with_indices max_pool2d embedding""".split()

# normalisation kernels whose affine parameters and running statistics may stay fp32 beside a
# low-precision input (CPU and CUDA kernels take the mixed types; eager autocast runs them so).  With
# fp32 parameters the saved statistics (mean, rstd) come out fp32, as the meta kernels say; with
# low-precision parameters the CPU kernels return low-precision statistics that the meta kernels
# still call fp32, and the fp32 backward kernel that reads them fails ("expected scalar type Float")
_AFFINE = ("weight", "bias")
_RUNNING = ("weight", "bias", "running_mean", "running_var")
_FP32_OPERANDS = {"native_layer_norm": _AFFINE, "layer_norm": _AFFINE, "native_group_norm": _AFFINE,
                  "group_norm": _AFFINE, "native_batch_norm": _RUNNING, "_native_batch_norm_legit": _RUNNING,
                  "_native_batch_norm_legit_functional": _RUNNING,
                  "_native_batch_norm_legit_no_training": _RUNNING, "batch_norm": _RUNNING}

_REASONS = {
    "product": "matrix product/convolution: the seed rule and autocast run it in low precision",
    "growth": "|f(x)| can be much larger than |x| (exp, log, pow): fp32 math (seed rule)",
    "reduction": "reduction/norm: accumulates many terms, fp32 math (seed rule)",
    "loss": "loss or log-softmax: fp32 math (seed rule, autocast fp32 list)",
    "norm": "normalisation statistics/backward: fp32 math (seed rule)",
    "norm_train": "batch statistics in fp32, the normalised result back in low precision",
    "cpu_opmath": "pointwise/data-movement op: computes in the precision of its inputs",
    "cuda_fp32": "softmax/layer norm: fp32 math on CUDA (autocast's CUDA fp32 list), result back in low precision",
    "pointwise": "pointwise/data-movement op: computes in the precision of its inputs",
    "unknown": "op without a known low-precision kernel: kept fp32",
    "compute_only": "policy compute-only: only matrix products and convolutions run in low precision",
}


@dataclass(frozen=True)
class PolicyTable:
    """Op name → (rule, reason) for one policy and device kind; unknown ops by category."""

    name: PolicyName
    device: DeviceKind
    rules: Mapping[str, tuple[Rule, str]]

    def describe(self) -> list[tuple[str, str, str]]:
        """``(op, rule, reason)`` rows, sorted by op name (for reports and docs)."""
        return [(op, rule.value, why) for op, (rule, why) in sorted(self.rules.items())]


def policy_table(name: PolicyName, device: DeviceKind) -> PolicyTable:
    """The table for ``name`` on ``device``."""
    rules: dict[str, tuple[Rule, str]] = {}

    def put(ops: list[str], rule: Rule, why: str) -> None:
        for op in ops:
            rules[op] = (rule, _REASONS[why])

    put(_POINTWISE_EXTRA, Rule.FOLLOW, "pointwise")
    put(_GROWTH, Rule.KEEP_FP32, "growth")
    put(_REDUCTIONS, Rule.KEEP_FP32, "reduction")
    put(_LOSSES, Rule.KEEP_FP32, "loss")
    put(_NORM_STATS, Rule.KEEP_FP32, "norm")
    put(_NORM_TRAIN, Rule.WIDEN, "norm_train")
    if device is DeviceKind.CUDA:
        put(_DEVICE_DEPENDENT, Rule.WIDEN, "cuda_fp32")
    else:
        put(_DEVICE_DEPENDENT, Rule.FOLLOW, "cpu_opmath")
    put(_PRODUCTS, Rule.LOWER, "product")
    if name is PolicyName.COMPUTE_ONLY:
        for op, (rule, _) in list(rules.items()):
            if rule is not Rule.LOWER and category(aten(op)) is not Category.INJECTIVE:
                rules[op] = (Rule.KEEP_FP32, _REASONS["compute_only"])
    return PolicyTable(name, device, MappingProxyType(rules))


def fp32_operands(node: Node) -> list[str]:
    """Values ``node`` reads that stay fp32 on a training graph whatever precision it computes in: a
    normalisation's affine parameters and running statistics (the mixed-type kernels autocast uses),
    passed positionally or by keyword."""
    names = _FP32_OPERANDS.get(node.op.name, ()) if node.op.namespace is Namespace.ATEN else ()
    if not names:
        return []
    schema = node.op.resolve()._schema
    found = [node.attrs.get(n) for n in names]
    found += [node.inputs[i] for i, a in enumerate(schema.arguments) if a.name in names and i < len(node.inputs)]
    return [r.name for r in found if isinstance(r, Ref)]


def rule_for(table: PolicyTable, op: Op) -> tuple[Rule, str]:
    """The rule for ``op`` and why; ops not in the table follow if pointwise or data movement."""
    if op.namespace in (Namespace.ATEN, Namespace.PRIMS) and op.name in table.rules:
        return table.rules[op.name]
    kind = category(op)
    if kind is Category.INJECTIVE:     # data movement: exact in any precision
        return Rule.FOLLOW, _REASONS["pointwise"]
    if table.name is PolicyName.COMPUTE_ONLY:
        return Rule.KEEP_FP32, _REASONS["compute_only"]
    if kind in (Category.ELEMWISE, Category.BROADCAST) or op.namespace is Namespace.MLCOMP:
        return Rule.FOLLOW, _REASONS["pointwise"]
    return Rule.KEEP_FP32, _REASONS["unknown"]


# ops whose result depends on the order of their input's values (what they select or return)
SELECTIONS = frozenset("""topk sort argsort argmax argmin kthvalue msort max.dim min.dim mode""".split())


def _selects(node: Node) -> bool:
    return node.op.namespace is Namespace.ATEN and (node.op.name in SELECTIONS
                                                    or f"{node.op.name}.{node.op.overload}" in SELECTIONS)


def ranking_products(graph: Graph, rules: Mapping[str, Rule]) -> list[str]:
    """The ``lower`` nodes (by ``rules``: node name → rule) nearest upstream of each selection's ranked
    input, and the ``follow`` views of weights they read (a transposed weight would be rounded with it):
    the walk back passes every other node and stops at them and at graph inputs/weights (O(n))."""
    found: dict[str, None] = {}
    seen: set[str] = set()
    stack = [node.input_names()[0] for node in graph.call_nodes() if _selects(node) and node.input_names()]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if rules.get(name) is Rule.LOWER:
            found[name] = None
            found.update(dict.fromkeys(_weight_views(graph, name, rules)))
        elif graph.node(name).op not in (INPUT, PARAM):
            stack.extend(graph.node(name).input_names())
    return list(found)


def _weight_views(graph: Graph, product: str, rules: Mapping[str, Rule]) -> list[str]:
    """``follow`` nodes between ``product`` and the weights it reads that read weights only (``t(%w)``)."""
    views = []
    for name in graph.node(product).input_names():
        chain = []
        while rules.get(name) is Rule.FOLLOW and len(graph.node(name).input_names()) == 1:
            chain.append(name)
            name = graph.node(name).input_names()[0]
        if graph.node(name).op == PARAM:
            views += chain
    return views
