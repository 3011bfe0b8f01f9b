"""The pipeline schedule simulator: bubbles, orders, memory in flight, the Gantt chart."""
from __future__ import annotations

import pytest

from mlcomp.analysis.parallel.pipeline_schedule import Op, Schedule, plot_timeline, rank_orders, simulate
from mlcomp.base.errors import MlcompError


@pytest.mark.parametrize("stages,micro", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_gpipe_bubble_with_equal_stages(stages, micro):
    tl = simulate([0.5] * stages, microbatches=micro, schedule=Schedule.GPIPE)
    assert tl.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))
    assert tl.makespan == pytest.approx(0.5 * (micro + stages - 1))
    train = simulate([0.5] * stages, [1.0] * stages, microbatches=micro, schedule=Schedule.GPIPE)
    assert train.bubble_fraction == pytest.approx((stages - 1) / (micro + stages - 1))
    assert train.throughput == pytest.approx(micro / (1.5 * (micro + stages - 1)))


def test_1f1b_same_bubble_less_memory_than_gpipe():
    kw = dict(microbatches=8, activation_bytes=[100] * 4, param_bytes=[10] * 4)
    gpipe = simulate([1.0] * 4, [2.0] * 4, schedule=Schedule.GPIPE, **kw)
    f1b = simulate([1.0] * 4, [2.0] * 4, schedule=Schedule.ONE_F_ONE_B, **kw)
    assert f1b.makespan == pytest.approx(gpipe.makespan)
    assert gpipe.peak_in_flight == (8, 8, 8, 8)
    assert f1b.peak_in_flight == (4, 3, 2, 1)
    assert f1b.peak_memory == (410, 310, 210, 110)
    assert gpipe.peak_memory == (810,) * 4


def test_1f1b_order_of_the_first_rank():
    order = rank_orders(Schedule.ONE_F_ONE_B, 2, 3, training=True)
    assert [f"{op.value}{mb}" for op, _, mb in order[0]] == ["F0", "F1", "B0", "F2", "B1", "B2"]
    assert [f"{op.value}{mb}" for op, _, mb in order[1]] == ["F0", "B0", "F1", "B1", "F2", "B2"]


def test_interleaved_shrinks_the_bubble():
    plain = simulate([1.0] * 2, [2.0] * 2, microbatches=4, schedule=Schedule.ONE_F_ONE_B)
    inter = simulate([0.5] * 4, [1.0] * 4, microbatches=4, schedule=Schedule.INTERLEAVED, virtual=2)
    assert inter.ranks == 2 and inter.stages == 4
    assert inter.bubble_fraction < plain.bubble_fraction
    assert sum(inter.busy) == pytest.approx(sum(plain.busy))
    with pytest.raises(MlcompError, match="multiple of the ranks"):
        simulate([1.0] * 4, microbatches=3, schedule=Schedule.INTERLEAVED, virtual=2)


def test_transfer_delays_and_unequal_stages():
    tl = simulate([1.0, 3.0], microbatches=2, transfer=[0.5])
    # F0: rank0 0-1, rank1 1.5-4.5; F1: rank0 1-2, rank1 4.5-7.5
    assert tl.makespan == pytest.approx(7.5)
    assert [e.op for e in tl.events] == [Op.FORWARD] * 4


def test_gantt_chart(tmp_path):
    tl = simulate([1.0] * 3, [2.0] * 3, microbatches=4, schedule=Schedule.ONE_F_ONE_B)
    out = tmp_path / "timeline.png"
    plot_timeline(tl, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
