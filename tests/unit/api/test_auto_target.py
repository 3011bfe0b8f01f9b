"""``target="auto"`` (issue 14 part 3): fastest verified candidate, failures reported, never picked.

Fake targets are passed as the candidate list (the global registry is untouched); their
runtimes advance an injected clock by a fixed cost per call, so "fastest" is decided
without wall-clock assertions.  The ranking protocol (:func:`mlcomp.api.auto.rank.rank`) is checked
on fakes 3 % apart whose samples carry seeded noise and load drift: with tie-break rounds it
ranks them right where one pass of rounds does not.  One real run compiles the zoo mlp for cpu
and onnxruntime.
"""
from __future__ import annotations

import gc
import math
import random
from typing import Any, ClassVar

import pytest
import torch
from click.testing import CliRunner

import mlcomp
from mlcomp.api import AutoTargetError, compile_auto, compile_model
from mlcomp.api.auto import search as auto
from mlcomp.api.auto import rank as auto_mod
from mlcomp.cli.main import main
from mlcomp.frontend.loading import load_model
from mlcomp.hardware.timing import TimingPolicy
from mlcomp.ir import Mode
from mlcomp.targets import Capabilities, Target
from mlcomp.runtime.artifact import RuntimeKind
from mlcomp.runtime.codegen import to_fx

FAST = TimingPolicy(warmup=1, budget_s=0.01, min_repeats=3, max_repeats=5)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRuntime:
    kind: ClassVar[RuntimeKind] = RuntimeKind.EAGER

    def __init__(self, module: Any, clock: FakeClock, cost_s: float, offset: float) -> None:
        self.module, self.clock, self.cost_s, self.offset = module, clock, cost_s, offset

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.clock.now += self.cost_s
        with torch.no_grad():
            return tuple(out + self.offset for out in self.module(*inputs))

    def save(self, directory):
        raise RuntimeError("fake")


class FakeTarget(Target):
    """Runs the graph as torch code; ``cost_s`` per call on the fake clock; ``offset`` breaks the numbers."""

    description = "a fake for the auto target's tests"

    def __init__(self, name: str, clock: FakeClock, cost_s: float, *, offset: float = 0.0, crash: bool = False,
                 unavailable: str | None = None, capabilities: Capabilities | None = None) -> None:
        self.name, self.clock, self.cost_s, self.offset = name, clock, cost_s, offset
        self.crash, self.unavailable = crash, unavailable
        self.builds = 0
        if capabilities is not None:
            self.capabilities = capabilities

    def available(self) -> str | None:
        return self.unavailable

    def build(self, graph, options, inputs):
        self.builds += 1
        if self.crash:
            raise RuntimeError("the backend crashed")
        return FakeRuntime(to_fx(graph).eval(), self.clock, self.cost_s, self.offset)


@pytest.fixture(scope="module")
def mlp(captured):
    module, inputs, graph = captured("mlp", 2)
    return load_model(module, example_inputs=inputs), graph


def test_picks_the_fastest_verified_fake_and_records_every_candidate(mlp):
    source, graph = mlp
    clock = FakeClock()
    fakes = [FakeTarget("slow", clock, 3e-3), FakeTarget("fast", clock, 1e-3),
             FakeTarget("wrong", clock, 1e-5, offset=1.0),               # fastest of all, but wrong numbers
             FakeTarget("crash", clock, 1e-6, crash=True),
             FakeTarget("absent", clock, 1e-6, unavailable="no such device here"),
             FakeTarget("trainer", clock, 1e-6, capabilities=Capabilities(modes=frozenset({Mode.TRAINING})))]
    result = compile_auto(source, graph, candidates=fakes, pipeline="dce", policy=FAST, clock=clock, isolate=False)
    art = result.artifact
    assert art.target == "fast" and result.check.passed and result.pipeline_report is not None
    rows = {c["target"]: c for c in art.manifest["auto"]["candidates"]}
    assert list(rows) == ["slow", "fast", "wrong", "crash", "absent", "trainer"]
    assert art.manifest["auto"]["picked"] == "fast" and [r["picked"] for r in rows.values()].count(True) == 1
    assert rows["slow"]["median_ms"] == pytest.approx(3.0) and rows["fast"]["median_ms"] == pytest.approx(1.0)
    assert rows["slow"]["verified"] and rows["slow"]["compile_seconds"] > 0
    assert not rows["wrong"]["verified"] and rows["wrong"]["reason"].startswith("verification failed: FAILED")
    assert rows["wrong"]["median_ms"] is None                          # never timed, so never picked
    assert rows["crash"]["reason"] == "compile failed: RuntimeError: the backend crashed"
    assert rows["absent"]["reason"] == "unavailable: no such device here" and fakes[4].builds == 0
    assert rows["trainer"]["reason"].startswith("cannot take the graph:") and "inference" in rows["trainer"]["reason"]
    table = result.auto.table().format().splitlines()
    assert table[0] == "auto: picked fast (fastest that verified; * marks it), timed in this process (asked for)"
    assert table[1].split() == ["target", "compile", "median", "vs", "pick", "verified"]
    assert any(line.startswith("fast *") and line.endswith("yes") for line in table)
    assert any(line.startswith("slow ") and "3.000x p=0.12" in line for line in table)
    # clearly apart: eliminated in the first rounds, no tie-break; the pick is the artifact built for it, unwrapped
    timing = art.manifest["auto"]["timing"]
    assert timing["tie_break_rounds"] == 0 and timing["rounds"] == auto_mod.EARLY_ROUNDS
    assert list(timing["eliminated"]) == ["slow"] and "above 1.2x in every round" in rows["slow"]["reason"]
    assert rows["slow"]["ratio_to_picked"] == pytest.approx(3.0) and rows["fast"]["ratio_to_picked"] == 1.0
    assert type(art.runtime) is FakeRuntime and art.runtime.cost_s == 1e-3
    assert any(line.startswith("wrong") and "no: verification failed" in line for line in table)


def test_candidates_that_cannot_be_saved_are_timed_in_this_process_and_it_says_why(mlp):
    """Fakes cannot be saved for a worker process: every candidate is timed here instead, alike."""
    source, graph = mlp
    clock = FakeClock()
    fakes = [FakeTarget("slow", clock, 3e-3), FakeTarget("fast", clock, 1e-3)]
    result = compile_auto(source, graph, candidates=fakes, pipeline="", policy=FAST, clock=clock)
    timing = result.artifact.manifest["auto"]["timing"]
    assert result.artifact.target == "fast"
    assert timing["timed_in"] == ("this process (saving the candidates for their timing processes failed: "
                                  "RuntimeError: fake.)")
    assert result.auto.table().title.endswith("timed in " + timing["timed_in"])


def test_never_picks_a_failing_candidate_even_alone_with_the_public_api(mlp):
    source, graph = mlp
    clock = FakeClock()
    good, wrong = FakeTarget("good", clock, 5e-3), FakeTarget("wrong", clock, 0.0, offset=0.5)
    module = source.eager
    art = mlcomp.compile(module, source.inputs(), target="auto", candidates=[wrong, good], pipeline="")
    assert art.target == "good" and art.verification["passed"]
    picked = [c["target"] for c in art.manifest["auto"]["candidates"] if c["picked"]]
    assert picked == ["good"] and wrong.builds == 1


def test_error_lists_every_candidate_when_none_verifies(mlp):
    source, graph = mlp
    clock = FakeClock()
    fakes = [FakeTarget("wrong", clock, 1e-3, offset=1.0), FakeTarget("crash", clock, 1e-3, crash=True)]
    with pytest.raises(AutoTargetError) as err:
        compile_model(source, graph, target="auto", candidates=fakes, pipeline="")
    text = str(err.value)
    assert text.startswith(f"no candidate target compiled and verified {graph.name}: wrong: verification failed: "
                           "FAILED")
    assert "crash: compile failed: RuntimeError: the backend crashed" in text and "\n" not in text


def test_candidates_only_with_auto(mlp):
    source, graph = mlp
    with pytest.raises(mlcomp.MlcompError, match="candidates apply to target='auto'"):
        compile_model(source, graph, target="cpu", candidates=["cpu"])
    with pytest.raises(mlcomp.MlcompError, match="auto cannot be one of its own candidates"):
        compile_model(source, graph, target="auto", candidates=[FakeTarget("auto", FakeClock(), 0.0)])


@pytest.mark.ort
def test_real_auto_on_the_zoo_mlp_with_cpu_and_onnxruntime(mlp):
    source, graph = mlp
    result = compile_model(source, graph, target="auto", candidates=["cpu", "onnxruntime"], pipeline="-O2",
                           auto_timing=FAST)
    art = result.artifact
    rows = {c["target"]: c for c in art.manifest["auto"]["candidates"]}
    assert set(rows) == {"cpu", "onnxruntime"} and all(r["verified"] for r in rows.values())
    assert art.target == min(rows, key=lambda t: rows[t]["median_ms"]) and rows[art.target]["picked"]
    timing = art.manifest["auto"]["timing"]
    assert timing["timed_in"] == f"{auto.AUTO_PROCS} {auto.IN_PROCESSES}"
    assert timing["processes"] == auto.AUTO_PROCS                       # shared: not one per candidate
    assert all(len(r["process_medians_ms"]) == auto.AUTO_PROCS for r in rows.values())  # each timed in both
    assert result.check.passed
    x = source.inputs()
    torch.testing.assert_close(art(*x), source.eager(*x), rtol=1e-4, atol=1e-5)
    # the winner's pipeline was adapted to it (-O2 drops fusion for onnxruntime)
    adapted = {"onnxruntime": "cleanup{fold_params=false},split-projections,cleanup{fold_params=false}",
               "tvm": "cleanup", "openvino": "cleanup"}
    assert art.manifest["pipeline"] == adapted.get(art.target, "cleanup,split-projections,fuse,cleanup")


def test_cli_prints_the_candidates_table(tmp_path):
    out = tmp_path / "art"
    res = CliRunner().invoke(main, ["compile", "mlp", "--target", "auto", "--candidates", "cpu", "-O0", "-o", str(out),
                                    "--no-cache", "--cache-dir", str(tmp_path / "unused")])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    title = lines.index("auto: picked cpu (fastest that verified; * marks it), timed in this process (one candidate)")
    assert lines[title + 1].split() == ["target", "compile", "median", "vs", "pick", "verified"]
    assert lines[title + 3].startswith("cpu *") and lines[title + 3].endswith("yes")
    assert not [ln for ln in lines if ln.startswith("cache ")] and not (tmp_path / "unused").exists()
    assert mlcomp.load(out).manifest["auto"]["picked"] == "cpu"
    bad = CliRunner().invoke(main, ["compile", "mlp", "--target", "cpu", "--candidates", "cpu"])
    assert bad.exit_code == 2 and "--candidates applies to --target auto only" in bad.output


# ---------------------------------------------------------------------------
# the ranking protocol on close candidates


def _noisy(costs: dict[str, float], seed: int, sigma: float = 0.05, drift: float = 0.5):
    """Fakes whose calls advance a fake clock by cost x load x jitter: the load drifts slowly
    (up to 1 + drift), the jitter is log-normal (sigma), both seeded."""
    clock, rng = FakeClock(), random.Random(seed)
    order: list[str] = []

    def make(name: str, cost: float):
        def call() -> None:
            load = 1 + drift * (0.5 + 0.5 * math.sin(clock.now / 0.7 + seed))
            clock.now += cost * load * math.exp(rng.gauss(0, sigma))
            order.append(name)
        return call
    return clock, {n: make(n, c) for n, c in costs.items()}, order


CLOSE_PAIR = {"slower": 0.0206, "faster": 0.0200}      # 20 ms blocks, 3 % apart (ResNet-18@1: ORT vs OpenVINO)


def _wrong_picks(monkeypatch, tie_break: float, seeds: range) -> int:
    monkeypatch.setattr(auto_mod, "TIE_BREAK", tie_break)
    wrong = 0
    for seed in seeds:
        clock, fns, _ = _noisy(CLOSE_PAIR, seed)
        wrong += auto_mod.rank(fns, auto_mod.DEFAULT_AUTO_TIMING, clock=clock).picked != "faster"
    return wrong


def test_close_candidates_get_tie_break_rounds_and_rank_right(monkeypatch):
    seeds, tie_break = range(20), auto_mod.TIE_BREAK
    assert _wrong_picks(monkeypatch, 0.0, seeds) >= 5          # one pass of ~8 rounds: a coin toss too often
    assert _wrong_picks(monkeypatch, tie_break, seeds) <= 1


def test_tie_break_is_bounded_and_rounds_rotate():
    policy = auto_mod.DEFAULT_AUTO_TIMING
    clock, fns, order = _noisy({"a": 0.02, "b": 0.02, "c": 0.02}, seed=3)    # equal: never decided
    ranking = auto_mod.rank(fns, policy, clock=clock)
    assert ranking.tie_break_rounds > 0 and ranking.picked in fns
    one_round = 2 * 3 * 0.02 * 1.6                   # a lead-in and a sample of each, at the worst load
    warmup = policy.warmup * 3 * 0.02 * 1.6
    bound = warmup + max(policy.budget_s * 3, auto_mod.MIN_ROUNDS * one_round) + auto_mod.TIE_BREAK * policy.budget_s
    assert clock.now <= bound + one_round
    # after warm-up, each round is (lead-in, sample) per candidate, starting one candidate later each round
    timed = order[3 * policy.warmup:]
    firsts = [timed[i] for i in range(0, 6 * ranking.rounds, 6)]
    assert firsts[:6] == ["a", "b", "c", "a", "b", "c"]
    assert all(timed[i] == timed[i + 1] for i in range(0, 6 * ranking.rounds, 2))
    assert set(ranking.ratios) == {"a", "b", "c"} and ranking.ratios[ranking.picked] == 1.0


def test_a_contender_decided_slower_leaves_the_tie_break():
    """2x slower is decided in the first rounds and timed no further; 3 % slower needs tie-break rounds."""
    clock, fns, order = _noisy({"fast": 0.020, "close": 0.0206, "far": 0.04}, seed=0, sigma=0.03, drift=0.0)
    policy = auto_mod.DEFAULT_AUTO_TIMING
    ranking = auto_mod.rank(fns, policy, clock=clock)
    assert ranking.picked == "fast" and ranking.tie_break_rounds > 0
    assert order.count("far") == policy.warmup + 2 * ranking.eliminated["far"].after_rounds    # left early
    assert ranking.eliminated["far"].after_rounds == auto_mod.EARLY_ROUNDS
    assert order.count("close") == order.count("fast") == policy.warmup + 2 * (ranking.rounds + ranking.tie_break_rounds)
    assert ranking.p_values["close"] < auto_mod.ALPHA and ranking.ratios["close"] == pytest.approx(1.03, abs=0.02)
    assert ranking.ratios["far"] == pytest.approx(2.0, abs=0.05) and ranking.eliminated["far"].ratio > 1.9
    assert ranking.medians["fast"] == pytest.approx(0.020, rel=0.03)


def test_candidates_may_be_target_specs_and_one_target_with_two_specs_is_two_candidates():
    from mlcomp.api.auto.search import auto_candidates
    from mlcomp.cli.compile import _candidates

    assert _candidates("cpu, tvm{kernels=off}, ort", "auto") == ["cpu", "tvm{kernels=off}", "onnxruntime"]
    picked = auto_candidates(["tvm", "tvm{kernels=off}", "tvm"])
    assert [t.spec for t in picked] == ["tvm", "tvm{kernels=off}"]
    assert [t.settings.kernels for t in picked] == ["auto", "off"]


class CollectorTarget(FakeTarget):
    """Records whether Python's cyclic collector was on while it built."""

    def build(self, graph, options, inputs):
        self.collector_on = gc.isenabled()
        return super().build(graph, options, inputs)


def test_the_candidates_build_with_the_cyclic_collector_paused_and_it_comes_back(mlp):
    source, graph = mlp
    clock = FakeClock()
    fakes = [CollectorTarget("a", clock, 2e-3), CollectorTarget("b", clock, 1e-3)]
    assert gc.isenabled()
    result = compile_auto(source, graph, candidates=fakes, pipeline="dce", policy=FAST, clock=clock, isolate=False)
    assert [f.collector_on for f in fakes] == [False, False] and gc.isenabled()
    assert result.artifact.target == "b" and result.check.passed
