"""``mixed-precision``: each op in the precision that pays; casts only where regions meet.

The pass gives every node a precision from the per-op policy
(:mod:`mlcomp.passes.precision.policy`), the user's ``allow``/``deny`` overrides (op
names or module-path globs) and, for fp16, the range guard (a calibration run;
nodes whose values overflow fp16 or flush to zero keep fp32).  It writes the
decision on the node (``ann.precision``, ``ann.precision_reason``), inserts one
``aten._to_copy(x, dtype=…)`` per value and dtype where a region of one precision
hands a value to another, and converts graph-owned weights once, at compile time::

    before                                           after (dtype=bf16, keep_io=true)
    %fc.weight: f32[4, 8] = param                    %fc.weight: bf16[4, 8] = param
    %t: f32[8, 4] = aten.t(%fc.weight)               %x_bf16: bf16[2, 8] = aten._to_copy(%x, dtype=bf16)
    %mm: f32[2, 4] = aten.mm(%x, %t)                 %t: bf16[8, 4] = aten.t(%fc.weight)       {bf16, policy}
    %exp: f32[2, 4] = aten.exp(%mm)                  %mm: bf16[2, 4] = aten.mm(%x_bf16, %t)    {bf16, policy}
    return (%exp,)                                   %mm_f32: f32[2, 4] = aten._to_copy(%mm, dtype=f32)
                                                     %exp: f32[2, 4] = aten.exp(%mm_f32)       {fp32, policy}
                                                     return (%exp,)

Cast pairs (``bf16 → f32 → bf16``) are removed by ``cleanup``.  Stats: the dtype chosen and
why (``dtype=auto`` decides for the target being compiled, from the facts in the pass
context only: what the target builds in low precision and what pays on this host,
:mod:`mlcomp.passes.precision.choice`; fp16 on CUDA; else fp32 and the graph is left
unchanged; a target that lowers an fp32 graph itself, OpenVINO, gets the graph with each
node's precision recorded and no casts), node counts per precision, casts inserted, weight bytes before/after,
the range guard's nodes with their module paths, the declared tolerance
(:func:`mlcomp.analysis.ranges.declared_tolerance`, which verification uses) and
warnings (a ``deny``/``allow`` pattern that matched nothing; fp16 on a CPU measured
to be much slower than fp32).

Training graphs (``Mode.TRAINING``, :mod:`mlcomp.frontend.joint`) — what a loss-scaling
step builds on: parameters stay fp32 ``PARAM`` nodes (the master weights the
optimizer updates); each parameter read in low precision gets ONE cast node
``%<param>_bf16 = aten._to_copy(%<param>, dtype=bf16)`` right before its first
reader, shared by forward and backward, so the low-precision copy is made once per
step inside the graph.  Losses, log-softmax, reductions (the bias gradients' ``sum``)
and normalisation statistics compute in fp32; a norm reads its weight, bias and running
statistics in fp32 (``precision.policy.fp32_operands``), so its saved statistics are fp32
as the IR says and its fused backward reads fp32 only.  Outputs keep their captured dtype
(``%loss``, ``%grad:<param>`` via a cast ``…_f32``, ``%new:<buffer>``: fp32).
"""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from mlcomp.analysis.ranges import ValueRange, calibrate, declared_tolerance
from mlcomp.frontend.loading import graph_random_inputs
from mlcomp.base.errors import PipelineSpecError
from mlcomp.ir import Graph, Mode, Node, Precision, Ref, TensorMeta, map_refs, refs_in
from mlcomp.ir.builder import new_node, rename
from mlcomp.ir.dtypes import dtype_name
from mlcomp.ir.meta import infer_meta
from mlcomp.ir.node import PrecisionReason
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM, Namespace
from mlcomp.passes import patterns as P
from mlcomp.passes.precision.policy import (
    DeviceKind, PolicyName, Rule, fp32_operands, policy_table, ranking_products, rule_for,
)
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option
from mlcomp.pipeline.target_facts import LowMode, TargetFacts
from mlcomp.passes.precision.choice import LOW_DTYPES, annotate, auto_decision, choose, refused

__all__ = ["MixedPrecision", "LowDtype", "MixedPrecisionWarning"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_PRECISION = {torch.float32: Precision.FP32, torch.bfloat16: Precision.BF16, torch.float16: Precision.FP16}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}



class LowDtype(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    AUTO = "auto"
    FP32 = "fp32"


class MixedPrecisionWarning(UserWarning):
    """A mixed-precision option that probably does not do what was meant."""


@dataclass(frozen=True)
class MixedPrecision(Pass):
    """Compute matrix products (and what follows them) in bf16/fp16; weights cast once, casts at region edges."""

    name: ClassVar[str] = "mixed-precision"
    uses_host_precision: ClassVar[bool] = True
    dtype: LowDtype = option(LowDtype.AUTO, "low precision: bf16, fp16, auto (from the hardware) or fp32 (off)")
    policy: PolicyName = option(PolicyName.DEFAULT, "policy table: default or compute-only")
    allow: tuple[str, ...] = option((), "ops (exp, aten.exp) or module-path globs to compute in low precision")
    deny: tuple[str, ...] = option((), "ops or module-path globs (encoder.layers.3.*) to keep in fp32")
    keep_io: bool = option(True, "graph inputs and outputs stay fp32 (always on for training graphs)")
    device: DeviceKind | None = option(None, "policy of device cpu or cuda (none: where the graph lives)")

    enum_options: ClassVar[Mapping[str, type[enum.Enum]]] = {"dtype": LowDtype, "policy": PolicyName,
                                                             "device": DeviceKind}

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        device = self.device or _graph_device(graph)
        low, support, choice, notes = choose(self.dtype.value, device, ctx)
        stats: dict[str, Any] = {"dtype": _NAMES.get(low, "fp32"), "choice": choice}
        decision = auto_decision(self.dtype.value, device, ctx, low, choice)
        if decision is not None:
            stats["decisions"] = [decision.to_json()]
        if low is None or support is None:
            stats["warnings"] = _warn(notes)
            return PassResult(graph, False, stats)
        ranges = self._calibrate(graph, ctx) if low == torch.float16 else {}
        plan, guarded, counts = self._plan(graph, device, low, ranges, support.fp32_ops)
        if support.mode is LowMode.HINT:    # the runtime lowers the fp32 graph itself: record, do not cast
            stats.update(mode=support.mode.value, nodes=annotate(graph, plan, low))
            stats["warnings"] = _warn(notes)
            return PassResult(graph, True, stats)
        notes += [f"{which} pattern {pat!r} matched no node" + (
            " (training graphs carry no module paths; name ops instead)"
            if graph.mode is Mode.TRAINING and not _is_op_name(pat) else "")
            for which, pats in (("deny", self.deny), ("allow", self.allow)) for pat in pats if not counts[pat]]
        before = sum(graph.constants[n.name].nbytes for n in graph.nodes(PARAM))
        rewriter = _Rewriter(graph, low, training=graph.mode is Mode.TRAINING,
                             keep_io=self.keep_io or graph.mode is Mode.TRAINING)
        rewriter.run(plan)
        tol = declared_tolerance(graph)
        per: dict[str, int] = {}
        for node in graph.call_nodes():
            if node.ann.precision is not None and node.op != P.TO_COPY:
                per[node.ann.precision.value] = per.get(node.ann.precision.value, 0) + 1
        stats.update({
            "nodes": per, "casts_inserted": rewriter.casts, "weight_casts": rewriter.weight_casts,
            "weights_converted": rewriter.converted,
            "param_bytes_before": before,
            "param_bytes_after": sum(graph.constants[n.name].nbytes for n in graph.nodes(PARAM)),
            "range_guard": guarded,
            "declared_tolerance": tol.rtol if tol else None,
            "tolerance_why": (tol.explain() if tol else "no node computes in low precision") + (
                "; bf16 keeps fp32's exponent range, so only its 8-bit mantissa costs accuracy"
                if low == torch.bfloat16 else ""),
        })
        stats["warnings"] = _warn(notes)
        return PassResult(graph, True, stats)

    # -- deciding ---------------------------------------------------------
    def check_target_facts(self, facts: TargetFacts) -> None:
        """An explicit bf16/fp16 that the target does not build is refused before capture."""
        low = LOW_DTYPES.get(self.dtype.value)
        if low is not None and facts.support(low) is None:
            raise refused(facts, low)

    def _calibrate(self, graph: Graph, ctx: PassContext) -> dict[str, ValueRange]:
        samples = ctx.calibration_data or ((ctx.example_inputs,) if ctx.example_inputs is not None
                                          else (graph_random_inputs(graph),))
        return calibrate(graph, samples)

    def _plan(self, graph: Graph, device: DeviceKind, low: torch.dtype, ranges: dict[str, ValueRange],
              fp32_ops: frozenset[str] = frozenset()
              ) -> tuple[dict[str, tuple[Rule, PrecisionReason]], dict[str, str], dict[str, int]]:
        table = policy_table(self.policy, device)
        plan: dict[str, tuple[Rule, PrecisionReason]] = {}
        guarded: dict[str, str] = {}
        counts = {p: 0 for p in (*self.deny, *self.allow)}
        for node in graph.call_nodes():
            if not _eligible(node):
                continue
            denied = [p for p in self.deny if _matches(p, node)]
            allowed = [p for p in self.allow if _matches(p, node)]
            for p in denied + allowed:
                counts[p] += 1
            if denied:
                plan[node.name] = (Rule.KEEP_FP32, PrecisionReason.DENIED)
                continue
            if node.op.name in fp32_ops:    # the target has no kernel for it in ``low``
                plan[node.name] = (Rule.WIDEN, PrecisionReason.TARGET)
                continue
            rule = Rule.LOWER if allowed else rule_for(table, node.op)[0]
            reason = PrecisionReason.ALLOWED if allowed else PrecisionReason.POLICY
            if rule is not Rule.KEEP_FP32 and ranges:
                found = _out_of_range(node, ranges, low, inputs=rule is Rule.LOWER)
                if found is not None:
                    reason, what = found
                    rule = Rule.KEEP_FP32
                    guarded[node.name] = f"{node.origin.module_path or '<root>'} ({node.op}; {what})"
            plan[node.name] = (rule, reason)
        for name in ranking_products(graph, {n: r for n, (r, why) in plan.items() if why is PrecisionReason.POLICY}):
            plan[name] = (Rule.KEEP_FP32, PrecisionReason.SELECTION)
        return plan, guarded, counts


def _out_of_range(node: Node, ranges: dict[str, ValueRange], low: torch.dtype, *, inputs: bool
                  ) -> tuple[PrecisionReason, str] | None:
    """Why ``node`` cannot compute in ``low``: its values (or, for ``inputs``, those it casts down:
    a lowered op's inputs) overflow or fall below the smallest normal number."""
    for name in (node.name, *(node.input_names() if inputs else ())):
        r = ranges.get(name)
        if r is None:
            continue
        whose = "its values" if name == node.name else f"its input %{name}"
        if r.overflows(low):
            return PrecisionReason.OVERFLOW, (f"overflow: {whose} reach {r.absmax:.3g} > "
                                              f"{torch.finfo(low).max:.6g}")
        if r.flushes(low):
            return PrecisionReason.UNDERFLOW, (f"underflow: {r.tiny} of {r.nonzero} non-zero values of "
                                               f"{whose} are below {torch.finfo(low).tiny:.2g} (subnormal or 0)")
    return None


def _warn(notes: list[str]) -> list[str]:
    for text in notes:
        warnings.warn(f"mixed-precision: {text}", MixedPrecisionWarning, stacklevel=3)
    return notes


def _graph_device(graph: Graph) -> DeviceKind:
    metas = [n.meta for n in (*graph.input_nodes, *graph.nodes(PARAM)) if isinstance(n.meta, TensorMeta)]
    return DeviceKind.CUDA if any(m.device.startswith("cuda") for m in metas) else DeviceKind.CPU


def _is_op_name(pattern: str) -> bool:
    return not any(c in pattern for c in "*?[") and "." not in pattern.removeprefix("aten.")


def _matches(pattern: str, node: Node) -> bool:
    """``pattern`` names the node's op (``exp``, ``aten.exp``, ``aten.exp.default``) or globs its module path."""
    return P.names_op_or_module(pattern, node)


def _float_meta(meta: Any) -> TensorMeta | None:
    """The meta of a float value, or of a tuple's first float element (None: no float result)."""
    for m in meta if isinstance(meta, tuple) else (meta,):
        if isinstance(m, TensorMeta) and m.dtype in _FLOATS:
            return m
    return None


def _eligible(node: Node) -> bool:
    """Nodes the policy decides: float results, not casts/factories (they state their dtype)."""
    if node.op == GETITEM or node.op.namespace is Namespace.OPERATOR or node.op == P.TO_COPY:
        return False
    return "dtype" not in node.attrs and _float_meta(node.meta) is not None


class _Rewriter:
    """One walk in graph order: each node's float inputs in the dtype its rule wants (casts memoised)."""

    def __init__(self, graph: Graph, low: torch.dtype, *, training: bool, keep_io: bool) -> None:
        self.graph, self.low, self.training, self.keep_io = graph, low, training, keep_io
        self.versions: dict[str, dict[torch.dtype, str]] = {}   # value -> dtype -> node holding it
        self.pref: dict[str, torch.dtype] = {}                  # the dtype followers read a value in
        self.original: dict[str, torch.dtype] = {}
        self.casts = self.weight_casts = 0
        self.converted = 0
        self.at: str | None = None
        self._widened: set[str] = set()      # tuple-valued WIDEN nodes whose elements return to low

    def run(self, plan: dict[str, tuple[Rule, PrecisionReason]]) -> None:
        g = self.graph
        for name in g.order():
            node = g.node(name)
            if node.op == OUTPUT:
                self._outputs(node)
                continue
            meta = _float_meta(node.meta) if isinstance(node.meta, TensorMeta) else None
            if node.op in (INPUT, PARAM):
                if meta is not None:
                    self.original[name] = meta.dtype
                    if node.op == INPUT and not self.keep_io:
                        g.replace(node.with_(meta=TensorMeta(meta.shape, self.low, meta.device, meta.requires_grad)))
                        meta = g.node(name).tensor_meta
                    self.versions[name], self.pref[name] = {meta.dtype: name}, meta.dtype
                continue
            self.at = name
            self._compute(node, plan.get(name))
        self._adopt_constants()

    def _is_float(self, name: str) -> bool:
        return name in self.pref

    def _compute(self, node: Node, decision: tuple[Rule, PrecisionReason] | None) -> None:
        g = self.graph
        floats = [r.name for r in refs_in(node.inputs) + refs_in(dict(node.attrs)) if self._is_float(r.name)]
        acts = [s for s in floats if g.node(s).op != PARAM]      # weights: converted or cast once, never vote
        came_low = any(self.pref[s] == self.low for s in acts)
        if decision is None:
            want: dict[str, torch.dtype] = {s: self.pref[s] for s in floats}
        else:
            rule = decision[0]
            if rule is Rule.LOWER:
                target = self.low
            elif rule is Rule.FOLLOW:
                target = self.low if all(self.pref[s] == self.low for s in acts) else torch.float32
            else:
                target = torch.float32
            want = {s: target for s in floats}
            if self.training:    # a norm's parameters and running statistics stay fp32 (mixed-type kernel)
                want.update((s, torch.float32) for s in fp32_operands(node) if s in want)
        swap = {s: Ref(self._get(s, d)) for s, d in want.items()}
        new = node.with_(inputs=map_refs(node.inputs, lambda r: swap.get(r.name, r)),
                         attrs=map_refs(dict(node.attrs), lambda r: swap.get(r.name, r)))
        meta = infer_meta(g, new)
        if meta is not NotImplemented and meta is not None:
            new = new.with_(meta=_keep_symbols(node.meta, meta))
        elif decision is not None and floats:      # no meta kernel: the float results take the compute dtype
            new = new.with_(meta=_retype(node.meta, want[floats[0]]))
        out = _float_meta(new.meta)
        if decision is not None and out is not None:
            new = new.with_ann(precision=_PRECISION[out.dtype], precision_reason=decision[1])
        elif node.op == GETITEM and out is not None:   # an element: its own dtype, the tuple's reason
            src = g.node(node.input_names()[0])
            new = new.with_ann(precision=_PRECISION[out.dtype] if src.ann.precision is not None else None,
                               precision_reason=src.ann.precision_reason)
        g.replace(new)
        if isinstance(new.meta, TensorMeta) and new.meta.dtype in _FLOATS:
            self.original[node.name] = node.meta.dtype if isinstance(node.meta, TensorMeta) else new.meta.dtype
            self.versions[node.name] = {new.meta.dtype: node.name}
            self.pref[node.name] = new.meta.dtype
            widen = decision is not None and decision[0] is Rule.WIDEN and came_low
            if node.op == GETITEM:
                widen = node.input_names()[0] in self._widened
            if widen:
                self.pref[node.name] = self.low
        if decision is not None and decision[0] is Rule.WIDEN and came_low and isinstance(new.meta, tuple):
            self._widened.add(node.name)

    def _get(self, name: str, dtype: torch.dtype) -> str:
        """The node holding value ``name`` in ``dtype``: existing, a converted constant, or a new cast."""
        have = self.versions[name]
        if dtype in have:
            return have[dtype]
        g = self.graph
        node = g.node(name)
        if node.op == PARAM and not self.training:      # converted once, at compile time
            const = g.add_constant(g.fresh_name(f"{name}@{dtype_name(dtype)}"), g.constants[name].to(dtype),
                                   origin=node.origin)
            have[dtype] = const.name
            self.converted += 1
            return const.name
        source = have.get(torch.float32) or have[self.pref[name]]
        cast = new_node(g, P.TO_COPY, (Ref(source),), {"dtype": dtype}, name=f"{name}_{dtype_name(dtype)}",
                        origin=node.origin, before=self.at)
        g.replace(cast.with_ann(precision=_PRECISION[dtype]))
        have[dtype] = cast.name
        self.casts += 1
        self.weight_casts += node.op == PARAM
        return cast.name

    def _outputs(self, node: Node) -> None:
        def pick(r: Ref) -> Ref:
            if not self._is_float(r.name):
                return r
            dtype = self.original[r.name] if self.keep_io else self.pref[r.name]
            return Ref(self._get(r.name, dtype))
        self.at = node.name
        self.graph.replace(node.with_(inputs=map_refs(node.inputs, pick)))

    def _adopt_constants(self) -> None:
        """A weight now read only in low precision: its low copy takes over its name."""
        g = self.graph
        for name, have in list(self.versions.items()):
            if name not in g or g.node(name).op != PARAM or len(have) < 2 or g.num_users(name):
                continue
            (low_name,) = [n for d, n in have.items() if n != name]
            g.erase(name)
            rename(g, low_name, name)


def _retype(meta: Any, dtype: torch.dtype) -> Any:
    if isinstance(meta, TensorMeta) and meta.dtype in _FLOATS:
        return TensorMeta(meta.shape, dtype, meta.device, meta.requires_grad)
    return tuple(_retype(m, dtype) for m in meta) if isinstance(meta, tuple) else meta


def _keep_symbols(old: Any, new: Any) -> Any:
    """The inferred meta with the old meta's (possibly symbolic) shapes; dtypes from the inference."""
    if isinstance(old, TensorMeta) and isinstance(new, TensorMeta):
        return TensorMeta(old.shape, new.dtype, old.device, old.requires_grad)
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return tuple(_keep_symbols(o, n) for o, n in zip(old, new))
    return new
