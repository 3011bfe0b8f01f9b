"""``quantize``: int8 post-training quantization with quantize/dequantize pairs.

The pass observes activation ranges by running the graph on calibration samples
(:mod:`mlcomp.passes.quantize.observe`; the example inputs by default), then, around
every op the policy marks int8-capable (:mod:`mlcomp.passes.quantize.policy`), writes
``mlcomp.quantize_linear``/``mlcomp.dequantize_linear`` (:mod:`mlcomp.ir.quant`):
activations per tensor in uint8; the op's output too (what lets ONNX Runtime pick its
``QLinear*`` kernels), after the ReLU when a ReLU is its only reader (ORT then drops the
ReLU, which a zero point of 0 makes exact); weights folded now into int8 constants with
one symmetric scale per output channel; the bias into int32 at ``input scale × weight
scale``.  Everything else keeps float.  Before/after on ``conv → relu → flatten → linear``::

    %convolution = convolution(%input, %0.weight, %0.bias, ...)
    %relu = relu(%convolution)
    %view = view(%relu, [2, 144])
    %permute = permute(%3.weight, [1, 0])
    %addmm = addmm(%3.bias, %view, %permute)
    return (%addmm,)
                 ↓ quantize
    %input_q: u8[2, 3, 8, 8] = mlcomp.quantize_linear(%input, %input.scale, %input.zero, 1)
    %input_dq: f32[2, 3, 8, 8] = mlcomp.dequantize_linear(%input_q, %input.scale, %input.zero, 1)
    %0.weight_dq: f32[4, 3, 3, 3] = mlcomp.dequantize_linear(%0.weight.int8, %0.weight.scale, %0.weight.zero, 0)
    %0.bias_dq: f32[4] = mlcomp.dequantize_linear(%0.bias.int32, %0.bias.scale, %0.bias.zero, 0)
    %convolution = convolution(%input_dq, %0.weight_dq, %0.bias_dq, ...)
    %relu = relu(%convolution)
    %relu_q: u8[2, 4, 6, 6] = mlcomp.quantize_linear(%relu, %relu.scale, %relu.zero, 1)
    %relu_dq = mlcomp.dequantize_linear(%relu_q, ...);  %view = view(%relu_dq, [2, 144])
    %view_q, %view_dq (the pair of the linear's input);  %3.weight_dq, %3.bias_dq as above
    %addmm = addmm(%3.bias_dq, %view_dq, permute(%3.weight_dq, [1, 0]))
    %addmm_q, %addmm_dq;  return (%addmm_dq,)

Stats: per quantized layer its module path, op, input/output scale and zero point,
weight scale range and the relative error of its output against float on the first
calibration sample; the top-1 agreement of the outputs over all samples; and the
declared tolerance verification uses (:func:`mlcomp.analysis.ranges.declared_tolerance`).
The ``onnxruntime`` and ``openvino`` targets lower the pairs to int8 kernels; the pass
refuses every other target before anything is loaded; its emitter must take the whole graph
(``fold-constants`` first removes constant index arithmetic it has no rule for).  O(n)
rewriting plus the calibration runs.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch

from mlcomp.base.errors import PassFailure, PipelineSpecError
from mlcomp.frontend.loading import graph_random_inputs
from mlcomp.ir import Graph, Mode, Node
from mlcomp.ir.ops import aten
from mlcomp.passes.quantize.observe import observe
from mlcomp.passes.quantize.write import Writer, output_value, plan, stats
from mlcomp.passes.quantize.policy import INT8_POLICY, Int8Rule, int8_rule
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["Quantize", "Granularity", "Method", "INT8_TARGETS"]

INT8_TARGETS = frozenset({"onnxruntime", "openvino"})       # targets that lower the Q/DQ pairs to int8 kernels
# why the others do not (docs/decisions/0019-int8-lowering.md)
NO_INT8_WHY = {
    "cpu": "torch's int8 CPU kernels need quantized tensor types torch deprecates, or private oneDNN ops whose "
           "prepacked weights TorchScript cannot save",
    "tvm": "its Relax build has no integer lowering of the pairs",
    "cuda": "it has no int8 lowering of the pairs",
}


class Granularity(enum.Enum):
    PER_CHANNEL = "per-channel"
    PER_TENSOR = "per-tensor"


class Method(enum.Enum):
    MINMAX = "minmax"
    PERCENTILE = "percentile"


@dataclass(frozen=True)
class Quantize(Pass):
    """Compute convolutions and matrix products in int8: quantize/dequantize pairs from calibrated ranges."""

    name: ClassVar[str] = "quantize"
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.INFERENCE})
    calibration: int = option(8, "calibration samples to observe ranges on (at most those given)", ge=1)
    granularity: Granularity = option(Granularity.PER_CHANNEL, "weight scales: per-channel or per-tensor")
    method: Method = option(Method.MINMAX, "activation ranges: minmax or percentile (0.01%..99.99%)")

    enum_options: ClassVar[Mapping[str, type[enum.Enum]]] = {"granularity": Granularity, "method": Method}

    def check_target(self, target: str) -> None:
        """Only ONNX Runtime and OpenVINO turn the pairs into int8 kernels; elsewhere they would run as float math."""
        if target not in INT8_TARGETS:
            raise PipelineSpecError(
                f"quantize writes quantize/dequantize pairs that only the onnxruntime and openvino targets lower "
                f"to int8 kernels (QLinearConv/QGemm; u8 Convolution/FullyConnected); target {target} would run "
                f"them as float arithmetic, slower than the float model and no smaller "
                f"({NO_INT8_WHY.get(target, 'it has no int8 lowering of the pairs')}; "
                f"docs/decisions/0019-int8-lowering.md)",
                hint="compile with --target onnxruntime or --target openvino, or drop quantize from the pipeline "
                     "for this target")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        layers = [(n, r) for n in graph.call_nodes() if (r := _rule(n)) is not None]
        if not layers:
            raise PassFailure(
                f"quantize found no op it computes in int8 in graph {graph.name} (it quantizes "
                f"{', '.join(str(op) for op in INT8_POLICY)}; convolutions must not be transposed)",
                where=f"graph {graph.name}", hint="drop quantize from the pipeline for this model")
        samples = _samples(graph, ctx, self.calibration)
        plans = [plan(graph, n, rule) for n, rule in layers]
        acts = list(dict.fromkeys(
            [r.name for p in plans for r in p[0]] + [output_value(graph, n) for n, _ in layers]))
        seen = observe(graph, samples, acts, self.method.value, keep=[n.name for n, _ in layers])
        writer = Writer(graph, seen.ranges, self.granularity is Granularity.PER_CHANNEL)
        records = [writer.layer(n, rule, p) for (n, rule), p in zip(layers, plans)]
        return PassResult(graph, True, stats(graph, samples, seen, records))


def _rule(node: Node) -> Int8Rule | None:
    rule = int8_rule(node.op)
    if rule is None or (node.op == aten("convolution") and node.inputs[6]):   # transposed: another weight axis
        return None
    return rule


def _samples(graph: Graph, ctx: PassContext, count: int) -> list[tuple[torch.Tensor, ...]]:
    given = ctx.calibration_data or ((ctx.example_inputs,) if ctx.example_inputs is not None
                                     else (graph_random_inputs(graph),))
    return [(s,) if isinstance(s, torch.Tensor) else tuple(s) for s in list(given)[:count]]
