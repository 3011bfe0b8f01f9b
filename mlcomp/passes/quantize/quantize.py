"""``quantize``: int8 post-training quantization with quantize/dequantize pairs.

The pass observes activation ranges by running the graph on calibration samples
(:mod:`mlcomp.passes.quantize.observe`; the example inputs by default), then, around
every op the policy marks int8-capable (:mod:`mlcomp.passes.quantize.policy`), writes
``mlcomp.quantize_linear``/``mlcomp.dequantize_linear`` (:mod:`mlcomp.ir.quant`): activations per
tensor in uint8 (a product of two activations: on its target's grids); the op's output too when an
int8 op reads it (what lets ONNX Runtime pick its ``QLinear*`` kernels), after the ReLU when a ReLU
is its only reader (ORT then drops the ReLU, which a zero point of 0 makes exact); weights folded now into int8 constants
with one symmetric scale per output channel; the bias into int32 at ``input scale × weight scale``.
Everything else keeps float. Before/after on ``conv → relu → flatten → linear``::

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
    return (%addmm,)          # read in float only: no pair (ORT's QGemm writes float)

With ``activations=dynamic`` only matrix products with a constant weight are quantized: the
weight to int8 as above, the activation on each call (``mlcomp.dynamic_quantize_linear``, ORT's
``DynamicQuantizeMatMul``), the bias and output left float; no range is observed.

Options: ``calibration`` (how many samples, or a ``.pt`` file of batches:
:mod:`~mlcomp.passes.quantize.data`), ``granularity`` of the weight scales, ``method`` of the
activation ranges (``minmax``, ``percentile``, ``entropy``: :mod:`~mlcomp.passes.quantize.observe`),
``exclude`` (node names, ops, module-path globs kept in float:
:mod:`~mlcomp.passes.quantize.selection`), ``held_back`` (samples kept out of the ranges and
measured only), ``products`` (the grids of a product of two activations' operands, attention's
``Q·Kᵀ`` and ``P·V``: by default the target's row of :mod:`~mlcomp.passes.quantize.grids`, zero
points on onnxruntime, none on openvino, which runs such a product in int8 only then),
``embeddings`` (large embedding tables looked up in int8 and scaled per row after the lookup:
:mod:`~mlcomp.passes.quantize.embeddings`), ``smooth`` (a linear's input spread moved into its
weight before quantizing, SmoothQuant's ``α``; by default the target's row, none has one:
:mod:`~mlcomp.passes.quantize.smooth`), ``bias_correction`` (each layer's own mean output shift,
its input and weight rounding measured against fp32 on the calibration samples, added to its bias:
:mod:`~mlcomp.passes.quantize.bias`),
and a declared accuracy target, ``tolerance`` (max
relative error of the outputs) and ``agreement`` (top-1), refused with the numbers when missed.
A fused graph (``-O2,quantize``) is first put back as its ops (:mod:`~mlcomp.passes.quantize.unfuse`), a packed
q/k/v projection becomes one linear per part (:func:`~mlcomp.passes.projections.split_projections`); on a
target with an attention row (openvino: :data:`~mlcomp.passes.quantize.policy.TARGET_ROWS`) attention is
recovered as one op (:func:`~mlcomp.passes.attention.fuse_attention`); a linear read as ``bmm`` against its weight
broadcast over the batch (attention's input projection on a permuted input) is written as one
``addmm`` again (:mod:`mlcomp.ir.linearize`), so its weight folds to int8 like any linear's.

Stats: per quantized layer its module path, op, input/output scale and zero point,
weight scale range, its output's relative error and the error it adds itself; the
metric on the calibration and held-back sets, the layers that lose most, ``exclude``
suggestions and why each other candidate kept float (:mod:`~mlcomp.passes.quantize.accuracy`);
and the declared tolerance verification uses (:func:`mlcomp.analysis.ranges.declared_tolerance`).
The ``onnxruntime`` and ``openvino`` targets lower the pairs to int8 kernels; the pass
refuses every other target before anything is loaded; its emitter must take the whole graph
(``fold-constants`` first removes constant index arithmetic it has no rule for).  O(n)
rewriting plus the calibration runs.
"""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch

from mlcomp.analysis.ranges import declared_tolerance
from mlcomp.base.errors import PassFailure, PipelineSpecError
from mlcomp.frontend.loading import graph_random_inputs
from mlcomp.hardware.decide import Decision
from mlcomp.hardware.probe import int8_dot_saturates
from mlcomp.ir import Graph, Mode, Node
from mlcomp.ir.ops import aten
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.linearize import linearize_batched_matmuls
from mlcomp.passes.attention import fuse_attention
from mlcomp.passes.projections import split_projections
from mlcomp.passes.patterns import SDPA
from mlcomp.passes.quantize import accuracy, data
from mlcomp.passes.quantize.absorb import absorb_scalar_muls
from mlcomp.passes.quantize.bias import correct_biases, correctable
from mlcomp.passes.quantize.embeddings import quantize_embeddings
from mlcomp.passes.quantize.grids import PRODUCT_SCHEMES, Grid, operand_grids, plain_grid
from mlcomp.passes.quantize.observe import observe
from mlcomp.passes.quantize.policy import INT8_POLICY, TARGET_ROWS, Int8Rule, int8_rule
from mlcomp.passes.quantize.selection import choose, excluded_by, uncarried, unmatched
from mlcomp.passes.quantize.smooth import smooth, smoothing_for
from mlcomp.passes.quantize.unfuse import inline_fused
from mlcomp.passes.quantize.write import (Writer, drop_softmax_guard, output_value, outputs_read_in_int8, plan,
                                          ranges_through_moves, reader_grids)
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["Quantize", "Activations", "Granularity", "Method", "INT8_TARGETS"]

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


class Activations(enum.Enum):
    STATIC = "static"
    DYNAMIC = "dynamic"


class Products(enum.Enum):
    AUTO = "auto"
    MINMAX = "minmax"
    ZERO_FREE = "zero-free"


WEIGHT_BITS_QUESTION = "quantize: bits of the int8 weights"


class WeightBits(enum.Enum):
    AUTO = "auto"      # 7 where the CPU's int8 dot product saturates (hardware.probe.int8_dot_saturates), else 8
    SEVEN = "7"
    EIGHT = "8"


WEIGHT_LEVELS: Mapping[str, int] = MappingProxyType({"7": 63, "8": 127})
"""Bits -> the symmetric int8 grid's largest level (weights and signed activation grids on ``[-l, l]``)."""


class Method(enum.Enum):
    MINMAX = "minmax"
    PERCENTILE = "percentile"
    ENTROPY = "entropy"


@dataclass(frozen=True)
class Quantize(Pass):
    """Compute convolutions, matrix products, adds and softmax in int8 (quantize/dequantize pairs)."""

    name: ClassVar[str] = "quantize"
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.INFERENCE})
    calibration: int | str = option(8, "calibration samples to observe (at most those given), or a .pt file of "
                                       "example batches", ge=1)
    activations: Activations = option(Activations.STATIC, "static (calibrated ranges) or dynamic (measured on "
                                      "each call; matrix products with a constant weight only)")
    granularity: Granularity = option(Granularity.PER_CHANNEL, "weight scales: per-channel or per-tensor")
    method: Method = option(Method.MINMAX, "activation ranges: minmax, percentile (0.01%..99.99%) or entropy (KL)")
    exclude: tuple[str, ...] = option((), "node names, ops (add, aten.bmm) or module-path globs kept in float")
    held_back: int = option(0, "calibration samples kept out of the ranges, only measured", ge=0)
    tolerance: float | None = option(None, "largest max relative error of the outputs accepted", gt=0)
    agreement: float | None = option(None, "smallest top-1 agreement with fp32 accepted", gt=0, le=1)
    fold_scalars: bool = option(True, "turn scalar multiplies of dequantized values into dequantize scales")
    embeddings: bool = option(True, "embedding tables (4096 elements or more) in int8: int8 rows looked up, "
                              "then scaled per row")
    bias_correction: bool = option(True, "add each quantized layer's own mean output shift, measured on the "
                                   "calibration samples against fp32, to its bias")
    smooth: float | None = option(None, "move activation spread into the weights before quantizing linears "
                                  "(SmoothQuant's alpha, 0 off; default: the target's row in quantize.smooth)",
                                  ge=0, le=1)
    products: Products = option(Products.AUTO, "grids of the operands of a product of two activations: auto "
                                "(the target's row in quantize.grids), minmax (uint8 with zero points) or "
                                "zero-free (zero point 0, the second operand int8)")
    weight_bits: WeightBits = option(WeightBits.AUTO, "int8 weights (and signed activation grids) on 8 bits "
                                     "(±127) or 7 (±63); auto: 7 on an x86 CPU without VNNI/AMX, whose int8 "
                                     "dot product adds two u8×s8 products in int16 and saturates")
    split_projections: bool = option(True, "a packed q/k/v projection as one linear per part "
                                     "(passes.projections; measured faster on both int8 targets)")

    enum_options: ClassVar[Mapping[str, type[enum.Enum]]] = {"granularity": Granularity, "method": Method,
                                                             "activations": Activations, "products": Products,
                                                             "weight_bits": WeightBits}

    def check_target(self, target: str) -> None:
        """Only ONNX Runtime and OpenVINO turn the pairs into int8 kernels; elsewhere they would run as float math."""
        if target in INT8_TARGETS:
            self.check_dynamic_target(target)
        if target not in INT8_TARGETS:
            raise PipelineSpecError(
                f"quantize writes quantize/dequantize pairs that only the onnxruntime and openvino targets lower "
                f"to int8 kernels (QLinearConv/QGemm; u8 Convolution/FullyConnected); target {target} would run "
                f"them as float arithmetic, slower than the float model and no smaller "
                f"({NO_INT8_WHY.get(target, 'it has no int8 lowering of the pairs')}; "
                f"docs/decisions/0019-int8-lowering.md)",
                hint="compile with --target onnxruntime or --target openvino, or drop quantize from the pipeline "
                     "for this target")

    def check_dynamic_target(self, target: str) -> None:
        """Per-call activation scales lower to ORT's DynamicQuantizeMatMul only."""
        if self.activations is Activations.DYNAMIC and target != "onnxruntime":
            raise PipelineSpecError(
                f"quantize{{activations=dynamic}} measures activation scales on each call, which only the "
                f"onnxruntime target lowers to integer kernels (DynamicQuantizeMatMul); target {target} has no "
                f"lowering of it", hint="compile with --target onnxruntime, or use activations=static")

    def files_read(self) -> tuple[str, ...]:
        return (self.calibration,) if isinstance(self.calibration, str) else ()

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        unfused = inline_fused(graph)
        target = ctx.target.name if ctx.target is not None else None
        excluded = lambda node: excluded_by(node, self.exclude) is not None   # noqa: E731
        split = split_projections(graph, leave=excluded)["projections_split"] if self.split_projections else 0
        attention = fuse_attention(graph, leave=excluded) if int8_rule(SDPA, target) is not None else 0
        linearized = linearize_batched_matmuls(graph)
        layers, kept = choose(graph, self.exclude, target)
        if self.activations is Activations.DYNAMIC:
            layers = _dynamic_only(graph, layers, kept)
        if not layers:
            raise PassFailure(
                f"quantize found no op it computes in int8 in graph {graph.name} (it quantizes "
                f"{', '.join(str(op) for op in [*INT8_POLICY, *TARGET_ROWS.get(target or '', {})])}; "
                f"{_kept_text(kept)})",
                where=f"graph {graph.name}", hint="drop quantize from the pipeline for this model")
        samples, held = data.held_back(self._samples(graph, ctx), self.held_back)
        alpha = smoothing_for(ctx.target.name if ctx.target is not None else None) if self.smooth is None \
            else self.smooth
        smoothed = [] if self.activations is Activations.DYNAMIC else smooth(graph, layers, samples, alpha)
        layers = [(graph.node(n.name), rule) for n, rule in layers]
        plans = {n.name: plan(graph, n, rule) for n, rule in layers}
        acts = list(dict.fromkeys([r.name for n, _ in layers for r in plans[n.name][0]]
                                  + [output_value(graph, n) for n, _ in layers]))
        dynamic = self.activations is Activations.DYNAMIC
        axes = correctable(graph, [n for n, _ in layers], target) if self.bias_correction and not dynamic else {}
        seen = observe(graph, samples, [] if dynamic else acts, self.method.value,
                       keep=[n.name for n, _ in layers] + (acts if dynamic else []))
        held_ref = [Interpreter(graph).run(*s) for s in held]
        layers = self._carried(graph, layers, plans, seen.ranges, kept)
        for node, rule in layers:
            if rule.fixed_output is not None:
                seen.ranges[output_value(graph, node)] = rule.fixed_output
                drop_softmax_guard(graph, node)
        outputs = [output_value(graph, n) for n, _ in layers]
        shared = 0 if dynamic else ranges_through_moves(graph, acts, outputs, seen.ranges)
        grids = self._grids(ctx)
        bits = self._weight_bits()
        writer = Writer(graph, seen.ranges, self.granularity is Granularity.PER_CHANNEL, grids,
                        None if dynamic else outputs_read_in_int8(
                            graph, [r.name for n, _ in layers for r in plans[n.name][0]], outputs),
                        reader_grids(graph, [(n, r, plans[n.name]) for n, r in layers], outputs, grids),
                        plain_grid(target), levels=WEIGHT_LEVELS[bits.choice])
        write = writer.dynamic_layer if dynamic else writer.layer
        reference = graph.copy() if axes else None             # the float graph: what each bias is corrected to
        records = [write(n, rule, plans[n.name]) for n, rule in layers]
        absorbed = absorb_scalar_muls(graph) if self.fold_scalars else 0
        tables = quantize_embeddings(graph, self.exclude) if self.embeddings else []
        corrected = correct_biases(graph, reference, samples, axes, records) if axes else 0
        stats = self._measure(graph, samples, held, seen, held_ref, records)
        stats.update(kept_float=kept, unfused_groups=unfused, attention_fused=attention, projections_split=split,
                     batched_linears=linearized,
                     scalar_muls_absorbed=absorbed, ranges_shared=shared, embeddings=tables, biases_corrected=corrected,
                     smoothed=smoothed, weight_bits=int(bits.choice))
        stats["decisions"] = [bits.to_json()]
        stats["warnings"] = [f"exclude pattern {p!r} matched no node" for p in unmatched(graph, self.exclude)]
        for text in stats["warnings"]:
            warnings.warn(f"quantize: {text}", UserWarning, stacklevel=2)
        stats["explain"] = accuracy.explain_lines(stats)
        accuracy.check_targets(stats, self.tolerance, self.agreement)
        return PassResult(graph, True, stats)

    def _weight_bits(self) -> Decision:
        """7 or 8 bits for int8 weights and signed grids: the option's, else the CPU's (the rule's record)."""
        if self.weight_bits is not WeightBits.AUTO:
            return Decision.fixed(WEIGHT_BITS_QUESTION, ["7", "8"], self.weight_bits.value,
                                  f"quantize{{weight_bits={self.weight_bits.value}}}")
        saturates = int8_dot_saturates()
        return Decision.fixed(WEIGHT_BITS_QUESTION, ["7", "8"], "7" if saturates else "8",
                              "this x86 CPU has no VNNI/AMX: its int8 dot product (vpmaddubsw) adds two u8×s8 "
                              "products in int16, which 8-bit weights overflow" if saturates else
                              "the CPU's int8 dot product accumulates in int32 (VNNI/AMX, ARM) or is unknown")

    def _grids(self, ctx: PassContext) -> tuple[Grid, Grid]:
        """The grids of a product of two activations' operands: the option's, else the target's row."""
        if self.products is Products.AUTO:
            return operand_grids(ctx.target.name if ctx.target is not None else None)
        return PRODUCT_SCHEMES[self.products.value]

    def _carried(self, graph: Graph, layers: list[tuple[Node, Int8Rule]], plans: dict[str, Any],
                ranges: dict[str, tuple[float, float]], kept: dict[str, str]) -> list[tuple[Node, Int8Rule]]:
        """``layers`` without those one int8 grid cannot carry (:func:`uncarried`; the reason recorded in ``kept``)."""
        out, wide = [], set()
        for node, rule in layers:
            reason = uncarried(graph, node, ranges, [*plans[node.name][0], output_value(graph, node)], wide)
            if reason is None:
                out.append((node, rule))
            else:
                kept[node.name] = reason
                wide.update([node.name] if node.op == aten("add.Tensor") else [])
        return out

    def _samples(self, graph: Graph, ctx: PassContext) -> list[tuple[torch.Tensor, ...]]:
        """The calibration samples: the file's, else the API's, else the example inputs, else random ones."""
        specs = data.input_specs(graph)
        if isinstance(self.calibration, str):
            found = data.as_samples(data.load_file(self.calibration), specs, f"calibration={self.calibration}")
            return found
        if ctx.calibration_data is not None:
            found = data.as_samples(ctx.calibration_data, specs, "calibration_data=")
        else:
            given = ctx.example_inputs if ctx.example_inputs is not None else graph_random_inputs(graph)
            found = data.as_samples([tuple(given)], specs, "the example inputs")
        return found[:self.calibration + self.held_back]

    def _measure(self, graph: Graph, samples: list[Any], held: list[Any], seen: Any, held_ref: list[Any],
                 records: list[dict[str, Any]]) -> dict[str, Any]:
        interp = Interpreter(graph)
        with torch.no_grad():
            env = interp.run_all(*samples[0])
            got = [env["__output__"]] + [interp.run(*s) for s in samples[1:]]
            held_got = [interp.run(*s) for s in held]
        accuracy.layer_errors(records, seen.first, env)
        ranked = accuracy.sensitivity(records)
        cal = accuracy.metric(seen.outputs, got)
        tol = declared_tolerance(graph)
        return {"layers": records, "quantized": len(records), "calibration_samples": len(samples),
                "held_back_samples": len(held), "calibration": cal,
                "held_back": accuracy.metric(held_ref, held_got) if held else None,
                "output_rel_error": cal["max_rel"], "top1_agreement": cal["top1"],
                "sensitivity": ranked, "suggest_exclude": accuracy.suggest(ranked),
                "declared_tolerance": tol.rtol if tol else None,
                "tolerance_why": tol.explain() if tol else None}


_DYNAMIC_OPS = frozenset({aten("addmm"), aten("mm")})     # ORT's DynamicQuantizeMatMul: a constant 2-d weight


def _dynamic_only(graph: Graph, layers: list[tuple[Node, Int8Rule]], kept: dict[str, str]
                  ) -> list[tuple[Node, Int8Rule]]:
    """The matrix products with a constant weight (what ORT computes with per-call activation scales)."""
    out = []
    for node, rule in layers:
        if node.op in _DYNAMIC_OPS and plan(graph, node, rule)[1] is not None:
            out.append((node, rule))
        else:
            kept[node.name] = "activations=dynamic quantizes only matrix products with a constant weight"
    return out


def _kept_text(kept: dict[str, str]) -> str:
    if not kept:
        return "convolutions must not be transposed"
    return "kept float: " + "; ".join(f"%{n}: {why}" for n, why in list(kept.items())[:4])
