"""The cpu target's frozen products run eager's fused GEMM (``targets.torch.linears``): TorchScript's executor
splits ``aten::addmm`` into ``mm`` + ``add``, so products reach it as ``aten::linear``."""
from __future__ import annotations

import torch
from torch import nn
from torch.profiler import profile

import mlcomp
from mlcomp.targets.torch.cpu import OptimizeReason
from mlcomp.targets.torch.linears import addmm_as_linear


def _kernels(fn) -> dict[str, int]:
    with torch.no_grad():
        for _ in range(3):            # the profiling executor optimises after its first calls
            fn()
        with profile() as prof:
            fn()
    return {e.key: e.count for e in prof.key_averages()}


def test_frozen_products_run_addmm_not_mm_and_add():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval(), torch.randn(8, 16)
    art = mlcomp.compile(model, (x,), target="cpu", pipeline="-O0", threads=1)
    ran = _kernels(lambda: art(x))
    assert ran.get("aten::addmm") == 2 and "aten::mm" not in ran and "aten::add" not in ran, ran
    torch.testing.assert_close(art(x), model(x))
    # optimize_for_inference's module runs the same kernels: still untimed, the plain module kept
    assert art.runtime.choice.reason is OptimizeReason.SAME_KERNELS


def test_only_unit_scaled_products_of_a_constant_become_linears():
    b, x, w = torch.randn(3), torch.randn(2, 4), torch.randn(4, 3)

    def products(b, x):                       # w traced as a constant, as freezing leaves a weight
        return torch.addmm(b, x, w), torch.addmm(b, x, w, beta=0.5), torch.addmm(b, x, w, alpha=2.0)

    graph = torch.jit.trace(products, (b, x)).graph
    assert addmm_as_linear(graph) == 1
    assert [n.kind() for n in graph.findAllNodes("aten::addmm")] == ["aten::addmm"] * 2
    assert len(graph.findAllNodes("aten::linear")) == 1


def test_a_computed_second_operand_stays_an_addmm():
    """A training graph's weight is an input: its product is left as it is (the rewrite is for constants)."""
    graph = torch.jit.trace(lambda b, x, w: torch.addmm(b, x, w), (torch.randn(3), torch.randn(2, 4),
                                                                    torch.randn(4, 3))).graph
    assert addmm_as_linear(graph) == 0 and len(graph.findAllNodes("aten::addmm")) == 1
