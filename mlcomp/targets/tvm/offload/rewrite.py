"""Which Relax ops of a TVM build run in a vendor kernel, and the rewrite that sends them there.

:func:`offload` walks each Relax function (after BatchNorm folding and constant
folding, before legalization) and replaces every float32 ``conv2d`` (NCHW/OIHW, any
stride, padding, dilation or groups, so depthwise too) and every float32 ``matmul``
by a ``call_pure_packed`` to a :mod:`mlcomp.targets.tvm.kernels` function (and every float32
``conv2d_transpose``: :mod:`~mlcomp.targets.tvm.offload.deconv`); a
``matmul`` by a constant ``[K, N]`` weight followed by the ``add`` of a constant
``[N]`` bias becomes one ``linear`` (``F.linear`` with the weight stored back in torch's
``[N, K]`` layout, as eager calls it: the bias rides in the GEMM).
A weight expanded over a batch axis (``expand + bmm`` of a linear on a 3-D input, all
slices equal) is that one ``[K, N]`` weight again.  The :class:`Fusion` rewrites (TVM's code is serial next to torch's kernels, so work that sits between them gets torch's
threads) also send ``softmax`` attention to ``scaled_dot_product_attention``, a conv's bias
add and an activation after a conv/linear into its call (``linear_relu``, ``conv2d_sigmoid``),
and a (residual add +) layer norm to ``F.layer_norm``; last, the layout chains around those calls
(permutes, q/k/v split out of an in-projection, heads merged) become strided views the torch call
reads and one torch-side copy of its result (:mod:`mlcomp.targets.tvm.offload.views`); a small conv whose
stride is its kernel (ViT's patch embedding) becomes a patch copy and a ``linear``
(:func:`mlcomp.targets.tvm.offload.gemm.patch_convs`).  Which small GEMMs then go back to TVM code is the
backend's measured decision (:mod:`mlcomp.targets.tvm.offload.gemm`).
Everything else (pooling, permutes, means, the arithmetic of an unfolded BatchNorm) stays
in Relax, so TVM legalizes and fuses it as before.
Matrix–vector products go to torch too: measured on the zoo (mlp and gru at batch 1,
one thread), DLight's GEMV schedule was 3× and 2× slower than ``addmm`` there.  A
low-precision op stays in TVM (its dtype rules are TVM's).

    before:  lv3 = R.matmul(lv2, metadata["relax.expr.Constant"][4], out_dtype="void")   # [32, 512] x [512, 10]
             lv4 = R.add(lv3, metadata["relax.expr.Constant"][5])
    after:   lv4 = R.call_pure_packed("mlcomp.torch.linear", lv2, <metadata[4] transposed: [10, 512]>, metadata[5],
                                      ty_args=(R.Tensor((32, 10), dtype="float32"),))

    before:  lv29 = R.matmul(q, k_t); lv31 = R.nn.softmax(lv30); lv39 = R.where(<row all -inf>, 0, lv31)
             lv44 = R.matmul(lv41, v)                             # decomposed SDPA, q and k_t pre-scaled
    after:   lv44 = R.call_pure_packed("mlcomp.torch.attention", q, R.reshape(R.multiply(k, c), …), v, …)
    before:  lv60 = <linear>(lv57, w, b); lv62 = R.nn.relu(R.reshape(lv60, …))
    after:   lv = R.call_pure_packed("mlcomp.torch.linear_relu", lv57, w, b, …); lv62 = R.reshape(lv, …)

The returned :class:`OffloadReport` counts each op by where it runs and why
(``conv2d ×20 → torch (oneDNN/MKL CPU kernels)``); it goes into the build's stats, the
manifest and ``--explain``.  Each rewrite is one pass over the bindings: O(n).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mlcomp.targets.tvm.offload.chains import maybe, static_shape, ty_of
from mlcomp.targets.tvm.offload.conv_packed import pack_convs
from mlcomp.targets.tvm.offload.conv1d import conv1d_reason, conv1ds
from mlcomp.targets.tvm.offload.deconv import conv_transpose_reason, conv_transposes
from mlcomp.targets.tvm.offload.epilogues import epilogues, layer_norms, means
from mlcomp.targets.tvm.offload.gemm import patch_convs
from mlcomp.targets.tvm.kernels import KERNELS
from mlcomp.targets.tvm.offload.policy import ALL_FUSIONS, REWRITE_ORDER, Fusion
from mlcomp.targets.tvm.offload.views import VIEW_MIN_ELEMENTS, absorb_views

__all__ = ["ALL_FUSIONS", "Fusion", "OffloadReport", "offload"]

_CONV = "relax.nn.conv2d"
_MATMUL = "relax.matmul"


@dataclass
class OffloadReport:
    """Per op kind: how many ran in a kernel (by packed-function name) and how many stayed in TVM (by reason)."""

    kernels: Counter = field(default_factory=Counter)          # packed-function name -> count
    kept: Counter = field(default_factory=Counter)             # (op, reason) -> count
    packed: list = field(default_factory=list)                 # PACKED_WEIGHTS keys of the packed convs

    def to_json(self) -> dict[str, Any]:
        return {"kernels": {name: {"op": KERNELS[name].op, "count": n, "runs_in": KERNELS[name].library.describe()}
                            for name, n in sorted(self.kernels.items())},
                "kept_in_tvm": [{"op": op, "count": n, "reason": why}
                                for (op, why), n in sorted(self.kept.items())]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "OffloadReport":
        return cls(Counter({name: int(v["count"]) for name, v in data.get("kernels", {}).items()}),
                   Counter({(k["op"], k["reason"]): int(k["count"]) for k in data.get("kept_in_tvm", [])}))

    def lines(self) -> list[str]:
        """``conv2d ×20 → torch 2.x (oneDNN/MKL CPU kernels)`` and ``matmul ×3 → TVM (…reason)``."""
        out = [f"{KERNELS[name].op} ×{n} → {KERNELS[name].library.describe()} via packed function {name}"
               for name, n in sorted(self.kernels.items())]
        out += [f"{op} ×{n} → TVM codegen ({why})" for (op, why), n in sorted(self.kept.items())]
        return out


def _conv_reason(call: Any) -> str | None:
    """Why this conv2d stays in TVM (None: it goes to the kernel)."""
    attrs = call.attrs
    if str(attrs.data_layout) != "NCHW" or str(attrs.kernel_layout) != "OIHW" or \
            str(attrs.out_layout) not in ("NCHW", ""):
        return f"layout {attrs.data_layout}/{attrs.kernel_layout}"
    dtypes = {str(ty_of(a).dtype) for a in call.args} | {str(ty_of(call).dtype)}
    if dtypes != {"float32"}:
        return f"dtype {'/'.join(sorted(dtypes))}"
    return None


def _matmul_reason(call: Any) -> str | None:
    dtypes = {str(ty_of(a).dtype) for a in call.args} | {str(ty_of(call).dtype)}
    if dtypes != {"float32"}:
        return f"dtype {'/'.join(sorted(dtypes))}"
    if static_shape(call.args[0]) is None or static_shape(call.args[1]) is None:
        return "symbolic shape"
    return None


def _shared_weight(product: Any, weight: Any) -> Any:
    """The ``[K, N]`` matrix ``x @ weight`` multiplies every row block by, or None.

    A 2-D constant is that matrix; a ``[B…, K, N]`` constant whose batch slices are all equal (what
    ``expand + bmm`` of a linear over a 3-D input leaves after constant folding) is too, when ``x``
    has the same batch axes.  Checking the slices reads the constant once, at build time.
    """
    import numpy as np

    w, x = static_shape(weight), static_shape(product.args[0])
    if w is None or x is None or len(w) < 2:
        return None
    value = np.from_dlpack(weight.value)
    if len(w) == 2:
        return value
    if x[:-1] + w[-1:] != static_shape(product) or len(x) != len(w):
        return None
    flat = value.reshape(-1, *w[-2:])
    return flat[0] if bool((flat == flat[:1]).all()) else None


def _bias_of(add: Any, product: Any, weight: Any, bias: Any) -> bool:
    """Whether ``add = product + bias`` is a linear layer's bias: a constant ``[N]`` row added to ``x @ w``."""
    b = static_shape(bias)
    return (weight is not None and b in ((weight.shape[1],), (1, weight.shape[1]))
            and str(ty_of(bias).dtype) == "float32" and static_shape(add) == static_shape(product))


def offload(mod: Any, fusions: frozenset[Fusion] = ALL_FUSIONS,
            view_min_elements: int = VIEW_MIN_ELEMENTS) -> tuple[Any, OffloadReport]:
    """``mod`` with its float32 conv2d and matmul calls sent to the torch kernels; see the module doc.

    ``fusions``: which of the larger rewrites (:class:`Fusion`) also apply.  ``view_min_elements``:
    the smallest layout copy :data:`Fusion.VIEWS` moves into a torch call (attention's views: any).
    """
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    report = OffloadReport()
    empty = relax.const(np.zeros((0,), dtype="float32"))

    def conv(call: Any, _matches: Any) -> Any:
        if _conv_reason(call):
            return call
        a = call.attrs
        ints = [*a.strides, *a.padding, *a.dilation, a.groups]
        return relax.call_pure_packed("mlcomp.torch.conv2d", call.args[0], call.args[1], empty,
                                      *[relax.prim_value(int(i)) for i in ints], ty_args=ty_of(call))

    x, w, b = wildcard(), is_const(), is_const()
    product = is_op(_MATMUL)(x, w)

    def linear(call: Any, matches: Any) -> Any:
        mm = matches[product]
        shared = None if _matmul_reason(mm) else _shared_weight(mm, matches[w])
        if shared is None or not _bias_of(call, mm, shared, matches[b]):
            return call
        bias = matches[b]
        if len(static_shape(bias)) == 2:
            bias = relax.const(np.from_dlpack(bias.value).reshape(-1))
        # the weight back in torch's [N, K] layout: F.linear then runs eager's own GEMM call
        weight = relax.const(np.ascontiguousarray(shared.T))
        return relax.call_pure_packed("mlcomp.torch.linear", matches[x], weight, bias, ty_args=ty_of(call))

    def matmul(call: Any, _matches: Any) -> Any:
        if _matmul_reason(call):
            return call
        return relax.call_pure_packed("mlcomp.torch.matmul", call.args[0], call.args[1], ty_args=ty_of(call))

    patterns = {"conv2d": (is_op(_CONV)(wildcard(), wildcard()), conv),
                "linear": (is_op("relax.add")(product, b), linear),
                "matmul": (is_op(_MATMUL)(wildcard(), wildcard()), matmul)}
    always = {"conv1d": conv1ds, "conv2d_transpose": conv_transposes}      # plain offloads that are not a Fusion
    steps = {"attention": _attention, "packed_conv": lambda f: pack_convs(f, report.packed),
             "patches": patch_convs, "epilogue": epilogues, "layer_norm": layer_norms, "mean": means,
             "views": lambda f: absorb_views(f, view_min_elements)}
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs) if mod.attrs is not None else mod
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function):
            continue
        for name in REWRITE_ORDER:       # the policy's order; a fusion step only when asked for
            if name in patterns:
                func = rewrite_call(*patterns[name], func)
            elif name in always:
                func = always[name](func)
            elif Fusion(name) in fusions:
                func = steps[name](func)
        out[gv] = func
        relax.analysis.post_order_visit(func, lambda e: _count(e, report))
    return out, report


def _const_all(expr: Any, value: float) -> bool:
    import numpy as np

    return bool(np.all(np.from_dlpack(expr.value) == value)) if hasattr(expr, "value") else False


def _attention(func: Any) -> Any:
    """Decomposed attention → ``mlcomp.torch.attention`` (torch's fused SDPA), see the module doc.

    Matches what ``scaled_dot_product_attention``'s decomposition leaves in Relax:
    ``matmul(where(all(-inf row), 0, softmax(matmul(q, k_t))), v)`` with the views between
    (``reshape``/``broadcast_to`` that do not move elements); q and k_t come pre-scaled.
    """
    import numpy as np
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    q, k_t, v, neg_inf, zero = wildcard(), wildcard(), wildcard(), is_const(), is_const()
    # k_t is often a transposed copy of a scaled key: take the key itself, scale it, skip both transposes
    key, scale = wildcard(), is_const()
    swapped = is_op("relax.permute_dims")(key)
    scaled = is_op("relax.multiply")(swapped, scale)
    key_t = maybe(scaled, "relax.broadcast_to", "relax.reshape")
    scores = is_op(_MATMUL)(q, key_t | k_t)
    logits = maybe(scores, "relax.reshape")
    soft = is_op("relax.nn.softmax")(logits)
    finite = is_op("relax.logical_not")(is_op("relax.equal")(logits, neg_inf))
    any_finite = is_op("relax.astype")(is_op("relax.max")(is_op("relax.astype")(finite)))
    probs = is_op("relax.where")(is_op("relax.logical_not")(any_finite), zero, soft)
    pattern = is_op(_MATMUL)(maybe(probs, "relax.broadcast_to", "relax.reshape"), v)

    def rewrite(call: Any, m: Any) -> Any:
        s, p = static_shape(m[scores]), static_shape(call.args[0])
        shapes = [static_shape(e) for e in (*m[scores].args, m[v])]
        ok = (s is not None and p == s and len(s) == 3 and None not in shapes
              and all(len(t) == 3 for t in shapes) and static_shape(m[logits])[-1] == s[-1]
              and int(m[soft].attrs.axis) in (-1, len(static_shape(m[logits])) - 1)
              and _const_all(m[neg_inf], float("-inf")) and _const_all(m[zero], 0.0)
              and _matmul_reason(m[scores]) is None and _matmul_reason(call) is None)
        if not ok:
            return call
        b, d, n = shapes[1]
        k = relax.op.permute_dims(m[scores].args[1], [0, 2, 1])
        if scaled in m:   # the un-transposed key [..., n, d] holds exactly the b·n·d elements of k_t
            shape, axes = static_shape(m[key]), [int(i) for i in m[swapped].attrs.axes]
            if (shape is not None and axes == [*range(len(shape) - 2), len(shape) - 1, len(shape) - 2]
                    and shape[-2:] == (n, d) and int(np.prod(shape)) == b * n * d and static_shape(m[scale]) == ()
                    and str(ty_of(m[scale]).dtype) == "float32"):
                k = relax.op.reshape(relax.op.multiply(m[key], m[scale]), (b, n, d))
        return relax.call_pure_packed("mlcomp.torch.attention", m[q], k, m[v], ty_args=ty_of(call))

    return rewrite_call(pattern, rewrite, func)


def _count(expr: Any, report: OffloadReport) -> None:
    """Enter one call of the rewritten function in ``report`` (kernel calls and the ops TVM kept)."""
    import tvm
    from tvm import relax

    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return
    name = expr.op.name
    if name == "relax.call_pure_packed" and isinstance(expr.args[0], relax.ExternFunc) \
            and str(expr.args[0].global_symbol) in KERNELS:
        report.kernels[str(expr.args[0].global_symbol)] += 1
    elif name == _CONV:
        report.kept["conv2d", _conv_reason(expr) or "not matched"] += 1
    elif name == _MATMUL:
        report.kept["matmul", _matmul_reason(expr) or "not matched"] += 1
    elif name == "relax.nn.conv1d":
        report.kept["conv1d", conv1d_reason(expr) or "not matched"] += 1
    elif name == "relax.nn.conv2d_transpose":
        report.kept["conv2d_transpose", conv_transpose_reason(expr) or "not matched"] += 1
