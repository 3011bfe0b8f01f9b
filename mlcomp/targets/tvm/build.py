"""Apache TVM (Relax API, apache-tvm 0.27) build: torch module -> compiled Relax VM (:class:`TvmModule`).

On CPU, by default, the module TVM builds calls torch's own kernels for the heavy ops (oneDNN/MKL
convolutions and GEMMs, SDPA attention, layer norms) through packed functions, and TVM compiles the
rest; which op goes where is the table of :mod:`mlcomp.targets.tvm.offload.policy`, and
``stats["offload"]`` (:mod:`~mlcomp.targets.tvm.offload.placement`) records it per op.  With
``BuildConfig(kernels=False)`` the build is pure TVM (every op TVM code; the saved ``model.so`` loads
with TVM alone).  The steps that are not decisions live in :mod:`~mlcomp.targets.tvm.lowering`.

Scheduling
    Untuned (``tune_trials == 0``, no database in ``work_dir``): every fused PrimFunc gets DLight's
    GEMV/Reduction rules or mlcomp's ParallelVector (:mod:`mlcomp.targets.tvm.schedules`), without
    parallel loops when the module calls torch's kernels (torch's OpenMP pool owns the cores), so the
    VM never starts TVM's thread pool; ``stats["schedules"]`` (``parallel``, ``parallel_loops``) says
    how.  CUDA gets the DLight GPU rules.  ``tune_trials > 0``: MetaSchedule
    (:mod:`~mlcomp.targets.tvm.tuning`), ``tune_trials`` being the budget of a search shared evenly by
    its tasks.  A tuned CPU build keeps the torch kernels and tunes only what TVM itself runs; with
    default ``kernels`` a second search tunes the module with TVM's own conv/matmul kernels and
    parallel loops; the untuned build and the tuned ones are timed and the fastest is returned
    (``stats["tuning_decision"]``).  The ledger ``mlcomp_ledger.json`` counts trials per (target, task
    workload), so a task tuned to its share by any earlier build with a valid record is reused
    (``stats["tasks_reused"]``).  Records go to a JSON database in ``work_dir``; a build with
    ``tune_trials == 0`` and a ``work_dir`` holding records applies them and tunes nothing.  Weights are
    "layout free" while tuning; the repacking is constant-folded into the weights.

Tuning-speed workarounds (TVM 0.27 + torch in one process):
    ``import tvm`` imports torch (tvm_ffi does), which makes TVMScript's
    ``inspect.stack()`` scan every loaded module per frame, which makes importing
    ``tvm.s_tir.tensor_intrin`` slower than MetaSchedule's stock build timeout, in the
    main process and in every build worker (the build pool is restarted per batch).  While building, ``inspect.stack`` is
    replaced by one that skips the module lookup, CPU build workers skip the
    intrinsic import, and torch is hidden from the workers
    (``BuildConfig(worker_torch=True)`` keeps it).  All of that, and the console
    verbosity (``log_level``), is process state changed only inside a
    :class:`~mlcomp.targets.tvm.scope.TvmScope` and restored when the build ends,
    Ctrl-C included; nothing is written outside ``work_dir``, the output folder
    and the scope's private temporary folder.  Each task's full MetaSchedule log
    goes to ``work_dir/logs`` through loggers private to the build.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping

from mlcomp.hardware.decide import DecisionPolicy, call_samplers, decide
from mlcomp.targets.tvm.config import BuildConfig
from mlcomp.targets.tvm.fast_math import fast_math
from mlcomp.targets.tvm.kernels import register_kernels
from mlcomp.targets.tvm.lowering import (
    default_schedules,
    host_llvm_target,
    lower_to_tir,
    make_target,
    prepare,
    to_relax,
)
from mlcomp.targets.tvm.module import TvmModule
from mlcomp.targets.tvm.offload.destinations import to_destinations
from mlcomp.targets.tvm.offload.conv_packed import channels_last_reason, to_channels_last
from mlcomp.targets.tvm.offload.gemm import keep_small_gemms
from mlcomp.targets.tvm.offload.linear_packed import pack_linears
from mlcomp.targets.tvm.offload.placement import placements
from mlcomp.targets.tvm.offload.policy import Fusion, HostFacts
from mlcomp.targets.tvm.offload.rewrite import offload as offload_to_kernels
from mlcomp.targets.tvm.scope import TvmScope
from mlcomp.targets.tvm.tuning import tune

__all__ = ["BuildConfig", "TvmModule", "build", "faster", "host_llvm_target"]


def build(module, example_inputs, config: BuildConfig | None = None, *, dynamic_shapes=None,
          progress: Callable[[int, int, str], None] | None = None,
          clock: Callable[[], float] = time.perf_counter) -> TvmModule:
    """Compile ``module`` for the exact shapes/dtypes of ``example_inputs`` as ``config`` says (or, with
    ``dynamic_shapes``, for every size of their ranges: see :func:`~mlcomp.targets.tvm.lowering.to_relax`).

    ``progress(done, total, message)``: called after every tuning batch.  ``clock``: the timer of
    the tuned-vs-untuned comparison.
    """
    config = config or BuildConfig()
    t_start = time.perf_counter()
    with TvmScope(log_level=config.log_level, hide_torch_from_workers=not config.worker_torch) as scope:
        target = make_target(config.device)
        stats: dict = {"device": config.device, "target": str(target), "tune_trials": config.tune_trials,
                       "trial_budget": "total per build, an even share per task; tasks tuned before are reused",
                       "db_reused": False}
        mod, n_out = to_relax(module, example_inputs, dynamic_shapes)
        stats["export_seconds"] = round(time.perf_counter() - t_start, 2)
        base = prepare(mod, target)
        host = HostFacts.probe(config.device, config.kernels_for(config.device))
        mod = _place(base, target, stats, config, host)
        calls_torch = bool(host.kernels and (stats["kernels"]["kernels"]
                                             or stats.get("small_gemms", {}).get("kept_in_tvm")))
        built = _compile(mod, base, target, stats, scope, config, n_out, calls_torch, example_inputs,
                         progress, clock)
    built.stats["total_seconds"] = round(time.perf_counter() - t_start, 2)
    return built


def _place(mod, target, stats: dict, config: BuildConfig, host: HostFacts):
    """``mod`` with its ops placed by the policy (torch kernels or TVM code), fast math, lowered to TIR;
    ``stats["offload"]`` says per op where it runs and why."""
    if host.kernels:
        mod = _to_torch_kernels(mod, target, stats, config, host)
    else:
        stats["kernels"] = {"kernels": {}, "kept_in_tvm": []}
    probed = bool(stats.get("small_gemms", {}).get("kept_in_tvm"))
    stats["offload"] = placements(mod, host, probed).to_json()
    if host.kernels:     # results into tensors the VM allocates: planned, pooled from call to call
        mod, stats["kernels_into"] = to_destinations(mod)
    if target.kind.name == "llvm":
        mod, stats["fast_math"] = fast_math(mod)
    return lower_to_tir(mod, target)


def _compile(mod, base, target, stats: dict, scope, config: BuildConfig, n_out: int, calls_torch: bool,
             example_inputs, progress, clock) -> TvmModule:
    """Tune (when asked), schedule the rest and compile; a tuned build races the untuned one (and, with
    default kernels on CPU, one tuned with TVM's own kernels) and the fastest is returned."""
    import tvm

    use_db = config.uses_database
    own_variant = config.kernels is None and use_db and target.kind.name == "llvm"
    tuning_dir = config.work_dir or os.path.join(scope.tmp, "tuning")
    searches = 2 if own_variant and calls_torch else 1
    tuning = {"build_timeout": config.build_timeout, "run_timeout": config.run_timeout}
    untuned = None
    if use_db:
        untuned = mod if calls_torch else None
        mod = tune(mod, target, config.tune_trials, tuning_dir, stats, scope, progress=_stage(progress, 0, searches),
                   parallel=not calls_torch, **tuning)
    mod = default_schedules(mod, target, stats, parallel=not calls_torch)   # what the database did not schedule
    t0 = time.perf_counter()
    built = TvmModule(tvm.compile(mod, target=target), config.device, n_out, stats)
    if untuned is not None:
        own = None if searches != 2 or config.deterministic else lambda: _own_kernels_build(
            base, target, config.tune_trials, tuning_dir, stats, scope, config.device, n_out,
            progress=_stage(progress, 1, searches), **tuning)
        built = _fastest(built, untuned, own, example_inputs, target=target, device=config.device, n_out=n_out,
                         stats=stats, clock=clock, deterministic=config.deterministic)
    if use_db and not config.work_dir:
        built.stats["work_dir"] = None   # it was the private folder, gone after the build
    built.stats["compile_seconds"] = round(time.perf_counter() - t0, 2)
    return built


def _to_torch_kernels(mod, target, stats: dict, config: BuildConfig, host: HostFacts):
    """The kernel offload (:mod:`~mlcomp.targets.tvm.offload.rewrite`): float32 conv2d/matmul and the fusions
    become torch calls; with ``small_gemms`` the GEMMs this host runs faster as TVM code go back to Relax
    (``deterministic``: none, unprobed)."""
    import tvm

    register_kernels()
    if Fusion.PACKED_CONV in config.fusions:
        mod = _conv_layout(mod, target, stats, host)
    mod, report = offload_to_kernels(mod, config.fusions, config.view_min_elements)
    if config.small_gemms and target.kind.name == "llvm":
        # the probe is compiled as mod will be
        mod = keep_small_gemms(mod, report, stats, config.threads, lambda probe: tvm.compile(
            default_schedules(lower_to_tir(fast_math(probe)[0], target), target, {}, parallel=False),
            target=target), deterministic=config.deterministic)
    if host.packed_linear:       # large linears on oneDNN with packed weights (policy row linear-packed)
        mod, stats["linears_packed"] = pack_linears(mod, host, report)
    stats["kernels"] = report.to_json()
    stats["packed_weight_keys"] = list(report.packed)
    return mod


def _conv_layout(mod, target, stats: dict, host: HostFacts):
    """NHWC around the convolutions when :func:`channels_last_reason` allows (``stats["conv_layout"]``)."""
    reason = channels_last_reason(mod, host)
    if reason is None:
        with target:
            mod = to_channels_last(mod)
    stats["conv_layout"] = {"layout": "NCHW" if reason else "NHWC",
                            "reason": reason or "prepacked oneDNN convolutions on channels-last tensors"}
    return mod


def _fastest(tuned: "TvmModule", untuned, own_kernels: Callable[[], "TvmModule"] | None, example_inputs, *,
             target, device: str, n_out: int, stats: dict, clock: Callable[[], float],
             deterministic: bool = False) -> "TvmModule":
    """The faster of the tuned build, the untuned one (same kernels, default schedules) and, with default
    kernels, the build tuned with TVM's own kernels (``own_kernels``; an MLP at batch 1 runs faster with
    TVM's GEMV than with torch's), by :func:`faster`; ``stats["tuning_decision"]`` records the decision
    (``deterministic``: the untuned build, untimed)."""
    import tvm

    plain = dict(stats)
    candidates = {"untuned": TvmModule(tvm.compile(default_schedules(untuned, target, plain, parallel=False),
                                                   target=target), device, n_out, plain),
                  "tuned": tuned}
    if own_kernels is not None:
        candidates["tuned_tvm_kernels"] = own_kernels()
    winner, times = faster(candidates, example_inputs, clock=clock, deterministic=deterministic)
    built = candidates[winner]
    built.stats.update(tuning_decision=dict(times, winner=winner))
    return built


def _own_kernels_build(base, target, tune_trials: int, tuning_dir: str, stats: dict, scope, device: str,
                       n_out: int, **tuning) -> "TvmModule":
    """``base`` (before the kernel offload) tuned with TVM's own conv/matmul kernels and parallel loops.

    Its stats are the first search's (top-level tuning figures stay that search's, whichever build wins)
    with no kernels, and this search's figures under ``tvm_kernels_search``.
    """
    import tvm

    own = {k: v for k, v in stats.items() if k not in ("kernels", "packed_weight_keys", "conv_layout", "offload")}
    own["kernels"] = {"kernels": {}, "kept_in_tvm": []}
    own["offload"] = placements(base, HostFacts.probe("cpu", kernels=False)).to_json()
    search: dict = {}
    mod = tune(lower_to_tir(base, target), target, tune_trials, tuning_dir, search, scope, parallel=True, **tuning)
    own["tvm_kernels_search"] = {k: search[k] for k in ("tasks", "tasks_reused", "trials_run") if k in search}
    mod = default_schedules(mod, target, own, parallel=True)
    return TvmModule(tvm.compile(mod, target=target), device, n_out, own)


def _stage(progress: Callable[[int, int, str], None] | None, index: int, count: int):
    """``progress`` for search ``index`` of ``count``: one bar over all of them (each reports done of its total)."""
    if progress is None:
        return None
    return lambda done, total, message: progress(index * total + done, count * total, message)


TUNING_QUESTION = "tvm: which build runs, untuned or tuned?"
TUNING_RULE = "deterministic build: the untuned build (MetaSchedule's schedules are a measured search), untimed"
TUNING_TIMING = DecisionPolicy(warmup=3, budget_s=0.5, min_rounds=6, max_rounds=2000, threshold=0.9)


def faster(runners: Mapping[str, Callable[..., Any]], inputs, *, clock: Callable[[], float] = time.perf_counter,
           policy: DecisionPolicy = TUNING_TIMING, deterministic: bool = False) -> tuple[str, dict]:
    """The runner to keep and the evidence: the first of ``runners`` (the untuned build) unless a sign test
    decides another takes < ``policy.threshold`` x its time (:func:`mlcomp.hardware.decide.decide`).

    With ``{"untuned": …, "tuned": …}`` a tuned build not clearly faster is never kept;
    ``deterministic``: nothing is timed, the first is kept.
    """
    fns = {name: (lambda r=r: r(*inputs)) for name, r in runners.items()}
    samplers = fns if deterministic else call_samplers(fns, warmup=policy.warmup, budget_s=policy.budget_s,
                                                       clock=clock)      # deterministic: never called
    decision = decide(TUNING_QUESTION, samplers, policy=policy, clock=clock, deterministic=deterministic,
                      rule=TUNING_RULE)
    times = {f"{name}_ms": round(decision.medians[name] * 1e3, 4) for name in runners if name in decision.medians}
    return decision.choice, times | {"rounds": decision.rounds, "decision": decision.to_json()}
