"""Cleanup passes (dce, cse, simplify, fold-constants, cleanup): golden IR, stats, edge cases.

Numerical agreement on the zoo is in test_passes_zoo.py.  Every run goes
through ``run_pipeline(..., verify=True)``: the IR verifier and the interpreter
check each pass.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from mlcomp.ir import Mode, TensorMeta
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.ops import Namespace, Op, aten
from mlcomp.pipeline import run_pipeline


def run(graph, spec, verify=True):
    out, report = run_pipeline(graph, spec, verify=verify)
    return out, report.records[0].stats


def golden(text: str) -> str:
    return textwrap.dedent(text).strip()


# ---------------------------------------------------------------------------
# dce / cse


def test_dce_removes_dead_chains_and_unused_params():
    b = GraphBuilder("dce")
    x = b.input("x", (2, 3))
    b.param("unused.weight", torch.ones(3))
    b.call(aten("neg"), b.call(aten("exp"), x))
    graph = b.output(b.call(aten("relu"), x))
    out, stats = run(graph, "dce")
    assert out.format() == golden("""
        graph dce(%x: f32[2, 3]) {
          %relu: f32[2, 3] = aten.relu.default(%x)
          return (%relu,)
        }""")
    assert stats == {"nodes_removed": 2, "params_removed": 1, "param_bytes_removed": 12}
    kept, stats = run(graph, "dce{keep_params=true}")
    assert "unused.weight" in kept and stats["params_removed"] == 0


def test_dce_keeps_side_effects_and_inputs():
    b = GraphBuilder("effects")
    x = b.input("x", (3,))
    b.input("unused", (3,))
    b.call(aten("_assert_async.msg"), b.call(aten("any"), x), "boom", meta=TensorMeta((), torch.bool))
    graph = b.output(b.call(aten("relu"), x))
    out, stats = run(graph, "dce")
    assert "unused" in out and "_assert_async" in out.format() and stats["nodes_removed"] == 0


def test_cse_merges_equal_pure_nodes_only():
    b = GraphBuilder("cse")
    x = b.input("x", (2, 3))
    a1 = b.call(aten("mul.Tensor"), x, 2.0)
    a2 = b.call(aten("mul.Tensor"), x, 2.0)
    a3 = b.call(aten("mul.Tensor"), x, 2)              # an int literal is a different op argument
    r1 = b.call(aten("rand_like"), x)
    r2 = b.call(aten("rand_like"), x)                  # random: never merged
    s = b.call(aten("add.Tensor"), b.call(aten("add.Tensor"), a1, a2), a3)
    graph = b.output(b.call(aten("add.Tensor"), s, b.call(aten("sub.Tensor"), r1, r2)))
    out, stats = run(graph.copy(), "cse", verify=False)        # random values: nothing to compare
    assert stats == {"nodes_merged": 1}
    assert out.format() == golden("""
        graph cse(%x: f32[2, 3]) {
          %mul: f32[2, 3] = aten.mul.Tensor(%x, 2.0)
          %mul_2: f32[2, 3] = aten.mul.Tensor(%x, 2)
          %rand_like: f32[2, 3] = aten.rand_like.default(%x)
          %rand_like_1: f32[2, 3] = aten.rand_like.default(%x)
          %add: f32[2, 3] = aten.add.Tensor(%mul, %mul)
          %add_1: f32[2, 3] = aten.add.Tensor(%add, %mul_2)
          %sub: f32[2, 3] = aten.sub.Tensor(%rand_like, %rand_like_1)
          %add_2: f32[2, 3] = aten.add.Tensor(%add_1, %sub)
          return (%add_2,)
        }""")


# ---------------------------------------------------------------------------
# simplify


def noop_chain():
    b = GraphBuilder("simplify")
    x = b.input("x", (4, 8))
    v = b.call(aten("view"), x, [4, 8])                               # same shape
    p2 = b.call(aten("permute"), b.call(aten("permute"), v, [1, 0]), [1, 0])   # cancelling pair
    c = b.call(aten("_to_copy"), p2, dtype=torch.float32)            # cast to the same dtype
    d = b.call(aten("alias"), b.call(aten("detach"), b.call(aten("clone"), c)))
    r2 = b.call(aten("view"), b.call(aten("view"), d, [2, 16]), [32])   # reshape chain
    e = b.call(aten("expand"), r2, [32])                             # identity expand
    down = b.call(aten("_to_copy"), b.call(aten("_to_copy"), e, dtype=torch.float64), dtype=torch.float32)
    a = b.call(aten("add.Tensor"), b.call(aten("mul.Tensor"), down, 1), 0.0)
    sq = b.call(aten("squeeze.dims"), b.call(aten("unsqueeze"), a, 0), [0])
    dr = b.call(aten("dropout"), sq, 0.1, False)
    sl = b.call(aten("slice.Tensor"), dr, 0, 0, 9223372036854775807)
    tr = b.call(aten("transpose.int"), b.call(aten("t"), b.call(aten("view"), sl, [4, 8])), 0, 1)
    return b.output(b.call(aten("relu"), tr))


def test_simplify_removes_every_kind_of_noop():
    graph = noop_chain()
    assert len(graph) == 24
    out, stats = run(graph, "simplify")
    assert out.format() == golden("""
        graph simplify(%x: f32[4, 8]) {
          %relu: f32[4, 8] = aten.relu.default(%x)
          return (%relu,)
        }""")
    assert stats == {"reshapes_removed": 7, "transposes_removed": 2, "casts_removed": 2, "copies_removed": 3,
                     "arithmetic_removed": 2, "dropouts_removed": 1, "slices_removed": 1}


def test_removing_a_clone_turns_the_views_it_enabled_into_reshapes():
    b = GraphBuilder("clone_view")
    x = b.input("x", (4, 8))
    c = b.call(aten("clone"), b.call(aten("permute"), x, [1, 0]), memory_format=torch.contiguous_format)
    graph = b.output(b.call(aten("view"), c, [32]))
    out, stats = run(graph, "simplify")
    assert out.format() == golden("""
        graph clone_view(%x: f32[4, 8]) {
          %permute: f32[8, 4] = aten.permute.default(%x, [1, 0])
          %view: f32[32] = aten.reshape.default(%permute, [32])
          return (%view,)
        }""")
    assert stats == {"copies_removed": 1}


def test_permute_pairs_compose_and_views_merge():
    b = GraphBuilder("compose")
    x = b.input("x", (2, 3, 4))
    p = b.call(aten("permute"), b.call(aten("permute"), x, [1, 0, 2]), [0, 2, 1])
    r = b.call(aten("view"), b.call(aten("reshape"), p, [3, 8]), [24])
    graph = b.output(r)
    out, stats = run(graph, "simplify")
    assert out.format() == golden("""
        graph compose(%x: f32[2, 3, 4]) {
          %permute_1: f32[3, 4, 2] = aten.permute.default(%x, [1, 2, 0])
          %view: f32[24] = aten.reshape.default(%permute_1, [24])
          return (%view,)
        }""")
    assert stats == {"transposes_removed": 1, "reshapes_removed": 1}


@pytest.mark.parametrize("path, kept", [
    ((torch.float16, torch.float32, torch.float16), 0),     # exact round trip: both casts go
    ((torch.float16, torch.float32, torch.bfloat16), 1),    # exact widening then narrowing: one cast
    ((torch.float32, torch.float16, torch.float32), 2),     # rounding in the middle: both stay
])
def test_cast_pairs(path, kept):
    src, mid, dst = path
    b = GraphBuilder("casts")
    x = b.input("x", (8,), src)
    y = b.call(aten("_to_copy"), b.call(aten("_to_copy"), x, dtype=mid), dtype=dst)
    out, _ = run(b.output(b.call(aten("neg"), y)), "simplify")
    casts = [n for n in out.call_nodes() if n.op == aten("_to_copy")]
    assert len(casts) == kept
    if kept == 1:
        assert casts[0].input_names() == ["x"] and casts[0].attrs["dtype"] == dst


def test_training_graphs_keep_detach_clone_and_dropout():
    b = GraphBuilder("train", mode=Mode.TRAINING)
    x = b.input("x", (4,))
    y = b.call(aten("dropout"), b.call(aten("clone"), b.call(aten("detach"), x)), 0.5, True)
    graph = b.output(b.call(aten("alias"), y))
    out, stats = run(graph, "simplify", verify=False)         # dropout in training: random
    assert [n.op.name for n in out.call_nodes()] == ["detach", "clone", "dropout"]
    assert stats == {"copies_removed": 1}                    # only the alias


def test_arithmetic_identity_needs_the_same_dtype():
    b = GraphBuilder("arith")
    x = b.input("x", (4,), torch.int64)
    graph = b.output(b.call(aten("mul.Tensor"), x, 1.0))      # int * 1.0 is a float tensor: kept
    out, stats = run(graph, "simplify")
    assert "mul" in out and not stats


# ---------------------------------------------------------------------------
# fold-constants


def folding_graph():
    torch.manual_seed(0)
    b = GraphBuilder("fold")
    x = b.input("x", (2, 4))
    w, bias = b.param("fc.weight", torch.randn(3, 4)), b.param("fc.bias", torch.randn(3))
    s = b.call(aten("mul.Tensor"), b.call(aten("permute"), w, [1, 0], origin="fc"), 0.5, origin="fc")
    y = b.call(aten("addmm"), bias, x, s, origin="fc")
    rows = b.call(Op(Namespace.OPERATOR, "mul"), b.call(Op(Namespace.ATEN, "sym_size", "int"), y, 0), 3)
    v = b.call(aten("view"), y, [rows, 1], meta=TensorMeta((6, 1), torch.float32))
    z = b.call(aten("full"), [6, 1], 1.0, dtype=torch.float32)
    return b.output(b.call(aten("add.Tensor"), v, z))


def test_fold_constants_params_shapes_and_literals():
    out, stats = run(folding_graph(), "fold-constants")
    assert out.format() == golden("""
        graph fold(%x: f32[2, 4]) {
          %fc.bias: f32[3] = param   # fc
          %mul: f32[4, 3] = param   # fc
          %full: f32[6, 1] = param
          %addmm: f32[2, 3] = aten.addmm.default(%fc.bias, %x, %mul)   # fc
          %view: f32[6, 1] = aten.view.default(%addmm, [6, 1])
          %add: f32[6, 1] = aten.add.Tensor(%view, %full)
          return (%add,)
        }""")
    assert stats == {"nodes_folded": 3, "constants_created": 2, "literals_inlined": 1}
    w = folding_graph().constants["fc.weight"]
    torch.testing.assert_close(out.constants["mul"], w.t() * 0.5)
    assert out.constants["mul"].is_contiguous()


def test_fold_constants_leaves_trainable_params_alone():
    b = GraphBuilder("train", mode=Mode.TRAINING)
    x = b.input("x", (2, 4))
    w = b.param("fc.weight", torch.randn(3, 4).requires_grad_())
    graph = b.output(b.call(aten("mm"), x, b.call(aten("permute"), w, [1, 0])))
    out, stats = run(graph, "fold-constants")
    assert out.format() == graph.format() and stats["nodes_folded"] == 0


def test_fold_constants_size_guard():
    b = GraphBuilder("big")
    x = b.input("x", (512, 1024))
    e = b.call(aten("repeat"), b.param("w", torch.randn(1, 1024)), [512, 1])
    graph = b.output(b.call(aten("add.Tensor"), x, e))
    out, stats = run(graph, "fold-constants{max_bytes=1024}")
    assert "repeat" in out and stats["nodes_folded"] == 0      # 2 MiB from 4 KiB: not materialised
    out, stats = run(graph, "fold-constants{max_bytes=4194304}")
    assert "repeat" in out.constants and stats["constants_created"] == 1


def test_fold_constants_keeps_broadcasts_as_views():
    """An expand to more elements never folds, whatever max_bytes; what reads it stays; a same-size one folds."""
    b = GraphBuilder("bcast")
    x = b.input("x", (4, 3, 8))
    w = b.call(aten("permute"), b.param("w", torch.randn(5, 8)), [1, 0])
    wide = b.call(aten("expand"), w, [4, 8, 5])
    same = b.call(aten("expand"), b.param("b", torch.randn(1, 5)), [1, 5])
    graph = b.output(b.call(aten("add.Tensor"), b.call(aten("bmm"), x, wide), same))
    out, stats = run(graph, "fold-constants{max_bytes=4194304}")
    assert out.node("expand").op == aten("expand") and tuple(out.constants["permute"].shape) == (8, 5)
    assert "expand_1" in out.constants and stats["constants_created"] == 2


# ---------------------------------------------------------------------------
# cleanup


def test_cleanup_reaches_a_fixed_point_and_sums_stats():
    graph = noop_chain()
    b_out, stats = run(graph, "cleanup")
    assert len(b_out) == 3 and stats["rounds"] == 2 and stats["reshapes_removed"] == 7
    out, stats = run(folding_graph(), "cleanup")
    assert [n.op.name for n in out.call_nodes()] == ["addmm", "view", "add"]
    assert stats["constants_created"] == 2 and stats["rounds"] == 2
    again, stats = run(out, "cleanup")
    assert again.format() == out.format() and stats == {"rounds": 1}


def test_cleanup_without_folding():
    out, stats = run(folding_graph(), "cleanup{fold=false}")
    assert "fc.weight" in out and "constants_created" not in stats
