"""Operator sets and properties: which ops are views, pure, fusable, in-place capable.

The one place where mlcomp recognises operators by identity; passes, the fused-kernel
generator and targets all ask here::

    >>> is_pure(aten("relu"))            # safe to merge, fold, or drop when unused
    True
    >>> print(inplace_variant(aten("relu")))
    aten.relu_.default
    >>> aten("view") in SHAPE_OPS
    True
"""
from __future__ import annotations

from mlcomp.ir.ops import INPUT, OUTPUT, PARAM, Category, Namespace, Op, aten, category

# -- single ops ----------------------------------------------------------------
VIEW, UNSAFE_VIEW, RESHAPE = aten("view"), aten("_unsafe_view"), aten("reshape")
PERMUTE, TRANSPOSE, T = aten("permute"), aten("transpose.int"), aten("t")
EXPAND, UNSQUEEZE = aten("expand"), aten("unsqueeze")
SQUEEZE_DIM, SQUEEZE_DIMS = aten("squeeze.dim"), aten("squeeze.dims")
SLICE, AS_STRIDED = aten("slice.Tensor"), aten("as_strided")
CLONE, ALIAS, DETACH, LIFT_FRESH_COPY = aten("clone"), aten("alias"), aten("detach"), aten("lift_fresh_copy")
TO_COPY = aten("_to_copy")
DROPOUT, NATIVE_DROPOUT = aten("dropout"), aten("native_dropout")
ADDMM, MM, BMM, CONVOLUTION = aten("addmm"), aten("mm"), aten("bmm"), aten("convolution")
BATCH_NORM_EVAL = aten("_native_batch_norm_legit_no_training")
GELU, TANH, ERF = aten("gelu"), aten("tanh"), aten("erf")
SQRT, RSQRT = aten("sqrt"), aten("rsqrt")
POW_SCALAR = aten("pow.Tensor_Scalar")
MEAN_DIM, VAR, VAR_MEAN = aten("mean.dim"), aten("var.correction"), aten("var_mean.correction")
SOFTMAX, SAFE_SOFTMAX = aten("_softmax"), aten("_safe_softmax")
SDPA = aten("scaled_dot_product_attention")
LAYER_NORM = aten("native_layer_norm")
WHERE, FULL_LIKE, EQ_SCALAR = aten("where.self"), aten("full_like"), aten("eq.Scalar")
LOGICAL_NOT, ANY_DIM = aten("logical_not"), aten("any.dim")
SYM_SIZE = Op(Namespace.ATEN, "sym_size", "int")

# -- families -------------------------------------------------------------------
ADD = (aten("add.Tensor"), aten("add.Scalar"))
SUB = (aten("sub.Tensor"), aten("sub.Scalar"))
MUL = (aten("mul.Tensor"), aten("mul.Scalar"))
DIV = (aten("div.Tensor"), aten("div.Scalar"))
SHAPE_OPS = frozenset({VIEW, UNSAFE_VIEW, RESHAPE})           # same data, new shape
PERMUTE_OPS = frozenset({PERMUTE, TRANSPOSE, T})
SQUEEZE_OPS = frozenset({SQUEEZE_DIM, SQUEEZE_DIMS})
IDENTITY_OPS = frozenset({ALIAS, LIFT_FRESH_COPY})            # always the same value
INFERENCE_IDENTITY_OPS = frozenset({DETACH, CLONE})          # same value when no gradient flows
# ops whose result aliases (is a view of) an input: in-place writes to them are unsafe
VIEW_LIKE = SHAPE_OPS | PERMUTE_OPS | SQUEEZE_OPS | IDENTITY_OPS | frozenset({
    EXPAND, UNSQUEEZE, SLICE, DETACH, AS_STRIDED, aten("select.int"), aten("split.Tensor"),
    aten("split_with_sizes"), aten("unbind.int"), aten("chunk"), aten("narrow"), aten("diagonal")})
_RANDOM = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
           "normal", "uniform", "dropout", "native_dropout", "multinomial", "exponential", "poisson",
           "empty", "empty_like", "empty_strided", "new_empty"}
_SIDE_EFFECTS = {"_assert_async", "_assert_scalar", "_assert_tensor_metadata", "sym_constrain_range",
                 "sym_constrain_range_for_size", "_print", "copy_", "resize_"}
COMMUTATIVE = frozenset({aten("add.Tensor"), aten("mul.Tensor"), aten("maximum"), aten("minimum")})


def has_side_effects(op: Op) -> bool:
    """In-place ops, asserts and prints: never removed, merged or folded."""
    if op.namespace not in (Namespace.ATEN, Namespace.PRIMS):
        return False
    return op.name.endswith("_") and not op.name.startswith("_") or op.name in _SIDE_EFFECTS


def is_pure(op: Op) -> bool:
    """Deterministic and free of side effects: safe to merge (CSE), fold or drop when unused."""
    if op in (INPUT, PARAM, OUTPUT):
        return False
    if op.namespace in (Namespace.ATEN, Namespace.PRIMS):
        return op.name not in _RANDOM and not has_side_effects(op)
    # getitem, operator.*, mlcomp composites; a torch.library op may be random or stateful: never merged
    return op.namespace is not Namespace.LIBRARY


def is_fusable(op: Op) -> bool:
    return category(op) is not Category.OPAQUE and is_pure(op)


def inplace_variant(op: Op) -> Op | None:
    """``aten.relu.default`` → ``aten.relu_.default`` when torch has it (else None)."""
    if op.namespace is not Namespace.ATEN or op.name.endswith("_"):
        return None
    cand = Op(Namespace.ATEN, op.name + "_", op.overload)
    try:
        cand.resolve()
    except (AttributeError, RuntimeError):
        return None
    return cand
