"""The graph's incremental order and users index: they hold under any edit sequence and scale.

The order is a linked list with order labels (``mlcomp.ir.order``); these tests
check it against brute-force recomputations (users from the nodes' inputs, a
lexicographic topological sort keyed by insertion) and count the work of big
edits in node visits, never in seconds.
"""
from __future__ import annotations

import dataclasses
import random

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlcomp.base.errors import IRError
from mlcomp.ir import Graph, Node, Ref, TensorMeta, ops
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.order import NodeOrder
from mlcomp.passes.cleanup.cleanup import Cleanup
from mlcomp.pipeline.pass_base import PassContext

F32 = torch.float32
META = TensorMeta((4,), F32)
RELU, ADD, NEG = ops.aten("relu"), ops.aten("add.Tensor"), ops.aten("neg")


def chain(n: int) -> Graph:
    g = Graph("chain")
    g.add(Node("x", ops.INPUT, meta=META))
    prev = "x"
    for i in range(n):
        g.add(Node(f"r{i}", RELU, (Ref(prev),), meta=META))
        prev = f"r{i}"
    g.add(Node("output", ops.OUTPUT, ((Ref(prev),),)))
    return g


def brute_users(g: Graph) -> dict[str, list[str]]:
    """Users of every node recomputed from the inputs alone, in topological order."""
    order = g.order()
    pos = {n: i for i, n in enumerate(order)}
    users: dict[str, set[str]] = {n: set() for n in order}
    for n in order:
        for src in g.node(n).input_names():
            users[src].add(n)
    return {n: sorted(u, key=pos.__getitem__) for n, u in users.items()}


def assert_consistent(g: Graph) -> None:
    order = g.order()
    assert sorted(order) == sorted(n.name for n in g.nodes()) and len(order) == len(g)
    pos = {n: i for i, n in enumerate(order)}
    for n in order:                              # a valid topological order
        assert all(pos[s] < pos[n] for s in g.node(n).input_names()), n
    assert {n: [u.name for u in g.users(n)] for n in order} == brute_users(g)
    for a, b in zip(order, order[1:]):
        assert g.precedes(a, b) and not g.precedes(b, a)
    g.verify(check_meta=False)


# -- the order list itself ------------------------------------------------------


def test_ten_thousand_insertions_before_one_node_keep_their_order():
    g = chain(3)
    for i in range(10_000):
        g.add(Node(f"n{i}", NEG, (Ref("x"),), meta=META), before="r1")
    order = g.order()
    assert order[:2] == ["x", "r0"] and order[-3:] == ["r1", "r2", "output"]
    assert order[2:-3] == [f"n{i}" for i in range(10_000)]      # each sits right before r1
    assert g._order.relabelled < 40 * 10_000                     # O(log n) label writes each


def test_insertions_alternating_ends_stay_ordered():
    order = NodeOrder()
    order.append("a")
    order.append("z")
    expect = ["a", "z"]
    for i in range(3000):                         # always squeeze in right after "a" or before "z"
        name = f"m{i}"
        if i % 2:
            order.insert_before(name, "z")
            expect.insert(len(expect) - 1, name)
        else:
            order.insert_before(name, expect[1])
            expect.insert(1, name)
    assert list(order) == expect
    labels = [order.label(n) for n in expect]
    assert labels == sorted(labels) and len(set(labels)) == len(labels)


def test_insert_before_reading_a_later_value_sinks_below_it():
    g = chain(3)                                   # x r0 r1 r2 output
    g.add(Node("late", ADD, (Ref("r2"), Ref("x")), meta=META), before="r0")
    g.replace(g.node("output").with_(inputs=((Ref("late"),),)))
    assert g.order() == ["x", "r0", "r1", "r2", "late", "output"]
    assert_consistent(g)


def test_replace_reading_a_later_value_moves_the_reader_and_its_users():
    g = Graph("branches")
    g.add(Node("x", ops.INPUT, meta=META))
    g.add(Node("a", RELU, (Ref("x"),), meta=META))
    g.add(Node("b", NEG, (Ref("a"),), meta=META))
    g.add(Node("c", RELU, (Ref("x"),), meta=META))
    g.add(Node("d", ADD, (Ref("b"), Ref("c")), meta=META))
    g.add(Node("output", ops.OUTPUT, ((Ref("d"),),)))
    g.replace(g.node("a").with_(inputs=(Ref("c"),)))       # a now reads c, which sits after b
    assert g.order() == ["x", "c", "a", "b", "d", "output"]
    # the same as a full lexicographic topological sort keyed by the previous order
    before = {n: i for i, n in enumerate(["x", "a", "b", "c", "d", "output"])}
    full = nx.DiGraph([(s, n) for n in before for s in g.node(n).input_names()])
    assert list(nx.lexicographical_topological_sort(full, key=before.__getitem__)) == g.order()
    assert_consistent(g)


def test_cycle_is_reported_and_stays_reported():
    g = chain(3)
    g.replace(dataclasses.replace(g.node("r0"), inputs=(Ref("r2"),)))
    for _ in range(2):
        with pytest.raises(IRError, match="cycle: .*%r"):
            g.order()


def test_fresh_name_reuses_the_smallest_free_suffix():
    g = chain(0)
    names = []
    for _ in range(5):
        names.append(g.fresh_name("x"))
        g.add(Node(names[-1], RELU, (Ref("x"),), meta=META))
    assert names == ["x_1", "x_2", "x_3", "x_4", "x_5"]
    g.erase("x_2")
    assert g.fresh_name("x") == "x_2"


def test_add_constant_goes_before_the_first_compute_node():
    g = chain(2)
    g.add_constant("w", torch.ones(4))
    assert g.order()[:3] == ["x", "w", "r0"]
    g.add(Node("early", NEG, (Ref("x"),), meta=META), before="w")
    g.add_constant("v", torch.ones(4))
    assert g.order()[:5] == ["x", "v", "early", "w", "r0"]


# -- random edit sequences against brute force --------------------------------

EDITS = st.lists(st.tuples(st.sampled_from(["add", "add_before", "rewire", "forward", "erase"]),
                           st.integers(0, 10_000), st.integers(0, 10_000)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(EDITS)
def test_users_index_and_order_match_brute_force_after_random_edits(edits):
    g = chain(4)
    count = 0
    for kind, i, j in edits:
        values = [n for n in g.order() if n != "output"]
        a, b = values[i % len(values)], values[j % len(values)]
        if kind in ("add", "add_before"):
            count += 1
            anchor = b if kind == "add_before" and b != "x" else None
            g.add(Node(f"n{count}", ADD, (Ref(a), Ref(values[(i + j) % len(values)])), meta=META), before=anchor)
        elif kind == "rewire" and a != "x" and b not in descendants(g, a) and a != b:
            node = g.node(a)
            g.replace(node.with_(inputs=(Ref(b),) + tuple(node.inputs[1:])))
        elif kind == "forward" and a != "x" and a != b and b not in descendants(g, a):
            g.replace_all_uses(a, b)
        elif kind == "erase" and a != "x" and not g.users(a):
            g.erase(a)
        assert_consistent(g)


def descendants(g: Graph, name: str) -> set[str]:
    seen, stack = {name}, [name]
    while stack:
        for u in g.users(stack.pop()):
            if u.name not in seen:
                seen.add(u.name)
                stack.append(u.name)
    return seen


def test_copy_is_independent():
    g = chain(3)
    h = g.copy()
    h.add(Node("extra", NEG, (Ref("r0"),), meta=META), before="r1")
    assert "extra" not in g and [u.name for u in g.users("r0")] == ["r1"]
    assert [u.name for u in h.users("r0")] == ["extra", "r1"]
    assert_consistent(g)
    assert_consistent(h)


# -- scale: count node visits, not seconds -------------------------------------


class CountingGraph(Graph):
    """A Graph that counts the nodes its queries hand out (node visits)."""

    visits = 0

    def node(self, name):
        self.visits += 1
        return super().node(name)

    def nodes(self, op=None):
        out = super().nodes(op)
        self.visits += len(out)
        return out

    def order(self):
        out = super().order()
        self.visits += len(out)
        return out

    def users(self, name):
        out = super().users(name)
        self.visits += len(out) + 1
        return out


def residual_blocks(blocks: int) -> Graph:
    """``blocks`` of relu -> permute pair -> mul by one -> add, plus dead and duplicate nodes."""
    b = GraphBuilder("scale")
    b.graph = CountingGraph("scale")
    x = b.input("x", (2, 8))
    for i in range(blocks):
        y = b.call(ops.aten("relu"), x)
        t = b.call(ops.aten("permute"), b.call(ops.aten("permute"), y, [1, 0]), [1, 0])   # cancels
        u = b.call(ops.aten("mul.Tensor"), t, 1.0)                                         # identity
        b.call(ops.aten("neg"), y)                                                         # dead
        d = b.call(ops.aten("relu"), x)                                                    # duplicate of y
        x = b.call(ops.aten("add.Tensor"), u, d)
    return b.output(x)


def test_ten_thousand_node_graph_builds_and_cleans_up_in_linear_node_visits():
    small, big = residual_blocks(150), residual_blocks(1500)
    assert len(big) > 10_000
    visits = {}
    for g in (small, big):
        built = g.visits + g._order.relabelled
        result = Cleanup().run(g, PassContext())
        g = result.graph
        assert result.changed and result.stats["nodes_merged"] == blocks_of(g)
        visits[len(g)] = (built, g.visits + g._order.relabelled - built)
        assert [n.op.name for n in g.call_nodes()[:2]] == ["relu", "add"]   # permutes, mul, neg, dup gone
    (n_small, (build_s, clean_s)), (n_big, (build_b, clean_b)) = sorted(visits.items())
    assert n_big == 10 * n_small - 9 * 2             # x + output are not per block
    # linear: ten times the nodes costs at most ~12 times the visits (no n^2 term)
    assert build_b <= 12 * build_s and clean_b <= 12 * clean_s
    assert clean_b < 200 * n_big


def blocks_of(g: Graph) -> int:
    return (len(g) - 2) // 2


def test_ordered_big_graph_keeps_users_index_exact():
    g = residual_blocks(200)
    rng = random.Random(0)
    names = [n for n in g.order() if g.node(n).op.name == "relu"]
    for name in rng.sample(names, 50):              # forward some relus to the input
        g.replace_all_uses(name, "x")
    assert_consistent(g)
