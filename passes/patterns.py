"""The one place where passes recognise operators and small patterns.

Passes never compare op names as strings; they use the :class:`~mlcomp.ops.Op`
constants and sets below and the helpers that read a node's arguments::

    >>> n = producer(graph, node.inputs[0], *MUL)      # the mul.Tensor/mul.Scalar feeding node
    >>> scalar(n.inputs[1])                             # 0.5, or None if not a number
    >>> mul_factors(graph, Ref("mul_2"))                # [Ref("x"), 0.5, Ref("add")]
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ops import INPUT, OUTPUT, PARAM, Category, Namespace, Op, aten, category

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
    return True  # getitem, operator.*, mlcomp composites


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


# -- reading nodes ----------------------------------------------------------------

def producer(graph: Graph, value: Any, *ops: Op) -> Node | None:
    """The node behind ``value`` if it is a :class:`Ref` to a node with one of ``ops`` (any op if none)."""
    if not isinstance(value, Ref):
        return None
    node = graph.node(value.name)
    return node if not ops or node.op in ops else None


def scalar(value: Any) -> float | None:
    """A Python number literal (bool excluded) as float, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def arg(node: Node, index: int, key: str, default: Any = None) -> Any:
    """Argument ``index`` of ``node``, or keyword ``key``, or ``default``."""
    if index < len(node.inputs):
        return node.inputs[index]
    return node.attrs.get(key, default)


def close(a: float | None, b: float, rel: float = 1e-6) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def meta_of(graph: Graph, value: Any) -> TensorMeta | None:
    if isinstance(value, Ref):
        m = graph.node(value.name).meta
        return m if isinstance(m, TensorMeta) else None
    return None


def only_user(graph: Graph, name: str, user: str) -> bool:
    """``name`` is read by ``user`` and nothing else (and is not a graph output)."""
    users = graph.users(name)
    return len(users) == 1 and users[0].name == user


def internal(graph: Graph, names: Iterable[str], root: str) -> bool:
    """Every node in ``names`` except ``root`` is only read inside ``names``."""
    group = set(names)
    return all(all(u.name in group for u in graph.users(n)) for n in group if n != root)


def same_value(graph: Graph, a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same value, or the same pure op on the same arguments."""
    if a == b:
        return True
    na, nb = producer(graph, a), producer(graph, b)
    if na is None or nb is None or na.op != nb.op or not is_pure(na.op):
        return False
    return na.inputs == nb.inputs and dict(na.attrs) == dict(nb.attrs)


def mul_factors(graph: Graph, value: Any, *, depth: int = 4) -> list[Any] | None:
    """Flatten a tree of single-use multiplications into its factors (numbers are folded into one).

    Returns ``None`` unless ``value`` is a product; literals are multiplied together
    and appended last, so ``0.5 * x * y`` gives ``[Ref(x), Ref(y), 0.5]``.
    """
    node = producer(graph, value, *MUL)
    if node is None:
        return None
    factors: list[Any] = []
    number = 1.0

    def walk(v: Any, level: int, top: bool) -> None:
        nonlocal number
        n = producer(graph, v, *MUL)
        if n is not None and level < depth and (top or len(graph.users(n.name)) == 1):
            for x in n.inputs[:2]:
                walk(x, level + 1, False)
            return
        s = scalar(v)
        if s is not None:
            number *= s
        else:
            factors.append(v)

    walk(value, 0, True)
    return factors + ([number] if number != 1.0 else [])


def mul_tree(graph: Graph, value: Any, *, depth: int = 4) -> list[str]:
    """Names of the multiplication nodes :func:`mul_factors` walked through."""
    out: list[str] = []

    def walk(v: Any, level: int, top: bool) -> None:
        n = producer(graph, v, *MUL)
        if n is not None and level < depth and (top or len(graph.users(n.name)) == 1):
            out.append(n.name)
            for x in n.inputs[:2]:
                walk(x, level + 1, False)

    walk(value, 0, True)
    return out


# -- shapes and permutations -----------------------------------------------------

def perm_of(node: Node, rank: int) -> list[int] | None:
    """The permutation a permute/transpose/t node applies (None for other ops)."""
    if node.op == PERMUTE:
        return [d % rank for d in node.inputs[1]]
    if node.op == TRANSPOSE:
        a, b = node.inputs[1] % rank, node.inputs[2] % rank
        p = list(range(rank))
        p[a], p[b] = p[b], p[a]
        return p
    if node.op == T:
        return list(range(rank))[::-1] if rank == 2 else list(range(rank))
    return None


def compose_perms(first: Sequence[int], second: Sequence[int]) -> list[int]:
    """``x.permute(first).permute(second)`` == ``x.permute(compose_perms(first, second))``."""
    return [first[i] for i in second]


def last_dims(dims: Any, rank: int) -> int | None:
    """``k`` if ``dims`` names exactly the last ``k`` dimensions of a rank-``rank`` tensor."""
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, (list, tuple)) or not dims:
        return None
    norm = sorted(d % rank for d in dims)
    k = len(norm)
    return k if norm == list(range(rank - k, rank)) else None


def is_structural(node: Node) -> bool:
    return node.op in (INPUT, PARAM, OUTPUT)
