"""Bias correction: each quantized layer's bias takes back the mean shift its own rounding puts on its output.

Rounding a layer's input and weight does not only spread its output: it moves its mean,
``E[W·x − Ŵ·x̂]`` per output channel (the weight's rounding times the input's mean: large
after a ReLU, whose outputs are never negative), and a shift, unlike noise, does not
average out in the layers that read it.  :func:`correct_biases` measures each layer's own
shift on the calibration samples and adds it to the bias:

* the float graph (the one the pass quantized) runs each sample, keeping every value a
  ``quantize_linear`` reads and every layer's output;
* the quantized graph runs the same sample with each of those values replaced by its float
  one as soon as it is computed: every layer reads the float input through its own pair
  and its own int8 weight, so its output differs from the float one by its own rounding
  only, not by what the layers before it lost (their shift is theirs to correct; a shift
  measured through them would also carry what their noise does to the ReLUs between, which
  moves with the data and overshoots on inputs other than the calibration ones);
* the shift, the mean over the samples' rows of (float − int8 output) per channel (the axis
  its bias adds along, :data:`BIAS_AXIS`), goes into the bias: the int32 constant at
  ``input scale × weight scale`` is requantized (a float bias is added to)::

      %addmm = addmm(%bias_dq, %x_dq, %w_dq)        %bias.int32: round(b / (s_x · s_w))
                   ↓ correct_biases
      %addmm = addmm(%bias_dq, %x_dq, %w_dq)        %bias.int32: round((b + Δ) / (s_x · s_w)),
                                                    Δ = mean over rows of (W·x + b − (Ŵ·x̂ + b̂))

A classifier is corrected like every layer once its channels see :data:`MIN_ROWS` rows over the
samples and the samples hold that many examples (a batch of 32); with fewer the layer keeps its
bias (the mean of so few rows is mostly noise: one row's correction would make the calibration
output exact and say nothing of other inputs; the pixels or tokens of one example are many rows
but one example's shift, not the data's), as does one without a constant bias, or whose bias
another layer reads too, or whose channel axis is symbolic.  Each layer's record gains ``bias_shift`` (the largest
correction) or ``bias_kept`` (why not).
O(samples × graph): one run of each graph per calibration sample.
"""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import PARAM, Op, aten
from mlcomp.ir.quant import DEQUANTIZE, QUANTIZE
from mlcomp.passes.quantize.observe import channel_mean
from mlcomp.passes.quantize.policy import int8_rule

__all__ = ["BIAS_AXIS", "MIN_ROWS", "correct_biases", "correctable", "examples", "rows_per_channel"]

BIAS_AXIS: Mapping[Op, int] = MappingProxyType({
    aten("addmm"): -1,          # [rows, out]: the bias adds along the last axis
    aten("convolution"): 1,     # [N, C, ...]: along the channels
})
"""Op -> the axis of its output its bias adds along (the other axes are the rows a shift is averaged over)."""

MIN_ROWS = 32
"""Fewest rows per channel over the calibration samples, and fewest examples in them (:func:`examples`), for a
shift to be measured: a classifier's rows at batch 32."""


def correctable(graph: Graph, nodes: Sequence[Node], target: str | None = None) -> dict[str, int]:
    """Of ``nodes`` (float graph), those with a row in :data:`BIAS_AXIS` and a constant bias (by their int8 row on
    ``target``): name -> axis."""
    out = {}
    for node in nodes:
        rule = int8_rule(node.op, target)
        axis = BIAS_AXIS.get(node.op)
        if axis is None or rule is None or rule.bias is None or rule.bias >= len(node.inputs):
            continue
        bias = node.inputs[rule.bias]
        if isinstance(bias, Ref) and graph.node(bias.name).op == PARAM:
            out[node.name] = axis
    return out


def _bias_const(graph: Graph, node: Node) -> tuple[str, torch.Tensor | None] | None:
    """The constant holding ``node``'s bias and its scale (``None``: a float bias), if it is read only there."""
    rule = int8_rule(node.op)
    ref = node.inputs[rule.bias] if rule is not None and rule.bias is not None else None
    src = graph.node(ref.name) if isinstance(ref, Ref) else None
    if src is None or len(graph.users(src.name)) != 1:
        return None
    if src.op == PARAM:
        return src.name, None
    if src.op == DEQUANTIZE and all(isinstance(a, Ref) for a in src.inputs[:2]):
        const, scale = src.inputs[0].name, graph.constants.get(src.inputs[1].name)
        if graph.node(const).op == PARAM and len(graph.users(const)) == 1 and scale is not None:
            return const, scale
    return None


def _fed(graph: Graph, reference: Graph) -> set[str]:
    """The values a ``quantize_linear`` of ``graph`` reads that ``reference`` computes too (same name, shape, dtype)."""
    out = set()
    for node in graph.nodes(QUANTIZE):
        ref = node.inputs[0]
        if isinstance(ref, Ref) and ref.name in reference:
            ours, theirs = graph.node(ref.name).tensor_meta, reference.node(ref.name).tensor_meta
            if ours is not None and theirs is not None and (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype):
                out.add(ref.name)
    return out


def _shifts(graph: Graph, reference: Graph, samples: Sequence[tuple[torch.Tensor, ...]],
            axes: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Per layer (name -> output axis), the mean over samples of (float − int8 output mean) per channel, each
    layer of ``graph`` reading the float values of ``reference`` through its own pairs (one interpreter each)."""
    fed = _fed(graph, reference)
    floats: dict[str, Any] = {}
    total: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def after(args: tuple[Any, ...], value: Any) -> Any:
            floats[name] = value
            return value
        return after

    def swap(name: str):
        def after(args: tuple[Any, ...], value: Any) -> Any:
            if name in axes:
                delta = channel_mean(floats[name], axes[name]) - channel_mean(value, axes[name])
                total[name] = total.get(name, 0) + delta / len(samples)
            return floats[name] if name in fed else value
        return after

    wanted = set(axes) | fed
    float_run = Interpreter(reference, after={n: keep(n) for n in wanted})
    int8_run = Interpreter(graph, after={n: swap(n) for n in wanted})
    with torch.no_grad():
        for inputs in samples:
            floats.clear()
            float_run.run(*inputs)
            int8_run.run(*inputs)
    return total


def correct_biases(graph: Graph, reference: Graph, samples: Sequence[tuple[torch.Tensor, ...]],
                   axes: Mapping[str, int], records: Sequence[dict[str, Any]]) -> int:
    """Add each layer's (of ``axes``, name -> output axis) own measured shift to its bias in ``graph``, in place
    (see the module docstring); the number corrected.  ``reference``: the float graph ``graph`` was quantized
    from; each layer's record gains ``bias_shift`` or ``bias_kept``."""
    by_name = {r["node"]: r for r in records}
    todo: dict[str, int] = {}
    consts: dict[str, tuple[str, torch.Tensor | None]] = {}
    for name, axis in axes.items():
        rec = by_name.get(name)
        if rec is None:
            continue
        found = _bias_const(graph, graph.node(name))
        shape = graph.node(name).tensor_meta.shape
        if found is None:
            rec["bias_kept"] = "its bias is not a constant read by it alone"
        elif not _sized(shape[axis % len(shape)]):
            rec["bias_kept"] = "its channel axis has no fixed size to hold one shift per channel"
        elif rows_per_channel(shape, axis) * len(samples) < MIN_ROWS:
            rec["bias_kept"] = f"fewer than {MIN_ROWS} rows per channel to measure a shift on"
        elif examples(samples) < MIN_ROWS:
            rec["bias_kept"] = f"fewer than {MIN_ROWS} calibration examples (samples × batch) to measure a shift over"
        else:
            todo[name], consts[name] = axis, found
    shifts = _shifts(graph, reference, samples, todo)
    for name, delta in shifts.items():
        const, scale = consts[name]
        old = graph.constants[const]
        if scale is None:
            graph.constants[const] = (old.double() + delta).to(old.dtype)
        else:
            q = torch.round(old.double() + delta / scale.double().expand(delta.shape))
            graph.constants[const] = q.clamp(-2 ** 31, 2 ** 31 - 1).to(old.dtype)
        by_name[name]["bias_shift"] = float(delta.abs().max())
    return len(shifts)


def examples(samples: Sequence[tuple[torch.Tensor, ...]]) -> int:
    """How many examples the calibration samples hold: the leading size of each sample's first input (its batch;
    1 for a 0-d one), summed.  Positions within one example (a feature map's pixels, a sequence's tokens) are
    rows but not independent ones: one image's mean shift says little of another's.

    >>> examples([(torch.zeros(8, 3, 4, 4),), (torch.zeros(8, 3, 4, 4),)]), examples([(torch.tensor(1.0),)])
    (16, 1)
    """
    return sum(s[0].shape[0] if s and isinstance(s[0], torch.Tensor) and s[0].dim() else 1 for s in samples)


def _sized(channels: Any) -> bool:
    """A channel axis a shift can be measured along: a known size above 0 (a symbolic one is not)."""
    return isinstance(channels, int) and channels > 0


def rows_per_channel(shape: Sequence[Any], axis: int) -> int:
    """How many rows one sample of a value of ``shape`` gives each channel along ``axis``: the product of its
    other sizes, a symbolic size counting 1 (the fewest it is known to hold).

    >>> rows_per_channel((4, 8, 16), -1), rows_per_channel((4, 8, 16), 1), rows_per_channel(("s0", 8, 16), -1)
    (32, 64, 8)
    >>> rows_per_channel((), -1)
    1
    """
    sizes = [d if isinstance(d, int) else 1 for d in shape]
    if sizes:                                   # a 0-d value is one row of one channel
        del sizes[axis % len(sizes)]
    return math.prod(sizes)
