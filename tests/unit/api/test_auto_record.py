"""A quick ``auto``: the record of earlier measurements, the timing processes, clear losers dropped early.

Fake targets (``tests.unit.api.test_auto_target``) advance a fake clock by a fixed cost per call, and
the record lives in a temporary folder, so nothing here reads a wall clock or the user's cache.
"""
from __future__ import annotations

import itertools

import pytest

from mlcomp.api import compile_auto
from mlcomp.api.auto import rank as auto_rank
from mlcomp.api.auto import search as auto
from mlcomp.api.auto.record import AutoRecord, RecordStore, record_key, shape_class
from mlcomp.frontend.loading import load_model
from mlcomp.hardware.fingerprint import host_fingerprint
from mlcomp.hardware.timing import TimingPolicy
from tests.unit.api.test_auto_target import FAST, FakeClock, FakeTarget


@pytest.fixture
def mlp_at(captured):
    def make(batch: int):
        module, inputs, graph = captured("mlp", batch)
        return load_model(module, example_inputs=inputs), graph
    return make


def _run(source, graph, records, clock, fakes):
    return compile_auto(source, graph, candidates=fakes, pipeline="", policy=FAST, clock=clock, isolate=False,
                        records=records)


def test_second_compile_ranks_from_the_record_and_builds_only_the_pick(mlp_at, tmp_path, fake_hardware):
    fake_hardware("avx512")
    source, graph = mlp_at(2)
    records, clock = RecordStore(tmp_path / "auto-records"), FakeClock()
    fakes = [FakeTarget("slow", clock, 3e-3), FakeTarget("fast", clock, 1e-3)]
    first = _run(source, graph, records, clock, fakes)
    assert first.artifact.target == "fast" and [f.builds for f in fakes] == [1, 1]
    assert len(list(records.root.glob("*.json"))) == 1
    second = _run(source, graph, records, clock, fakes)
    assert second.artifact.target == "fast" and second.check.passed
    assert [f.builds for f in fakes] == [1, 2]                       # the recorded loser is not built again
    data = second.artifact.manifest["auto"]
    assert data["timing"]["timed_in"] == auto.FROM_RECORD and data["timing"]["rounds"] == 0
    slow = next(c for c in data["candidates"] if c["target"] == "slow")
    assert slow["reason"] == "not built: recorded at 3.00x the pick's time on this host" and not slow["picked"]
    decision = second.artifact.manifest["decisions"][-1]
    assert decision["verdict"] == "fixed" and "best-recorded" in decision["why"]


def test_a_recorded_pick_that_no_longer_verifies_falls_to_the_next(mlp_at, tmp_path):
    source, graph = mlp_at(2)
    records, clock = RecordStore(tmp_path), FakeClock()
    fakes = [FakeTarget("b", clock, 3e-3), FakeTarget("a", clock, 1e-3)]
    _run(source, graph, records, clock, fakes)
    fakes[1].offset = 1.0                                            # "a" now computes wrong numbers
    result = _run(source, graph, records, clock, fakes)
    assert result.artifact.target == "b"
    rows = {c["target"]: c for c in result.artifact.manifest["auto"]["candidates"]}
    assert rows["a"]["reason"].startswith("verification failed")


def test_the_record_is_per_host_kind_and_shape_class(mlp_at, tmp_path, fake_hardware):
    records, clock = RecordStore(tmp_path), FakeClock()
    fakes = [FakeTarget("slow", clock, 3e-3), FakeTarget("fast", clock, 1e-3)]
    fake_hardware("avx2")
    source, graph = mlp_at(2)
    _run(source, graph, records, clock, fakes)
    assert [f.builds for f in fakes] == [1, 1]
    fake_hardware("avx512")                                          # another CPU kind: measured again
    _run(source, graph, records, clock, fakes)
    assert [f.builds for f in fakes] == [2, 2]
    source32, graph32 = mlp_at(32)                                   # another batch class: measured again
    _run(source32, graph32, records, clock, fakes)
    assert [f.builds for f in fakes] == [3, 3]
    source4, graph4 = mlp_at(4)                                      # batch 4 is in batch 2's class: reused
    _run(source4, graph4, records, clock, fakes)
    assert [f.builds for f in fakes] == [3, 4]
    assert shape_class(source4.inputs()) == shape_class(source.inputs()) != shape_class(source32.inputs())


def test_fingerprint_and_key_follow_the_host(mlp_at, fake_hardware):
    source, graph = mlp_at(2)
    fake_hardware("avx2")
    avx2 = host_fingerprint()
    key = record_key(graph, source.inputs(), ["cpu", "tvm"], "-O2", None)
    fake_hardware("amx")
    assert host_fingerprint() != avx2 and record_key(graph, source.inputs(), ["cpu", "tvm"], "-O2", None) != key
    assert record_key(graph, source.inputs(), ["cpu", "tvm"], "-O2", None, host=avx2) == key


def test_unreadable_or_foreign_records_are_ignored(mlp_at, tmp_path):
    source, graph = mlp_at(2)
    store = RecordStore(tmp_path)
    key = record_key(graph, source.inputs(), ["x"], "", None, host="h")
    store.path(key).parent.mkdir(parents=True, exist_ok=True)
    store.path(key).write_text("{not json")
    assert store.load(key) is None
    other = record_key(graph, source.inputs(), ["y"], "", None, host="h")
    store.save(AutoRecord(other, {"y": 1e-3}, "y"))
    store.path(other).replace(store.path(key))                       # a file under the wrong name
    assert store.load(key) is None
    store.save(AutoRecord(key, {"x": 1e-3}, "x"))
    assert store.load(key).order(["z", "x"]) == ["x", "z"]


def test_a_clear_loser_is_dropped_after_the_first_decisive_rounds():
    ticks = itertools.count(step=0.001)
    policy = TimingPolicy(warmup=0, budget_s=1.0, min_repeats=5, max_repeats=40)
    samplers = {"a": lambda: 1.00e-3, "b": lambda: 1.02e-3, "slow": lambda: 3e-3}
    stopped: list[str] = []
    ranking = auto_rank.rank_samplers(samplers, policy, clock=lambda: next(ticks), on_eliminate=stopped.append)
    assert ranking.picked == "a" and list(ranking.eliminated) == ["slow"] and stopped == ["slow"]
    gone = ranking.eliminated["slow"]
    assert (gone.after_rounds, gone.leader, gone.ratio, gone.p_value) == (4, "a", pytest.approx(3.0), 2 / 2 ** 4)
    # b is 1.02x in every round: decided slower at the same round, so the ranking stops there
    assert ranking.rounds == 6 and ranking.p_values["b"] < auto_rank.ALPHA
    assert ranking.ratios["slow"] == pytest.approx(3.0)
