"""IR → the FX module OpenVINO's PyTorch frontend converts, and the conversion itself.

:func:`~mlcomp.runtime.codegen.to_fx` generates the torch module; every node whose
ATen op the frontend translates reaches it whole, so OpenVINO sees what it fuses
(``aten.scaled_dot_product_attention`` becomes its ``ScaledDotProductAttention``,
which the CPU plugin runs as one attention kernel).  Only the nodes it lacks are
replaced, one by one, by the ops torch decomposes them into (``aten.reshape`` →
``aten.view`` or ``clone`` + ``view``)::

    %reshape = aten.reshape.default(%permute, [2, 32, 64])
  becomes
    %clone = aten.clone.default(%permute, memory_format=torch.contiguous_format)
    %view = aten.view.default(%clone, [2, 32, 64])

A product against a weight copied along the batch (``bmm(x, w.expand(b, k, n))``,
a linear layer on a 3-d input that is not contiguous, as after a transpose; weight folding
may store the copies, or the ``expand`` of the 2-d weight stays) is handed over as a 2-d product with one copy, which OpenVINO runs as ``FullyConnected``
instead of a batched ``MatMul`` that transposes its weight on every call::

    %bmm_2 = aten.bmm.default(%view_16, %expand_8)            # %expand_8: f32[2, 64, 64], equal slices
  becomes
    %bmm_2 = aten.view.default(aten.mm.default(aten.reshape.default(%view_16, [64, 64]), %expand_8_w), [2, 32, 64])
    %bmm = aten.bmm.default(%permute_1, aten.expand.default(%w, [2, 64, 128]))      # %w: f32[64, 128]
  becomes
    %bmm = aten.view.default(aten.mm.default(aten.reshape.default(%permute_1, [128, 64]), %w), [2, 64, 128])

Tracing the whole module instead (``make_fx``) would decompose every composite op
with them, attention included: OpenVINO then runs MatMul, Softmax and Transpose
layers where its own conversion runs one fused attention subgraph.  A graph that
holds mlcomp composites (fused kernels) is traced whole: their bodies are Python.
"""
from __future__ import annotations

import operator
from functools import lru_cache
from typing import Any, Callable

import torch
from torch import fx

from mlcomp.ir import Graph, Ref, TensorMeta, refs_in
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.ir.ops import PARAM, Namespace, Op, aten

__all__ = ["activations_before_views", "decomposition", "lower_for_frontend", "shared_weights_as_linear", "translated"]

# ATen overloads the FX frontend translates that the partitioner's table (``OperatorSupport``)
# leaves out; tracing would decompose them, so they are kept whole only when listed here
_FRONTEND_ALSO = frozenset({"torch.ops.aten.scaled_dot_product_attention.default"})


@lru_cache(maxsize=1)
def translated() -> frozenset[str]:
    """Qualified names of the ATen overloads OpenVINO's FX decoder translates."""
    from openvino.frontend.pytorch.torchdynamo.op_support import OperatorSupport

    return frozenset(OperatorSupport(None)._support_dict) | _FRONTEND_ALSO


def decomposition(op: Op) -> Any:
    """How torch decomposes ``op`` when tracing: its table entry, ``"implicit"`` for a composite op, or None."""
    from torch._decomp import decomposition_table

    overload = op.resolve()
    if overload in decomposition_table:
        return decomposition_table[overload]
    if isinstance(overload, torch._ops.OpOverload) and \
            overload.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return "implicit"      # make_fx decomposes it by itself
    return None


def _example(node: fx.Node) -> torch.Tensor:
    meta = node.meta["tensor_meta"]
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype)


def _inline(module: fx.GraphModule, node: fx.Node, table: dict[Any, Callable[..., Any]]) -> None:
    """Replace ``node`` by the graph ``make_fx`` traces for its op on example values of its operands."""
    from torch.fx.experimental.proxy_tensor import make_fx

    operands: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), operands.append)
    operands = list(dict.fromkeys(operands))
    target = node.target

    def call(*values: torch.Tensor) -> Any:
        env = dict(zip(operands, values))
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        return target(*args, **kwargs)

    traced = make_fx(call, decomposition_table=table)(*[_example(o) for o in operands])
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for sub in traced.graph.nodes:              # constants the decomposition made: copied onto the module
        if sub.op == "get_attr":
            name = f"_lowered_{node.name}_{sub.target}"
            setattr(module, name, getattr(traced, sub.target))
            sub.target = name
    with module.graph.inserting_before(node):
        out = module.graph.graph_copy(traced.graph, dict(zip(placeholders, operands)))
    if isinstance(out, (tuple, list)):           # a multi-output op: its getitem users take the parts
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(out[user.args[1]])
                module.graph.erase_node(user)
    else:
        node.replace_all_uses_with(out)
    module.graph.erase_node(node)


_SDPA_POSITIONAL = ("attn_mask", "dropout_p", "is_causal")    # positional in the schema, after q, k, v


def _sdpa_positional(module: fx.GraphModule) -> None:
    """Attention's mask (and dropout, causal flag) as positional arguments: the FX frontend reads
    ``attn_mask`` only from its position and drops it as a keyword, which changes the result."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    for node in module.graph.nodes:
        if node.target is sdpa and any(k in node.kwargs for k in _SDPA_POSITIONAL):
            args, kwargs = list(node.args), dict(node.kwargs)
            defaults = (None, 0.0, False)
            args += list(defaults[len(args) - 3:])
            for i, key in enumerate(_SDPA_POSITIONAL):
                if key in kwargs:
                    args[3 + i] = kwargs.pop(key)
            node.args, node.kwargs = tuple(args), kwargs


def lower_for_frontend(module: fx.GraphModule, inputs: tuple[torch.Tensor, ...], lowered: dict[Any, Any],
                       *, whole: bool, symbolic: bool = False) -> fx.GraphModule:
    """``module`` with the ops in ``lowered`` (overload → decomposition) replaced by what torch decomposes
    them into: node by node, or by tracing the whole module when ``whole`` (mlcomp composites) or the
    sizes are ``symbolic`` (traced symbolically, so they stay computed from the inputs)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.passes.shape_prop import ShapeProp

    table = {k: v for k, v in lowered.items() if callable(v)}
    _sdpa_positional(module)
    module.recompile()
    if whole or (symbolic and lowered):         # node by node would fix the sizes at the examples'
        return make_fx(module, decomposition_table=table, tracing_mode="symbolic" if symbolic else "real",
                       _allow_non_fake_inputs=symbolic)(*inputs)
    if not lowered:
        return module
    ShapeProp(module).propagate(*inputs)         # operand shapes and strides for the examples
    for node in list(module.graph.nodes):
        if node.op == "call_function" and node.target in lowered:
            _inline(module, node, table)
    module.graph.lint()
    module.recompile()
    return module


def frontend_name(op: Op) -> str | None:
    """The name the frontend's table knows ``op`` by (None for ops outside ATen, prims and operator)."""
    from torch.fx.node import _get_qualified_name

    if op.namespace is Namespace.OPERATOR:
        return f"_operator.{op.name}"
    if op.namespace in (Namespace.ATEN, Namespace.PRIMS):
        return _get_qualified_name(op.resolve())
    return None


def _shared_weight(graph: Graph, ref: object) -> Ref | torch.Tensor | None:
    """The 2-d weight a 3-d operand repeats along dim 0, else None: a reference to the 2-d constant an
    ``expand`` broadcasts, or the first slice of a 3-d constant whose slices are all equal."""
    node = graph.node(ref.name) if isinstance(ref, Ref) else None
    if node is None or not isinstance(node.meta, TensorMeta) or len(node.meta.shape) != 3:
        return None
    if node.op == aten("expand") and isinstance(node.inputs[0], Ref):
        source = graph.node(node.inputs[0].name)
        broadcast = source is not None and source.op == PARAM and isinstance(source.meta, TensorMeta) \
            and tuple(source.meta.shape) == tuple(node.meta.shape[1:])
        return Ref(source.name) if broadcast else None
    if node.op != PARAM:
        return None
    value = graph.constants[node.name]
    return value[0].clone() if value.shape[0] > 1 and bool((value == value[:1]).all()) else None


def shared_weights_as_linear(graph: Graph) -> Graph:
    """``graph`` (a copy, if anything changes) with each ``bmm`` against a batch-repeated constant (stored
    repeated, or a 2-d constant ``expand``-ed) as one ``mm`` over the batch's rows (the constant kept once)."""
    bmm = aten("bmm")
    found = [(n, w) for n in graph.call_nodes() if n.op == bmm and isinstance(n.meta, TensorMeta)
             and all(isinstance(d, int) for d in n.meta.shape)
             and (w := _shared_weight(graph, n.inputs[1])) is not None]
    if not found:
        return graph
    out = graph.copy()
    for node, weight in found:
        batch, rows, n = node.meta.shape
        if not isinstance(weight, Ref):
            weight = Ref(out.add_constant(out.fresh_name(f"{node.inputs[1].name}_w"), weight,
                                          origin=node.origin).name)
        k = out.node(weight.name).meta.shape[0]
        flat = new_node(out, aten("reshape"), [node.inputs[0], [batch * rows, k]],
                        name=f"{node.name}_rows", origin=node.origin, before=node.name)
        mm = new_node(out, aten("mm"), [Ref(flat.name), weight], name=f"{node.name}_mm", origin=node.origin,
                      before=node.name)
        stale = node.inputs[1].name
        substitute(out, node.name, aten("view"), [Ref(mm.name), [batch, rows, n]], origin=node.origin)
        remove_dead(out, [stale])
    return out


# element-wise activations the CPU plugin fuses into the product that writes their input (a post-op)
_ACTIVATIONS = frozenset({aten("gelu"), aten("relu"), aten("silu"), aten("sigmoid"), aten("tanh")})
_VIEWS = frozenset({aten("view"), aten("_unsafe_view"), aten("reshape")})
_ADD = aten("add.Tensor")


def activations_before_views(graph: Graph) -> Graph:
    """``graph`` (a copy, if anything changes) with each activation, and each bias add (a constant of one row:
    shape ``[n]``, ``[1, n]``, …), that reads a view read by nothing else computed before the view (a view
    of fixed sizes that keeps the last dimension: one with symbolic sizes stays).  A linear on a 3-d input
    is captured as ``view → addmm → view``; with its activation after the second view the plugin runs the
    product and the activation (and the quantize that follows it) as separate layers, with the activation
    applied before the view they become one ``FullyConnected`` with post-ops, and the two views cancel::

        %view_21 = aten.view(%addmm_3, [8, 128, 3072]);  %gelu = aten.gelu(%view_21)
      becomes
        %gelu_rows = aten.gelu(%addmm_3);  %gelu = aten.view(%gelu_rows, [8, 128, 3072])

    A linear on a non-contiguous 3-d input is captured as ``bmm`` and a bias ``add``
    (:func:`shared_weights_as_linear` makes the ``bmm`` a viewed ``mm``); its bias moves the same way and
    the plugin runs product and bias as one ``FullyConnected``::

        %bmm_1 = aten.view(%bmm_1_mm, [2, 16, 10]);  %add = aten.add.Tensor(%bmm_1, %out_bias)
      becomes
        %add_rows = aten.add.Tensor(%bmm_1_mm, %out_bias);  %add = aten.view(%add_rows, [2, 16, 10])
    """
    found = [n.name for n in graph.call_nodes() if _moves_before_view(graph, n)]
    if not found:
        return graph
    out = graph.copy()
    for name in found:
        node = out.node(name)
        view = out.node(node.inputs[0].name)
        act = new_node(out, node.op, [view.inputs[0], *node.inputs[1:]], node.attrs, name=f"{name}_rows",
                       origin=node.origin, before=name)
        substitute(out, name, view.op, [Ref(act.name), *view.inputs[1:]], view.attrs, origin=node.origin)
        remove_dead(out, [view.name])
    return out


def _moves_before_view(graph: Graph, node: Any) -> bool:
    """Whether ``node`` (an activation or a one-row bias add) reads a fixed-size view that only it reads."""
    if node.op not in _ACTIVATIONS and not (node.op == _ADD and _row_bias(graph, node)):
        return False
    src = graph.node(node.inputs[0].name) if node.inputs and isinstance(node.inputs[0], Ref) else None
    return src is not None and src.op in _VIEWS and len(graph.users(src.name)) == 1 \
        and isinstance(src.inputs[0], Ref) and not refs_in(list(src.inputs[1:]))


def _row_bias(graph: Graph, node: Any) -> bool:
    """``add(view, c)`` (no ``alpha``) where ``c`` is a constant of one row as wide as the view's last
    dimension and the view's input's: the sum is the same before the view and after it."""
    if len(node.inputs) != 2 or node.attrs.get("alpha", 1) != 1 or not isinstance(node.inputs[1], Ref):
        return False
    view, bias = graph.node(node.inputs[0].name) if isinstance(node.inputs[0], Ref) else None, \
        graph.node(node.inputs[1].name)
    if view is None or bias is None or bias.op != PARAM or not isinstance(node.meta, TensorMeta) \
            or not isinstance(bias.meta, TensorMeta) or not bias.meta.shape or view.op not in _VIEWS:
        return False
    product = graph.node(view.inputs[0].name) if isinstance(view.inputs[0], Ref) else None
    width = node.meta.shape[-1]
    return product is not None and isinstance(product.meta, TensorMeta) and bool(product.meta.shape) \
        and product.meta.shape[-1] == width and bias.meta.dtype == node.meta.dtype \
        and tuple(bias.meta.shape) == (*([1] * (len(bias.meta.shape) - 1)), width) \
        and len(bias.meta.shape) <= len(product.meta.shape)
