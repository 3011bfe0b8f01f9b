"""The one place where passes recognise operators and small patterns.

Passes never compare op names as strings; they use the :class:`~mlcomp.ir.ops.Op`
constants and sets below and the helpers that read a node's arguments::

    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("g")
    >>> x = b.input("x", (4,))
    >>> m = b.call(aten("mul.Tensor"), x, 0.5)
    >>> graph = b.output(b.call(aten("mul.Tensor"), m, b.call(aten("add.Tensor"), x, x)))
    >>> node = graph.node("mul_1")
    >>> n = producer(graph, node.inputs[0], *MUL)      # the mul.Tensor/mul.Scalar feeding node
    >>> n.name, scalar(n.inputs[1])                     # scalar: the number, or None if not one
    ('mul', 0.5)
    >>> mul_factors(graph, Ref("mul_1"))
    [%x, %add, 0.5]
"""
from __future__ import annotations

import math
from fnmatch import fnmatchcase
from typing import Any, Iterable, Sequence

from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.graph_tools import producer  # noqa: F401 - read by passes as P.producer
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM, Op
from mlcomp.ir.opsets import (  # noqa: F401 - the op vocabulary passes use as P.NAME
    ADD,
    ADDMM,
    ALIAS,
    ANY_DIM,
    AS_STRIDED,
    BATCH_NORM_EVAL,
    BMM,
    CLONE,
    COMMUTATIVE,
    CONVOLUTION,
    DETACH,
    DIV,
    DROPOUT,
    EQ_SCALAR,
    ERF,
    EXPAND,
    FULL_LIKE,
    GELU,
    IDENTITY_OPS,
    INFERENCE_IDENTITY_OPS,
    LAYER_NORM,
    LIFT_FRESH_COPY,
    LOGICAL_NOT,
    MEAN_DIM,
    MM,
    MUL,
    NATIVE_DROPOUT,
    PERMUTE,
    PERMUTE_OPS,
    POW_SCALAR,
    RESHAPE,
    RSQRT,
    SAFE_SOFTMAX,
    SDPA,
    SHAPE_OPS,
    SLICE,
    SOFTMAX,
    SQRT,
    SQUEEZE_DIM,
    SQUEEZE_DIMS,
    SQUEEZE_OPS,
    SUB,
    SYM_SIZE,
    TANH,
    TO_COPY,
    TRANSPOSE,
    UNSAFE_VIEW,
    UNSQUEEZE,
    VAR,
    VAR_MEAN,
    VIEW,
    VIEW_LIKE,
    WHERE,
    T,
    has_side_effects,
    inplace_variant,
    is_fusable,
    is_pure,
)

# -- reading nodes ----------------------------------------------------------------

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


def names_op_or_module(pattern: str, node: Node) -> bool:
    """``pattern`` names the node's op (``exp``, ``aten.exp``, ``aten.exp.default``) or globs its module path
    (``encoder.layers.3.*``; a path also matches its submodules)."""
    op = node.op
    if pattern in (op.name, op.qualname, f"{op.namespace.value}.{op.name}"):
        return True
    path = node.origin.module_path
    return bool(path) and (fnmatchcase(path, pattern) or fnmatchcase(path, pattern + ".*"))


def row_guard(graph: Graph, cond: Any, scores: Any) -> list[str] | None:
    """The node names of ``logical_not(any(logical_not(eq(scores, -inf)), -1, True))`` (a safe softmax's test
    for rows that are all ``-inf``) when ``cond`` is that test of ``scores``, else ``None``."""
    n1 = producer(graph, cond, LOGICAL_NOT)
    n2 = n1 and producer(graph, n1.inputs[0], ANY_DIM)
    n3 = n2 and producer(graph, n2.inputs[0], LOGICAL_NOT)
    n4 = n3 and producer(graph, n3.inputs[0], EQ_SCALAR)
    if not n4 or n4.inputs[0] != scores or scalar(n4.inputs[1]) != -math.inf:
        return None
    return [n1.name, n2.name, n3.name, n4.name]
