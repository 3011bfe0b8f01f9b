"""What a TorchScript model's inputs must be, read from the first op each input reaches.

When a TorchScript archive fails on the example inputs, mlcomp names the cause
instead of reporting a capture failure: which input, what was given, and what
the model's first use of it expects (count, dtype, rank), with an
``--input-shape`` that would work::

    bert_tiny.pt --input-shape 2x64   (ids given as f32)
    → input 1 (ids) is f32[2, 64], but the model's first use of it is aten::embedding
      (token ids into an embedding table), which needs an integer tensor (i64)
      hint: --input-shape 2x64:i64

The expectations are a table (:data:`FIRST_USE`): op → (argument position, what it
is, the dtypes it takes, the ranks it takes).  Inputs are followed through ops
that keep their kind (``aten::to``, views, slices…) until an op of the table reads
them; ``inlined_graph`` lets the walk see into submodules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mlcomp.base.errors import InputSpecError
from mlcomp.ir import dtype_name

__all__ = ["Expectation", "FIRST_USE", "check_script_inputs", "first_uses", "input_problem"]

_FLOAT = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INDEX = (torch.int64, torch.int32)


@dataclass(frozen=True)
class Expectation:
    what: str                           # "token ids into an embedding table"
    dtypes: tuple[torch.dtype, ...]     # the first is the one to suggest
    ranks: tuple[int, ...] = ()         # empty: any rank


# op -> (argument position of the input, expectation)
FIRST_USE: dict[str, tuple[int, Expectation]] = {
    "aten::embedding": (1, Expectation("token ids into an embedding table", _INDEX)),
    "aten::embedding_bag": (1, Expectation("token ids into an embedding table", _INDEX)),
    "aten::conv1d": (0, Expectation("a batch of 1-D signals (N, C, L)", _FLOAT, (3, 2))),
    "aten::conv2d": (0, Expectation("a batch of images (N, C, H, W)", _FLOAT, (4, 3))),
    "aten::conv3d": (0, Expectation("a batch of volumes (N, C, D, H, W)", _FLOAT, (5, 4))),
    "aten::_convolution": (0, Expectation("a batch for a convolution", _FLOAT)),
    "aten::linear": (0, Expectation("features into a linear layer", _FLOAT)),
    "aten::matmul": (0, Expectation("a matrix product operand", _FLOAT)),
    "aten::layer_norm": (0, Expectation("features into a layer norm", _FLOAT)),
    "aten::batch_norm": (0, Expectation("a batch into a batch norm", _FLOAT)),
    "aten::lstm": (0, Expectation("a sequence into an LSTM", _FLOAT, (3, 2))),
    "aten::gru": (0, Expectation("a sequence into a GRU", _FLOAT, (3, 2))),
}
# ops whose output is the input in another shape or device (the walk goes on through them)
_PASS = {"aten::to", "aten::view", "aten::reshape", "aten::slice", "aten::contiguous", "aten::unsqueeze",
         "aten::squeeze", "aten::select", "aten::expand", "aten::clone", "aten::detach", "aten::flatten",
         "aten::permute", "aten::transpose", "aten::type_as"}


def first_uses(module: Any) -> list[tuple[str, str, Expectation, str] | None]:
    """Per user input of a ScriptModule's forward: (name, op, expectation, source line) or None."""
    graph = module.inlined_graph
    out = []
    for value in list(graph.inputs())[1:]:                 # inputs()[0] is self
        found, frontier = None, [value]
        while frontier and found is None:
            uses = sorted((u for v in frontier for u in v.uses()), key=lambda u: _position(graph, u.user))
            frontier = []
            for use in uses:
                kind = use.user.kind()
                entry = FIRST_USE.get(kind)
                if entry is not None and entry[0] == use.offset:
                    found = (value.debugName().split(".")[0], kind, entry[1], _line(use.user))
                    break
                if kind in _PASS and use.offset == 0:
                    frontier.extend(use.user.outputs())
        out.append(found)
    return out


def _position(graph: Any, node: Any) -> int:
    return _order(graph).get(node, 1 << 30)


_ORDERS: dict[int, dict[Any, int]] = {}


def _order(graph: Any) -> dict[Any, int]:
    key = id(graph)
    if key not in _ORDERS:
        _ORDERS.clear()
        _ORDERS[key] = {n: i for i, n in enumerate(graph.nodes())}
    return _ORDERS[key]


def _line(node: Any) -> str:
    text = (node.sourceRange() or "").strip().splitlines()
    return text[0].strip() if text else ""


def _spec(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    shape = "x".join(map(str, t.shape)) or "1"
    return f"{shape}:{dtype_name(dtype or t.dtype)}"


def check_script_inputs(module: Any, inputs: Sequence[torch.Tensor], *, name: str, path: str | None,
                        run: bool = False) -> None:
    """Raise :class:`InputSpecError` when ``inputs`` do not fit ``module`` (``run``: also run it once)."""
    problem = input_problem(module, inputs)
    if problem is not None:
        what, where, hint = problem
        raise InputSpecError(f"{name}: {what}", where=f"{path or name}: {where}", hint=hint)
    if not run:
        return
    try:
        with torch.no_grad():
            module(*inputs)
    except Exception as exc:  # noqa: BLE001 - any failure here is about the inputs or the model
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        cause = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else type(exc).__name__)
        given = " ".join(f"--input-shape {_spec(t)}" for t in inputs)
        raise InputSpecError(f"{name} fails on the given inputs ({given}): {cause}", where=path or name,
                             hint="give one --input-shape per forward argument, in order, with its dtype "
                                  "(e.g. 2x64:i64 for token ids, 1x3x224x224:f32 for images)") from None


def input_problem(module: Any, inputs: Sequence[torch.Tensor]) -> tuple[str, str, str] | None:
    """``(what is wrong, where, hint)`` when the inputs do not fit the model's first uses, else ``None``."""
    try:
        uses = first_uses(module)
    except Exception:  # noqa: BLE001 - a graph we cannot read: no diagnosis
        return None
    if len(uses) != len(inputs):
        specs = []
        for i, use in enumerate(uses):
            given = inputs[i] if i < len(inputs) else None
            dtype = use[2].dtypes[0] if use else (given.dtype if given is not None else torch.float32)
            specs.append(f"--input-shape {_spec(given, dtype) if given is not None else '1:' + dtype_name(dtype)}")
        names = ", ".join(u[0] if u else f"input {i + 1}" for i, u in enumerate(uses))
        return (f"the model takes {len(uses)} input(s) ({names}) but {len(inputs)} were given",
                "forward's signature", "give one --input-shape per input, e.g. " + " ".join(specs))
    for i, (use, t) in enumerate(zip(uses, inputs)):
        if use is None:
            continue
        name, op, need, line = use
        wrong_dtype = t.dtype not in need.dtypes
        wrong_rank = bool(need.ranks) and t.dim() not in need.ranks
        if not (wrong_dtype or wrong_rank):
            continue
        want = (f"an integer tensor ({'/'.join(dtype_name(d) for d in need.dtypes)})" if need.dtypes == _INDEX
                else f"a floating-point tensor ({'/'.join(dtype_name(d) for d in need.dtypes)})")
        if wrong_rank:
            want += f" of rank {' or '.join(map(str, need.ranks))}"
        given = f"{dtype_name(t.dtype)}[{', '.join(map(str, t.shape))}]"
        example = _spec(t, t.dtype if not wrong_dtype else need.dtypes[0])
        hint = (f"give it as --input-shape {example}" if not wrong_rank else
                f"give a shape of rank {need.ranks[0]} with dtype {dtype_name(need.dtypes[0] if wrong_dtype else t.dtype)}"
                f", e.g. --input-shape {'x'.join(['1'] * need.ranks[0])}:{dtype_name(need.dtypes[0] if wrong_dtype else t.dtype)}")
        where = f"input {name} → {op}" + (f" at {line}" if line and "/torch/" not in line else "")
        return (f"input {i + 1} ({name}) is {given}, but the model's first use of it is {op} ({need.what}), "
                f"which needs {want}", where, hint)
    return None
