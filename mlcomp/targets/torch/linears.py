"""Products the cpu target hands TorchScript as ``aten::linear``, so its executor keeps eager's fused GEMM.

TorchScript's graph executor decomposes every ``aten::addmm`` whose ``beta`` and ``alpha`` are the
constant 1 into ``aten::mm`` + ``aten::add`` when it optimises a graph (a rewrite meant for its own
fusers): the bias then costs a second pass over the product, a fresh buffer and a kernel call.
``aten::linear`` is left alone, and for a 2-D input it runs the very ``addmm`` eager runs (bias in
the GEMM).  So a frozen module's products are written as linears of the transposed second matrix;
constant propagation folds that transpose into the weight constant::

    before:  %12 : Tensor = aten::addmm(%bias, %x, %w_t, %one, %one)       # %w_t a [K, N] constant
    after:   %12 : Tensor = aten::linear(%x, %w, %bias)                    # %w its [N, K] transpose

:data:`SAME_KERNEL` says which node kinds run the same kernel (a module compared by its kernels
before and after ``optimize_for_inference`` counts a linear as the ``addmm`` it calls).  One walk over
the graph's nodes.
"""
from __future__ import annotations

import torch

__all__ = ["SAME_KERNEL", "addmm_as_linear", "freeze_with_linears"]

# node kind -> the kind whose kernel it runs (for comparing two modules' kernel calls)
SAME_KERNEL = {"aten::linear": "aten::addmm"}
_UNIT = ("beta", "alpha")


def _is_one(value: torch._C.Value) -> bool:
    node = value.node()
    return node.kind() == "prim::Constant" and value.toIValue() == 1


def addmm_as_linear(graph: torch._C.Graph) -> int:
    """Rewrite, in place, each ``addmm(b, x, m, 1, 1)`` of ``graph`` whose ``m`` is a constant as
    ``linear(x, t(m), b)``; how many."""
    count = 0
    for node in graph.findAllNodes("aten::addmm"):
        inputs = list(node.inputs())
        if len(inputs) != 2 + len(_UNIT) + 1 or not all(_is_one(v) for v in inputs[3:]):
            continue
        bias, x, mat2 = inputs[:3]
        if mat2.node().kind() != "prim::Constant":     # a computed operand (a training graph's weight) stays
            continue
        transpose = graph.create("aten::t", [mat2])
        transpose.insertBefore(node)
        transpose.output().setType(mat2.type())
        linear = graph.create("aten::linear", [x, transpose.output(), bias])
        linear.insertBefore(node)
        linear.output().setType(node.output().type())
        node.output().replaceAllUsesWith(linear.output())
        node.destroy()
        count += 1
    return count


def freeze_with_linears(module: torch.jit.ScriptModule) -> torch.jit.ScriptModule:
    """``torch.jit.freeze(module)`` with its products as linears (:func:`addmm_as_linear`), the weights'
    transposes folded into the constants; ``module`` itself is not changed."""
    frozen = torch.jit.freeze(module)
    if addmm_as_linear(frozen.graph):
        torch._C._jit_pass_constant_propagation(frozen.graph)
    return frozen
