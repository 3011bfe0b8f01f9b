"""Blocking sends in the schedule simulator (gloo's point-to-point is a rendezvous) and the load reading."""
from __future__ import annotations

import os

import pytest

from mlcomp.analysis.parallel.pipeline_schedule import Op, Schedule, send_waits, rank_orders, simulate
from mlcomp.hardware.link import Link, LinkProfile, background_now, busy_cores


def _starts(tl, rank):
    return [(e.op.value, e.microbatch, e.start) for e in tl.events if e.rank == rank]


def test_a_sender_blocks_until_its_receiver_posts():
    # 1F1B, forward only, stage 1 three times slower: rank 0 waits after F1 for rank 1 to post F1's receive
    # (when rank 1 finishes F0 at 4) and after F2 for the post of F2 (at 7)
    kw = dict(microbatches=3, schedule=Schedule.ONE_F_ONE_B)
    buffered = simulate([1.0, 3.0], **kw)
    blocking = simulate([1.0, 3.0], rendezvous=True, **kw)
    assert _starts(buffered, 0) == [("F", 0, 0.0), ("F", 1, 1.0), ("F", 2, 2.0)]
    assert _starts(blocking, 0) == [("F", 0, 0.0), ("F", 1, 1.0), ("F", 2, 4.0)]
    assert blocking.makespan == buffered.makespan == pytest.approx(10.0)      # the slow stage sets the pace
    # rank 0 free (waiting for its last send) only at 7: that is not compute
    assert blocking.busy[0] == buffered.busy[0] == pytest.approx(3.0)


def test_a_message_cannot_move_before_its_receive_is_posted():
    # GPipe, transfer 0.5: F1 is sent at 2, but rank 1 posts its receive only after F0 (at 2.5), so with
    # blocking sends the message moves from 2.5 and arrives at 3.0; buffered, it was there at 2.5
    tl = simulate([1.0, 1.0], microbatches=2, transfer=[0.5], rendezvous=True)
    assert _starts(tl, 1) == [("F", 0, 1.5), ("F", 1, 3.0)]
    assert _starts(simulate([1.0, 1.0], microbatches=2, transfer=[0.5]), 1) == [("F", 0, 1.5), ("F", 1, 2.5)]


@pytest.mark.parametrize("schedule,virtual", [(Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1),
                                              (Schedule.INTERLEAVED, 2)])
@pytest.mark.parametrize("micro", [2, 4, 8])
def test_training_schedules_never_deadlock_and_only_slow_down(schedule, virtual, micro):
    kw = dict(microbatches=micro, schedule=schedule, virtual=virtual, transfer=[0.1] * 3, batches=3)
    buffered = simulate([1.0] * 4, [2.0] * 4, **kw)
    blocking = simulate([1.0] * 4, [2.0] * 4, rendezvous=True, **kw)
    assert blocking.makespan >= buffered.makespan - 1e-9
    assert len(blocking.events) == len(buffered.events) == 2 * 4 * micro * 3


def test_send_waits_follow_torch_1f1b():
    # rank 0 of 2, training, M=4: torch warms up with w=2 forwards; F0's send is waited after F1, F1's
    # right after it (fused with B0's receive, which is posted first), and so is every steady forward's;
    # stage 0's backwards send nothing.  Rank 1 (the last stage) sends only backwards: B0..B2 right after
    # them (fused with the next forward's receive), the last one (cool-down) at the step's end
    order = [(op, s, mb, 0.0) for op, s, mb in rank_orders(Schedule.ONE_F_ONE_B, 2, 4, training=True)[0]]
    assert [f"{op.value}{mb}" for op, _, mb, _ in order] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    waits, post_at, early = send_waits(Schedule.ONE_F_ONE_B, order, len(order), 2, 0, 4, 2, True)
    assert waits == [[], [(Op.FORWARD, 1, 0), (Op.FORWARD, 1, 1)], [], [(Op.FORWARD, 1, 2)], [],
                     [(Op.FORWARD, 1, 3)], [], []]
    assert early == [False, False, True, True, True, True, True, False]
    assert post_at == list(range(8))
    order = [(op, s, mb, 0.0) for op, s, mb in rank_orders(Schedule.ONE_F_ONE_B, 2, 4, training=True)[1]]
    assert [f"{op.value}{mb}" for op, _, mb, _ in order] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    waits, _, early = send_waits(Schedule.ONE_F_ONE_B, order, len(order), 2, 1, 4, 2, True)
    assert waits == [[], [(Op.BACKWARD, 0, 0)], [], [(Op.BACKWARD, 0, 1)], [], [(Op.BACKWARD, 0, 2)], [],
                     [(Op.BACKWARD, 0, 3)]]
    assert early == [False, True, True, True, True, True, True, True]
    # interleaved posts every receive at the step's start and waits for every send at its end
    order = [(op, s, mb, 0.0) for op, s, mb in rank_orders(Schedule.INTERLEAVED, 2, 2, 2, training=False)[0]]
    waits, post_at, _ = send_waits(Schedule.INTERLEAVED, order, len(order), 2, 0, 2, 4, False)
    assert post_at == [0] * len(order) and all(not w for w in waits[:-1]) and len(waits[-1]) == len(order)


def test_the_probe_result_keeps_rendezvous():
    prof = LinkProfile(Link("l", 1e9, 1e-4), 1e-4, 0.0, 2, 0.5, rendezvous=True)
    again = LinkProfile.from_json(prof.to_json())
    assert again.rendezvous is True and again == prof
    assert "rendezvous" in prof.format()


def test_busy_cores_reads_the_host_without_spinning():
    busy = busy_cores(0.05)
    if not os.path.exists("/proc/stat"):
        assert busy is None
        return
    assert busy is not None and 0.0 <= busy <= (os.cpu_count() or 1) + 1e-9
    assert 0.0 <= background_now(2, 0.05) <= (os.cpu_count() or 1) + 1e-9
