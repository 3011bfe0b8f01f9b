"""Study ``parallelism``: independent branches run concurrently, and compute overlapped with copies.

Part 1 (chapter 12.3.1) runs two independent chains of matrix products:

* GPU present: both chains on one stream vs on two CUDA streams, and the
  chapter's own experiment — one chain on the CPU and one on the GPU at once;
* CPU only: serially with one intra-op thread, serially with every intra-op
  thread, and concurrently on two Python threads with one intra-op thread
  each (torch releases the GIL inside ops).  Two sizes: large products, where
  one op already fills every core, and small ones, where it cannot (the
  chapter's exercise 2).

Part 2 (chapter 12.3.2) computes a list of products and copies each result to
the host: serially (compute all, then copy all) vs overlapped (copy ``y[i-1]``
while computing ``y[i]``).  On a GPU the copies are ``non_blocking`` into pinned
memory on a second stream.  Without a GPU there is no device-to-host copy; the
CPU stand-in copies each result into a separate buffer on a second thread.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from ..timing import measure, synchronizer
from . import chapter
from .common import Figure, StudyConfig, StudyResult, machine_line


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Set torch's intra-op thread count for the block and restore it afterwards."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _chain(x: Any, k: int) -> list[Any]:
    return [x.mm(x) for _ in range(k)]


def _cpu_branches(config: StudyConfig, n: int, k: int, tag: str) -> list[Figure]:
    import torch

    full = torch.get_num_threads()
    x1, x2 = torch.rand(n, n), torch.rand(n, n)
    policy = config.policy(warmup=1, min_repeats=3)
    clock = config.timer
    with torch_threads(1):
        one = measure(lambda: (_chain(x1, k), _chain(x2, k)), policy, clock=clock).median
    allt = measure(lambda: (_chain(x1, k), _chain(x2, k)), policy, clock=clock).median
    with torch_threads(1), ThreadPoolExecutor(2, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        def both() -> None:
            a, b = pool.submit(_chain, x1, k), pool.submit(_chain, x2, k)
            a.result(), b.result()

        conc = measure(both, policy, clock=clock).median
    return [
        Figure(f"{tag}: serial, 1 intra-op thread", one, "s", "", f"2 chains x {k} products {n}x{n}"),
        Figure(f"{tag}: serial, {full} intra-op threads", allt, "s", "",
               f"{one / allt:.2f}x over 1 thread: each op uses every core"),
        Figure(f"{tag}: two threads, 1 intra-op thread each", conc, "s", "",
               f"{one / conc:.2f}x over serial-1, {allt / conc:.2f}x over serial-{full}"),
    ]


def _cuda_branches(config: StudyConfig, n: int, k: int) -> list[Figure]:
    import torch

    dev = torch.device("cuda")
    sync = synchronizer(dev)
    policy, clock = config.policy(warmup=1, min_repeats=3), config.timer
    x1, x2, xc = torch.rand(n, n, device=dev), torch.rand(n, n, device=dev), torch.rand(n, n)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def two_streams() -> None:
        with torch.cuda.stream(s1):
            _chain(x1, k)
        with torch.cuda.stream(s2):
            _chain(x2, k)

    one_stream = measure(lambda: (_chain(x1, k), _chain(x2, k)), policy, clock=clock, sync=sync).median
    streams = measure(two_streams, policy, clock=clock, sync=sync).median
    t_cpu = measure(lambda: _chain(xc, k), policy, clock=clock).median
    t_gpu = measure(lambda: _chain(x1, k), policy, clock=clock, sync=sync).median
    t_both = measure(lambda: (_chain(x1, k), _chain(xc, k)), policy, clock=clock, sync=sync).median
    return [
        Figure("GPU: two chains, one stream", one_stream, "s", "", f"2 x {k} products {n}x{n}"),
        Figure("GPU: two chains, two streams", streams, "s", "", f"{one_stream / streams:.2f}x"),
        Figure("CPU chain alone", t_cpu, "s", chapter.PARALLEL["cpu"]),
        Figure("GPU chain alone", t_gpu, "s", chapter.PARALLEL["gpu"]),
        Figure("CPU and GPU chains at once", t_both, "s", chapter.PARALLEL["both"],
               f"{(t_cpu + t_gpu) / t_both:.2f}x over the sum"),
    ]


def _cpu_overlap(config: StudyConfig, n: int, k: int) -> list[Figure]:
    import torch

    x = torch.rand(n, n)
    dst = [torch.empty(n, n) for _ in range(k)]
    policy, clock = config.policy(warmup=1, min_repeats=3), config.timer

    def copy_all(ys: list[Any]) -> None:
        for d, y in zip(dst, ys):
            d.copy_(y)

    def overlapped() -> None:
        todo: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def copier() -> None:
            torch.set_num_threads(1)
            for d in dst:
                d.copy_(todo.get())

        t = threading.Thread(target=copier)
        t.start()
        for _ in range(k):
            todo.put(x.mm(x))
        t.join()

    with torch_threads(1):
        ys = _chain(x, k)
        t_compute = measure(lambda: _chain(x, k), policy, clock=clock).median
        t_copy = measure(lambda: copy_all(ys), policy, clock=clock).median
        t_serial = measure(lambda: copy_all(_chain(x, k)), policy, clock=clock).median
        t_over = measure(overlapped, policy, clock=clock).median
    return _overlap_figures(t_compute, t_copy, t_serial, t_over, f"CPU stand-in, {k} products {n}x{n}",
                            "copy thread")


def _cuda_overlap(config: StudyConfig, n: int, k: int) -> list[Figure]:
    import torch

    dev = torch.device("cuda")
    sync = synchronizer(dev)
    policy, clock = config.policy(warmup=1, min_repeats=3), config.timer
    x = torch.rand(n, n, device=dev)
    pinned = [torch.empty(n, n, pin_memory=True) for _ in range(k)]
    copy_stream = torch.cuda.Stream()

    def overlapped() -> None:
        for h in pinned:
            y = x.mm(x)
            done = torch.cuda.Event()
            done.record()
            copy_stream.wait_event(done)
            with torch.cuda.stream(copy_stream):
                h.copy_(y, non_blocking=True)
            y.record_stream(copy_stream)

    ys = _chain(x, k)
    sync()
    t_compute = measure(lambda: _chain(x, k), policy, clock=clock, sync=sync).median
    t_copy = measure(lambda: [y.to("cpu") for y in ys], policy, clock=clock, sync=sync).median
    t_serial = measure(lambda: [y.to("cpu") for y in _chain(x, k)], policy, clock=clock, sync=sync).median
    t_over = measure(overlapped, policy, clock=clock, sync=sync).median
    return _overlap_figures(t_compute, t_copy, t_serial, t_over, f"GPU, {k} products {n}x{n}",
                            "non_blocking into pinned memory on a copy stream")


def _overlap_figures(compute: float, copy: float, serial: float, over: float, tag: str, how: str) -> list[Figure]:
    bound = serial / max(compute, copy)
    return [
        Figure(f"{tag}: compute only", compute, "s", chapter.PARALLEL["compute"]),
        Figure(f"{tag}: copy results only", copy, "s", chapter.PARALLEL["copy"]),
        Figure(f"{tag}: compute, then copy", serial, "s", "", "serial"),
        Figure(f"{tag}: compute overlapped with copy", over, "s", chapter.PARALLEL["compute+copy"],
               f"{how}; {serial / over:.2f}x over serial (at most {bound:.2f}x possible)"),
        Figure("overlap speedup over serial", serial / over, "x"),
    ]


def run(config: StudyConfig) -> StudyResult:
    device = config.resolved_device()
    big, small = ((128, 2), (32, 20)) if config.quick else ((2000, 10), (64, 400))
    figures: list[Figure] = []
    figures += _cpu_branches(config, *big, f"large {big[0]}x{big[0]}")
    figures += _cpu_branches(config, *small, f"small {small[0]}x{small[0]}")
    if device == "cuda":
        figures += _cuda_branches(config, *((256, 2) if config.quick else (2000, 10)))
        figures += _cuda_overlap(config, *((256, 2) if config.quick else (2000, 10)))
    else:
        figures += _cpu_overlap(config, *((128, 4) if config.quick else (1024, 20)))
    notes = [
        "torch.set_num_threads is per process for the intra-op pool; the concurrent runs set it to 1 in "
        "the main thread and in each worker, and restore it afterwards.",
        "The chapter's point holds where one op already uses every core (large products): running the "
        "branches side by side buys little over intra-op threads.  With small ops, each op cannot fill "
        "the machine and inter-op parallelism pays (its exercise 2).",
    ]
    if device == "cpu":
        notes.append("No GPU here, so there is no CPU+GPU run, no second stream and no device-to-host copy. "
                     "The overlap rows use a CPU stand-in (a copy thread plays the DMA engine); host memory "
                     "copies are cheap next to the products, so the possible saving is small, and a copy "
                     "thread competes for the same cores and memory bus that a real DMA engine would not.")
    setup = f"device {device}; median of >= {config.policy().min_repeats} repeats. {machine_line()}"
    return StudyResult("parallelism", "Automatic parallelism: branches and overlapped copies (chapter 12.3)", setup,
                       tuple(figures), (), tuple(notes), {"device": device})


def plot(result: StudyResult, path: str) -> None:
    from .common import bar_plot

    bar_plot(result, path)
