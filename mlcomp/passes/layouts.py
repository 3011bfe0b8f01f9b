"""A run of reshapes and permutes as at most one reshape, one permute and one reshape.

The run is read as moves of "atoms": the input's axes cut where any reshape of the
run cuts them.  The atoms that stay next to each other in the same order from the
input to the output merge, and what is left is a reshape into the atoms, the one
permute that orders them, and a reshape to the output::

    >>> compose((8, 2, 32), [("permute", [1, 0, 2]), ("reshape", [2, 8, 4, 8]),
    ...                      ("permute", [0, 2, 1, 3])])
    [('reshape', [8, 8, 8]), ('permute', [1, 0, 2]), ('reshape', [2, 4, 8, 8])]
    >>> compose((2, 8, 32), [("reshape", [16, 32]), ("reshape", [2, 8, 4, 8])])
    [('reshape', [2, 8, 4, 8])]
    >>> compose((6,), [("reshape", [4, -1])]) is None      # only concrete sizes that divide
    True

Size-1 axes are no atoms.  ``keep_ones=True``: where the output's other sizes are the
permuted atoms (or the input's are the atoms), the permute keeps the size-1 axes in place at
that rank instead of a reshape adding (or dropping) them.  At batch 1 the heads' permute then
is the 4-d ``[0, 2, 1, 3]`` OpenVINO takes into its attention kernel, not a 3-d one and an
unsqueeze (ONNX Runtime, on an attention left as products, fuses the 3-d one into them)::

    >>> split = [("reshape", [16, 4, 16]), ("permute", [1, 0, 2]), ("reshape", [1, 4, 16, 16])]
    >>> compose((16, 64), split)
    [('reshape', [16, 4, 16]), ('permute', [1, 0, 2]), ('reshape', [1, 4, 16, 16])]
    >>> compose((16, 64), split, keep_ones=True)
    [('reshape', [1, 16, 4, 16]), ('permute', [0, 2, 1, 3])]
    >>> compose((1, 4, 16, 16), [("reshape", [4, 16, 16]), ("permute", [1, 0, 2]), ("reshape", [16, 64])],
    ...         keep_ones=True)
    [('permute', [0, 2, 1, 3]), ('reshape', [16, 64])]

:func:`fold_run` rewrites a run of graph nodes so, size-1 axes kept (``fuse-attention``
on the runs into and out of an attention).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.passes import patterns as P

__all__ = ["compose", "fold_run", "layout_step", "run_before"]

Step = tuple[str, list[int]]
RESHAPES = P.SHAPE_OPS | P.SQUEEZE_OPS | {P.UNSQUEEZE}


class _Atoms:
    """Atom sizes, and the atoms an atom was cut into."""

    def __init__(self) -> None:
        self.size: list[int] = []
        self.cut: dict[int, tuple[int, int]] = {}

    def new(self, size: int) -> int:
        self.size.append(size)
        return len(self.size) - 1

    def leaves(self, atoms: Sequence[int]) -> list[int]:
        out: list[int] = []
        for a in atoms:
            out += self.leaves(self.cut[a]) if a in self.cut else [a]
        return out


def _regroup(atoms: _Atoms, flat: list[int], shape: Sequence[int]) -> list[list[int]] | None:
    """``flat`` (atoms in order) grouped into dims of ``shape``, cutting atoms where a dim ends inside one."""
    flat, dims = list(flat), []
    for size in shape:
        group, prod = [], 1
        while prod < size and flat:
            a = flat.pop(0)
            if size % (prod * atoms.size[a]) == 0:
                group.append(a)
                prod *= atoms.size[a]
                continue
            need = size // prod
            if size % prod or atoms.size[a] % need:
                return None
            first, rest = atoms.new(need), atoms.new(atoms.size[a] // need)
            atoms.cut[a] = (first, rest)
            group.append(first)
            flat.insert(0, rest)
            prod = size
        if prod != size:
            return None
        dims.append(group)
    return dims if not flat else None


def compose(shape: Sequence[int], steps: Sequence[Step], *, keep_ones: bool = False) -> list[Step] | None:
    """``steps`` (``("reshape", sizes)``, ``("permute", dims)``) on a tensor of ``shape``, as at most a reshape,
    a permute and a reshape (identities left out); None when a size is not a positive concrete number.
    ``keep_ones``: the permute keeps size-1 axes where that saves a reshape (module docstring)."""
    if any(not isinstance(d, int) or d < 1 for d in shape):
        return None
    atoms = _Atoms()
    source = [[atoms.new(d)] if d > 1 else [] for d in shape]
    dims, out = [list(g) for g in source], list(shape)
    for kind, arg in steps:
        if kind == "permute":
            dims, out = [dims[d % len(dims)] for d in arg], [out[d % len(out)] for d in arg]
            continue
        if any(not isinstance(d, int) or d < 1 for d in arg) or math.prod(arg) != math.prod(out):
            return None
        grouped = _regroup(atoms, [a for g in dims for a in atoms.leaves(g) if atoms.size[a] > 1],
                           [d for d in arg])
        if grouped is None:
            return None
        dims, out = grouped, list(arg)
    return _emit(atoms, atoms.leaves([a for g in source for a in g]),
                 atoms.leaves([a for g in dims for a in g]), list(shape), out, keep_ones)


def _emit(atoms: _Atoms, src: list[int], dst: list[int], shape: list[int], out: list[int],
          keep_ones: bool) -> list[Step]:
    """Reshape into merged atoms, permute them into ``dst``'s order, reshape to ``out``."""
    follows = {src[i]: src[i + 1] for i in range(len(src) - 1)}
    runs: list[list[int]] = []
    for a in dst:
        if runs and follows.get(runs[-1][-1]) == a:
            runs[-1].append(a)
        else:
            runs.append([a])
    start = {run[0]: i for i, run in enumerate(runs)}
    order = [start[a] for a in src if a in start]                  # runs in source order
    merged = [math.prod(atoms.size[a] for a in runs[i]) for i in order]
    perm = [order.index(i) for i in range(len(runs))]
    result: list[Step] = []
    if perm != sorted(perm):
        if keep_ones:
            merged, perm = _with_ones(merged, perm, shape, out)
        if merged != shape:
            result.append(("reshape", merged))
        result.append(("permute", perm))
        permuted = [merged[p] for p in perm]
    else:
        permuted = shape
    if permuted != out:
        result.append(("reshape", out))
    return result


def _with_ones(merged: list[int], perm: list[int], shape: list[int], out: list[int]) -> tuple[list[int], list[int]]:
    """The permute at the rank of ``out`` when its sizes other than 1 are the permuted runs (no reshape after),
    else at the rank of ``shape`` when its sizes other than 1 are the runs (no reshape before), each size-1
    axis staying where it is; else ``(merged, perm)`` as they are."""
    permuted = [merged[p] for p in perm]
    for ones, runs in ((out, permuted), (shape, merged)):
        if 1 in ones and [d for d in ones if d != 1] == runs:
            pos = [i for i, d in enumerate(ones) if d != 1]        # where the runs are, in order
            full, sizes = list(range(len(ones))), [1] * len(ones)
            for j, p in enumerate(perm):                            # run perm[j] goes from pos[perm[j]] to pos[j]
                full[pos[j]] = pos[p]
                sizes[pos[j]] = merged[j]
            return sizes, full
    return merged, perm


def layout_step(node: Node) -> Step | None:
    """``node`` as a step of a run: ``("reshape", its sizes)`` or ``("permute", dims)``; None for any other
    node, or one whose sizes are not concrete."""
    shape = getattr(node.meta, "shape", None)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    if node.op in RESHAPES:
        return "reshape", list(shape)
    perm = P.perm_of(node, len(shape))
    return ("permute", perm) if perm is not None else None


def run_before(graph: Graph, x: Any) -> tuple[Any, list[Node]]:
    """The value the layout run ending in ``x`` starts from, and that run (each node read only by the next)."""
    run: list[Node] = []
    while isinstance(x, Ref) and layout_step(node := graph.node(x.name)) is not None \
            and graph.num_users(x.name) == 1:
        run.append(node)
        x = node.inputs[0]
    return x, run[::-1]


def fold_run(graph: Graph, end: Node) -> bool:
    """The layout run ending in ``end`` (``end`` and the nodes before it that only the next one reads) as
    :func:`compose` writes it with ``keep_ones``, where that is fewer nodes; ``end`` keeps its name.  Whether it
    changed::

        %r = aten.reshape(%y, [16, 4, 16]);  %p = aten.permute(%r, [1, 0, 2]);  %v = aten.unsqueeze(%p, 0)
      becomes
        %v_reshape = aten.reshape(%y, [1, 16, 4, 16]);  %v = aten.permute(%v_reshape, [0, 2, 1, 3])
    """
    if layout_step(end) is None:
        return False
    source, run = run_before(graph, end.inputs[0])
    run.append(end)
    shape = getattr(graph.node(source.name).meta, "shape", None) if isinstance(source, Ref) else None
    composed = compose(tuple(shape), [layout_step(n) for n in run], keep_ones=True) if shape is not None else None
    if not composed or len(composed) >= len(run):
        return False
    value = source
    for i, (kind, arg) in enumerate(composed):
        op, inputs = P.RESHAPE if kind == "reshape" else P.PERMUTE, [value, arg]
        if i == len(composed) - 1:
            substitute(graph, end.name, op, inputs, origin=end.origin)
        else:
            value = Ref(new_node(graph, op, inputs, name=f"{end.name}_{kind}", origin=end.origin,
                                 before=end.name).name)
    remove_dead(graph, [n.name for n in run[:-1]])
    return True
