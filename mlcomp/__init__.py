"""mlcomp: a declarative model-compiler pipeline for PyTorch.

    >>> import mlcomp, torch
    >>> model, x = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval(), torch.randn(2, 8)
    >>> art = mlcomp.compile(model, (x,), target="cpu", pipeline="-O2")
    >>> y = art(x)                   # torch tensors in, torch tensors out
    >>> art.verification["passed"], y.shape          # compared with eager on the example inputs
    (True, torch.Size([2, 4]))
    >>> _ = art.save("out/")
    >>> torch.equal(mlcomp.load("out/")(x), y)
    True

Heavy pieces import lazily: ``import mlcomp`` does not import tvm or onnxruntime.
"""
from __future__ import annotations

from typing import Any

from mlcomp.base.errors import MlcompError
from mlcomp.base.version import __version__

__all__ = ["MlcompError", "capture", "compile", "compile_generator", "load", "load_generator", "export",
           "__version__"]


def capture(model: Any, example_inputs: Any = None, **kwargs: Any):
    """Capture a model (module, file or zoo name) into a :class:`mlcomp.ir.graph.Graph`."""
    from mlcomp.frontend.loading import load_model

    source = load_model(model, example_inputs=example_inputs,
                        trust_pickle=kwargs.pop("trust_pickle", False))
    return source.capture(**kwargs)


def __getattr__(name: str) -> Any:
    if name in ("compile", "load", "export"):
        from mlcomp import api

        return getattr(api, name)
    if name in ("compile_generator", "load_generator"):     # decoder LMs: mlcomp.api.generate
        from mlcomp.api import generate

        return getattr(generate, name)
    raise AttributeError(name)
