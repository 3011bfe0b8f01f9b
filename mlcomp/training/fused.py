"""Optimizer in the backward: each parameter is updated as soon as its gradient is complete.

The unfused step returns every gradient from the generated code and then runs
the optimizer, so all gradients coexist at the end of the backward, on top of
whatever the backward still holds.  The fused step generates the same code with
one call of the op ``mlcomp::param_update(param, grad)`` per parameter after its
update point (:func:`mlcomp.analysis.step_peak.update_points`: the later of the
node completing its gradient and the parameter's last reader), and returns
``None`` in the gradient's output slot, so the gradient dies right after its
update::

    mm_5 = torch.ops.aten.mm(permute_7, relu_1)
    permute_9 = torch.ops.aten.permute(mm_5, [1, 0])
    layer2_weight = self.layer2_weight
    ops.mlcomp.param_update(layer2_weight, permute_9)   # one optimizer step on that parameter alone
    ...
    return (loss, None, None, ..., new_running_mean)

The op is registered with torch's dispatcher when this module is imported, so the
fused step is TorchScript: it is saved as such and reloads fused, with nothing in
the folder running Python code.  The op looks up the :class:`ParamUpdate` bound to
its parameter (by the tensor's identity): the artifact's own ``torch.optim``
optimizer class over that one parameter (foreach, as the unfused step), sharing the
main optimizer's state dict, so every update does exactly the arithmetic of the
unfused step and parameters stay bit-identical.  Optimizers that need all gradients
before any update (a loss scaler's inf/NaN check, gradient clipping) cannot be fused.
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch
from torch import fx

from mlcomp.analysis.step_peak import grad_params, update_points
from mlcomp.base.errors import MlcompError
from mlcomp.base.quiet import quiet_torch
from mlcomp.ir import Graph
from mlcomp.runtime.codegen import param_names, to_fx
from mlcomp.runtime.optim import OptimizerSpec

__all__ = ["ParamUpdate", "bind_updates", "fused_module", "fused_step", "param_update", "scripted"]

_BOUND: weakref.WeakValueDictionary[int, ParamUpdate] = weakref.WeakValueDictionary()


@torch.library.custom_op("mlcomp::param_update", mutates_args=("param",))
def param_update(param: torch.Tensor, grad: torch.Tensor) -> None:
    """One optimizer step of ``param`` with ``grad`` as its gradient (the update bound to ``param``)."""
    update = _BOUND.get(param._cdata)
    if update is None:
        raise MlcompError("a fused training step updated a parameter no optimizer is bound to",
                          hint="run the step through its TrainingArtifact (mlcomp.load), not the bare module")
    update(grad)


class ParamUpdate:
    """``update(grad)``: one optimizer step of one parameter with ``grad`` as its gradient."""

    def __init__(self, name: str, param: torch.Tensor, spec: OptimizerSpec, main: torch.optim.Optimizer) -> None:
        self.name, self.param, self.main = name, param, main
        self.optimizer = spec.build([param])
        _BOUND[param._cdata] = self

    def __call__(self, grad: torch.Tensor) -> None:
        self.optimizer.state = self.main.state      # shared (load_state_dict replaces the main one's dict)
        self.param.grad = grad
        self.optimizer.step()
        self.param.grad = None

    def __repr__(self) -> str:
        return f"update({self.name})"


def fused_module(graph: Graph, *, device: str, grad_slots: Mapping[str, int], scriptable: bool = False
                 ) -> fx.GraphModule:
    """The step's code with each parameter's update at its update point and its gradient slot ``None``
    (``grad_slots``: parameter → its output position)."""
    grads = grad_params(graph)
    after: dict[str, list] = {}
    for param, point in update_points(graph).items():
        after.setdefault(point, []).append((torch.ops.mlcomp.param_update, (param, grads[param])))
    return to_fx(graph, device=device, honour_placement=False, scriptable=scriptable, after=after,
                 drop_outputs=set(grad_slots.values()))


def bind_updates(module: torch.nn.Module, attrs: Mapping[str, str], tensors: Mapping[str, torch.Tensor],
                 params: Mapping[str, torch.Tensor], spec: OptimizerSpec,
                 main: torch.optim.Optimizer) -> list[ParamUpdate]:
    """Make ``module`` (fx code or TorchScript) read the artifact's own tensors (``attrs``: attribute →
    dotted name) and bind an update to each parameter of ``params``: a one-parameter optimizer sharing
    ``main``'s state.  The caller keeps the updates (they are bound while it holds them)."""
    for attr, dotted in attrs.items():
        if isinstance(module, torch.jit.ScriptModule):
            setattr(module, attr, tensors[dotted])
        else:
            table = module._parameters if attr in module._parameters else module._buffers
            table[attr] = tensors[dotted]
    return [ParamUpdate(name, param, spec, main) for name, param in params.items()]


def fused_step(graph: Graph, device: str, grad_slots: Mapping[str, int], tensors: Mapping[str, torch.Tensor],
               spec: OptimizerSpec, main: torch.optim.Optimizer, *, scaled: bool, script: bool = True
               ) -> tuple[torch.nn.Module, dict[str, str], list[ParamUpdate]]:
    """``(module, attrs, updates)``: the fused step of a training artifact (TorchScript when it compiles,
    else fx code) over the artifact's ``tensors``; a loss-scaled step is refused: its scaler checks every
    gradient for inf/NaN before any update."""
    if scaled:
        raise MlcompError(f"the training step of {graph.name} cannot update parameters inside the backward with "
                          "loss scaling: the scaler checks every gradient for inf/NaN before any update",
                          hint="drop update_in_backward or the loss scale")
    gm = fused_module(graph, device=device, grad_slots=grad_slots, scriptable=script)
    attrs = param_names(gm)
    module = (scripted(gm) if script else None) or fused_module(graph, device=device, grad_slots=grad_slots)
    params = {p: tensors[p] for p in grad_slots}
    return module, attrs, bind_updates(module, attrs, tensors, params, spec, main)


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
