"""Fused kernels (mlcomp.ir.composites): generated code, in-place safety, tiling, trace/export."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from mlcomp.ir import Graph, Mode, Node, Ref, TensorMeta
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.composites import Tiling, fused_body, fused_kernel, is_fused, register_fused
from mlcomp.ir.ops import INPUT, OUTPUT, Category, aten, category
from mlcomp.pipeline import run_pipeline


def chain_body(shape=(64, 48), mode=Mode.INFERENCE) -> Graph:
    b = GraphBuilder("body", mode=mode)
    a0, a1 = b.input("a0", shape), b.input("a1", shape[-1:])
    v0 = b.call(aten("mul.Tensor"), a0, 1.5, name="v0")
    v1 = b.call(aten("add.Tensor"), v0, a1, name="v1")
    v2 = b.call(aten("sigmoid"), v1, name="v2")                # v1 is read again below: kept
    v3 = b.call(aten("mul.Tensor"), v2, v1, name="v3")
    return b.output(b.call(aten("tanh"), v3, name="v4"))


def reference(x, y):
    v = x * 1.5 + y
    return torch.tanh(torch.sigmoid(v) * v)


def test_generated_source_overwrites_dead_intermediates_only():
    op = register_fused(chain_body())
    kernel = fused_kernel(op)
    assert is_fused(op) and fused_body(op) is kernel.body and category(op) is Category.BROADCAST
    lines = kernel.source.splitlines()
    assert lines[1].endswith("# aten.mul.Tensor")            # reads the input a0: a new tensor
    assert lines[2].endswith("# aten.add_.Tensor")           # v0 is dead after: in place
    assert lines[3].endswith("# aten.sigmoid.default")      # v1 is read again by the mul
    assert lines[4].endswith("# aten.mul_.Tensor")           # overwrites v2, the sigmoid's result
    assert lines[5].endswith("# aten.tanh_.default")
    x, y = torch.randn(64, 48), torch.randn(48)
    before = x.clone()
    torch.testing.assert_close(op.resolve()(x, y), reference(x, y))
    assert torch.equal(x, before)                           # inputs are never written


def test_identical_bodies_share_one_op_and_training_bodies_never_write_in_place():
    assert register_fused(chain_body()) == register_fused(chain_body())
    train = fused_kernel(register_fused(chain_body(mode=Mode.TRAINING)))
    assert "_." not in train.source.replace("aten.", "")
    x = torch.randn(64, 48, requires_grad=True)
    y = torch.randn(48)
    out = fused_kernel(register_fused(chain_body())).__call__(x, y)   # inference body, but autograd is on
    out.sum().backward()                                     # the out-of-place variant keeps autograd valid
    x2 = x.detach().clone().requires_grad_()
    reference(x2, y).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("shape, second, mode", [
    ((64, 48), (64, 48), "flat"),
    ((64, 48), (), "flat"),
    ((64, 48), (1, 1), "flat"),
    ((64, 48), (48,), "rows"),
    ((64, 48), (1, 48), "rows"),
])
def test_tiled_execution_matches_the_plain_function(shape, second, mode):
    b = GraphBuilder("body")
    a0, a1 = b.input("a0", shape), b.input("a1", second)
    v = b.call(aten("relu"), b.call(aten("sub.Tensor"), b.call(aten("mul.Tensor"), a0, a1, name="v0"), 0.5,
                                    name="v1"), name="v2")
    op = register_fused(b.output(b.call(aten("exp"), v, name="v3")), Tiling(tile_elements=100, min_elements=16))
    kernel = fused_kernel(op)
    assert kernel.tiled and kernel._plan.tile.mode == mode
    x, y = torch.randn(shape), torch.randn(second)
    want = torch.exp(torch.relu(x * y - 0.5))
    torch.testing.assert_close(kernel(x, y), want)
    torch.testing.assert_close(kernel._plan.fast(x, y), want)           # untiled path
    # traced: the tile loop is a TorchScript function and survives freeze, save and load
    traced = torch.jit.freeze(torch.jit.trace(_Wrap(op), (x, y)).eval())
    torch.testing.assert_close(traced(x, y), want)
    # exported: plain ATen ops, no call into mlcomp
    ep = torch.export.export(_Wrap(op), (x, y))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert targets and all(t.startswith("aten.") for t in targets), targets
    torch.testing.assert_close(ep.module()(x, y), want)


def test_no_tiling_for_small_or_non_elementwise_bodies():
    small = fused_kernel(register_fused(chain_body(), Tiling(min_elements=1 << 20)))
    assert not small.tiled
    b = GraphBuilder("body")
    a0 = b.input("a0", (64, 64))
    s = b.call(aten("sum.dim_IntList"), b.call(aten("exp"), a0, name="v0"), [1], True, name="v1")
    reduction = fused_kernel(register_fused(b.output(s), Tiling(tile_elements=16, min_elements=16)))
    assert not reduction.tiled


class _Wrap(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.kernel = op.resolve()

    def forward(self, *xs):
        return self.kernel(*xs)


def test_kernels_pickle_by_value_and_nothing_is_registered_process_wide():
    op = register_fused(chain_body())
    again = pickle.loads(pickle.dumps(op))                    # as in a new process
    assert again == op and fused_kernel(again) is not fused_kernel(op)
    assert fused_kernel(again).body.format() == fused_kernel(op).body.format()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(again.resolve()(x, y), op.resolve()(x, y))
    import mlcomp.ir.ops as ops_module

    assert not any(isinstance(v, dict) and op.name in v for v in vars(ops_module).values())


def test_fused_graphs_lower_through_the_shared_torch_codegen():
    codegen = pytest.importorskip("mlcomp.runtime.codegen")
    torch.manual_seed(0)
    b = GraphBuilder("lower")
    x = b.input("x", (32, 64))
    w = b.param("fc.weight", torch.randn(64, 64))
    h = b.call(aten("tanh"), b.call(aten("add.Tensor"), b.call(aten("relu"), b.call(aten("mm"), x, w)), 1.0))
    graph = b.output(b.call(aten("mul.Tensor"), h, h))
    fused, report = run_pipeline(graph, "-O2", verify=True)
    assert report.stats("fuse")["groups_formed"] == 1
    inputs = (torch.randn(32, 64),)
    want = graph_value(graph, inputs)
    gm = codegen.to_fx(fused)
    torch.testing.assert_close(gm(*inputs)[0], want)
    frozen = torch.jit.freeze(torch.jit.trace(gm, inputs).eval())
    torch.testing.assert_close(frozen(*inputs)[0], want)
    ep = torch.export.export(gm, inputs)
    assert all(str(n.target).startswith("aten.") for n in ep.graph.nodes if n.op == "call_function")


def graph_value(graph: Graph, inputs):
    from mlcomp.ir.interpreter import Interpreter

    return Interpreter(graph).run(*inputs)[0]


def test_meta_inference_and_cost_see_through_kernels():
    from mlcomp.analysis.cost import node_cost
    from mlcomp.ir.meta import infer_meta

    b = GraphBuilder("body")
    a0, a1 = b.input("a0", (64, 48)), b.input("a1", (48, 32))
    op = register_fused(b.output(b.call(aten("relu"), b.call(aten("mm"), a0, a1, name="v0"), name="v1")))
    g = Graph("outer")
    g.add(Node("x", INPUT, meta=TensorMeta((64, 48), torch.float32)))
    g.add(Node("w", INPUT, meta=TensorMeta((48, 32), torch.float32)))
    node = g.add(Node("f", op, (Ref("x"), Ref("w")), meta=TensorMeta((64, 32), torch.float32)))
    g.add(Node("output", OUTPUT, inputs=((Ref("f"),),)))
    g.verify()
    assert infer_meta(g, node) == node.meta
    cost = node_cost(g, node)
    assert cost.bytes == (64 * 48 + 48 * 32 + 64 * 32) * 4          # the intermediate never reaches memory
    assert cost.flops == 2 * 64 * 48 * 32
