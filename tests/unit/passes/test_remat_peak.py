"""remat's objective is the whole step's predicted peak: plans are compared by it, ``peak=`` limits it,
and the compiled step's allocator peak is the prediction."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.analysis.step_peak import step_memory
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.base.errors import PipelineSpecError
from mlcomp.frontend.joint import LossKind, capture_joint
from mlcomp.hardware.peak_memory import MemorySource, PeakMemory
from mlcomp.passes.remat.remat import RematError
from mlcomp.pipeline import run_pipeline
from mlcomp.training.step import compile_training


def cnn() -> nn.Module:
    """Six conv-bn-relu blocks on 16x16 maps: activations, not weights, make the peak."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(6):
        layers += [nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(8 * 16 * 16, 10))


@pytest.fixture(scope="module")
def joint():
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))
    return capture_joint(cnn(), (x,), y, loss=LossKind.CROSS_ENTROPY), (x, y)


def peak(graph, fused: bool = False) -> int:
    return step_memory(graph, workspace=op_workspaces(graph), fused=fused).peak_bytes


def allocator_peak(graph, args, fused: bool) -> int:
    art = compile_training(graph, optimizer="sgd{lr=0.01 momentum=0.9}", update_in_backward=fused)
    art.step(*args)
    with PeakMemory("cpu", source=MemorySource.ALLOCATOR) as mem:
        art.step(*args)
    return mem.reading.growth


@pytest.mark.parametrize("fused", [False, True])
def test_plan_lowers_the_step_peak_and_the_allocator_agrees(joint, fused):
    graph, args = joint
    after, report = run_pipeline(graph, f"remat{{budget=0.3 fused={str(fused).lower()}}}")
    stats = report.records[0].stats
    assert stats["peak_before_bytes"] == peak(graph, fused) and stats["peak_after_bytes"] == peak(after, fused)
    assert stats["peak_after_bytes"] < 0.8 * stats["peak_before_bytes"]
    assert stats["plans_compared"] >= 2 and sum(stats["peak_by_kind"].values()) == stats["peak_after_bytes"]
    assert any(n.name.endswith(".remat") for n in after.call_nodes())
    assert abs(allocator_peak(after, args, fused) - stats["peak_after_bytes"]) <= 0.01 * stats["peak_after_bytes"]


def test_peak_limit_takes_the_cheapest_plan_that_fits(joint):
    graph, _ = joint
    base = peak(graph)
    _, loose = run_pipeline(graph, f"remat{{peak={int(base * 0.95)}B}}")
    _, tight = run_pipeline(graph, "remat{budget=0.3}")
    low = tight.records[0].stats["peak_after_bytes"]
    _, limited = run_pipeline(graph, f"remat{{peak={low}B}}")
    s_loose, s_lim = loose.records[0].stats, limited.records[0].stats
    assert s_loose["peak_after_bytes"] <= 0.95 * base and s_loose["peak_limit_bytes"] == int(base * 0.95)
    assert s_lim["peak_after_bytes"] <= low
    assert s_loose["recompute_flops"] <= s_lim["recompute_flops"]    # a looser limit never costs more


def test_peak_limit_below_reach_names_the_lowest(joint):
    graph, _ = joint
    with pytest.raises(RematError) as err:
        run_pipeline(graph, "remat{peak=1KiB}")
    text = str(err.value)
    assert "cannot bring the predicted peak" in text and "the lowest any plan reaches is" in text
    assert "raise the limit to at least peak=" in err.value.hint


@pytest.mark.parametrize("spec, words", [("remat{peak=12XB}", "unknown unit"), ("remat{peak=0}", "must be above 0")])
def test_bad_peak_is_a_spec_error(joint, spec, words):
    with pytest.raises(PipelineSpecError, match=words):
        run_pipeline(joint[0], spec)


def test_gradients_unchanged_by_the_chosen_plan(joint):
    graph, args = joint
    after, _ = run_pipeline(graph, "remat{budget=0.3 fused=true}")
    plain, remat = compile_training(graph), compile_training(after)
    (_, g0), (_, g1) = plain.gradients(*args), remat.gradients(*args)
    assert g0.keys() == g1.keys() and all(torch.equal(g0[k], g1[k]) for k in g0)


@pytest.fixture(scope="module")
def wide():
    """An MLP whose weights outweigh its activations: the optimizer's update is the step's peak."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (4,), generator=torch.Generator().manual_seed(2))
    return capture_joint(model, (x,), y, loss=LossKind.CROSS_ENTROPY), (x, y)


@pytest.mark.parametrize(("spec", "fused"), [("adam{lr=1e-3}", False), ("adamw{lr=1e-3 weight_decay=0.1}", True),
                                             ("sgd{lr=0.1 weight_decay=1e-3}", False)])
def test_remat_told_the_optimizer_predicts_the_allocator_peak(wide, spec, fused):
    graph, args = wide
    flag = str(fused).lower()
    after, report = run_pipeline(graph, f'remat{{budget=0.5 fused={flag} optimizer="{spec}"}}')
    predicted = report.records[0].stats["peak_after_bytes"]
    art = compile_training(after, optimizer=spec, update_in_backward=fused)
    art.step(*args)                              # the optimizer's state exists before the measured step
    with PeakMemory("cpu", source=MemorySource.ALLOCATOR) as mem:
        art.step(*args)
    got = mem.reading.growth
    assert abs(got - predicted) <= 0.01 * got, (got, predicted)       # a few bytes: the optimizer's scalars
    _, blind = run_pipeline(graph, f"remat{{budget=0.5 fused={flag}}}")     # the update's temporaries unseen
    assert blind.records[0].stats["peak_after_bytes"] < 0.9 * got


def test_an_unknown_optimizer_is_a_spec_error(wide):
    with pytest.raises(PipelineSpecError, match="option 'optimizer' of pass 'remat' got 'rmsprop'"):
        run_pipeline(wide[0], 'remat{optimizer="rmsprop"}')


def test_remat_reads_the_steps_optimizer_from_the_pipeline_run(wide):
    from mlcomp.runtime.optim import OptimizerSpec

    graph, _ = wide
    _, told = run_pipeline(graph, 'remat{budget=0.5 optimizer="adam{lr=1e-3}"}')
    _, given = run_pipeline(graph, "remat{budget=0.5}", optimizer=OptimizerSpec.parse("adam{lr=1e-3}"))
    _, blind = run_pipeline(graph, "remat{budget=0.5}")
    peaks = [r.records[0].stats["peak_after_bytes"] for r in (told, given, blind)]
    assert peaks[0] == peaks[1] > peaks[2]
