"""What a real pipeline pays besides compute: schedule overhead, link latency, shared cores, the link probe.

Makespans are fixed numbers worked out by hand (traces in the comments); the
probe is one real 2-process run on tiny messages.
"""
from __future__ import annotations

import math

import pytest

from mlcomp.analysis.parallel.pipeline_schedule import Op, Schedule, simulate
from mlcomp.analysis.parallel.placement_cost import LINKS, measure_node_times
from mlcomp.base.errors import MlcompError
from mlcomp.hardware.link import (
    Link,
    LinkProbe,
    LinkProfile,
    background_threads,
    cpu_share,
    fit_link,
    fit_overhead,
    rank_speed,
)


def test_overhead_and_transfer_on_one_and_two_cores():
    # S=2, M=2, compute 1, overhead 0.5 (rank time), transfer 0.25 (a delay)
    kw = dict(microbatches=2, overhead=0.5, transfer=[0.25])
    # own cores: r0 F0 0-1.5, F1 1.5-3; r1 F0 1.75-3.25, F1 3.25-4.75
    free = simulate([1.0, 1.0], **kw)
    assert free.makespan == pytest.approx(4.75)
    assert simulate([1.0, 1.0], cores=2, **kw).makespan == pytest.approx(4.75)
    # one core: r0 F0 0-1.5, r0 F1 1.5-3 (ready before r1's 1.75), r1 F0 3-4.5, F1 4.5-6
    one = simulate([1.0, 1.0], cores=1, **kw)
    assert one.makespan == pytest.approx(6.0)
    assert [(e.rank, e.start, e.end) for e in one.events] == [(0, 0.0, 1.5), (0, 1.5, 3.0), (1, 3.0, 4.5),
                                                               (1, 4.5, 6.0)]
    assert {e.overhead for e in one.events} == {0.5}
    # the overhead is rank time: busy counts it, so the bubble is what is left idle
    assert free.busy == (3.0, 3.0)
    assert free.bubble_fraction == pytest.approx(1 - 6.0 / (2 * 4.75))


def test_step_overhead_and_back_to_back_batches():
    # S=2, M=2, two batches, compute 1, step overhead 0.5 on the first op of every batch on every rank
    # r0: F0 0-1.5, F1 1.5-2.5, F2 2.5-4, F3 4-5
    # r1: F0 1.5-3, F1 3-4, F2 4-5.5, F3 5.5-6.5
    tl = simulate([1.0, 1.0], microbatches=2, step_overhead=0.5, batches=2)
    assert tl.makespan == pytest.approx(6.5)
    assert tl.batch_seconds == pytest.approx(3.25)
    assert tl.throughput == pytest.approx(4 / 6.5)
    assert [e.microbatch for e in tl.events if e.rank == 1] == [0, 1, 2, 3]
    assert [e.overhead for e in tl.events if e.rank == 0] == [0.5, 0.0, 0.5, 0.0]
    # one batch alone: the fill is paid once, so back-to-back batches cost less each than a lone one
    assert simulate([1.0, 1.0], microbatches=2).makespan == pytest.approx(3.0)
    steady = simulate([1.0, 1.0], microbatches=2, batches=10)
    assert steady.batch_seconds == pytest.approx(21 / 10)


def test_four_ranks_share_two_cores():
    # GPipe forward, S=4, M=4, 1 s each: 16 s of work on 2 cores needs >= 8 s; the fill makes it 9:
    # t=0 r0F0 | 1 r0F1 r1F0 | 2 r0F2 r1F1 | 3 r2F0 r0F3 | 4 r1F2 r2F1 | 5 r3F0 r1F3 | 6 r2F2 r3F1
    # | 7 r2F3 r3F2 | 8 r3F3
    kw = dict(microbatches=4, schedule=Schedule.GPIPE)
    assert simulate([1.0] * 4, **kw).makespan == pytest.approx(7.0)        # (M + S - 1)
    two = simulate([1.0] * 4, cores=2, **kw)
    assert two.makespan == pytest.approx(9.0)
    starts = sorted((e.start, e.rank, e.microbatch) for e in two.events)
    assert starts[:6] == [(0.0, 0, 0), (1.0, 0, 1), (1.0, 1, 0), (2.0, 0, 2), (2.0, 1, 1), (3.0, 0, 3)]
    # at no time do more than 2 ops run
    edges = sorted([(e.start, 1) for e in two.events] + [(e.end, -1) for e in two.events], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, d in edges:
        running += d
        peak = max(peak, running)
    assert peak == 2
    # one core serialises everything: the makespan is all the work, overhead included
    one = simulate([1.0] * 3, [2.0] * 3, microbatches=4, schedule=Schedule.ONE_F_ONE_B, overhead=0.25, cores=1)
    assert one.makespan == pytest.approx(3 * 4 * (1.0 + 2.0 + 2 * 0.25))
    assert all(e.op in (Op.FORWARD, Op.BACKWARD) for e in one.events)
    with pytest.raises(MlcompError, match="at least one core"):
        simulate([1.0], microbatches=1, cores=0)


def test_link_and_overhead_fits_recover_exact_lines():
    link = Link("exact", 2e9, 150e-6)
    samples = [(s, link.seconds(s)) for s in (4096, 65536, 1 << 20, 16 << 20)]
    fit = fit_link(samples)
    assert fit.latency == pytest.approx(150e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-6)
    assert fit_overhead([(2, 0.3e-3 + 2 * 0.4e-3), (16, 0.3e-3 + 16 * 0.4e-3)]) == pytest.approx((0.4e-3, 0.3e-3))
    # per message: two tensors crossing a cut pay the latency twice
    assert link.seconds(1000, messages=2) == pytest.approx(300e-6 + 1000 / 2e9)
    with pytest.raises(ValueError):
        fit_link([(4096, 1e-4)])
    assert LINKS["gloo-loopback"].latency > 0


@pytest.fixture(scope="module")
def probed():
    probe = LinkProbe(sizes=(4096, 1 << 18), repeats=3, microbatches=(2, 4), batches=3)
    return probe, probe.result


def test_probe_measures_positive_finite_numbers_once(probed):
    probe, prof = probed
    for value in (prof.link.latency, prof.link.bandwidth):
        assert value > 0 and math.isfinite(value)
    for value in (prof.op_overhead, prof.step_overhead):
        assert value >= 0 and math.isfinite(value)
    assert prof.op_overhead + prof.step_overhead > 0
    assert prof.cores >= 1
    assert [s for s, _ in prof.link_samples] == [4096, 1 << 18]
    assert all(t > 0 and math.isfinite(t) for _, t in prof.link_samples + prof.pipeline_samples)
    assert probe.result is prof and probe._runs == 1           # cached on the probe, measured once
    assert LinkProfile.from_json(prof.to_json()) == prof
    assert "per (microbatch, stage)" in prof.format()


def test_speed_divides_rank_time_and_follows_a_fair_share():
    # speed 0.5: every op's compute and overhead take twice as long; transfers (delays) do not
    # r0 F0 0-3, F1 3-6; r1 F0 3.25-6.25, F1 6.25-9.25
    tl = simulate([1.0, 1.0], microbatches=2, overhead=0.5, transfer=[0.25], speed=0.5)
    assert tl.makespan == pytest.approx(9.25)
    assert {e.overhead for e in tl.events} == {1.0}
    with pytest.raises(MlcompError, match="speed"):
        simulate([1.0], microbatches=1, speed=0.0)
    # a fair scheduler: 2 ranks beside 12 busy threads on 2 cores get 2·2/14 cores, one each: 1/7 of a core
    assert rank_speed(2, 2, 12.0) == pytest.approx(1 / 7)
    # 4 ranks get 2·4/16 = 0.5 cores, spread over 2 simulated cores: 0.25 each; idle: full speed
    assert rank_speed(4, 2, 12.0) == pytest.approx(0.25)
    assert rank_speed(4, 2, 0.0) == 1.0 and rank_speed(1, 2, 0.5) == 1.0
    assert background_threads(2 / 14, 2, 2) == pytest.approx(12.0)
    assert background_threads(1.0, 4, 2) == 2.0
    prof = LinkProfile(Link("l", 1e9, 1e-4), 1e-4, 1e-3, cores=2, load_average=3.0, background=6.0)
    assert prof.speed(2) == pytest.approx(2 * 2 / 8 / 2) and prof.speed(2, background=0.0) == 1.0
    assert 0.0 < cpu_share(0.02) <= 1.0


def test_node_times_are_taken_in_graph_order_with_the_given_clock(captured):
    _, inputs, graph = captured("mlp", batch=2)
    ticks: list[float] = []

    def clock() -> float:                   # every reading one second later: every call "takes" 1 s
        ticks.append(float(len(ticks)))
        return ticks[-1]

    times = measure_node_times(graph, inputs, repeats=3, clock=clock)
    names = [n.name for n in graph.call_nodes()]
    assert list(times) == names and set(times.values()) == {1.0}
    # an untimed warm-up sweep, then 3 timed sweeps with two readings per call
    assert len(ticks) == 2 * 3 * len(names)
