"""The ``tvm`` target: IR → generated torch module → Apache TVM (Relax) → VM executable.

::

    art = get_target("tvm").compile(graph, CompileOptions(tune_trials=64, work_dir="tvm-db"))
    art(x)
    art.save("out/mlp-tvm")          # out/mlp-tvm/model.so (+ meta.json)

What it builds: on CPU a TVM-built Relax VM module in which the heavy ops (float32 conv2d,
matmul/linear, attention, layer norm) run in torch's oneDNN/MKL kernels, called through packed
functions (:mod:`~mlcomp.targets.tvm.kernels`), and TVM's own code runs the rest, fused and scheduled
by DLight's GEMV/Reduction rules and mlcomp's ParallelVector (:mod:`~mlcomp.targets.tvm.schedules`).
Which op goes where is one table, :mod:`mlcomp.targets.tvm.offload.policy`; ``--explain``
(``art.runtime.explain_lines()``) and the manifest (``runtime_info.offload``) list every heavy op with
where it ran and the rule.  On CUDA, and as ``tvm{kernels=off}`` (``BuildConfig(kernels=False)``), every op
is TVM code.
The build is :func:`mlcomp.targets.tvm.build.build`; with ``tune_trials`` MetaSchedule tunes what TVM
runs (:meth:`TvmTarget.tune`, ``mlcomp tune``), ``work_dir`` holding the database, shared across models
by task workload.  Shapes are the example's, except symbolic sizes (``--dynamic``): those are ``tir``
variables of the Relax signature bounded by their ranges, and one build serves every size; the kernel
offload leaves ops with a symbolic size to TVM's code (``--explain`` says "symbolic shape").

``supports(node)`` asks TVM's ExportedProgram importer whether it has a
converter for the op (its table read from the installed source, without importing ``tvm``:
:func:`~mlcomp.targets.tvm.lowering.importer_ops`).

Mixed precision: bf16/fp16 graphs go through Relax as they are (the casts
become ``R.astype``; TVM's LLVM codegen legalizes bf16 arithmetic to fp32 with
bf16 storage).  TVM 0.27's importer returns ``addmm`` and ``convolution`` in float32 whatever
their inputs (``out_dtype="float32"``), so low-precision ones are lowered
around it first (:func:`lower_low_precision`); a node TVM cannot run in its precision is refused before the build with
a :class:`~mlcomp.targets.capabilities.CapabilityError` listing the nodes::

    before: %addmm: bf16[2, 16] = aten.addmm.default(%l1.bias, %x_bf16, %permute)
    after:  %addmm_mm: bf16[2, 16] = aten.mm.default(%x_bf16, %permute)
            %addmm: bf16[2, 16] = aten.add.Tensor(%addmm_mm, %l1.bias)
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Mapping

import torch
from mlcomp.runtime.artifact import RuntimeKind
from mlcomp.targets.backend_errors import first_error
from mlcomp.targets.base import CompileOptions, Fallback, Target, TargetCompileError, example_inputs
from mlcomp.targets.capabilities import (
    Capabilities,
    CapabilityError,
    DeviceKind,
    Mismatch,
    MismatchKind,
    hint_for,
    mismatches,
)
from mlcomp.runtime.codegen import to_fx
from mlcomp.frontend.dynamic import graph_dims
from mlcomp.targets.tvm.lowering import importer_ops
from mlcomp.targets.tvm.offload.placement import Placements
from mlcomp.base.quiet import quiet_native

from mlcomp.base.errors import MlcompError
from mlcomp.base.spec import option
from mlcomp.hardware.decide import Decision
from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.builder import new_node, substitute
from mlcomp.ir.dtypes import dtype_name
from mlcomp.ir.ops import GETITEM, Namespace, Op, aten
from mlcomp.pipeline.presets import Rewrite
from mlcomp.pipeline.target_facts import LowPrecision

__all__ = ["TvmTarget", "TvmOptions", "TvmRuntime", "quiet_native"]


class TvmRuntime:
    """Wraps :class:`mlcomp.targets.tvm.module.TvmModule` (the Relax VM)."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.TVM

    def __init__(self, module: Any, *, tuned: bool, threads: int | None = None, deterministic: bool = False) -> None:
        self.module = module
        self.tuned = tuned
        self.threads = threads
        self.deterministic = deterministic      # saved without durations or paths (byte-identical rebuilds)
        self.stats = dict(module.stats)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the VM; with ``threads`` set, torch's kernels it calls use that many threads, for this call only.

        TVM's own code is serial when the module calls torch's kernels (``stats["schedules"]``),
        so torch's intra-op count is the one thread setting there is; it is put back afterwards.
        """
        if self.module.device != "cpu":
            inputs = tuple(t.to(self.module.device) for t in inputs)
        before = torch.get_num_threads()
        if self.threads is None or before == self.threads:
            return self.module(*inputs)
        torch.set_num_threads(self.threads)
        try:
            return self.module(*inputs)
        finally:
            torch.set_num_threads(before)

    def save(self, directory: Path) -> dict[str, Any]:
        with quiet_native():
            files = self.module.save(str(directory), stable=self.deterministic)
        return {"files": files, "device": self.module.device, "tuned": self.tuned, "threads": self.threads,
                "deterministic": self.deterministic,
                "stats": {k: v for k, v in self.stats.items() if isinstance(v, (int, float, str, bool))},
                "offload": self.stats.get("offload"),
                "kernels": self.stats.get("kernels"), "schedules": self.stats.get("schedules"),
                "conv_layout": self.stats.get("conv_layout"), "tuning_decision": self.stats.get("tuning_decision")}

    @property
    def decisions(self) -> list[Decision]:
        """The build's measured choices: the small-GEMM probe's per call, then tuned against untuned."""
        found = list((self.stats.get("small_gemms") or {}).get("decisions") or [])
        tuning = (self.stats.get("tuning_decision") or {}).get("decision")
        return [Decision.from_json(d) for d in found + ([tuning] if tuning else [])]

    def explain_lines(self) -> list[str]:
        """Where each heavy op runs and how the rest was scheduled, one line each (``--explain``)."""
        lines = []
        if self.stats.get("offload"):
            lines += Placements.from_json(self.stats["offload"]).lines()
        sched = self.stats.get("schedules")
        if sched:
            lines.append(f"TVM kernels: {sched.get('scheduled', 0)} scheduled (DLight GEMV/Reduction, mlcomp "
                         f"ParallelVector at {sched.get('vector_bits')}-bit vectors), {sched.get('unscheduled', 0)} "
                         "left as plain loop nests")
            if sched.get("parallel") is False:
                lines.append("TVM kernels run serially: torch's kernels own the cores (TVM's thread pool, spinning "
                             "after each parallel loop, would take them from torch's)")
        layout = self.stats.get("conv_layout")
        if layout:
            lines.append(f"convolutions {layout['layout']}: {layout['reason']}")
        decision = self.stats.get("tuning_decision")
        if decision:
            why = (decision.get("decision") or {}).get("why", "")
            lines.append(f"tuned build {decision.get('tuned_ms', '—')} ms vs untuned {decision.get('untuned_ms', '—')} "
                         f"ms: kept the {decision['winner']} one" + (f" ({why})" if why else ""))
        if "tasks" in self.stats:
            lines.append(f"MetaSchedule database {self.stats.get('work_dir')}: {self.stats['tasks']} tasks, "
                         f"{len(self.stats.get('tasks_reused', []))} reused, {self.stats.get('trials_run', 0)} "
                         "trials run now")
        return lines

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "TvmRuntime":
        from mlcomp.targets.tvm.module import TvmModule

        with quiet_native():
            module = TvmModule.load(str(directory), device=info.get("device", "cpu"))
        return cls(module, tuned=bool(info.get("tuned")), threads=info.get("threads"),
                   deterministic=bool(info.get("deterministic")))


# ops whose TVM converter emits a float32 result whatever the inputs' dtype (measured, TVM 0.27: the
# importer hard-codes out_dtype="float32"); addmm and convolution are lowered around it before the
# build (lower_low_precision), linear is refused
_FLOAT32_ONLY = frozenset({"linear"})
_LOW = (torch.bfloat16, torch.float16)
_ADDMM, _CONV, _TO_COPY = aten("addmm"), aten("convolution"), aten("_to_copy")


def _low(node: Node) -> bool:
    return isinstance(node.meta, TensorMeta) and node.meta.dtype in _LOW


def lower_low_precision(graph: Graph) -> Graph:
    """``graph``, or a copy whose bf16/fp16 ``addmm`` and ``convolution`` TVM's importer types right.

    ``addmm(bias, a, b)`` → ``add(mm(a, b), bias)``; ``convolution(x, w, bias, …)`` →
    ``add(_to_copy(convolution(x, w, None, …), dtype), view(bias, [1, C, 1, 1]))``: the
    importer returns the convolution in float32 (fp32 accumulation), the cast, a no-op
    in torch, brings it back to the graph's dtype.  O(n).
    """
    todo = [n for n in graph.nodes(_ADDMM) if _low(n) and len(n.inputs) == 3
            and n.attrs.get("beta", 1) == 1 and n.attrs.get("alpha", 1) == 1]
    todo += [n for n in graph.nodes(_CONV) if _low(n) and len(n.inputs) >= 3 and not n.attrs]
    if not todo:
        return graph
    out = graph.copy()
    for node in todo:
        where = {"origin": node.origin, "before": node.name}
        if node.op == _ADDMM:
            bias, a, b = node.inputs
            core = new_node(out, aten("mm"), (a, b), name=f"{node.name}_mm", **where)
        else:
            bias = node.inputs[2]
            conv = new_node(out, _CONV, (*node.inputs[:2], None, *node.inputs[3:]), name=f"{node.name}_nobias",
                            **where)
            cast = (_TO_COPY, (Ref(conv.name),), {"dtype": node.meta.dtype})
            if bias is None:
                new = substitute(out, node.name, *cast, origin=node.origin)
                out.replace(new.with_(ann=node.ann))
                continue
            core = new_node(out, *cast, name=f"{node.name}_cast", **where)
            ones = [1] * (len(node.meta.shape) - 2)
            bias = Ref(new_node(out, aten("view"), (bias, [1, -1, *ones]), name=f"{node.name}_bias", **where).name)
        new = substitute(out, node.name, aten("add", "Tensor"), (Ref(core.name), bias), origin=node.origin)
        out.replace(new.with_(ann=node.ann))
    return out


# generated code computes bf16/fp16 natively only with these CPU instructions (else LLVM emulates them)
# (TVM's relax.nn.layer_norm takes no bf16 operands: layer norm computes in fp32 between casts)
LOW_PRECISION = (LowPrecision(torch.bfloat16, needs=("avx512_bf16", "amx_bf16"),
                              fp32_ops=frozenset({"native_layer_norm", "layer_norm"})),
                 LowPrecision(torch.float16, needs=("avx512_fp16", "amx_fp16")))


# the ``kernels`` option of a tvm target spec -> BuildConfig.kernels
_KERNELS = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True)
class TvmOptions:
    """The tvm target's own options: ``--target "tvm{kernels=off}"``."""

    kernels: Literal["auto", "on", "off"] = option(
        "auto", "heavy ops in torch's kernels: auto (on CPU only), on, off (pure TVM: every op TVM code)")


class TvmTarget(Target):
    name = "tvm"
    Options = TvmOptions
    description = ("Apache TVM (Relax) module; on CPU its heavy ops (conv2d, matmul/linear, attention, layer "
                   "norm) run in torch's oneDNN/MKL kernels called from inside the TVM-built module, TVM's own "
                   "code runs the rest (--explain: per op, where and why); on CUDA, and as "
                   "tvm{kernels=off}, every op is TVM code; MetaSchedule tuning with --tune-trials, --tuning-dir")
    # from_exported_program converts every real dtype of the table; symbolic sizes become tir vars
    rewrites = frozenset({Rewrite.CLEANUP, Rewrite.WEIGHT_FOLDING})   # fuses on its own: presets skip mlcomp's fusion
    # not tvm itself: with it imported before the fork, forked timing processes timed TVM up to 6x slow at times
    runtime_modules = ("mlcomp.targets.tvm.target", "mlcomp.targets.tvm.module")
    capabilities = Capabilities(devices=frozenset({DeviceKind.CPU, DeviceKind.CUDA}), dynamic_shapes=True,
                                low_precision=LOW_PRECISION)

    def available(self) -> str | None:
        if importlib.util.find_spec("tvm") is None:
            return "the apache-tvm package is not installed (pip install apache-tvm)"
        return None

    def explain(self, node: Node, graph: Graph | None = None) -> str | None:
        return super().explain(node, graph) or self.precision_reason(node)

    def precision_reason(self, node: Node) -> str | None:
        """Why TVM cannot run ``node`` in its (bf16/fp16) precision; ``None`` when it can."""
        if _low(node) and node.op.namespace is Namespace.ATEN and node.op.name in _FLOAT32_ONLY:
            return (f"TVM 0.27's importer computes {node.op.name} in float32 whatever its inputs "
                    f"(out_dtype='float32'), so a {dtype_name(node.meta.dtype)} {node.op.name} fails to build")
        return None

    def check_capabilities(self, graph: Graph, options: CompileOptions, bad: Mapping[str, str]) -> None:
        """As :meth:`Target.check_capabilities`, with nodes TVM cannot run in their precision reported as
        one dtype problem per precision (a :class:`CapabilityError`) rather than as unsupported ops."""
        precision = {n: r for n, r in bad.items() if self.precision_reason(graph.node(n))}
        if not precision or options.fallback is Fallback.EAGER:
            return super().check_capabilities(graph, options, bad)
        rest = {n: r for n, r in bad.items() if n not in precision}
        problems = mismatches(self.capabilities, self.name, graph, self.device(options), runs_elsewhere=bad)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in precision:
            by_dtype.setdefault(graph.node(name).meta.dtype, []).append(name)
        for dtype, names in by_dtype.items():
            ops = sorted({str(graph.node(n).op) for n in names})
            reasons = "; ".join(dict.fromkeys(precision[n] for n in names))
            problems.append(Mismatch(MismatchKind.DTYPE, f"target {self.name} cannot run {', '.join(ops)} in "
                                                         f"{dtype_name(dtype)}: {reasons}", tuple(names)))
        if rest:
            problems.append(Mismatch(MismatchKind.OPS, f"{len(rest)} node(s) use ops target {self.name} cannot "
                                                       "run: " + self._describe_ops(graph, rest)))
        err = CapabilityError(self.name, graph, problems,
                              "keep those ops in fp32 (mixed-precision{deny=...}), run them in torch with "
                              "--fallback eager, or compile for cpu; " + hint_for(problems))
        err.nodes = dict(bad)
        raise err

    def explain_op(self, op: Op) -> str | None:
        if op == GETITEM:
            return None
        if op.namespace is Namespace.OPERATOR:
            key = op.name
        elif op.namespace is Namespace.ATEN:
            key = f"{op.name}.{op.overload}"
        else:
            return f"TVM's PyTorch importer has no converter for {op}"
        if key in importer_ops() or op.name in importer_ops():
            return None
        return f"TVM's PyTorch importer (from_exported_program) has no converter for {op}"

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> TvmRuntime:
        return self._build(graph, options, inputs)

    def tune(self, graph: Graph, options: CompileOptions,
             progress: Callable[[int, int, str], None] | None = None) -> TvmRuntime:
        """Tune ``graph``'s tasks into ``options.work_dir`` (``options.tune_trials`` in all) and build with them.

        What ``mlcomp tune`` runs; ``progress(done, total, message)`` after every measured batch.
        The graph must be fully supported (no fallback regions: those are not TVM's to tune).
        """
        if not options.tune_trials or not options.work_dir:
            raise ValueError("tune needs tune_trials > 0 and a work_dir (the database folder)")
        bad = self.unsupported(graph)
        self.check_capabilities(graph, options, bad)
        self.check(graph)
        return self._build(graph, options, example_inputs(graph), progress)

    def _build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...],
               progress: Callable[[int, int, str], None] | None = None) -> TvmRuntime:
        from mlcomp.targets.tvm import build as tvm_backend
        from mlcomp.targets.tvm.config import BuildConfig

        # mode, dtypes and device were checked by compile(); TVM takes the device kind
        kind = DeviceKind.of(self.device(options))
        device = kind.value if kind is not None else self.device(options)
        work_dir = os.path.abspath(options.work_dir) if options.work_dir else None
        dynamic = graph_dims(graph)
        if dynamic is not None and options.tune_trials:
            raise TargetCompileError(
                f"tvm cannot tune {graph.name}: its sizes {', '.join(sorted(graph.ranges))} are symbolic and "
                "MetaSchedule tunes each task for fixed sizes", where="tvm build options (tune_trials)",
                hint="compile with --dynamic and without --tune-trials (untuned), or tune at fixed sizes")
        module = to_fx(lower_low_precision(graph)).eval()
        try:
            config = BuildConfig.from_options(options, device, work_dir).replace(
                kernels=_KERNELS[self.settings.kernels])
            built = tvm_backend.build(module, inputs, config, dynamic_shapes=dynamic,
                                      **({"progress": progress} if progress is not None else {}))
        except MlcompError:
            raise
        except Exception as exc:  # noqa: BLE001 - TVM's errors are long C++ traces (first_error finds the real cause)
            failure = first_error(exc, module)
            raise TargetCompileError(
                f"TVM could not build {graph.name}: {failure.message}",
                where=failure.where() or "mlcomp.targets.tvm.build.build",
                hint="The cpu target (TorchScript) runs every op: use --target cpu, or --target onnxruntime") from None
        # tuned now, or records of a database applied
        return TvmRuntime(built, tuned="tasks" in built.stats, threads=options.threads,
                          deterministic=options.deterministic)
