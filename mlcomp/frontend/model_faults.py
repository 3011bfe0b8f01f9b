"""Faults of the user's model that a compiled graph cannot hold, found at capture and named as such.

Each check raises :class:`~mlcomp.base.errors.ModelFaultError` (the model's code must
change, not mlcomp) naming the module path and the source line where known:

    fault                                         found from
    forward takes its inputs by keyword only      the signature of ``forward``
    a Python number or string as an argument      the example inputs
    None, a number or a string among the outputs  the exported graph's output node
    an in-place update of a buffer or an input    mutating ops on placeholders (their stack trace)
    eager PyTorch rejects the example inputs too  the eager reference run (see :func:`eager_fault`)

>>> import torch
>>> class Counter(torch.nn.Module):
...     def __init__(self):
...         super().__init__(); self.register_buffer("n", torch.zeros(1))
...     def forward(self, x):
...         self.n += 1
...         return x * 2
>>> ep = torch.export.export(Counter(), (torch.ones(2),))
>>> try:
...     check_no_mutation(ep, "counter")
... except ModelFaultError as err:
...     print(err.what.split(";")[0])
the model's forward (counter) updates buffer n in place
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from torch import nn

from mlcomp.base.errors import ModelFaultError
from mlcomp.frontend.provenance import first_line, user_frame

__all__ = ["check_signature", "check_arguments", "check_outputs", "check_no_mutation", "check_graph_mutation",
           "eager_fault",
           "train_mode_notes"]

# module classes that compute differently in train() mode (dropout active, batch statistics used)
TRAIN_SENSITIVE: tuple[type[nn.Module], ...] = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm,
                                                nn.modules.instancenorm._InstanceNorm)

# what to do instead, by kind of non-tensor value in an argument or output
_ARGUMENT_FIX = ("make {param} a constructor argument stored on the module (self.{param} = ...) so forward "
                 "takes tensors only, or pass it as a tensor (torch.tensor(...))")
_OUTPUT_FIX = "return tensors only (drop the non-tensor values, or compute them outside forward)"


def forward_location(module: nn.Module) -> str | None:
    """``file:line in Class.forward`` of the module's forward definition."""
    fn = getattr(type(module), "forward", None)
    try:
        path = inspect.getsourcefile(fn)            # type: ignore[arg-type]
        line = inspect.getsourcelines(fn)[1]         # type: ignore[arg-type]
    except (OSError, TypeError):
        return None
    return f"{path}:{line} in {type(module).__name__}.forward"


def check_signature(module: nn.Module, name: str) -> None:
    """A forward whose inputs are keyword-only (``*, x`` or ``**kwargs``) cannot take positional example inputs."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    by_keyword = [p.name if p.kind is p.KEYWORD_ONLY else f"**{p.name}" for p in params
                  if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]
    if positional or not by_keyword:
        return
    raise ModelFaultError(
        f"forward ({name}) takes its inputs by keyword only ({', '.join(by_keyword)}); mlcomp passes example "
        "inputs and --input-shape tensors positionally", where=forward_location(module),
        hint="make them positional parameters (def forward(self, x)), or wrap the model in a module whose "
             "forward(self, x) calls it with the keyword")


def parameter_names(module: nn.Module, count: int) -> list[str]:
    """The names of forward's first ``count`` parameters (``input i`` where the signature does not say)."""
    try:
        names = [p.name for p in inspect.signature(module.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    return [names[i] if i < len(names) else f"input {i}" for i in range(count)]


def check_arguments(module: nn.Module, inputs: Sequence[Any], name: str) -> None:
    """No example input may be a Python number or string: export bakes it in, and the graph has no input for it."""
    try:
        names = [p.name for p in inspect.signature(module.forward).parameters.values()]
    except (TypeError, ValueError):
        names = []
    for i, value in enumerate(inputs):
        leaves, _ = torch.utils._pytree.tree_flatten(value)
        if not any(isinstance(v, (bool, int, float, complex, str)) for v in leaves):
            continue        # tensors (or containers of them); None stays an absent optional argument
        param = names[i] if i < len(names) else f"argument {i}"
        raise ModelFaultError(
            f"forward ({name}) takes {param} (argument {i}) as a Python {type(value).__name__} "
            f"({value!r:.40}), not a tensor; a compiled graph's inputs are tensors only",
            where=forward_location(module), hint=_ARGUMENT_FIX.format(param=param))


def check_outputs(graph: torch.fx.Graph, module: nn.Module, name: str) -> None:
    """The outputs must all be tensors (``None``, numbers and strings cannot be an artifact's outputs)."""
    out = next(n for n in graph.nodes if n.op == "output")
    flat, _ = torch.utils._pytree.tree_flatten(out.args[0])
    bad = [(i, v) for i, v in enumerate(flat) if not isinstance(v, torch.fx.Node)]
    if not bad:
        return
    listed = ", ".join(f"output {i} of {len(flat)} is {v!r:.40}" for i, v in bad[:3])
    raise ModelFaultError(f"forward ({name}) returns values that are not tensors ({listed})",
                          where=forward_location(module), hint=_OUTPUT_FIX)


def _written(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The arguments an in-place / out= op writes (its schema marks them), followed through views."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
            out.append(_base(value))
    return out


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a chain of views (view, slice, select, …) looks into."""
    seen = 0
    while node.op == "call_function" and seen < 64:
        schema = getattr(node.target, "_schema", None)
        first = schema.arguments[0] if schema is not None and schema.arguments else None
        if first is None or first.alias_info is None or first.alias_info.is_write \
                or not node.args or not isinstance(node.args[0], torch.fx.Node):
            break
        node, seen = node.args[0], seen + 1
    return node


def _site(node: torch.fx.Node) -> str | None:
    """``file:line (code)`` of the user's line that made ``node``, and its module path."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [i for i, ln in enumerate(trace) if ln.strip().startswith("File ")
              and "/torch/" not in ln and "/mlcomp/" not in ln]
    where = None
    if frames:
        head = trace[frames[-1]].strip()
        code = trace[frames[-1] + 1].strip() if frames[-1] + 1 < len(trace) else ""
        path, _, rest = head.removeprefix('File "').partition('", line ')
        where = f"{path}:{rest.split(',')[0]} ({code})"
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        module_path = list(stack.values())[-1][0] or "<root>"
        where = f"{where}, module {module_path}" if where else f"module {module_path}"
    return where


def check_no_mutation(ep: "torch.export.ExportedProgram", name: str) -> None:
    """Inference must not update a buffer or an input in place: eager's side effect is no output of a graph."""
    sig = ep.graph_signature
    owner = {s.arg.name: f"input {s.arg.name}" if s.kind.name == "USER_INPUT" else f"{s.kind.name.lower()} {s.target}"
             for s in sig.input_specs if hasattr(s.arg, "name")}
    lost = [f"buffer {b}" for b in getattr(sig, "buffers_to_mutate", {}).values()]
    lost += [f"input {i}" for i in getattr(sig, "user_inputs_to_mutate", {}).values()]
    check_graph_mutation(ep.graph, owner, name, lost)


def check_graph_mutation(graph: torch.fx.Graph, owner: dict[str, str], name: str, lost: Sequence[str] = (),
                         where: str | None = None) -> None:
    """No op of ``graph`` writes a placeholder named in ``owner`` (placeholder name → "buffer b", "input x")."""
    found: list[tuple[str, torch.fx.Node | None]] = []
    for node in graph.nodes:
        if node.op == "call_function":
            found += [(owner[w.name], node) for w in _written(node) if w.op == "placeholder" and w.name in owner]
    found += [(what, None) for what in lost]
    if not found:
        return
    what, node = found[0]
    raise ModelFaultError(
        f"forward ({name}) updates {what} in place; a compiled inference graph computes outputs only, so the "
        "update would be lost (eager PyTorch keeps it)", where=(_site(node) if node is not None else None) or where,
        hint="compute a new tensor instead (y = x * 2, not x.mul_(2)); keep running statistics out of the "
             "inference forward, or compile the training step with --train")


def eager_fault(exc: BaseException, inputs: Sequence[Any], name: str) -> ModelFaultError:
    """Eager PyTorch fails on the example inputs too: the model and its inputs disagree, not mlcomp."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    shapes = ", ".join(f"{'x'.join(map(str, t.shape))}:{str(t.dtype).removeprefix('torch.')}" for t in tensors)
    as_float = " ".join(f"--input-shape {'x'.join(map(str, t.shape))}:f32" for t in tensors)
    integer = any(not (t.is_floating_point() or t.is_complex()) for t in tensors)
    hint = (f"the model computes in floating point: give float inputs ({as_float}) or convert them inside "
            "forward (x.float())" if integer and "dtype" in str(exc) else
            "give inputs the model accepts (the shapes and dtypes its first layer expects, --input-shape)")
    return ModelFaultError(
        f"forward ({name}) fails in eager PyTorch too on its example inputs ({shapes}): "
        f"{type(exc).__name__}: {first_line(exc)}", where=user_frame(exc), hint=hint)


def train_mode_notes(module: nn.Module, name: str) -> list[str]:
    """One note when ``module`` comes in train() mode with modules that train() changes; inference compiles eval().

    >>> train_mode_notes(nn.Sequential(nn.Linear(2, 2), nn.Dropout()).train(), "f.py:fn")[0][:54]
    'the model of f.py:fn is in train() mode (Dropout at 1)'
    """
    changed = [(path or "<root>", type(m).__name__) for path, m in module.named_modules()
               if m.training and isinstance(m, TRAIN_SENSITIVE)]
    if not changed:
        return []
    listed = ", ".join(f"{kind} at {path}" for path, kind in changed[:3]) + (" …" if len(changed) > 3 else "")
    return [f"the model of {name} is in train() mode ({listed}); it is compiled in eval() mode, as "
            "inference runs (no dropout, running statistics); call model.eval() in the factory to silence "
            "this, or compile a training step with --train"]
