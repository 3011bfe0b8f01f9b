"""A linear's rows in the order its reader wants: the permutes before and after it composed into one.

A linear (``addmm``/``mm`` over ``[rows, K]``) computes each row on its own, so any reordering of its rows
can happen before it as well as after.  ``nn.MultiheadAttention`` on a batch-first input computes its
out-projection over ``(s, b)`` rows and transposes back to ``(b, s)``; with both layout runs composed
(:func:`~mlcomp.passes.layouts.compose`) one permute is left::

    %p = aten.permute(%attn, [2, 0, 1, 3]);  %r = aten.reshape(%p, [16, 32])          # attn: [2, 4, 8, 8]
    %y = aten.addmm(%b, %r, %w);  %o = aten.permute(aten.view(%y, [8, 2, 32]), [1, 0, 2])
  becomes
    %p = aten.permute(%attn, [0, 2, 1, 3]);  %r = aten.reshape(%p, [16, 32])
    %y = aten.addmm(%b, %r, %w);  %o = aten.reshape(%y, [2, 8, 32])

The run after the linear must keep its features as the last axis, whole; the rewrite is made only when it
leaves fewer permutes than there were.  The last node keeps its name (``builder.substitute``).
"""
from __future__ import annotations

from typing import Any, Callable

from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.passes import patterns as P
from mlcomp.passes.layouts import compose, layout_step, run_before

__all__ = ["reorder_rows"]


def reorder_rows(graph: Graph, leave: Callable[[Node], bool] | None = None) -> int:
    """Rewrite every linear whose rows are permuted before and after it (module docstring); how many.
    ``leave``: a linear it names stays as it is."""
    done = 0
    for node in graph.nodes():
        if node.name in graph and node.op in (P.ADDMM, P.MM) and not (leave and leave(node)) \
                and _reorder(graph, node):
            done += 1
    return done


def _concrete(node: Node) -> list[int] | None:
    shape = getattr(node.meta, "shape", None)
    return list(shape) if shape is not None and all(isinstance(d, int) for d in shape) else None


def _after(graph: Graph, node: Node, n: int) -> list[Node]:
    """The layout run after ``node`` that keeps the ``n`` features last and whole."""
    run: list[Node] = []
    while len(users := graph.users(node.name)) == 1 and (step := layout_step(users[0])) is not None:
        kind, arg = step
        keeps = arg[-1] == n if kind == "reshape" else arg[-1] == len(arg) - 1
        if not keeps:
            break
        node = users[0]
        run.append(node)
    return run


def _reorder(graph: Graph, product: Node) -> bool:
    x = product.inputs[1 if product.op == P.ADDMM else 0]
    shape = _concrete(product)
    source, before = run_before(graph, x)
    after = _after(graph, product, shape[-1]) if shape is not None else []
    src = graph.node(source.name) if isinstance(source, Ref) else None
    rows = _concrete(graph.node(x.name)) if isinstance(x, Ref) else None
    if not after or src is None or _concrete(src) is None or rows is None or len(shape) != 2:
        return False
    k = rows[-1]
    steps = [layout_step(n) for n in before]
    steps += [(kind, arg[:-1] + [k] if kind == "reshape" else arg) for kind, arg in map(layout_step, after)]
    composed = compose(_concrete(src), steps)
    count = sum(kind == "permute" for kind, _ in steps)
    if composed is None or sum(kind == "permute" for kind, _ in composed) >= count:
        return False
    if composed and composed[-1][0] == "reshape":
        composed.pop()                                      # the rows' reshape below takes its place
    value = source
    for kind, arg in composed:
        op = P.RESHAPE if kind == "reshape" else P.PERMUTE
        value = Ref(new_node(graph, op, [value, arg], name=f"{product.name}_rows", origin=product.origin,
                             before=product.name).name)
    flat = Ref(new_node(graph, P.RESHAPE, [value, [shape[0], k]], name=f"{product.name}_rows",
                        origin=product.origin, before=product.name).name)
    inputs = [product.inputs[0], flat, product.inputs[2]] if product.op == P.ADDMM else [flat, product.inputs[1]]
    linear = new_node(graph, product.op, inputs, dict(product.attrs), name=f"{product.name}_linear",
                      origin=product.origin, before=product.name)
    last = after[-1]
    substitute(graph, last.name, P.RESHAPE, [Ref(linear.name), _concrete(last)], origin=last.origin)
    remove_dead(graph, [n.name for n in (*before, product, *after[:-1])] + [x.name])
    return True
