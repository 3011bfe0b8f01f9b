"""Joint capture: a model plus a loss → one IR graph holding forward, loss and backward.

The graph has ``Mode.TRAINING``; every compute node carries ``ann.phase``
(:class:`~mlcomp.ir.node.Phase`).  Its outputs are, in order, the scalar loss
(``%loss``), one gradient per trainable parameter (``%grad:<param>``) and the new
value of every buffer the step mutates (``%new:<buffer>``, BatchNorm running
statistics), which the training step copies into the buffers after the step::

    >>> g = capture_joint(mlp(), (x,), y, loss=LossKind.CROSS_ENTROPY)
    >>> print(g)
    graph mlp(%x: f32[4, 512], %target: i64[4]) {
      %permute: f32[512, 256] = aten.permute.default(%0.weight, [1, 0])   # {phase=forward}
      %addmm: f32[4, 256] = aten.addmm.default(%0.bias, %x, %permute)     # {phase=forward}
      ...
      %_log_softmax: f32[4, 2] = aten._log_softmax.default(%addmm_2, 1, False)   # {phase=loss}
      ...
      %grad:0.weight: f32[256, 512] = aten.permute.default(%permute_13, [1, 0])  # {phase=backward}
      return (%loss, %grad:0.weight, %grad:0.bias, ...)
    }

Route: ``torch.export.export`` of a wrapper whose forward returns ``(loss,
model_output.detach())``, then ``torch.export.experimental._export_forward_backward``
(core-ATen decompositions, joint tracing).  It was chosen over
``aot_export_module(trace_joint=True)`` because its output signature is typed
(``LOSS_OUTPUT``, ``GRADIENT_TO_PARAMETER`` with the parameter's name,
``BUFFER_MUTATION`` with the buffer's name), so gradients and buffer updates are
named without positional bookkeeping; on the zoo it also captured faster
(resnet18: 8.5 s vs 15.9 s) with fewer nodes (1051 vs 1091).  The detached model
output marks where the model ends and the loss begins; it is dropped from the
graph's outputs.  Neither route keeps ``nn_module_stack`` on joint nodes, so
origins of joint nodes are empty.  Both routes trace the fused CPU attention
kernel (``scaled_dot_product_attention``) with a wrong query/key gradient in
torch 2.13 (7.7 relative on a two-linear attention model); capture runs under
the math attention backend, which decomposes attention before autograd sees it.

Dropout: the graph draws its masks from torch's global generator through
decomposed ops, which consume random numbers differently from eager's fused
kernel, so compiled and eager dropout masks differ even with the same seed;
verification sets dropout probabilities to 0 (see ``without_dropout``).
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.export.experimental import _export_forward_backward
from torch.nn.attention import SDPBackend, sdpa_kernel

from mlcomp.base.errors import CaptureError, MlcompError
from mlcomp.base.quiet import quiet_torch
from mlcomp.frontend.capture import _explain_export_failure, _from_fx
from mlcomp.ir import Graph, Mode, Node, Ref, map_refs
from mlcomp.ir.node import Phase
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM, aten

__all__ = [
    "GRAD",
    "LOSS",
    "NEW",
    "OUTPUT_NAMES",
    "TARGET",
    "LossKind",
    "TrainingError",
    "capture_joint",
    "check_trainable",
    "example_target",
    "loss_function",
    "model_output",
    "output_names",
    "without_dropout",
]

_ALIAS = aten("alias")
GRAD = "grad:"      # output name prefix of a parameter's gradient
NEW = "new:"        # output name prefix of a mutated buffer's new value
LOSS = "loss"       # name of the loss node
TARGET = "target"   # name of the loss target input
OUTPUT_NAMES = "names"   # output node attribute: loss, grad:<param>…, new:<buffer>… in output order


class TrainingError(MlcompError):
    """A model, loss or optimizer cannot be used for a training step."""


class LossKind(enum.Enum):
    CROSS_ENTROPY = "cross_entropy"
    MSE = "mse"
    MODEL = "model"     # the model's forward already returns the scalar loss

    @classmethod
    def parse(cls, value: str | LossKind) -> LossKind:
        if isinstance(value, LossKind):
            return value
        try:
            return cls(str(value).strip().lower().replace("-", "_"))
        except ValueError:
            raise TrainingError(f"there is no loss named {value!r}",
                                hint="use cross_entropy, mse, model (the forward returns the loss) "
                                     "or pass a callable loss_fn(output, target)") from None


def loss_function(loss: str | LossKind | Callable[..., torch.Tensor] | None) -> Callable[..., Any] | None:
    """The callable ``loss(output, target)`` (``None`` when the model returns its own loss)."""
    if callable(loss) and not isinstance(loss, (str, LossKind)):
        return loss
    kind = LossKind.parse(loss or LossKind.CROSS_ENTROPY)
    return {LossKind.CROSS_ENTROPY: F.cross_entropy, LossKind.MSE: F.mse_loss, LossKind.MODEL: None}[kind]


def model_output(value: Any) -> Any:
    """The tensor a loss reads from a model's output (first element of a tuple or ``ModelOutput``)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value:
        return model_output(value[0])
    if hasattr(value, "to_tuple"):   # transformers' ModelOutput
        return model_output(value.to_tuple())
    return value


def example_target(model: nn.Module, inputs: Sequence[torch.Tensor],
                   loss: str | LossKind | Callable[..., Any] | None, seed: int = 2) -> torch.Tensor | None:
    """A random target fitting ``model``'s output: class indices for cross_entropy, values for mse."""
    if loss_function(loss) is None:
        return None
    saved = {k: v.detach().clone() for k, v in model.named_buffers()}
    with torch.no_grad(), quiet_torch():
        out = model_output(model(*inputs))
        for k, v in model.named_buffers():
            v.copy_(saved[k])
    gen = torch.Generator().manual_seed(seed)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() == 0:
        return None   # check_trainable explains what is wrong with this output
    if loss_function(loss) is F.cross_entropy:
        return torch.randint(0, out.shape[-1], out.shape[:-1], generator=gen).to(out.device)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)


def without_dropout(module: nn.Module) -> nn.Module:
    """Set every dropout probability in ``module`` to 0 (in place); returns it."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for attr in ("dropout", "attention_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return module


class _WithLoss(nn.Module):
    """``forward(*inputs, target) -> (loss, model_output.detach())`` for joint export."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any] | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.loss_fn is None:
            return (model_output(self.model(*args)),)
        out = model_output(self.model(*args[:-1]))
        return self.loss_fn(out, args[-1]), out.detach()


def check_trainable(model: nn.Module, inputs: Sequence[torch.Tensor], target: torch.Tensor | None,
                    loss_fn: Callable[..., Any] | None, name: str) -> None:
    """Raise :class:`TrainingError` for a model/loss pair that cannot make a training step."""
    if not any(p.requires_grad and p.is_floating_point() for p in model.parameters()):
        raise TrainingError(f"{name} has no parameters that require grad, so a training step has nothing "
                            "to update", where=name,
                            hint="unfreeze some parameters (p.requires_grad_(True)) or compile for inference")
    saved = {k: v.detach().clone() for k, v in model.named_buffers()}   # the check must not move BN stats
    with quiet_torch(), torch.no_grad():
        try:
            out = model_output(model(*inputs))
        except Exception as exc:  # noqa: BLE001 - a user model failing on its inputs
            raise TrainingError(f"{name} fails on the example inputs: {type(exc).__name__}: {exc}",
                                where=name, hint="check the example inputs' shapes") from None
        finally:
            for k, v in model.named_buffers():
                v.copy_(saved[k])
    if not isinstance(out, torch.Tensor):
        raise TrainingError(f"{name} returns a {type(out).__name__}, not a tensor a loss can read", where=name,
                            hint="return a tensor (or a tuple whose first element is the logits/loss)")
    if not out.is_floating_point():
        raise TrainingError(f"{name} returns an integer tensor ({out.dtype}), which has no gradient",
                            where=name, hint="return the float logits and apply argmax outside the model")
    if loss_fn is None:
        loss = out
        what = "the model's output (loss='model')"
    else:
        if target is None:
            raise TrainingError(f"loss for {name} needs a target tensor", hint="pass the target as `y`")
        try:
            loss = loss_fn(out, target)
        except Exception as exc:  # noqa: BLE001
            raise TrainingError(f"the loss fails on {name}'s output {tuple(out.shape)} and target "
                                f"{tuple(target.shape)}: {type(exc).__name__}: {exc}", where=name,
                                hint="cross_entropy wants integer class indices of shape (batch,); "
                                     "mse wants a target shaped like the output") from None
        what = "the loss"
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TrainingError(f"{what} of {name} is not a scalar (shape {shape}); backward needs one number",
                            where=name, hint="reduce it (mean or sum), e.g. reduction='mean'")


def capture_joint(model: nn.Module, inputs: Sequence[torch.Tensor], target: torch.Tensor | None, *,
                  loss: str | LossKind | Callable[..., Any] | None = LossKind.CROSS_ENTROPY,
                  name: str | None = None) -> Graph:
    """Capture one training step of ``model`` on ``inputs`` (and ``target``) as a joint graph.

    The graph is of ``model`` in training mode (BatchNorm batch statistics, dropout);
    the module's own mode, weights and buffers are left as they were.  Raises
    :class:`TrainingError` for a model without trainable parameters, a non-scalar
    loss or an integer output.
    """
    was_training = model.training
    try:
        return _capture(model, tuple(inputs), target, loss_function(loss), name or type(model).__name__)
    finally:
        model.train(was_training)


def _capture(model: nn.Module, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None,
             loss_fn: Callable[..., Any] | None, name: str) -> Graph:
    model.train(True)
    check_trainable(model, inputs, target, loss_fn, name)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    wrapper = _WithLoss(model, loss_fn)
    args = inputs if loss_fn is None else inputs + (target,)
    # torch 2.13's joint trace of the fused CPU attention kernel gives wrong query gradients
    # (7.7 relative on a two-linear SDPA model); the math backend decomposes attention into
    # bmm/softmax before autograd sees it, which traces correctly (scoped, restored on exit)
    with quiet_torch(), sdpa_kernel(SDPBackend.MATH):
        try:
            ep = torch.export.export(wrapper, args)
            ep = _export_forward_backward(ep, joint_loss_index=0)
        except MlcompError:
            raise
        except Exception as exc:  # noqa: BLE001 - converted to a user error
            raise _explain_export_failure(exc, name) from None
    return _to_ir(ep, name, frozen, has_target=loss_fn is not None)


def output_names(graph: Graph) -> list[str]:
    """``loss``, ``grad:<param>``…, ``new:<buffer>``… in the order of the graph's outputs."""
    out = graph.output_node
    names = out.attrs.get(OUTPUT_NAMES)
    return list(names) if names is not None else [r.name for r in graph.output_refs]


def _strip(target: str) -> str:
    return target.removeprefix("model.")


def _to_ir(ep: Any, name: str, frozen: set[str], *, has_target: bool) -> Graph:
    sig = ep.graph_signature
    tensors = {_strip(k): v for k, v in dict(ep.state_dict).items()}
    tensors.update({_strip(k): v for k, v in (getattr(ep, "constants", {}) or {}).items()})
    constant_of = {s.arg.name: _strip(s.target) for s in sig.input_specs
                   if s.target is not None and s.kind.name != "USER_INPUT"}
    raw = _from_fx(ep.graph_module.graph, name=name, training=False, constant_of=constant_of, tensors=tensors)
    outs = raw.output_refs
    rename: dict[str, str] = {}
    loss_ref: Ref | None = None
    marker: str | None = None
    grads: list[tuple[str, Ref]] = []
    news: list[tuple[str, Ref]] = []
    for spec, ref in zip(sig.output_specs, outs):
        kind = spec.kind.name
        if kind == "LOSS_OUTPUT":
            loss_ref = ref
        elif kind == "GRADIENT_TO_PARAMETER":
            grads.append((_strip(spec.target), ref))
        elif kind == "BUFFER_MUTATION":
            news.append((_strip(spec.target), ref))
        elif kind == "USER_OUTPUT":
            marker = ref.name
    if loss_ref is None:   # pragma: no cover - _export_forward_backward always marks one
        raise CaptureError(f"joint capture of {name} produced no loss output")
    for new_name, ref in [(LOSS, loss_ref)] + [(GRAD + p, r) for p, r in grads if p not in frozen] \
            + [(NEW + b, r) for b, r in news]:
        if ref.name not in rename and raw.node(ref.name).op not in (PARAM, INPUT):
            rename[ref.name] = new_name
    inputs = raw.input_nodes
    if has_target and inputs:
        rename[inputs[-1].name] = TARGET
    model_end = None
    if marker is not None:   # the detached model output: alias(model_output)
        node = raw.node(marker)
        model_end = node.input_names()[0] if node.input_names() else None
    return _rebuild(raw, rename, model_end, marker,
                    out_refs=[loss_ref] + [r for p, r in grads if p not in frozen] + [r for _, r in news])


def _phases(raw: Graph, roots: list[str], model_end: str | None, target: str | None) -> dict[str, Phase]:
    """Forward = what the loss and buffer updates need; loss = forward reading the model's output or target."""
    forward: set[str] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n in forward:
            continue
        forward.add(n)
        stack.extend(raw.node(n).input_names())
    after_model: set[str] = {model_end, target or model_end} if model_end is not None else set()
    out: dict[str, Phase] = {}
    for node in raw.nodes():   # topological: one pass marks the descendants of the model output
        if node.op.is_structural:
            continue
        if node.name in forward:
            loss = any(i in after_model for i in node.input_names())
            if loss:
                after_model.add(node.name)
            out[node.name] = Phase.LOSS if loss else Phase.FORWARD
        else:
            out[node.name] = Phase.BACKWARD
    return out


def _rebuild(raw: Graph, rename: dict[str, str], model_end: str | None, marker: str | None,
             out_refs: list[Ref]) -> Graph:
    original = {v: k for k, v in rename.items()}
    fwd_roots = [out_refs[0].name] + [r.name for r in out_refs if rename.get(r.name, "").startswith(NEW)]
    phases = _phases(raw, fwd_roots, model_end, original.get(TARGET))
    graph = Graph(raw.name, mode=Mode.TRAINING)
    graph.symbols = dict(raw.symbols)
    new = lambda r: Ref(rename.get(r.name, r.name))
    for node in raw.nodes():
        if node.name == marker or node.op == OUTPUT:
            continue
        if node.op == _ALIAS and node.name not in rename:   # autograd's "saved" marker: a no-op view
            rename[node.name] = new(Ref(node.input_names()[0])).name
            continue
        node = node.with_(name=rename.get(node.name, node.name), inputs=map_refs(node.inputs, new),
                          attrs=map_refs(dict(node.attrs), new))
        if node.op == PARAM:
            graph.constants[node.name] = raw.constants[node.name]
        elif not node.op.is_structural:
            node = node.with_ann(phase=phases[original.get(node.name, node.name)])
        graph.add(node)
    refs = tuple(new(r) for r in out_refs)
    # the layout also rides on the output node, so it survives a pass that redirects an output
    # to an equal value under another name (permute(permute(x)) → x)
    graph.add(Node("output", OUTPUT, inputs=(refs,), attrs={OUTPUT_NAMES: tuple(r.name for r in refs)}))
    _drop_dead(graph)
    return graph


def _drop_dead(graph: Graph) -> None:
    """Remove compute nodes nobody reads (the model-output alias's leftovers), users first."""
    for node in reversed(graph.nodes()):
        if not node.op.is_structural and not graph.users(node.name):
            graph.erase(node.name)
