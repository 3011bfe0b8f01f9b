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
"""
from __future__ import annotations

import json
import os
import weakref

from mlcomp.runtime.manifest import stable_manifest
from mlcomp.targets.tvm.kernels import PACKED_WEIGHTS, register_kernels

__all__ = ["TvmModule", "needs"]

_META = "meta.json"
_LIB = "model.so"
_KERNELS = "kernels.py"                   # the vendor kernels' registration, for a loader without mlcomp


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
        import tvm
        from tvm.runtime.vm import VirtualMachine     # TVM's runtime library is enough (no tvm.relax)

        self._ex = executable
        self.device = device
        self.num_outputs = num_outputs
        self.stats = stats
        self._vm = VirtualMachine(executable, tvm.cpu(0) if device == "cpu" else tvm.cuda(0))
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
        import shutil

        from mlcomp.targets.tvm import kernels as tvm_kernels

        os.makedirs(directory, exist_ok=True)
        self._ex.export_library(os.path.join(directory, _LIB))
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

        The vendor kernels it calls (``stats["kernels"]``) are registered first.
        """
        import tvm

        with open(os.path.join(directory, _META)) as f:
            meta = json.load(f)
        if meta.get("stats", {}).get("kernels", {}).get("kernels"):
            register_kernels()
        lib = tvm.runtime.load_module(os.path.join(directory, _LIB))
        return cls(lib, device, meta["num_outputs"], dict(meta.get("stats", {}), loaded_from=directory))


def _flatten(out, torch):
    """Flatten (possibly nested) tvm-ffi arrays into torch tensors."""
    for o in out:
        if isinstance(o, torch.Tensor):
            yield o
        elif hasattr(o, "__dlpack__"):
            yield torch.from_dlpack(o)
        else:
            yield from _flatten(o, torch)
