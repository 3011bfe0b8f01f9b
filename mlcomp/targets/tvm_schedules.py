"""Default CPU schedules for what an untuned TVM build compiles itself (no MetaSchedule).

DLight's CPU rules (TVM 0.27) schedule matrix–vector products (``GEMV``) and
softmax/layer-norm shaped reductions (``Reduction``); every other fused PrimFunc,
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
kernels (:mod:`mlcomp.targets.tvm_offload`), torch's OpenMP pool owns the cores and TVM
adds no parallel loop at all.  Measured on 2 cores (resnet18 at batch 1, TVM's pool at 2
threads): TVM's workers busy-wait after every parallel region (300 000 yields) while torch's
next convolution wants both cores, and the model ran 2.8× slower than with TVM's pool at 1
thread.  A larger :data:`PARALLEL_MIN` does not help: lenet at batch 32 with its one loop over
65 536 elements parallel took 8.1 ms, serial 1.4 ms (one region starts the spinning pool).
ParallelVector then only vectorizes, and DLight's GEMV/Reduction rules are wrapped by
:func:`without_parallel`, which replays their schedule minus its ``parallel`` steps::

    parallel=True:   for ax0 in T.parallel(64):  for ax1_0 in range(64): for ax1_1 in T.vectorized(8): ...
    parallel=False:  for ax0 in range(64):       for ax1_0 in range(64): for ax1_1 in T.vectorized(8): ...

With no parallel loop the VM never starts TVM's thread pool, so nothing about it (its size,
its spinning, the core it pins its workers to) touches the process.  Each rule looks at a
PrimFunc once: O(blocks × loops).
"""
from __future__ import annotations

from typing import Any

__all__ = ["PARALLEL_MIN", "parallel_vector_rule", "without_parallel", "default_rules", "schedule_counts",
           "parallel_loops"]

# output elements below which a loop nest is not worth the thread pool's wake-up (~a few µs)
PARALLEL_MIN = 16384


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
    from tvm import s_tir, tirx
    from tvm.s_tir.dlight.analysis import normalize_prim_func
    from tvm.s_tir.dlight.base.common_schedules import try_inline

    class ParallelVector(_rule_base()):
        """Inline injective blocks; parallel leading spatial loops; vectorize injective inner loops."""

        def apply(self, func: Any, target: Any, _tunable: bool) -> Any:
            if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
                return None
            sch = s_tir.Schedule(func)
            infos = normalize_prim_func(sch)
            if not infos:
                return None
            infos = try_inline(sch, list(infos))
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
    """The rules an untuned build applies, first match wins: DLight GEMV, Reduction, then ParallelVector.

    ``parallel=False``: the same schedules without parallel loops (see the module docstring).
    CUDA keeps DLight's GPU rules (Matmul, GEMV, Reduction, GeneralReduction, Fallback).
    """
    from tvm.s_tir import dlight as dl

    if target.kind.name == "cuda":
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    if not parallel:
        return [without_parallel(dl.cpu.GEMV()), without_parallel(dl.cpu.Reduction()),
                parallel_vector_rule(vector_bits, parallel_min=None)]
    return [dl.cpu.GEMV(), dl.cpu.Reduction(), parallel_vector_rule(vector_bits)]


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
