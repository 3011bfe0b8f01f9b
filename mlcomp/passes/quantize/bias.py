"""Bias correction: each quantized layer's bias takes back the mean shift quantization puts on its output.

Rounding a layer's input and weight does not only spread its output: it moves its mean,
``E[W·x − Ŵ·x̂]`` per output channel, and a shift, unlike noise, does not average out
in the layers that read it.  :func:`correct_biases` measures that shift on the
calibration samples against the float graph and adds it to the bias, so the int8 layer
is unbiased on the data it was calibrated on:

* the float run (:func:`~mlcomp.passes.quantize.observe.observe`, ``means=``) keeps each
  layer's output mean per channel (per column of a linear's output, per channel of a
  convolution's: the axis its bias adds along, :data:`BIAS_AXIS`);
* the quantized graph then runs once per sample with each layer's output moved by its
  measured shift as soon as it is computed, so a later layer measures its own shift on
  already corrected inputs (one run corrects the drift that builds up over the layers);
* the shift, averaged over the samples, goes into the bias: the int32 constant at
  ``input scale × weight scale`` is requantized (a float bias is added to)::

      %addmm = addmm(%bias_dq, %x_dq, %w_dq)        %bias.int32: round(b / (s_x · s_w))
                   ↓ correct_biases
      %addmm = addmm(%bias_dq, %x_dq, %w_dq)        %bias.int32: round((b + Δ) / (s_x · s_w)),
                                                    Δ = mean over rows of (fp32 − int8 output)

A layer whose channels see fewer than :data:`MIN_ROWS` rows over the samples keeps its bias
(the mean of so few rows is mostly noise: one row's correction would make the calibration
output exact and say nothing of other inputs), as does one without a constant bias, or
whose bias another layer reads too, or whose channel axis is symbolic.  Each layer's record gains ``bias_shift`` (the largest
correction) or ``bias_kept`` (why not).
O(samples × graph): one more run of the quantized graph per calibration sample.
"""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import PARAM, Op, aten
from mlcomp.ir.quant import DEQUANTIZE
from mlcomp.passes.quantize.observe import channel_mean
from mlcomp.passes.quantize.policy import int8_rule

__all__ = ["BIAS_AXIS", "MIN_ROWS", "correct_biases", "correctable", "rows_per_channel"]

BIAS_AXIS: Mapping[Op, int] = MappingProxyType({
    aten("addmm"): -1,          # [rows, out]: the bias adds along the last axis
    aten("convolution"): 1,     # [N, C, ...]: along the channels
})
"""Op -> the axis of its output its bias adds along (the other axes are the rows a shift is averaged over)."""

MIN_ROWS = 64
"""Fewest rows per channel over the calibration samples for a shift to be measured."""


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


def _shifts(graph: Graph, samples: Sequence[tuple[torch.Tensor, ...]], means: Mapping[str, list[torch.Tensor]],
            axes: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Per layer, the mean over samples of (float mean − int8 mean) per channel, each layer measured with the
    earlier layers' outputs already moved by their own sample's shift (one interpreter runs every sample)."""
    total: dict[str, torch.Tensor] = {}
    sample = [0]                # the index of the sample being run: which float means the hooks compare with

    def hook(name: str, axis: int):
        def after(args: tuple[Any, ...], value: torch.Tensor) -> torch.Tensor:
            delta = means[name][sample[0]] - channel_mean(value, axis)
            total[name] = total.get(name, 0) + delta / len(samples)
            shape = [1] * value.dim()
            shape[axis % value.dim()] = -1
            return value + delta.to(value.dtype).reshape(shape)
        return after

    interp = Interpreter(graph, after={n: hook(n, axis) for n, axis in axes.items()})
    with torch.no_grad():
        for i, inputs in enumerate(samples):
            sample[0] = i
            interp.run(*inputs)
    return total


def correct_biases(graph: Graph, samples: Sequence[tuple[torch.Tensor, ...]],
                   means: Mapping[str, list[torch.Tensor]], axes: Mapping[str, int],
                   records: Sequence[dict[str, Any]]) -> int:
    """Add each layer's measured shift to its bias, in place (see the module docstring); the number corrected.
    ``means``: per layer (of ``axes``, name -> output axis), the float output's channel means, one per sample;
    each layer's record gains ``bias_shift`` or ``bias_kept``."""
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
        else:
            todo[name], consts[name] = axis, found
    shifts = _shifts(graph, samples, means, todo)
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
