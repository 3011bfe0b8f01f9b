"""targets/tvm/lowering.py: a generated module of core ATen calls reaches TVM's importer as its own graph (no
second trace), and the importer makes of it exactly the Relax module it makes of ``torch.export``'s trace."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.frontend.loading import load_model
from mlcomp.runtime.codegen import to_fx

pytestmark = pytest.mark.tvm
tvm_ffi = pytest.importorskip("tvm_ffi")
lowering = pytest.importorskip("mlcomp.targets.tvm.lowering")


class Block(nn.Module):
    """A buffer, a batch norm, a multi-output op picked apart, a reshape of a permuted tensor, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8 * 4, 5)
        self.register_buffer("shift", torch.linspace(-1, 1, 5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, idx = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2, return_indices=True)
        flat = y.permute(0, 2, 3, 1).reshape(x.shape[0], -1, 8 * 4)
        return self.fc(flat).mean(1) + self.shift, idx


class Reshapes(nn.Module):
    """ATen calls as mlcomp's passes emit them: a ``reshape`` (not core ATen: traced, it becomes a copy and a
    view of the permuted tensor) on a buffer's sum."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.arange(12.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        t = torch.ops.aten.permute.default(x, [0, 2, 1])
        return (torch.ops.aten.add.Tensor(torch.ops.aten.reshape.default(t, [2, 12]), self.bias),)


@pytest.fixture(scope="module")
def generated():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 8)
    return to_fx(load_model(Block().eval(), example_inputs=(x,)).capture()), x


@pytest.fixture(scope="module", params=["captured", "reshape"])
def program(request, generated):
    if request.param == "captured":
        return generated
    return torch.fx.symbolic_trace(Reshapes().eval()), torch.randn(2, 3, 4)


def _relax(ep):
    from tvm.relax.frontend.torch import from_exported_program

    from mlcomp.targets.tvm.converters import CONVERTERS

    return from_exported_program(ep, keep_params_as_input=False, custom_convert_map=CONVERTERS,
                                 run_ep_decomposition=not lowering.core_aten_only(ep))


def test_the_generated_graph_imports_as_its_trace_does(program):
    module, x = program
    direct = lowering.program_of(module, (x,))
    assert direct is not None
    assert lowering.exported_program(module, (x,)).graph_signature == direct.graph_signature
    with torch.no_grad():
        traced = torch.export.export(module, (x,))
    assert tvm_ffi.structural_equal(_relax(traced), _relax(direct), map_free_vars=True)
    assert [s.arg.name for s in direct.graph_signature.input_specs] == \
        [s.arg.name for s in traced.graph_signature.input_specs]
    got = direct.module()(x)
    for a, b in zip(got, module(x)):
        torch.testing.assert_close(a, b)


def test_what_is_not_a_generated_core_aten_graph_is_traced(generated):
    module, x = generated
    assert lowering.program_of(nn.Sequential(nn.Linear(8, 8)).eval(), (torch.randn(2, 8),)) is None
    module.train()
    try:
        assert lowering.program_of(module, (x,)) is None       # export runs it in eval mode
    finally:
        module.eval()
    dropout = torch.fx.symbolic_trace(nn.Sequential(nn.Dropout(0.5)).eval())   # a call of a torch function
    assert lowering.program_of(dropout, (torch.randn(2, 8),)) is None
