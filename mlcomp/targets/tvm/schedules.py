"""Default CPU schedules for what an untuned TVM build compiles itself (no MetaSchedule).

DLight's CPU rules (TVM 0.27) schedule matrix–vector products (``GEMV``) and
softmax/layer-norm shaped reductions (``Reduction``, a scalar walk per row; mlcomp's
:mod:`~mlcomp.targets.tvm.row_reduction` goes first and reduces a vector at a time); every other fused PrimFunc,
the elementwise epilogues after an offloaded convolution or GEMM, residual adds,
casts, pooling, ``mean``, stays a serial scalar loop nest.  :class:`ParallelVector`
is the rule for those: inline every injective block it can into its consumer, then
for each block left give its fused leading spatial loops to the cores (``parallel``)
and, for an injective block whose innermost loop the lanes divide, run that loop at
the host's vector width.
The width comes from :func:`mlcomp.hardware.probe.vector_bits` (256 bits on AVX2:
8 float32 lanes), never from an assumption::

    before:  for ax0, ax1, ax2, ax3 in T.grid(32, 64, 56, 56):
                 with T.sblock("T_relu"): ...  T_relu[v0, v1, v2, v3] = T.max(lv[v0, v1, v2, v3] + b[v1], 0)
    after:   for ax0_ax1_ax2_fused in T.parallel(114688):
                 for ax3_0 in range(7):
                     for ax3_1 in T.vectorized(8): ...            (8 float32 lanes, contiguous loads)

Small funcs (fewer than :data:`PARALLEL_MIN` output elements) are vectorized but not
parallelised: waking the thread pool costs more than the work.

Serial builds (``default_rules(..., parallel=False)``): when the module calls torch's
kernels (:mod:`mlcomp.targets.tvm.offload.rewrite`), torch's OpenMP pool owns the cores and TVM
adds no parallel loop at all: TVM's workers busy-wait after every parallel region while
torch's next kernel wants the same cores.  A larger :data:`PARALLEL_MIN` does not help: one
parallel region is enough to start the spinning pool (figures in ``benchmarks/RESULTS.md``).
ParallelVector then only vectorizes, and DLight's GEMV/Reduction rules are wrapped by
:func:`without_parallel`, which replays their schedule minus its ``parallel`` steps::

    parallel=True:   for ax0 in T.parallel(64):  for ax1_0 in range(64): for ax1_1 in T.vectorized(8): ...
    parallel=False:  for ax0 in range(64):       for ax1_0 in range(64): for ax1_1 in T.vectorized(8): ...

Serial builds also start with :func:`small_matmul_rule` (``SmallMatmul``), for the small float32
GEMMs :mod:`mlcomp.targets.tvm.offload.gemm` measured faster as TVM code than as torch calls: rows by up to
4 (unrolled), columns by one or two vectors, the reduction serial, the fused epilogue at the tile::

    for i0, j0:  for k:  for i1 in T.unroll(4):  for j1 in T.vectorized(16):  C[i, j] += A[i, k] * B[k, j]
                 for i1:  for j1 in T.vectorized(16):  out[i, j] = C[i, j] + bias[j]

A one-row product (batch 1, where DLight normalises ``i`` away) is the same without the row tile;
DLight's GEMV would instead reduce each output over a column of the ``[K, N]`` weight, a K-long
walk with a stride of N floats, scalar::

    for j0:  for k:  for j1 in T.vectorized(32):  C[0, j] += A[0, k] * B[k, j]

With no parallel loop the VM never starts TVM's thread pool, so nothing about it (its size,
its spinning, the core it pins its workers to) touches the process.  Each rule looks at a
PrimFunc once: O(blocks × loops).
"""
from __future__ import annotations

from typing import Any

from mlcomp.targets.tvm.offload.policy import rule
from mlcomp.targets.tvm.row_reduction import inlined, row_reduction_rule

__all__ = ["PARALLEL_MIN", "default_rules", "parallel_loops", "parallel_vector_rule", "schedule_counts",
           "small_matmul_rule", "without_parallel"]

# output elements below which a loop nest is not worth the thread pool's wake-up (~a few µs)
PARALLEL_MIN = rule("parallel-loop").min_size


def _extent(sch: Any, loop: Any) -> int | None:
    from tvm import tirx

    extent = sch.get(loop).extent
    return int(extent) if isinstance(extent, tirx.IntImm) else None


def _rule_base() -> type:
    from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

    return CPUScheduleRule


def parallel_vector_rule(vector_bits: int, parallel_min: int | None = PARALLEL_MIN) -> Any:
    """The :class:`ParallelVector` rule (a DLight ``ScheduleRule``) for registers of ``vector_bits``.

    ``parallel_min=None``: never parallel (vector loops only).
    """

    class ParallelVector(_rule_base()):
        """Inline injective blocks; parallel leading spatial loops; vectorize injective inner loops."""

        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            prepared = inlined(self, func, target)
            if prepared is None:
                return None
            sch, infos = prepared
            for info in infos:
                _schedule_block(sch, info, vector_bits, parallel_min)
            return sch

    return ParallelVector()


def _schedule_block(sch: Any, info: Any, vector_bits: int, parallel_min: int | None) -> None:
    """Parallel + vector loops for one block that could not be inlined (see the module docstring).

    Only the block's own innermost loop is split for the vector lanes (and only when the
    lanes divide it), so a vector load stays a contiguous load: splitting a fused loop
    would index each lane with divisions and moduli that LLVM turns into gathers.
    """
    kinds = info.dom_kind()
    loops = sch.get_loops(info.block_rv)
    if not loops or len(loops) != len(kinds):
        return
    lead = len(kinds) - len(kinds.lstrip("S"))
    if lead == 0:
        return
    stmt = sch.get(info.block_rv)
    bits = stmt.writes[0].source.dtype.bits if stmt.writes else 32
    lanes = max(2, vector_bits // max(bits, 8))
    total = 1
    for loop in loops[:lead]:
        extent = _extent(sch, loop)
        if extent is None:
            return
        total *= extent
    if info.is_injective() and lead == len(loops) and (_extent(sch, loops[-1]) or 0) % lanes == 0:
        _, vec = sch.split(loops[-1], factors=[None, lanes])
        sch.vectorize(vec)
        loops = sch.get_loops(info.block_rv)
        lead = len(loops) - 1
    outer = loops[:lead]          # the leading spatial loops (not the vector loop split off above)
    if parallel_min is not None and total >= parallel_min and outer:
        fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
        if (_extent(sch, fused) or 0) >= 2:
            sch.parallel(fused)


def without_parallel(rule: Any) -> Any:
    """``rule`` (a DLight CPU ``ScheduleRule``) with the ``parallel`` steps of its schedules left out.

    The rule schedules as usual; its trace is then replayed on a fresh schedule of the same
    PrimFunc, skipping every ``Parallel`` instruction (it returns nothing, so no later step
    refers to it).  Loops it would have given to the cores stay serial; splits, vector
    loops, ``compute_at`` and unrolling are kept.
    """
    from tvm import s_tir
    from tvm.s_tir.schedule import Trace

    def serial(func: Any, sch: Any) -> Any:
        trace = sch.trace
        insts = [inst for inst in trace.insts if inst.kind.name != "Parallel"]
        if len(insts) == len(trace.insts):
            return sch
        decisions = {inst: trace.get_decision(inst) for inst in insts if trace.get_decision(inst) is not None}
        out = s_tir.Schedule(func)
        Trace(insts, decisions).apply_to_schedule(out, remove_postproc=False)
        return out

    class Serial(_rule_base()):
        """A DLight rule whose schedules run on the calling thread only."""

        def apply(self, func: Any, target: Any, tunable: bool) -> Any:
            got = rule.apply(func, target, tunable)
            if got is None:
                return None
            if isinstance(got, list):
                return [serial(func, sch) for sch in got]
            return serial(func, got)

        def is_target_available(self, target: Any) -> bool:
            return rule.is_target_available(target)

    return Serial()


def default_rules(target: Any, vector_bits: int, *, parallel: bool = True) -> list[Any]:
    """The rules an untuned build applies, first match wins: DLight GEMV, mlcomp's RowReduction
    (:mod:`~mlcomp.targets.tvm.row_reduction`: layer norm, softmax, row means a vector at a time),
    DLight's Reduction (what RowReduction leaves: odd rows, column reductions), then ParallelVector.

    ``parallel=False``: the same schedules without parallel loops (see the module docstring), after
    :func:`~mlcomp.targets.tvm.offload.gemm.small_matmul_rule` for the small GEMMs the build kept as TVM code.
    CUDA keeps DLight's GPU rules (Matmul, GEMV, Reduction, GeneralReduction, Fallback).
    """
    from tvm.s_tir import dlight as dl

    if target.kind.name == "cuda":
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    if not parallel:   # small GEMMs kept as TVM code (tvm_gemm) only exist in these builds
        return [small_matmul_rule(vector_bits), without_parallel(dl.cpu.GEMV()),
                row_reduction_rule(vector_bits, parallel_min=None), without_parallel(dl.cpu.Reduction()),
                parallel_vector_rule(vector_bits, parallel_min=None)]
    return [dl.cpu.GEMV(), row_reduction_rule(vector_bits, PARALLEL_MIN), dl.cpu.Reduction(),
            parallel_vector_rule(vector_bits)]


def schedule_counts(mod: Any) -> dict[str, int]:
    """How many PrimFuncs of ``mod`` were scheduled and how many were left as plain loop nests."""
    from tvm import tirx

    counts = {"scheduled": 0, "unscheduled": 0}
    for func in mod.functions.values():
        if isinstance(func, tirx.PrimFunc):
            counts["scheduled" if func.attrs and func.attrs.get("tirx.is_scheduled", False) else "unscheduled"] += 1
    return counts


def parallel_loops(mod: Any) -> int:
    """How many ``T.parallel`` loops the PrimFuncs of ``mod`` hold (read from their TVMScript)."""
    from tvm import tirx

    return sum(func.script().count("T.parallel(") for func in mod.functions.values()
               if isinstance(func, tirx.PrimFunc))


def small_matmul_rule(vector_bits: int) -> Any:
    """The :class:`SmallMatmul` DLight rule: register-tiled float32 ``matmul`` (+ fused epilogue), serial."""
    from tvm import tirx
    from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

    lanes = max(1, vector_bits // 32)

    class SmallMatmul(CPUScheduleRule):
        """Rows by up to 4, columns by one or two vectors, the reduction serial; the epilogue at the tile."""

        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            if not isinstance(func, tirx.PrimFunc) or not _one_matmul(func):   # cheap look first
                return None
            prepared = inlined(self, func, target)
            if prepared is None:
                return None
            sch, infos = prepared
            if not infos or infos[0].dom_kind() != "S" * (len(infos[0].dom_kind()) - 1) + "R" \
                    or any(not i.is_injective() for i in infos[1:]):
                return None
            mm = infos[0].block_rv
            shape = _matmul_extents(sch.get(mm))
            if shape is None or (shape[1] % lanes and shape[1] > 2 * lanes):
                return None
            m, n = shape
            # a narrow N that the lanes do not divide (a 10-tag head, 17 tokens) is one odd-width vector
            nj = 2 * lanes if n % (2 * lanes) == 0 else lanes if n % lanes == 0 else n
            if len(sch.get(mm).iter_vars) == 2:      # one row (batch 1): DLight normalised the unit i away
                j, k = sch.get_loops(mm)[-2:]
                jo, ji = sch.split(j, [None, nj])
                sch.reorder(jo, k, ji)
            else:
                *_, i, j, k = sch.get_loops(mm)
                io, ii = sch.split(i, [None, next(f for f in (4, 3, 2, 1) if m % f == 0)])
                jo, ji = sch.split(j, [None, nj])
                sch.reorder(io, jo, k, ii, ji)
                sch.unroll(ii)
            sch.vectorize(ji)
            for info in infos[1:]:
                sch.reverse_compute_at(info.block_rv, jo)
                inner = sch.get_loops(info.block_rv)[-1]
                if (_extent(sch, inner) or 0) % lanes == 0:
                    sch.vectorize(inner)
            init = sch.decompose_reduction(mm, k)
            sch.vectorize(sch.get_loops(init)[-1])
            return sch

    return SmallMatmul()


def _one_matmul(func: Any) -> bool:
    """Whether ``func``'s only reduction block is a float32 matmul: a cheap look (its root's child blocks)
    before the schedule's normalisation and inlining, which take seconds on a long fused elementwise chain."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    try:
        blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    except Exception:  # noqa: BLE001 - no root block of that name: not a PrimFunc this rule schedules
        return False
    reductions = [b for b in blocks if any(int(v.iter_type) == 2 for v in b.iter_vars)]   # 2: CommReduce
    return len(reductions) == 1 and _matmul_extents(reductions[0]) is not None


def _matmul_extents(block: Any) -> tuple[int, int] | None:
    """``(M, N)`` when ``block`` is ``C[.., i, j] += A[.., i, k] * B[.., k, j]`` in float32 with static
    extents (B read along ``j``, so the vector loop loads contiguously), else None.  A one-row product
    (batch 1) after DLight's normalisation has no ``i``: ``C[0, j] += A[0, k] * B[k, j]`` gives ``(1, N)``."""
    from tvm import tirx

    iters = block.iter_vars
    if len(iters) < 2 or len(block.reads) != 2 or len(block.writes) != 1 \
            or str(block.writes[0].source.dtype) != "float32":
        return None
    if len(iters) == 2 or int(iters[-3].iter_type) != 0:     # no spatial i: the one-row form
        return _row_extents(block)
    i, j, k = (v.var for v in iters[-3:])

    def last(region: Any, count: int) -> list[Any]:
        return [r.min for r in region.region[-count:]] if len(region.region) >= count else []

    def is_var(expr: Any, var: Any) -> bool:
        return isinstance(expr, tirx.Var) and expr.same_as(var)

    out = last(block.writes[0], 2)
    if len(out) != 2 or not (is_var(out[0], i) and is_var(out[1], j)):
        return None
    reads = [last(r, 2) for r in block.reads]
    a_ok = any(len(r) == 2 and is_var(r[0], i) and is_var(r[1], k) for r in reads)
    b_ok = any(len(r) == 2 and is_var(r[0], k) and is_var(r[1], j) for r in reads)
    dims = [iters[-3].dom.extent, iters[-2].dom.extent]
    if not (a_ok and b_ok) or not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return int(dims[0]), int(dims[1])


def _row_extents(block: Any) -> tuple[int, int] | None:
    """``(1, N)`` when ``block`` is ``C[.., 0, j] += A[.., 0, k] * B[k, j]`` (spatial ``j``, reduction ``k``)."""
    from tvm import tirx

    (j, jv), (k, kv) = ((v.var, v) for v in block.iter_vars[-2:])
    if int(jv.iter_type) != 0 or int(kv.iter_type) != 2 or not isinstance(jv.dom.extent, tirx.IntImm):
        return None

    def ends_with(region: Any, *vars_: Any) -> bool:
        idx = [r.min for r in region.region]
        if len(idx) < len(vars_) or any(not (isinstance(e, tirx.Var) and e.same_as(v))
                                        for e, v in zip(idx[len(idx) - len(vars_):], vars_)):
            return False
        return all(isinstance(e, tirx.IntImm) and int(e) == 0 for e in idx[:len(idx) - len(vars_)])

    if not ends_with(block.writes[0], j) or not any(ends_with(r, k) for r in block.reads) \
            or not any(len(r.region) == 2 and ends_with(r, k, j) for r in block.reads):
        return None
    return 1, int(jv.dom.extent)
