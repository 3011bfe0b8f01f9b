"""The pass manager: ordering, IR checks, timing/stats, dumps, verification, explain, memory, failures."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from mlcomp.base.errors import PassFailure, PipelineSpecError, VerificationError
from mlcomp.ir import Origin
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.ops import aten
from mlcomp.pipeline import Dump, Explain, IRCheck, Memory, Pipeline, Timing, Verify, run_pipeline, standard_instruments
from mlcomp.pipeline.pass_base import REGISTRY, Pass, PassRegistry, PassResult, option


def small_graph():
    torch.manual_seed(0)
    b = GraphBuilder("small")
    x = b.input("x", (4, 8))
    w = b.param("fc.weight", torch.randn(6, 8))
    t = b.call(aten("t"), w, origin="fc")
    mm = b.call(aten("mm"), x, t, origin="fc")
    r = b.call(aten("relu"), mm, origin="act")
    v = b.call(aten("view"), r, [4, 6], origin="act")       # a no-op view for cleanup
    m = b.call(aten("mul.Tensor"), v, 2.0, origin="scale")
    return b.output(m)


@dataclass(frozen=True)
class BreakRelu(Pass):
    """Turn relu into sigmoid but keep the node's name (a wrong rewrite)."""

    name: ClassVar[str] = "break-relu"

    def run(self, graph, ctx):
        node = graph.node("relu")
        graph.replace(node.with_(op=aten("sigmoid")))
        return PassResult(graph, True, {"broken": 1})


@dataclass(frozen=True)
class Explode(Pass):
    """Raise an exception."""

    name: ClassVar[str] = "explode"
    message: str = option("boom", "what to raise")

    def run(self, graph, ctx):
        raise ValueError(self.message)


@dataclass(frozen=True)
class Corrupt(Pass):
    """Leave a node whose meta is wrong."""

    name: ClassVar[str] = "corrupt"

    def run(self, graph, ctx):
        from mlcomp.ir import TensorMeta

        node = graph.node("relu")
        graph.replace(node.with_(meta=TensorMeta((5, 5), torch.float32)))
        return PassResult(graph, True)


@pytest.fixture()
def registry() -> PassRegistry:
    reg = REGISTRY.copy()
    for cls in (BreakRelu, Explode, Corrupt):
        reg.register(cls)
    return reg


def test_runs_passes_in_order_and_reports_them():
    graph = small_graph()
    before = graph.format()
    out, report = run_pipeline(graph, "cleanup,fuse,dce", verify=True)
    assert graph.format() == before                      # the input graph is left alone
    assert [r.name for r in report.records] == ["cleanup", "fuse", "dce"]
    assert report.pipeline == "cleanup,fuse,dce" and report.verified
    assert report.nodes_before == len(graph) and report.nodes_after == len(out)
    assert all(r.seconds >= 0 for r in report.records) and report.seconds >= sum(r.seconds for r in report.records)
    cleanup, fuse, dce = report.records
    assert cleanup.changed and cleanup.stats["reshapes_removed"] == 1 and cleanup.stats["constants_created"] == 1
    assert fuse.stats["groups_formed"] == 1 and fuse.stats["nodes_fused"] == 3
    assert not dce.changed and dce.nodes_before == dce.nodes_after
    assert all(r.max_error is not None and r.max_error < 1e-6 for r in report.records)
    x = torch.randn(4, 8)
    from mlcomp.ir.interpreter import Interpreter

    torch.testing.assert_close(Interpreter(out).run(x)[0], Interpreter(graph).run(x)[0])


def test_report_format_and_json():
    _, report = run_pipeline(small_graph(), Pipeline.parse("-O2"), verify=True)
    text = report.format()
    assert text.splitlines()[0].startswith("pipeline cleanup,fuse,cleanup: 8 -> 4 nodes")
    assert "every pass verified" in text and "groups_formed=1" in text and "max rel err" in text
    data = json.loads(json.dumps(report.to_json()))
    assert data["pipeline"] == "cleanup,fuse,cleanup" and len(data["passes"]) == 3
    assert data["passes"][1]["stats"]["groups_formed"] == 1
    assert report.stats("fuse")["nodes_fused"] == 3
    with pytest.raises(KeyError):
        report.stats("remat")


def test_empty_pipeline_returns_an_equal_copy():
    graph = small_graph()
    out, report = run_pipeline(graph, None)
    assert out is not graph and out.format() == graph.format() and report.records == []


def test_dump_after_writes_text_and_dot(tmp_path):
    _, report = run_pipeline(small_graph(), "cleanup,fuse,cleanup", instruments=[Dump("fuse", tmp_path)])
    names = sorted(p.name for p in tmp_path.iterdir() if p.name != ".mlcomp")
    assert names == ["00-input.dot", "00-input.ir.txt", "02-fuse.dot", "02-fuse.ir.txt"]
    assert (tmp_path / ".mlcomp").is_file()                      # the folder is marked as mlcomp's
    assert "mlcomp.fused_mm_relu_mul" in (tmp_path / "02-fuse.ir.txt").read_text()
    assert (tmp_path / "02-fuse.dot").read_text().startswith('digraph "small"')
    assert len(report.dumps) == 4 and "dumped 4 file(s)" in report.format()
    run_pipeline(small_graph(), "cleanup,fuse,cleanup", instruments=[Dump("all", tmp_path / "all")])
    assert len(list((tmp_path / "all").glob("0*"))) == 8          # 'all': the input and every top-level pass


def test_dump_after_errors(tmp_path):
    with pytest.raises(PipelineSpecError, match="needs a dump_dir"):
        standard_instruments(dump_after="cleanup")
    with pytest.raises(PipelineSpecError, match="names remat, which the pipeline cleanup does not run") as info:
        run_pipeline(small_graph(), "cleanup", instruments=[Dump("remat", tmp_path)])
    assert "one of: cleanup, simplify, cleanup.simplify, fold-constants" in str(info.value)
    assert list(tmp_path.iterdir()) == []                          # refused before writing anything


def test_verify_names_the_first_pass_and_node_that_broke_the_numbers(registry):
    with pytest.raises(VerificationError) as info:
        run_pipeline(small_graph(), "cleanup,break-relu,fuse", verify=True, registry=registry)
    msg = str(info.value)
    assert "pass 'break-relu' (pass 2 of 3, after cleanup) changed the numbers" in msg
    assert "The first value that diverges is %relu (aten.sigmoid.default) from module act" in msg
    # without verify the same pipeline runs through
    run_pipeline(small_graph(), "cleanup,break-relu,fuse", registry=registry)


def test_verify_uses_given_inputs_and_tolerance(registry):
    x = torch.full((4, 8), -10.0)          # relu and sigmoid nearly agree below zero... but not exactly
    with pytest.raises(VerificationError):
        run_pipeline(small_graph(), "break-relu", verify=True, example_inputs=(x,), registry=registry)
    out, report = run_pipeline(small_graph(), "break-relu", example_inputs=(x,), instruments=[Verify(tolerance=1.0)],
                               registry=registry)
    assert report.records[0].max_error <= 1.0


def test_a_raising_pass_becomes_pass_failure_naming_the_passes_before_it(registry):
    with pytest.raises(PassFailure) as info:
        run_pipeline(small_graph(), "cleanup,fuse,explode{message=kaput}", registry=registry)
    msg = str(info.value)
    assert "pass 'explode' (pass 3 of 3, after cleanup, fuse) failed: ValueError: kaput" in msg
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(PassFailure, match=r"pass 'explode' \(pass 1 of 1, the first\)"):
        run_pipeline(small_graph(), "explode", registry=registry)


def test_an_invalid_graph_is_caught_after_the_pass(registry):
    with pytest.raises(PassFailure) as info:
        run_pipeline(small_graph(), "dce,corrupt", registry=registry)
    assert "pass 'corrupt' (pass 2 of 2, after dce) produced an invalid graph" in str(info.value)
    assert "%relu" in str(info.value)
    run_pipeline(small_graph(), "dce,corrupt", registry=registry, instruments=[Timing()])   # no IRCheck


def test_explain_records_a_diff_pointing_at_modules():
    _, report = run_pipeline(small_graph(), "cleanup,fuse", instruments=[Explain(), IRCheck()])
    cleanup, fuse = report.records
    assert cleanup.diff.removed == ("t", "view") and cleanup.diff.added == ()
    assert cleanup.diff.op_delta == {"aten.t.default": -1, "aten.view.default": -1}
    assert set(cleanup.diff.modules) == {"fc", "act"}
    assert fuse.diff.groups == 1 and fuse.diff.bytes_after < fuse.diff.bytes_before
    assert fuse.diff.removed == ("mm", "relu") and fuse.diff.rewritten == ("mul",)   # the group's value
    assert fuse.diff.modules == ("fc", "act", "scale")
    text = report.format()
    assert "-2 +0 ~1 nodes; bytes moved" in text and "1 fusion group(s)" in text
    assert "modules: fc, act, scale" in text
    assert "ops: aten.mm.default -1" in text


def test_pass_context_carries_example_inputs_and_hardware():
    seen = {}

    @dataclass(frozen=True)
    class Probe(Pass):
        """Record the context."""

        name: ClassVar[str] = "probe"

        def run(self, graph, ctx):
            seen["ctx"] = ctx
            return PassResult(graph, False)

    reg = PassRegistry()
    reg.register(Probe)
    x = torch.randn(4, 8)
    run_pipeline(small_graph(), "probe", example_inputs=(x,), registry=reg)
    assert seen["ctx"].example_inputs[0] is x and seen["ctx"].hw.name.startswith("CPU")
    run_pipeline(small_graph(), "probe", verify=True, registry=reg)          # random inputs when verifying
    assert seen["ctx"].example_inputs[0].shape == (4, 8)


def test_origins_survive_rewrites():
    out, _ = run_pipeline(small_graph(), "-O2")
    fused = [n for n in out.call_nodes() if n.op.is_composite]
    assert len(fused) == 1 and fused[0].origin == Origin("fc")


def test_memory_records_the_estimated_peak_before_and_after_each_pass():
    from mlcomp.analysis.liveness import peak_bytes

    graph = small_graph()
    out, report = run_pipeline(graph, "-O2", instruments=[Memory()])
    cleanup, fuse, again = report.records
    assert cleanup.peak_bytes_before == peak_bytes(graph)
    assert cleanup.peak_bytes_after == fuse.peak_bytes_before and again.peak_bytes_after == peak_bytes(out)
    # fusing mm+relu+mul keeps only the group's output: 4x6 f32 = 96 bytes instead of two 96-byte values
    assert (fuse.peak_bytes_before, fuse.peak_bytes_after) == (192, 96)
    assert fuse.children[-1].name == "fuse-elementwise" and fuse.children[-1].peak_bytes_after == 96
    assert "peak 192 B -> 96 B" in report.format()
    assert report.to_json()["passes"][1]["peak_bytes_after"] == 96
