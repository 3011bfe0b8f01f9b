"""MetaSchedule tuning for the TVM backend: budget ledger, worker set-up, private logs, Ctrl-C.

``tune(mod, target, trials, work_dir, stats, scope, ...)`` takes the fused TIR
module of :func:`mlcomp.targets.tvm.build.build` and returns it with the best
schedules of ``work_dir``'s database applied, after spending what is still owed
of ``trials`` on the tasks (see the budget rules in ``tvm.build``)::

    before: work_dir/ empty            after: work_dir/database_workload.json,
                                              database_tuning_record.json,
                                              mlcomp_ledger.json  {"llvm …|<task hash>": 64, …},
                                              logs/task_0_fused_matmul_add_relu.log
    a second build with the same budget: nothing tuned, stats["db_reused"] is True
    another model with a task of the same workload: that task is in stats["tasks_reused"],
    only its other tasks are tuned (the ledger is keyed by target and task workload)

It runs inside the build's :class:`~mlcomp.targets.tvm.scope.TvmScope`: worker
processes start in ``scope.for_workers()`` (torch hidden, temporary files in the
scope's folder) and the scheduler runs in ``scope.native()``.  A Ctrl-C kills
the build/measure workers, skips what is left of the batch, and ends tuning at
the batch's measure callbacks (:func:`_stop_when_interrupted`); the interrupted
trials are not entered in the ledger.  The builder is MetaSchedule's local
builder rewritten around a pool that refuses new work after Ctrl-C.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Callable

from mlcomp.base.files import mark_folder
from mlcomp.targets.options import LogLevel
from mlcomp.targets.tvm.scope import TvmScope, fast_inspect_stack

__all__ = ["tune"]

_LEDGER = "mlcomp_ledger.json"


def _worker_build(mod, target, _params):
    """``meta_schedule.builder.default_build`` minus ``import tvm.s_tir.tensor_intrin`` on CPU.

    That import costs seconds of CPU per worker per batch; candidates arrive already
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


def _space(parallel: bool):
    """MetaSchedule's search space for CPU; ``parallel=False``: its default rules with no parallel loops
    (the module calls torch's kernels, whose thread pool owns the cores)."""
    from tvm.s_tir import meta_schedule as ms

    if parallel:
        return "post-order-apply"
    rules = []
    for rule in ms.schedule_rule.ScheduleRule.create("llvm"):
        if isinstance(rule, ms.schedule_rule.ParallelizeVectorizeUnroll):
            rule = ms.schedule_rule.ParallelizeVectorizeUnroll(
                max_jobs_per_core=-1, max_vectorize_extent=int(rule.max_vectorize_extent),
                unroll_max_steps=[int(i) for i in rule.unroll_max_steps], unroll_explicit=bool(rule.unroll_explicit))
        rules.append(rule)
    return ms.space_generator.PostOrderApply(sch_rules=rules)


def tune(mod, target, tune_trials: int, work_dir: str, stats: dict, scope: TvmScope, *,
         build_timeout: float, run_timeout: float, progress: Callable[[int, int, str], None] | None = None,
         parallel: bool = True):
    """MetaSchedule-tune the fused TIR tasks not yet covered by ``work_dir``; apply the database.

    The budget is shared evenly: each task is owed ``tune_trials // len(tasks)`` trials (at least 1).
    The ledger counts trials per (target, task workload), so a task any earlier build, of this
    model or another, already tuned to its share and that has a valid record is *reused*
    (``stats["tasks_reused"]``); the trials still owed to the other tasks are spent on them only.
    ``progress(done, total, message)`` is called after every measured batch.  ``parallel=False``
    (a module that calls torch's kernels): the search space has no parallel loops and the
    ledger keys get a ``|serial`` suffix (the database's format is unchanged; a record tuned with
    parallel loops may still be applied, which the build's tuned-vs-untuned timing then catches).
    """
    import tvm
    import tvm_ffi
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.relax_integration import extract_tasks

    os.makedirs(work_dir, exist_ok=True)
    mark_folder(work_dir, "tuning database")          # the output rule knows it as mlcomp's (mlcomp.base.files)
    with target:
        mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
    db = ms.database.JSONDatabase(work_dir=work_dir)
    ledger_path = os.path.join(work_dir, _LEDGER)
    ledger = {}
    if os.path.exists(ledger_path):
        with open(ledger_path) as f:
            ledger = json.load(f)
    every = [t for t in extract_tasks(mod, target) if not t.mod.attrs.get("tirx.is_scheduled", False)]
    suffix = "" if parallel else "|serial"
    keys = {t.task_name: f"{target}|{tvm_ffi.structural_hash(t.dispatched[0])}{suffix}" for t in every}
    share = max(1, tune_trials // max(1, len(every))) if tune_trials > 0 else 0
    spent = {t.task_name: int(ledger.get(keys[t.task_name], 0)) for t in every}
    has_record = {t.task_name: db.query_tuning_record(t.dispatched[0], target, "main") is not None for t in every}
    reused = [t.task_name for t in every if has_record[t.task_name] and spent[t.task_name] >= share]
    tasks = [t for t in every if t.task_name not in reused and share]
    # a task without a valid record (all its builds failed, say) is tuned to its whole share again
    owed_by = {t.task_name: share - spent[t.task_name] if has_record[t.task_name] else share for t in tasks}
    owed = sum(owed_by.values())
    t0 = time.perf_counter()
    if owed and tasks:
        _search(tasks, owed, work_dir, db, scope, build_timeout=build_timeout, run_timeout=run_timeout,
                progress=progress, parallel=parallel)
        for t in tasks:
            ledger[keys[t.task_name]] = spent[t.task_name] + owed_by[t.task_name]
        with open(ledger_path, "w") as f:
            json.dump(ledger, f, indent=1)
    records = {t.task_name: len(db.get_top_k(db.commit_workload(t.dispatched[0]), 1 << 20))
               for t in every}
    stats.update(tuning_seconds=round(time.perf_counter() - t0, 2), tasks=len(every),
                 trials_run=owed if tasks else 0, trials_before=sum(spent.values()), records_per_task=records,
                 tasks_reused=reused, db_reused=bool(every) and not (owed and tasks), work_dir=work_dir)
    with target, db:
        mod = relax.transform.MetaScheduleApplyDatabase()(mod)
        # split MetaSchedule's weight repacking out of the kernels and fold it into constants
        mod = tvm.transform.Sequential([relax.transform.SplitLayoutRewritePreproc(),
                                        relax.transform.FoldConstant(),
                                        relax.transform.DeadCodeElimination(["main"])])(mod)
    return mod


def _search(tasks: list, owed: int, work_dir: str, db, scope: TvmScope, *, build_timeout: float,
            run_timeout: float, progress: Callable[[int, int, str], None] | None, parallel: bool) -> None:
    """Spend ``owed`` trials on ``tasks`` (MetaSchedule's gradient task scheduler: one warm-up round of
    ``step`` trials per task, then the rest goes to the tasks whose weighted latency drops fastest);
    the records go to ``db``.  Stops early, cleanly, when the scope is interrupted."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.utils import fork_seed

    per = owed // len(tasks)
    step = max(1, min(64, max(per // 2, min(per, 8))))
    # MetaSchedule's population of 512 suits 64-candidate rounds; scale it down for
    # small rounds (each round's search is the main fixed cost of a small budget).
    pop = min(512, max(128, 8 * step))
    strategy = ms.search_strategy.EvolutionarySearch(population_size=pop, init_min_unmeasured=min(50, pop // 2))
    with _task_loggers(work_dir, [t.task_name for t in tasks], scope.log_level) as loggers:
        ctxs = [ms.TuneContext(mod=t.dispatched[0], target=t.target, space_generator=_space(parallel),
                               search_strategy=strategy, task_name=t.task_name, logger=log,
                               rand_state=seed, num_threads="physical").clone()
                for t, log, seed in zip(tasks, loggers, fork_seed(0, n=len(tasks)))]
        with scope.for_workers():
            init = _by_value(fast_inspect_stack)
            runner = ms.runner.LocalRunner(timeout_sec=run_timeout, initializer=init)
            try:
                with scope.native(), scope.on_interrupt(lambda: _kill_workers(runner.pool)):
                    ms.tune_tasks(tasks=ctxs, task_weights=[t.weight for t in tasks], work_dir=work_dir,
                                  database=db, builder=_builder(scope, build_timeout, init),
                                  runner=_runner(scope, runner),
                                  # first, so an interrupted batch does not train the cost model
                                  measure_callbacks=[_stop_when_interrupted(scope, owed, progress)]
                                  + ms.measure_callback.MeasureCallback.create("default"),
                                  max_trials_global=owed, max_trials_per_task=owed,
                                  num_trials_per_iter=step)
            finally:
                runner.pool.shutdown()   # its workers would otherwise live until garbage collection


@contextlib.contextmanager
def _task_loggers(work_dir: str, names: list[str], level: LogLevel):
    """One logger per task, private to this build (not registered with ``logging``).

    Everything goes to ``work_dir/logs/<task>.log``; records at ``level`` and above also go
    to stderr.  MetaSchedule's own helper configures the process's logging with
    ``dictConfig``, which closes every handler the process has: not used.
    """
    import sys

    os.makedirs(os.path.join(work_dir, "logs"), exist_ok=True)
    loggers, handlers = [], []
    try:
        for i, name in enumerate(names):
            log = logging.Logger(f"mlcomp.tvm.task_{i}_{name}"[:100], logging.DEBUG)  # noqa: LOG001 - private
            to_file = logging.FileHandler(os.path.join(work_dir, "logs", f"task_{i}_{name}"[:100] + ".log"),
                                          delay=True)
            to_file.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] %(message)s"))
            console = logging.StreamHandler(sys.stderr)
            console.setLevel(level.logging_level)
            for handler in (to_file, console):
                log.addHandler(handler)
                handlers.append(handler)
            loggers.append(log)
        yield loggers
    finally:
        for handler in handlers:
            handler.close()


def _kill_workers(pool) -> None:
    """Kill ``pool``'s worker processes without waiting (called from the SIGINT handler).

    The threads waiting on them see the pipe close and report the candidate as failed; only
    the processes are killed here (closing their pipes could block on a reader's lock).
    """
    for worker in list(getattr(pool, "_worker_map", {}).values()):
        proc = getattr(worker, "_proc", None)
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.kill()


def _builder(scope: TvmScope, timeout: float, initializer):
    """MetaSchedule's local builder (one process pool per batch), stoppable by Ctrl-C.

    Once Ctrl-C is recorded, running builds are killed, queued ones fail without starting a
    worker, and later batches build nothing, so the batch ends within moments.
    """
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.builder import local_builder
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

    class Pool(PopenPoolExecutor):
        def _worker_run(self, fn, args, kwargs):
            if scope.interrupted:
                raise ChildProcessError("interrupted (Ctrl-C)")
            return super()._worker_run(fn, args, kwargs)

    f_build = _by_value(_worker_build)

    @derived_object
    class StoppableBuilder(ms.builder.PyBuilder):
        def build(self, build_inputs):
            if scope.interrupted:
                return [ms.builder.BuilderResult(None, "interrupted (Ctrl-C)") for _ in build_inputs]
            pool = Pool(max_workers=os.cpu_count() or 1, timeout=timeout, initializer=initializer)
            jobs = [(f_build, None, b.mod, b.target, local_builder._serialize_params(b.params))
                    for b in build_inputs]
            results = []
            try:
                with scope.on_interrupt(lambda: _kill_workers(pool)):
                    for done in pool.map_with_error_catching(lambda job: local_builder._worker_func(*job), jobs):
                        if done.status == StatusKind.COMPLETE:
                            results.append(ms.builder.BuilderResult(done.value, None))
                        elif done.status == StatusKind.TIMEOUT:
                            results.append(ms.builder.BuilderResult(None, f"timeout after {timeout} s"))
                        else:
                            results.append(ms.builder.BuilderResult(None, f"build failed: {done.value}"))
            finally:
                pool.shutdown()
            return results

    return StoppableBuilder()


def _runner(scope: TvmScope, runner):
    """``runner`` fed one candidate at a time, so that after Ctrl-C the rest are skipped."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.runner.local_runner import LocalRunnerFuture

    @derived_object
    class StoppableRunner(ms.runner.PyRunner):
        def run(self, runner_inputs):
            out = []
            for one in runner_inputs:
                if scope.interrupted:
                    out.append(LocalRunnerFuture(None, "interrupted (Ctrl-C)"))
                else:
                    out.extend(runner.run([one]))
            return out

    return StoppableRunner()


def _stop_when_interrupted(scope: TvmScope, total: int = 0,
                           progress: Callable[[int, int, str], None] | None = None):
    """A measure callback that reports progress and ends tuning after the batch once Ctrl-C was recorded.

    Raising here, between batches, is the safe point: TVM's C++ scheduler unwinds cleanly
    (an exception raised elsewhere inside it can end the process in std::terminate).
    """
    from tvm.ir.utils import derived_object
    from tvm.s_tir import meta_schedule as ms

    done = [0]

    @derived_object
    class StopWhenInterrupted(ms.measure_callback.PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            if scope.interrupted:
                raise RuntimeError("tuning interrupted (Ctrl-C)")
            done[0] += len(measure_candidates)
            if progress is not None:
                ok = sum(1 for r in runner_results if r.error_msg is None)
                try:
                    progress(min(done[0], total), total, f"task {task_id}: {ok}/{len(runner_results)} ran")
                except BaseException:   # noqa: BLE001 - a Ctrl-C the progress line saw: stop here, safely
                    scope.interrupted = True
                    raise RuntimeError("tuning interrupted (Ctrl-C)") from None

    return StopWhenInterrupted()
