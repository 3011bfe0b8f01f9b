"""Issue 14 part 6: the cold-compile paths cut in capture and the cpu target, pinned.

* Capture runs the model eagerly only when ``torch.export`` fails (to tell an input
  mistake from an export limit, or to initialise lazy modules); the IR is unchanged.
* The cpu target traces once (plain = freeze, tuned = ``optimize_for_inference`` of the
  same trace), serialises the payload only when it is needed, skips the timing where the
  optimisation changes no kernel, and stops timing once a sign test decides; the choice
  and why is ``runtime.choice`` (manifest ``runtime_info.choice``).
"""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import mlcomp.targets.torch.cpu as cpu
from mlcomp.base.errors import InputSpecError
from mlcomp.frontend.loading import load_model
from mlcomp.hardware.decide import DecisionPolicy
from mlcomp.ir.interpreter import Interpreter
from mlcomp.targets import CompileOptions, get_target
from mlcomp.runtime.artifact import Artifact
from mlcomp.targets.torch.cpu import MIN_ROUNDS, OptimizeReason, choose_by_timing


class Tiny(nn.Module):
    """Conv + BatchNorm + ReLU + Linear + softmax: the ops whose capture and cpu lowering changed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)
        self.eager_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_exporting():
            self.eager_calls += 1
        y = torch.relu(self.bn(self.conv(x)))
        return torch.softmax(self.fc(y.flatten(1)), dim=-1)


def tiny() -> tuple[Tiny, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Tiny().eval(), (torch.randn(2, 2, 4, 4),)


# The IR text HEAD's capture (with its eager run before export) printed for Tiny.
GOLDEN = """\
graph Tiny(%x: f32[2, 2, 4, 4]) {
  %conv.weight: f32[4, 2, 3, 3] = param   # conv
  %conv.bias: f32[4] = param   # conv
  %bn.weight: f32[4] = param   # bn
  %bn.bias: f32[4] = param   # bn
  %fc.weight: f32[3, 64] = param   # fc
  %fc.bias: f32[3] = param   # fc
  %bn.running_mean: f32[4] = param   # bn
  %bn.running_var: f32[4] = param   # bn
  %bn.num_batches_tracked: i64[] = param   # bn
  %convolution: f32[2, 4, 4, 4] = aten.convolution.default(%x, %conv.weight, %conv.bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)   # conv
  %_native_batch_norm_legit_no_training: (f32[2, 4, 4, 4], f32[0], f32[0]) = aten._native_batch_norm_legit_no_training.default(%convolution, %bn.weight, %bn.bias, %bn.running_mean, %bn.running_var, 0.1, 1e-05)   # bn
  %getitem: f32[2, 4, 4, 4] = graph.getitem(%_native_batch_norm_legit_no_training, 0)   # bn
  %relu: f32[2, 4, 4, 4] = aten.relu.default(%getitem)   # <root>
  %view: f32[2, 64] = aten.view.default(%relu, [2, 64])   # <root>
  %permute: f32[64, 3] = aten.permute.default(%fc.weight, [1, 0])   # fc
  %addmm: f32[2, 3] = aten.addmm.default(%fc.bias, %view, %permute)   # fc
  %_softmax: f32[2, 3] = aten._softmax.default(%addmm, -1, False)   # <root>
  return (%_softmax,)
}"""


@pytest.fixture(scope="module")
def tiny_graph():
    module, inputs = tiny()
    graph = load_model(module, example_inputs=inputs).capture()
    return module, inputs, graph


# -- capture -------------------------------------------------------------------------


def test_capture_gives_the_same_ir_without_running_the_model(tiny_graph):
    module, inputs, graph = tiny_graph
    assert graph.format() == GOLDEN
    assert module.eager_calls == 0                        # export traced it; nothing ran it eagerly
    with torch.no_grad():
        torch.testing.assert_close(Interpreter(graph).run(*inputs)[0], module(*inputs))


def test_training_capture_leaves_the_users_running_statistics_alone():
    module, inputs = tiny()
    before = {k: v.clone() for k, v in module.bn.state_dict().items()}
    load_model(module.train(), example_inputs=inputs).capture(training=True)
    assert module.eager_calls == 0
    for key, value in module.bn.state_dict().items():   # an eager run in train mode would update them
        assert torch.equal(value, before[key]), key


def test_wrong_input_shape_is_still_an_input_error():
    module, _ = tiny()
    with pytest.raises(InputSpecError, match=r"Tiny fails on example inputs of shape 2x3x4x4:f32"):
        load_model(module, example_inputs=(torch.randn(2, 3, 4, 4),)).capture()
    assert module.eager_calls == 1                        # only after export failed


def test_lazy_module_is_initialised_by_the_eager_run_and_exported_again():
    module = nn.Sequential(nn.LazyLinear(4), nn.ReLU()).eval()
    x = torch.randn(2, 3)
    graph = load_model(module, example_inputs=(x,)).capture()
    assert graph.constants["0.weight"].shape == (4, 3)
    with torch.no_grad():
        torch.testing.assert_close(Interpreter(graph).run(x)[0], module(x))


# -- choosing optimize_for_inference by timing -----------------------------------------


class FakeClock:
    """Time moves only when a fake module runs: each call takes its scripted duration."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def runner(self, durations):
        it = iter(durations)

        def run() -> None:
            self.now += next(it)
        return run


def always(seconds: float):
    while True:
        yield seconds


POLICY = DecisionPolicy(warmup=3, budget_s=0.25, min_rounds=15, max_rounds=2000, threshold=cpu.THRESHOLD)


@pytest.mark.parametrize("tuned_s, optimize", [(0.004, True), (0.02, False)])
def test_a_clear_difference_is_decided_after_the_fewest_rounds(tuned_s, optimize):
    clock = FakeClock()
    choice = choose_by_timing(clock.runner(always(0.01)), clock.runner(always(tuned_s)), cpu.TIMING, clock=clock)
    assert (choice.optimize, choice.rounds, choice.decided_early) == (optimize, MIN_ROUNDS, True)
    assert choice.reason is (OptimizeReason.FASTER if optimize else OptimizeReason.NOT_FASTER)
    assert choice.ratio == pytest.approx(tuned_s / 0.01)
    assert choice.decision.why.startswith("decided by sign test p") and "after 6 rounds" in choice.decision.why


@pytest.mark.parametrize("policy", [POLICY, cpu.TIMING])
def test_a_difference_near_the_threshold_takes_the_whole_budget_and_keeps_plain(policy):
    clock = FakeClock()
    wobble = (0.0085, 0.0095) * 1000                       # ratios 0.85 / 0.95 around THRESHOLD 0.9
    choice = choose_by_timing(clock.runner(always(0.01)), clock.runner(iter(wobble)), policy, clock=clock)
    assert not choice.decided_early
    assert choice.rounds >= policy.min_rounds
    assert choice.rounds * (0.01 + 0.009) >= 2 * policy.budget_s     # ran until the budget was spent
    assert choice.optimize is False and choice.decision.verdict.value == "undecided"


def test_slow_calls_stop_at_the_fewest_rounds_once_the_budget_is_spent():
    clock = FakeClock()
    wobble = (0.085, 0.095) * 100                          # 0.1 s calls: one round is 0.19 s of a 0.5 s budget
    choice = choose_by_timing(clock.runner(always(0.1)), clock.runner(iter(wobble)), cpu.TIMING, clock=clock)
    assert (choice.rounds, choice.decided_early) == (MIN_ROUNDS, False)


def test_deterministic_choice_times_nothing():
    def never() -> None:
        raise AssertionError("a deterministic choice ran a variant")
    choice = choose_by_timing(never, never, cpu.TIMING, deterministic=True)
    assert (choice.optimize, choice.reason, choice.rounds) == (False, OptimizeReason.DETERMINISTIC, 0)
    assert choice.decision.why.startswith("fixed rule (deterministic)")


# -- the cpu target ------------------------------------------------------------------------


def test_no_kernel_change_means_no_timing_and_the_manifest_says_why(tmp_path):
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8)
    graph = load_model(module, example_inputs=(x,)).capture()
    art = get_target("cpu").compile(graph, CompileOptions.make())
    choice = art.runtime.choice.to_json()
    assert (choice["optimize"], choice["reason"], choice["decision"]["verdict"]) == (False, "same-kernels", "fixed")
    assert choice["decision"]["rounds"] == 0 and "changes no kernel call" in choice["decision"]["why"]
    art.save(tmp_path / "mlp")
    loaded = Artifact.load(tmp_path / "mlp")
    assert loaded.manifest["runtime_info"]["choice"]["reason"] == "same-kernels"
    assert [d["choice"] for d in loaded.decisions] == ["plain"]        # the manifest's decisions list
    assert loaded.runtime.choice == art.runtime.choice
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), module(x))


def test_convolutions_are_timed_from_one_trace(tiny_graph, monkeypatch):
    module, inputs, graph = tiny_graph
    traces = []
    real = cpu.trace_module
    monkeypatch.setattr(cpu, "trace_module", lambda *a, **k: traces.append(1) or real(*a, **k))
    art = get_target("cpu").compile(graph.copy(), CompileOptions.make(threads=1))
    choice = art.runtime.choice
    assert len(traces) == 1
    assert choice.reason in (OptimizeReason.FASTER, OptimizeReason.NOT_FASTER)
    assert choice.rounds >= MIN_ROUNDS and choice.ratio > 0
    assert choice.optimize is (choice.decision.choice == "tuned") is art.runtime.optimize
    assert not choice.optimize or choice.ratio < cpu.THRESHOLD
    assert art.decisions == [dict(choice.decision.to_json(), made_by="target cpu")]
    with torch.no_grad():
        torch.testing.assert_close(art(*inputs), module(*inputs))


def test_requested_optimize_runs_mkldnn_and_saves_the_plain_frozen_module(tiny_graph):
    module, inputs, graph = tiny_graph
    art = get_target("cpu").compile(graph.copy(), CompileOptions.make(optimize=True))
    assert art.runtime.choice.reason is OptimizeReason.REQUESTED
    assert "mkldnn" in str(art.runtime.module.graph).lower()
    plain = torch.jit.load(io.BytesIO(art.runtime.payload))  # serialised on first use; loadable by torch
    assert "mkldnn" not in str(plain.graph).lower()
    with torch.no_grad():
        torch.testing.assert_close(art(*inputs), module(*inputs))
        torch.testing.assert_close(plain(*inputs)[0], module(*inputs))
