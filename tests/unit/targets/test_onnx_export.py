"""The onnxruntime target's fast export path (issue 14): same ONNX graph as torch.onnx, fallback recorded.

The direct path (:mod:`mlcomp.targets.onnx.export`) must give what
``torch.onnx.export(dynamo=True)`` gives: the same op-type histogram, nodes
(with their value names), inputs, initializers and numbers; the name-only
support check must agree with torch.onnx's full torchlib registry.
"""
from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch
from mlcomp.targets import CompileOptions
from mlcomp.targets.onnx import export as onnx_export
from mlcomp.targets.onnx import torchlib
from mlcomp.runtime.artifact import Artifact
from mlcomp.runtime.codegen import to_fx
from mlcomp.targets.onnx.export import DIRECT, PUBLIC, export_model
from mlcomp.targets.onnx.torchlib import translatable
from mlcomp.targets.onnx.patterns import ort_friendly
from mlcomp.targets.onnx.target import OnnxRuntimeTarget
from torch import fx

from mlcomp.base.quiet import quiet_converter
from mlcomp.ir.ops import Namespace

pytestmark = pytest.mark.ort


def _histogram(proto) -> Counter:
    return Counter(n.op_type for n in proto.graph.node)


def _nodes(proto) -> list[tuple]:
    return [(n.op_type, list(n.input), list(n.output)) for n in proto.graph.node]


def _run(proto, inputs):
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in session.run(None, feed)]


def _module(graph, inputs):
    friendly, _ = ort_friendly(graph, inputs)
    return to_fx(friendly).eval()


# the ATen op kinds of the -O2 graphs of resnet18, mobilenet, transformer and gru (besides lenet's, captured)
ZOO_OPS = ("_native_batch_norm_legit_no_training.default", "_softmax.default", "add.Tensor", "addmm.default",
           "any.dim", "bmm.default", "convolution.default", "eq.Scalar", "full_like.default", "hardtanh.default",
           "logical_not.default", "mean.dim", "mul.Scalar", "mul.Tensor", "native_layer_norm.default",
           "permute.default", "relu.default", "reshape.default", "select.int", "sigmoid.default",
           "split_with_sizes.default", "squeeze.dims", "sub.Tensor", "tanh.default", "view.default",
           "where.self", "gru.input", "kthvalue.default", "sym_size.int")


def _aten(qualified: str):
    name, overload = qualified.split(".")
    return getattr(getattr(torch.ops.aten, name), overload)


def test_name_only_support_check_agrees_with_the_torchlib_registry(captured):
    """Every op torch decomposes, the zoo's op kinds and the symbolic-size operators: ``translatable``
    (names only) says what ``ONNXRegistry.from_torchlib().is_registered`` says."""
    from torch.onnx._internal.exporter import _registration

    ops = {op for op in (*torch._decomp.decomposition_table, *torch.export.default_decompositions().keys())
           if isinstance(op, torch._ops.OpOverload)}
    ops |= {n.op.resolve() for n in captured("lenet")[2].call_nodes() if n.op.namespace is Namespace.ATEN}
    ops |= {_aten(q) for q in ZOO_OPS} | {operator.mul, operator.floordiv, operator.sub}
    with quiet_converter():
        registry = _registration.ONNXRegistry.from_torchlib()
    disagree = {str(op): translatable(op) for op in ops if translatable(op) != registry.is_registered(op)}
    assert not disagree
    assert translatable(torch.ops.aten.addmm.default) and not translatable(torch.ops.aten.kthvalue.default)
    assert not translatable(torch.ops.aten.squeeze.dims)       # torch.onnx decomposes it; so does the direct path
    assert len(ops) > 1000


@pytest.fixture(scope="module")
def both_paths(captured):
    """mlp and lenet exported by the direct path and by torch.onnx: name -> (inputs, eager, protos, records)."""
    out = {}
    for name in ("mlp", "lenet"):
        module, inputs, graph = captured(name)
        gm = _module(graph, inputs)
        with quiet_converter():
            direct, direct_rec = export_model(gm, inputs)
            public, public_rec = export_model(gm, inputs, direct=False)
        with torch.no_grad():
            eager = module(*inputs)
        out[name] = (inputs, eager, (direct, public), (direct_rec, public_rec))
    return out


@pytest.mark.parametrize("name", ["mlp", "lenet"])
def test_direct_graph_equals_the_torch_onnx_graph(both_paths, name):
    inputs, eager, (direct, public), (direct_rec, public_rec) = both_paths[name]
    assert direct_rec.path == DIRECT and public_rec.path == PUBLIC
    assert _histogram(direct) == _histogram(public)
    assert sum(_histogram(direct).values()) > 0
    assert _nodes(direct) == _nodes(public)          # value names too: ONNX nodes named as torch.onnx names them
    assert [i.name for i in direct.graph.input] == [i.name for i in public.graph.input]
    assert sorted(i.name for i in direct.graph.initializer) == sorted(i.name for i in public.graph.initializer)
    assert [o.version for o in direct.opset_import if o.domain == ""] == \
        [o.version for o in public.opset_import if o.domain == ""]
    (ours,), (theirs,) = _run(direct, inputs), _run(public, inputs)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-5)


OFF = "it was turned off (emit=False)"     # mlcomp's emitter (tests/unit/targets/test_onnx_emit.py) not asked


@pytest.mark.parametrize("name", ["mlp", "lenet"])
def test_the_target_takes_the_direct_path_and_says_so(captured, name, tmp_path):
    """Where mlcomp's emitter does not run, the direct path exports; the record says both."""
    module, inputs, graph = captured(name)
    art = OnnxRuntimeTarget(emit=False).compile(graph, CompileOptions())
    assert art.runtime.stats == {"onnx_export": "direct", "onnx_emitter_declined": OFF}
    assert art.runtime.explain_lines() == [onnx_export.ExportRecord(DIRECT, declined=OFF).line()]
    assert art.runtime.explain_lines()[0].startswith("ONNX export: direct (ExportedProgram built from the IR")
    with torch.no_grad():
        torch.testing.assert_close(art(*inputs), module(*inputs), rtol=1e-4, atol=1e-5)
    again = Artifact.load(art.save(tmp_path / name))
    assert again.runtime.stats == {"onnx_export": "direct", "onnx_emitter_declined": OFF}


def test_a_failing_direct_path_falls_back_and_records_why(captured):
    """A module the direct path refuses (a tensor literal argument, which torch.export would lift):
    torch.onnx exports it, and the record says why."""
    _, (x,), _ = captured("mlp")
    g = fx.Graph()
    inp = g.placeholder("x")
    g.output((g.call_function(torch.ops.aten.add.Tensor, (inp, torch.ones(x.shape[-1]))),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    with quiet_converter():
        proto, record = export_model(gm, (x,))
    assert record.path == PUBLIC
    assert "direct path failed (TypeError: add_tensor has a tensor literal argument" in record.reason
    assert "because the direct path failed" in record.line()
    (out,) = _run(proto, (x,))
    torch.testing.assert_close(out, x + 1)


def test_missing_private_api_falls_back_in_the_target(captured, monkeypatch):
    """A torch without one of the pinned private names: the target exports with torch.onnx, still verified."""
    module, inputs, graph = captured("mlp")
    missing = ("torch.onnx._internal.exporter._core", "_no_such_function")
    monkeypatch.setattr(torchlib, "PINNED", (*torchlib.PINNED, missing))
    art = OnnxRuntimeTarget(emit=False).compile(graph, CompileOptions())
    assert art.runtime.stats["onnx_export"] == PUBLIC
    assert art.runtime.stats["onnx_export_reason"] == \
        "this torch/onnxscript has no torch.onnx._internal.exporter._core._no_such_function"
    assert "torch.onnx.export(dynamo=True), because this torch/onnxscript has no" in art.runtime.explain_lines()[0]
    with torch.no_grad():
        torch.testing.assert_close(art(*inputs), module(*inputs), rtol=1e-4, atol=1e-5)


def test_every_emitter_op_is_also_translatable_by_torchlib():
    """``explain_op`` answers from mlcomp's emitter first; where the emitter then declines a graph (a symbolic
    size, bf16, an argument it does not match) torchlib must still translate the op, or torch decompose it."""
    from torch._decomp import decomposition_table

    from mlcomp.ir.quant import is_qdq
    from mlcomp.targets.onnx.emit import RULES

    # int8 pairs have no torch fallback by design: the target refuses a declined graph that carries them
    # (test_quantize.py) rather than run it in float
    missing = [str(op) for op in RULES if not translatable(op.resolve()) and op.resolve() not in decomposition_table
               and not is_qdq(op)]
    assert not missing
