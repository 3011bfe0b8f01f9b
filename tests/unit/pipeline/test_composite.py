"""Composite passes the manager sees into: innermost blame, nested dumps, up-front checks, hooks, report nesting."""
from __future__ import annotations

import collections
import json
import textwrap
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from mlcomp.base.errors import PassFailure, PipelineMismatchError, PipelineSpecError, TargetUnavailableError, \
    VerificationError
from mlcomp.ir import Mode
from mlcomp.ir.ops import aten
from mlcomp.passes.cleanup.cleanup import CommonSubexpressionElimination, DeadCodeElimination
from mlcomp.pipeline import (REGISTRY, CompositePass, Dump, FixedPoint, Instrument, IRCheck, Pass, PassResult,
                             Requirement, Sequential, Timing, Verify, run_pipeline)
from mlcomp.pipeline.composite import Position
from tests.unit.passes.test_fusion import conv_bn
from tests.unit.pipeline.test_manager import BreakRelu, Corrupt, Explode, small_graph

CALLS: list[str] = []


@dataclass(frozen=True)
class Touch(Pass):
    """Record that it ran; change nothing."""

    name: ClassVar[str] = "touch"

    def run(self, graph, ctx):
        CALLS.append(self.name)
        return PassResult(graph, False)


@dataclass(frozen=True)
class Sneaky(Pass):
    """Break relu but claim nothing changed."""

    name: ClassVar[str] = "sneaky"

    def run(self, graph, ctx):
        graph.replace(graph.node("relu").with_(op=aten("sigmoid")))
        return PassResult(graph, False)


@dataclass(frozen=True)
class NeedsCalibration(Pass):
    """Stand-in for a quantizer: needs calibration data and a hardware spec."""

    name: ClassVar[str] = "needs-calibration"
    requires: ClassVar[frozenset[Requirement]] = frozenset({Requirement.CALIBRATION_DATA,
                                                            Requirement.HARDWARE_SPEC})

    def run(self, graph, ctx):
        CALLS.append(self.name)
        return PassResult(graph, False)


@dataclass(frozen=True)
class NeedsInputs(Pass):
    """Stand-in for a pass that measures on example inputs and needs the backward graph."""

    name: ClassVar[str] = "needs-inputs"
    requires: ClassVar[frozenset[Requirement]] = frozenset({Requirement.EXAMPLE_INPUTS, Requirement.TRAINING_GRAPH})

    def run(self, graph, ctx):
        CALLS.append(f"{self.name}:{len(ctx.example_inputs)}")
        return PassResult(graph, False)


@dataclass(frozen=True)
class TrainingOnly(Pass):
    """Stand-in for a pass that only makes sense on training graphs."""

    name: ClassVar[str] = "training-only"
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.TRAINING})

    def run(self, graph, ctx):
        CALLS.append(self.name)
        return PassResult(graph, False)


@dataclass(frozen=True)
class Wrapper(CompositePass):
    """dce, a wrong rewrite, cse."""

    name: ClassVar[str] = "wrapper"

    def body(self):
        return Sequential(DeadCodeElimination(), BreakRelu(), CommonSubexpressionElimination())


@dataclass(frozen=True)
class Hider(CompositePass):
    """A child that hides its change."""

    name: ClassVar[str] = "hider"

    def body(self):
        return Sequential(Sneaky(), CommonSubexpressionElimination())


@dataclass(frozen=True)
class Boom(CompositePass):
    """dce, then a raising pass."""

    name: ClassVar[str] = "boom"

    def body(self):
        return Sequential(DeadCodeElimination(), Explode())


@dataclass(frozen=True)
class Broken(CompositePass):
    """dce, then a pass that leaves an invalid graph."""

    name: ClassVar[str] = "broken"

    def body(self):
        return Sequential(DeadCodeElimination(), Corrupt())


@dataclass(frozen=True)
class Calibrate(CompositePass):
    """A composite whose second child needs what the context may lack, and a training-only third."""

    name: ClassVar[str] = "calibrate"

    def body(self):
        return Sequential(Touch(), NeedsCalibration(), TrainingOnly())


@dataclass(frozen=True)
class Tidy(CompositePass):
    """dce then cse, nothing broken."""

    name: ClassVar[str] = "tidy"

    def body(self):
        return Sequential(DeadCodeElimination(), FixedPoint(Sequential(CommonSubexpressionElimination()), 2))


@pytest.fixture()
def registry():
    reg = REGISTRY.copy()
    for cls in (BreakRelu, Explode, Corrupt, Touch, Sneaky, NeedsCalibration, NeedsInputs, TrainingOnly, Wrapper,
                Hider, Boom, Broken, Calibrate, Tidy):
        reg.register(cls)
    CALLS.clear()
    return reg


# ---------------------------------------------------------------------------
# the innermost pass is named


def test_verify_names_the_innermost_pass_that_broke_the_numbers(registry):
    with pytest.raises(VerificationError) as info:
        run_pipeline(small_graph(), "cleanup,wrapper,fuse", verify=True, registry=registry)
    msg = str(info.value)
    assert ("pass 'break-relu' (inside wrapper, pass 2 of 3, after cleanup; step 2 of 3 of wrapper, after dce) "
            "changed the numbers") in msg
    assert "The first value that diverges is %relu (aten.sigmoid.default) from module act" in msg
    run_pipeline(small_graph(), "cleanup,wrapper,fuse", registry=registry)       # no Verify: runs through


def test_a_child_that_hides_its_change_is_blamed_on_its_composite(registry):
    with pytest.raises(VerificationError, match=r"pass 'hider' \(pass 2 of 2, after dce\) changed the numbers"):
        run_pipeline(small_graph(), "dce,hider", verify=True, registry=registry)


def test_failures_and_invalid_graphs_name_the_child_and_its_composite(registry):
    with pytest.raises(PassFailure) as info:
        run_pipeline(small_graph(), "boom", registry=registry)
    assert ("pass 'explode' (inside boom, pass 1 of 1, the first; step 2 of 2 of boom, after dce) failed: "
            "ValueError: boom") in str(info.value)
    with pytest.raises(PassFailure) as info:
        run_pipeline(small_graph(), "cse,broken", registry=registry)
    assert "pass 'corrupt' (inside broken, pass 2 of 2, after cse; step 2 of 2 of broken, after dce) produced an " \
           "invalid graph" in str(info.value)


def test_positions_describe_rounds_and_name_dump_files():
    top = Position("cleanup", 1, 3)
    child = Position("cse", 3, 4, ("simplify", "fold-constants"), 2, top, "cse")
    assert child.slug == "01-cleanup.r2.cse" and child.names == ("cleanup", "cse") and child.depth == 1
    assert child.describe() == ("inside cleanup, pass 1 of 3, the first; step 3 of 4 of cleanup in round 2, "
                                "after simplify, fold-constants")


# ---------------------------------------------------------------------------
# dumps of nested passes


def test_dump_after_a_nested_pass_writes_its_files(tmp_path):
    out, report = run_pipeline(conv_bn(), "cleanup,fuse,cleanup",
                               instruments=[IRCheck(), Dump("fold-batchnorm,fuse.fold-bias,simplify", tmp_path)])
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != ".mlcomp")
    rounds = [report.records[0].stats["rounds"], report.records[2].stats["rounds"]]
    assert rounds == [1, 1]                                        # nothing to clean up: one round each
    stems = ["00-input", "01-cleanup.r1.simplify", "02-fuse.fold-batchnorm",
             "02-fuse.fold-bias", "03-cleanup.r1.simplify"]
    assert names == sorted(f"{s}{ext}" for s in stems for ext in (".dot", ".ir.txt"))
    folded = (tmp_path / "02-fuse.fold-batchnorm.ir.txt").read_text()
    assert "%conv.weight_bnfold" in folded and "batch_norm" not in folded
    assert "batch_norm" in (tmp_path / "01-cleanup.r1.simplify.ir.txt").read_text()
    assert sorted(report.dumps) == sorted(str(tmp_path / n) for n in names)


def test_dump_after_a_name_no_pass_runs_is_refused_listing_nested_ones(tmp_path):
    with pytest.raises(PipelineSpecError) as info:
        run_pipeline(conv_bn(), "fuse", instruments=[Dump("batchnorm", tmp_path)])
    msg = str(info.value)
    assert "--dump-after names batchnorm, which the pipeline fuse does not run" in msg
    assert "fuse.fold-batchnorm" in msg and "fuse-elementwise" in msg


# ---------------------------------------------------------------------------
# modes and requirements, checked before anything runs


def test_mismatches_are_refused_up_front_with_every_problem(registry):
    with pytest.raises(PipelineMismatchError) as info:
        run_pipeline(conv_bn(Mode.TRAINING), "touch,fold-batchnorm,calibrate,fuse", registry=registry)
    msg = str(info.value)
    assert msg.startswith("pipeline touch,fold-batchnorm,calibrate,fuse cannot run on graph convbn (a training "
                          "graph); nothing was run: (1) pass 'fold-batchnorm' (pass 2 of 4) runs on inference graphs "
                          "only, and graph convbn is a training graph (fuse skips it on training graphs by itself); "
                          "(2) pass 'needs-calibration' (inside calibrate, pass 3 of 4) needs a hardware spec, and "
                          "none was given (pass hardware=")
    assert "(3) pass 'needs-calibration' (inside calibrate, pass 3 of 4) needs calibration data" in msg
    assert "(4)" not in msg and CALLS == []                       # nothing ran, not even the first pass
    with pytest.raises(PipelineMismatchError, match=r"\(1\) pass 'training-only' \(pass 1 of 1\) runs on "
                                                    r"training graphs only, and graph small is a inference"):
        run_pipeline(small_graph(), "training-only", registry=registry)


def test_example_inputs_and_training_graph_requirements(registry):
    with pytest.raises(PipelineMismatchError) as info:
        run_pipeline(small_graph(), "needs-inputs", registry=registry)
    msg = str(info.value)
    assert "(1) pass 'needs-inputs' (pass 1 of 1) needs a training graph, and the graph is not one (capture the " \
           "model in training mode); (2) pass 'needs-inputs' (pass 1 of 1) needs example inputs, and none was " \
           "given (pass example_inputs=)" in msg
    graph = conv_bn(Mode.TRAINING)
    with pytest.raises(PipelineMismatchError, match=r"\(1\) pass 'needs-inputs' .* needs example inputs"):
        run_pipeline(graph, "needs-inputs", registry=registry)
    run_pipeline(graph, "needs-inputs", registry=registry, example_inputs=(torch.randn(1, 3, 8, 8),))
    run_pipeline(graph, "needs-inputs", registry=registry, verify=True)      # verifying supplies random inputs
    assert CALLS == ["needs-inputs:1", "needs-inputs:1"]


def test_a_child_whose_mode_does_not_fit_is_skipped_with_a_reason(registry):
    from mlcomp.hardware.spec import DEFAULT_CPU

    out, report = run_pipeline(small_graph(), "calibrate", registry=registry, calibration_data=(torch.ones(1),),
                               hardware=DEFAULT_CPU)
    assert CALLS == ["touch", "needs-calibration"]
    skipped = report.records[0].children[2]
    assert (skipped.name, skipped.skipped, skipped.path) == ("training-only", "inference graph",
                                                             "01-calibrate.training-only")
    assert report.records[0].stats == {"training-only": "skipped (inference graph)"}
    CALLS.clear()
    run_pipeline(conv_bn(Mode.TRAINING), "calibrate", registry=registry, calibration_data=(torch.ones(1),),
                 hardware=DEFAULT_CPU)
    assert CALLS == ["touch", "needs-calibration", "training-only"]


# ---------------------------------------------------------------------------
# instruments


class Recording(Instrument):
    def __init__(self, tag: str, events: list) -> None:
        self.tag, self.events = tag, events

    def start_pipeline(self, passes, graph, ctx):
        self.events.append((self.tag, "start", ",".join(p.name for p in passes)))

    def before_pass(self, p, graph, ctx):
        self.events.append((self.tag, "before", p.name))

    def after_pass(self, p, result, record):
        kids = ",".join(c.name for c in record.children)
        self.events.append((self.tag, "after", p.name + (f"[{kids}]" if kids else "")))

    def end_pipeline(self, graph, report):
        self.events.append((self.tag, "end", str(len(report.records))))


def test_instrument_hooks_are_called_in_order_around_every_pass(registry):
    events: list = []
    run_pipeline(small_graph(), "dce,tidy", registry=registry,
                 instruments=[Recording("a", events), Recording("b", events)])
    assert events == [
        ("a", "start", "dce,tidy"), ("b", "start", "dce,tidy"),
        ("a", "before", "dce"), ("b", "before", "dce"), ("b", "after", "dce"), ("a", "after", "dce"),
        ("a", "before", "tidy"), ("b", "before", "tidy"),
        ("a", "before", "dce"), ("b", "before", "dce"), ("b", "after", "dce"), ("a", "after", "dce"),
        ("a", "before", "cse"), ("b", "before", "cse"), ("b", "after", "cse"), ("a", "after", "cse"),
        ("b", "after", "tidy[dce,cse]"), ("a", "after", "tidy[dce,cse]"),
        ("a", "end", "2"), ("b", "end", "2")]


def test_report_nests_child_records_under_their_composite():
    out, report = run_pipeline(conv_bn(Mode.TRAINING), "cleanup,fuse", verify=True)
    cleanup, fuse = report.records
    assert [c.name for c in fuse.children] == ["fold-batchnorm", "recompose", "fuse-attention", "fold-bias",
                                               "fuse-elementwise"]
    assert fuse.children[0].skipped == "training graph" and fuse.stats["batchnorm"] == "skipped (training graph)"
    assert [(c.round, c.name) for c in cleanup.children] == [
        (r, n) for r in range(1, cleanup.stats["rounds"] + 1) for n in ("simplify", "fold-constants", "cse", "dce")]
    # a composite's stats are its children's numbers summed (zeros dropped), plus the rounds
    total: collections.Counter = collections.Counter()
    for c in cleanup.children:
        total.update({k: v for k, v in c.stats.items() if isinstance(v, int)})
    assert cleanup.stats == {**{k: v for k, v in total.items() if v}, "rounds": cleanup.stats["rounds"]}
    assert fuse.stats["groups_formed"] == fuse.children[-1].stats["groups_formed"] == 1
    assert cleanup.seconds == pytest.approx(sum(c.seconds for c in cleanup.children))
    assert fuse.nodes_before == fuse.children[0].nodes_before and fuse.nodes_after == fuse.children[-1].nodes_after
    # Verify checks after top-level passes (children are replayed only when a composite broke the numbers)
    assert all(r.max_error < 1e-6 for r in report.records)
    assert all(c.max_error is None for r in report.records for c in r.children)
    data = json.loads(json.dumps(report.to_json()))
    assert data["passes"][1]["children"][0]["skipped"] == "training graph"
    assert data["passes"][1]["children"][4]["path"] == "02-fuse.fuse-elementwise"
    text = report.format(nested=True)
    rows = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert list(rows) == ["1", "1.1", "1.2", "1.3", "1.4", "2", "2.1", "2.2", "2.3", "2.4", "2.5"]
    assert rows["2.1"].split()[1:] == ["fold-batchnorm", "-", "11", "->", "11", "skipped", "(training", "graph)"]
    assert rows["1.1"].split()[1:3] == ["r1", "simplify"]
    assert [line.split()[0] for line in report.format().splitlines()[2:]] == ["1", "2"]   # top level by default
    assert report.stats("fuse-elementwise") == fuse.children[-1].stats


def test_composite_runs_the_same_as_its_children_in_a_flat_pipeline(registry):
    nested, report = run_pipeline(small_graph(), "cleanup", verify=True)
    rounds = report.records[0].stats["rounds"]
    flat, _ = run_pipeline(small_graph(), ",".join(["simplify,fold-constants,cse,dce"] * rounds), verify=True)
    assert nested.format() == flat.format() == textwrap.dedent("""
        graph small(%x: f32[4, 8]) {
          %t: f32[8, 6] = param   # fc
          %mm: f32[4, 6] = aten.mm.default(%x, %t)   # fc
          %relu: f32[4, 6] = aten.relu.default(%mm)   # act
          %mul: f32[4, 6] = aten.mul.Tensor(%relu, 2.0)   # scale
          return (%mul,)
        }""").strip()
    # without the manager, a composite runs its children itself, with the same result
    from mlcomp.passes.cleanup.cleanup import Cleanup
    from mlcomp.pipeline import PassContext

    alone = Cleanup().run(small_graph(), PassContext())
    assert alone.graph.format() == nested.format() and dict(alone.stats) == report.records[0].stats
    capped, report = run_pipeline(small_graph(), "cleanup{max_iterations=1}")
    assert report.records[0].stats["rounds"] == 1 and len(report.records[0].children) == 4


def test_fixed_point_and_sequential_are_data():
    body = FixedPoint(Sequential(DeadCodeElimination(), Sequential(CommonSubexpressionElimination())), 3)
    assert [s.pass_.name for s in body.body.steps] == ["dce", "cse"]          # nested sequences flatten
    assert body == FixedPoint(Sequential(DeadCodeElimination(), CommonSubexpressionElimination()), 3)
    with pytest.raises(ValueError, match="max_iterations >= 1"):
        FixedPoint(Sequential(DeadCodeElimination()), 0)
    with pytest.raises(TypeError, match="holds passes"):
        Sequential("dce")


# ---------------------------------------------------------------------------
# the API honours a pipeline file's target


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2.0


def test_compile_honours_the_toml_target(tmp_path):
    import mlcomp

    path = tmp_path / "pipe.toml"
    path.write_text('target = "no-such-target"\npipeline = "-O1"\n')
    torch.manual_seed(0)
    model, x = Tiny().eval(), torch.randn(2, 8)
    with pytest.raises(TargetUnavailableError, match="no target named 'no-such-target'"):
        mlcomp.compile(model, (x,), pipeline=str(path))
    art = mlcomp.compile(model, (x,), pipeline=str(path), target="cpu")          # an explicit target wins
    assert art.target == "cpu" and art.manifest["pipeline"] == "cleanup"
    path.write_text('target = "cpu"\n[[passes]]\nname = "O2"\n')
    art = mlcomp.compile(model, (x,), pipeline=str(path))
    assert art.target == "cpu" and art.manifest["pipeline_report"]["passes"][1]["children"]


@pytest.mark.ort
def test_compile_uses_the_toml_target_onnxruntime(tmp_path):
    import mlcomp

    path = tmp_path / "pipe.toml"
    path.write_text('target = "onnxruntime"\npipeline = "-O2"\n')
    torch.manual_seed(0)
    art = mlcomp.compile(Tiny().eval(), (torch.randn(2, 8),), pipeline=str(path))
    assert art.target == "onnxruntime" and art.verification["passed"]


def test_timing_only_instruments_still_report_every_pass():
    _, report = run_pipeline(small_graph(), "-O2", instruments=[Timing()])
    assert not report.verified and all(r.seconds >= 0 for r in report.walk())
    assert [len(r.children) for r in report.records] == [8, 5, 4]


def test_verify_instrument_on_its_own(registry):
    out, report = run_pipeline(small_graph(), "cleanup,fuse", instruments=[Verify()])
    assert report.verified and all(r.max_error < 1e-6 for r in report.records)
