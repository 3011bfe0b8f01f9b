"""The ``cpu`` target: TorchScript trace + ``torch.jit.freeze`` (+ ``optimize_for_inference``).

This is the analogue of the textbook's ``hybridize()``: the Python that built
the graph disappears, parameters become constants folded into the graph, and
the TorchScript executor runs it (fusing and specialising after two warm-up
calls).

    >>> art = get_target("cpu").compile(graph, CompileOptions(threads=1))
    >>> art(x)
    >>> art.save("out/mlp-cpu")               # out/mlp-cpu/model.pt
    >>> torch.jit.load("out/mlp-cpu/model.pt")(x)   # plain torch can load the payload

The payload is the *frozen* module.  ``optimize_for_inference`` (MKLDNN
convolution layouts, conv/bn folding) rewrites the module into a form
TorchScript cannot serialise, so it is applied again after loading; with
``optimize=None`` (the default) both variants are timed at compile time and the
faster one is kept, but only where the optimisation changes the kernels
(convolutions become MKLDNN): elsewhere it only folds constant lists, and the
plain module is kept untimed.  The choice and why is ``runtime.choice``
(manifest ``runtime_info.choice``)::

    trace → freeze (plain) and optimize_for_inference (tuned) of the same trace
            → time until a sign test over paired rounds decides (≥ 6 rounds; the same
            budget when it cannot) → the payload serialised when first needed (save)
    lenet:  {"optimize": false, "reason": "not-faster", "rounds": 6, "ratio": 1.9535, "decided_early": true}
"""
from __future__ import annotations

import contextlib
import enum
import io
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch

from mlcomp.base.errors import MlcompError
from mlcomp.base.quiet import quiet_torch
from mlcomp.hardware.timing import Clock, TimingPolicy, median
from mlcomp.ir import Graph, Mode
from mlcomp.runtime.artifact import RuntimeKind
from mlcomp.targets.base import CompileOptions, Target, TargetCompileError
from mlcomp.targets.capabilities import TORCH_CPU
from mlcomp.runtime.codegen import to_fx

__all__ = ["CpuTarget", "OptimizeChoice", "OptimizeReason", "TorchScriptRuntime", "choose_by_timing",
           "trace_frozen", "trace_module", "threads"]

PAYLOAD = "model.pt"


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` intra-op threads, restoring the previous count (no-op for ``None``)."""
    if not n or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def require_inference(graph: Graph, target: str) -> None:
    if graph.mode is Mode.TRAINING:
        raise MlcompError(f"target {target} compiles inference graphs, but {graph.name} was captured "
                          "in training mode", hint="capture without --training to compile it")


def trace_frozen(graph: Graph, inputs: tuple[torch.Tensor, ...], device: str = "cpu") -> torch.jit.ScriptModule:
    """Generate torch code for ``graph`` on ``device``, trace it and freeze it."""
    scripted = trace_module(graph, inputs, device)
    with torch.no_grad(), quiet_torch():
        return torch.jit.freeze(scripted)


def trace_module(graph: Graph, inputs: tuple[torch.Tensor, ...], device: str = "cpu") -> torch.jit.ScriptModule:
    """Generate torch code for ``graph`` on ``device`` and trace it (scripted if sizes are dynamic), in eval mode.

    Not frozen: ``torch.jit.freeze`` and ``optimize_for_inference`` each freeze their own
    copy, so one trace serves both variants.
    """
    dynamic = any(n.tensor_meta.is_dynamic for n in graph.input_nodes)
    gm = to_fx(graph, device=device, scriptable=dynamic).eval()
    inputs = tuple(t.to(device) for t in inputs)
    with torch.no_grad(), quiet_torch():
        if dynamic:  # tracing would bake the example sizes in; scripting keeps size() calls
            try:
                scripted = torch.jit.script(gm)
            except Exception as exc:  # noqa: BLE001 - TorchScript's compiler errors are long
                raise TargetCompileError(
                    f"TorchScript cannot compile the dynamic-shape graph {graph.name}: "
                    f"{str(exc).strip().splitlines()[0]}", where="torch.jit.script of the generated module",
                    hint="capture without --dynamic-batch (static shapes are traced), or use "
                         "--target onnxruntime, which keeps dynamic sizes") from None
        else:
            scripted = torch.jit.trace(gm, inputs, check_trace=False)
        return scripted.eval()


class TorchScriptRuntime:
    """Runs a frozen TorchScript module (optionally ``optimize_for_inference``-d)."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.TORCHSCRIPT

    def __init__(self, payload: bytes | torch.jit.ScriptModule, *, optimize: bool, threads: int | None,
                 device: str = "cpu", module: torch.jit.ScriptModule | None = None,
                 choice: "OptimizeChoice | None" = None) -> None:
        """``payload``: the frozen module's TorchScript archive, or the frozen module itself (serialised
        when first needed, e.g. by :meth:`save`).  ``module``: what runs, the payload loaded (and
        optimised if ``optimize``), e.g. by the compile that chose it.  ``choice``: how ``optimize`` was decided."""
        self._payload = payload
        self.optimize = optimize
        self.threads = threads
        self.device = device
        self.choice = choice or OptimizeChoice(optimize, OptimizeReason.REQUESTED)
        if module is None:
            module = self._load_module(self.payload, optimize, device)
        self.module = module
        self._forward = self.module.forward

    @property
    def payload(self) -> bytes:
        """The frozen module as a TorchScript archive (``torch.jit.load`` reads it)."""
        if not isinstance(self._payload, bytes):
            self._payload = frozen_bytes(self._payload)
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
        return {"file": PAYLOAD, "optimize": self.optimize, "threads": self.threads, "choice": self.choice.to_json()}

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "TorchScriptRuntime":
        payload = (directory / info.get("file", PAYLOAD)).read_bytes()
        optimize = bool(info.get("optimize"))
        return cls(payload, optimize=optimize, threads=info.get("threads"),
                   choice=OptimizeChoice.from_json(info.get("choice"), optimize))


def frozen_bytes(module: torch.jit.ScriptModule) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    return buffer.getvalue()


class CpuTarget(Target):
    name = "cpu"
    description = "TorchScript trace + freeze (+ optimize_for_inference) on the CPU"
    capabilities = TORCH_CPU   # training graphs: mlcomp.training.step
    runs_composites_in_torch = True

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> TorchScriptRuntime:
        require_inference(graph, self.name)
        if self.device(options) != "cpu":
            raise MlcompError(f"target cpu cannot compile for device {options.device!r}",
                              hint="use --target cuda for GPUs")
        with threads(options.threads):
            scripted = trace_module(graph, inputs)        # one trace for both variants
            with torch.no_grad(), quiet_torch():
                plain = torch.jit.freeze(scripted)
                tuned = torch.jit.optimize_for_inference(scripted) if options.optimize is not False else None
            if options.optimize is None:   # the timed variant is kept, warmed up
                choice = self._choose(plain, tuned, inputs)
            else:
                choice = OptimizeChoice(options.optimize, OptimizeReason.REQUESTED)
        module = tuned if choice.optimize else plain
        return TorchScriptRuntime(plain, optimize=choice.optimize, threads=options.threads, module=module,
                                  choice=choice)

    @staticmethod
    def _choose(plain: torch.jit.ScriptModule, tuned: torch.jit.ScriptModule,
                inputs: tuple[torch.Tensor, ...]) -> "OptimizeChoice":
        """Keep ``optimize_for_inference`` if it changed the kernels and the timing says it clearly helps.

        When it only folds constant lists (MLPs, attention, GRUs: same kernel calls)
        there is nothing to time and the plain module is kept.  Otherwise the two are
        timed interleaved (:func:`choose_by_timing`), so load on a shared machine hits
        both alike.
        """
        if _kernels(plain) == _kernels(tuned):
            return OptimizeChoice(False, OptimizeReason.SAME_KERNELS)
        with torch.no_grad():
            return choose_by_timing(lambda: plain(*inputs), lambda: tuned(*inputs))


class OptimizeReason(enum.Enum):
    """Why a cpu artifact does or does not run ``optimize_for_inference``'s module."""

    REQUESTED = "requested"        # CompileOptions.optimize was given
    SAME_KERNELS = "same-kernels"  # it changes no kernel call (only constant lists): nothing to time
    FASTER = "faster"              # timed: the optimised module is clearly faster
    NOT_FASTER = "not-faster"      # timed: it is not


@dataclass(frozen=True)
class OptimizeChoice:
    """The decision and its evidence: timed rounds and the median ratio optimised / plain time."""

    optimize: bool
    reason: OptimizeReason
    rounds: int = 0
    ratio: float | None = None
    decided_early: bool = False    # the sign test decided before the time budget ran out

    def to_json(self) -> dict[str, Any]:
        return {"optimize": self.optimize, "reason": self.reason.value, "rounds": self.rounds,
                "ratio": None if self.ratio is None else round(self.ratio, 4), "decided_early": self.decided_early}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None, optimize: bool) -> "OptimizeChoice":
        if not data:                      # an artifact saved before the choice was recorded
            return cls(optimize, OptimizeReason.REQUESTED)
        return cls(bool(data["optimize"]), OptimizeReason(data["reason"]), int(data.get("rounds", 0)),
                   data.get("ratio"), bool(data.get("decided_early", False)))


# The optimised module must take less than THRESHOLD x the plain module's time.
THRESHOLD = 0.9
MIN_ROUNDS = 6        # the fewest paired rounds a sign test can decide at ALPHA (two-sided p = 2 / 2**6)
ALPHA = 0.05
# 0.25 s of calls per variant; a slow call (or a loaded machine) stops at MIN_ROUNDS, not 15
TIMING = TimingPolicy(warmup=3, budget_s=0.25, min_repeats=MIN_ROUNDS, max_repeats=2000)


def sign_test(ratios: list[float], threshold: float) -> float:
    """Two-sided sign-test p-value that the median of ``ratios`` is ``threshold`` (ties dropped)."""
    below = sum(r < threshold for r in ratios)
    above = sum(r > threshold for r in ratios)
    n, k = below + above, min(below, above)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def choose_by_timing(plain: Callable[[], Any], tuned: Callable[[], Any], policy: TimingPolicy = TIMING, *,
                     clock: Clock = time.perf_counter) -> OptimizeChoice:
    """Time ``plain`` and ``tuned`` in paired rounds and keep ``tuned`` if it takes < THRESHOLD x the time.

    Each is warmed up (``policy.warmup`` calls: TorchScript's profiling executor
    specialises in its first two).  A round times one call of each, in alternating
    order; its ratio tuned / plain cancels load that hits both.  After MIN_ROUNDS the
    rounds stop as soon as a sign test rejects "the median ratio is THRESHOLD" at
    ALPHA (a clear win or loss: MKLDNN convolutions are often 2x faster or slower);
    otherwise they go on until ``policy.budget_s`` of calls per variant is spent
    (and at least ``policy.min_repeats`` rounds).  The decision is the median ratio.
    """
    for fn in (plain, tuned):
        w0 = clock()
        for _ in range(policy.warmup):
            fn()
            if clock() - w0 >= policy.budget_s:     # a slow model: one budget of warm-up is enough
                break
    ratios: list[float] = []
    begin, early = clock(), False
    while len(ratios) < policy.max_repeats:
        order = ((0, plain), (1, tuned)) if len(ratios) % 2 == 0 else ((1, tuned), (0, plain))
        took = [0.0, 0.0]
        for i, fn in order:
            start = clock()
            fn()
            took[i] = clock() - start
        ratios.append(took[1] / took[0] if took[0] > 0 else math.inf)
        n = len(ratios)
        if n >= MIN_ROUNDS and sign_test(ratios, THRESHOLD) < ALPHA:
            early = n < policy.min_repeats or clock() - begin < 2 * policy.budget_s
            break
        if n >= policy.min_repeats and clock() - begin >= 2 * policy.budget_s:
            break
    ratio = median(ratios)
    faster = ratio < THRESHOLD
    return OptimizeChoice(faster, OptimizeReason.FASTER if faster else OptimizeReason.NOT_FASTER,
                          len(ratios), ratio, early)


_CONSTANT_PLUMBING = frozenset({"prim::Constant", "prim::ListConstruct"})


def _kernels(module: torch.jit.ScriptModule) -> Counter[str]:
    """The TorchScript node kinds ``module`` runs, constants and constant lists left out."""
    return Counter(n.kind() for n in module.graph.nodes() if n.kind() not in _CONSTANT_PLUMBING)
