"""A compiled training step: joint IR graph → generated torch code + an optimizer.

    >>> art = compile_training(joint_graph, target="cpu", optimizer="sgd{lr=0.05 momentum=0.9}",
    ...                        state_keys=list(model.state_dict()))
    >>> loss = art.step(x, y)               # forward, loss, backward, optimizer, buffer updates
    >>> art.state_dict().keys() == model.state_dict().keys()
    True

The joint graph's outputs are ``(%loss, %grad:<param>…, %new:<buffer>…)``
(:mod:`mlcomp.frontend.joint`).  :func:`mlcomp.targets.codegen.to_fx` turns the
graph into a ``GraphModule`` whose attributes are the artifact's own copies of
the parameters and buffers; ``step`` runs it without autograd, hands the
gradients to a ``torch.optim`` optimizer (foreach) over those same tensors, and
copies the new buffer values (BatchNorm running statistics) into the buffers.

Only targets whose :class:`~mlcomp.targets.base.Target` runs torch code (``cpu``,
``cuda``) run training graphs; ``onnxruntime`` and ``tvm`` are refused with a
capability message before anything is built.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mlcomp.base.errors import MlcompError, TargetUnavailableError, UnsupportedOpError
from mlcomp.ir import Graph, Mode
from mlcomp.targets.base import CompileOptions, get_target, target_name
from mlcomp.targets.capabilities import (
    Capabilities,
    CapabilityError,
    DeviceKind,
    hint_for,
    mismatches,
)
from mlcomp.targets.codegen import param_names, to_fx
from mlcomp.targets.optim import OptimizerSpec

__all__ = [
    "GRAD",
    "NEW",
    "TRAINING_CAPABILITIES",
    "TRAINING_TARGETS",
    "TrainingArtifact",
    "TrainingCapabilityError",
    "check_training_target",
    "compare_steps",
    "compile_training",
    "verify_gradients",
]

GRAD = "grad:"     # the joint graph's output names (mlcomp.frontend.joint)
NEW = "new:"
_NAMES = "names"   # output node attribute holding them in output order (mlcomp.frontend.joint)


def output_names(graph: Graph) -> list[str]:
    names = graph.output_node.attrs.get(_NAMES)
    return list(names) if names is not None else [r.name for r in graph.output_refs]
TRAINING_TARGETS = ("cpu", "cuda")
GRAD_FLOOR = 1e-3   # see verify_gradients


class TrainingCapabilityError(UnsupportedOpError):
    """The chosen target cannot run training graphs."""


# The training step runs generated torch code (the TrainingArtifact below), so what a training
# graph needs of a target is declared here, per target that runs torch programs.
TRAINING_CAPABILITIES: Mapping[str, Capabilities] = {
    "cpu": Capabilities(modes=frozenset({Mode.TRAINING}), devices=frozenset({DeviceKind.CPU})),
    "cuda": Capabilities(modes=frozenset({Mode.TRAINING}), devices=frozenset({DeviceKind.CUDA})),
}


def training_capabilities(target: Any) -> Capabilities | None:
    """The capabilities under which ``target`` runs training graphs (``None``: it cannot)."""
    if target.name in TRAINING_CAPABILITIES:
        return TRAINING_CAPABILITIES[target.name]
    caps = getattr(target, "capabilities", None)
    return caps if caps is not None and Mode.TRAINING in caps.modes else None


def check_training_target(name: str) -> Any:
    """The target object for ``name``; :class:`TrainingCapabilityError` if it cannot train (checked
    before anything is captured or written)."""
    target = get_target(target_name(name))
    if training_capabilities(target) is None:
        caps = getattr(target, "capabilities", None)
        declared = f" (it declares: {caps.describe()})" if caps is not None else ""
        raise TrainingCapabilityError(
            f"target {target.name} cannot compile training graphs: it compiles inference graphs only, "
            f"with no backward pass or parameter update{declared}",
            hint=f"compile with --train for one of: {', '.join(TRAINING_TARGETS)}; then export the trained "
                 f"weights and compile for {target.name} without --train")
    reason = target.available()
    if reason:
        raise TargetUnavailableError(f"target {target.name} is not available: {reason}",
                                     hint="see `mlcomp targets` for the targets this machine can use")
    return target


class TrainingArtifact:
    """``step(*inputs, y) -> loss`` over its own parameters; ``state_dict``/``load_state_dict``."""

    def __init__(self, graph: Graph, optimizer: OptimizerSpec, *, device: str,
                 state_keys: Sequence[str] | None = None,
                 extra_state: Mapping[str, torch.Tensor] | None = None, target: str = "cpu") -> None:
        if graph.mode is not Mode.TRAINING:
            raise TrainingCapabilityError(f"graph {graph.name} is an inference graph, not a joint training graph",
                                          hint="capture it with mode='train'")
        own = graph.copy()
        own.constants = {k: v.detach().to(device).clone() for k, v in graph.constants.items()}
        self.graph = own
        self.target = target
        self.device = device
        self.optimizer_spec = optimizer
        self.module = to_fx(own, device=device, honour_placement=False)
        names = param_names(self.module)
        tensors = {dotted: getattr(self.module, attr) for attr, dotted in names.items()}
        outs = output_names(own)
        self._grad_index = {n[len(GRAD):]: i for i, n in enumerate(outs) if n.startswith(GRAD)}
        self._new_index = {n[len(NEW):]: i for i, n in enumerate(outs) if n.startswith(NEW)}
        self.params: dict[str, torch.Tensor] = {p: tensors[p] for p in self._grad_index}
        self.buffers: dict[str, torch.Tensor] = {b: tensors[b] for b in self._new_index}
        self._tensors = tensors
        self._extra = {k: v.detach().to(device).clone() for k, v in (extra_state or {}).items()}
        keys = list(state_keys) if state_keys is not None else list(tensors)
        self._state_keys = [k for k in keys if k in tensors or k in self._extra]
        self.optimizer = optimizer.build(self.params.values())
        self.steps = 0
        self.verification: dict[str, Any] | None = None

    # -- running ------------------------------------------------------------
    def _run(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        inputs = tuple(t.to(self.device) for t in inputs)
        with torch.no_grad():
            return self.module(*inputs)

    def gradients(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, {param: grad})`` for one batch without updating anything (the last input is ``y``)."""
        outs = self._run(inputs)
        return outs[0], {p: outs[i] for p, i in self._grad_index.items()}

    def step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One training step on a batch (the last argument is the loss's target); returns the loss."""
        outs = self._run(inputs)
        for p, i in self._grad_index.items():
            self.params[p].grad = outs[i]
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None
        with torch.no_grad():
            for b, i in self._new_index.items():
                self.buffers[b].copy_(outs[i])
        self.steps += 1
        return outs[0].detach()

    __call__ = step

    # -- state --------------------------------------------------------------
    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """Parameters and buffers under the user's module's keys (tensors are live: clone to keep)."""
        return OrderedDict((k, self._tensors[k] if k in self._tensors else self._extra[k])
                           for k in self._state_keys)

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        missing = [k for k in self._state_keys if k not in state]
        unexpected = [k for k in state if k not in self._state_keys]
        if missing or unexpected:
            raise MlcompError("the state dict does not fit this training artifact: "
                              + (f"missing {', '.join(missing[:5])}" if missing else "")
                              + ("; " if missing and unexpected else "")
                              + (f"unexpected {', '.join(unexpected[:5])}" if unexpected else ""),
                              hint="load a state dict saved from the same model (model.state_dict())")
        with torch.no_grad():
            for k in self._state_keys:
                dest = self._tensors[k] if k in self._tensors else self._extra[k]
                if tuple(state[k].shape) != tuple(dest.shape):
                    raise MlcompError(f"state {k} has shape {tuple(state[k].shape)}, the artifact's has "
                                      f"{tuple(dest.shape)}", hint="load a state dict of the same model")
                dest.copy_(state[k])

    def __repr__(self) -> str:
        return (f"<TrainingArtifact {self.graph.name} on {self.target} ({self.device}): "
                f"{len(self.params)} params, {self.optimizer_spec.text()}, {self.steps} steps>")


def compile_training(graph: Graph, *, target: str = "cpu", optimizer: str | OptimizerSpec = "sgd",
                     options: CompileOptions | None = None, state_keys: Sequence[str] | None = None,
                     extra_state: Mapping[str, torch.Tensor] | None = None) -> TrainingArtifact:
    """Lower a joint training graph on ``target`` (``cpu`` or ``cuda``) with ``optimizer``."""
    spec = OptimizerSpec.parse(optimizer)
    t = check_training_target(target)
    options = options or CompileOptions()
    device = options.device or t.default_device
    problems = mismatches(training_capabilities(t), t.name, graph, device)
    if problems:
        raise CapabilityError(t.name, graph, problems, hint_for(problems))
    t.check(graph)
    return TrainingArtifact(graph, spec, device=device, state_keys=state_keys, extra_state=extra_state,
                            target=t.name)


# ---------------------------------------------------------------------------
# Verification against eager autograd


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    diff = (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item() if a.numel() else 0.0
    scale = b.detach().double().abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def eager_loss(model: torch.nn.Module, loss_fn: Any, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    from mlcomp.frontend.joint import model_output

    if loss_fn is None:
        return model_output(model(*inputs))
    return loss_fn(model_output(model(*inputs[:-1])), inputs[-1])


def verify_gradients(art: TrainingArtifact, model: torch.nn.Module, loss_fn: Any,
                     inputs: Sequence[torch.Tensor], tolerance: float = 1e-5) -> dict[str, Any]:
    """Per-parameter max abs / relative gradient error vs eager autograd on one batch (nothing updated).

    Relative error is ``max|compiled - eager| / max(max|eager|, GRAD_FLOOR * G)`` with ``G`` the
    largest gradient entry of the model.

    ``inputs`` end with the loss's target unless ``loss_fn`` is ``None``.  Raises
    :class:`~mlcomp.base.errors.VerificationError` naming the worst parameter.
    """
    import copy

    from mlcomp.base.errors import VerificationError

    ref = copy.deepcopy(model).train(True).to(art.device)
    args = [t.to(art.device) for t in inputs]
    loss, grads = art.gradients(*args)
    expected = eager_loss(ref, loss_fn, args)
    expected.backward()
    pairs = {name: (grads[name], p.grad) for name, p in ref.named_parameters() if name in grads and p.grad is not None}
    # a gradient that is mathematically zero (an attention key bias: softmax ignores a constant
    # added to every score) is rounding noise on both sides; it is compared against a floor of
    # GRAD_FLOOR times the model's largest gradient entry instead of against its own size
    floor = GRAD_FLOOR * max((b.detach().abs().max().item() for _, b in pairs.values() if b.numel()), default=0.0)
    rows = {}
    for name, (a, b) in pairs.items():
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        scale = max(b.detach().abs().max().item() if b.numel() else 0.0, floor)
        rows[name] = {"max_abs": diff, "rel": diff / scale if scale > 0 else diff}
    worst = max(rows, key=lambda k: rows[k]["rel"]) if rows else None
    result = {"loss": loss.item(), "eager_loss": expected.item(), "loss_rel": _rel(loss, expected),
              "params": rows, "worst": worst, "worst_rel": rows[worst]["rel"] if worst else 0.0,
              "tolerance": tolerance}
    result["passed"] = result["worst_rel"] <= tolerance and result["loss_rel"] <= tolerance
    art.verification = result
    if not result["passed"]:
        raise VerificationError(
            f"the compiled training step of {art.graph.name} disagrees with eager autograd: gradient of "
            f"{worst} differs by {result['worst_rel']:.2e} relative (loss {result['loss_rel']:.2e}), "
            f"tolerance {tolerance:.0e}",
            hint="run with --verify to find the first diverging node of the joint graph, or raise --tolerance")
    return result


def compare_steps(art: TrainingArtifact, model: torch.nn.Module, loss_fn: Any,
                  inputs: Sequence[torch.Tensor], steps: int = 5) -> dict[str, Any]:
    """Run ``steps`` compiled steps and ``steps`` eager steps (same optimizer spec) on one batch.

    Returns the losses of both, the norm-wise relative difference of the whole state
    (``global_rel``: ``||compiled - eager|| / ||eager||`` over every float tensor) and,
    for information, the worst per-tensor ``max|Δ| / max|eager|`` and its key; the
    artifact and ``model`` both advance (pass copies to keep them).
    """
    model.train(True)
    opt = art.optimizer_spec.build(p for p in model.parameters() if p.requires_grad)
    args = [t.to(art.device) for t in inputs]
    compiled, eager = [], []
    for _ in range(steps):
        compiled.append(art.step(*args).item())
        opt.zero_grad(set_to_none=True)
        loss = eager_loss(model, loss_fn, args)
        loss.backward()
        opt.step()
        eager.append(loss.item())
    mine, theirs = art.state_dict(), model.state_dict()
    keys = [k for k in theirs if theirs[k].is_floating_point()]
    errors = {k: _rel(mine[k], theirs[k]) for k in keys}
    worst = max(errors, key=errors.__getitem__) if errors else None
    diff = sum(float((mine[k].double().cpu() - theirs[k].double().cpu()).square().sum()) for k in keys)
    norm = sum(float(theirs[k].double().cpu().square().sum()) for k in keys)
    return {"compiled_losses": compiled, "eager_losses": eager, "worst": worst,
            "worst_rel": errors[worst] if worst else 0.0,
            "global_rel": (diff / norm) ** 0.5 if norm > 0 else diff ** 0.5,
            # relative to the first loss: a loss driven to ~0 has no meaningful relative error of its own
            "loss_rel": max(abs(a - b) for a, b in zip(compiled, eager)) / max(abs(eager[0]), 1e-12)}
