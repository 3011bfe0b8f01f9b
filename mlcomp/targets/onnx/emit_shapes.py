"""The ONNX emitter's rules for shape ops: views, transposes, slices, splits, concatenation, gathers, fills.

Shapes are the node's static output shape (``-1`` already resolved), dims are normalised,
``slice`` bounds are clamped as Python slices are (``end = INT64_MAX`` → the size), and
``squeeze`` drops only the dims of size 1, as ATen does.  Chains ORT would otherwise run
are written as one node (what onnxscript's optimizer leaves for the torch.onnx path)::

    %view = aten.view.default(%relu, [2, 64])      view/shape = initializer i64[2];  view = Reshape(relu, view/shape)
    %squeeze = aten.squeeze.dims(%p, [-2])         squeeze = Squeeze(p, squeeze/axes)   (axes [3]: size-1 dims only)
    view(bmm(view(a), view(b)))                    MatMul(a, b)   (batch dims flattened and restored: broadcast)
    permute(permute(x, p), q)                      Transpose(x, p∘q), or nothing when they cancel
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mlcomp.ir import Node, Ref
from mlcomp.ir.ops import aten
from mlcomp.targets.onnx.emit_ops import Decline, Rule, normalize_dim, out_dtype
from mlcomp.targets.onnx.emit_sizes import shape_tensor

if TYPE_CHECKING:
    from mlcomp.targets.onnx.emit import Emitter

__all__ = ["SHAPE_RULES"]


def _reshape(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    """``Reshape`` to the IR's static output shape; a reshape of a reshape reads the first one's input,
    a reshape to the input's own shape is none, and ``view(bmm(view(a), view(b)))`` that only
    flattened and restored batch dims is one broadcasting ``MatMul(a, b)`` (as onnxscript's optimizer
    leaves it, so ORT fuses a scale before it)."""
    shape = tuple(node.tensor_meta.shape)      # static: the IR's output shape (-1 already resolved)
    source = em.value(a["self"])
    while (made := em.source_of(source, "Reshape")) is not None and em.shape(made[0][0]) is not None:
        source = made[0][0]
    if em.shape(source) == shape:
        em.alias(node, source)
        return
    if _batched_matmul(em, node, source, shape):
        return
    attrs = {"allowzero": 1} if 0 in shape else {}
    em.add("Reshape", [source, shape_tensor(em, shape, f"{node.name}/shape")], out=node.name, **attrs)


def _batched_matmul(em: Emitter, node: Node, source: str, shape: tuple[int, ...]) -> bool:
    made = em.source_of(source, "MatMul")
    if made is None or len(shape) < 3:
        return False
    operands = []
    for value in made[0]:
        inner = em.source_of(value, "Reshape")
        original = inner[0][0] if inner is not None else value
        dims, seen = em.shape(original), em.shape(value)
        if dims is None or seen is None or len(dims) < 2 or len(dims) > len(shape) or dims[-2:] != seen[-2:]:
            return False
        lead = (1,) * (len(shape) - len(dims)) + tuple(dims[:-2])   # right-aligned: leading 1s only
        if lead != shape[:-2]:
            return False
        operands.append((original, dims))
    (x, x_dims), (y, y_dims) = operands
    if (x_dims[-2], y_dims[-1]) != shape[-2:]:
        return False
    em.add("MatMul", [x, y], out=node.name)
    return True


def _expand(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    shape = tuple(node.tensor_meta.shape)
    if tuple(em.meta(a["self"]).shape) == shape:      # to its own shape: nothing to do
        em.alias(node, em.value(a["self"]))
        return
    em.add("Expand", [em.value(a["self"]), shape_tensor(em, shape, f"{node.name}/shape")], out=node.name)


def _permute(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    """``Transpose``; a transpose of a transpose is one (or none, when the two cancel)."""
    rank = len(node.tensor_meta.shape)
    perm = [normalize_dim(d, rank) for d in a["dims"]]
    source = em.value(a["self"])
    made = em.source_of(source, "Transpose")
    if made is not None:
        source, perm = made[0][0], [made[1]["perm"][p] for p in perm]
    if perm == list(range(rank)):
        em.alias(node, source)
    else:
        em.add("Transpose", [source], out=node.name, perm=perm)


def _transpose(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    rank = len(node.tensor_meta.shape)
    if rank < 2:
        em.alias(node, em.value(a["self"]))
        return
    perm = list(range(rank))
    d0, d1 = (normalize_dim(a["dim0"], rank), normalize_dim(a["dim1"], rank)) if "dim0" in a else (0, 1)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    em.add("Transpose", [em.value(a["self"])], out=node.name, perm=perm)


def _squeeze(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    shape = em.meta(a["self"]).shape
    dims = a.get("dims", a.get("dim", None))
    dims = list(range(len(shape))) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    axes = sorted({normalize_dim(d, len(shape)) for d in dims if shape and shape[d] == 1})  # ATen skips others
    if not axes:
        em.alias(node, em.value(a["self"]))
        return
    em.add("Squeeze", [em.value(a["self"]), em.ints(axes, f"{node.name}/axes")], out=node.name)


def _unsqueeze(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    axis = normalize_dim(a["dim"], len(node.tensor_meta.shape))
    em.add("Unsqueeze", [em.value(a["self"]), em.ints([axis], f"{node.name}/axes")], out=node.name)


def _slice(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    shape = em.meta(a["self"]).shape
    dim = normalize_dim(a["dim"], len(shape))
    if a["step"] <= 0 or any(isinstance(a[k], Ref) for k in ("start", "end")):
        raise Decline("a non-positive step or a tensor bound")
    start, end, step = slice(a["start"], a["end"], a["step"]).indices(shape[dim])   # clamped as ATen clamps
    if (start, step) == (0, 1) and end >= shape[dim]:
        em.alias(node, em.value(a["self"]))
        return
    end = max(end, start)
    em.add("Slice", [em.value(a["self"]), em.ints([start], f"{node.name}/start"), em.ints([end], f"{node.name}/end"),
                     em.ints([dim], f"{node.name}/axes"), em.ints([step], f"{node.name}/step")], out=node.name)


def _slice_scatter(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    """``self`` with ``self[start:end]`` along ``dim`` replaced by ``src``: the ``Concat`` of the part
    before, ``src`` and the part after (empty parts left out); a step other than 1 is declined."""
    shape = tuple(node.tensor_meta.shape)
    dim = normalize_dim(a["dim"], len(shape))
    bounds = (a.get("start"), a.get("end"), a.get("step", 1))
    if any(isinstance(b, Ref) for b in bounds) or bounds[2] != 1:
        raise Decline("a step other than 1 or a tensor bound")
    start, end, _ = slice(*bounds).indices(shape[dim])
    end = max(end, start)
    dtype = out_dtype(node)
    parts, whole = [], em.value(a["self"], dtype)
    for lo, hi in ((0, start), (end, shape[dim])):
        if hi > lo:
            parts.append(em.add("Slice", [whole, em.ints([lo], f"{node.name}/start"), em.ints([hi], f"{node.name}/end"),
                                          em.ints([dim], f"{node.name}/axes")], hint=f"{node.name}/part"))
    if end > start:
        parts.insert(1 if start > 0 else 0, em.value(a["src"], dtype))
    if len(parts) == 1:
        em.alias(node, parts[0])
        return
    em.add("Concat", parts, out=node.name, axis=dim)


def _copy(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    """``copy(self, src)``'s value: ``src`` in ``self``'s dtype, broadcast to ``self``'s shape."""
    if not isinstance(a["src"], Ref):
        raise Decline("a scalar source")
    shape = tuple(node.tensor_meta.shape)
    src = em.value(a["src"], out_dtype(node))
    if tuple(em.meta(a["src"]).shape) == shape:
        em.alias(node, src)
        return
    em.add("Expand", [src, em.ints(shape, f"{node.name}/shape")], out=node.name)


def _select(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    shape = em.meta(a["self"]).shape
    dim = normalize_dim(a["dim"], len(shape))
    index = a["index"]
    if not -shape[dim] <= index < shape[dim]:
        raise Decline(f"index {index} is out of range")
    index = em.const(np.array(index % shape[dim]), torch.int64, f"{node.name}/index")
    em.add("Gather", [em.value(a["self"]), index], out=node.name, axis=dim)


def _split(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    shape = em.meta(a["self"]).shape
    dim = normalize_dim(a["dim"], len(shape))
    size = a.get("split_size", None)
    if "split_sizes" in a:
        sizes = list(a["split_sizes"])
    elif isinstance(size, int) and size > 0:
        sizes = [min(size, shape[dim] - i) for i in range(0, shape[dim], size)] or [0]
    else:
        raise Decline("split sizes")
    outs = em.outs(node, len(sizes))
    em.add_multi("Split", [em.value(a["self"]), em.ints(sizes, f"{node.name}/sizes")], outs, axis=dim)


def _cat(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    """``Concat`` of the inputs holding elements (an empty one adds nothing; ATen skips legacy 1-D
    empties of any shape); a single one left is the value itself."""
    dtype, shape = out_dtype(node), tuple(node.tensor_meta.shape)
    parts = [t for t in a["tensors"] if 0 not in em.meta(t).shape] or list(a["tensors"][:1])
    if len(parts) == 1 and tuple(em.meta(parts[0]).shape) == shape:
        em.alias(node, em.value(parts[0], dtype))
        return
    axis = normalize_dim(a["dim"], len(shape))
    em.add("Concat", [em.value(t, dtype) for t in parts], out=node.name, axis=axis)


def _gather(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    if a.get("sparse_grad"):
        raise Decline("sparse_grad")
    axis = normalize_dim(a["dim"], len(em.meta(a["self"]).shape))
    em.add("GatherElements", [em.value(a["self"]), em.value(a["index"])], out=node.name, axis=axis)


def _index_select(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    axis = normalize_dim(a["dim"], len(em.meta(a["self"]).shape))
    em.add("Gather", [em.value(a["self"]), em.value(a["index"])], out=node.name, axis=axis)


def _filled(value_key: str | None, fill: Any = None) -> Rule:
    """A constant tensor of the node's static shape: one scalar initializer expanded (ORT folds it)."""
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        if a.get("device") is not None and torch.device(a["device"]).type != "cpu":
            raise Decline(f"a tensor on {a['device']}")
        value = a[value_key] if value_key else fill
        if isinstance(value, Ref):
            raise Decline("a tensor fill value")
        meta = node.tensor_meta
        scalar = em.value(value, meta.dtype, hint=f"{node.name}/value")
        if not meta.shape:
            em.alias(node, scalar)
            return
        em.add("Expand", [scalar, em.ints(meta.shape, f"{node.name}/shape")], out=node.name)
    return rule


def _arange(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    """``arange(start, end, step)`` of numbers: the values as one initializer (a size that is a value declines)."""
    bounds = [a["start"], a["end"], a.get("step", 1)]
    if not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds):
        raise Decline(f"arange over computed bounds {bounds}")
    if a.get("device") is not None and torch.device(a["device"]).type != "cpu":
        raise Decline(f"a tensor on {a['device']}")
    meta = node.tensor_meta
    em.alias(node, em.const(torch.arange(*bounds, dtype=meta.dtype), meta.dtype, node.name))


def _constant_pad(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    pad, rank = list(a["pad"]), len(node.tensor_meta.shape)
    if len(pad) % 2 or len(pad) // 2 > rank or any(p < 0 for p in pad):
        raise Decline(f"pad {pad}")
    begins, ends = [0] * rank, [0] * rank
    for i in range(len(pad) // 2):          # ATen: (last dim begin, end, second-to-last begin, end, …)
        begins[rank - 1 - i], ends[rank - 1 - i] = pad[2 * i], pad[2 * i + 1]
    dtype = out_dtype(node)
    em.add("Pad", [em.value(a["self"]), em.ints(begins + ends, f"{node.name}/pads"),
                   em.value(a["value"], dtype, hint=f"{node.name}/value")], out=node.name, mode="constant")


SHAPE_RULES: dict[Any, Rule] = {
    **{aten(name): _reshape for name in ("view", "reshape", "_unsafe_view")},
    aten("expand"): _expand, aten("permute"): _permute, aten("t"): _transpose, aten("transpose.int"): _transpose,
    aten("squeeze.dims"): _squeeze, aten("squeeze.dim"): _squeeze, aten("squeeze"): _squeeze,
    aten("unsqueeze"): _unsqueeze, aten("slice.Tensor"): _slice, aten("select.int"): _select,
    aten("split_with_sizes"): _split, aten("split.Tensor"): _split, aten("cat"): _cat,
    aten("gather"): _gather, aten("index_select"): _index_select,
    aten("scalar_tensor"): _filled("s"), aten("full"): _filled("fill_value"), aten("arange.start_step"): _arange,
    aten("full_like"): _filled("fill_value"), aten("zeros_like"): _filled(None, 0), aten("ones_like"): _filled(None, 1),
    aten("constant_pad_nd"): _constant_pad, aten("slice_scatter"): _slice_scatter, aten("copy"): _copy,
}
