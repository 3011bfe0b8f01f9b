"""Which input sizes are symbolic, under which names and ranges: ``--dynamic batch,seq=8..512``.

Each entry of the spec is ``NAME[@DIM][=MIN..MAX]``: the size ``DIM`` of every tensor input
of rank above ``DIM`` is the symbol ``NAME``.  ``batch`` is dim 0 and ``seq`` (``sequence``,
``tokens``, ``length``) dim 1 unless ``@DIM`` says otherwise (:data:`AXES`); a missing range
is ``1..`` (no upper bound).  ``--dynamic-batch`` is ``--dynamic batch``.

>>> parse_dynamic("batch,seq=8..512")
(DynamicDim(name='batch', dim=0, range=SizeRange(lo=1, hi=None)), DynamicDim(name='seq', dim=1, range=SizeRange(lo=8, hi=512)))
>>> parse_dynamic("heads@2=1..16")[0].dim
2

Capture exports with one ``torch.export.Dim`` per entry (:func:`export_dims`); the captured
graph's symbols, which torch names ``s0``, ``s77``…, are then renamed after the entries
(:func:`name_symbols`), and each symbol's range is what torch proved for it
(:func:`note_symbol`, from the program's shape environment: export's ``range_constraints``,
or Dynamo's ranges for its ``SymInt`` sizes).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mlcomp.base.errors import InputSpecError
from mlcomp.ir import Graph, TensorMeta
from mlcomp.ir.symbols import SizeRange, rename_symbols

__all__ = ["AXES", "DynamicDim", "parse_dynamic", "export_dims", "graph_dims", "widen_examples", "name_symbols", "note_symbol",
           "rename_graph_symbols"]

AXES = {"batch": 0, "seq": 1, "sequence": 1, "tokens": 1, "length": 1}    # a name's default dimension
_ENTRY = re.compile(r"(?P<name>[A-Za-z_]\w*)(?:@(?P<dim>\d+))?(?:=(?P<range>[^,]*))?")
_HINT = "write --dynamic NAME[@DIM][=MIN..MAX],… e.g. --dynamic batch,seq=8..512 or --dynamic heads@2=1..16"


@dataclass(frozen=True)
class DynamicDim:
    """Dimension ``dim`` of every input of higher rank is the symbol ``name``, within ``range``."""

    name: str
    dim: int
    range: SizeRange


def parse_dynamic(spec: Any) -> tuple[DynamicDim, ...]:
    """``spec`` (text, ``True`` for ``batch``, ``None``/``False`` for none, or DynamicDims) as DynamicDims."""
    if spec is None or spec is False or spec == "":
        return ()
    if spec is True:
        spec = "batch"
    if not isinstance(spec, str):
        return tuple(spec)
    out: list[DynamicDim] = []
    for text in (t.strip() for t in spec.split(",")):
        m = _ENTRY.fullmatch(text)
        if m is None:
            raise InputSpecError(f"--dynamic entry {text!r} is not NAME[@DIM][=MIN..MAX]", hint=_HINT)
        name = m["name"]
        if m["dim"] is None and name not in AXES:
            raise InputSpecError(f"--dynamic {name}: mlcomp does not know which dimension {name!r} is",
                                 hint=f"name the dimension with @DIM ({name}@2) or use one of {', '.join(AXES)}")
        dim = int(m["dim"]) if m["dim"] is not None else AXES[name]
        if any(d.name == name for d in out) or any(d.dim == dim for d in out):
            raise InputSpecError(f"--dynamic names {name!r} or dimension {dim} twice", hint=_HINT)
        try:
            size_range = SizeRange.parse(m["range"]) if m["range"] else SizeRange(1)
        except InputSpecError as exc:
            raise InputSpecError(f"--dynamic {text}: {exc.what}", hint=exc.hint) from None
        out.append(DynamicDim(name, dim, size_range))
    return tuple(out)


def widen_examples(dims: Sequence[DynamicDim], inputs: Sequence[Any]) -> tuple[Any, ...]:
    """Inputs whose size 1 along a dynamic dimension is doubled: torch.export fixes a size-1 dimension."""
    out = []
    for t in inputs:
        if isinstance(t, torch.Tensor):
            for d in dims:
                if t.dim() > d.dim and t.shape[d.dim] == 1 and (d.range.hi is None or d.range.hi >= 2):
                    t = torch.cat([t, t], dim=d.dim)
        out.append(t)
    return tuple(out)


def export_dims(dims: Sequence[DynamicDim], inputs: Sequence[Any], name: str) -> tuple[dict[int, Any], ...]:
    """``dynamic_shapes`` for ``torch.export``: one ``Dim`` per entry, at its dimension of each input.

    An example size outside its entry's range, or an entry no input has the dimension of, is
    refused here, before torch.export reports it its own way.
    """
    made = {d.name: torch.export.Dim(d.name, min=d.range.lo,
                                     **({"max": d.range.hi} if d.range.hi is not None else {})) for d in dims}
    out: list[dict[int, Any]] = []
    used: set[str] = set()
    for i, t in enumerate(inputs):
        entry: dict[int, Any] = {}
        for d in dims if isinstance(t, torch.Tensor) else ():
            if t.dim() > d.dim:
                size = int(t.shape[d.dim])
                if not d.range.contains(size):
                    raise InputSpecError(
                        f"--dynamic {d.name}={d.range}: the example input {i} of {name} has size {size} at dim "
                        f"{d.dim}, outside that range", hint="give an example size inside the range, or widen it")
                entry[d.dim] = made[d.name]
                used.add(d.name)
        out.append(entry)
    unused = [d.name for d in dims if d.name not in used]
    if unused:
        raise InputSpecError(f"--dynamic {', '.join(unused)}: no input of {name} has that dimension "
                             f"(ranks {[t.dim() for t in inputs if isinstance(t, torch.Tensor)]})", hint=_HINT)
    return tuple(out)


def graph_dims(graph: Graph) -> tuple[dict[int, Any], ...] | None:
    """``dynamic_shapes`` that export code generated from ``graph`` with its symbols (None: all static).

    One ``Dim`` per symbol, named and ranged as in the graph; an input size that is an expression
    of symbols is ``Dim.AUTO`` (torch finds the relation again).
    """
    if not any(n.tensor_meta.is_dynamic for n in graph.input_nodes):
        return None
    made: dict[str, Any] = {}
    for name, r in graph.ranges.items():
        made[name] = torch.export.Dim(name, min=r.lo, **({"max": r.hi} if r.hi is not None else {}))
    return tuple({axis: made.get(d, torch.export.Dim.AUTO) for axis, d in enumerate(n.tensor_meta.shape)
                  if isinstance(d, str)} for n in graph.input_nodes)


def note_symbol(graph: Graph, size: torch.SymInt) -> str:
    """``size``'s name; a plain symbol's example value and range (from its shape environment) join the graph."""
    sym = str(size)
    if re.fullmatch(r"[A-Za-z_]\w*", sym) and sym not in graph.ranges:
        node = size.node
        if node.has_hint():
            graph.symbols.setdefault(sym, int(node.hint))
        found = getattr(node.shape_env, "var_to_range", {}).get(node.expr)
        if found is not None:
            graph.ranges[sym] = SizeRange(max(_finite(found.lower) or 0, 0), _finite(found.upper))
    return sym


def _finite(bound: Any) -> int | None:
    """A sympy bound as an int; ``None`` for an infinite one (sympy's ``oo``, torch's ``int_oo``)."""
    text = str(bound)
    return None if "oo" in text else int(text)


def name_symbols(graph: Graph, dims: Sequence[DynamicDim]) -> Graph:
    """``graph`` with torch's symbol at each entry's dimension of its inputs renamed after the entry.

    The symbol's range is the entry's: torch.export proves ``2..`` where ``1..`` was asked (it
    assumes no dynamic size is 1), and verification at the range's ends checks size 1 itself.
    """
    mapping: dict[str, str] = {}
    for node in graph.input_nodes:
        shape = node.tensor_meta.shape
        for d in dims:
            if len(shape) > d.dim and isinstance(shape[d.dim], str):
                mapping.setdefault(shape[d.dim], d.name)
    for old, new in mapping.items():
        graph.ranges[old] = next(d.range for d in dims if d.name == new)
    return rename_graph_symbols(graph, mapping)


def rename_graph_symbols(graph: Graph, mapping: dict[str, str]) -> Graph:
    """``graph`` with each symbol of ``mapping`` renamed in every meta, its example values and its ranges."""
    mapping = {old: new for old, new in mapping.items() if old != new}
    if not mapping:
        return graph
    for node in list(graph.nodes()):
        if node.meta is not None:
            graph.replace(node.with_(meta=_renamed(node.meta, mapping)))
    graph.symbols = {mapping.get(k, k): v for k, v in graph.symbols.items()}
    graph.ranges = {mapping.get(k, k): v for k, v in graph.ranges.items()}
    return graph


def _renamed(meta: Any, mapping: dict[str, str]) -> Any:
    if isinstance(meta, TensorMeta):
        return TensorMeta(rename_symbols(meta.shape, mapping), meta.dtype, meta.device, meta.requires_grad)
    if isinstance(meta, tuple):
        return tuple(_renamed(m, mapping) for m in meta)
    return meta
