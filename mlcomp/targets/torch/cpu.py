"""The ``cpu`` target: TorchScript trace + ``torch.jit.freeze`` (+ ``optimize_for_inference``).

This is the analogue of the textbook's ``hybridize()``: the Python that built
the graph disappears, parameters become constants folded into the graph, and
the TorchScript executor runs it (fusing and specialising after two warm-up
calls).

    >>> import torch
    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> graph = linear_relu_graph()              # relu(x @ W.T + b), x f32[2, 8]
    >>> x = torch.randn(2, 8)
    >>> from mlcomp.targets import get_target
    >>> art = get_target("cpu").compile(graph, CompileOptions(threads=1))
    >>> y = art(x)
    >>> art.save("out/mlp-cpu")               # out/mlp-cpu/model.pt
    PosixPath('out/mlp-cpu')
    >>> torch.equal(torch.jit.load("out/mlp-cpu/model.pt")(x)[0], y)   # plain torch can load the payload
    True

The payload is the *frozen* module.  ``optimize_for_inference`` (MKLDNN
convolution layouts, conv/bn folding) rewrites the module into a form
TorchScript cannot serialise, so it is applied again after loading; with
``optimize=None`` (the default) both variants are timed at compile time and the
faster one is kept, but only where the optimisation changes the kernels
(convolutions become MKLDNN): elsewhere it only folds constant lists, and the
plain module is kept untimed.  The timing is :func:`mlcomp.hardware.decide.decide` (paired
rounds until a sign test decides; undecided keeps plain); with ``deterministic`` the plain
module is kept untimed.  The choice and why is ``runtime.choice`` (manifest
``runtime_info.choice``, and its :class:`~mlcomp.hardware.decide.Decision` in ``decisions``)::

    trace → freeze (plain) and optimize_for_inference (tuned) of the same trace
          → decide (≥ 6 paired rounds) → the payload serialised when first needed (save)
    lenet: {"optimize": false, "reason": "not-faster", "decision": {"verdict": "decided", "rounds": 6, …}}
"""
from __future__ import annotations

import enum
import io
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from mlcomp.base.errors import MlcompError
from mlcomp.base.quiet import quiet_torch
from mlcomp.hardware import decide as decide_mod
from mlcomp.hardware.decide import Decision, DecisionPolicy, Verdict, call_samplers, decide
from mlcomp.hardware.threads import threads
from mlcomp.hardware.timing import Clock
from mlcomp.ir import Graph, Mode, TensorMeta
from mlcomp.ir.ops import Op
from mlcomp.pipeline.presets import ALL_REWRITES, Rewrite
from mlcomp.runtime.artifact import RuntimeKind
from mlcomp.targets.torch.archive import canonical_torchscript
from mlcomp.targets.torch.linears import SAME_KERNEL, freeze_with_linears
from mlcomp.targets.base import CompileOptions, Target, TargetCompileError
from mlcomp.targets.capabilities import TORCH_CPU
from mlcomp.runtime.codegen import to_fx

__all__ = ["CpuTarget", "OptimizeChoice", "OptimizeReason", "TorchScriptRuntime", "choose_by_timing",
           "trace_frozen", "trace_module", "threads"]

PAYLOAD = "model.pt"


def require_inference(graph: Graph, target: str) -> None:
    if graph.mode is Mode.TRAINING:
        raise MlcompError(f"target {target} compiles inference graphs, but {graph.name} was captured "
                          "in training mode", hint="capture without --training to compile it")


def trace_frozen(graph: Graph, inputs: tuple[torch.Tensor, ...], device: str = "cpu") -> torch.jit.ScriptModule:
    """Generate torch code for ``graph`` on ``device``, trace it and freeze it, its products as ``aten::linear``
    (:func:`~mlcomp.targets.torch.linears.freeze_with_linears`: TorchScript's executor splits an ``addmm``)."""
    scripted = trace_module(graph, inputs, device)
    with torch.no_grad(), quiet_torch():
        return freeze_with_linears(scripted)


def trace_module(graph: Graph, inputs: tuple[torch.Tensor, ...], device: str = "cpu") -> torch.jit.ScriptModule:
    """Generate torch code for ``graph`` on ``device`` and trace it (scripted if sizes are dynamic), in eval mode.

    Not frozen: ``torch.jit.freeze`` and ``optimize_for_inference`` each freeze their own
    copy, so one trace serves both variants.
    """
    dynamic = any(n.tensor_meta.is_dynamic for n in graph.input_nodes)
    script = dynamic or any(untraceable(n.op) for n in graph.call_nodes())
    graph = int_fill_values(graph if dynamic else explicit_view_sizes(graph))
    gm = to_fx(graph, device=device, scriptable=script).eval()
    inputs = tuple(t.to(device) for t in inputs)
    with torch.no_grad(), quiet_torch():
        if script:  # tracing would bake the example sizes in (or cannot record the op); scripting keeps size() calls
            try:
                scripted = torch.jit.script(gm)
            except Exception as exc:  # noqa: BLE001 - TorchScript's compiler errors are long
                raise TargetCompileError(
                    f"TorchScript cannot compile the dynamic-shape graph {graph.name}: "
                    f"{str(exc).strip().splitlines()[0]}", where="torch.jit.script of the generated module",
                    hint="capture without --dynamic (static shapes are traced), or use "
                         "--target onnxruntime, which keeps dynamic sizes") from None
        else:
            scripted = torch.jit.trace(gm, inputs, check_trace=False)
        return scripted.eval()


_VIEWS = frozenset({"view", "reshape", "_unsafe_view"})
# argument types torch.jit.trace cannot record ("unsupported argument type in the JIT tracer"): the fused
# backward kernels' ``bool[3] output_mask`` (convolution_backward, native_layer_norm_backward, …), ``SymInt[]?``
UNTRACEABLE = frozenset({"List[bool]", "Optional[List[int]]"})


def untraceable(op: Op) -> bool:
    """Whether an argument of ``op``'s schema has a type in :data:`UNTRACEABLE` (a graph holding it is scripted)."""
    if op.is_structural or op.is_composite:
        return False
    try:
        schema = getattr(op.resolve(), "_schema", None)
    except Exception:  # noqa: BLE001 - an op torch cannot resolve is not ours to judge here
        return False
    return schema is not None and any(str(a.type) in UNTRACEABLE for a in schema.arguments)


def explicit_view_sizes(graph: Graph) -> Graph:
    """``graph``, or a copy whose static ``view``/``reshape`` sizes are written out (``-1`` → the size).

    ``torch.jit.freeze`` folds linears that share an input into one product and resolves a ``-1``
    of a later ``view`` against the joined product's size, so ``mm(x, w1).view(2, -1, 4, 16)``
    beside ``addmm(b, x, w2)`` fails ("shape '[2, 32, 4, 16]' is invalid for input of size 2048");
    with the sizes the IR already knows there is nothing to resolve.
    """
    found = [n for n in graph.call_nodes() if n.op.name in _VIEWS and len(n.inputs) > 1
             and isinstance(n.inputs[1], (list, tuple)) and -1 in n.inputs[1]
             and isinstance(n.meta, TensorMeta) and not n.meta.is_dynamic]
    if not found:
        return graph
    graph = graph.copy()
    for node in found:
        graph.replace(node.with_(inputs=(node.inputs[0], list(node.tensor_meta.shape), *node.inputs[2:])))
    return graph


# factory ops -> the position of their ``Scalar`` fill value
_FILLS = {"full": 1, "full_like": 1, "new_full": 2, "fill": 1, "scalar_tensor": 0}


def int_fill_values(graph: Graph) -> Graph:
    """``graph``, or a copy whose bool fill values are ints (``full(size, True, dtype=bool)`` ->
    ``full(size, 1, dtype=bool)``, the same tensor): TorchScript's ``Scalar`` has no bool, so tracing a
    bool fill stops ("We don't have an op for aten::full … Argument types: int[], bool").  The dtype the
    bool implied is written out."""
    found = [n for n in graph.call_nodes() if n.op.name in _FILLS and len(n.inputs) > _FILLS[n.op.name]
             and isinstance(n.inputs[_FILLS[n.op.name]], bool) and isinstance(n.meta, TensorMeta)]
    if not found:
        return graph
    graph = graph.copy()
    for node in found:
        at, inputs = _FILLS[node.op.name], list(node.inputs)
        inputs[at] = int(inputs[at])
        attrs = dict(node.attrs)
        if node.op.name in ("full", "scalar_tensor", "new_full", "full_like"):
            attrs.setdefault("dtype", node.meta.dtype)
        graph.replace(node.with_(inputs=tuple(inputs), attrs=attrs))
    return graph


class TorchScriptRuntime:
    """Runs a frozen TorchScript module (optionally ``optimize_for_inference``-d)."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.TORCHSCRIPT

    def __init__(self, payload: bytes | torch.jit.ScriptModule, *, optimize: bool, threads: int | None,
                 device: str = "cpu", module: torch.jit.ScriptModule | None = None,
                 choice: "OptimizeChoice | None" = None, deterministic: bool = False) -> None:
        """``payload``: the frozen module's TorchScript archive, or the frozen module itself (serialised
        when first needed, e.g. by :meth:`save`).  ``module``: what runs, the payload loaded (and
        optimised if ``optimize``), e.g. by the compile that chose it.  ``choice``: how ``optimize`` was decided.
        ``deterministic``: the payload is written with its process counters renumbered
        (:func:`~mlcomp.targets.torch.archive.canonical_torchscript`), the same bytes for the same model."""
        self._payload = payload
        self.optimize = optimize
        self.threads = threads
        self.device = device
        self.choice = choice or OptimizeChoice(optimize, OptimizeReason.REQUESTED)
        self.deterministic = deterministic
        self.decisions = [self.choice.decision] if self.choice.decision else []
        if module is None:
            module = self._load_module(self.payload, optimize, device)
        self.module = module
        self._forward = self.module.forward

    @property
    def payload(self) -> bytes:
        """The frozen module as a TorchScript archive (``torch.jit.load`` reads it)."""
        if not isinstance(self._payload, bytes):
            data = frozen_bytes(self._payload)
            self._payload = canonical_torchscript(data) if self.deterministic else data
        return self._payload

    @staticmethod
    def _load_module(payload: bytes, optimize: bool, device: str) -> torch.jit.ScriptModule:
        module = torch.jit.load(io.BytesIO(payload), map_location=device)
        if optimize:
            module = torch.jit.optimize_for_inference(module)
        return module

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # No context managers on this path: each `with` costs microseconds, as much as a
        # small model's forward.  The frozen module holds no trainable tensors, so autograd
        # records nothing unless an input itself requires grad.
        if self.threads is None:
            return self._forward(*inputs)
        before = torch.get_num_threads()
        if before == self.threads:
            return self._forward(*inputs)
        torch.set_num_threads(self.threads)
        try:
            return self._forward(*inputs)
        finally:
            torch.set_num_threads(before)

    def save(self, directory: Path) -> dict[str, Any]:
        (directory / PAYLOAD).write_bytes(self.payload)
        info = {"file": PAYLOAD, "optimize": self.optimize, "threads": self.threads, "choice": self.choice.to_json()}
        return info | ({"deterministic": True} if self.deterministic else {})

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "TorchScriptRuntime":
        payload = (directory / info.get("file", PAYLOAD)).read_bytes()
        optimize = bool(info.get("optimize"))
        return cls(payload, optimize=optimize, threads=info.get("threads"),
                   choice=OptimizeChoice.from_json(info.get("choice"), optimize),
                   deterministic=bool(info.get("deterministic")))


def frozen_bytes(module: torch.jit.ScriptModule) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    return buffer.getvalue()


class CpuTarget(Target):
    name = "cpu"
    description = "TorchScript trace + freeze (+ optimize_for_inference) on the CPU"
    runtime_modules = ("mlcomp.targets.torch.cpu",)
    capabilities = TORCH_CPU   # training graphs: mlcomp.training.step
    runs_composites_in_torch = True
    rewrites = ALL_REWRITES | {Rewrite.PROJECTIONS}    # q/k/v apart measured faster (decision 43)

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> TorchScriptRuntime:
        require_inference(graph, self.name)
        if self.device(options) != "cpu":
            raise MlcompError(f"target cpu cannot compile for device {options.device!r}",
                              hint="use --target cuda for GPUs")
        with threads(options.threads):
            scripted = trace_module(graph, inputs)        # one trace for both variants
            with torch.no_grad(), quiet_torch():
                plain = freeze_with_linears(scripted)
                tuned = torch.jit.optimize_for_inference(scripted) if options.optimize is not False else None
            if options.optimize is None:   # the timed variant is kept, warmed up
                choice = self._choose(plain, tuned, inputs, options.deterministic)
            else:
                choice = OptimizeChoice(options.optimize, OptimizeReason.REQUESTED)
        module = tuned if choice.optimize else plain
        return TorchScriptRuntime(plain, optimize=choice.optimize, threads=options.threads, module=module,
                                  choice=choice, deterministic=options.deterministic)

    @staticmethod
    def _choose(plain: torch.jit.ScriptModule, tuned: torch.jit.ScriptModule,
                inputs: tuple[torch.Tensor, ...], deterministic: bool = False) -> "OptimizeChoice":
        """Keep ``optimize_for_inference`` if it changed the kernels and the timing says it clearly helps.

        When it only folds constant lists (MLPs, attention, GRUs: same kernel calls)
        there is nothing to time and the plain module is kept.  Otherwise the two are
        timed interleaved (:func:`choose_by_timing`), so load on a shared machine hits
        both alike.
        """
        if _kernels(plain) == _kernels(tuned):
            return OptimizeChoice(False, OptimizeReason.SAME_KERNELS, Decision.fixed(
                QUESTION, ("plain", "tuned"), "plain", "optimize_for_inference changes no kernel call: plain, untimed",
                deterministic=False))
        with torch.no_grad():
            return choose_by_timing(lambda: plain(*inputs), lambda: tuned(*inputs), deterministic=deterministic)


class OptimizeReason(enum.Enum):
    """Why a cpu artifact does or does not run ``optimize_for_inference``'s module."""

    REQUESTED = "requested"        # CompileOptions.optimize was given
    SAME_KERNELS = "same-kernels"  # it changes no kernel call (only constant lists): nothing to time
    FASTER = "faster"              # timed: the optimised module is clearly faster
    NOT_FASTER = "not-faster"      # timed: it is not (or the timing could not tell)
    DETERMINISTIC = "deterministic"  # a deterministic compile: the plain module, untimed


@dataclass(frozen=True)
class OptimizeChoice:
    """The decision and its evidence (:class:`~mlcomp.hardware.decide.Decision`; none when nothing was compared)."""

    optimize: bool
    reason: OptimizeReason
    decision: Decision | None = None

    @property
    def rounds(self) -> int:
        return self.decision.rounds if self.decision else 0

    @property
    def ratio(self) -> float | None:
        return self.decision.ratios.get("tuned") if self.decision else None

    @property
    def decided_early(self) -> bool:
        return bool(self.decision and self.decision.verdict is Verdict.DECIDED)

    def to_json(self) -> dict[str, Any]:
        return {"optimize": self.optimize, "reason": self.reason.value,
                "decision": self.decision.to_json() if self.decision else None}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None, optimize: bool) -> "OptimizeChoice":
        if not data:                      # an artifact saved before the choice was recorded
            return cls(optimize, OptimizeReason.REQUESTED)
        decision = data.get("decision")
        return cls(bool(data["optimize"]), OptimizeReason(data["reason"]),
                   Decision.from_json(decision) if decision else None)


# The optimised module must take less than THRESHOLD x the plain module's time.
THRESHOLD = 0.9
MIN_ROUNDS = decide_mod.MIN_ROUNDS
# 0.25 s of calls per variant; a slow call (or a loaded machine) stops at MIN_ROUNDS
TIMING = DecisionPolicy(warmup=3, budget_s=0.25, min_rounds=MIN_ROUNDS, max_rounds=2000, threshold=THRESHOLD)
QUESTION = "cpu: run optimize_for_inference's module (tuned) or the frozen trace (plain)?"
DETERMINISTIC_RULE = "the plain frozen trace (optimize_for_inference is not timed)"


def choose_by_timing(plain: Callable[[], Any], tuned: Callable[[], Any], policy: DecisionPolicy = TIMING, *,
                     clock: Clock = time.perf_counter, deterministic: bool = False) -> OptimizeChoice:
    """Time ``plain`` and ``tuned`` in paired rounds (:func:`mlcomp.hardware.decide.decide`) and keep
    ``tuned`` only if a sign test decides it takes < ``policy.threshold`` x the plain time.

    Each is warmed up first (``policy.warmup`` calls: TorchScript's profiling executor
    specialises in its first two).  ``deterministic``: nothing is timed, plain is kept.
    """
    fns = {"plain": plain, "tuned": tuned}
    samplers = fns if deterministic else call_samplers(fns, warmup=policy.warmup, budget_s=policy.budget_s,
                                                       clock=clock)     # deterministic: never called
    decision = decide(QUESTION, samplers, default="plain", policy=policy, clock=clock,
                      deterministic=deterministic, rule=DETERMINISTIC_RULE)
    faster = decision.choice == "tuned"
    reason = (OptimizeReason.DETERMINISTIC if deterministic else
              OptimizeReason.FASTER if faster else OptimizeReason.NOT_FASTER)
    return OptimizeChoice(faster, reason, decision)


_CONSTANT_PLUMBING = frozenset({"prim::Constant", "prim::ListConstruct"})


def _kernels(module: torch.jit.ScriptModule) -> Counter[str]:
    """The TorchScript node kinds ``module`` runs (a kind that runs another's kernel counted as that one,
    :data:`~mlcomp.targets.torch.linears.SAME_KERNEL`), constants and constant lists left out."""
    return Counter(SAME_KERNEL.get(n.kind(), n.kind()) for n in module.graph.nodes()
                   if n.kind() not in _CONSTANT_PLUMBING)
