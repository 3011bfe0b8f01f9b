"""How the small-GEMM probe times one call both ways: what a sample is, and when a figure is re-measured.

The probe (:mod:`~mlcomp.targets.tvm.offload.gemm`) compares, in the compiling process, TVM's serial
kernel for a small product with the packed torch call the offload made.  The two react to a
busy machine very differently: TVM's kernel runs on the calling thread and loses only its share
of a core, while torch's kernel at two or more threads ends each call at a barrier that waits for
every OpenMP worker, so one worker that is not on a core (another process, the compile's own
spare timing worker, a thread pool still spinning after its last job) costs the call a scheduler
time slice: milliseconds for a call of tens of µs.  Paired rounds cancel load that hits both sides
alike; this load hits the torch side up to a hundred times harder, so a probe taken while a core
was taken measures a torch call far slower than the process that runs the artifact will.

So :func:`judge`:

* warms both up (:data:`PROBE_TIMING` ``warmup`` calls: torch's first calls start its pool),
* makes each sample a short batch of back-to-back calls (about :data:`SAMPLE_S`, at least one
  call), its time divided by the batch, so one preemption moves one sample, not the median,
* decides by :func:`mlcomp.hardware.decide.decide` (rotated paired rounds, sign test, medians),
* and when the two medians differ by more than :data:`WILD` times either way — more than any
  kernel difference at these sizes, the signature of a stalled barrier — pauses
  :data:`SETTLE_S` (pools go back to sleep, a burst of other work passes), warms up again and
  measures once more; the second decision stands and its ``why`` says that it was re-measured
  and what the first ratio was,
* unless torch is still the wildly slow side and the probe can run torch on one thread
  (``one_thread``): a kernel on a quiet machine is not many times slower with more threads than
  with one, so torch's stalled multi-thread figure is replaced by its one-thread figure (an upper
  bound on its quiet time) and that comparison decides; the ``why`` says so.

    >>> batch_size(20e-6), batch_size(1e-3), batch_size(0.0)
    (10, 1, 64)
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, ContextManager

from mlcomp.hardware.decide import Decision, DecisionPolicy, call_samplers
from mlcomp.hardware.decide import decide as decide_by_timing
from mlcomp.targets.tvm.offload.policy import rule

__all__ = ["KEEP_RATIO", "PROBE_TIMING", "SAMPLE_S", "SETTLE_S", "WILD", "batch_size", "judge", "wild"]

KEEP_RATIO = rule("small-gemm").ratio   # TVM must take under this share of the torch call's time (noise margin)
# per probed call: 20 warm-up calls, then paired batched rounds until the sign test decides (6 rounds when all
# agree) or 0.05 s per variant is spent (on a busy machine a preempted batch costs a round its agreement)
PROBE_TIMING = DecisionPolicy(warmup=20, budget_s=0.05, min_rounds=6, max_rounds=2000, threshold=KEEP_RATIO)
SAMPLE_S = 2e-4      # a sample: back-to-back calls for about this long
MAX_BATCH = 64       # calls per sample at most
WILD = 8.0           # medians further apart than this, either way: re-measured after a pause
SETTLE_S = 0.2       # the pause (longer than OpenBLAS's and OpenMP's spin after their last job)


def batch_size(per_call_s: float) -> int:
    """Calls per sample for a call that took ``per_call_s`` in the warm-up: about :data:`SAMPLE_S` of calls."""
    if per_call_s <= 0:
        return MAX_BATCH
    return max(1, min(MAX_BATCH, round(SAMPLE_S / per_call_s)))


def _batched(fn: Callable[[], Any], clock: Callable[[], float], warmup: int) -> tuple[Callable[[], Any], int]:
    """``fn`` called ``k`` times in a row, and ``k`` (from the fastest of ``warmup`` timed warm-up calls)."""
    best = float("inf")
    for _ in range(max(1, warmup)):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    k = batch_size(best)

    def run() -> None:
        for _ in range(k):
            fn()
    return run, k


def _measure(question: str, tvm_fn: Callable[[], Any], torch_fn: Callable[[], Any], clock: Callable[[], float],
             policy: DecisionPolicy) -> Decision:
    (t_run, t_k), (p_run, p_k) = (_batched(f, clock, policy.warmup) for f in (tvm_fn, torch_fn))
    samplers = call_samplers({"torch": p_run, "tvm": t_run}, warmup=1, budget_s=policy.budget_s, clock=clock,
                             per_call={"torch": 1 / p_k, "tvm": 1 / t_k})
    return decide_by_timing(question, samplers, default="torch", policy=policy, clock=clock)


def wild(decision: Decision) -> float | None:
    """The tvm/torch ratio of ``decision`` when it is beyond :data:`WILD` either way, else None."""
    r = decision.ratios.get("tvm")
    return r if r is not None and r > 0 and not 1 / WILD <= r <= WILD else None


def judge(question: str, tvm_fn: Callable[[], Any], torch_fn: Callable[[], Any], *,
          clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], Any] = time.sleep,
          policy: DecisionPolicy = PROBE_TIMING,
          one_thread: Callable[[], ContextManager[Any]] | None = None) -> Decision:
    """Whether one probed call stays a torch call (the default) or becomes TVM code (module doc).

    ``one_thread()``: a context in which torch's calls run on one thread (None: torch already does).
    """
    first = _measure(question, tvm_fn, torch_fn, clock, policy)
    ratio = wild(first)
    if ratio is None:
        return first
    sleep(SETTLE_S)
    second = _measure(question, tvm_fn, torch_fn, clock, policy)
    why = f"re-measured after a {SETTLE_S:g} s pause: the first measurement's tvm/torch ratio {ratio:.3g} was " \
          f"beyond {WILD:g}x"
    again = wild(second)
    if again is None or again > 1 or one_thread is None:
        return dataclasses.replace(second, why=f"{second.why} ({why})")
    with one_thread():
        third = _measure(question, tvm_fn, torch_fn, clock, policy)
    return dataclasses.replace(third, why=f"{third.why} (torch on one thread: {why}, and the second's "
                                          f"{again:.3g} too, a stalled multi-thread figure)")
