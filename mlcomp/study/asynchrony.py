"""Study ``asynchrony``: the same work timed without and with a barrier — the wrong number and the right one.

The chapter generates ten 1000x1000 random matrices and multiplies each with
itself; on an asynchronous backend the loop returns before the work is done,
so a clock stopped right after it measures only how fast work was *queued*.

* On CUDA the study does exactly that with and without
  ``torch.cuda.synchronize`` before the clock stops.
* CPU PyTorch is synchronous: every op returns when its result exists.  The
  study shows that honestly — both numbers agree — and then rebuilds the
  chapter's frontend/backend split on the CPU: a one-thread *backend* executes
  submitted work while the Python *frontend* returns at once.  Timing the
  frontend without waiting on the futures gives the wrong number; waiting
  gives the right one.

The second experiment (chapter 12.2.3) adds 1 to a small tensor 1000 times
with a barrier after every step vs one barrier at the end.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from mlcomp.hardware.timing import (
    Clock,
    Sync,
    TimingPolicy,
    measure,
    measure_interleaved,
    median,
    no_sync,
    synchronizer,
)
from mlcomp.study import chapter
from mlcomp.study.common import Figure, StudyConfig, StudyResult, machine_line, paired


class ThreadBackend:
    """A one-thread executor standing in for an asynchronous backend (torch ops release the GIL)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlcomp-backend")
        self._pending: list[Future[Any]] = []

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut = self._pool.submit(fn)
        self._pending.append(fut)
        return fut

    def wait_all(self) -> None:
        """The barrier: block until everything submitted so far has run."""
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def close(self) -> None:
        self.wait_all()
        self._pool.shutdown()

    def __enter__(self) -> "ThreadBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def wrong_and_right(work: Callable[[], Any], drain: Sync, clock: Clock, policy: TimingPolicy) -> tuple[float, float]:
    """Median of the chapter's *wrong* number and of the right one, sampled alternately.

    Wrong: the clock stops as soon as ``work`` returns, before queued work is
    drained.  Right: ``drain`` runs before the clock stops.  Each round takes
    one sample of each, and drains outside the clock in between, so one
    sample's backlog never leaks into the next and load drift falls on both.
    """
    for _ in range(policy.warmup):
        work()
        drain()
    wrong: list[float] = []
    right: list[float] = []
    begin = clock()
    while len(wrong) < policy.max_repeats:
        start = clock()
        work()
        wrong.append(clock() - start)
        drain()                                   # outside the clock: the backlog of the wrong sample
        start = clock()
        work()
        drain()
        right.append(clock() - start)
        if len(wrong) >= policy.min_repeats and clock() - begin >= 2 * policy.budget_s:
            break
    return median(wrong), median(right)


def run(config: StudyConfig) -> StudyResult:
    import numpy as np
    import torch

    device = config.resolved_device()
    n, k, steps = (200, 2, 50) if config.quick else (1000, 10, 1000)
    policy = config.policy(warmup=1, min_repeats=3)
    clock = config.timer
    sync = synchronizer(device)
    figures: list[Figure] = []
    rng = np.random.default_rng(0)

    def numpy_work() -> None:
        for _ in range(k):
            a = rng.normal(size=(n, n))
            a.dot(a)

    def torch_work() -> None:
        for _ in range(k):
            a = torch.randn(n, n, device=device)
            torch.mm(a, a)

    t_np = measure(numpy_work, policy, clock=clock).median
    figures.append(Figure(f"numpy, {k} x (normal {n}x{n} + dot)", t_np, "s", chapter.ASYNC_MATMUL["numpy"],
                          "synchronous by construction"))
    wrong, right = wrong_and_right(torch_work, sync, clock, policy)
    agree = f"without/with = {wrong / right:.2f}" if right else ""
    figures.append(Figure(f"torch {device}, clock stopped without barrier", wrong, "s",
                          chapter.ASYNC_MATMUL["no barrier"],
                          "queued work not counted" if device == "cuda" else
                          "CPU torch returns only when done: no queue to miss"))
    figures.append(Figure(f"torch {device}, barrier before the clock stops", right, "s",
                          chapter.ASYNC_MATMUL["barrier"],
                          "torch.cuda.synchronize" if device == "cuda" else f"no-op barrier; {agree}"))
    with ThreadBackend() as backend:
        def submit_all() -> None:
            for _ in range(k):
                backend.submit(lambda: _one_matmul(n))

        q_wrong, q_right = wrong_and_right(submit_all, backend.wait_all, clock, policy)
    figures.append(Figure("CPU thread backend, frontend returns (no barrier)", q_wrong, "s",
                          chapter.ASYNC_MATMUL["no barrier"], "only the submission is timed: the wrong number"))
    figures.append(Figure("CPU thread backend, wait on all futures", q_right, "s", chapter.ASYNC_MATMUL["barrier"],
                          f"the right number; {q_right / q_wrong:.0f}x the wrong one" if q_wrong else ""))
    figures += _steps(config, device, steps, clock, sync, config.policy(warmup=5, min_repeats=5))
    notes = [
        "The barrier belongs inside the timed region, before the clock stops: `mlcomp bench` calls the "
        "device's synchroniser after every timed call (tests check that order with a fake clock).",
    ]
    if device == "cpu":
        notes.append("No GPU here. CPU PyTorch executes each op before returning, so 'without barrier' and "
                     "'with barrier' measure the same thing; the thread backend reproduces the "
                     "chapter's frontend/backend split on the CPU to show the failure mode for real.")
    setup = (f"{k} x (normal sample {n}x{n}, matrix product) on {device}; barrier experiment: {steps} steps "
             f"of y = x + 1 on a 1x2 tensor; median of >= {policy.min_repeats} repeats. {machine_line()}")
    return StudyResult("asynchrony", "Asynchrony: timing without and with a barrier (chapter 12.2)", setup,
                       tuple(figures), (), tuple(notes), {"device": device})


def _one_matmul(n: int) -> Any:
    import torch

    a = torch.randn(n, n)
    return torch.mm(a, a)


def _steps(config: StudyConfig, device: str, steps: int, clock: Clock, sync: Sync, policy: Any) -> list[Figure]:
    """Chapter 12.2.3: a barrier after every step vs one at the end (device, then thread backend)."""
    import torch

    x = torch.ones(1, 2, device=device)

    def each() -> None:
        for _ in range(steps):
            x + 1
            sync()

    def once() -> None:
        for _ in range(steps):
            y = x + 1
        del y

    t = measure_interleaved({"each": each, "once": once}, policy, clock=clock, sync={"each": no_sync, "once": sync})
    out = [Figure(f"{steps} x (y = x + 1) on {device}, barrier each step", t["each"].median, "s",
                  chapter.ASYNC_STEPS["barrier each step"], "" if device == "cuda" else "barrier is a no-op"),
           Figure(f"{steps} x (y = x + 1) on {device}, one barrier", t["once"].median, "s",
                  chapter.ASYNC_STEPS["one barrier"])]
    with ThreadBackend() as backend:
        def each_b() -> None:
            for _ in range(steps):
                backend.submit(lambda: x + 1).result()

        def once_b() -> None:
            for _ in range(steps):
                backend.submit(lambda: x + 1)
            backend.wait_all()

        tb = measure_interleaved({"each": each_b, "once": once_b}, policy, clock=clock)
        t_each, t_once = tb["each"].median, tb["once"].median
    out.append(Figure(f"{steps} steps via thread backend, barrier each step", t_each, "s",
                      chapter.ASYNC_STEPS["barrier each step"], "frontend waits for every result"))
    out.append(Figure(f"{steps} steps via thread backend, one barrier", t_once, "s",
                      chapter.ASYNC_STEPS["one barrier"], f"{paired(tb, 'each', 'once')} faster: frontend and "
                                                          "backend overlap" if t_once else ""))
    return out


def plot(result: StudyResult, path: str) -> None:
    from mlcomp.study.plots import bar_plot

    bar_plot(result, path)
