"""A pipeline schedule simulator: GPipe, 1F1B and interleaved 1F1B on per-stage times.

Each rank runs its operations (forward ``F`` or backward ``B`` of one
microbatch on one of its stages) in the order its schedule prescribes; an
operation starts when its rank is free and its input has arrived (``F`` of
stage ``s`` needs ``F`` of stage ``s-1``; ``B`` of stage ``s`` needs ``B`` of
``s+1``, the last stage's ``B`` its own ``F``).  Out come the per-rank
timeline, the bubble fraction, throughput and the peak memory per rank::

    GPipe, S=2 stages of 1 s, M=3 microbatches, forward only
    rank 0  F0 F1 F2 .       makespan = (M+S-1)·t = 4 s
    rank 1  .  F0 F1 F2      bubble = (S-1)/(M+S-1) = 1/4

    >>> tl = simulate([1.0, 1.0], microbatches=3, schedule=Schedule.GPIPE)
    >>> tl.makespan, tl.bubble_fraction
    (4.0, 0.25)

What a real pipeline pays besides compute (``torch.distributed.pipelining``
on gloo; figures from :class:`mlcomp.hardware.link.LinkProbe`) enters as three
kinds of events, so the predicted time of a batch is the simulated makespan:

* **compute**: ``forward[s]`` / ``backward[s]`` on the rank;
* **overhead** (rank time, before the compute of every op): ``overhead``
  seconds per (microbatch, stage): the schedule's Python work, irecv/isend
  setup and waits; ``step_overhead`` once per batch per rank (splitting the
  batch, merging outputs);
* **communication** (a delay between ranks, not rank time):
  ``transfer[s] = messages · latency + bytes / bandwidth`` from stage ``s`` to
  ``s+1`` (:meth:`PlacementCost.transfer_seconds`).  With ``rendezvous``
  (gloo's sends, as the probe finds them) a message moves only once its
  receive is posted, and the sender blocks where torch's schedule waits for
  its sends (:func:`send_waits`)::

      1F1B, forward only, stages of 1 s and 3 s, M=3
      buffered    rank 0  F0 F1 F2              (sends never block)
      rendezvous  rank 0  F0 F1 .. F2 ..        (F1's send waits for rank 1 to post at 4 s)

``cores``: at most that many ops run at once; an op whose rank is ready waits
for the first core to free up (list scheduling in time order), which is how 4
single-threaded ranks share 2 cores; ``speed`` (< 1) divides every op's rank
time when other processes load the host (``LinkProfile.speed``: a fair
scheduler leaves ``R`` ranks ``cores · R / (B + R)`` cores beside ``B`` busy
threads).  ``batches`` runs that many steps back to
back, as a timed loop does (rank 0 starts the next batch while the last rank
finishes this one); throughput is ``batches · M / makespan``::

    S=2, M=2, compute 1 s, overhead 0.5 s, transfer 0.25 s, 1 core
    rank 0  [o F0][o F1]                          F0 on rank 1 is ready at 1.75
    rank 1               [o F0][o F1]             but the core frees at 3.0
    makespan = 4 · 1.5 = 6.0 s (2 cores: 1.5 + 0.25 + 1.5 + 1.5 = 4.75 s)

Memory: a microbatch's activations of a stage are held from the start of its
``F`` to the end of its ``B`` (training), or for the ``F`` alone (inference);
peak memory per rank = its parameters + the most activation bytes in flight.
1F1B caps what is in flight at ``S - rank`` microbatches, GPipe holds all
``M``.  Interleaved 1F1B gives every rank ``v`` stages (rank ``r`` runs stages
``r, r+R, …``) and needs ``M`` to be a multiple of the ranks ``R``.
Everything is O(ops · R + ops · log cores).  :func:`plot_timeline` draws the Gantt chart
(matplotlib, imported when called).
"""
from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from typing import Sequence

from mlcomp.analysis.parallel.schedule_orders import (Key, Op, Schedule, batched_orders, send_waits, in_flight,
                                             rank_orders)
from mlcomp.base.errors import MlcompError

__all__ = ["Schedule", "Op", "Event", "Timeline", "simulate", "in_flight", "rank_orders", "plot_timeline"]


@dataclass(frozen=True)
class Event:
    rank: int
    stage: int
    microbatch: int
    op: Op
    start: float
    end: float
    overhead: float = 0.0               # of end - start, seconds of schedule overhead (the rest computes)


@dataclass(frozen=True)
class Timeline:
    schedule: Schedule
    ranks: int
    stages: int
    microbatches: int
    events: tuple[Event, ...]
    makespan: float
    busy: tuple[float, ...]             # seconds each rank computes
    peak_memory: tuple[int, ...]        # bytes per rank: parameters + activations in flight
    peak_in_flight: tuple[int, ...]     # most microbatches a rank holds at once
    batches: int = 1                    # steps simulated back to back

    @property
    def batch_seconds(self) -> float:
        """Seconds per batch (``M`` microbatches) in steady back-to-back running."""
        return self.makespan / self.batches

    @property
    def bubble_fraction(self) -> float:
        total = self.ranks * self.makespan
        return 1.0 - sum(self.busy) / total if total > 0 else 0.0

    @property
    def throughput(self) -> float:
        """Microbatches per second."""
        return self.microbatches * self.batches / self.makespan if self.makespan > 0 else float("inf")


def simulate(forward: Sequence[float], backward: Sequence[float] | None = None, *, microbatches: int,
             schedule: Schedule = Schedule.GPIPE, virtual: int = 1, transfer: Sequence[float] = (),
             param_bytes: Sequence[int] = (), activation_bytes: Sequence[int] = (), overhead: float = 0.0,
             step_overhead: float = 0.0, cores: int | None = None, batches: int = 1,
             speed: float = 1.0, rendezvous: bool = False) -> Timeline:
    """Simulate ``len(forward)`` stages (``virtual`` per rank for interleaved) over ``microbatches``.

    ``backward``: per-stage backward seconds (training) or ``None`` (inference);
    ``transfer[s]``: seconds from stage ``s`` to ``s+1`` (a delay, not rank time);
    ``overhead``: rank seconds every (microbatch, stage) op pays besides compute;
    ``step_overhead``: rank seconds per batch; ``cores``: at most this many ops
    run at once (``None``: every rank has its own core); ``batches``: steps run
    back to back, as a timed loop runs them; ``speed``: the fraction of a core a
    running op gets (rank time is divided by it; below 1 on a loaded host);
    ``rendezvous``: a send completes only once its receiver has posted the
    receive (gloo's point-to-point, :attr:`LinkProfile.rendezvous`), and the
    sender waits for it where the schedule waits (:func:`send_waits`).
    """
    stages = len(forward)
    if schedule is not Schedule.INTERLEAVED:
        virtual = 1
    if stages % virtual:
        raise MlcompError(f"{stages} stages cannot be spread evenly as {virtual} per rank")
    if cores is not None and cores < 1:
        raise MlcompError(f"cores={cores}: the simulator needs at least one core")
    if not 0.0 < speed <= 1.0:
        raise MlcompError(f"speed={speed}: a rank gets more than nothing and at most a whole core")
    ranks = stages // virtual
    training = backward is not None
    per_step = rank_orders(schedule, ranks, microbatches, virtual, training)
    orders = batched_orders(per_step, microbatches, max(1, batches), step_overhead)
    plans = [send_waits(schedule, orders[r], len(per_step[r]), ranks, r, microbatches, stages, training)
             if rendezvous else ([[] for _ in orders[r]], list(range(len(orders[r]))), [False] * len(orders[r]))
             for r in range(ranks)]
    memory = _Memory(ranks, list(activation_bytes) + [0] * stages, training)
    sim = _Simulation(orders, plans, forward, backward, memory, transfer=transfer, overhead=overhead,
                      cores=cores, speed=speed, rendezvous=rendezvous)
    sim.run(schedule)
    makespan = max(max((e.end for e in sim.events), default=0.0), max(sim.free, default=0.0))
    busy = [0.0] * ranks
    for e in sim.events:
        busy[e.rank] += e.end - e.start
    pbytes = list(param_bytes) + [0] * stages
    params = [sum(pbytes[s] for s in range(r, stages, ranks)) for r in range(ranks)]
    return Timeline(schedule, ranks, stages, microbatches,
                    tuple(sorted(sim.events, key=lambda e: (e.rank, e.start))), makespan, tuple(busy),
                    tuple(p + b for p, b in zip(params, memory.peak_bytes)), tuple(memory.peak_count),
                    max(1, batches))


Plan = tuple[list[list[Key]], list[int], list[bool]]     # send_waits: (waits, post_at, early) per op


class _Memory:
    """Activation bytes and microbatches each rank holds: taken at a forward, given back at the end of the
    backward (training) or of the forward itself (inference)."""

    def __init__(self, ranks: int, abytes: list[int], training: bool) -> None:
        self.abytes, self.training = abytes, training
        self.held, self.peak_bytes = [0] * ranks, [0] * ranks
        self.count, self.peak_count = [0] * ranks, [0] * ranks
        self.releases: list[list[tuple[float, int]]] = [[] for _ in range(ranks)]

    def op(self, r: int, op: Op, s: int, start: float, end: float) -> None:
        """Free what finished before this op starts, then account for this op."""
        for _, b in [x for x in self.releases[r] if x[0] <= start]:
            self.held[r] -= b
            self.count[r] -= 1
        self.releases[r] = [x for x in self.releases[r] if x[0] > start]
        if op is Op.FORWARD:
            self.held[r] += self.abytes[s]
            self.count[r] += 1
            self.peak_bytes[r] = max(self.peak_bytes[r], self.held[r])
            self.peak_count[r] = max(self.peak_count[r], self.count[r])
            if not self.training:
                self.releases[r].append((end, self.abytes[s]))
        else:
            self.releases[r].append((end, self.abytes[s]))


class _Simulation:
    """List scheduling in time order over the ranks' orders (see the module docstring).

    A rank's next step is its next op (once the op's input has arrived) or, after an op, a wait for one of
    that op's sends (``rendezvous``); of the ranks that can take a step, the one ready first goes.
    """

    def __init__(self, orders: list[list[tuple[Op, int, int, float]]], plans: list[Plan],
                 forward: Sequence[float], backward: Sequence[float] | None, memory: _Memory, *,
                 transfer: Sequence[float], overhead: float, cores: int | None, speed: float,
                 rendezvous: bool) -> None:
        ranks, stages = len(orders), len(forward)
        self.orders, self.plans, self.forward, self.backward = orders, plans, forward, backward
        self.memory = memory
        self.stages, self.overhead, self.speed, self.rendezvous = stages, overhead, speed, rendezvous
        self.delay = list(transfer) + [0.0] * stages
        self.core_free = [0.0] * cores if cores is not None else None   # a min-heap of when each core frees up
        self.posts_at: list[dict[int, list[Key]]] = [{} for _ in range(ranks)]
        for r, (_, post_at, _) in enumerate(plans):
            for i, at in enumerate(post_at):
                self.posts_at[r].setdefault(at, []).append(orders[r][i][:3])
        self.done: dict[Key, float] = {}
        self.posted: dict[Key, float] = {k: 0.0 for r in range(ranks) for k in self.posts_at[r].get(0, ())}
        self.free = [0.0] * ranks
        self.heads = [0] * ranks
        self.waiting = [0] * ranks              # how many of the current op's send waits are already over
        self.events: list[Event] = []
        self.remaining = sum(len(o) for o in orders) + sum(len(w) for waits, _, _ in plans for w in waits)

    def lag_to(self, key: Key) -> float:
        """Transfer time of the message consumed by ``key``."""
        op, s, _ = key
        return self.delay[s - 1] if op is Op.FORWARD else self.delay[s]

    @staticmethod
    def sent_by(key: Key) -> Key:
        op, s, mb = key
        return (op, s - 1, mb) if op is Op.FORWARD else (op, s + 1, mb)

    def run(self, schedule: Schedule) -> None:
        while self.remaining:
            pick = self.next_step()
            if pick is None:  # pragma: no cover - the orders never deadlock
                raise MlcompError(f"schedule {schedule.value} deadlocks on {self.stages} stages")
            start, r, is_wait = pick
            self.remaining -= 1
            if is_wait:
                self.end_wait(r, start)
            else:
                self.run_op(r, start)

    def next_step(self) -> tuple[float, int, bool] | None:
        """(when, rank, is a send wait) of the step that can start first; None if no rank can step."""
        pick: tuple[float, int, bool] | None = None
        for r in range(len(self.orders)):
            is_wait = self.in_waits(r)
            at = self.wait_ready(r) if is_wait else self.op_ready(r)
            if at is not None and (pick is None or at < pick[0]):
                pick = (at, r, is_wait)
        return pick

    def in_waits(self, r: int) -> bool:
        """Rank ``r`` still has send waits of its last op to go through."""
        return self.heads[r] > 0 and self.waiting[r] < len(self.plans[r][0][self.heads[r] - 1])

    def wait_ready(self, r: int) -> float | None:
        """When the next send wait of rank ``r`` ends (None: its receiver has not posted yet)."""
        to = self.plans[r][0][self.heads[r] - 1][self.waiting[r]]
        if to not in self.posted:
            return None
        return max(self.free[r], max(self.done[self.sent_by(to)], self.posted[to]) + self.lag_to(to))

    def op_ready(self, r: int) -> float | None:
        """When rank ``r``'s next op can start (None: no op left, or its input is not computed yet)."""
        if self.heads[r] >= len(self.orders[r]):
            return None
        op, s, mb, _ = self.orders[r][self.heads[r]]
        if op is Op.FORWARD:
            dep = (Op.FORWARD, s - 1, mb) if s > 0 else None
        else:
            dep = (Op.BACKWARD, s + 1, mb) if s < self.stages - 1 else (Op.FORWARD, s, mb)
        if dep is None:
            return self.free[r]
        if dep not in self.done:
            return None
        crossing = dep[1] != s
        if not crossing:
            return max(self.free[r], self.done[dep])
        sent = max(self.done[dep], self.posted.get((op, s, mb), 0.0)) if self.rendezvous else self.done[dep]
        return max(self.free[r], sent + self.lag_to((op, s, mb)))

    def end_wait(self, r: int, at: float) -> None:
        """The rank blocked until the receiver posted and the message went through."""
        self.free[r] = at
        self.waiting[r] += 1
        if self.waiting[r] == len(self.plans[r][0][self.heads[r] - 1]):
            for k in self.posts_at[r].get(self.heads[r], ()):
                self.posted.setdefault(k, self.free[r])

    def run_op(self, r: int, start: float) -> None:
        op, s, mb, extra = self.orders[r][self.heads[r]]
        if self.core_free is not None:
            start = max(start, heapq.heappop(self.core_free))
        work = self.forward[s] if op is Op.FORWARD else self.backward[s]  # type: ignore[index]
        end = start + (extra + self.overhead + work) / self.speed
        if self.core_free is not None:
            heapq.heappush(self.core_free, end)
        self.memory.op(r, op, s, start, end)
        self.done[(op, s, mb)] = end
        self.free[r] = end
        self.events.append(Event(r, s, mb, op, start, end, (extra + self.overhead) / self.speed))
        self.heads[r] += 1
        self.waiting[r] = 0
        head, plan = self.heads[r], self.plans[r]
        if head < len(self.orders[r]) and plan[2][head]:
            self.posted[self.orders[r][head][:3]] = end           # posted with this op's sends, before waiting
        if not plan[0][head - 1]:
            for k in self.posts_at[r].get(head, ()):
                self.posted.setdefault(k, end)


def plot_timeline(timeline: Timeline, path: str | os.PathLike[str], *, title: str = "") -> None:
    """Draw the Gantt chart of ``timeline`` (one row per rank, F light, B dark) as a PNG."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from mlcomp.base.files import atomic_path

    fig, ax = plt.subplots(figsize=(10, 0.6 * timeline.ranks + 1.4))
    cmap = plt.get_cmap("tab10")
    for e in timeline.events:
        colour = cmap(e.microbatch % 10)
        ax.broken_barh([(e.start, e.end - e.start)], (e.rank - 0.4, 0.8), facecolors=colour,
                       alpha=0.55 if e.op is Op.FORWARD else 1.0, edgecolor="black", linewidth=0.4)
        ax.text(e.start + (e.end - e.start) / 2, e.rank, f"{e.op.value}{e.microbatch}", ha="center",
                va="center", fontsize=7)
    ax.set_yticks(range(timeline.ranks), [f"rank {r}" for r in range(timeline.ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"{timeline.schedule.value}: {timeline.stages} stages, {timeline.microbatches} "
                          f"microbatches, bubble {timeline.bubble_fraction:.1%}")
    fig.tight_layout()
    with atomic_path(path, "png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
