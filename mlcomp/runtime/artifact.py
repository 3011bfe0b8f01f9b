"""Compiled artifacts: callable on torch tensors, saved as a self-describing folder.

    >>> import torch
    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> graph = linear_relu_graph()              # relu(x @ W.T + b), x f32[2, 8]
    >>> x = torch.randn(2, 8)
    >>> from mlcomp.targets import get_target   # mlcomp.compile returns the same kind of artifact
    >>> art = get_target("onnxruntime").compile(graph)
    >>> y = art(x)                            # one output → a tensor, several → a tuple
    >>> art.save("out/mlp-ort")
    PosixPath('out/mlp-ort')
    >>> again = Artifact.load("out/mlp-ort")  # any process; checks manifest and payload
    >>> again.verify((x,), y).passed          # no arguments: the stored reference (compile with verify)
    True

Folder layout::

    out/mlp-ort/
      manifest.json    format + version, mlcomp/torch/onnxruntime/tvm versions, target,
                       input/output spec, pipeline spec, options, verification result,
                       runtime info, payload files with their sha256
      model.onnx       the payload (model.pt for cpu/cuda, model.so + meta.json for tvm,
                       part0/ part1/ … for a graph split by --fallback eager)
      reference.pt     example inputs and eager outputs (tensors only; weights_only load)

The folder is written under a temporary name and renamed when complete
(:func:`mlcomp.base.files.atomic_dir`), so a failure never leaves half an artifact.
"""
from __future__ import annotations

import enum
import json
import platform
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Protocol, Sequence

import torch

from mlcomp.analysis.ranges import declared_tolerance
from mlcomp.analysis.verify import check_against
from mlcomp.base.errors import ArtifactError, InputSpecError, TargetUnavailableError
from mlcomp.base.files import Kind, atomic_dir, check_destination
from mlcomp.base.registry import LazyRegistry, resolve_ref
from mlcomp.base.version import __version__
from mlcomp.runtime.folders import _COMPILE_ONE, MANIFEST, OTHER_FORMATS, REFERENCE  # noqa: F401 (re-exported)
from mlcomp.runtime.folders import damaged, first_line_of, unavailable
from mlcomp.runtime.manifest import (FORMAT, FORMAT_VERSION, check_payload_file, payload_entries, read_manifest,
                                     runtime_decisions, stable_manifest)
from mlcomp.models import random_tensor
from mlcomp.ir import Dim, Graph, Node, TensorMeta, dtype_name, parse_dtype
from mlcomp.ir.symbols import check_sizes, ranges_from_json, ranges_json

__all__ = ["Artifact", "TensorSpec", "Runtime", "RuntimeKind", "FORMAT", "FORMAT_VERSION"]


class RuntimeKind(enum.Enum):
    """How a payload is run; each kind names the class that loads it."""

    TORCHSCRIPT = "torchscript"
    CUDA_GRAPH = "cuda-graph"
    ONNXRUNTIME = "onnxruntime"
    TVM = "tvm"
    EAGER = "eager"
    PARTITIONED = "partitioned"
    PIPELINE = "pipeline"
    OPENVINO = "openvino"

    @property
    def loader(self) -> str:
        return str(RUNTIMES.ref(self.value))

    def runtime_class(self) -> type["Runtime"]:
        return RUNTIMES.get(self.value)


# runtime kind -> "module:Class" that loads its payload, imported on first use
RUNTIMES: LazyRegistry[type["Runtime"]] = LazyRegistry("runtime", {
    "torchscript": "mlcomp.targets.torch.cpu:TorchScriptRuntime", "cuda-graph": "mlcomp.targets.torch.cuda:CudaRuntime",
    "onnxruntime": "mlcomp.targets.onnx.target:OrtRuntime", "tvm": "mlcomp.targets.tvm.target:TvmRuntime",
    "eager": "mlcomp.runtime.eager:EagerRuntime", "partitioned": "mlcomp.runtime.eager:PartitionedRuntime",
    "pipeline": "mlcomp.targets.distributed.target:PipelineRuntime",
    "openvino": "mlcomp.targets.openvino.target:OpenVinoRuntime",
})

# target name -> Target, imported on first use: targets sit above the runtime layer, so the
# runtime names the lookup (as it names the loaders above) instead of importing it
TARGET_LOOKUP = "mlcomp.targets.registry:get_target"


class Runtime(Protocol):
    """What a target builds: tensors in, tuple of tensors out; saves/loads its payload."""

    kind: ClassVar[RuntimeKind]
    # optional ``checks_inputs = True``: the runtime itself raises on a wrong shape or dtype,
    # so the artifact only inspects the inputs after a failure (saves a check per call)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def save(self, directory: Path) -> dict[str, Any]:
        """Write the payload into ``directory``; return JSON-able info that ``load`` needs."""

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "Runtime": ...


@dataclass(frozen=True)
class TensorSpec:
    """Name, shape (ints, or names of symbolic sizes) and dtype of one input or output."""

    name: str
    shape: tuple[Dim, ...]
    dtype: torch.dtype

    @classmethod
    def of_node(cls, node: Node) -> "TensorSpec":
        meta = node.tensor_meta
        return cls(node.name, tuple(meta.shape), meta.dtype)

    @classmethod
    def of_outputs(cls, graph: Graph) -> list["TensorSpec"]:
        out = []
        for ref in graph.output_refs:
            meta = graph.node(ref.name).meta
            if isinstance(meta, TensorMeta):
                out.append(cls(ref.name, tuple(meta.shape), meta.dtype))
            else:
                out.append(cls(ref.name, (), torch.float32))
        return out

    def __str__(self) -> str:
        return f"{self.name}: {dtype_name(self.dtype)}[{', '.join(map(str, self.shape))}]"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TensorSpec":
        return cls(d["name"], tuple(d["shape"]), parse_dtype(d["dtype"]))

    def fits(self, t: Any) -> str | None:
        """``None`` if ``t`` fits this spec, else what is wrong."""
        if not isinstance(t, torch.Tensor):
            return f"is a {type(t).__name__}, not a tensor"
        if t.dim() != len(self.shape) or any(isinstance(d, int) and d != s for d, s in zip(self.shape, t.shape)):
            return f"has shape {list(t.shape)}"
        if t.dtype != self.dtype:
            return f"has dtype {dtype_name(t.dtype)}"
        return None

    def random(self, symbols: dict[str, int] | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        shape = TensorMeta(self.shape, self.dtype).concrete_shape(symbols or {})
        return random_tensor(shape, self.dtype, generator)


def versions() -> dict[str, str | None]:
    """Versions of the packages an artifact depends on (read from metadata, nothing imported)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for key, dist in (("mlcomp", "mlcomp"), ("torch", "torch"), ("onnx", "onnx"),
                      ("onnxruntime", "onnxruntime"), ("tvm", "apache-tvm"), ("openvino", "openvino")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def _declared_rtol(graph: Graph, runtime: "Runtime") -> float | None:
    """The looser of what the graph's low-precision nodes imply and the runtime's own (cuda with tf32)."""
    declared = declared_tolerance(graph)
    found = [r for r in (declared.rtol if declared else None, getattr(runtime, "declared_rtol", None))
             if r is not None]
    return max(found, default=None)


class Artifact:
    """A compiled model.  Build one with a target or :func:`mlcomp.compile`; see module doc."""

    def __init__(self, runtime: "Runtime", manifest: dict[str, Any],
                 reference: tuple[tuple[torch.Tensor, ...], tuple[Any, ...]] | None = None) -> None:
        self.runtime = runtime      # property: also rebinds the call path
        self.manifest = manifest
        self.inputs = [TensorSpec.from_json(d) for d in manifest["inputs"]]
        self.outputs = [TensorSpec.from_json(d) for d in manifest["outputs"]]
        self.reference = reference
        # (shape, dtype) per input for the fast check; shape None = has symbolic sizes
        self._expect = [(None if any(isinstance(d, str) for d in s.shape) else torch.Size(s.shape), s.dtype)
                        for s in self.inputs]
        self._ranges = ranges_from_json(manifest.get("ranges"))

    @classmethod
    def new(cls, runtime: "Runtime", *, target: str, device: str, graph: Graph, inputs: Sequence[TensorSpec],
            outputs: Sequence[TensorSpec], options: dict[str, Any], compile_seconds: float,
            regions: list[dict[str, Any]] | None = None, pipeline: str | None = None) -> "Artifact":
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "mlcomp_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
            "model": graph.name, "target": target, "device": device, "runtime": runtime.kind.value,
            "inputs": [s.to_json() for s in inputs], "outputs": [s.to_json() for s in outputs],
            "symbols": dict(graph.symbols), "ranges": ranges_json(graph.ranges), "pipeline": pipeline, "options": options,
            "fallback_regions": regions or [], "compile_seconds": round(compile_seconds, 4),
            "verification": None,
            # what the graph's bf16/fp16 nodes imply (mlcomp.analysis.ranges), or the runtime's own
            # math (cuda with tf32: its ``declared_rtol``), the looser of the two; verify's default
            "declared_tolerance": _declared_rtol(graph, runtime),
            # every choice the compile made by timing or by a fixed rule (mlcomp.hardware.decide.Decision)
            "decisions": [dict(d.to_json(), made_by=f"target {target}") for d in runtime_decisions(runtime)],
        }
        return cls(runtime, manifest)

    # -- properties -------------------------------------------------------
    @property
    def runtime(self) -> "Runtime":
        return self._runtime

    @runtime.setter
    def runtime(self, value: "Runtime") -> None:
        self._runtime = value
        self._invoke = value.__call__   # bound once: one attribute lookup less per call
        self._runtime_checks = bool(getattr(value, "checks_inputs", False))

    @property
    def target(self) -> str:
        return self.manifest["target"]

    @property
    def deterministic(self) -> bool:
        """Compiled with ``deterministic=True``: saved without anything time- or path-dependent."""
        return bool((self.manifest.get("options") or {}).get("deterministic"))

    @property
    def decisions(self) -> list[dict[str, Any]]:
        """The choices the compile made (``Decision.to_json()`` records: question, choice, verdict, why)."""
        return list(self.manifest.get("decisions") or [])

    @property
    def compile_seconds(self) -> float:
        return float(self.manifest.get("compile_seconds", 0.0))

    @property
    def verification(self) -> dict[str, Any] | None:
        return self.manifest.get("verification")

    def __repr__(self) -> str:
        ins = ", ".join(str(s) for s in self.inputs)
        return f"<Artifact {self.manifest['model']} target={self.target} ({ins})>"

    # -- running ----------------------------------------------------------
    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self._expect):
            raise InputSpecError(
                f"the artifact takes {len(self.inputs)} input(s) ({', '.join(map(str, self.inputs))}) "
                f"but got {len(inputs)}", hint="pass one tensor per model input")
        if self._runtime_checks:
            # the runtime (ONNX Runtime) rejects wrong shapes/dtypes itself: check only on failure
            if self._ranges:             # but not sizes outside the ranges the artifact was verified for
                self._check_ranges(inputs)
            try:
                out = self._invoke(*inputs)
            except Exception:
                self._check_slow(inputs)
                raise
            return out[0] if len(out) == 1 else out
        # fast path: exact shape and dtype (well under a microsecond); anything else gets the full check
        if len(inputs) == 1:
            shape, dtype = self._expect[0]
            value = inputs[0]
            if shape is None or getattr(value, "shape", None) != shape or value.dtype is not dtype:
                self._check_slow(inputs)
        else:
            for (shape, dtype), value in zip(self._expect, inputs):
                if shape is None or getattr(value, "shape", None) != shape or value.dtype is not dtype:
                    self._check_slow(inputs)
                    break
        out = self._invoke(*inputs)
        return out[0] if len(out) == 1 else out

    def _check_slow(self, inputs: Sequence[torch.Tensor]) -> None:
        for spec, value in zip(self.inputs, inputs):
            problem = spec.fits(value)
            if problem:
                raise InputSpecError(
                    f"input {spec.name} {problem} but the artifact was compiled for {spec}",
                    where=f"{self.target} artifact of {self.manifest['model']}",
                    hint="pass a tensor of that shape and dtype, or compile again for this shape "
                         "(--batch / --input-shape, --dynamic batch,seq for variable sizes)")
        self._check_ranges(inputs)

    def _check_ranges(self, inputs: Sequence[torch.Tensor]) -> None:
        """Each symbolic size inside its range, and the same size wherever one symbol appears."""
        check_sizes(self._ranges, [s.shape for s in self.inputs], [tuple(t.shape) for t in inputs],
                    [s.name for s in self.inputs], where=f"{self.target} artifact of {self.manifest['model']}")

    def random_inputs(self, seed: int = 0) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        return tuple(s.random(self.manifest.get("symbols"), gen) for s in self.inputs)

    # -- verification -----------------------------------------------------
    def set_reference(self, inputs: Sequence[torch.Tensor], expected: Sequence[Any]) -> None:
        """Keep example inputs and eager outputs; saved with the artifact for later checks."""
        self.reference = (tuple(t.detach().cpu() for t in inputs),
                          tuple(e.detach().cpu() if isinstance(e, torch.Tensor) else e for e in expected))

    def verify(self, inputs: Sequence[torch.Tensor] | None = None, expected: Any = None, *,
               tolerance: float | None = None, record: bool = True, raise_on_failure: bool = True):
        """Compare with eager outputs (the stored reference by default); raises VerificationError.

        The artifact runs from the seed eager's reference ran from (:func:`mlcomp.pipeline.seeding.seeded`):
        its random ops (``rand_like``, dropout in a training graph) draw the numbers eager drew."""
        from mlcomp.pipeline.seeding import seeded   # not at import: timing processes never verify

        if inputs is None or expected is None:
            if self.reference is None:
                raise ArtifactError("this artifact has no reference inputs/outputs to verify against",
                                    hint="pass inputs and the eager outputs, or compile with verify=True")
            inputs, expected = self.reference
        if tolerance is None:
            tolerance = (self.manifest.get("options") or {}).get("tolerance")
        if tolerance is None:
            tolerance = self.manifest.get("declared_tolerance")
        with seeded():
            result = check_against(self, expected, inputs, tolerance=tolerance,
                                   names=[s.name for s in self.outputs],
                                   where=f"target {self.target}, model {self.manifest['model']}",
                                   raise_on_failure=False)
        if record:
            self.manifest["verification"] = result.to_json()
        if raise_on_failure:
            result.raise_if_failed(where=f"target {self.target}, model {self.manifest['model']}")
        return result

    # -- persistence ------------------------------------------------------
    def save(self, directory: str | Path, *, force: bool = True) -> Path:
        """Write the artifact folder (atomically); returns its path.

        ``directory`` must be new, empty or an earlier mlcomp output (replaced only with
        ``force``); a folder of anything else is refused with an OutputPathError.
        """
        directory = check_destination(directory, Kind.DIR, force=force)
        with atomic_dir(directory, label="artifact") as tmp:
            info = self.runtime.save(tmp)
            if self.reference is not None:
                torch.save({"inputs": list(self.reference[0]), "expected": list(self.reference[1])},
                           tmp / REFERENCE)
            manifest = dict(self.manifest, runtime_info=info, payload=payload_entries(tmp),
                            reference=REFERENCE if self.reference is not None else None)
            if self.deterministic:
                manifest = stable_manifest(manifest)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
        self.manifest = manifest
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "Artifact":
        """Load a folder written by :meth:`save`; any problem is an :class:`ArtifactError`."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        for entry in manifest["payload"]:
            check_payload_file(directory, entry)
        try:
            kind = RuntimeKind(manifest["runtime"])
        except ValueError:
            raise damaged(directory, f"its runtime {manifest['runtime']!r} is unknown to this mlcomp") from None
        _check_backend(kind, manifest)
        try:
            runtime = kind.runtime_class().load(directory, manifest.get("runtime_info") or {})
        except (ArtifactError, TargetUnavailableError):
            raise
        except ImportError as exc:        # the backend package is present but does not import here
            raise unavailable(manifest, f"importing its package failed ({type(exc).__name__}: "
                                         f"{first_line_of(exc)})") from None
        except Exception as exc:  # noqa: BLE001 - any loader failure is a corrupt or incompatible payload
            raise damaged(directory, f"loading its {kind.value} payload failed: {type(exc).__name__}: "
                                     f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
        reference = None
        if manifest.get("reference"):
            data = torch.load(directory / manifest["reference"], map_location="cpu", weights_only=True)
            reference = (tuple(data["inputs"]), tuple(data["expected"]))
        return cls(runtime, manifest, reference)


def _check_backend(kind: RuntimeKind, manifest: dict[str, Any]) -> None:
    """A clear error when the backend this payload needs is missing here."""
    get_target = resolve_ref(TARGET_LOOKUP)
    reason = get_target(manifest["target"]).available()  # type: ignore[operator]
    if reason and kind is not RuntimeKind.EAGER:
        raise unavailable(manifest, reason)
