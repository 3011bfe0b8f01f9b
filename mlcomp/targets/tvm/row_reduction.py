"""The ``RowReduction`` rule: layer norm, softmax, mean/variance over a row, reduced a vector at a time.

DLight's CPU ``Reduction`` rule (TVM 0.27) walks each row's reduction one scalar at a time (LLVM
keeps a float sum in order, so it never vectorizes it).  This rule splits the row by ``w`` float
lanes and ``rfactor``\\ s the lane loop: each row is first reduced into ``w`` partial results, one
vector register, then the ``w`` partials into one; the elementwise blocks after the reductions
(the normalisation, ``exp``, the divide) run ``w`` lanes at a time, all under one loop over rows::

    before (DLight):  for row:  for k in range(256):  sum[row] += x[row, k]           (scalar)
                                for k in T.vectorized(...):  y[row, k] = (x[row, k] - mean) * ...
    after:            for row:  for lane in T.vectorized(16):  part[row, lane] = 0
                                for k0 in range(16):  for lane in T.vectorized(16):
                                    part[row, lane] += x[row, k0 * 16 + lane]
                                for lane in range(16):  sum[row] += part[row, lane]
                                for k0 in range(16):  for lane in T.vectorized(16):  y[row, k0 * 16 + lane] = ...

What it matches is :data:`BLOCK_STEPS`, one row per block kind; a float32 PrimFunc is taken only when every
block (after inlining what can be inlined) has a row there, at least one is a reduction, the last
one is elementwise, and each reduction's axis is the contiguous last axis of what it reads.  A
reduction down the columns (``x.mean(1)`` of ``[B, T, C]``: the contiguous axis is the output's) is
the ``"columns"`` row: ``for c0: for t: for c1 in T.vectorized(w): s[c0 * w + c1] += x[t, c0 * w + c1]``
(DLight's walks each column with a stride of a row).  The width ``w``
is the widest of ``lanes, lanes/2, …, 4`` (``lanes``: float32 lanes of the host's registers) that
divides the row (the columns), so every vector stays inside it and no lane needs a bound check; a row
that no such width divides (an odd row: 65 tokens) is left to DLight's rule.  Reducers ``rfactor``
cannot split (anything but sum, max, min, product) make the rule step aside the same way.
A parallel build gives the loop over rows to the cores when it holds at least ``parallel_min``
elements.  O(blocks × loops) per PrimFunc.
"""
from __future__ import annotations

from typing import Any

__all__ = ["BLOCK_STEPS", "MARK", "as_reductions", "inlined", "MIN_LANES", "row_reduction_rule", "row_reductions", "row_width"]

MARK = "mlcomp.row_reduction"   # root-block annotation of a PrimFunc this rule scheduled (value: its width)
OUT_ELEMWISE_FUSABLE, COMM_REDUCE = 4, 3    # TVM's OpPatternKind values
MIN_LANES = 4      # narrower than this, a row is not worth the partials: DLight's scalar walk

# block kind (DLight's dom_kind: S spatial, R reduction, leading S are the rows) -> what the rule does to it
BLOCK_STEPS: dict[str, str] = {
    "rows+R": "split the reduction by w, rfactor the lanes: w partials per row (vector), then their sum",
    "rows+S": "split the last axis by w, vectorize (the normalisation, exp, a divide)",
    "rows": "nothing: one value per row (a mean's divide, a row's max), computed at the row",
    "columns": "a reduction down the columns (a mean over tokens): w columns at a time, a vector of w sums "
               "walking down them, the epilogue on the same w",
}


def _kind(dom_kind: str, rows: int) -> str | None:
    """The :data:`BLOCK_STEPS` key of a block whose first ``rows`` axes are the rows, or None."""
    rest = dom_kind[rows:]
    return {"R": "rows+R", "S": "rows+S", "": "rows"}.get(rest)


def row_width(extent: int, lanes: int) -> int | None:
    """The vector width for a row of ``extent`` elements: the widest ``lanes / 2**i`` ≥ :data:`MIN_LANES`
    that divides it (None: none does).

    >>> row_width(256, 16), row_width(100, 16), row_width(20, 8), row_width(65, 16)
    (16, 4, 4, None)
    """
    w = lanes
    while w >= MIN_LANES:
        if extent % w == 0:
            return w
        w //= 2
    return None


def _static(sch: Any, loop: Any) -> int | None:
    from tvm import tirx

    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _row_axis_contiguous(block: Any) -> bool:
    """Whether ``block``'s reduction variable indexes only the last axis of every buffer it reads."""
    var = block.iter_vars[-1].var
    seen = False
    for region in block.reads:
        idx = [r.min for r in region.region]
        if any(_mentions(e, var) for e in idx[:-1]):
            return False
        seen = seen or (bool(idx) and _mentions(idx[-1], var))
    return seen


def _mentions(expr: Any, var: Any) -> bool:
    from tvm.tirx.analysis import undefined_vars

    return any(v.same_as(var) for v in undefined_vars(expr))


def _candidate(sch: Any, infos: list[Any] | None) -> bool:
    """What both plans need: float32 blocks, at least one a reduction, the last elementwise, and each
    block's loops static, one per axis."""
    if len(infos or ()) < 2 or not infos[-1].is_injective() or all(i.is_injective() for i in infos):
        return False
    if any(str(sch.get(i.block_rv).writes[0].source.dtype) != "float32" for i in infos):
        return False
    for info in infos:
        loops = sch.get_loops(info.block_rv)
        if len(loops) != len(info.dom_kind()) or any(_static(sch, lp) is None for lp in loops):
            return False
    return True


def _lanes(vector_bits: int) -> int:
    """float32 lanes of registers of ``vector_bits``."""
    return max(2, vector_bits // 32)


def _plan(sch: Any, infos: list[Any], lanes: int) -> tuple[int, int] | None:
    """``(rows, w)``: how many leading axes are the rows and the vector width, or None (not a row reduction).
    ``infos`` passed :func:`_candidate`."""
    kinds = [i.dom_kind() for i in infos]
    rows = min(len(k) - len(k.lstrip("S")) for k in kinds)
    if rows == 0 or any(k.endswith("R") and len(k) != rows + 1 for k in kinds):
        return None
    if any(_kind(k, rows) is None for k in kinds):
        return None
    widths = set()
    for info in infos:
        if info.dom_kind().endswith("R"):
            if not _row_axis_contiguous(sch.get(info.block_rv)):
                return None
            widths.add(row_width(_static(sch, sch.get_loops(info.block_rv)[-1]), lanes))
    if None in widths or len(widths) != 1:
        return None
    return rows, widths.pop()


def _work(sch: Any, infos: list[Any]) -> int:
    """The largest iteration space among the blocks (the elements a reduction reads)."""
    most = 0
    for info in infos:
        size = 1
        for loop in sch.get_loops(info.block_rv):
            size *= _static(sch, loop)
        most = max(most, size)
    return most


def _schedule(sch: Any, infos: list[Any], rows: int, w: int, parallel_min: int | None) -> None:
    """The steps of :data:`BLOCK_STEPS` (module docstring), in place on ``sch``."""
    last = infos[-1].block_rv
    loops = sch.get_loops(last)
    size, count = _work(sch, infos), 1
    for loop in loops[:rows]:
        count *= _static(sch, loop)
    row = sch.fuse(*loops[:rows]) if rows > 1 else loops[0]
    partials = {}
    for info in infos[:-1]:
        if info.dom_kind().endswith("R"):
            _, lane = sch.split(sch.get_loops(info.block_rv)[-1], factors=[None, w])
            ndim = len(sch.get(info.block_rv).writes[0].source.shape)
            partials[id(info)] = sch.rfactor(lane, factor_axis=ndim)
    for info in reversed(infos[:-1]):
        sch.compute_at(info.block_rv, row, preserve_unit_loops=False)
        if id(info) in partials:
            sch.compute_at(partials[id(info)], row, preserve_unit_loops=False)
    if parallel_min is not None and count >= 2 and size >= parallel_min:
        sch.parallel(row)      # before decompose_reduction: a parallel loop's blocks must keep their init
    for info in infos:
        block = partials.get(id(info))
        if block is not None:          # loops: row, lane, k0 -> row, k0, lane (lane vectorized)
            lane, k0 = sch.get_loops(block)[-2:]
            sch.reorder(k0, lane)
            sch.vectorize(lane)
            init = sch.decompose_reduction(block, k0)
            sch.vectorize(sch.get_loops(init)[-1])
        elif _kind(info.dom_kind(), rows) == "rows+S":
            inner = sch.get_loops(info.block_rv)[-1]
            if (_static(sch, inner) or 0) % w == 0:
                _, vec = sch.split(inner, factors=[None, w])
                sch.vectorize(vec)


def _column_plan(sch: Any, infos: list[Any], lanes: int) -> tuple[int, int] | None:
    """``(rows, w)`` for reductions down columns (``"columns"`` of :data:`BLOCK_STEPS`), or None.
    ``infos`` passed :func:`_candidate`."""
    last = infos[-1]
    rows = len(last.dom_kind())
    if any(i.dom_kind() not in ("S" * rows, "S" * rows + "R") for i in infos):
        return None
    for info in infos:
        block = sch.get(info.block_rv)
        if info.dom_kind().endswith("R"):
            red, col = block.iter_vars[-1].var, block.iter_vars[-2].var
            ends = [r.region[-1].min for r in block.reads if r.region]
            if any(_mentions(e, red) for e in ends) or not any(_mentions(e, col) for e in ends):
                return None
    w = row_width(_static(sch, sch.get_loops(last.block_rv)[-1]), lanes)
    return None if w is None else (rows, w)


def _column_schedule(sch: Any, infos: list[Any], rows: int, w: int, parallel_min: int | None) -> None:
    """Columns ``w`` at a time: each reduction walks down its column block with a vector of ``w`` sums."""
    size, loops = _work(sch, infos), sch.get_loops(infos[-1].block_rv)
    count = _static(sch, loops[-1]) // w
    for loop in loops[:-1]:
        count *= _static(sch, loop)
    col, lane = sch.split(loops[-1], factors=[None, w])
    sch.vectorize(lane)
    outer = sch.fuse(*loops[:-1], col) if rows > 1 else col
    for info in reversed(infos[:-1]):
        sch.compute_at(info.block_rv, outer, preserve_unit_loops=False)
    if parallel_min is not None and count >= 2 and size >= parallel_min:
        sch.parallel(outer)
    for info in infos[:-1]:
        inner = sch.get_loops(info.block_rv)
        if info.dom_kind().endswith("R"):          # loops: outer, lane, k -> outer, k, lane (lane vectorized)
            sch.reorder(inner[-1], inner[-2])
            sch.vectorize(inner[-2])
            init = sch.decompose_reduction(info.block_rv, inner[-1])
            sch.vectorize(sch.get_loops(init)[-1])
        elif _static(sch, inner[-1]) == w:
            sch.vectorize(inner[-1])


def inlined(rule: Any, func: Any, target: Any) -> tuple[Any, list[Any]] | None:
    """A schedule of ``func`` with its injective blocks inlined and what blocks remain, or None when
    ``rule`` does not apply (not a PrimFunc, another target, nothing DLight can normalise)."""
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.base.common_schedules import try_inline

    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if not infos:
        return None
    return sch, try_inline(sch, list(infos))


def row_reduction_rule(vector_bits: int, parallel_min: int | None) -> Any:
    """The :class:`RowReduction` DLight rule for registers of ``vector_bits`` (``parallel_min=None``: serial)."""
    from tvm import s_tir
    from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

    class RowReduction(CPUScheduleRule):
        """Vector partials per row for each reduction, vector epilogues, one loop over rows."""

        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            prepared = inlined(self, func, target)
            if prepared is None:
                return None
            sch, infos = prepared
            if not _candidate(sch, infos):
                return None
            lanes = _lanes(vector_bits)
            plan, step = _plan(sch, infos, lanes), _schedule
            if plan is None:
                plan, step = _column_plan(sch, infos, lanes), _column_schedule
            if plan is None:
                return None
            try:
                step(sch, infos, *plan, parallel_min)
            except s_tir.ScheduleError:     # a reducer rfactor cannot split, a block compute_at cannot move
                return None
            sch.annotate(sch.get_sblock("root"), MARK, plan[1])    # the width, for the build's stats
            return sch

    return RowReduction()


def as_reductions(mod: Any, vector_bits: int) -> tuple[Any, int]:
    """``mod`` (legalized, op patterns annotated) with each PrimFunc this rule would take marked a plain
    reduction (``op_pattern`` 3, ``kCommReduce``) instead of ``kOutEWiseFusable`` (4), and how many.

    ``AnnotateTIROpPattern`` calls a function with two chained reductions (layer norm, softmax)
    ``kOutEWiseFusable``, like a convolution, so ``FuseOps`` never folds the elementwise op before it
    (a residual add) into it: the add writes a tensor the norm reads back.  As a reduction it is folded
    in, and the rule inlines it into each pass over the row::

        before:  add = R.call_tir(add, (a, b));  y = R.call_tir(layer_norm, (add, gamma, beta))
        after:   y = R.call_tir(fused_add_layer_norm, (a, b, gamma, beta))
    """
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    changed = 0
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, tirx.PrimFunc) or func.attrs is None \
                or int(func.attrs.get("op_pattern", -1)) != OUT_ELEMWISE_FUSABLE:
            continue
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if _candidate(sch, infos) and _plan(sch, infos, _lanes(vector_bits)) is not None:
            mod[gv] = func.with_attr("op_pattern", COMM_REDUCE)
            changed += 1
    return mod, changed


def row_reductions(mod: Any) -> int:
    """How many PrimFuncs of ``mod`` :class:`RowReduction` scheduled (their root blocks carry :data:`MARK`)."""
    from tvm import tirx

    count = 0
    for func in mod.functions.values():
        body = func.body if isinstance(func, tirx.PrimFunc) else None
        block = getattr(body, "block", None)
        count += bool(block is not None and MARK in block.annotations)
    return count
