"""Probe the inter-process link and the pipeline schedule's fixed cost on this host.

Two processes (``torch.distributed``, gloo over TCP loopback, one thread each,
as torchrun starts them) measure what a pipeline of stages pays besides
compute:

* **link**: ping-pong ``send``/``recv`` of ``sizes`` bytes; half a round
  trip per message, fitted by least squares as ``latency + bytes / bandwidth``;
* **schedule overhead**: a two-stage ``torch.distributed.pipelining`` pipeline
  whose stages do nothing (``x + 1`` on 16 floats), run back to back at two
  microbatch counts ``M1 < M2``.  Each rank's CPU seconds per batch (its
  process's, gloo's threads included) are ``step + M · op``: ``op`` (per
  (microbatch, stage): PipelineStage/schedule Python work, irecv/isend setup)
  is the slope and ``step`` (per batch and rank: splitting inputs, merging
  outputs) the intercept.  CPU time, not wall time, so another process's load
  does not leak into it (the least of three rounds: waiting while descheduled
  still costs some CPU);
* **rendezvous**: whether a send completes before its receive is posted (rank 1
  posts 50 ms late; gloo: it does not, so a sender blocks where the schedule
  waits for its sends: :func:`mlcomp.analysis.parallel.pipeline_schedule.simulate`);
* **load**: each process spins one thread for 0.3 s; its CPU time over wall
  time is its share of a core.  A fair scheduler gives each of ``B + 2``
  runnable threads ``cores / (B + 2)``, which gives ``B``, the other
  processes' busy threads; :meth:`LinkProfile.speed`
  says how fast ``R`` ranks run beside ``B`` threads (:func:`rank_speed`).

Usage::

    probe = LinkProbe()                 # configuration only; nothing runs yet
    prof = probe.result                 # spawns 2 processes once (~5 s); cached on the probe
    prof.link.latency, prof.link.bandwidth, prof.op_overhead, prof.step_overhead, prof.cores
    (<s>, <bytes/s>, <s>, <s>, <cores>)            # measured on the host it runs on
    prof.speed(4, background=12.0)      # 4 ranks beside 12 busy threads on 2 cores: 2·4/16 = 0.5 cores
    0.25                                # … spread over the 2 simulated cores (when prof.cores is 2)

The result is measured under whatever load the host has (state it with the
figures); ``cores`` is how many CPUs this process may run on, which the
schedule simulator uses to serialise ranks beyond it.
"""
from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

__all__ = ["Link", "LinkProfile", "LinkProbe", "fit_link", "fit_overhead", "available_cores", "cpu_share",
           "background_threads", "rank_speed", "busy_cores", "background_now"]


@dataclass(frozen=True)
class Link:
    """A point-to-point link: ``seconds(bytes) = messages · latency + bytes / bandwidth``."""

    name: str
    bandwidth: float        # bytes/s, one direction
    latency: float          # seconds per message

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        if nbytes <= 0 and messages <= 0:
            return 0.0
        return messages * self.latency + nbytes / self.bandwidth


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # pragma: no cover - macOS has no affinity masks
        return os.cpu_count() or 1


def _weighted_line(xs: Sequence[float], ys: Sequence[float], ws: Sequence[float]) -> tuple[float, float]:
    """Weighted least squares ``y = a + b·x``: ``(a, b)``."""
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def cpu_share(seconds: float = 0.3) -> float:
    """The fraction of a core one busy thread of this process gets now (its CPU time over wall time)."""
    w0, c0 = time.perf_counter(), time.thread_time()
    x = 0
    while time.perf_counter() - w0 < seconds:
        for i in range(2000):
            x += i
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    return min(1.0, cpu / wall) if wall > 0 else 1.0


def _cpu_ticks() -> tuple[int, int] | None:
    """``(busy, total)`` jiffies of all CPUs since boot (``/proc/stat``), ``None`` where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)        # idle + iowait
    total = sum(fields[:8])                                          # guest time is already in user
    return total - idle, total


def busy_cores(seconds: float = 0.3) -> float | None:
    """How many of the machine's CPUs other processes kept busy over the next ``seconds`` (``/proc/stat``;
    this process only sleeps meanwhile, so it measures without adding load).  ``None`` without
    ``/proc/stat`` (callers fall back to :func:`cpu_share`)."""
    a = _cpu_ticks()
    time.sleep(seconds)
    b = _cpu_ticks()
    if a is None or b is None or b[1] <= a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1]) * (os.cpu_count() or 1)


def background_now(cores: int, seconds: float = 0.3) -> float:
    """Other processes' busy threads now: :func:`busy_cores` where the OS tells, else the share one spinning
    thread gets (:func:`background_threads`, which cannot tell 0 from ``cores - 1`` on an idle host)."""
    busy = busy_cores(seconds)
    if busy is not None:
        return max(0.0, busy)
    return background_threads(cpu_share(seconds), cores, 1)


def background_threads(share: float, cores: int, ours: int) -> float:
    """Runnable threads of other processes, from the ``share`` of a core each of ``ours`` busy threads
    got on ``cores``: a fair scheduler gives each of ``B + ours`` threads ``cores / (B + ours)``."""
    if share >= 1.0 or share <= 0.0:
        return max(0.0, float(cores - ours)) if share >= 1.0 else float("inf")
    return max(0.0, cores / share - ours)


def rank_speed(ranks: int, cores: int, background: float) -> float:
    """How fast each of ``ranks`` one-thread ranks runs, serialised on ``min(ranks, cores)`` simulated
    cores, so that they get the ``cores · ranks / (B + ranks)`` cores a fair scheduler leaves them beside
    ``B`` background threads (1.0 on an idle host with a core per rank)."""
    used = min(ranks, cores)
    share = min(float(used), cores * ranks / (background + ranks)) if background + ranks > cores else float(used)
    return share / used


def fit_link(samples: Sequence[tuple[int, float]], name: str = "gloo over TCP loopback (measured)") -> Link:
    """``latency + bytes / bandwidth`` through ``(bytes, seconds)`` samples, least squares in *relative*
    error (weights ``1/seconds²``), so 4 KiB and 16 MiB messages count alike.

    The latency is floored at a tenth of the smallest message's time (a noisy fit
    may cross zero), the bandwidth capped at 10 TB/s."""
    xs = [float(b) for b, _ in samples]
    ys = [float(t) for _, t in samples]
    if len(set(xs)) < 2 or min(ys) <= 0:
        raise ValueError("fit_link needs positive times at two or more message sizes")
    a, b = _weighted_line(xs, ys, [1.0 / y ** 2 for y in ys])
    b = max(b, 1e-13)
    return Link(name, 1.0 / b, max(a, 0.1 * ys[xs.index(min(xs))]))


def fit_overhead(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(op, step)`` from ``(microbatches, seconds per batch)`` of an empty pipeline (least squares)."""
    xs = [float(m) for m, _ in samples]
    ys = [float(t) for _, t in samples]
    if len(set(xs)) < 2:
        raise ValueError("fit_overhead needs two or more microbatch counts")
    step, op = _weighted_line(xs, ys, [1.0] * len(xs))
    return max(op, 0.0), max(step, 0.0)


@dataclass(frozen=True)
class LinkProfile:
    """What :class:`LinkProbe` measured (see the module docstring)."""

    link: Link
    op_overhead: float                  # seconds per (microbatch, stage) on a core of its own
    step_overhead: float                # seconds per batch per rank on a core of its own
    cores: int
    load_average: float                 # 1-minute load when the probe ran
    background: float = 0.0             # other processes' runnable threads when the probe ran
    link_samples: tuple[tuple[int, float], ...] = ()
    pipeline_samples: tuple[tuple[int, float], ...] = ()
    rendezvous: bool = False            # a send completes only once the receiver has posted its receive

    def speed(self, ranks: int, background: float | None = None) -> float:
        """:func:`rank_speed` for ``ranks`` ranks beside ``background`` (default: as probed) threads."""
        return rank_speed(ranks, self.cores, self.background if background is None else background)

    def format(self) -> str:
        lines = [f"gloo loopback, 2 processes, {self.cores} cores, load average {self.load_average:.1f}, "
                 f"{self.background:.1f} background threads"]
        for size, t in self.link_samples:
            lines.append(f"  {size / 2**10:9.0f} KiB  {t * 1e6:9.1f} us  {size / t / 1e9:6.2f} GB/s")
        lines.append(f"  fit: latency {self.link.latency * 1e6:.1f} us, bandwidth {self.link.bandwidth / 1e9:.2f} GB/s")
        lines.append("  a send completes " + ("only once the receive is posted (rendezvous)" if self.rendezvous
                                              else "before the receive is posted (buffered)"))
        for m, t in self.pipeline_samples:
            lines.append(f"  empty 2-stage pipeline, {m:3d} microbatches: {t * 1e3:8.3f} CPU ms per batch (busier rank)")
        lines.append(f"  schedule overhead on a core of its own: {self.op_overhead * 1e6:.1f} us per "
                     f"(microbatch, stage), {self.step_overhead * 1e6:.1f} us per batch")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LinkProfile":
        return cls(Link(**data["link"]), float(data["op_overhead"]), float(data["step_overhead"]),
                   int(data["cores"]), float(data["load_average"]), float(data.get("background", 0.0)),
                   tuple((int(a), float(b)) for a, b in data.get("link_samples", ())),
                   tuple((int(a), float(b)) for a, b in data.get("pipeline_samples", ())),
                   bool(data.get("rendezvous", False)))


class _Nothing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: str, sizes: Sequence[int], repeats: int,
            microbatches: Sequence[int], batches: int) -> None:
    """One of the two probe processes (module level: spawned processes import it by name)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        link: list[tuple[int, float]] = []
        for size in sizes:
            t = torch.zeros(max(1, size // 4))
            samples = []
            for _ in range(repeats + 2):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
                samples.append((time.perf_counter() - start) / 2)
            link.append((size, statistics.median(samples[2:])))
        # does a send complete before its receive is posted?  rank 1 posts 50 ms late
        dist.barrier()
        t = torch.zeros(16)
        if rank == 0:
            start = time.perf_counter()
            dist.isend(t, 1).wait()
            held = time.perf_counter() - start
        else:
            time.sleep(0.05)
            dist.recv(t, 0)
            held = 0.0
        pipeline: list[tuple[int, float]] = []
        for m in microbatches:
            stage = PipelineStage(_Nothing(), rank, 2, torch.device("cpu"))
            sched = Schedule1F1B(stage, m)
            x = torch.zeros(m, 16)
            with torch.no_grad():
                for _ in range(3):
                    sched.step(*((x,) if rank == 0 else ()))
                rounds = []
                for _ in range(3):      # the least of 3 rounds: a rank descheduled mid-wait burns more
                    dist.barrier()
                    cpu = time.process_time()
                    for _ in range(batches):
                        sched.step(*((x,) if rank == 0 else ()))
                    rounds.append((time.process_time() - cpu) / batches)
            both: list[Any] = [None, None]
            dist.all_gather_object(both, rounds)
            pipeline.append((m, min(max(r) for r in zip(*both))))
        dist.barrier()
        share = cpu_share()
        shares: list[Any] = [None, None]
        dist.all_gather_object(shares, share)
        if rank == 0:
            Path(out).write_text(json.dumps({"link": link, "pipeline": pipeline, "share": statistics.mean(shares),
                                             "rendezvous": held > 0.025}))
    finally:
        dist.destroy_process_group()


@dataclass
class LinkProbe:
    """How to probe (message sizes, repeats, microbatch counts); :attr:`result` runs it once and keeps it."""

    sizes: tuple[int, ...] = tuple(1 << k for k in range(12, 25, 2))     # 4 KiB … 16 MiB
    repeats: int = 10
    microbatches: tuple[int, ...] = (2, 16)
    batches: int = 20
    _runs: int = field(default=0, repr=False)

    @functools.cached_property
    def result(self) -> LinkProfile:
        """The measurement (two processes, once per probe object)."""
        if len(set(self.microbatches)) < 2 or len(self.sizes) < 2 or min(self.microbatches) < 2:
            raise ValueError("the probe needs two message sizes and two microbatch counts >= 2 (1F1B on two "
                             "stages needs at least two microbatches) to fit")
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="mlcomp-link-") as tmp:
            out = str(Path(tmp) / "probe.json")
            mp.spawn(_worker, args=(_free_port(), out, list(self.sizes), self.repeats, list(self.microbatches),
                                    self.batches), nprocs=2, join=True)
            data = json.loads(Path(out).read_text())
        self._runs += 1
        link_samples = tuple((int(s), float(t)) for s, t in data["link"])
        pipe_samples = tuple((int(m), float(t)) for m, t in data["pipeline"])
        cores = available_cores()
        background = background_threads(float(data["share"]), cores, 2)
        op, step = fit_overhead(pipe_samples)
        return LinkProfile(fit_link(link_samples), op, step, cores, load, background, link_samples, pipe_samples,
                           bool(data["rendezvous"]))
