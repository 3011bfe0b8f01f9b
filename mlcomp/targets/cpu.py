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
faster one is kept (the choice is stored in the manifest), but only where the
optimisation changes the kernels (convolutions become MKLDNN): elsewhere it only
folds constant lists, and the plain module is kept untimed.
"""
from __future__ import annotations

import contextlib
import io
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch
from mlcomp.targets.artifact import RuntimeKind
from mlcomp.targets.base import CompileOptions, Target, TargetCompileError
from mlcomp.targets.capabilities import TORCH_CPU
from mlcomp.targets.codegen import to_fx

from mlcomp.base.errors import MlcompError
from mlcomp.base.quiet import quiet_torch
from mlcomp.hardware.timing import TimingPolicy, measure_interleaved
from mlcomp.ir import Graph, Mode

__all__ = ["CpuTarget", "TorchScriptRuntime", "trace_frozen", "threads"]

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
        return torch.jit.freeze(scripted.eval())


class TorchScriptRuntime:
    """Runs a frozen TorchScript module (optionally ``optimize_for_inference``-d)."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.TORCHSCRIPT

    def __init__(self, payload: bytes, *, optimize: bool, threads: int | None, device: str = "cpu",
                 module: torch.jit.ScriptModule | None = None) -> None:
        """``module``: ``payload`` already loaded (and optimised if ``optimize``), e.g. by the compile that chose it."""
        self.payload = payload
        self.optimize = optimize
        self.threads = threads
        self.device = device
        self.module = module if module is not None else self._load_module(payload, optimize, device)
        self._forward = self.module.forward

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
        return {"file": PAYLOAD, "optimize": self.optimize, "threads": self.threads}

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "TorchScriptRuntime":
        payload = (directory / info.get("file", PAYLOAD)).read_bytes()
        return cls(payload, optimize=bool(info.get("optimize")), threads=info.get("threads"))


def frozen_bytes(module: torch.jit.ScriptModule) -> bytes:
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    return buffer.getvalue()


class CpuTarget(Target):
    name = "cpu"
    description = "TorchScript trace + freeze (+ optimize_for_inference) on the CPU"
    capabilities = TORCH_CPU   # training graphs: mlcomp.targets.training
    runs_composites_in_torch = True

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> TorchScriptRuntime:
        require_inference(graph, self.name)
        if self.device(options) != "cpu":
            raise MlcompError(f"target cpu cannot compile for device {options.device!r}",
                              hint="use --target cuda for GPUs")
        with threads(options.threads):
            payload = frozen_bytes(trace_frozen(graph, inputs))
            optimize, module = options.optimize, None
            if optimize is None:   # the timed variant is kept, warmed up
                plain = TorchScriptRuntime._load_module(payload, False, "cpu")
                tuned = TorchScriptRuntime._load_module(payload, True, "cpu")
                optimize = self._optimize_is_faster(plain, tuned, inputs)
                module = tuned if optimize else plain
        return TorchScriptRuntime(payload, optimize=optimize, threads=options.threads, module=module)

    @staticmethod
    def _optimize_is_faster(plain: torch.jit.ScriptModule, tuned: torch.jit.ScriptModule,
                            inputs: tuple[torch.Tensor, ...]) -> bool:
        """True if ``optimize_for_inference`` changed the kernels and the timing says it clearly helps.

        When it only folds constant lists (MLPs, attention, GRUs: same kernel calls)
        there is nothing to time and the plain module is kept; before, every compile
        paid the interleaved timing (18+ calls of each variant, the optimised one
        re-specialised by the profiling executor), most of a cold cpu compile.
        The two are timed interleaved (one call of each per round), so load on a
        shared machine hits both alike; timed one after the other, a burst of load
        during one of them decided the choice, and two compiles of one model could
        differ by 1.5x.  Keeping ``optimize`` needs a 10% win over the median.
        """
        if _kernels(plain) == _kernels(tuned):
            return False
        with torch.no_grad():
            timing = measure_interleaved({"plain": lambda: plain(*inputs), "tuned": lambda: tuned(*inputs)},
                                         TimingPolicy(warmup=3, budget_s=0.25, min_repeats=15, max_repeats=2000))
        return timing["tuned"].median < 0.9 * timing["plain"].median


_CONSTANT_PLUMBING = frozenset({"prim::Constant", "prim::ListConstruct"})


def _kernels(module: torch.jit.ScriptModule) -> Counter[str]:
    """The TorchScript node kinds ``module`` runs, constants and constant lists left out."""
    return Counter(n.kind() for n in module.graph.nodes() if n.kind() not in _CONSTANT_PLUMBING)
