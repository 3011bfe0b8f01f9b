"""A compiled training step: joint IR graph → generated torch code + an optimizer.

    >>> from mlcomp.frontend.joint import LossKind, capture_joint
    >>> model, x, y = torch.nn.Linear(8, 3), torch.randn(4, 8), torch.tensor([0, 2, 1, 0])
    >>> joint_graph = capture_joint(model, (x,), y, loss=LossKind.CROSS_ENTROPY)
    >>> art = compile_training(joint_graph, target="cpu", optimizer="sgd{lr=0.05 momentum=0.9}",
    ...                        state_keys=list(model.state_dict()))
    >>> loss = art.step(x, y)               # forward, loss, backward, optimizer, buffer updates
    >>> loss.shape, art.state_dict().keys() == model.state_dict().keys()
    (torch.Size([]), True)
    >>> bool(art.step(x, y) < loss)         # one SGD step lowered the loss on this batch
    True

The joint graph's outputs are ``(%loss, %grad:<param>…, %new:<buffer>…)``
(:mod:`mlcomp.frontend.joint`).  :func:`mlcomp.runtime.codegen.to_fx` turns the
graph into a ``GraphModule`` whose attributes are the artifact's own copies of
the parameters and buffers; ``step`` runs it without autograd, hands the
gradients to a ``torch.optim`` optimizer (foreach) over those same tensors, and
copies the new buffer values (BatchNorm running statistics) into the buffers.

Only targets whose :class:`~mlcomp.targets.base.Target` runs torch code (``cpu``,
``cuda``) run training graphs; ``onnxruntime`` and ``tvm`` are refused with a
capability message before anything is built.
"""
from __future__ import annotations

import copy
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from mlcomp.base.errors import (
    ArtifactError,
    MlcompError,
)
from mlcomp.base.files import Kind, atomic_dir, check_destination
from mlcomp.base.version import __version__
from mlcomp.ir import Graph, Mode
from mlcomp.targets.base import CompileOptions
from mlcomp.targets.capabilities import CapabilityError, hint_for, mismatches
from mlcomp.training.capability import (
    TrainingCapabilityError,
    check_training_target,
    training_capabilities,
    training_targets,
)
from mlcomp.runtime.codegen import param_names, to_fx
from mlcomp.passes.precision.loss_scale import LossScale, find_backward_seed, is_loss_scaled
from mlcomp.pipeline import run_pipeline
from mlcomp.hardware import allocator
from mlcomp.training.fused import bind_updates, fused_step, scripted
from mlcomp.training.host_memory import at_compile
from mlcomp.training.loss_scaling import LossScaleError, LossScaler, LossScaleSpec
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.training.check import (
    GRAD_FLOOR,
    check_step,
    compare_steps,
    eager_loss,
    verify_gradients,
)

__all__ = ["GRAD", "GRAD_FLOOR", "NEW", "SAVED_FILES", "TRAINING_FORMAT", "TrainingArtifact",
           "TrainingCapabilityError", "check_training_target", "compare_steps", "compile_training", "eager_loss",
           "training_targets", "verify_gradients"]

GRAD = "grad:"     # the joint graph's output names (mlcomp.frontend.joint)
NEW = "new:"
_NAMES = "names"   # output node attribute holding them in output order (mlcomp.frontend.joint)
_TIED = "tied"     # output node attribute: (alias, canonical) pairs of tied parameters (mlcomp.frontend.tied)


TRAINING_FORMAT = "mlcomp-training"
# what TrainingArtifact.save writes next to manifest.json
SAVED_FILES = {"joint.ir.txt": "the joint IR, as text", "step.pt": "the step (TorchScript) with parameters and buffers",
               "state.pt": "parameters and buffers under the model's keys", "optimizer.pt": "the optimizer's state",
               "reference.pt": "a batch and the loss and state one step later, checked on load"}
FUSED_FILE = "fused.pt"   # the step with the optimizer in the backward (TorchScript), when compiled so


def output_names(graph: Graph) -> list[str]:
    names = graph.output_node.attrs.get(_NAMES)
    return list(names) if names is not None else [r.name for r in graph.output_refs]


class TrainingArtifact:
    """``step(*inputs, y) -> loss`` (``y`` positional or ``y=``) over its own parameters;
    ``state_dict``/``load_state_dict``."""

    fused: torch.nn.Module | None = None    # the step with the optimizer in the backward (mlcomp.training.fused)
    host_memory: dict[str, Any] | None = None   # the process's allocator policy (mlcomp.hardware.allocator)
    _fused_attrs: dict[str, str] | None = None  # the fused module's attribute → dotted name
    _updates: Sequence[Any] = ()                # the fused step's bound updates (kept: they are weakly bound)

    def __init__(self, graph: Graph, optimizer: OptimizerSpec, *, device: str,
                 state_keys: Sequence[str] | None = None,
                 extra_state: Mapping[str, torch.Tensor] | None = None, target: str = "cpu",
                 loss_scaler: LossScaler | None = None, script: bool = True,
                 update_in_backward: bool = False) -> None:
        if graph.mode is not Mode.TRAINING:
            raise TrainingCapabilityError(f"graph {graph.name} is an inference graph, not a joint training graph",
                                          hint="capture it with mode='train'")
        own = graph.copy()
        own.constants = {k: v.detach().to(device).clone() for k, v in graph.constants.items()}
        self.graph: Graph | None = own      # None on an artifact loaded from a folder (it runs TorchScript)
        module = to_fx(own, device=device, honour_placement=False, scriptable=script)
        names = param_names(module)
        module = (scripted(module) if script else None) or to_fx(own, device=device, honour_placement=False)
        self._bind(module, names, output_names(own), name=graph.name, target=target, device=device,
                   optimizer=optimizer, state_keys=state_keys, extra_state=extra_state,
                   tied=dict(own.output_node.attrs.get(_TIED, ())))
        self.loss_scaler = loss_scaler   # graph has a %loss_scale input (mlcomp.training.loss_scaling)
        self.verification: dict[str, Any] | None = None
        if update_in_backward:
            self.fused, self._fused_attrs, self._updates = fused_step(
                own, device, self._grad_index, self._tensors, optimizer, self.optimizer,
                scaled=loss_scaler is not None, script=script)

    def _bind(self, module: Any, names: Mapping[str, str], outs: Sequence[str], *, name: str, target: str,
              device: str, optimizer: OptimizerSpec, state_keys: Sequence[str] | None,
              extra_state: Mapping[str, torch.Tensor] | None, tied: Mapping[str, str] | None = None) -> None:
        """Tensors, output layout and optimizer around ``module`` (generated fx code or TorchScript);
        ``tied`` maps each alias of a tied parameter to its canonical name (one tensor under both keys)."""
        self.name, self.target, self.device, self.optimizer_spec = name, target, device, optimizer
        self.module = module
        self._names = dict(names)       # module attribute → dotted parameter/buffer name
        self._outs = list(outs)
        self._tied = dict(tied or {})
        tensors = {dotted: getattr(module, attr) for attr, dotted in names.items()}
        tensors.update({alias: tensors[c] for alias, c in self._tied.items() if c in tensors})
        self._grad_index = {n[len(GRAD):]: i for i, n in enumerate(outs) if n.startswith(GRAD)}
        self._new_index = {n[len(NEW):]: i for i, n in enumerate(outs) if n.startswith(NEW)}
        self.params: dict[str, torch.Tensor] = {p: tensors[p] for p in self._grad_index}
        self.buffers: dict[str, torch.Tensor] = {b: tensors[b] for b in self._new_index}
        self._tensors = tensors
        self._extra = {k: v.detach().to(device).clone() for k, v in (extra_state or {}).items() if k not in tensors}
        keys = list(state_keys) if state_keys is not None else list(tensors)
        self._state_keys = [k for k in keys if k in tensors or k in self._extra]
        self.optimizer = optimizer.build(self.params.values())
        self.steps = 0
        self.reference_inputs: tuple[torch.Tensor, ...] | None = None   # the batch verify_gradients used

    # -- running ------------------------------------------------------------
    def _run(self, inputs: Sequence[torch.Tensor], module: Any = None) -> tuple[torch.Tensor, ...]:
        module = self.module if module is None else module
        inputs = tuple(t.to(self.device) for t in inputs)
        if self.loss_scaler is not None:
            inputs += self.loss_scaler.inputs(self.device)
        if isinstance(module, torch.jit.ScriptModule):   # no JIT fusion: eager's kernels, bit for bit
            with torch.no_grad(), torch.jit.optimized_execution(False):
                return module(*inputs)
        with torch.no_grad():
            return module(*inputs)

    def gradients(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, {param: grad})`` for one batch without updating anything (the last input is ``y``)."""
        outs = self._run(inputs)
        grads = [outs[i] for i in self._grad_index.values()]
        if self.loss_scaler is not None:
            grads, _ = self.loss_scaler.unscale(grads)
        return outs[0], dict(zip(self._grad_index, grads))

    def step(self, *inputs: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """One training step on a batch; returns the loss.  The loss's target ``y`` comes last, positionally or
        by name: ``step(x, y)`` and ``step(x, y=y)`` are the same step (a loss the model computes itself takes
        no ``y``)."""
        if self.fused is not None:     # each parameter updated inside the backward (mlcomp.training.fused)
            return self._finish(self._run(inputs if y is None else (*inputs, y), self.fused))
        outs = self._run(inputs if y is None else (*inputs, y))
        grads = [outs[i] for i in self._grad_index.values()]
        apply = True
        if self.loss_scaler is not None:   # unscaled in fp32; an inf/NaN gradient skips the update
            grads, finite = self.loss_scaler.unscale(grads)
            apply = self.loss_scaler.update(finite)
        if apply:
            for p, g in zip(self._grad_index, grads):
                self.params[p].grad = g
            self.optimizer.step()
            for p in self.params.values():
                p.grad = None
        return self._finish(outs)

    def _finish(self, outs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Copy the new buffer values in, count the step, return the loss."""
        with torch.no_grad():
            for b, i in self._new_index.items():
                self.buffers[b].copy_(outs[i])
        self.steps += 1
        return outs[0].detach()

    __call__ = step

    def __deepcopy__(self, memo: dict[int, Any]) -> TrainingArtifact:
        """An independent copy whose step reads the tensors its optimizer updates: a TorchScript module
        copies its attributes outside ``memo``, so they are bound back to the copied parameters."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        memo[id(self._updates)] = ()       # not copied: the copy's updates are bound to its own tensors below
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        for attr, dotted in new._names.items():
            if getattr(new.module, attr).data_ptr() != new._tensors[dotted].data_ptr():
                setattr(new.module, attr, new._tensors[dotted])
        if new.fused is not None:       # its updates must step the copy's parameters and optimizer
            new._updates = bind_updates(new.fused, new._fused_attrs, new._tensors, new.params, new.optimizer_spec,
                                        new.optimizer)
        return new

    def stats(self) -> dict[str, Any]:
        """Steps taken and, with loss scaling, its history (scale changes, skipped steps)."""
        return {"steps": self.steps,
                "loss_scaling": self.loss_scaler.stats() if self.loss_scaler is not None else None}

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

    # -- persistence --------------------------------------------------------
    def save(self, path: str | Path, *, inputs: Sequence[torch.Tensor] | None = None, force: bool = True) -> Path:
        """Write the folder atomically (see :data:`SAVED_FILES`); returns its path.

        ``inputs`` (default: the batch the gradients were verified on) is traced and stored
        with the loss and state one step from now, which :meth:`load` repeats and compares.
        """
        inputs = inputs if inputs is not None else self.reference_inputs
        if inputs is None:
            raise MlcompError(f"saving the training artifact of {self.name} needs a batch to check the reload "
                              "against", hint="pass inputs=(x, ..., y), or verify the artifact first")
        directory = check_destination(path, Kind.DIR, force=force)
        args = tuple(t.detach().to(self.device) for t in inputs)
        trial = copy.deepcopy(self)
        loss = trial.step(*args).detach().cpu()
        after = {k: v.detach().cpu().clone() for k, v in trial.state_dict().items()}
        if not all(isinstance(m, torch.jit.ScriptModule) for m in (self.module, self.fused) if m is not None):
            raise ArtifactError(f"TorchScript cannot compile the training step of {self.name}, so it cannot be "
                                "saved as a folder", hint="keep the artifact in memory and save its state_dict()")
        manifest = {"format": TRAINING_FORMAT, "format_version": 1, "mlcomp_version": __version__,
                    "torch_version": torch.__version__, "model": self.name, "target": self.target,
                    "device": self.device, "optimizer": self.optimizer_spec.text(), "steps": self.steps,
                    "state_keys": self._state_keys, "extra_keys": list(self._extra), "outputs": self._outs,
                    "attributes": self._names, "tied": self._tied, "verification": self.verification,
                    "files": list(SAVED_FILES) + ([FUSED_FILE] if self.fused is not None else []),
                    "update_in_backward": self.fused is not None, "host_memory": self.host_memory,
                    "fused_attributes": self._fused_attrs if self.fused is not None else None,
                    # the scaler's spec, running scale and history: the reloaded step scales as the next one would
                    "loss_scaling": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}
        with atomic_dir(directory, label="training artifact") as tmp:
            (tmp / "joint.ir.txt").write_text((self.graph.format() if self.graph is not None else "") + "\n")
            torch.jit.save(self.module, str(tmp / "step.pt"))
            if self.fused is not None:
                torch.jit.save(self.fused, str(tmp / FUSED_FILE))
            torch.save({k: v.detach().cpu() for k, v in self.state_dict().items()}, tmp / "state.pt")
            torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
            torch.save({"inputs": [t.cpu() for t in args], "loss": loss, "after": after}, tmp / "reference.pt")
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
        return directory

    @classmethod
    def load(cls, path: str | Path, *, device: str | None = None) -> TrainingArtifact:
        """Load a folder written by :meth:`save` and check it: one step on the stored batch must repeat
        the step the original took (``verification["reload"]``).  TorchScript and weights-only tensors:
        nothing in the folder runs Python code."""
        directory = Path(path)
        try:
            manifest = json.loads((directory / "manifest.json").read_text())
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{directory} is not a training artifact folder ({exc})",
                                hint="write one with `mlcomp compile MODEL --train -o DIR`") from None
        if manifest.get("format") != TRAINING_FORMAT:
            raise ArtifactError(f"{directory} holds a {manifest.get('format', 'non-mlcomp')} folder, not a "
                                "training artifact", hint="load it with mlcomp.load")
        device = device or manifest["device"]
        try:
            module = torch.jit.load(str(directory / "step.pt"), map_location=device)
            fused = (torch.jit.load(str(directory / FUSED_FILE), map_location=device)
                     if manifest.get("update_in_backward") else None)
            state = torch.load(directory / "state.pt", map_location=device, weights_only=True)
            opt_state = torch.load(directory / "optimizer.pt", map_location=device, weights_only=True)
            ref = torch.load(directory / "reference.pt", map_location=device, weights_only=True)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ArtifactError(f"the training artifact at {directory} cannot be read: "
                                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}",
                                hint="compile it again (`mlcomp compile MODEL --train -o DIR`)") from None
        art = cls.__new__(cls)
        art.graph, art.verification = None, manifest.get("verification")
        scaling = manifest.get("loss_scaling")
        art.loss_scaler = LossScaler.from_state(scaling) if scaling else None
        extra = {k: state[k] for k in manifest["extra_keys"]}
        art._bind(module, manifest["attributes"], manifest["outputs"], name=manifest["model"],
                  target=manifest["target"], device=device, optimizer=OptimizerSpec.parse(manifest["optimizer"]),
                  state_keys=manifest["state_keys"], extra_state=extra, tied=manifest.get("tied"))
        recorded = (manifest.get("host_memory") or {}).get("policy", "keep")
        art.host_memory = allocator.apply(recorded if recorded in allocator.POLICIES else "keep", where="at load")
        if fused is not None:         # the optimizer in the backward, bound to the loaded tensors
            art.fused, art._fused_attrs = fused, manifest["fused_attributes"]
            art._updates = bind_updates(fused, art._fused_attrs, art._tensors, art.params, art.optimizer_spec,
                                        art.optimizer)
        art.load_state_dict(state)
        art.optimizer.load_state_dict(opt_state)
        art.steps = int(manifest["steps"])
        art.reference_inputs = tuple(ref["inputs"])
        check = check_step(art, art.reference_inputs, ref["loss"], ref["after"])
        art.verification = dict(art.verification or {}, reload=check)
        return art

    def __repr__(self) -> str:
        return (f"<TrainingArtifact {self.name} on {self.target} ({self.device}): "
                f"{len(self.params)} params, {self.optimizer_spec.text()}, {self.steps} steps>")


def compile_training(graph: Graph, *, target: str = "cpu", optimizer: str | OptimizerSpec = "sgd",
                     options: CompileOptions | None = None, state_keys: Sequence[str] | None = None,
                     extra_state: Mapping[str, torch.Tensor] | None = None,
                     loss_scale: str | float | LossScaleSpec | None = None,
                     update_in_backward: bool = False, host_memory: str = "auto") -> TrainingArtifact:
    """Lower a joint training graph on ``target`` (``cpu`` or ``cuda``) with ``optimizer``.

    ``loss_scale``: ``dynamic``, ``none``, a number or ``dynamic{init=… interval=…}``
    (:mod:`mlcomp.training.loss_scaling`); ``None`` is dynamic when the graph computes in fp16, or
    when a pipeline already ran the ``loss-scale`` pass on it.  ``update_in_backward`` updates each
    parameter as soon as its gradient is complete and frees the gradient (:mod:`mlcomp.training.fused`).
    ``host_memory`` (``auto``, ``return``, ``keep``): whether freed tensors go back to the OS
    (:mod:`mlcomp.training.host_memory`; ``auto``: for a rematerialised or fused step).
    """
    spec = OptimizerSpec.parse(optimizer)
    scaling = _loss_scaling(graph, loss_scale)
    t = check_training_target(target)
    options = options or CompileOptions()
    device = options.device or t.default_device
    problems = mismatches(training_capabilities(t), t.name, graph, device)
    if problems:
        raise CapabilityError(t.name, graph, problems, hint_for(problems))
    t.check(graph)
    scaler = LossScaler(scaling) if scaling.active else None
    if scaler is not None and not is_loss_scaled(graph):
        graph, _ = run_pipeline(graph, LossScale.name)
    memory = at_compile(host_memory, graph, fused=update_in_backward)
    art = TrainingArtifact(graph, spec, device=device, state_keys=state_keys, extra_state=extra_state,
                           target=t.name, loss_scaler=scaler, update_in_backward=update_in_backward)
    art.host_memory = memory
    return art


def _loss_scaling(graph: Graph, loss_scale: str | float | LossScaleSpec | None) -> LossScaleSpec:
    """The loss-scale spec; a graph the ``loss-scale`` pass already ran on needs an active one to feed it."""
    if not is_loss_scaled(graph):
        scaling = LossScaleSpec.parse(loss_scale, graph=graph)
        if scaling.active:
            find_backward_seed(graph)      # a graph without backward: refused with the loss-scale message
        return scaling
    scaling = LossScaleSpec.parse(loss_scale if loss_scale is not None else "dynamic")
    if not scaling.active:
        raise LossScaleError(f"graph {graph.name} was loss-scaled by the pipeline's loss-scale pass, and the "
                             "loss scale is 'none': nothing would feed its %loss_scale input",
                             hint="drop loss-scale from the pipeline, or give a loss scale (dynamic or a number)")
    return scaling
