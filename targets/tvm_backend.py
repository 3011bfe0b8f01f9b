"""Apache TVM (Relax, >= 0.27) backend for mlcomp.

Flow: ``torch.export.export`` -> ``tvm.relax.frontend.torch.from_exported_program``
(weights baked in as Relax constants, so an exported ``model.so`` needs no torch
model) -> graph clean-up (BatchNorm folded into conv weights, ops decomposed,
constants folded) -> legalize + fuse to TIR -> schedule -> ``tvm.compile`` ->
``relax.VirtualMachine``.

Scheduling:

* ``tune_trials == 0``: untuned build.  CPU gets the DLight CPU rules (GEMV,
  Reduction), CUDA gets the DLight GPU rules (required for unscheduled TIR to
  build at all on GPU).
* ``tune_trials > 0``: MetaSchedule.  ``tune_trials`` is the TOTAL trial budget
  of one build, split evenly over the tasks that still need tuning
  (``per_task = ceil(tune_trials / n_tasks)``).  Records live in a JSON database
  in ``work_dir`` (``database_workload.json`` / ``database_tuning_record.json``),
  plus a ledger (``mlcomp_ledger.json``) counting the trials already spent per
  (target, task).  A task whose ledger count reaches the requested per-task
  budget and that has a valid record is not tuned again; a larger budget tops
  it up.  Weights are "layout free" during tuning (MetaSchedule may pick a
  packed weight layout); the repacking is constant-folded at build time.

Library offload (``offload=True``), checked against apache-tvm 0.27.0.post1 from
PyPI: the wheel registers no BYOC codegen at all (no ``relax.ext.dnnl``,
``relax.ext.cublas``, ``relax.ext.cudnn``, ...), ships no
``tvm.relax.backend.contrib.dnnl`` patterns and no ``tvm.contrib.dnnl`` /
``tvm.contrib.cblas`` / ``tvm.contrib.mkl`` runtime functions (libinfo has no
USE_DNNL / USE_BLAS / USE_MKL / USE_CUBLAS).  Offload is therefore probed at
build time and skipped cleanly; ``stats["offload"]`` records why.  If a wheel
built with cuBLAS is used, dense/matmul on CUDA is partitioned to cuBLAS.
"""

from __future__ import annotations

import json
import math
import os
import time

_LEDGER = "mlcomp_ledger.json"
_META = "meta.json"
_LIB = "model.so"
_BUILD_TIMEOUT = float(os.environ.get("MLCOMP_TVM_BUILD_TIMEOUT", 180))
_RUN_TIMEOUT = float(os.environ.get("MLCOMP_TVM_RUN_TIMEOUT", 60))


def host_llvm_target(num_cores: int | None = None) -> dict:
    """LLVM target dict for this host (``-mcpu`` from LLVM's host CPU query)."""
    import tvm

    mcpu = "x86-64"
    try:
        name = str(tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")())
        if name and name != "generic":
            mcpu = name
    except Exception:  # pragma: no cover - LLVM-less runtime
        pass
    if num_cores is None:
        try:
            import psutil

            num_cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        except ImportError:
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


def _tvm_device(device: str):
    import tvm

    return tvm.cpu(0) if device == "cpu" else tvm.cuda(0)


def _offload(mod, target, stats: dict):
    """Partition dense/conv to an external library if this wheel can (see module doc)."""
    import tvm
    from tvm import relax

    info: dict = {"requested": True, "applied": []}
    if target.kind.name == "cuda" and tvm.get_global_func("relax.ext.cublas", allow_missing=True):
        from tvm.relax.backend.cuda.cublas import partition_for_cublas

        mod = relax.transform.RunCodegen()(partition_for_cublas(mod))
        info["applied"].append("cublas")
    elif target.kind.name == "llvm" and tvm.get_global_func("relax.ext.dnnl", allow_missing=True):
        info["reason"] = "relax.ext.dnnl codegen exists but no relax DNNL patterns ship with TVM 0.27"
    else:
        want = "relax.ext.cublas/cudnn" if target.kind.name == "cuda" else "relax.ext.dnnl / cblas / mkl"
        info["reason"] = f"wheel has no {want} codegen or runtime (built without DNNL/BLAS)"
    stats["offload"] = info
    return mod


def _lower_to_tir(mod, target):
    """Graph clean-up, then legalize + fuse to TIR (the pre-tuning 'zero' pipeline)."""
    import tvm
    from tvm import relax
    from tvm.relax.transform.fold_batch_norm_to_conv2d_for_inference import FoldBatchnormToConv2D

    seq = [
        FoldBatchnormToConv2D(),
        relax.transform.DecomposeOpsForInference(),
        relax.transform.CanonicalizeBindings(),
        relax.transform.FoldConstant(),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]
    with target:
        return tvm.transform.Sequential(seq)(mod)


def _dlight(mod, target):
    import tvm
    from tvm.s_tir import dlight as dl

    if target.kind.name == "cuda":
        rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    else:
        rules = [dl.cpu.GEMV(), dl.cpu.Reduction()]
    with target:
        return dl.ApplyDefaultSchedule(*rules)(mod)


def _tune(mod, target, tune_trials: int, work_dir: str, stats: dict):
    """Tune the fused TIR tasks of ``mod`` (reusing work_dir's database), then apply it."""
    import tvm
    import tvm_ffi
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.relax_integration import extract_tasks, extracted_tasks_to_tune_contexts

    os.makedirs(work_dir, exist_ok=True)
    with target:
        mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    db = ms.database.JSONDatabase(work_dir=work_dir)
    ledger_path = os.path.join(work_dir, _LEDGER)
    ledger = json.load(open(ledger_path)) if os.path.exists(ledger_path) else {}
    tasks = [t for t in extract_tasks(mod, target) if not t.mod.attrs.get("tirx.is_scheduled", False)]
    per_task = max(1, math.ceil(tune_trials / max(1, len(tasks))))
    todo, deficits, reused = [], [], []
    for t in tasks:
        key = f"{target}|{tvm_ffi.structural_hash(t.dispatched[0])}"
        have = ledger.get(key, 0)
        if have and db.query_tuning_record(t.dispatched[0], target, "main") is None:
            have = 0  # ledger says tuned but nothing valid was recorded
        if have >= per_task:
            reused.append(t.task_name)
        else:
            todo.append((t, key))
            deficits.append(per_task - have)
    t0 = time.perf_counter()
    if todo:
        ctxs, weights = extracted_tasks_to_tune_contexts([t for t, _ in todo], work_dir=work_dir, seed=0)
        step = min(64, max(deficits))
        # Builder workers re-import tvm (and torch, via tvm_ffi) for every batch: ~5 s of CPU
        # each, so the stock 30 s build timeout is too tight on a small or busy host.
        builder = ms.builder.LocalBuilder(timeout_sec=_BUILD_TIMEOUT)
        runner = ms.runner.LocalRunner(timeout_sec=_RUN_TIMEOUT)
        ms.tune_tasks(tasks=ctxs, task_weights=weights, work_dir=work_dir, database=db,
                      builder=builder, runner=runner,
                      max_trials_global=sum(deficits), max_trials_per_task=max(deficits),
                      num_trials_per_iter=step)
        for (_, key), d in zip(todo, deficits):
            ledger[key] = ledger.get(key, 0) + d
        with open(ledger_path, "w") as f:
            json.dump(ledger, f, indent=1)
    stats.update(
        tuning_seconds=round(time.perf_counter() - t0, 2), tasks=len(tasks), trials_per_task=per_task,
        tasks_tuned=[t.task_name for t, _ in todo], tasks_reused=reused,
        trials_run=sum(deficits), db_reused=bool(reused) and not todo, work_dir=work_dir,
    )
    with target, db:
        mod = relax.transform.MetaScheduleApplyDatabase()(mod)
        # materialize MetaSchedule's weight repacking into constants
        mod = tvm.transform.Sequential(
            [relax.transform.SplitLayoutRewritePreproc(), relax.transform.FoldConstant()]
        )(mod)
    return mod


def build(module, example_inputs, *, device: str = "cpu", tune_trials: int = 0,
          work_dir: str | None = None, offload: bool = True) -> "TvmModule":
    """Compile ``module`` for the exact shapes/dtypes of ``example_inputs``.

    ``tune_trials`` is the total MetaSchedule budget (see module doc); with
    ``tune_trials > 0`` and no ``work_dir`` a temporary directory is used (so
    nothing is reused).  Shapes are static: another batch size needs another build.
    """
    import tempfile

    import torch
    import tvm
    from tvm.relax.frontend.torch import from_exported_program

    t_start = time.perf_counter()
    target = _make_target(device)
    stats: dict = {"device": device, "target": str(target), "tune_trials": tune_trials,
                   "trial_budget": "total, split evenly over tasks", "db_reused": False}
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            ep = torch.export.export(module, tuple(example_inputs))
    finally:
        module.train(was_training)
    mod = from_exported_program(ep, keep_params_as_input=False)
    stats["export_seconds"] = round(time.perf_counter() - t_start, 2)
    if offload:
        mod = _offload(mod, target, stats)
    else:
        stats["offload"] = {"requested": False, "applied": []}
    mod = _lower_to_tir(mod, target)
    if tune_trials > 0:
        work_dir = work_dir or tempfile.mkdtemp(prefix="mlcomp_tvm_")
        mod = _tune(mod, target, tune_trials, work_dir, stats)
    if tune_trials <= 0 or target.kind.name == "cuda":
        mod = _dlight(mod, target)  # untuned, or GPU fall-back for tasks not in the database
    t0 = time.perf_counter()
    ex = tvm.compile(mod, target=target)
    stats["compile_seconds"] = round(time.perf_counter() - t0, 2)
    stats["total_seconds"] = round(time.perf_counter() - t_start, 2)
    n_out = len(ep.graph_signature.user_outputs)
    return TvmModule(ex, device, n_out, stats)


class TvmModule:
    """A compiled Relax VM program: torch tensors in, tuple of torch tensors out."""

    def __init__(self, executable, device: str, num_outputs: int, stats: dict):
        import tvm
        from tvm import relax

        self._ex = executable
        self.device = device
        self.num_outputs = num_outputs
        self.stats = stats
        self._vm = relax.VirtualMachine(executable, _tvm_device(device))
        self._main = self._vm["main"]  # look the function up once
        self._tvm = tvm

    def __call__(self, *inputs):
        """Run the model; inputs are passed zero-copy via DLPack (made contiguous if needed)."""
        import torch

        args = [x if x.is_contiguous() else x.contiguous() for x in inputs]
        out = self._main(*args)  # tvm-ffi converts torch tensors through DLPack
        if isinstance(out, self._tvm.runtime.Tensor):
            return (torch.from_dlpack(out),)
        return tuple(_flatten(out, torch))

    def save(self, directory: str) -> list[str]:
        """Write ``model.so`` (code + baked weights) and ``meta.json``; return the file names."""
        os.makedirs(directory, exist_ok=True)
        self._ex.export_library(os.path.join(directory, _LIB))
        meta = {"device": self.device, "num_outputs": self.num_outputs, "stats": self.stats}
        with open(os.path.join(directory, _META), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        return [_LIB, _META]

    @classmethod
    def load(cls, directory: str, device: str = "cpu") -> "TvmModule":
        """Load a saved module (no torch model or TVM compiler pass needed)."""
        import tvm

        with open(os.path.join(directory, _META)) as f:
            meta = json.load(f)
        lib = tvm.runtime.load_module(os.path.join(directory, _LIB))
        stats = dict(meta.get("stats", {}), loaded_from=directory)
        return cls(lib, device, meta["num_outputs"], stats)


def _flatten(out, torch):
    """Flatten (possibly nested) tvm-ffi arrays of tensors into torch tensors."""
    for o in out:
        if hasattr(o, "__dlpack__"):
            yield torch.from_dlpack(o)
        else:
            yield from _flatten(o, torch)
