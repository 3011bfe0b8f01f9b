"""The ONNX emitter's symbolic sizes: ``dim_param`` at the boundary, ``Shape``/``Gather`` arithmetic inside.

A symbolic dimension of an input becomes a named ``dim_param`` (``batch``, ``seq``), so one
ONNX model serves every size.  Where a rule needs a shape as a tensor (``Reshape``'s target,
``Expand``'s), :func:`shape_tensor` builds it at run time: literal sizes as a constant, each
symbolic size computed from the input that carries it::

    %view: f32[seq*batch, 16] = aten.view.default(%x, [%mul, 16])
        x/shape = Shape(x);  batch = Gather(x/shape, [0]);  seq = Gather(x/shape, [1])
        seq*batch = Mul(seq, batch);  view/shape = Concat(seq*batch, [16]);  view = Reshape(x, view/shape)

A size expression (sympy's text: ``seq*batch``, ``2*seq + 1``, ``(seq//2)``) is read with
Python's own parser and written one ONNX op per operator (:data:`BINARY`); a name no input
carries, or an operator outside the table (``Max``, ``floor``), declines the graph with the
reason.  The IR's size nodes (``aten.sym_size.int``, ``operator.mul``…) are emitted the
same way, as 1-element int64 tensors (:data:`SIZE_RULES`).
"""
from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any, Sequence

from mlcomp.ir import Node, Ref
from mlcomp.ir.ops import Namespace, Op
from mlcomp.ir.opsets import SYM_SIZE
from mlcomp.targets.onnx.emit_ops import Decline, normalize_dim

if TYPE_CHECKING:
    from mlcomp.targets.onnx.emit import Emitter

__all__ = ["BINARY", "SIZE_RULES", "dim_params", "shape_tensor", "size_of", "size_args"]

# python operator (in an expression, or an IR ``operator.*`` node) -> ONNX op on int64 sizes (all >= 0)
BINARY = {ast.Mult: "Mul", ast.Add: "Add", ast.Sub: "Sub", ast.FloorDiv: "Div", ast.Mod: "Mod"}
_OPERATOR_NAMES = {"mul": ast.Mult, "add": ast.Add, "sub": ast.Sub, "floordiv": ast.FloorDiv, "mod": ast.Mod}


def dim_params(shape: Sequence[Any]) -> list[Any]:
    """A value_info shape: ints, a symbol's name as its ``dim_param``, ``None`` (unnamed) for an expression."""
    return [d if isinstance(d, int) or d.isidentifier() else None for d in shape]


def _symbol(em: Emitter, name: str) -> str:
    """The size ``name`` as a 1-element int64 tensor: ``Shape`` of the first input with it as a dimension."""
    for node in em.graph.input_nodes:
        shape = node.tensor_meta.shape
        if name in shape:
            axis = shape.index(name)
            return em.add("Shape", [em.names[node.name]], hint=name, start=axis, end=axis + 1)
    raise Decline(f"the symbolic size {name} is no input's dimension")


def _expression(em: Emitter, tree: ast.AST, text: str) -> str:
    if isinstance(tree, ast.Name):
        return em.size_cache(tree.id, lambda: _symbol(em, tree.id))
    if isinstance(tree, ast.Constant) and isinstance(tree.value, int):
        return em.ints([tree.value], "size")
    if isinstance(tree, ast.BinOp) and type(tree.op) in BINARY:
        left, right = _expression(em, tree.left, text), _expression(em, tree.right, text)
        return em.add(BINARY[type(tree.op)], [left, right], hint="size")
    raise Decline(f"the symbolic size {text!r} uses {ast.dump(tree)[:40]}, which the emitter does not write")


def size_of(em: Emitter, expr: str) -> str:
    """The symbolic size ``expr`` (a name or an expression of names) as a 1-element int64 tensor."""
    def build() -> str:
        try:
            tree = ast.parse(expr.strip(), mode="eval").body
        except SyntaxError:
            raise Decline(f"the symbolic size {expr!r} is not an expression the emitter reads") from None
        return _expression(em, tree, expr)
    return em.size_cache(expr, build)


def shape_tensor(em: Emitter, shape: Sequence[Any], hint: str) -> str:
    """``shape`` as an int64 tensor: one constant when every size is literal, else a ``Concat`` of
    constant runs and the symbolic sizes computed at run time."""
    if all(isinstance(d, int) for d in shape):
        return em.ints(shape, hint)
    parts: list[str] = []
    run: list[int] = []
    for d in shape:
        if isinstance(d, int):
            run.append(d)
            continue
        if run:
            parts.append(em.ints(run, f"{hint}/part"))
            run = []
        parts.append(size_of(em, d))
    if run:
        parts.append(em.ints(run, f"{hint}/part"))
    return em.add("Concat", parts, hint=hint, axis=0)


def size_args(node: Node) -> dict[str, Any]:
    """Arguments of a size node by name (``operator.*`` ops have no ATen schema)."""
    return {"self": node.inputs[0], "other": node.inputs[1] if len(node.inputs) > 1 else None}


def _size_value(em: Emitter, v: Any, hint: str) -> str:
    return em.names[v.name] if isinstance(v, Ref) and v.name in em.names else em.ints([int(v)], hint)


def _sym_size(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    x, dim = node.inputs[0], node.inputs[1]
    axis = normalize_dim(dim, len(em.meta(x).shape))
    em.add("Shape", [em.value(x)], out=node.name, start=axis, end=axis + 1)


def _operator(kind: type) -> Any:
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        if a["other"] is None or not all(isinstance(v, (Ref, int)) for v in (a["self"], a["other"])):
            raise Decline("a size operator on something other than sizes")
        em.add(BINARY[kind], [_size_value(em, a["self"], f"{node.name}/a"),
                              _size_value(em, a["other"], f"{node.name}/b")], out=node.name)
    return rule


SIZE_RULES = {SYM_SIZE: _sym_size,
              **{Op(Namespace.OPERATOR, name): _operator(kind) for name, kind in _OPERATOR_NAMES.items()}}
