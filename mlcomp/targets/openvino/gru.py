"""``nn.GRU`` handed to OpenVINO whole: one ``GRUSequence`` per layer instead of the unrolled cells.

Capture lowers ``nn.GRU`` to core ATen, which unrolls it: per step and layer two matrix products,
slices, sigmoids and a tanh.  OpenVINO's FX decoder has no translation for ``aten.gru``, so it
would run those cells one by one.  Three steps give it its ``GRUSequence`` instead:

1. :func:`~mlcomp.targets.recurrent.recompose_rnns` (IR, shared with the onnxruntime target) puts each
   ``nn.GRU`` region back as one ``aten.gru.input`` node where its weights are still the module's own
   parameters (a pipeline whose cleanup folds weights, ``-O2``'s, leaves the region unrolled);
   :func:`whole_rnns` keeps that only if it reproduces the graph on the example inputs;
2. :func:`gru_parts` (FX) writes each ``getitem`` of such a node as ``mlcomp.gru_part`` (one tensor out:
   the frontend maps one output per FX node)::

       %gru_rnn = aten.gru.input(%embedding, %gru_h0, [%w_ih, %w_hh, %b_ih, %b_hh], True, 1, 0.0, False, False, True)
       %permute_35 = getitem(%gru_rnn, 0)
     becomes
       %permute_35 = mlcomp.gru_part(%embedding, %gru_h0, [%w_ih, %w_hh, %b_ih, %b_hh], True, 1, False, True, 0)

3. :func:`gru_extension` converts ``mlcomp.gru_part`` into ``GRUSequence`` layers: PyTorch's gate order
   (r, z, n) reordered to OpenVINO's (z, r, h), ``linear_before_reset`` (PyTorch's reset gate multiplies
   ``W_hn·h + b_hn``), the two biases of r and z summed.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from mlcomp.ir import Graph
from mlcomp.ir.interpreter import Interpreter
from mlcomp.targets.recurrent import RecomposeStats, recompose_rnns

__all__ = ["whole_rnns", "gru_parts", "gru_extension", "GRU_PART"]


@torch.library.custom_op("mlcomp::gru_part", mutates_args=())
def _gru_part(x: torch.Tensor, h0: torch.Tensor, params: list[torch.Tensor], has_biases: bool, num_layers: int,
              bidirectional: bool, batch_first: bool, part: int) -> torch.Tensor:
    """Output ``part`` (0: the sequence, 1: the last states) of ``aten.gru.input`` in eval mode."""
    out = torch.ops.aten.gru.input(x, h0, params, has_biases, num_layers, 0.0, False, bidirectional, batch_first)
    return out[part].clone()


@_gru_part.register_fake
def _(x, h0, params, has_biases, num_layers, bidirectional, batch_first, part):
    if part == 1:
        return h0.new_empty(h0.shape)
    dirs = 2 if bidirectional else 1
    return x.new_empty((*x.shape[:2], dirs * h0.shape[-1]))


GRU_PART = torch.ops.mlcomp.gru_part.default


def whole_rnns(graph: Graph, inputs: tuple[torch.Tensor, ...]) -> tuple[Graph, RecomposeStats]:
    """``graph`` with its unrolled GRU layers put back (a copy; ``graph`` itself if none is), kept only if it
    gives ``graph``'s outputs on ``inputs``; and what was put back or left, with the reason."""
    stats = RecomposeStats(nodes_before=len(graph.order()))
    out = graph.copy()
    recompose_rnns(out, stats)
    if stats.recomposed:
        want, got = Interpreter(graph).run(*inputs), Interpreter(out).run(*inputs)
        if not all(torch.allclose(a, e, rtol=1e-4, atol=1e-5, equal_nan=True) for a, e in zip(got, want)):
            stats.skipped["graph"] = "the rewritten graph did not reproduce the original; converted unrolled"
            stats.recomposed = []
    if not stats.recomposed:
        out = graph
    stats.nodes_after = len(out.order())
    return out, stats


def gru_parts(module: fx.GraphModule) -> fx.GraphModule:
    """``module`` (in place; returned) with each ``getitem`` of an ``aten.gru.input`` call as a ``gru_part`` call."""
    calls = [n for n in module.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.gru.input]
    for call in calls:
        x, h0, params, has_biases, layers, _, _, bidirectional, batch_first = call.args
        for user in list(call.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise ValueError(f"{call.name}: read other than by getitem")
            user.target = GRU_PART
            user.args = (x, h0, params, has_biases, layers, bidirectional, batch_first, user.args[1])
        module.graph.erase_node(call)
    if calls:
        module.graph.lint()
        module.recompile()
    return module


def _layer_weights(params: list[Any], first: int, has_biases: bool, hidden: int) -> tuple[Any, Any, Any]:
    """One direction's ``W``, ``R``, ``B`` as arrays in OpenVINO's gate order (z, r, h) (PyTorch's: r, z, n)."""
    import numpy as np

    def zrn(i: int) -> list[Any]:
        r, z, n = np.split(params[first + i].get_node().get_data(), 3)
        return [z, r, n]

    w, r = np.concatenate(zrn(0)), np.concatenate(zrn(1))
    if has_biases:
        (iz, ir, i_n), (hz, hr, h_n) = zrn(2), zrn(3)
        return w, r, np.concatenate([iz + hz, ir + hr, i_n, h_n])
    return w, r, np.zeros(4 * hidden, dtype=w.dtype)


def _lengths(ops: Any, x: Any) -> Any:
    """Every sequence's length (``[batch]``, i32; ``x``: ``[batch, steps, features]``): a constant where the sizes
    are static (the CPU plugin then runs its RNN sequence kernel, ``RNNSeq``; with lengths computed from the
    input's shape it unrolls the layer into a ``TensorIterator``), else computed from ``x``'s shape."""
    import numpy as np

    shape = x.get_partial_shape()
    if shape.is_static:
        return ops.constant(np.full(shape[0].get_length(), shape[1].get_length(), dtype=np.int32))
    sizes = ops.shape_of(x, "i32")
    return ops.broadcast(ops.gather(sizes, ops.constant(np.int64(1)), ops.constant(np.int64(0))),
                         ops.gather(sizes, ops.constant(np.array([0], dtype=np.int64)), ops.constant(np.int64(0))))


def _convert_gru_part(context: Any) -> list[Any]:
    """``mlcomp.gru_part`` as ``GRUSequence`` layers (see the module docstring)."""
    import numpy as np
    from openvino import opset13 as ops

    def i64(v: Any) -> Any:
        return ops.constant(np.array(v, dtype=np.int64))

    x, h0 = context.get_input(0), context.get_input(1)
    params = list(context.get_input(2).get_node().input_values())
    has_biases, layers, bidirectional, batch_first, part = (context.get_values_from_const_input(i)
                                                           for i in range(3, 8))
    dirs, per = (2 if bidirectional else 1), (4 if has_biases else 2)
    hidden = params[1].get_partial_shape()[1].get_length()
    if not batch_first:
        x = ops.transpose(x, i64([1, 0, 2])).output(0)
    lengths = _lengths(ops, x)
    states = []
    for layer in range(layers):
        w, r, b = (ops.constant(np.stack(v)) for v in zip(*(
            _layer_weights(params, (layer * dirs + d) * per, has_biases, hidden) for d in range(dirs))))
        h = ops.transpose(ops.slice(h0, i64([layer * dirs]), i64([(layer + 1) * dirs]), i64([1])), i64([1, 0, 2]))
        y, last = ops.gru_sequence(x, h, lengths, w, r, b, hidden, "bidirectional" if bidirectional else "forward",
                                   linear_before_reset=True).outputs()
        states.append(ops.transpose(last, i64([1, 0, 2])).output(0))              # [dirs, batch, hidden]
        x = ops.reshape(ops.transpose(y, i64([0, 2, 1, 3])), i64([0, 0, -1]), True).output(0)
    if part == 1:
        return [states[0] if layers == 1 else ops.concat(states, 0).output(0)]
    return [x if batch_first else ops.transpose(x, i64([1, 0, 2])).output(0)]


def gru_extension() -> Any:
    """The frontend extension that converts ``mlcomp.gru_part`` (what :func:`gru_parts` writes)."""
    from openvino.frontend.pytorch import ConversionExtension

    return ConversionExtension("mlcomp.gru_part.default", _convert_gru_part)
