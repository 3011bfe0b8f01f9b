"""Optimizer in the backward: each parameter is updated as soon as its gradient is complete.

The unfused step returns every gradient from the generated code and then runs
the optimizer, so all gradients coexist at the end of the backward, on top of
whatever the backward still holds.  The fused step generates the same code with
one call per parameter after its update point
(:func:`mlcomp.analysis.step_peak.update_points`: the later of the node
completing its gradient and the parameter's last reader), and returns ``None``
in the gradient's output slot, so the gradient dies right after its update::

    mm_5 = torch.ops.aten.mm.default(permute_7, relu_1)
    permute_9 = torch.ops.aten.permute.default(mm_5, [1, 0])
    update_layer2_weight(permute_9)        # p.grad = g; optimizer step on p alone; p.grad = None
    ...
    return (loss, None, None, ..., new_running_mean)

Each update is the artifact's own ``torch.optim`` optimizer class over that one
parameter (foreach, as the unfused step), sharing the main optimizer's state
dict, so the main optimizer's ``state_dict`` is the step's and every update does
exactly the arithmetic of the unfused step: parameters stay bit-identical.
Optimizers that need all gradients before any update (a loss scaler's inf/NaN
check, gradient clipping) cannot be fused.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import fx

from mlcomp.analysis.step_peak import grad_params, update_points
from mlcomp.base.errors import MlcompError
from mlcomp.base.quiet import quiet_torch
from mlcomp.ir import Graph
from mlcomp.runtime.codegen import to_fx
from mlcomp.runtime.optim import OptimizerSpec

__all__ = ["ParamUpdate", "bind_updates", "fused_module", "fused_step", "scripted"]


class ParamUpdate:
    """``update(grad)``: one optimizer step of one parameter with ``grad`` as its gradient."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.__name__ = self.__qualname__ = "update_" + re.sub(r"\W", "_", name)   # fx names the call after it
        self.param: torch.Tensor | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.main: torch.optim.Optimizer | None = None

    def bind(self, param: torch.Tensor, spec: OptimizerSpec, main: torch.optim.Optimizer) -> None:
        self.param, self.optimizer, self.main = param, spec.build([param]), main

    def __call__(self, grad: torch.Tensor) -> None:
        assert self.param is not None and self.optimizer is not None and self.main is not None
        self.optimizer.state = self.main.state      # shared (load_state_dict replaces the main one's dict)
        self.param.grad = grad
        self.optimizer.step()
        self.param.grad = None

    def __repr__(self) -> str:
        return f"update({self.name})"


def fused_module(graph: Graph, *, device: str, grad_slots: Mapping[str, int]) -> tuple[fx.GraphModule,
                                                                                        dict[str, ParamUpdate]]:
    """The step's code with each parameter's update at its update point and its gradient slot ``None``
    (``grad_slots``: parameter → its output position); the updates are bound later (:func:`bind_updates`)."""
    grads = grad_params(graph)
    updates = {p: ParamUpdate(p) for p in grads}
    after: dict[str, list] = {}
    for param, point in update_points(graph).items():
        after.setdefault(point, []).append((updates[param], grads[param]))
    gm = to_fx(graph, device=device, honour_placement=False, after=after, drop_outputs=set(grad_slots.values()))
    return gm, updates


def bind_updates(gm: fx.GraphModule, updates: Mapping[str, ParamUpdate], attrs: Mapping[str, str],
                 tensors: Mapping[str, torch.Tensor], spec: OptimizerSpec, main: torch.optim.Optimizer) -> None:
    """Make ``gm`` read the artifact's own tensors (``attrs``: attribute → dotted name) and bind each update
    to its parameter and a one-parameter optimizer sharing ``main``'s state."""
    for attr, dotted in attrs.items():
        table = gm._parameters if attr in gm._parameters else gm._buffers
        table[attr] = tensors[dotted]
    for name, update in updates.items():
        update.bind(tensors[name], spec, main)


def fused_step(graph: Graph, device: str, grad_slots: Mapping[str, int], attrs: Mapping[str, str],
               tensors: Mapping[str, torch.Tensor], spec: OptimizerSpec, main: torch.optim.Optimizer, *,
               scaled: bool) -> fx.GraphModule:
    """The fused step of a training artifact (:func:`fused_module`, then :func:`bind_updates`); a loss-scaled
    step is refused: its scaler checks every gradient for inf/NaN before any update."""
    if scaled:
        raise MlcompError(f"the training step of {graph.name} cannot update parameters inside the backward with "
                          "loss scaling: the scaler checks every gradient for inf/NaN before any update",
                          hint="drop update_in_backward or the loss scale")
    gm, updates = fused_module(graph, device=device, grad_slots=grad_slots)
    bind_updates(gm, updates, attrs, tensors, spec, main)
    return gm


def scripted(module: torch.nn.Module) -> torch.jit.ScriptModule | None:
    """The generated step scripted (``None`` when TorchScript cannot compile it: the fx code runs).

    TorchScript runs the whole step in its interpreter instead of one Python call per
    node; run with ``optimized_execution(False)`` it calls the same kernels in the same
    order, so results stay bitwise those of the fx code, without a Python call per node."""
    with quiet_torch():
        try:
            return torch.jit.script(module)
        except Exception:  # noqa: BLE001 - an op TorchScript cannot call: keep the fx code
            return None
