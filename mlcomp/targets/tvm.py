"""The ``tvm`` target: IR → generated torch module → Apache TVM (Relax) → VM executable.

    >>> art = get_target("tvm").compile(graph, CompileOptions(tune_trials=64, work_dir="tvm-db"))
    >>> art(x)
    >>> art.save("out/mlp-tvm")          # out/mlp-tvm/model.so (+ meta.json)

The build itself is :func:`mlcomp.targets.tvm_backend.build`: ``torch.export``
of the generated module, ``from_exported_program``, BatchNorm folding, fusion,
and either DLight default schedules (``tune_trials=0``, the default) or
MetaSchedule with a total budget of ``tune_trials`` trials.  ``work_dir`` holds
the tuning database; pointing several runs at the same folder reuses what was
tuned before.  Shapes are static: another batch size needs another compile.

``supports(node)`` asks TVM's ExportedProgram importer whether it has a
converter for the op.
"""
from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

import torch
from mlcomp.targets.artifact import RuntimeKind
from mlcomp.targets.base import CompileOptions, Target, TargetCompileError
from mlcomp.targets.capabilities import Capabilities, DeviceKind
from mlcomp.targets.codegen import to_fx
from mlcomp.targets.tvm_scope import quiet_native

from mlcomp.base.errors import MlcompError
from mlcomp.ir import Graph, Node, TensorMeta
from mlcomp.ir.dtypes import dtype_name
from mlcomp.ir.ops import GETITEM, Namespace, Op
from mlcomp.pipeline.presets import Rewrite

__all__ = ["TvmTarget", "TvmRuntime", "quiet_native"]


class TvmRuntime:
    """Wraps :class:`mlcomp.targets.tvm_backend.TvmModule` (the Relax VM)."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.TVM

    def __init__(self, module: Any, *, tuned: bool) -> None:
        self.module = module
        self.tuned = tuned
        self.stats = dict(module.stats)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.module.device != "cpu":
            inputs = tuple(t.to(self.module.device) for t in inputs)
        return self.module(*inputs)

    def save(self, directory: Path) -> dict[str, Any]:
        with quiet_native():
            files = self.module.save(str(directory))
        return {"files": files, "device": self.module.device, "tuned": self.tuned,
                "stats": {k: v for k, v in self.stats.items() if isinstance(v, (int, float, str, bool))}}

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "TvmRuntime":
        from mlcomp.targets import tvm_backend

        with quiet_native():
            module = tvm_backend.TvmModule.load(str(directory), device=info.get("device", "cpu"))
        return cls(module, tuned=bool(info.get("tuned")))


# ops whose TVM converter emits a float32 bias add whatever the inputs' dtype (measured, TVM 0.27)
_FLOAT32_ONLY = frozenset({"addmm", "linear"})


@lru_cache(maxsize=1)
def _converters() -> frozenset[str]:
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    return frozenset(ExportedProgramImporter().create_convert_map())


class TvmTarget(Target):
    name = "tvm"
    description = "Apache TVM (Relax): DLight schedules, or MetaSchedule with --tune-trials"
    # from_exported_program converts every real dtype of the table; the VM runs static shapes
    rewrites = frozenset({Rewrite.CLEANUP})      # fuses on its own: presets skip mlcomp's fusion
    capabilities = Capabilities(devices=frozenset({DeviceKind.CPU, DeviceKind.CUDA}), dynamic_shapes=False)

    def available(self) -> str | None:
        if importlib.util.find_spec("tvm") is None:
            return "the apache-tvm package is not installed (pip install apache-tvm)"
        return None

    def explain(self, node: Node, graph: Graph | None = None) -> str | None:
        reason = super().explain(node, graph)
        meta = node.meta
        if reason is None and node.op.namespace is Namespace.ATEN and node.op.name in _FLOAT32_ONLY \
                and isinstance(meta, TensorMeta) and meta.dtype.is_floating_point and meta.dtype != torch.float32:
            return (f"TVM 0.27's converter for {node.op.name} types its bias add as float32, so a "
                    f"{dtype_name(meta.dtype)} {node.op.name} fails to build (a matmul without bias works)")
        return reason

    def explain_op(self, op: Op) -> str | None:
        if op == GETITEM:
            return None
        if op.namespace is Namespace.OPERATOR:
            key = op.name
        elif op.namespace is Namespace.ATEN:
            key = f"{op.name}.{op.overload}"
        else:
            return f"TVM's PyTorch importer has no converter for {op}"
        if key in _converters() or op.name in _converters():
            return None
        return f"TVM's PyTorch importer (from_exported_program) has no converter for {op}"

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> TvmRuntime:
        from mlcomp.targets import tvm_backend

        # mode, dtypes, device and static shapes were checked by compile(); TVM takes the device kind
        kind = DeviceKind.of(self.device(options))
        device = kind.value if kind is not None else self.device(options)
        work_dir = options.work_dir
        if options.tune_trials and work_dir:
            work_dir = os.path.abspath(work_dir)
        module = to_fx(graph).eval()
        try:
            built = tvm_backend.build(module, inputs, device=device, tune_trials=options.tune_trials,
                                      work_dir=work_dir, build_timeout=options.tune_build_timeout,
                                      run_timeout=options.tune_run_timeout, log_level=options.log_level,
                                      worker_torch=options.tune_worker_torch)
        except MlcompError:
            raise
        except Exception as exc:  # noqa: BLE001 - TVM's errors are long C++ traces
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            raise TargetCompileError(
                f"TVM could not build {graph.name}: {type(exc).__name__}: {lines[-1] if lines else ''}",
                where="mlcomp.targets.tvm_backend.build",
                hint="run with --fallback eager only helps for ops TVM does not know; otherwise use "
                     "--target onnxruntime or cpu") from None
        return TvmRuntime(built, tuned=options.tune_trials > 0)
