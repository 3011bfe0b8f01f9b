"""Joint capture: a model plus a loss → one IR graph holding forward, loss and backward.

The graph has ``Mode.TRAINING``; every compute node carries ``ann.phase``
(:class:`~mlcomp.ir.node.Phase`).  Its outputs are, in order, the scalar loss
(``%loss``), one gradient per trainable parameter (``%grad:<param>``) and the new
value of every buffer the step mutates (``%new:<buffer>``, BatchNorm running
statistics), which the training step copies into the buffers after the step::

    >>> from mlcomp.models import mlp
    >>> x, y = torch.randn(4, 512), torch.tensor([0, 1, 1, 0])
    >>> g = capture_joint(mlp(), (x,), y, loss=LossKind.CROSS_ENTROPY)
    >>> print(g)
    graph Sequential(%args_0: f32[4, 512], %target: i64[4]) {
      ...
      %addmm: f32[4, 256] = aten.addmm.default(%0.bias, %args_0, %permute)   # 0 {phase=forward}
      ...
      %_log_softmax: f32[4, 2] = aten._log_softmax.default(%addmm_2, 1, False)   # {phase=loss}
      ...
      %grad:0.weight: f32[256, 512] = aten.permute.default(%permute_12, [1, 0])   # 0 {phase=backward}
      return (%loss, %grad:0.weight, %grad:0.bias, %grad:2.weight, %grad:2.bias, %grad:4.weight, %grad:4.bias)
    }

Route: ``torch.export.export`` of a wrapper whose forward returns ``(loss,
model_output.detach())``, then the joint decomposition behind
``torch.export.experimental._export_forward_backward`` (joint tracing) with our own
table.  It was chosen over ``aot_export_module(trace_joint=True)`` because its output
signature is typed (``LOSS_OUTPUT``, ``GRADIENT_TO_PARAMETER`` with the parameter's
name, ``BUFFER_MUTATION`` with the buffer's name), so gradients and buffer updates are
named without positional bookkeeping; it also captures faster.  The detached model output marks where the model ends and the loss
begins; it is dropped from the graph's outputs.

Decompositions (:func:`joint_decompositions`): core ATen *minus* the fused kernels
eager autograd itself runs (``_log_softmax_backward_data``, ``native_layer_norm`` and
its backward, batch-norm forward/backward, ``nll_loss_backward``, the CPU flash
attention kernel and its backward …).  With torch's full core table these were
rewritten as chains of elementwise ops and reductions that sum in another order, so
gradients differed from eager by fp32 rounding (~1e-7 of each tensor's scale); Adam
divides every element by its own magnitude and turned that noise into whole ``lr``
steps wherever a gradient is mathematically zero (attention key biases), which is
why the old tests needed ``eps=1e-6`` and a 1e-3 norm-wise tolerance.  Keeping the
kernels makes the compiled gradients of every zoo model, BERT and ViT *bitwise*
equal to eager's on CPU (tests/unit/training/test_training.py), and 5 SGD/Adam steps agree to
1e-5 per parameter.  It also fixes the attention gradient: decomposing the CPU flash
kernel's forward to math while autograd kept its backward formula gave a wrong
query gradient (7.7 relative), which earlier forced the math backend.

Origins: no module metadata survives the joint retrace, so
:mod:`mlcomp.frontend.joint_origins` restores it: forward nodes from the
pre-joint program's ``nn_module_stack`` (anchored on the parameters they read),
backward nodes from the forward node they differentiate.

Tied parameters (one ``nn.Parameter`` under two names, an LM head sharing the embedding) are
one parameter of the graph, named as ``named_parameters()`` names it, whose gradient sums
every use (:mod:`mlcomp.frontend.tied`); parameters the loss never reaches are frozen, as
eager leaves their ``.grad`` None.  Training-mode randomness outside the graph (LayerDrop,
SpecAugment) is refused before capture (:mod:`mlcomp.frontend.stochastic`).

Dropout: the graph draws its masks from torch's global generator through
decomposed ops, which consume random numbers differently from eager's fused
kernel, so compiled and eager dropout masks differ even with the same seed;
verification sets dropout probabilities to 0 (see ``without_dropout``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._decomp import core_aten_decompositions
from torch.export.experimental import (
    _copy_graph_module_and_signature,
    _decompose_exported_program,
    _remove_detach_pass,
)

from mlcomp.base.errors import CaptureError, MlcompError
from mlcomp.base.quiet import quiet_torch
from mlcomp.frontend.capture import from_fx
from mlcomp.frontend.joint_kernels import eager_autograd, restore_backward_kernels
from mlcomp.frontend.joint_origins import joint_origins, module_sequence
from mlcomp.frontend.losses import (
    LossKind,
    TrainingError,
    check_trainable,
    example_target,
    loss_function,
    model_output,
    resolve_loss,
    without_dropout,
)
from mlcomp.frontend.provenance import explain_export_failure
from mlcomp.frontend.stochastic import check_static_training
from mlcomp.frontend.tied import TIED, merge_tied, tied_parameters
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
    "joint_decompositions",
    "loss_function",
    "model_output",
    "output_names",
    "resolve_loss",
    "without_dropout",
]

_ALIAS = aten("alias")
GRAD = "grad:"      # output name prefix of a parameter's gradient
NEW = "new:"        # output name prefix of a mutated buffer's new value
LOSS = "loss"       # name of the loss node
TARGET = "target"   # name of the loss target input
OUTPUT_NAMES = "names"   # output node attribute: loss, grad:<param>…, new:<buffer>… in output order


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
    check_static_training(model, name)
    unused = check_trainable(model, inputs, target, loss_fn, name)
    # parameters the loss never reaches get no gradient in eager either: trace them as frozen
    # (requires_grad restored afterwards, the user's module is left as it was)
    flipped = [p for n, p in model.named_parameters() if n in unused]
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad} | set(unused)
    wrapper = _WithLoss(model, loss_fn)
    args = inputs if loss_fn is None else inputs + (target,)
    aliases = tied_parameters(model)
    with quiet_torch():
        try:
            for p in flipped:
                p.requires_grad_(False)
            with eager_autograd():
                ep = torch.export.export(wrapper, args)
                modules = module_sequence(ep, _strip)
                ep = _forward_backward(merge_tied(ep, {"model." + a: "model." + c for a, c in aliases.items()}))
        except MlcompError:
            raise
        except Exception as exc:  # noqa: BLE001 - converted to a user error
            raise explain_export_failure(exc, name) from None
        finally:
            for p in flipped:
                p.requires_grad_(True)
    return _to_ir(ep, name, frozen, has_target=loss_fn is not None, modules=modules, aliases=aliases)


# Fused kernels eager autograd runs; decomposing them sums in another order (see the module doc).
_KEPT = ("_log_softmax", "_log_softmax_backward_data", "_softmax", "_softmax_backward_data",
         "native_layer_norm", "native_layer_norm_backward", "native_batch_norm", "native_batch_norm_backward",
         "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
         "native_group_norm_backward", "nll_loss_forward", "nll_loss_backward", "mse_loss", "mse_loss_backward",
         "embedding_dense_backward", "gelu", "gelu_backward", "tanh_backward", "sigmoid_backward",
         "threshold_backward", "max_pool2d_with_indices_backward", "_scaled_dot_product_flash_attention_for_cpu",
         "silu", "silu_backward", "upsample_bilinear2d", "upsample_bilinear2d_backward")


def joint_decompositions() -> dict[Any, Callable[..., Any]]:
    """torch's core-ATen table without the fused kernels of :data:`_KEPT` (a fresh dict)."""
    kept = set(_KEPT)
    return {op: fn for op, fn in core_aten_decompositions().items()
            if getattr(op, "_schema", None) is None or op._schema.name.removeprefix("aten::") not in kept}


def _forward_backward(ep: Any) -> Any:
    """``_export_forward_backward`` with :func:`joint_decompositions` instead of the full core table,
    every ``view`` as a ``reshape``, eager's fused backward kernels restored (:mod:`.joint_kernels`).

    A traced ``view`` holds only for the strides the trace's fake tensors had; a kept kernel
    whose real output is laid out otherwise than its fake one (``mse_loss_backward`` on a
    channels-last input returns a contiguous gradient) makes it fail at run time.  Eager
    autograd reshapes there (``ViewBackward``), and so does the graph: a no-copy view
    where the strides allow one, a copy where they do not, the same values either way.
    """
    ep = _decompose_exported_program(ep, cia_to_decomp={}, python_decomp_table=joint_decompositions(),
                                     joint_loss_index=0, decompose_custom_triton_ops=False)
    gm, signature = _copy_graph_module_and_signature(ep)
    _remove_detach_pass(gm, signature)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    restore_backward_kernels(gm)
    gm.recompile()
    return ep._update(gm, signature)


def output_names(graph: Graph) -> list[str]:
    """``loss``, ``grad:<param>``…, ``new:<buffer>``… in the order of the graph's outputs."""
    out = graph.output_node
    names = out.attrs.get(OUTPUT_NAMES)
    return list(names) if names is not None else [r.name for r in graph.output_refs]


def _strip(target: str) -> str:
    return target.removeprefix("model.")


def _to_ir(ep: Any, name: str, frozen: set[str], *, has_target: bool,
           modules: list[tuple[str, str, str]], aliases: dict[str, str]) -> Graph:
    sig = ep.graph_signature
    key = lambda target: aliases.get(_strip(target), _strip(target))   # tied: the canonical name
    tensors = {_strip(k): v for k, v in dict(ep.state_dict).items()}
    tensors.update({_strip(k): v for k, v in (getattr(ep, "constants", {}) or {}).items()})
    constant_of = {s.arg.name: key(s.target) for s in sig.input_specs
                   if s.target is not None and s.kind.name != "USER_INPUT"}
    raw = from_fx(ep.graph_module.graph, name=name, training=False, constant_of=constant_of, tensors=tensors)
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
            grads.append((key(spec.target), ref))
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
                    out_refs=[loss_ref] + [r for p, r in grads if p not in frozen] + [r for _, r in news],
                    modules=modules, tied=tuple(sorted(aliases.items())))


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
             out_refs: list[Ref], modules: list[tuple[str, str, str]], tied: tuple = ()) -> Graph:
    original = {v: k for k, v in rename.items()}
    fwd_roots = [out_refs[0].name] + [r.name for r in out_refs if rename.get(r.name, "").startswith(NEW)]
    phases = _phases(raw, fwd_roots, model_end, original.get(TARGET))
    grad_of = {r.name: rename[r.name][len(GRAD):] for r in out_refs if rename.get(r.name, "").startswith(GRAD)}
    origins = joint_origins(raw, phases, modules, grad_of)
    graph = Graph(raw.name, mode=Mode.TRAINING)
    graph.symbols, graph.ranges = dict(raw.symbols), dict(raw.ranges)
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
            key = original.get(node.name, node.name)
            node = node.with_ann(phase=phases[key])
            if key in origins:
                node = node.with_(origin=origins[key])
        graph.add(node)
    refs = tuple(new(r) for r in out_refs)
    # the layout also rides on the output node, so it survives a pass that redirects an output
    # to an equal value under another name (permute(permute(x)) → x)
    layout = {OUTPUT_NAMES: tuple(r.name for r in refs), **({TIED: tied} if tied else {})}
    graph.add(Node("output", OUTPUT, inputs=(refs,), attrs=layout))
    _drop_dead(graph)
    return graph


def _drop_dead(graph: Graph) -> None:
    """Remove compute nodes nobody reads (the model-output alias's leftovers), users first."""
    for node in reversed(graph.nodes()):
        if not node.op.is_structural and not graph.users(node.name):
            graph.erase(node.name)
