"""Apache TVM (Relax API, apache-tvm 0.27) backend: torch module -> compiled Relax VM.

Flow: ``torch.export.export`` -> ``tvm.relax.frontend.torch.from_exported_program``
(``keep_params_as_input=False``: weights become Relax constants, so the exported
``model.so`` needs no torch model) -> BatchNorm folded into conv weights, ops
decomposed, constants folded -> legalize + fuse to TIR -> schedule ->
``tvm.compile`` -> ``relax.VirtualMachine``.  Shapes are static (one build per
input shape).

Scheduling
    ``tune_trials == 0``: untuned; CPU gets the DLight CPU rules (GEMV, Reduction),
    CUDA the DLight GPU rules.  ``tune_trials > 0``: MetaSchedule.  ``tune_trials``
    is the TOTAL trial budget of a build over all extracted tasks: MetaSchedule's
    gradient task scheduler gives every task a warm-up round of about
    ``min(64, budget // (2 * n_tasks))`` trials (8 if the budget allows), then
    spends the rest on the tasks whose weighted latency improves most.  Records go
    to a JSON database in ``work_dir`` (``database_workload.json``,
    ``database_tuning_record.json``); a ledger ``mlcomp_ledger.json`` counts trials
    spent per (target, set of tasks).  If that reaches ``tune_trials`` and every
    task has a valid record nothing is tuned (a rebuild of the same model with the
    same ``work_dir`` only re-compiles); a larger budget tunes the difference,
    seeded from the records already there.  Weights are "layout free" while
    tuning, so MetaSchedule may pick packed weight layouts; the repacking is
    constant-folded into the weights.

Library offload (``offload=True``), checked on the PyPI wheel apache-tvm 0.27.0.post1:
    it registers no BYOC codegen (no ``relax.ext.dnnl`` / ``cublas`` / ``cudnn`` /
    ``cutlass``), ships no ``tvm.relax.backend.contrib.dnnl`` patterns and no
    ``tvm.contrib.dnnl`` / ``cblas`` / ``mkl`` runtime functions (libinfo: USE_CUDNN,
    USE_CUTLASS OFF; no DNNL/BLAS/MKL entries).  Offload is probed and skipped
    cleanly, ``stats["offload"]["reason"]`` says why.  With a wheel built with
    cuBLAS, matmuls on CUDA are partitioned to cuBLAS.

Tuning-speed workarounds (TVM 0.27 + torch in one process; see the helpers):
    ``import tvm`` imports torch (tvm_ffi does), which makes TVMScript's
    ``inspect.stack()`` scan ~2000 modules per frame: importing
    ``tvm.s_tir.tensor_intrin`` takes ~60-90 s, in the main process and in every
    MetaSchedule build worker (the build pool is restarted per batch), so with the
    stock 30 s timeout every build failed.  We patch ``inspect.stack`` while
    building, skip the intrinsic import in CPU build workers, and hide torch from
    the workers (``MLCOMP_TVM_WORKER_TORCH=1`` disables that).  Console logging of
    MetaSchedule is reduced to warnings (``MLCOMP_TVM_VERBOSE=1`` restores it);
    full logs stay in ``work_dir/logs``.
"""

from __future__ import annotations

import json
import logging
import os
import time

_LEDGER = "mlcomp_ledger.json"
_META = "meta.json"
_LIB = "model.so"
_BUILD_TIMEOUT = float(os.environ.get("MLCOMP_TVM_BUILD_TIMEOUT", 180))
_RUN_TIMEOUT = float(os.environ.get("MLCOMP_TVM_RUN_TIMEOUT", 60))


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


def _worker_init():
    """Install an ``inspect.stack`` that never calls ``inspect.getmodule`` (see module doc).

    Also the MetaSchedule worker initializer, so it must stay self-contained.
    """
    import inspect
    import linecache
    import sys

    def stack(context=1):
        frame, out = sys._getframe(1), []
        while frame is not None:
            fn, ln = frame.f_code.co_filename, frame.f_lineno
            line = linecache.getline(fn, ln) if context > 0 else ""
            out.append(inspect.FrameInfo(frame, fn, ln, frame.f_code.co_name,
                                         [line] if line else None, 0 if line else None))
            frame = frame.f_back
        return out

    inspect.stack = stack


def _worker_build(mod, target, _params):
    """``meta_schedule.builder.default_build`` minus ``import tvm.s_tir.tensor_intrin`` on CPU.

    That import costs ~8 s of CPU per worker per batch; candidates arrive already
    scheduled (tensorized bodies inlined), so the registry is not needed to compile.
    """
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    if target.kind.name != "llvm":
        import tvm.s_tir.tensor_intrin  # noqa: F401
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def _by_value(fn):
    """Copy of a self-contained ``fn`` that cloudpickle ships by value (workers need not import us)."""
    import types

    return types.FunctionType(fn.__code__, {"__builtins__": __builtins__}, fn.__name__)


class _Patched:
    """Context: fast ``inspect.stack``; optionally a PYTHONPATH whose ``torch`` fails to import."""

    def __init__(self, hide_torch_from_children: bool = False):
        self.hide = hide_torch_from_children and os.environ.get("MLCOMP_TVM_WORKER_TORCH") != "1"

    def __enter__(self):
        import inspect
        import tempfile

        self._stack, self._path = inspect.stack, os.environ.get("PYTHONPATH")
        _worker_init()
        if self.hide:
            shim = os.path.join(tempfile.gettempdir(), "mlcomp_tvm_worker_shim")
            init = os.path.join(shim, "torch", "__init__.py")
            if not os.path.exists(init):
                os.makedirs(os.path.dirname(init), exist_ok=True)
                with open(init, "w") as f:
                    f.write('raise ImportError("torch is hidden from MetaSchedule workers")\n')
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, self._path]))
        return self

    def __exit__(self, *exc):
        import inspect

        inspect.stack = self._stack
        if self.hide:
            if self._path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = self._path


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


def _lower_to_tir(mod, target):
    """Graph clean-up, then legalize + fuse to TIR (what ``zero_pipeline`` does before tuning)."""
    import tvm
    from tvm import relax
    from tvm.relax.transform.fold_batch_norm_to_conv2d_for_inference import FoldBatchnormToConv2D

    seq = [FoldBatchnormToConv2D(), relax.transform.DecomposeOpsForInference(),
           relax.transform.CanonicalizeBindings(), relax.transform.FoldConstant(),
           relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
           relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with target:
        return tvm.transform.Sequential(seq)(mod)


def _dlight(mod, target):
    """DLight default schedules for functions MetaSchedule did not schedule."""
    from tvm.s_tir import dlight as dl

    if target.kind.name == "cuda":
        rules = [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
                 dl.gpu.Fallback()]
    else:
        rules = [dl.cpu.GEMV(), dl.cpu.Reduction()]
    with target:
        return dl.ApplyDefaultSchedule(*rules)(mod)


def _tune(mod, target, tune_trials: int, work_dir: str, stats: dict):
    """MetaSchedule-tune the fused TIR tasks not yet covered by ``work_dir``; apply the database."""
    import tvm
    import tvm_ffi
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.relax_integration import extract_tasks, extracted_tasks_to_tune_contexts

    os.makedirs(work_dir, exist_ok=True)
    if not os.environ.get("MLCOMP_TVM_VERBOSE"):
        logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    with target:
        mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    db = ms.database.JSONDatabase(work_dir=work_dir)
    ledger_path = os.path.join(work_dir, _LEDGER)
    ledger = {}
    if os.path.exists(ledger_path):
        with open(ledger_path) as f:
            ledger = json.load(f)
    tasks = [t for t in extract_tasks(mod, target) if not t.mod.attrs.get("tirx.is_scheduled", False)]
    hashes = sorted(str(tvm_ffi.structural_hash(t.dispatched[0])) for t in tasks)
    key = f"{target}|{','.join(hashes)}"
    spent = ledger.get(key, 0)
    if spent and any(db.query_tuning_record(t.dispatched[0], target, "main") is None for t in tasks):
        spent = 0  # a task has no valid record (e.g. all its builds failed): tune again
    owed = max(0, tune_trials - spent)
    t0 = time.perf_counter()
    if owed and tasks:
        # Gradient task scheduler: one warm-up round of `step` trials per task, then the
        # rest goes to the tasks whose weighted latency is dropping fastest.
        per = owed // len(tasks)
        step = max(1, min(64, max(per // 2, min(per, 8))))
        # MetaSchedule's population of 512 suits 64-candidate rounds; scale it down for
        # small rounds (each round's search is the main fixed cost of a small budget).
        pop = min(512, max(128, 8 * step))
        strategy = ms.search_strategy.EvolutionarySearch(population_size=pop,
                                                         init_min_unmeasured=min(50, pop // 2))
        ctxs, weights = extracted_tasks_to_tune_contexts(tasks, work_dir=work_dir,
                                                         strategy=strategy, seed=0)
        with _Patched(hide_torch_from_children=True):
            init = _by_value(_worker_init)
            builder = ms.builder.LocalBuilder(timeout_sec=_BUILD_TIMEOUT, initializer=init,
                                              f_build=_by_value(_worker_build))
            runner = ms.runner.LocalRunner(timeout_sec=_RUN_TIMEOUT, initializer=init)
            ms.tune_tasks(tasks=ctxs, task_weights=weights, work_dir=work_dir, database=db,
                          builder=builder, runner=runner, max_trials_global=owed,
                          max_trials_per_task=owed, num_trials_per_iter=step)
        ledger[key] = spent + owed
        with open(ledger_path, "w") as f:
            json.dump(ledger, f, indent=1)
    records = {t.task_name: len(db.get_top_k(db.commit_workload(t.dispatched[0]), 1 << 20))
               for t in tasks}
    stats.update(tuning_seconds=round(time.perf_counter() - t0, 2), tasks=len(tasks),
                 trials_run=owed, trials_before=spent, records_per_task=records,
                 db_reused=bool(tasks) and not owed, work_dir=work_dir)
    with target, db:
        mod = relax.transform.MetaScheduleApplyDatabase()(mod)
        # split MetaSchedule's weight repacking out of the kernels and fold it into constants
        mod = tvm.transform.Sequential([relax.transform.SplitLayoutRewritePreproc(),
                                        relax.transform.FoldConstant(),
                                        relax.transform.DeadCodeElimination(["main"])])(mod)
    return mod


def build(module, example_inputs, *, device: str = "cpu", tune_trials: int = 0,
          work_dir: str | None = None, offload: bool = True) -> "TvmModule":
    """Compile ``module`` for the exact shapes/dtypes of ``example_inputs``.

    ``device``: "cpu" (LLVM for this host) or "cuda".  ``tune_trials``: total
    MetaSchedule budget, 0 = untuned (see module doc); with no ``work_dir`` a fresh
    temporary directory is used, so nothing is reused.  ``offload``: try library
    BYOC (unavailable in the PyPI wheel; recorded in ``stats["offload"]``).
    """
    import tempfile

    import torch
    import tvm
    from tvm.relax.frontend.torch import from_exported_program

    t_start = time.perf_counter()
    target = _make_target(device)
    stats: dict = {"device": device, "target": str(target), "tune_trials": tune_trials,
                   "trial_budget": "total per build, gradient task scheduler", "db_reused": False}
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            ep = torch.export.export(module, tuple(example_inputs))
    finally:
        module.train(was_training)
    n_out = len(ep.graph_signature.user_outputs)
    # a single output comes back as a bare tensor: saves unpacking a tvm-ffi Array per call
    mod = from_exported_program(ep, keep_params_as_input=False, unwrap_unit_return_tuple=n_out == 1)
    stats["export_seconds"] = round(time.perf_counter() - t_start, 2)
    if offload:
        mod = _offload(mod, target, stats)
    else:
        stats["offload"] = {"requested": False, "applied": []}
    with _Patched():
        mod = _lower_to_tir(mod, target)
        if tune_trials > 0:
            mod = _tune(mod, target, tune_trials, work_dir or tempfile.mkdtemp(prefix="mlcomp_tvm_"),
                        stats)
        if tune_trials <= 0 or target.kind.name == "cuda":
            mod = _dlight(mod, target)  # untuned, or GPU fall-back for tasks the database lacks
        t0 = time.perf_counter()
        ex = tvm.compile(mod, target=target)
    stats["compile_seconds"] = round(time.perf_counter() - t0, 2)
    stats["total_seconds"] = round(time.perf_counter() - t_start, 2)
    return TvmModule(ex, device, n_out, stats)


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

    def __call__(self, *inputs):
        """Run the model and return a tuple of torch tensors."""
        torch = self._torch
        out = self._main(*[x if x.is_contiguous() else x.contiguous() for x in inputs])
        if self.num_outputs == 1:
            return (out if isinstance(out, torch.Tensor) else torch.from_dlpack(out),)
        return tuple(_flatten(out, torch))

    def save(self, directory: str) -> list[str]:
        """Write ``model.so`` (kernels + VM bytecode + baked weights) and ``meta.json``."""
        os.makedirs(directory, exist_ok=True)
        self._ex.export_library(os.path.join(directory, _LIB))
        meta = {"device": self.device, "num_outputs": self.num_outputs, "stats": self.stats}
        with open(os.path.join(directory, _META), "w") as f:
            json.dump(meta, f, indent=1, default=str)
        return [_LIB, _META]

    @classmethod
    def load(cls, directory: str, device: str = "cpu") -> "TvmModule":
        """Load a saved module; needs only the TVM runtime (no torch model, no compiler passes)."""
        import tvm

        with open(os.path.join(directory, _META)) as f:
            meta = json.load(f)
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
