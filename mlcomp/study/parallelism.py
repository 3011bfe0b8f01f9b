"""Study ``parallelism``: independent branches run concurrently, and compute overlapped with copies.

Part 1 (chapter 12.3.1) runs two independent chains of matrix products:

* GPU present: both chains on one stream vs on two CUDA streams, and the
  chapter's own experiment — one chain on the CPU and one on the GPU at once;
* CPU only: serially with one intra-op thread, serially with every intra-op
  thread, and concurrently on two Python threads with one intra-op thread
  each (torch releases the GIL inside ops).  Two sizes: large products, where
  one op already fills every core, and small ones, where it cannot (the
  chapter's exercise 2).

Variants of one comparison are timed round-robin
(:func:`mlcomp.hardware.timing.measure_interleaved`) so that load drift on a shared
machine falls on all of them alike.

Part 2 (chapter 12.3.2) computes a list of products and copies each result to
the host: serially (compute all, then copy all) vs overlapped (copy ``y[i-1]``
while computing ``y[i]``).  On a GPU the copies are ``non_blocking`` into pinned
memory on a second stream.  Without a GPU there is no device-to-host copy; the
CPU stand-in copies each result into a separate buffer on a second thread.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlcomp.hardware.threads import threads as torch_threads
from mlcomp.hardware.timing import measure_interleaved, synchronizer
from mlcomp.study import chapter
from mlcomp.study.common import Figure, StudyConfig, StudyResult, machine_line, paired


def _chain(x: Any, k: int) -> list[Any]:
    return [x.mm(x) for _ in range(k)]


def _cpu_branches(config: StudyConfig, n: int, k: int, tag: str) -> list[Figure]:
    import torch

    full = torch.get_num_threads()
    x1, x2 = torch.rand(n, n), torch.rand(n, n)

    def serial_one() -> None:
        with torch_threads(1):
            _chain(x1, k), _chain(x2, k)

    with ThreadPoolExecutor(2, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        def both() -> None:
            a, b = pool.submit(_chain, x1, k), pool.submit(_chain, x2, k)
            a.result(), b.result()

        t = measure_interleaved({"one": serial_one, "all": lambda: (_chain(x1, k), _chain(x2, k)), "both": both},
                                config.policy(warmup=1, min_repeats=3), clock=config.timer)
    one, allt, conc = t["one"].median, t["all"].median, t["both"].median
    return [
        Figure(f"{tag}: serial, 1 intra-op thread", one, "s", "", f"2 chains x {k} products {n}x{n}"),
        Figure(f"{tag}: serial, {full} intra-op threads", allt, "s", "", f"{paired(t, 'one', 'all')} over 1 thread"),
        Figure(f"{tag}: two threads, 1 intra-op thread each", conc, "s", "",
               f"{paired(t, 'one', 'both')} over serial-1, {paired(t, 'all', 'both')} over serial-{full}"),
    ]


def _cuda_branches(config: StudyConfig, n: int, k: int) -> list[Figure]:
    import torch

    dev = torch.device("cuda")
    sync = synchronizer(dev)
    policy, clock = config.policy(warmup=1, min_repeats=3), config.timer
    x1, x2, xc = torch.rand(n, n, device=dev), torch.rand(n, n, device=dev), torch.rand(n, n)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def two_streams() -> None:
        s1.wait_stream(torch.cuda.current_stream())   # inputs were made on the default stream
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            _chain(x1, k)
        with torch.cuda.stream(s2):
            _chain(x2, k)

    t = measure_interleaved(
        {"one": lambda: (_chain(x1, k), _chain(x2, k)), "two": two_streams, "cpu": lambda: _chain(xc, k),
         "gpu": lambda: _chain(x1, k), "both": lambda: (_chain(x1, k), _chain(xc, k))},
        policy, clock=clock, sync=sync)
    one_stream, streams, t_cpu, t_gpu, t_both = (t[name].median
                                                 for name in ("one", "two", "cpu", "gpu", "both"))
    return [
        Figure("GPU: two chains, one stream", one_stream, "s", "", f"2 x {k} products {n}x{n}"),
        Figure("GPU: two chains, two streams", streams, "s", "", paired(t, "one", "two")),
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
        t = measure_interleaved({"compute": lambda: _chain(x, k), "copy": lambda: copy_all(ys),
                                 "serial": lambda: copy_all(_chain(x, k)), "overlap": overlapped},
                                policy, clock=clock)
    t_compute, t_copy, t_serial, t_over = (t[name].median for name in ("compute", "copy", "serial", "overlap"))
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
    t = measure_interleaved({"compute": lambda: _chain(x, k), "copy": lambda: [y.to("cpu") for y in ys],
                             "serial": lambda: [y.to("cpu") for y in _chain(x, k)], "overlap": overlapped},
                            policy, clock=clock, sync=sync)
    t_compute, t_copy, t_serial, t_over = (t[name].median for name in ("compute", "copy", "serial", "overlap"))
    return _overlap_figures(t_compute, t_copy, t_serial, t_over, f"GPU, {k} products {n}x{n}",
                            "non_blocking into pinned memory on a copy stream")


def _overlap_figures(compute: float, copy: float, serial: float, over: float, tag: str, how: str) -> list[Figure]:
    bound = (compute + copy) / max(compute, copy)     # perfect overlap hides the shorter of the two
    return [
        Figure(f"{tag}: compute only", compute, "s", chapter.PARALLEL["compute"]),
        Figure(f"{tag}: copy results only", copy, "s", chapter.PARALLEL["copy"]),
        Figure(f"{tag}: compute, then copy", serial, "s", "", "serial"),
        Figure(f"{tag}: compute overlapped with copy", over, "s", chapter.PARALLEL["compute+copy"],
               f"{how}; {serial / over:.2f}x over serial; perfect overlap of the parts: {bound:.2f}x"),
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
        _verdict(figures, f"large {big[0]}x{big[0]}"),
        _verdict(figures, f"small {small[0]}x{small[0]}"),
    ]
    if device == "cpu":
        rows = {f.label.split(": ", 1)[-1]: f.measured for f in figures if f.label.startswith("CPU stand-in")}
        share = rows.get("copy results only", 0.0) / (rows.get("compute only") or 1.0)
        notes.append("No GPU here, so there is no CPU+GPU run, no second stream and no device-to-host copy. "
                     "The overlap rows use a CPU stand-in (a copy thread plays the DMA engine). Copying took "
                     f"{share:.0%} of the compute time, which bounds what overlap can save; and a copy thread "
                     "competes for the same cores and memory bus, which a GPU's copy engine does not.")
    setup = f"device {device}; median of >= {config.policy().min_repeats} repeats. {machine_line()}"
    return StudyResult("parallelism", "Automatic parallelism: branches and overlapped copies (chapter 12.3)", setup,
                       tuple(figures), (), tuple(notes), {"device": device})


def _verdict(figures: list[Figure], tag: str) -> str:
    """What the measured numbers say about inter-op vs intra-op parallelism for one size."""
    import os

    rows = {f.label.split(": ", 1)[1]: f.measured for f in figures if f.label.startswith(tag + ":")}
    one = rows.get("serial, 1 intra-op thread")
    many = next((v for k, v in rows.items() if k.startswith("serial, ") and "1 intra-op" not in k), None)
    both = rows.get("two threads, 1 intra-op thread each")
    if not (one and many and both):
        return f"{tag}: incomplete measurements."
    intra, inter = one / many, one / both
    text = (f"{tag}: intra-op threads give {intra:.2f}x over one thread, two concurrent branches "
            f"{inter:.2f}x. ")
    if intra < 0.9 or inter < 0.9:
        load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if hasattr(os, "getloadavg") \
            else "a busy machine"
        text += (f"Threads made it slower: with {load}, a thread that must wait for its partner (an "
                 "OpenMP barrier, a join) waits for a core another process holds.")
    elif inter > intra * 1.15:
        text += "Branch parallelism wins: one op alone does not fill the cores (the chapter's exercise 2)."
    elif intra > inter * 1.15:
        text += "Intra-op threads win: each op already fills the cores, as the chapter says for one device."
    else:
        text += "Both fill the cores about equally, as the chapter expects when one op is large enough."
    return text


def plot(result: StudyResult, path: str) -> None:
    from mlcomp.study.plots import bar_plot

    bar_plot(result, path)
