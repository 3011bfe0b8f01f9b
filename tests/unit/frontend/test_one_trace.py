"""Inference capture in one trace straight to core ATen gives the IR the two-trace path gives."""
from __future__ import annotations

import functools
import gc
import inspect
from unittest import mock

import pytest
import torch
from torch import nn

from mlcomp.base.errors import ModelFaultError
from mlcomp.frontend import capture as capture_mod
from mlcomp.frontend.loading import load_model
from mlcomp.frontend.decompose import lowering_table
from mlcomp.frontend.one_trace import ONE_TRACE, lowering_split, one_trace_program
from mlcomp.frontend.source import collector_paused
from mlcomp.ir.interpreter import evaluate


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return torch.nn.functional.gelu(self.norm(self.fc(x))) * 0.5     # the source line of mul


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.block = Block()

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x))).flatten(2)[..., :6]
        return self.block(y).softmax(-1).view(2, -1)


X = torch.randn(2, 2, 3, 3, generator=torch.Generator().manual_seed(1))


def _ir(graph) -> list[str]:
    nodes = [f"{n.name} {n.op} {n.inputs} {n.attrs} {n.meta} {n.origin}" for n in graph.nodes()]
    return nodes + [f"{k} {tuple(v.shape)} {v.sum().item():.6f}" for k, v in graph.constants.items()]


def _two_traces(*args, **kwargs):
    return None, "forced by the test"


@pytest.fixture(scope="module")
def both():
    model = Net().eval()
    one = load_model(model, example_inputs=(X,)).capture()
    with mock.patch.object(capture_mod, "_one_trace", _two_traces):
        two = load_model(model, example_inputs=(X,)).capture()
    return model, one, two


def test_one_trace_gives_the_two_trace_ir(both):
    model, one, two = both
    assert one.capture_trace == ONE_TRACE and two.capture_trace == "forced by the test"
    assert _ir(one) == _ir(two)
    ops = {str(n.op) for n in one.call_nodes()}
    assert {"aten.bmm.default", "aten.native_layer_norm.default"} <= ops and "aten.linear.default" not in ops
    with torch.no_grad():
        torch.testing.assert_close(evaluate(one, X)[0], model(X), rtol=1e-5, atol=1e-6)


def test_one_trace_keeps_module_paths_and_source_lines(both):
    _, one, _ = both
    assert "block.fc.weight" in one.constants and "bn.running_mean" in one.constants
    mul = next(n for n in one.call_nodes() if str(n.op) == "aten.mul.Tensor")
    assert mul.origin.module_path == "block" and mul.origin.module_type == "Block"
    lines, start = inspect.getsourcelines(Block.forward)
    assert mul.origin.source.endswith(f"test_one_trace.py:{start + len(lines) - 1}")    # forward's last line
    assert [n.name for n in one.input_nodes] == ["x"]


def test_dynamic_batch_in_one_trace():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).eval()
    graph = load_model(model, example_inputs=(torch.randn(2, 4),)).capture(dynamic="batch")
    assert graph.capture_trace == ONE_TRACE
    assert graph.input_nodes[0].tensor_meta.shape[0] == "batch"
    x5 = torch.randn(5, 4)
    with torch.no_grad():
        torch.testing.assert_close(evaluate(graph, x5)[0], model(x5))


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(1)                    # an in-place buffer update: the error names this line
        return x * 2


def test_an_in_place_update_takes_two_traces_and_names_its_line():
    ep, why = one_trace_program(Counts().eval(), (torch.ones(2),), None)
    assert ep is None and why == "two traces: the program updates a buffer or an input in place"
    with pytest.raises(ModelFaultError) as err:
        load_model(Counts().eval(), example_inputs=(torch.ones(2),)).capture()
    assert "updates buffer seen in place" in str(err.value)
    assert "test_one_trace.py" in str(err.value.where)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, i):
        return self.head(self.emb(i))


def test_tied_tensors_take_two_traces_before_any_trace():
    ep, why = one_trace_program(Tied().eval(), (torch.tensor([[1, 2]]),), None)
    assert ep is None and why == "two traces: tied tensors (one trace names each use by its own path)"


def _same_kernel(a, b) -> bool:
    """The same function, or partials of one function's code with equal arguments (torch makes a new one per call)."""
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return a.func.__code__ is b.func.__code__ and a.args == b.args and a.keywords == b.keywords
    return a is b


def test_lowering_split_is_torchs_split_of_the_lowering_table():
    from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp

    def linear(x, w, b=None):                 # a user's decomposition of a CIA op, and of a kept one
        return NotImplemented

    extra = {torch.ops.aten.linear.default: linear, torch.ops.aten.upsample_nearest2d.vec: linear}
    cia, python = lowering_split(extra)
    want_cia, want_python = _split_decomp_table_to_cia_and_python_decomp(dict(lowering_table(extra)))
    assert python == want_python and cia.keys() == want_cia.keys()
    assert all(_same_kernel(cia[op], want_cia[op]) for op in cia)
    kept = torch.ops.aten.upsample_bilinear2d.vec       # torch's default keeps it: a kernel that keeps it
    assert cia[torch.ops.aten.linear.default] is linear and cia[kept](None) is NotImplemented
    assert torch.ops.aten.addcmul.default in python and torch.ops.aten.linear.default not in python


class GcProbe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.seen = nn.Linear(3, 2), []

    def forward(self, x):
        self.seen.append(gc.isenabled())     # runs while capture traces it
        return self.fc(x).relu()


@pytest.mark.parametrize("enabled", [True, False])
def test_capture_pauses_the_cyclic_collector_and_restores_it(enabled):
    model, x = GcProbe().eval(), torch.randn(2, 3)
    (gc.enable if enabled else gc.disable)()
    try:
        graph = load_model(model, example_inputs=(x,)).capture()
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
    assert model.seen and not any(model.seen)
    with torch.no_grad():
        torch.testing.assert_close(evaluate(graph, x)[0], model.fc(x).relu())


def test_objects_made_while_paused_join_the_oldest_generation_and_frozen_ones_stay_frozen():
    with collector_paused():
        first = [[] for _ in range(100)]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert any(o is first for o in gc.get_objects(generation=2))
    assert not any(o is first for o in gc.get_objects(generation=0))
    gc.freeze()                              # a process that keeps frozen objects of its own: left as they are
    frozen = gc.get_freeze_count()
    try:
        with collector_paused():
            made = [[] for _ in range(100)]
        assert gc.get_freeze_count() == frozen and gc.isenabled()
        assert any(o is made for o in gc.get_objects(generation=0))
    finally:
        gc.unfreeze()
