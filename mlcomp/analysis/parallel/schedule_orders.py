"""What each rank of a pipeline schedule runs, in which order, and where it waits for its messages.

``rank_orders`` lists the ``(op, stage, microbatch)`` each rank runs per step
for GPipe, 1F1B and interleaved 1F1B; ``send_waits`` says where, in that
order, ``torch.distributed.pipelining`` (2.13) waits for a rank's sends and
posts its receives, which matters when a send completes only once the
receiver has posted (gloo).  Before/after, rank 0 of 2, training, M=4::

    rank_orders(Schedule.ONE_F_ONE_B, 2, 4, training=True)[0]
        F0 F1 B0 F2 B1 F3 B2 B3
    send_waits(...)  (waits after each op; ^ = receive posted before the previous op's waits)
        F0 F1        B0  F2  B1  F3  B2  B3
        -  F0,F1     -   F2  -   F3  -   -
                     ^   ^   ^   ^   ^

:mod:`mlcomp.analysis.parallel.pipeline_schedule` simulates them.
"""
from __future__ import annotations

import enum

from mlcomp.base.errors import MlcompError

__all__ = ["Schedule", "Op", "Key", "in_flight", "rank_orders", "batched_orders", "receiver", "send_waits"]


class Schedule(enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


def in_flight(schedule: Schedule, rank: int, ranks: int, microbatches: int, training: bool) -> int:
    """How many microbatches' activations rank ``rank`` holds at most under ``schedule``."""
    if not training:
        return 1
    if schedule is Schedule.GPIPE:
        return microbatches
    return min(microbatches, ranks - rank)


def rank_orders(schedule: Schedule, ranks: int, microbatches: int, virtual: int = 1,
                training: bool = False) -> list[list[tuple[Op, int, int]]]:
    """The ordered ``(op, stage, microbatch)`` list each rank runs."""
    m = microbatches
    if schedule is not Schedule.INTERLEAVED:
        virtual = 1
    elif m % ranks:
        raise MlcompError(f"interleaved 1F1B needs the microbatches ({m}) to be a multiple of the ranks ({ranks})",
                          hint=f"use microbatches={ranks * max(1, m // ranks)} or schedule=1f1b")
    orders: list[list[tuple[Op, int, int]]] = []
    for r in range(ranks):
        if schedule is Schedule.INTERLEAVED:
            n = m * virtual
            fwd = [(Op.FORWARD, ((k // ranks) % virtual) * ranks + r, (k // (ranks * virtual)) * ranks + k % ranks)
                   for k in range(n)]
            bwd = [(Op.BACKWARD, (virtual - 1 - (k // ranks) % virtual) * ranks + r,
                    (k // (ranks * virtual)) * ranks + k % ranks) for k in range(n)]
            warm = min(n, (ranks - r - 1) * 2 + (virtual - 1) * ranks)
        else:
            fwd = [(Op.FORWARD, r, i) for i in range(m)]
            bwd = [(Op.BACKWARD, r, i) for i in range(m)]
            warm = m if schedule is Schedule.GPIPE else min(m, ranks - r - 1)
        if not training:
            orders.append(fwd)
            continue
        seq = fwd[:warm]
        for k in range(len(fwd) - warm):
            seq += [fwd[warm + k], bwd[k]]
        seq += bwd[len(fwd) - warm:]
        orders.append(seq)
    return orders


def batched_orders(orders: list[list[tuple[Op, int, int]]], microbatches: int, batches: int,
                    step_overhead: float) -> list[list[tuple[Op, int, int, float]]]:
    """Each rank's order repeated for ``batches`` back-to-back steps (microbatch ``b·M + i``); the first op
    of every step carries the per-step overhead."""
    out = []
    for order in orders:
        seq: list[tuple[Op, int, int, float]] = []
        for b in range(batches):
            seq += [(op, s, b * microbatches + mb, step_overhead if k == 0 else 0.0)
                    for k, (op, s, mb) in enumerate(order)]
        out.append(seq)
    return out


Key = tuple[Op, int, int]           # (op, stage, microbatch): one operation, and the message it sends


def receiver(op: Op, stage: int, mb: int, stages: int) -> Key | None:
    """The operation that consumes what ``(op, stage, mb)`` sends (``None``: it sends nothing)."""
    if op is Op.FORWARD:
        return (Op.FORWARD, stage + 1, mb) if stage < stages - 1 else None
    return (Op.BACKWARD, stage - 1, mb) if stage > 0 else None


def send_waits(schedule: Schedule, order: list[tuple[Op, int, int, float]], step_len: int, ranks: int,
                rank: int, microbatches: int, stages: int, training: bool
                ) -> tuple[list[list[Key]], list[int], list[bool]]:
    """Where a rank waits for its sends to complete and posts its receives, as
    ``torch.distributed.pipelining`` 2.13 does.

    Returns ``(waits, post_at, early)``: ``waits[i]``, the receivers whose messages the rank waits for after
    its ``i``-th op; the receive of op ``i`` is posted when the rank reaches op ``post_at[i]``, or, when
    ``early[i]``, as soon as op ``i - 1`` ends, before that op's waits (a send fused with the next receive).

    * GPipe: forward sends are waited after the step's last forward, backward sends at the step's end;
    * 1F1B (``w = min(M, S - rank)`` warm-up forwards): a warm-up forward's send is waited after the next
      op, the last warm-up forward's and every steady-state op's right after it (fused with the next
      receive, which is posted first in training); the last steady backward's and the cool-down
      backwards' after the next op, the last at the step's end;
    * interleaved 1F1B (the action-list runtime): receives are posted ahead, at the step's start, and every
      send is waited at the step's end.
    """
    n = len(order)
    waits: list[list[Key]] = [[] for _ in range(n)]
    post_at = list(range(n))
    early = [False] * n
    warm = min(microbatches, ranks - rank)
    for i, (op, s, mb, _) in enumerate(order):
        pos = i % step_len
        first, last = i - pos, i - pos + step_len - 1
        if schedule is Schedule.INTERLEAVED:
            post_at[i] = first
        steady = training and schedule is Schedule.ONE_F_ONE_B and warm <= pos <= 2 * (microbatches - warm) + warm
        early[i] = steady and pos > warm - 1
        to = receiver(op, s, mb, stages)
        if to is None:
            continue
        if schedule is Schedule.INTERLEAVED:
            waits[last].append(to)
        elif schedule is Schedule.GPIPE:
            at = last
            if op is Op.FORWARD:
                at = max(j for j in range(first, last + 1) if order[j][0] is Op.FORWARD)
            waits[at].append(to)
        elif op is Op.FORWARD and pos < warm - 1:
            waits[i + 1].append(to)
        elif op is Op.BACKWARD and pos >= 2 * (microbatches - warm) + warm:
            waits[min(i + 1, last)].append(to)      # the last steady backward and the cool-down ones
        else:
            waits[i].append(to)
    return waits, post_at, early
