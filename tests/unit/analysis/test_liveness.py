"""mlcomp.analysis.liveness: liveness and peak on hand-built graphs, and against the interpreter.

Sizes are f32 unless said otherwise: a [256] tensor is 1 KiB.
"""
from __future__ import annotations

import weakref

import pytest
import torch

from mlcomp.analysis.liveness import (
    buffers,
    live_bytes_per_node,
    liveness,
    peak_bytes,
    storage_roots,
)
from mlcomp.base.errors import IRError
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM, aten

KB = 1024


def chain():
    """x → a=relu → b=exp → c=neg → out: at most two 1 KiB buffers at once."""
    b = GraphBuilder("chain")
    x = b.input("x", (256,))
    return b.output(b.call(aten("neg"), b.call(aten("exp"), b.call(aten("relu"), x))))


def test_chain_frees_each_value_after_its_last_use():
    g = chain()
    live = liveness(g)
    assert [names for names in live.schedule] == [("x",), ("relu",), ("exp",), ("neg",), ("output",)]
    assert live.live_bytes == (0, KB, 2 * KB, 2 * KB, KB)
    assert live.peak_bytes == 2 * KB == peak_bytes(g)
    assert live.live_at(2) == {"relu", "exp"} and live.live_at(3) == {"exp", "neg"}
    assert live.interval("relu") == (1, 2) and live.interval("neg") == (3, 4)   # output: to the end
    assert live.interval("x") is None                                           # inputs not counted
    assert liveness(g, count_inputs=True).live_bytes == (KB, 2 * KB, 2 * KB, 2 * KB, KB)
    assert live_bytes_per_node(g) == {"x": 0, "relu": KB, "exp": 2 * KB, "neg": 2 * KB, "output": KB}


def diamond():
    """a feeds two branches (4 KiB and 1 KiB) joined by add; ``a`` lives until both have read it."""
    b = GraphBuilder("diamond")
    x = b.input("x", (256,))
    a = b.call(aten("relu"), x)                                    # 1 KiB
    big = b.call(aten("expand"), b.call(aten("unsqueeze"), a, 0), [4, 256])
    wide = b.call(aten("exp"), big)                                 # 4 KiB (expand/unsqueeze are views of a)
    left = b.call(aten("sum.dim_IntList"), wide, [0])               # 1 KiB
    right = b.call(aten("neg"), a)                                  # 1 KiB
    return b.output(b.call(aten("add.Tensor"), left, right))


def test_diamond_holds_the_shared_value_across_both_branches():
    g = diamond()
    live = liveness(g)
    roots = storage_roots(g)
    assert roots["unsqueeze"] == roots["expand"] == "relu"          # views: no buffer of their own
    assert "expand" not in live.sizes and "unsqueeze" not in live.sizes
    step = live.step_of
    # while exp runs: relu (1 KiB) + exp (4 KiB); while sum runs: relu + exp + sum
    assert live.live_bytes[step["exp"]] == 5 * KB
    assert live.live_bytes[step["sum"]] == 6 * KB
    assert live.live_bytes[step["neg"]] == 3 * KB                  # exp freed after sum; relu, sum, neg
    assert live.live_bytes[step["add"]] == 3 * KB                  # relu freed after neg; sum, neg, add
    assert live.peak_bytes == 6 * KB


def test_view_chain_is_one_buffer_held_until_its_last_alias_is_read():
    b = GraphBuilder("views")
    x = b.input("x", (16, 16))
    a = b.call(aten("relu"), x)                                       # 1 KiB
    v = b.call(aten("t"), b.call(aten("view"), a, [16, 16]))          # two views of a
    c = b.call(aten("exp"), b.call(aten("neg"), x))                   # neg, exp: 1 KiB each, a still live
    g = b.output(b.call(aten("add.Tensor"), v, c))
    live = liveness(g)
    assert storage_roots(g)["t"] == "relu"
    assert set(live.sizes) == {"relu", "neg", "exp", "add"}           # no bytes for view or t
    assert live.interval("t") == live.interval("relu") == (1, live.step_of["add"])
    assert live.peak_bytes == 3 * KB                                  # relu + neg + exp (not 5: views free)


def test_a_given_schedule_changes_the_peak():
    b = GraphBuilder("order")
    x = b.input("x", (256,))
    big = b.call(aten("exp"), b.call(aten("expand"), b.call(aten("unsqueeze"), x, 0), [8, 256]))  # 8 KiB
    small = b.call(aten("sum.dim_IntList"), big, [0])                                             # 1 KiB
    other = b.call(aten("neg"), x)                                                                # 1 KiB
    g = b.output(b.call(aten("add.Tensor"), small, other))
    early = [n.name for n in g.call_nodes()]
    assert early.index("neg") > early.index("sum")
    late = ["neg", "unsqueeze", "expand", "exp", "sum", "add"]
    assert peak_bytes(g, early) == 9 * KB                  # exp + sum
    assert peak_bytes(g, late) == 10 * KB                  # neg held across exp + sum
    with pytest.raises(IRError, match="before %exp"):
        liveness(g, ["neg", "unsqueeze", "expand", "sum", "exp", "add"])
    with pytest.raises(IRError, match="leaves out"):
        liveness(g, ["neg"])


def test_groups_keep_internal_values_out_of_memory():
    g = chain()
    assert peak_bytes(g, groups=[["relu", "exp", "neg"]]) == KB      # one kernel writes only neg
    live = liveness(g, groups=[["relu", "exp"]])
    assert live.schedule[1] == ("relu", "exp")
    assert live.live_bytes == (0, KB, 2 * KB, KB)


def pool():
    """max_pool2d_with_indices returns two fresh tensors: values (1 KiB, read at once) and i64 indices
    (2 KiB, read last).  Each is its own buffer: the values die after exp, the indices live on."""
    b = GraphBuilder("pool")
    x = b.input("x", (1, 4, 16, 16))                                   # 4 KiB
    mp = b.call(aten("max_pool2d_with_indices"), b.call(aten("relu"), x), [2, 2])
    values, indices = b.call(GETITEM, mp, 0), b.call(GETITEM, mp, 1)
    late = b.call(aten("neg"), b.call(aten("exp"), values))
    return b.output(b.call(aten("add.Tensor"), late, indices))


def test_tuple_results_are_one_buffer_per_element():
    g = pool()
    bufs = buffers(g)
    assert bufs.storage["getitem"] == "getitem" and bufs.storage["getitem_1"] == "getitem_1"
    assert storage_roots(g)["getitem"] == "max_pool2d_with_indices"       # the unit a rewrite recomputes
    assert (bufs.size["getitem"], bufs.size["getitem_1"], bufs.size["max_pool2d_with_indices"]) == (KB, 2 * KB, 0)
    assert bufs.allocator["getitem"] == bufs.allocator["getitem_1"] == "max_pool2d_with_indices"
    live = liveness(g)
    # x relu pool getitem getitem_1 exp neg add output: the values (1 KiB) are freed after exp, not held
    # with the indices until add (which would read 5 KiB at neg and add)
    assert live.live_bytes == (0, 4 * KB, 7 * KB, 3 * KB, 3 * KB, 4 * KB, 4 * KB, 4 * KB, KB)
    assert live.interval("getitem") == (2, 5) and live.interval("getitem_1") == (2, 7)


def test_tuple_elements_are_held_by_the_tuple_until_its_last_getitem():
    b = GraphBuilder("late_pick")
    x = b.input("x", (1, 4, 16, 16))
    mp = b.call(aten("max_pool2d_with_indices"), x, [2, 2])
    values = b.call(GETITEM, mp, 0)
    mid = b.call(aten("exp"), values)
    late = b.call(GETITEM, mp, 1)                 # the tuple (and so the values) lives until here
    g = b.output(b.call(aten("add.Tensor"), mid, late))
    live = liveness(g)
    assert live.interval("getitem") == (1, live.step_of["getitem_1"])


# ---------------------------------------------------------------------------
# The interpreter frees each value after its last read: what it holds must be what liveness says


def measured_live_sets(graph, *inputs):
    """Run the interpreter; before each compute node, which produced tensors are still alive."""
    interp = Interpreter(graph)
    roots = buffers(graph)
    element = {(roots.tuple_of[r], graph.node(r).inputs[1]): r for r in roots.tuple_of}
    refs: dict[str, weakref.ref] = {}
    seen: dict[str, frozenset[str]] = {}

    def wrap(node, fn):
        def run(*args, **kwargs):
            seen[node.name] = frozenset(n for n, r in refs.items() if r() is not None)
            out = fn(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                refs[node.name] = weakref.ref(out)
            elif isinstance(out, tuple):      # a fresh tuple: each element is the buffer liveness names
                for k, t in enumerate(out):
                    if isinstance(t, torch.Tensor):
                        refs[element.get((node.name, k), node.name)] = weakref.ref(t)
            return out
        return run

    interp._plan = [(n, fn if fn is None else wrap(n, fn)) for n, fn in interp._plan]
    interp.run(*inputs)
    return seen


@pytest.mark.parametrize("make", [chain, diamond], ids=["chain", "diamond"])
def test_interpreter_holds_exactly_the_predicted_buffers(make):
    g = make()
    _check_against_interpreter(g, torch.randn(256))


def test_interpreter_agrees_on_tuple_results():
    _check_against_interpreter(pool(), torch.randn(1, 4, 16, 16))


def test_interpreter_agrees_on_a_zoo_model(captured):
    _, inputs, g = captured("lenet")
    _check_against_interpreter(g, *inputs)


def _check_against_interpreter(g, *inputs):
    live = liveness(g)
    seen = measured_live_sets(g, *inputs)
    compute = [n for n in g.nodes() if n.op not in (INPUT, PARAM, OUTPUT)]
    assert set(seen) == {n.name for n in compute}
    for node in compute:
        step = live.step_of[node.name]
        # buffers alive just before the node runs = live during its step, minus what it allocates;
        # a root is alive while any alias of it is (a view keeps its base), which liveness models
        # by holding the root to the last read of any alias
        predicted = {r for r in live.live_at(step) if live.born[r] < step and live.sizes[r]}
        alive_roots = {live.storage[n] for n in seen[node.name]} & set(live.sizes)
        assert alive_roots == predicted, node.name
