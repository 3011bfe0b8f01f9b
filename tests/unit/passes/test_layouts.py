"""Layout runs (``passes/layouts.py``): size-1 axes kept in the permute, ``fold_run`` on graph nodes, and the
attention at batch 1 reading its heads through the same 4-d permutes as at any other batch (decision 56)."""
from __future__ import annotations

import random
import textwrap

import torch

from mlcomp.frontend.loading import load_model
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.passes.layouts import compose, fold_run
from mlcomp.pipeline import run_pipeline
from tests.helpers.captures import captured_once
from tests.helpers.modules import small_transformer
from tests.unit.passes.test_projections import _apply, _factors

PIPELINE = "cleanup,split-projections,recompose,fuse-attention,cleanup"     # -O2's on openvino, ort, cpu


def _sizes(rng, n):
    """Factors of ``n`` with size-1 axes put in at random places."""
    dims = [d for d in _factors(rng, n) if d > 1]
    for _ in range(rng.randint(0, 2)):
        dims.insert(rng.randint(0, len(dims)), 1)
    return dims or [1]


def test_compose_with_size_one_axes_computes_what_the_steps_do():
    rng, composed_runs = random.Random(0), 0
    for _ in range(400):
        shape = [rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 5))]
        x, steps = torch.randn(shape), []
        for _ in range(rng.randint(1, 4)):
            cur = _apply(x, steps)
            steps.append(("permute", rng.sample(range(cur.dim()), cur.dim())) if rng.random() < 0.5
                         else ("reshape", _sizes(rng, cur.numel())))
        plain, kept = compose(tuple(shape), steps), compose(tuple(shape), steps, keep_ones=True)
        if plain is None:                   # an atom a later reshape cuts unevenly
            assert kept is None
            continue
        composed_runs += 1
        for composed in (plain, kept):
            assert torch.equal(_apply(x, composed), _apply(x, steps)), (shape, steps, composed)
            assert sum(kind == "permute" for kind, _ in composed) <= 1 and len(composed) <= 3
        assert len(kept) <= len(plain)
    assert composed_runs > 200


def test_a_head_split_and_merge_at_batch_1_keep_the_batch_axis_in_the_permute():
    split = [("reshape", [16, 4, 16]), ("permute", [1, 0, 2]), ("reshape", [1, 4, 16, 16])]
    assert compose((16, 64), split, keep_ones=True) == [("reshape", [1, 16, 4, 16]), ("permute", [0, 2, 1, 3])]
    assert compose((16, 64), split) == split                 # split-projections': the 3-d permute ORT fuses
    merge = [("reshape", [4, 16, 16]), ("permute", [1, 0, 2]), ("reshape", [16, 64])]
    assert compose((1, 4, 16, 16), merge, keep_ones=True) == [("permute", [0, 2, 1, 3]), ("reshape", [16, 64])]
    # the input's size-1 axis kept where its other sizes are the atoms (no reshape before the permute) ...
    assert compose((1, 4, 6), [("permute", [0, 2, 1]), ("reshape", [2, 12])], keep_ones=True) == \
        [("permute", [0, 2, 1]), ("reshape", [2, 12])]
    # ... and where neither end's other sizes are, the size-1 axes go in the reshapes
    assert compose((4, 6), [("permute", [1, 0]), ("reshape", [3, 1, 8])], keep_ones=True) == \
        [("permute", [1, 0]), ("reshape", [3, 1, 8])]


def _head_split_graph(shared: bool = False):
    b = GraphBuilder("heads")
    x = b.input("x", (16, 64))
    r = b.call(aten("reshape"), x, [16, 4, 16], name="r")
    p = b.call(aten("permute"), r, [1, 0, 2], name="p")
    u = b.call(aten("unsqueeze"), p, 0, name="u")
    return b.output(b.call(aten("mul.Tensor"), u, 2.0, name="y"), *([p] if shared else []))


def test_fold_run_writes_the_run_into_its_last_node():
    graph = _head_split_graph()
    x = torch.randn(16, 64)
    want = Interpreter(graph).run(x)[0]
    assert fold_run(graph, graph.node("u"))
    assert graph.format() == textwrap.dedent("""\
        graph heads(%x: f32[16, 64]) {
          %u_reshape: f32[1, 16, 4, 16] = aten.reshape.default(%x, [1, 16, 4, 16])
          %u: f32[1, 4, 16, 16] = aten.permute.default(%u_reshape, [0, 2, 1, 3])
          %y: f32[1, 4, 16, 16] = aten.mul.Tensor(%u, 2.0)
          return (%y,)
        }""")
    assert torch.equal(Interpreter(graph).run(x)[0], want)
    assert not fold_run(graph, graph.node("u"))            # as short as it gets: left alone


def test_fold_run_stops_at_a_value_another_node_reads():
    graph = _head_split_graph(shared=True)
    before = graph.format()
    assert not fold_run(graph, graph.node("u"))            # %p is an output too: the run is the unsqueeze alone
    assert graph.format() == before


@captured_once
def _encoder(batch: int):
    module, inputs = small_transformer(batch)
    module.eval()
    return module, *inputs, load_model(module, example_inputs=inputs).capture()


def _heads(out):
    """Per attention: (the op under each of q, k, v's permute, each permute's dims, the ops after it)."""
    found = []
    for sdpa in out.nodes(aten("scaled_dot_product_attention")):
        permutes = [out.node(ref.name) for ref in sdpa.inputs[:3]]
        (after,) = out.users(sdpa.name)
        found.append(([out.node(p.inputs[0].name).op for p in permutes],
                      [list(p.inputs[1]) if p.op == aten("permute") else p.op for p in permutes],
                      [after.op, list(after.inputs[1]), out.users(after.name)[0].op]))
    return found


def test_attention_at_batch_1_reads_its_heads_as_at_batch_2():
    module, x, graph = _encoder(1)
    out, report = run_pipeline(graph, PIPELINE, example_inputs=(x,))
    assert report.stats("fuse-attention") == {"attention_fused": 2}
    # q, k, v: reshape [1, s, h, d] of their own product, then the 4-d heads' permute; the result permuted back
    # the same way and reshaped to the out-projection's rows (before: 3-d permutes, three unsqueezes, a squeeze)
    after = [aten("permute"), [0, 2, 1, 3], aten("reshape")]
    assert _heads(out) == [([aten("reshape")] * 3, [[0, 2, 1, 3]] * 3, after)] * 2
    assert {n.op for n in out.call_nodes()}.isdisjoint({aten("unsqueeze"), aten("squeeze.dims")})
    for sdpa in out.nodes(aten("scaled_dot_product_attention")):
        assert [list(out.node(out.node(r.name).inputs[0].name).meta.shape) for r in sdpa.inputs[:3]] == \
            [[1, 16, 4, 16]] * 3
    with torch.no_grad():
        torch.testing.assert_close(Interpreter(out).run(x)[0], module(x), rtol=1e-5, atol=1e-5)
    _, x2, graph2 = _encoder(2)                            # the same layout around attention as at batch 2
    assert _heads(run_pipeline(graph2, PIPELINE, example_inputs=(x2,))[0]) == _heads(out)
