"""mlcomp targets: lower an IR graph to something that runs, save it, load it back.

    >>> import torch
    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> from mlcomp.targets import Artifact, CompileOptions, TargetName, available_targets, get_target
    >>> [t.value for t in TargetName]
    ['cpu', 'cuda', 'onnxruntime', 'tvm', 'distributed', 'openvino']
    >>> sorted(available_targets()) == sorted(t.value for t in TargetName)   # each: None, or why not here
    True
    >>> b = GraphBuilder("tiny")
    >>> graph = b.output(b.call(aten("relu"), b.input("x", (2, 8))))
    >>> art = get_target("cpu").compile(graph, CompileOptions())
    >>> x = torch.randn(2, 8)
    >>> torch.equal(art(x), torch.relu(x))
    True
    >>> get_target("tvm").capabilities.describe()
    'modes inference; dtypes f32, f16, bf16, f64, i64, i32, i16, i8, u8, bool; devices cpu, cuda; single device;
     symbolic sizes; mixed precision bf16 (casts in the graph, ...), f16 (casts in the graph, ...)'

``art.save("out/model")`` writes the artifact folder and ``Artifact.load("out/model")`` reads it back.
One subpackage per backend (``torch/``: cpu, cuda; ``onnx/``: onnxruntime; ``tvm/``;
``openvino/``; ``distributed/``), none importing another; what all targets share (``base``,
``registry``, ``capabilities``, ``options``, ``fallback``, ``backend_errors``, ``export``) sits
here.  Target modules are imported only when asked for, and import their heavy backends
lazily inside functions.  The artifact format and the runtimes are :mod:`mlcomp.runtime`;
training steps are :mod:`mlcomp.training`.
"""
from __future__ import annotations

from mlcomp.runtime.artifact import Artifact, TensorSpec
from mlcomp.targets.base import CompileOptions, Fallback, Target, TargetName, available_targets, get_target
from mlcomp.targets.capabilities import Capabilities, CapabilityError, DeviceKind
from mlcomp.targets.options import LogLevel

__all__ = ["Artifact", "TensorSpec", "CompileOptions", "Fallback", "LogLevel", "Target", "TargetName",
           "Capabilities", "CapabilityError", "DeviceKind", "available_targets", "get_target"]
