"""Model files as trainable, re-exportable ``nn.Module`` s: ExportedPrograms and TorchScript archives.

A ``.pt2`` file holds an ExportedProgram; ``ep.module()`` is a GraphModule whose
``train()``/``eval()`` raise, so the joint (training) capture and a re-export with
a dynamic batch could not take it.  A TorchScript archive's parameters are plain
tensors with ``requires_grad`` (not ``nn.Parameter``), which ``torch.export``
refuses in a module it is to train.  This module turns both into ordinary
modules, without changing the file or the loaded program's graph:

* :func:`program_module`: the program's GraphModule with ``train``/``eval`` that only
  set the flag (the program's ops are fixed at export: a program exported in eval
  mode trains with BatchNorm on its running statistics and without dropout, which
  is what its eager reference computes too);
* :func:`trainable_torchscript`: the archive converted to an ExportedProgram (no
  Python from the file runs), then the same module with the archive's trainable
  tensors registered as ``nn.Parameter`` under their own names;
* :func:`static_program`: a program saved with a dynamic batch, at the example's sizes
  (what targets that build static shapes take when ``--dynamic-batch`` is not given);
* :func:`dynamic_batch_program`: the program itself when its batch is already
  symbolic, else a re-export of its module with dim 0 of every input dynamic; a
  program whose ops fix the batch size is refused, naming what to do.

    >>> from mlcomp.models import mlp
    >>> torch.export.save(torch.export.export(mlp(), (torch.randn(2, 512),)), "mlp.pt2")
    >>> ep = torch.export.load("mlp.pt2")
    >>> model = program_module(ep)           # model.train() works; parameters are the program's
    >>> [n for n, _ in model.named_parameters()][:2]
    ['0.weight', '0.bias']
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from mlcomp.base.errors import CaptureError, InputSpecError
from mlcomp.base.quiet import quiet_torch
from mlcomp.frontend.dynamic import export_dims, parse_dynamic

__all__ = ["batch_is_dynamic", "dynamic_batch_program", "eval_mode_ops", "program_module",
           "static_program", "trainable_torchscript"]

# ops that say a program was captured in eval mode (BatchNorm reading its running statistics)
_EVAL_MODE_OPS = ("_native_batch_norm_legit_no_training",)


def program_module(ep: "torch.export.ExportedProgram") -> nn.Module:
    """``ep.module()`` whose ``train(mode)``/``eval()`` set ``training`` and return it (see the module doc)."""
    module = ep.module(check_guards=False)
    # ExportedProgram.module() binds train/eval on the instance to functions that raise;
    # removing them restores nn.Module's, which only flip flags (the graph does not read them)
    for name in ("train", "eval"):
        module.__dict__.pop(name, None)
    return module


def eval_mode_ops(program: Any) -> list[str]:
    """Names of the ops in ``program`` (an ExportedProgram or a GraphModule) that fix eval-mode behaviour."""
    found = {str(n.target).split(".")[-2] for n in program.graph.nodes if n.op == "call_function" and (
        any(op in str(n.target) for op in _EVAL_MODE_OPS)
        or (str(n.target).startswith("aten.batch_norm") and len(n.args) > 5 and n.args[5] is False))}
    return sorted(found)


def batch_is_dynamic(ep: "torch.export.ExportedProgram") -> bool:
    """Whether dim 0 of every tensor input of ``ep`` is symbolic (the program was exported with a Dim)."""
    user = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    vals = [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder" and n.name in user]
    tensors = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() > 0]
    return bool(tensors) and all(isinstance(v.shape[0], torch.SymInt) for v in tensors)


def dynamic_batch_program(ep: "torch.export.ExportedProgram", inputs: Sequence[torch.Tensor], *,
                          name: str, path: str | None, dims: Any = True) -> "torch.export.ExportedProgram":
    """``ep`` with symbolic sizes (``dims``: :func:`~mlcomp.frontend.dynamic.parse_dynamic`, default the
    batch): itself if it has a symbolic batch and only that is asked, else its module re-exported with them."""
    dims = parse_dynamic(dims)
    if batch_is_dynamic(ep) and [d.dim for d in dims] == [0]:
        return ep
    shapes = export_dims(dims, inputs, name)
    with quiet_torch():
        try:
            return torch.export.export(program_module(ep), tuple(inputs), dynamic_shapes=shapes)
        except Exception as exc:  # noqa: BLE001 - a program whose ops fix the batch size
            failure = exc
    sizes = sorted({int(t.shape[0]) for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0})
    specialised = "specialized" in str(failure) or "Constraints violated" in str(failure)
    raise InputSpecError(
        f"--dynamic-batch: the program in {path or name} was exported with a static batch "
        f"({', '.join(map(str, sizes))}) and "
        + ("its ops fix that size (a reshape or view to a constant shape), so the batch cannot be made dynamic"
           if specialised else f"re-exporting it with a dynamic batch failed: {_first_line(failure)}"),
        where=path or name,
        hint="export the model with a dynamic batch (torch.export.export(model, inputs, dynamic_shapes=("
             "{0: torch.export.Dim('batch')},)), or `mlcomp models save NAME --format pt2 --dynamic-batch`), "
             "or compile without --dynamic-batch") from None


def static_program(ep: "torch.export.ExportedProgram", inputs: Sequence[torch.Tensor], *,
                   name: str, path: str | None = None) -> "torch.export.ExportedProgram":
    """``ep`` at the sizes of ``inputs``: itself if it has no symbolic input size, else re-exported statically.

    A program saved with a dynamic batch then compiles on targets that build static
    shapes (openvino, tvm) as on the others; ``--dynamic-batch`` keeps the symbol.
    """
    user = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    symbolic = any(isinstance(d, torch.SymInt) for n in ep.graph.nodes
                   if n.op == "placeholder" and n.name in user and isinstance(n.meta.get("val"), torch.Tensor)
                   for d in n.meta["val"].shape)
    if not symbolic:
        return ep
    with quiet_torch():
        try:
            return torch.export.export(program_module(ep), tuple(inputs))
        except Exception as exc:  # noqa: BLE001 - the example does not fit the program's ranges
            failure = exc
    raise InputSpecError(f"the program {name} does not run on example inputs of shape "
                         + ", ".join("x".join(map(str, t.shape)) for t in inputs) + f": {_first_line(failure)}",
                         where=path or name, hint="give --input-shape sizes inside the ranges the program was exported "
                                          "with, or pass --dynamic-batch to keep its batch symbolic") from None


def trainable_torchscript(module: Any, inputs: Sequence[torch.Tensor], *, name: str,
                          path: str | None) -> nn.Module:
    """A TorchScript module as an ``nn.Module`` whose trainable tensors are ``nn.Parameter`` s.

    The archive is converted to an ExportedProgram (which lifts every tensor as a
    buffer); the tensors that are parameters with ``requires_grad`` in the archive
    become parameters again, under the same names; the rest stay buffers.
    """
    from torch._export.converter import TS2EPConverter

    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    with quiet_torch():
        try:
            ep = TS2EPConverter(module, tuple(inputs)).convert()
        except Exception as exc:  # noqa: BLE001 - a converter gap (control flow, an unknown op)
            raise CaptureError(
                f"TorchScript model {name} cannot be converted to a trainable program: {_first_line(exc)}",
                where=path or name,
                hint="save the model with torch.export.save (.pt2) and train that file, or give a factory "
                     "file.py:fn returning the Python module") from None
    model = program_module(ep)
    for qualified in trainable:
        owner_path, _, leaf = qualified.rpartition(".")
        owner = model.get_submodule(owner_path) if owner_path else model
        tensor = owner._buffers.pop(leaf, None)
        if tensor is None:   # not lifted (unused by forward): nothing reads it, nothing to train
            continue
        owner.register_parameter(leaf, nn.Parameter(tensor.detach(), requires_grad=True))
    return model


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(exc).__name__
