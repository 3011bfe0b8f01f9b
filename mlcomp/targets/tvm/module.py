"""A built TVM module: the Relax VM executable, how it is called from torch, saved and loaded.

Saved as a folder: ``model.so`` (TIR kernels, VM bytecode and the weights baked in as constants) and
``meta.json`` (outputs, device, the build's stats, and ``needs``: what loading it takes).  A module
built with ``kernels=False`` (pure TVM) needs TVM's runtime alone, no torch and no mlcomp::

    import numpy as np, tvm
    from tvm import relax
    vm = relax.VirtualMachine(tvm.runtime.load_module("model.so"), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(np.ones((1, 3, 32, 32), "float32"))).numpy()

A module that calls torch's kernels also gets ``kernels.py`` (a copy of :mod:`mlcomp.targets.tvm.kernels`,
which imports only torch and tvm_ffi): it needs torch, and
``runpy.run_path("kernels.py")["register_kernels"]()`` before loading.

:meth:`TvmModule.load` of a CPU module in a process that has not imported ``tvm`` loads TVM's
runtime libraries (``libtvm_runtime``, ``libtvm_runtime_extra``) and the file through ``tvm_ffi``
alone: the VM, its bytecode and kernels are all there, and ``import tvm`` (the compiler's Python
package, most of a load's CPU time) is not needed.  With ``tvm`` imported, or for CUDA, TVM's own
loader runs.  Either way the VM is started as ``tvm.runtime.vm.VirtualMachine`` starts it
(:func:`start_vm`: ``vm_load_executable``, then ``vm_initialization`` with the pooled allocator).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import sys
import weakref
from pathlib import Path

from mlcomp.runtime.manifest import stable_manifest
from mlcomp.targets.tvm.kernels import PACKED_WEIGHTS, register_kernels

__all__ = ["TvmModule", "load_library", "needs", "start_vm"]

_META = "meta.json"
_LIB = "model.so"
_KERNELS = "kernels.py"                   # the vendor kernels' registration, for a loader without mlcomp
# DLPack device types and TVM's VM allocator kinds (tvm.runtime.vm.VirtualMachine's constants)
_DEVICE_TYPES = {"cpu": 1, "cuda": 2}
_POOLED_ALLOCATOR = 2


def needs(stats: dict) -> list[str]:
    """What loading a saved module with these build ``stats`` takes, besides its files (``meta.json["needs"]``)."""
    if stats.get("kernels", {}).get("kernels"):
        return ["apache-tvm", "torch", f"{_KERNELS} registered first (its register_kernels())"]
    return ["apache-tvm"]


class TvmModule:
    """A compiled Relax VM program: torch tensors in, tuple of torch tensors out.

    Inputs must match the example shapes/dtypes/device (the VM checks and raises).
    Tensors cross via DLPack without copies; tvm-ffi hands results back as torch
    tensors directly when the arguments were torch tensors.
    """

    def __init__(self, executable, device: str, num_outputs: int, stats: dict):
        import torch

        self._ex = executable
        self.device = device
        self.num_outputs = num_outputs
        self.stats = stats
        self._vm = start_vm(executable, device)
        self._main = self._vm["main"]  # resolve the packed function once
        self._torch = torch
        # the oneDNN-packed conv weights this module's kernels use stay cached while it lives
        keys = [int(k) for k in stats.get("packed_weight_keys", ())]
        if keys:
            PACKED_WEIGHTS.hold(keys)
            weakref.finalize(self, PACKED_WEIGHTS.release, keys)

    def __call__(self, *inputs):
        """Run the model and return a tuple of torch tensors."""
        torch = self._torch
        out = self._main(*[x if x.is_contiguous() else x.contiguous() for x in inputs])
        if self.num_outputs == 1:
            return (out if isinstance(out, torch.Tensor) else torch.from_dlpack(out),)
        return tuple(_flatten(out, torch))

    def save(self, directory: str, *, stable: bool = False) -> list[str]:
        """Write ``model.so`` (kernels + VM bytecode + baked weights) and ``meta.json``.

        ``stable``: ``meta.json`` leaves out what differs between two identical builds (durations,
        paths: :func:`~mlcomp.runtime.manifest.stable_manifest`), as a deterministic compile saves it.

        A module that calls vendor kernels also gets ``kernels.py``, a copy of
        :mod:`mlcomp.targets.tvm.kernels` (it imports only torch and tvm_ffi): with only TVM's
        runtime and torch, ``runpy.run_path("kernels.py")["register_kernels"]()`` before
        ``tvm.runtime.load_module("model.so")`` runs the model without mlcomp.
        """
        from mlcomp.targets.tvm import kernels as tvm_kernels

        os.makedirs(directory, exist_ok=True)
        lib = os.path.join(directory, _LIB)
        loaded = self.stats.get("loaded_from")
        if loaded is not None:         # a loaded library is the file it came from (tvm_ffi's has no exporter)
            if not os.path.exists(lib) or not os.path.samefile(os.path.join(loaded, _LIB), lib):
                shutil.copyfile(os.path.join(loaded, _LIB), lib)
        else:
            self._ex.export_library(lib)
        stats = {k: v for k, v in self.stats.items() if k != "loaded_from"}     # where this process loaded it
        meta = {"device": self.device, "num_outputs": self.num_outputs, "needs": needs(self.stats),
                "stats": stable_manifest(stats) if stable else stats}
        with open(os.path.join(directory, _META), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        files = [_LIB, _META]
        if self.stats.get("kernels", {}).get("kernels"):
            shutil.copyfile(tvm_kernels.__file__, os.path.join(directory, _KERNELS))
            files.append(_KERNELS)
        return files

    @classmethod
    def load(cls, directory: str, device: str = "cpu") -> "TvmModule":
        """Load a saved module; needs only the TVM runtime (no torch model, no compiler passes).

        The vendor kernels it calls (``stats["kernels"]``) are registered first; the file is loaded by
        :func:`load_library`.
        """
        import tvm_ffi  # noqa: F401 - the runtime any load needs, before any file: its absence is the environment's

        with open(os.path.join(directory, _META)) as f:
            meta = json.load(f)
        if meta.get("stats", {}).get("kernels", {}).get("kernels"):
            register_kernels()
        lib = load_library(os.path.join(directory, _LIB), device)
        return cls(lib, device, meta["num_outputs"], dict(meta.get("stats", {}), loaded_from=directory))


def load_library(path: str, device: str = "cpu"):
    """The exported library at ``path`` as a TVM runtime module: through ``tvm_ffi`` and TVM's runtime
    libraries when ``tvm`` is not imported and ``device`` is the CPU, else by ``tvm.runtime.load_module``."""
    if device != "cpu" or "tvm" in sys.modules:
        import tvm

        return tvm.runtime.load_module(path)
    import tvm_ffi

    _runtime_libraries()
    return tvm_ffi.load_module(os.path.realpath(path))


@functools.lru_cache(maxsize=1)
def _runtime_libraries() -> tuple:
    """Load ``libtvm_runtime`` (global: an exported library resolves TVM's runtime symbols there) and
    ``libtvm_runtime_extra`` (its registered functions) from where ``import tvm`` finds them, without
    importing ``tvm``: its ``libinfo`` module (which imports only ``tvm_ffi``) is run on its own."""
    from tvm_ffi.libinfo import load_lib_ctypes

    spec = importlib.util.find_spec("tvm")
    if spec is None or spec.origin is None:
        raise ImportError("the apache-tvm package is not installed (pip install apache-tvm)")
    info_spec = importlib.util.spec_from_file_location("_mlcomp_tvm_libinfo", Path(spec.origin).parent / "libinfo.py")
    info = importlib.util.module_from_spec(info_spec)
    info_spec.loader.exec_module(info)
    paths = info.package_lib_paths()
    return (load_lib_ctypes("tvm", "tvm_runtime", "RTLD_GLOBAL", extra_lib_paths=paths),
            load_lib_ctypes("tvm", "tvm_runtime_extra", "RTLD_LOCAL", extra_lib_paths=paths))


def start_vm(executable, device: str):
    """The Relax VM of ``executable`` (a runtime module, or a built ``tvm.runtime.Executable``, jitted) on
    ``device``, started as ``tvm.runtime.vm.VirtualMachine`` starts it: every device (the CPU last, for
    shape functions) with the pooled allocator."""
    import tvm_ffi

    module = executable if isinstance(executable, tvm_ffi.Module) else executable.jit()
    vm = module["vm_load_executable"]()
    args = []
    for kind in dict.fromkeys([device, "cpu"]):
        args += [_DEVICE_TYPES[kind], 0, _POOLED_ALLOCATOR]
    vm["vm_initialization"](*args)
    return vm


def _flatten(out, torch):
    """Flatten (possibly nested) tvm-ffi arrays into torch tensors."""
    for o in out:
        if isinstance(o, torch.Tensor):
            yield o
        elif hasattr(o, "__dlpack__"):
            yield torch.from_dlpack(o)
        else:
            yield from _flatten(o, torch)
