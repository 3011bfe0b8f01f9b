"""The remat pass on joint training graphs: golden IR, gradients vs no-remat, stats, budgets, bad input.

Every zoo model (resnet18, gru and transformer with the slow tests; ResNet-18's structure at widths 8/16
in the fast suite) is captured once (batch 2) and rematerialised with Chen's ``sqrt`` plan, which recomputes the most; the compiled training step must give
the same gradients (1e-6 relative) as without remat.  A 10-layer MLP whose
activations dominate its memory checks that every solver's plan has a predicted
peak within what the budget allows and below the peak without remat, and that
``saved=`` keeps the saved-activation bytes of the rewritten graph, as
``saved_activations`` counts them, within the cap.
"""
from __future__ import annotations

import difflib
import itertools
import re

import pytest
import torch
from torch import nn

from mlcomp.analysis.step_peak import step_memory
from mlcomp.analysis.training_graph import saved_activations
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.base.errors import PipelineMismatchError, PipelineSpecError
from mlcomp.frontend.joint import capture_joint, example_target, without_dropout
from mlcomp.ir.node import Phase
from mlcomp.ir.opsets import is_pure
from mlcomp.passes.remat.costs import flops
from mlcomp.passes.remat.remat import (
    CostModel,
    Remat,
    RematError,
    build_problem,
    forward_values,
    parse_budget,
    parse_saved,
    saved_bytes,
)
from mlcomp.pipeline import run_pipeline
from mlcomp.pipeline.pass_base import PassContext
from mlcomp.training.step import compile_training
from tests.helpers.modules import small_resnet

GRAD_TOL = 1e-6


def _capture(model: nn.Module, x: torch.Tensor, name: str):
    model = without_dropout(model).train()
    y = example_target(model, (x,), "cross_entropy")
    return capture_joint(model, (x,), y, name=name), (x, y)


def _mlp(widths: list[int], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


@pytest.fixture(scope="module")
def tiny():
    """A 3-layer MLP: 8 -> 8 -> 8 -> 4, batch 4."""
    return _capture(_mlp([8, 8, 8, 4]), torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), "tiny")


@pytest.fixture(scope="module")
def deep():
    """10 layers of 64 at batch 256: activations (64 KiB each) dominate gradients (16 KiB)."""
    return _capture(_mlp([64] * 11 + [4]), torch.randn(256, 64, generator=torch.Generator().manual_seed(1)), "deep")


@pytest.fixture(scope="module")
def zoo_graphs(request):
    """Zoo models' joint graphs (batch 2) by name; ``"resnet"`` is the module's small ResNet-18 (``resnet``)."""
    from mlcomp.models import get

    cache = {}

    def get_graph(name: str):
        if name == "resnet":
            return request.getfixturevalue("resnet")
        if name not in cache:
            z = get(name)
            cache[name] = _capture(z.build(), *z.example_inputs(2), name)
        return cache[name]

    return get_graph


def _grads(graph, inputs):
    return compile_training(graph).gradients(*inputs)


def _max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)).item() for k in b)


# ---------------------------------------------------------------------------
# golden IR: what changes in the tiny MLP's joint graph

TINY_DIFF = """\
- %addmm: f32[4, 8] = aten.addmm.default(%0.bias, %args_0, %permute)   # 0 {phase=forward}
+ %addmm: f32[4, 8] = aten.addmm.default(%0.bias, %args_0, %permute)   # 0 {checkpoint=True, phase=forward}
- %relu: f32[4, 8] = aten.relu.default(%addmm)   # 1 {phase=forward}
+ %relu: f32[4, 8] = aten.relu.default(%addmm)   # 1 {checkpoint=True, phase=forward}
- %addmm_2: f32[4, 4] = aten.addmm.default(%4.bias, %relu_1, %permute_2)   # 4 {phase=forward}
+ %addmm_2: f32[4, 4] = aten.addmm.default(%4.bias, %relu_1, %permute_2)   # 4 {checkpoint=True, phase=forward}
- %_log_softmax: f32[4, 4] = aten._log_softmax.default(%addmm_2, 1, False)   # {phase=loss}
+ %_log_softmax: f32[4, 4] = aten._log_softmax.default(%addmm_2, 1, False)   # {checkpoint=True, phase=loss}
+ %addmm_2.remat: f32[4, 4] = aten.addmm.default(%4.bias, %relu_1, %permute_2)   # 4 {phase=backward}
+ %_log_softmax.remat: f32[4, 4] = aten._log_softmax.default(%addmm_2.remat, 1, False)   # {phase=backward}
- %nll_loss_backward: f32[4, 4] = aten.nll_loss_backward.default(%full_like, %_log_softmax, %target, None, 1, -100, %getitem_1)   # {phase=backward}
+ %nll_loss_backward: f32[4, 4] = aten.nll_loss_backward.default(%full_like, %_log_softmax.remat, %target, None, 1, -100, %getitem_1)   # {phase=backward}
- %_log_softmax_backward_data: f32[4, 4] = aten._log_softmax_backward_data.default(%nll_loss_backward, %_log_softmax, 1, f32)   # {phase=backward}
+ %_log_softmax_backward_data: f32[4, 4] = aten._log_softmax_backward_data.default(%nll_loss_backward, %_log_softmax.remat, 1, f32)   # {phase=backward}
+ %addmm.remat: f32[4, 8] = aten.addmm.default(%0.bias, %args_0, %permute)   # 0 {phase=backward}
+ %relu.remat: f32[4, 8] = aten.relu.default(%addmm.remat)   # 1 {phase=backward}
- %mm_3: f32[8, 8] = aten.mm.default(%permute_8, %relu)   # 2 {phase=backward}
+ %mm_3: f32[8, 8] = aten.mm.default(%permute_8, %relu.remat)   # 2 {phase=backward}
- %threshold_backward_1: f32[4, 8] = aten.threshold_backward.default(%mm_2, %relu, 0)   # 1 {phase=backward}
+ %threshold_backward_1: f32[4, 8] = aten.threshold_backward.default(%mm_2, %relu.remat, 0)   # 1 {phase=backward}
"""


def _diff(before, after) -> str:
    lines = difflib.ndiff([ln.strip() for ln in before.format().splitlines()],
                          [ln.strip() for ln in after.format().splitlines()])
    return "".join(ln + "\n" for ln in lines if ln[:1] in "+-")


def test_golden_ir_of_a_tiny_mlp(tiny):
    graph, inputs = tiny
    after, _ = run_pipeline(graph, "remat{solver=sqrt}")
    assert _diff(graph, after) == TINY_DIFF
    assert _diff(graph, run_pipeline(graph, "remat{solver=sqrt}")[0]) == TINY_DIFF     # stable names
    copies = [n for n in after.call_nodes() if n.name.endswith(".remat")]
    assert all(n.ann.phase is Phase.BACKWARD for n in copies)
    # each copy sits just before its first backward reader
    for n in copies:
        first = after.users(n.name)[0]
        order = after.order()
        assert order.index(first.name) - order.index(n.name) <= 2
    assert _max_rel(_grads(after, inputs)[1], _grads(graph, inputs)[1]) <= GRAD_TOL


def step_peak(graph) -> int:
    """The predicted peak of the whole step (optimizer after the graph), kernels' scratch included."""
    return step_memory(graph, workspace=op_workspaces(graph)).peak_bytes


# ---------------------------------------------------------------------------
# budgets: the peak within what the budget allows, saved activations within saved=, gradients unchanged


@pytest.mark.parametrize("spec", ["remat{budget=0.5}", "remat{budget=0.25 solver=milp}",
                                  "remat{budget=0.25 solver=mincut}", "remat{budget=0.5 cost=profile}"])
def test_peak_within_the_budget_and_gradients_unchanged(deep, spec):
    graph, inputs = deep
    after, report = run_pipeline(graph, spec, example_inputs=inputs)
    stats = report.records[0].stats
    budget = parse_budget(spec.split("=")[1].split()[0].rstrip("}"))
    low, top = stats["peak_lowest_bytes"], stats["peak_before_bytes"]
    assert stats["budget"] == budget and stats["peak_allowed_bytes"] == low + int(budget * (top - low))
    assert low <= stats["peak_after_bytes"] <= stats["peak_allowed_bytes"] < top
    assert stats["peak_after_bytes"] == step_peak(after)      # the whole step, kernels' scratch included
    assert stats["peak_before_bytes"] == step_peak(graph)
    assert stats["saved_after_bytes"] == saved_bytes(after) < stats["saved_before_bytes"] == saved_bytes(graph)
    assert stats["activations_saved_bytes"] == saved_bytes(after)   # the solvers' model is the saved-activation count
    assert stats["saved_limit_bytes"] is None
    assert _max_rel(_grads(after, inputs)[1], _grads(graph, inputs)[1]) <= GRAD_TOL


@pytest.mark.parametrize("spec", ["remat{saved=0.5}", "remat{saved=0.25 solver=milp}", "remat{saved=0.25 solver=mincut}"])
def test_saved_caps_the_saved_activations(deep, spec):
    graph, _ = deep
    after, report = run_pipeline(graph, spec)
    stats = report.records[0].stats
    cap = parse_saved(spec.split("=")[1].split()[0].rstrip("}"))
    before = saved_bytes(graph)
    assert stats["saved_limit_bytes"] == cap.resolve(before) == int(cap.fraction * before)
    assert saved_bytes(after) == stats["saved_after_bytes"] <= stats["saved_limit_bytes"]
    assert stats["peak_after_bytes"] < stats["peak_before_bytes"]


def test_stats_add_up(deep):
    graph, _ = deep
    after, report = run_pipeline(graph, "remat{budget=0.5}")
    s = report.records[0].stats
    problem = build_problem(graph)
    needed = [c for c in problem.candidates if c.needed and c.nbytes > 0]
    assert s["activations_saved"] + s["activations_recomputed"] == len(needed)
    assert s["activations_saved_bytes"] + s["activations_recomputed_bytes"] == sum(c.nbytes for c in needed)
    assert sum(c.nbytes for c in needed) == s["saved_before_bytes"]    # no remat: the model counts what is saved
    assert s["activations_recomputed"] >= 1 and s["solver"] == "knapsack"
    copies = [n for n in after.call_nodes() if n.name not in graph]
    assert s["nodes_recomputed"] == len(copies) >= s["activations_recomputed"]
    assert s["recompute_flops"] > 0 and s["recompute_cost"] > 0
    forward = sum(flops(graph, graph.node(n)) for n in forward_values(graph))
    assert s["recompute_overhead"] == pytest.approx(s["recompute_flops"] / forward) and 0 < s["recompute_overhead"] < 1
    # budget 1: the peak without remat is allowed, and the cheapest plan is to change nothing
    same, rep = run_pipeline(graph, "remat{budget=1.0}")
    assert same.format() == graph.format() and rep.records[0].stats["nodes_recomputed"] == 0


def test_absolute_saved_cap(deep):
    graph, _ = deep
    saved = saved_bytes(graph)
    after, report = run_pipeline(graph, f"remat{{saved={saved * 0.3 / 1024:.1f}KB}}")
    stats = report.records[0].stats
    assert saved_bytes(after) == stats["saved_after_bytes"] <= stats["saved_limit_bytes"] <= 0.3 * saved


@pytest.fixture(scope="module")
def resnet():
    """ResNet-18's structure at widths 8/16 (``tests.helpers.modules.small_resnet``), batch 2."""
    model, (x,) = small_resnet(2)
    return _capture(model, x, "resnet")


@pytest.mark.parametrize("solver", ["knapsack", "mincut"])
def test_resnet_saved_caps_keep_within_and_do_not_raise_the_peak(resnet, solver):
    """A residual conv net with batch norm (batch 2): caps far below the old peak-relative minimum are
    feasible, kept saved activations stay within them and the predicted peak never rises above no remat."""
    graph, _ = resnet
    saved, peak = saved_bytes(graph), step_peak(graph)
    for cap in (0.5, 0.25, 0.1):
        after, report = run_pipeline(graph, f"remat{{saved={cap} solver={solver}}}")
        stats = report.records[0].stats
        assert saved_bytes(after) <= cap * saved, (solver, cap)
        assert stats["peak_after_bytes"] == step_peak(after) <= peak, (solver, cap)


def test_profile_costs_are_cached_in_the_context(deep):
    graph, inputs = deep
    ctx = PassContext(example_inputs=inputs)
    build_problem(graph, cost=CostModel.PROFILE, ctx=ctx)
    timed = dict(ctx.cache["remat.profile"])
    assert timed and all(t > 0 for t in timed.values())
    build_problem(graph, cost=CostModel.PROFILE, ctx=ctx)
    assert ctx.cache["remat.profile"] == timed      # the second build times nothing


# ---------------------------------------------------------------------------
# never recomputed: random ops; views follow their base


def test_random_ops_are_never_recomputed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4)).train()
    x = torch.randn(32, 16)
    graph = capture_joint(model, (x,), example_target(model, (x,), "cross_entropy"), name="drop")
    problem = build_problem(graph)
    random = [c for c in problem.candidates if not is_pure(graph.node(c.name).op)]
    assert random and not any(c.recomputable for c in random)
    after, _ = run_pipeline(graph, "remat{solver=sqrt}")
    copies = [n for n in after.call_nodes() if n.name not in graph]
    assert copies and all(is_pure(n.op) for n in copies)
    kept, _ = run_pipeline(graph, "remat{solver=sqrt keep=[relu*]}")
    assert not any(n.name.startswith("relu") and n.name.endswith(".remat") for n in kept.call_nodes())


# ---------------------------------------------------------------------------
# every zoo model: gradients identical with and without remat


# gru, transformer and the full resnet18 take ~5-10 s each on an idle machine: marked slow to keep this file near
# its budget; the fast suite covers the residual conv net with batch norm through "resnet" (ResNet-18's structure
# at widths 8/16, the ``resnet`` fixture)
@pytest.mark.parametrize("name", ["mlp", "lenet", "resnet", pytest.param("resnet18", marks=pytest.mark.slow),
                                  pytest.param("gru", marks=pytest.mark.slow),
                                  pytest.param("transformer", marks=pytest.mark.slow)])
def test_zoo_gradients_identical(zoo_graphs, name):
    graph, inputs = zoo_graphs(name)
    after, report = run_pipeline(graph, "remat{solver=sqrt}")
    assert report.records[0].stats["nodes_recomputed"] > 0
    loss, grads = _grads(after, inputs)
    ref_loss, ref = _grads(graph, inputs)
    assert torch.equal(loss, ref_loss)
    assert _max_rel(grads, ref) <= GRAD_TOL


# ---------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("option, value, expect", [
    ("budget", "-1", "must be between 0 and 1, got '-1'"),
    ("budget", "1.5", "must be between 0 and 1"),
    ("budget", "256MB", "the budget is a number in [0, 1] between the lowest reachable peak and the peak without "
                        "remat, not a size"),
    ("budget", "half", "a size is a number of bytes"),
    ("saved", "0", "must be above 0"),
    ("saved", "12XB", "unknown unit 'XB'"),
    ("saved", "1.5", "a fraction must be at most 1"),
])
def test_malformed_limits(option, value, expect):
    with pytest.raises(PipelineSpecError, match=re.escape(expect)):
        Remat(**{option: value})
    assert parse_budget("0") == 0.0 and parse_budget("1") == 1.0 and parse_saved("0.5").fraction == 0.5
    # one size syntax across options (mlcomp.base.units): MB powers of 1000, MiB of 1024
    assert parse_saved("256MB").nbytes == 256 * 10**6 and parse_saved("256MiB").nbytes == 256 << 20


def test_saved_cap_below_the_minimum(deep):
    graph, _ = deep
    with pytest.raises(RematError) as err:
        run_pipeline(graph, "remat{saved=0.05}")      # the input alone is 1/11 of the saved activations
    text = str(err.value)
    assert "within saved=0.05" in text and "the minimum feasible cap is 67588 bytes (0.093 of" in text
    assert "raise the cap to at least saved=0.093 or saved=67588B" in err.value.hint and "\n" not in text
    assert build_problem(graph).keep_all().memory == saved_bytes(graph)
    run_pipeline(graph, "remat{saved=0.093 solver=mincut}")      # the minimum it names is feasible
    with pytest.raises(RematError, match="minimum feasible cap is 67588 bytes"):
        run_pipeline(graph, "remat{saved=67587B solver=milp}")


def test_refused_on_inference_graphs(captured):
    _, _, graph = captured("mlp")
    with pytest.raises(PipelineMismatchError, match="runs on training graphs only"):
        run_pipeline(graph, "remat")
    with pytest.raises(RematError, match="is an inference graph"):
        Remat().run(graph, PassContext())
