"""Dynamo's symbols named after their dimension, example values of unbacked sizes, size asserts dropped."""
from __future__ import annotations

import operator

import pytest
import torch

from mlcomp.base.errors import InputSpecError
from mlcomp.dynamo.lower import drop_bound_asserts
from mlcomp.dynamo.options import BY_RULE, INFERENCE_CANDIDATES, INFERENCE_TIMING, BackendOptions
from mlcomp.dynamo.partition import representable
from mlcomp.dynamo.report import size_ranges
from mlcomp.dynamo.symbols import bind_examples, name_dimensions
from mlcomp.dynamo.target_rule import FAMILIES, flop_shares, pick_target
from mlcomp.frontend.capture import capture_module
from mlcomp.frontend.dynamic import parse_dynamic
from mlcomp.ir import Graph, Node, TensorMeta
from mlcomp.ir.ops import INPUT
from mlcomp.ir.symbols import SizeRange


def graph_of(*shapes, ranges=None):
    g = Graph("g")
    for i, shape in enumerate(shapes):
        g.add(Node(f"x{i}", INPUT, meta=TensorMeta(tuple(shape), torch.float32)))
    g.ranges = dict(ranges or {})
    return g


def shapes(g):
    return [n.tensor_meta.shape for n in g.input_nodes]


def test_table_names_batch_seq_and_image_sides():
    g = name_dimensions(graph_of(("s0", "s1", 16), ("s0", 3, "s2", "s3")), ())
    assert shapes(g) == [("batch", "seq", 16), ("batch", 3, "height", "width")]


def test_two_symbols_for_one_dimension_keep_apart():
    g = name_dimensions(graph_of(("u0", 8), ("u1", 8)), ())
    assert shapes(g) == [("batch", 8), ("batch_2", 8)]


def test_an_expression_is_renamed_inside_and_a_name_already_given_is_kept():
    g = graph_of(("s0", "s1"), ("s0*s1",), ("tokens", 4))
    g.symbols = {"tokens": 3}
    g = name_dimensions(g, ())
    assert shapes(g) == [("batch", "seq"), ("batch*seq",), ("tokens", 4)]


def test_the_option_names_and_bounds_the_sizes():
    g = graph_of(("s0", "s1", 8), ranges={"s0": SizeRange(2), "s1": SizeRange(2, 4096)})
    g = name_dimensions(g, parse_dynamic("rows@0=1..64,steps@1=8..512"))
    assert shapes(g) == [("rows", "steps", 8)]
    assert g.ranges == {"rows": SizeRange(2, 64), "steps": SizeRange(8, 512)}   # Dynamo's range ∩ the option's


def test_a_suffixed_name_keeps_the_range_the_option_gave():
    g = graph_of(("u0", 8), ("u1", 8), ranges={"u0": SizeRange(1, 4096), "u1": SizeRange(1, 4096)})
    g = name_dimensions(g, parse_dynamic("rows@0=2..64"))
    assert shapes(g) == [("rows", 8), ("rows_2", 8)]
    assert g.ranges == {"rows": SizeRange(2, 64), "rows_2": SizeRange(2, 64)}


def test_unnamed_dimension_keeps_torchs_name():
    g = name_dimensions(graph_of((4, 3, 2, 2, "s7", 5)), ())
    assert shapes(g) == [(4, 3, 2, 2, "s7", 5)]


def test_unbacked_size_takes_its_example_from_the_inputs():
    g = bind_examples(graph_of(("u0", 8), ("u0", "u1")), [torch.zeros(5, 8), torch.zeros(5, 3)])
    assert g.symbols == {"u0": 5, "u1": 3}


def test_bound_asserts_are_dropped_and_relations_kept():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    size = graph.call_function(torch.ops.aten.sym_size.int, (x, 0))
    other = graph.call_function(torch.ops.aten.sym_size.int, (x, 1))
    for test in (graph.call_function(operator.ge, (size, 2)), graph.call_function(operator.le, (size, 64)),
                 graph.call_function(operator.eq, (size, other))):
        graph.call_function(torch.ops.aten._assert_scalar.default, (test, "check"))
    graph.output(x)
    assert drop_bound_asserts(graph) == 2
    kept = [n for n in graph.nodes if n.target is torch.ops.aten._assert_scalar.default]
    assert [n.args[0].target for n in kept] == [operator.eq]
    assert not representable(kept[0])          # it runs in torch, outside mlcomp's regions


def test_inference_picks_its_target_unless_one_is_named():
    default = BackendOptions.parse({})
    assert default.target == "cpu"                               # what training compiles for
    assert default.for_inference().target == BY_RULE
    auto = BackendOptions.parse({"target": "auto"}).for_inference().target_args()
    assert auto == {"target": "auto", "candidates": INFERENCE_CANDIDATES, "isolate": False,
                    "auto_timing": INFERENCE_TIMING}
    assert BackendOptions.parse({"target": "cpu"}).for_inference().target_args() == {"target": "cpu"}
    assert BackendOptions.parse({"dynamic": "batch,seq=8..64"}).dynamic[1].range == SizeRange(8, 64)


def test_bad_dynamic_option_is_refused_before_any_graph():
    with pytest.raises(InputSpecError, match="heads"):
        BackendOptions.parse({"dynamic": "heads"})


def conv_then_linear(channels: int, features: int) -> Graph:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, channels, 3), torch.nn.Flatten(),
                                torch.nn.Linear(channels * 6 * 6, features)).eval()
    return capture_module(model, (torch.randn(2, 3, 8, 8),))


def test_rule_follows_the_flop_share_and_skips_a_missing_target():
    conv_heavy, gemm_heavy = conv_then_linear(16, 4), conv_then_linear(1, 4096)
    assert pick_target(conv_heavy)[0] == "onnxruntime"
    target, why = pick_target(gemm_heavy)
    assert target == "cpu" and why.startswith("matmul 99% of heavy FLOPs") and why.endswith(": cpu (rule)")
    assert pick_target(conv_heavy, available=lambda name: name != "onnxruntime")[0] == "cpu"


def test_the_heavy_families_are_the_irs_compute_ops_batch_norm_aside():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 8)).eval()
    conv, linear = 2 * (2 * 4 * 6 * 6) * 3 * 3 * 3, 2 * 2 * (4 * 6 * 6) * 8     # multiply-adds, twice
    shares = flop_shares(capture_module(model, (torch.randn(2, 3, 8, 8),)))
    assert shares == pytest.approx({"convolution": conv / (conv + linear), "matmul": linear / (conv + linear)})
    assert "_native_batch_norm_legit_no_training" not in FAMILIES
    assert FAMILIES["_scaled_dot_product_flash_attention_for_cpu"] == FAMILIES["bmm"] == "matmul"


def test_the_reports_size_ranges_read_back_as_the_ranges_they_came_from():
    sizes = {"seq": [8, 512], "batch": [1, None]}
    lines = size_ranges(sizes)
    assert [line.split()[0] for line in lines] == ["batch", "seq"]
    assert {name: SizeRange.parse(text) for name, text in (line.split() for line in lines)} == \
        {"batch": SizeRange(1), "seq": SizeRange(8, 512)}
