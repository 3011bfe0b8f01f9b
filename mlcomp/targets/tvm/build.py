"""Apache TVM (Relax API, apache-tvm 0.27) backend: torch module -> compiled Relax VM.

Flow: ``torch.export.export`` -> ``tvm.relax.frontend.torch.from_exported_program``
(``keep_params_as_input=False``: weights become Relax constants, so the exported
``model.so`` needs no torch model) -> BatchNorm folded into conv weights, ops
decomposed, constants folded -> heavy ops to vendor kernels (untuned) ->
legalize + fuse to TIR -> schedule ->
``tvm.compile`` -> ``relax.VirtualMachine``.  Shapes are static (one build per
input shape).

Scheduling
    Untuned on CPU (``tune_trials == 0``, no database in ``work_dir``): float32 conv2d,
    matmul and linear go to torch's kernels through packed functions
    (:mod:`mlcomp.targets.tvm.offload.rewrite`); every other fused PrimFunc gets DLight's GEMV/
    Reduction rules or mlcomp's ParallelVector (:mod:`mlcomp.targets.tvm.schedules`),
    without parallel loops when the module calls torch's kernels (torch's OpenMP pool owns
    the cores; TVM's pool spinning next to it contends for them), so the
    VM never starts TVM's thread pool; ``stats["kernels"]`` and ``stats["schedules"]``
    (``parallel``, ``parallel_loops``) say what went where.  CUDA gets the
    DLight GPU rules.  ``tune_trials > 0``: MetaSchedule.  ``tune_trials``
    is the trial budget of a search, shared evenly by its extracted tasks (a tuned CPU build
    keeps the torch kernels and tunes only what TVM itself runs, with no parallel loops; with default
    ``kernels`` a second search tunes the module with TVM's own conv/matmul kernels and parallel loops;
    the untuned build and the tuned ones are timed and the fastest is returned, ``stats["tuning_decision"]``);
    the ledger ``mlcomp_ledger.json`` counts trials per (target, task workload), so a
    task tuned to its share by any earlier build (of any model) with a valid record
    is reused (``stats["tasks_reused"]``) and only the other tasks are tuned.
    MetaSchedule's gradient task scheduler gives every task a warm-up round of about
    ``min(64, budget // (2 * n_tasks))`` trials (8 if the budget allows), then
    spends the rest on the tasks whose weighted latency improves most.  Records go
    to a JSON database in ``work_dir`` (``database_workload.json``,
    ``database_tuning_record.json``).  A build with ``tune_trials == 0`` and a
    ``work_dir`` holding records applies them and tunes nothing.  Weights are "layout
    free" while tuning, so MetaSchedule may pick packed weight layouts; the repacking is
    constant-folded into the weights.

Library offload (``offload=True``), checked on the PyPI wheel apache-tvm 0.27.0.post1:
    it registers no BYOC codegen (no ``relax.ext.dnnl`` / ``cublas`` / ``cudnn`` /
    ``cutlass``), ships no ``tvm.relax.backend.contrib.dnnl`` patterns and no
    ``tvm.contrib.dnnl`` / ``cblas`` / ``mkl`` runtime functions (libinfo: USE_CUDNN,
    USE_CUTLASS OFF; no DNNL/BLAS/MKL entries).  Offload is probed and skipped
    cleanly, ``stats["offload"]["reason"]`` says why.  With a wheel built with
    cuBLAS, matmuls on CUDA are partitioned to cuBLAS.

Tuning-speed workarounds (TVM 0.27 + torch in one process):
    ``import tvm`` imports torch (tvm_ffi does), which makes TVMScript's
    ``inspect.stack()`` scan every loaded module per frame, which makes importing
    ``tvm.s_tir.tensor_intrin`` slower than MetaSchedule's stock build timeout, in the
    main process and in every build worker (the build pool is restarted per batch).  While building, ``inspect.stack`` is
    replaced by one that skips the module lookup, CPU build workers skip the
    intrinsic import, and torch is hidden from the workers
    (``tune_worker_torch=True`` keeps it).  All of that, and the console
    verbosity (``log_level``), is process state changed only inside a
    :class:`~mlcomp.targets.tvm.scope.TvmScope` and restored when the build ends,
    Ctrl-C included; nothing is written outside ``work_dir``, the output folder
    and the scope's private temporary folder.  Each task's full MetaSchedule log
    goes to ``work_dir/logs`` through loggers private to the build.

    build(module, inputs, tune_trials=64, build_timeout=300)
    (CompileOptions(tune_build_timeout=300) for the target; no environment variable)
"""

from __future__ import annotations

import json
import os
import time
import weakref
from typing import Any, Callable, Mapping

from mlcomp.targets.options import LogLevel
from mlcomp.hardware.probe import vector_bits
from mlcomp.hardware.decide import DecisionPolicy, call_samplers, decide
from mlcomp.targets.tvm.offload.conv_packed import channels_last_reason, to_channels_last
from mlcomp.targets.tvm.fast_math import fast_math
from mlcomp.targets.tvm.offload.gemm import keep_small_gemms
from mlcomp.targets.tvm.kernels import PACKED_WEIGHTS, register_kernels
from mlcomp.targets.tvm.offload.rewrite import ALL_FUSIONS, Fusion
from mlcomp.targets.tvm.offload.views import VIEW_MIN_ELEMENTS
from mlcomp.targets.tvm.offload.rewrite import offload as offload_to_kernels
from mlcomp.targets.tvm.schedules import default_rules, parallel_loops, schedule_counts
from mlcomp.targets.tvm.scope import TvmScope
from mlcomp.targets.tvm.tuning import tune

_META = "meta.json"
_LIB = "model.so"
_KERNELS = "kernels.py"                   # the vendor kernels' registration, for a loader without mlcomp
_RECORDS = "database_tuning_record.json"   # MetaSchedule's JSONDatabase in a tuning folder


def host_llvm_target(num_cores: int | None = None) -> dict:
    """LLVM target dict for this host: ``-mcpu`` from LLVM's host CPU name, cores from psutil."""
    import tvm

    mcpu = "x86-64"
    try:
        name = str(tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")())
        if name and name != "generic":
            mcpu = name
    except Exception:  # pragma: no cover - runtime without LLVM
        pass
    if num_cores is None:
        try:
            import psutil

            num_cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        except ImportError:  # pragma: no cover
            num_cores = os.cpu_count() or 1
    return {"kind": "llvm", "mcpu": mcpu, "num-cores": int(num_cores)}


def _make_target(device: str):
    import tvm

    if device == "cpu":
        return tvm.target.Target(host_llvm_target())
    if device == "cuda":
        arch = tvm.cuda(0).compute_version.replace(".", "")
        return tvm.target.Target({"kind": "cuda", "arch": f"sm_{arch}"}, host=host_llvm_target())
    raise ValueError(f"unsupported device {device!r} (expected 'cpu' or 'cuda')")


def _offload(mod, target, stats: dict):
    """Partition matmul/conv to an external library if this wheel can (see module doc)."""
    import tvm
    from tvm import relax

    info: dict = {"requested": True, "applied": []}
    has = lambda name: tvm.get_global_func(name, allow_missing=True) is not None  # noqa: E731
    if target.kind.name == "cuda" and has("relax.ext.cublas"):
        from tvm.relax.backend.cuda.cublas import partition_for_cublas

        mod = relax.transform.RunCodegen()(partition_for_cublas(mod))
        info["applied"].append("cublas")
    elif target.kind.name == "cuda":
        info["reason"] = "wheel built without cuBLAS/cuDNN/CUTLASS BYOC (no relax.ext.* codegen)"
    else:
        dnnl = "relax.ext.dnnl codegen present but" if has("relax.ext.dnnl") else "no relax.ext.dnnl codegen,"
        info["reason"] = (f"{dnnl} no relax DNNL patterns in TVM 0.27 and no tvm.contrib.dnnl/"
                          "cblas/mkl runtime in this wheel: dense/conv stay on TVM codegen")
    stats["offload"] = info
    return mod


def _prepare(mod, target):
    """Graph clean-up on Relax: BatchNorm folded into conv weights, ops decomposed, constants folded."""
    import tvm
    from tvm import relax
    from tvm.relax.transform.fold_batch_norm_to_conv2d_for_inference import FoldBatchnormToConv2D

    seq = [FoldBatchnormToConv2D(), relax.transform.DecomposeOpsForInference(),
           relax.transform.CanonicalizeBindings(), relax.transform.FoldConstant()]
    with target:
        return tvm.transform.Sequential(seq)(mod)


def _lower_to_tir(mod, target):
    """Legalize + fuse to TIR (what ``zero_pipeline`` does before tuning)."""
    import tvm
    from tvm import relax

    seq = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
           relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with target:
        return tvm.transform.Sequential(seq)(mod)


def _default_schedules(mod, target, stats: dict, *, parallel: bool = True):
    """Default schedules (DLight GEMV/Reduction, mlcomp's ParallelVector) for what is not yet scheduled.

    ``parallel=False``: no parallel loops (the module calls torch's kernels, which own the cores).
    """
    from tvm.s_tir import dlight as dl

    bits = vector_bits()
    with target:
        mod = dl.ApplyDefaultSchedule(*default_rules(target, bits, parallel=parallel))(mod)
    stats["schedules"] = dict(schedule_counts(mod), vector_bits=bits, parallel=parallel)
    if target.kind.name == "llvm":
        stats["schedules"]["parallel_loops"] = parallel_loops(mod)
    return mod


def build(module, example_inputs, *, device: str = "cpu", tune_trials: int = 0,
          work_dir: str | None = None, offload: bool = True, build_timeout: float = 180.0,
          run_timeout: float = 60.0, log_level: LogLevel = LogLevel.WARNING,
          worker_torch: bool = False, kernels: bool | None = None,
          fusions: frozenset[Fusion] = ALL_FUSIONS, view_min_elements: int = VIEW_MIN_ELEMENTS,
          small_gemms: bool = True, threads: int | None = None,
          progress: Callable[[int, int, str], None] | None = None,
          clock: Callable[[], float] = time.perf_counter, deterministic: bool = False) -> "TvmModule":
    """Compile ``module`` for the exact shapes/dtypes of ``example_inputs``.

    ``device``: "cpu" (LLVM for this host) or "cuda".  ``tune_trials``: total
    MetaSchedule budget, 0 = untuned (see module doc); with no ``work_dir`` the
    database lives in the build's private temporary folder (removed afterwards),
    so nothing is reused.  ``offload``: try library BYOC (unavailable in the PyPI
    wheel; recorded in ``stats["offload"]``).  ``build_timeout``/``run_timeout``:
    seconds per MetaSchedule candidate build/measurement.  ``log_level``: console
    verbosity.  ``worker_torch``: let MetaSchedule workers import torch.
    ``kernels``: send float32 conv2d/matmul to torch's kernels (:mod:`~mlcomp.targets.tvm.offload.rewrite`;
    convs channels-last and prepacked where :mod:`~mlcomp.targets.tvm.offload.conv_packed`'s rule allows,
    ``stats["conv_layout"]``); default: on for CPU, tuned or not.  ``clock``: the timer of the tuned-vs-untuned comparison.  ``fusions``: which larger rewrites
    the kernel offload also applies (attention, epilogues, layer norm, views); ``view_min_elements``: the
    smallest layout copy the views rewrite moves into a torch call.  ``small_gemms``: probe the offloaded
    GEMMs both ways and keep those TVM runs faster as TVM code (:mod:`~mlcomp.targets.tvm.offload.gemm`,
    ``stats["small_gemms"]``), timed with ``threads`` torch threads (None: torch's current count).
    ``deterministic``: neither timing probe runs (GEMMs stay torch calls, the untuned build is kept).
    ``progress(done, total,
    message)``: called after every tuning batch.
    """
    import tvm

    t_start = time.perf_counter()
    with TvmScope(log_level=log_level, hide_torch_from_workers=not worker_torch) as scope:
        target = _make_target(device)
        stats: dict = {"device": device, "target": str(target), "tune_trials": tune_trials,
                       "trial_budget": "total per build, an even share per task; tasks tuned before are reused", "db_reused": False}
        mod, n_out = _export(module, example_inputs)
        stats["export_seconds"] = round(time.perf_counter() - t_start, 2)
        if offload:
            mod = _offload(mod, target, stats)
        else:
            stats["offload"] = {"requested": False, "applied": []}
        mod = _prepare(mod, target)
        use_db = tune_trials > 0 or bool(work_dir and os.path.exists(os.path.join(work_dir, _RECORDS)))
        # tuned builds keep the kernels too (the database then holds only what TVM itself runs); by
        # default a tuned CPU build also tunes TVM's own conv/matmul kernels, and the faster build wins
        own_variant = kernels is None and use_db and target.kind.name == "llvm"
        if kernels is None:
            kernels = target.kind.name == "llvm"
        base = mod
        if kernels:
            mod = _to_torch_kernels(mod, target, stats, fusions, view_min_elements, small_gemms, threads,
                                    deterministic)
        if target.kind.name == "llvm":
            mod, stats["fast_math"] = fast_math(mod)
        mod = _lower_to_tir(mod, target)
        # torch's kernels in the module: torch's thread pool owns the cores, TVM's code stays serial
        # (a build whose every GEMM became TVM code stays serial too: the probe timed them serial)
        kept = stats.get("small_gemms", {}).get("kept_in_tvm")
        calls_torch = bool(kernels and (stats["kernels"]["kernels"] or kept))
        untuned = None
        tuning_dir = work_dir or os.path.join(scope.tmp, "tuning")
        searches = 2 if own_variant and calls_torch else 1
        if use_db:
            untuned = mod if calls_torch else None
            mod = tune(mod, target, tune_trials, tuning_dir, stats, scope, build_timeout=build_timeout,
                       run_timeout=run_timeout, progress=_stage(progress, 0, searches), parallel=not calls_torch)
        mod = _default_schedules(mod, target, stats, parallel=not calls_torch)   # what the database did not schedule
        t0 = time.perf_counter()
        built = TvmModule(tvm.compile(mod, target=target), device, n_out, stats)
        if untuned is not None:
            own = None if searches != 2 or deterministic else lambda: _own_kernels_build(
                base, target, tune_trials, tuning_dir, stats, scope, device, n_out,
                build_timeout=build_timeout, run_timeout=run_timeout, progress=_stage(progress, 1, searches))
            built = _fastest(built, untuned, own, example_inputs, target=target, device=device, n_out=n_out,
                             stats=stats, clock=clock, deterministic=deterministic)
        if use_db and not work_dir:
            built.stats["work_dir"] = None   # it was the private folder, gone after the build
    built.stats["compile_seconds"] = round(time.perf_counter() - t0, 2)
    built.stats["total_seconds"] = round(time.perf_counter() - t_start, 2)
    return built


def _export(module, example_inputs) -> tuple[Any, int]:
    """``module`` through torch.export (in eval mode, its training flag restored) to Relax; (module, outputs)."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            ep = torch.export.export(module, tuple(example_inputs))
    finally:
        module.train(was_training)
    _skip_empty_cat_inputs(ep)
    n_out = len(ep.graph_signature.user_outputs)
    # a single output comes back as a bare tensor: saves unpacking a tvm-ffi Array per call
    return from_exported_program(ep, keep_params_as_input=False, unwrap_unit_return_tuple=n_out == 1), n_out


def _to_torch_kernels(mod, target, stats: dict, fusions: frozenset[Fusion], view_min_elements: int,
                      small_gemms: bool, threads: int | None, deterministic: bool = False):
    """The kernel offload (:mod:`tvm_offload`): float32 conv2d/matmul and the ``fusions`` become torch calls;
    with ``small_gemms`` the GEMMs this host runs faster as TVM code go back to Relax (``deterministic``:
    none, unprobed)."""
    import tvm

    register_kernels()
    if Fusion.PACKED_CONV in fusions:
        mod = _conv_layout(mod, target, stats)
    mod, report = offload_to_kernels(mod, fusions, view_min_elements)
    if small_gemms and target.kind.name == "llvm":
        # the probe is compiled as mod will be
        mod = keep_small_gemms(mod, report, stats, threads, lambda probe: tvm.compile(
            _default_schedules(_lower_to_tir(fast_math(probe)[0], target), target, {}, parallel=False),
            target=target), deterministic=deterministic)
    stats["kernels"] = report.to_json()
    stats["packed_weight_keys"] = list(report.packed)
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
    candidates = {"untuned": TvmModule(tvm.compile(_default_schedules(untuned, target, plain, parallel=False),
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

    own = {k: v for k, v in stats.items() if k not in ("kernels", "packed_weight_keys", "conv_layout")}
    own["kernels"] = {"kernels": {}, "kept_in_tvm": []}
    search: dict = {}
    mod = tune(_lower_to_tir(base, target), target, tune_trials, tuning_dir, search, scope, parallel=True, **tuning)
    own["tvm_kernels_search"] = {k: search[k] for k in ("tasks", "tasks_reused", "trials_run") if k in search}
    mod = _default_schedules(mod, target, own, parallel=True)
    return TvmModule(tvm.compile(mod, target=target), device, n_out, own)


def _stage(progress: Callable[[int, int, str], None] | None, index: int, count: int):
    """``progress`` for search ``index`` of ``count``: one bar over all of them (each reports done of its total)."""
    if progress is None:
        return None
    return lambda done, total, message: progress(index * total + done, count * total, message)


def _skip_empty_cat_inputs(ep) -> None:
    """Drop 1-D empty inputs of each ``aten.cat`` of ``ep``'s graph, in place (HF GPT-2's cache).

    ``torch.cat`` skips tensors of shape ``(0,)`` whatever the others' rank (HF's ``DynamicCache``
    starts each layer's keys/values as ``torch.tensor([])``); TVM's Relax importer concatenates them
    and rejects the rank mismatch ("Concat … ndim 1 and 4").  Without them the cat is the same value.
    """
    import torch

    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.cat.default:
            empty = [a for a in node.args[0] if getattr(getattr(a, "meta", {}).get("val"), "shape", None) == (0,)]
            if empty and len(empty) < len(node.args[0]):
                node.args = ([a for a in node.args[0] if a not in empty], *node.args[1:])


def _conv_layout(mod, target, stats: dict):
    """NHWC around the convolutions when :func:`channels_last_reason` allows (``stats["conv_layout"]``)."""
    reason = channels_last_reason(mod)
    if reason is None:
        with target:
            mod = to_channels_last(mod)
    stats["conv_layout"] = {"layout": "NCHW" if reason else "NHWC",
                            "reason": reason or "prepacked oneDNN convolutions on channels-last tensors"}
    return mod


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


class TvmModule:
    """A compiled Relax VM program: torch tensors in, tuple of torch tensors out.

    Inputs must match the example shapes/dtypes/device (the VM checks and raises).
    Tensors cross via DLPack without copies; tvm-ffi hands results back as torch
    tensors directly when the arguments were torch tensors.
    """

    def __init__(self, executable, device: str, num_outputs: int, stats: dict):
        import torch
        import tvm
        from tvm import relax

        self._ex = executable
        self.device = device
        self.num_outputs = num_outputs
        self.stats = stats
        self._vm = relax.VirtualMachine(executable, tvm.cpu(0) if device == "cpu" else tvm.cuda(0))
        self._main = self._vm["main"]  # resolve the packed function once
        self._torch = torch
        # the oneDNN-packed conv weights this module's kernels use stay cached while it lives
        keys = [int(k) for k in stats.get("packed_weight_keys", ())]
        if keys:
            PACKED_WEIGHTS.hold(keys)
            weakref.finalize(self, PACKED_WEIGHTS.release, keys)

    def __call__(self, *inputs):
        """Run the model and return a tuple of torch tensors."""
        torch = self._torch
        out = self._main(*[x if x.is_contiguous() else x.contiguous() for x in inputs])
        if self.num_outputs == 1:
            return (out if isinstance(out, torch.Tensor) else torch.from_dlpack(out),)
        return tuple(_flatten(out, torch))

    def save(self, directory: str) -> list[str]:
        """Write ``model.so`` (kernels + VM bytecode + baked weights) and ``meta.json``.

        A module that calls vendor kernels also gets ``kernels.py``, a copy of
        :mod:`mlcomp.targets.tvm.kernels` (it imports only torch and tvm_ffi): with only TVM's
        runtime and torch, ``runpy.run_path("kernels.py")["register_kernels"]()`` before
        ``tvm.runtime.load_module("model.so")`` runs the model without mlcomp.
        """
        import shutil

        from mlcomp.targets.tvm import kernels as tvm_kernels

        os.makedirs(directory, exist_ok=True)
        self._ex.export_library(os.path.join(directory, _LIB))
        meta = {"device": self.device, "num_outputs": self.num_outputs, "stats": self.stats}
        with open(os.path.join(directory, _META), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        files = [_LIB, _META]
        if self.stats.get("kernels", {}).get("kernels"):
            shutil.copyfile(tvm_kernels.__file__, os.path.join(directory, _KERNELS))
            files.append(_KERNELS)
        return files

    @classmethod
    def load(cls, directory: str, device: str = "cpu") -> "TvmModule":
        """Load a saved module; needs only the TVM runtime (no torch model, no compiler passes).

        The vendor kernels it calls (``stats["kernels"]``) are registered first.
        """
        import tvm

        with open(os.path.join(directory, _META)) as f:
            meta = json.load(f)
        if meta.get("stats", {}).get("kernels", {}).get("kernels"):
            register_kernels()
        lib = tvm.runtime.load_module(os.path.join(directory, _LIB))
        return cls(lib, device, meta["num_outputs"], dict(meta.get("stats", {}), loaded_from=directory))


def _flatten(out, torch):
    """Flatten (possibly nested) tvm-ffi arrays into torch tensors."""
    for o in out:
        if isinstance(o, torch.Tensor):
            yield o
        elif hasattr(o, "__dlpack__"):
            yield torch.from_dlpack(o)
        else:
            yield from _flatten(o, torch)
