"""mlcomp targets: lower an IR graph to something that runs, save it, load it back.

    >>> from mlcomp.targets import get_target, available_targets, CompileOptions
    >>> available_targets()
    {'cpu': None, 'cuda': 'no CUDA device (torch.cuda.is_available() is False)', ...}
    >>> art = get_target("cpu").compile(graph, CompileOptions())
    >>> art.save("out/model"); Artifact.load("out/model")
    >>> get_target("tvm").capabilities.describe()
    'modes inference; dtypes f32, f16, bf16, …; devices cpu, cuda; single device; static shapes only'

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
