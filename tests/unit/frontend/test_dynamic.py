"""``--dynamic batch,seq=MIN..MAX``: named symbols with ranges from capture through passes to the artifact."""
from __future__ import annotations

import pytest
import torch

import mlcomp
from mlcomp.base.errors import InputSpecError
from mlcomp.frontend.dynamic import parse_dynamic
from mlcomp.frontend.loading import load_model
from mlcomp.ir.symbols import SizeRange
from mlcomp.pipeline import run_pipeline
from tests.helpers.modules import Tokens


def test_parse_names_dims_and_ranges():
    batch, seq, heads = parse_dynamic("batch=1..64,seq,heads@2=1..16")
    assert (batch.dim, batch.range, seq.dim, seq.range, heads.dim) == (0, SizeRange(1, 64), 1, SizeRange(1), 2)
    assert parse_dynamic(True)[0].name == "batch" and parse_dynamic(None) == ()


@pytest.mark.parametrize("spec, says", [("width", "which dimension 'width' is"), ("batch,batch", "twice"),
                                        ("batch=9..2", "minimum"), ("seq@x", "NAME\\[@DIM\\]"), ("seq=1..8;", "not MIN..MAX")])
def test_bad_dynamic_specs_are_refused(spec, says):
    with pytest.raises(InputSpecError, match=says):
        parse_dynamic(spec)


def test_symbols_are_named_ranged_and_survive_cleanup_and_fusion():
    source = load_model(Tokens().eval(), example_inputs=(torch.randn(2, 5, 8),))
    graph = source.capture(dynamic="batch,seq=1..32")
    assert graph.ranges == {"batch": SizeRange(1), "seq": SizeRange(1, 32)}
    assert graph.symbols == {"batch": 2, "seq": 5}
    optimized, _ = run_pipeline(graph, "-O2", example_inputs=source.inputs())
    text = str(optimized)
    assert text.splitlines()[:2] == ["graph Tokens(%x: f32[batch, seq, 8]) {",
                                     "  # sizes: batch in 1.., seq in 1..32"]
    out = optimized.node(optimized.output_refs[0].name).tensor_meta
    assert out.shape == ("batch", "seq", 8)
    assert "s0" not in text and "s77" not in text


def test_example_outside_its_range_is_refused_before_export():
    with pytest.raises(InputSpecError, match="size 5 at dim 1, outside that range"):
        load_model(Tokens().eval(), example_inputs=(torch.randn(2, 5, 8),)).capture(dynamic="seq=8..16")


def test_manifest_records_ranges_and_a_call_outside_them_is_refused():
    art = mlcomp.compile(Tokens().eval(), torch.randn(2, 5, 8), dynamic="batch=1..4,seq=1..32", pipeline="-O1")
    assert art.manifest["ranges"] == {"batch": [1, 4], "seq": [1, 32]}
    assert art(torch.randn(3, 31, 8)).shape == (3, 31, 8)
    with pytest.raises(InputSpecError, match="dim 0 of input x is 5, outside the range 1..4 of the symbolic size batch"):
        art(torch.randn(5, 7, 8))


def test_verification_runs_at_each_ranges_ends_and_middle():
    art = mlcomp.compile(Tokens().eval(), torch.randn(2, 5, 8), dynamic="batch=1..6,seq=3..9", pipeline="-O1")
    shapes = art.verification["shapes"]
    assert [s["sizes"] for s in shapes] == [{"batch": 2, "seq": 5}, {"batch": 1, "seq": 3},
                                            {"batch": 3, "seq": 6}, {"batch": 6, "seq": 9}]
    assert [s["shapes"] for s in shapes[1:]] == [["1x3x8"], ["3x6x8"], ["6x9x8"]]
    assert all(s["passed"] for s in shapes) and art.verification["passed"]
