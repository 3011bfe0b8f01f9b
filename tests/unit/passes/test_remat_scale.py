"""remat on long graphs: one liveness per plan scored, the graph's own facts read once, the same rewrites.

A chain joint graph is built node by node (no capture): ``n`` forward ``tanh``
layers whose values the backward reads in reverse, as a deep network's saved
activations are read::

    %a1 = tanh(%x) {forward}  ...  %an = tanh(%a(n-1)) {forward};  %loss = sum(%an) {loss}
    %bn = mul(%an, %an) {backward}  ...  %b1 = mul(%b2, %a1) {backward};  return (%loss, %b1)

Every forward value is a saved activation, so the pool has plans to compare and
the lowest peak needs recomputation.  The pass scores a bounded number of plans,
each one liveness pass over its rewritten copy, so its cost is linear in the
graph's size; counted here, never timed.
"""
from __future__ import annotations

import pytest
import torch

import mlcomp.analysis.step_peak as step_peak
import mlcomp.passes.remat.remat as remat_mod
from mlcomp.ir import Graph, Mode, Node, Ref, TensorMeta
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.node import Annotations, Phase
from mlcomp.ir.ops import INPUT, OUTPUT, aten
from mlcomp.passes.remat.pool import pool
from mlcomp.passes.remat.remat import Rewriter, build_problem, rewrite
from mlcomp.passes.remat.solvers import Solver
from mlcomp.pipeline import run_pipeline

META = TensorMeta((32, 32), torch.float32)


def chain(n: int) -> Graph:
    """The chain joint graph above with ``n`` forward layers (2n + 3 nodes)."""
    g = Graph(f"chain{n}", mode=Mode.TRAINING)
    g.add(Node("x", INPUT, meta=META))
    ann = {p: Annotations(phase=p) for p in Phase}
    prev = "x"
    for i in range(1, n + 1):
        g.add(Node(f"a{i}", aten("tanh"), (Ref(prev),), meta=META, ann=ann[Phase.FORWARD]))
        prev = f"a{i}"
    g.add(Node("loss", aten("sum"), (Ref(prev),), meta=TensorMeta((), torch.float32), ann=ann[Phase.LOSS]))
    grad = prev
    for i in range(n, 0, -1):
        g.add(Node(f"b{i}", aten("mul", "Tensor"), (Ref(grad), Ref(f"a{i}")), meta=META, ann=ann[Phase.BACKWARD]))
        grad = f"b{i}"
    g.add(Node("output", OUTPUT, ((Ref("loss"), Ref(grad)),)))
    return g


@pytest.fixture
def counted(monkeypatch):
    """Counts of ``liveness`` (through step_memory) and ``storage_roots`` (through the rewriter) calls."""
    calls = {"liveness": 0, "storage_roots": 0}

    def counting(module, name):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counting(step_peak, "liveness")
    counting(remat_mod, "storage_roots")
    return calls


def test_one_liveness_per_plan_scored_and_the_graphs_facts_found_once(counted):
    graph = chain(30)
    after, report = run_pipeline(graph, "remat{budget=0}")
    stats = report.records[0].stats
    assert counted["liveness"] == stats["plans_compared"] > 3      # one per plan, none for the graph itself twice
    assert counted["storage_roots"] == 1                          # the Rewriter's, for every plan
    assert stats["peak_after_bytes"] < stats["peak_before_bytes"] and stats["nodes_recomputed"] > 0
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    (l0, g0), (l1, g1) = Interpreter(graph).run(x), Interpreter(after).run(x)
    assert torch.equal(l0, l1) and torch.equal(g0, g1)          # recomputed values are the same numbers


def test_a_rewriter_built_once_rewrites_every_plan_as_rewrite_does():
    graph = chain(40)
    problem = build_problem(graph)
    plans = [p for p in pool(problem, Solver.KNAPSACK, None) if p.recompute]
    assert len(plans) >= 2
    once = Rewriter(graph)
    for plan in plans:
        a, b = graph.copy(), graph.copy()
        assert once(a, problem, plan) == rewrite(b, problem, plan) > 0
        assert a.format() == b.format()
    assert graph.format() == chain(40).format()                  # the graph itself is untouched


@pytest.mark.slow    # ~10k nodes; the counts are checked in the fast suite on 63 nodes (the test above it)
def test_ten_thousand_nodes_one_liveness_per_plan(counted):
    graph = chain(5000)
    assert len(graph) > 10_000
    _, report = run_pipeline(graph, "remat{budget=0}")
    stats = report.records[0].stats
    assert counted["liveness"] == stats["plans_compared"] and counted["storage_roots"] == 1
    assert stats["peak_after_bytes"] < stats["peak_before_bytes"]
