"""The graph owns its constants: nothing a pass does reaches the user's module or a sibling graph.

Every registered pass (so every family, including ones added later) runs on
every zoo model; the user's ``state_dict`` must stay byte-identical (compared as
raw bytes, not allclose), and so must the eager model's outputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

import mlcomp
from mlcomp.frontend.loading import load_model
from mlcomp.ir.constants import Constants
from mlcomp.ir.ops import PARAM
from mlcomp.models import ZOO
from mlcomp.pipeline import REGISTRY, Pass, PassRegistry, PassResult, option, run_pipeline
from mlcomp.pipeline.pass_base import BUILTIN_PASSES
from mlcomp.targets import get_target


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def state_bytes(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: raw_bytes(v) for k, v in module.state_dict().items()}


def assert_same_bytes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"user tensors changed: {changed[:5]}"


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


@dataclass(frozen=True)
class HalveWeightsInPlace(Pass):
    """Multiply every float constant by 0.5 in place (what pruning or casting in place would do)."""

    name: ClassVar[str] = "halve-weights-in-place"
    through_graph: bool = option(True, "ask graph.writable_constant first (False: write the shared tensor)")

    def run(self, graph, ctx):
        n = 0
        for node in graph.nodes(PARAM):
            t = graph.writable_constant(node.name) if self.through_graph else graph.constants[node.name]
            if t.is_floating_point():
                t.mul_(0.5)
                n += 1
        return PassResult(graph, n > 0, {"constants_halved": n})


def registry_with_halving() -> PassRegistry:
    reg = PassRegistry(BUILTIN_PASSES)
    reg.register(HalveWeightsInPlace)
    return reg


# ---------------------------------------------------------------------------
# Constants: copy-on-write


def test_copies_share_until_one_writes():
    w, b = torch.ones(4), torch.zeros(2)
    a = Constants({"w": w, "b": b})
    c = a.copy()
    assert c["w"] is a["w"] and a.is_shared("w") and c.is_shared("w")
    cw = c.writable("w")
    assert cw is not w and torch.equal(cw, w) and not c.is_shared("w")
    cw.add_(1)
    assert torch.equal(a["w"], torch.ones(4)) and torch.equal(c["w"], torch.full((4,), 2.0))
    assert c.writable("w") is cw                          # cloned once, then private
    d = c.copy()                                          # copying shares again, on both sides
    assert c.is_shared("w") and d["w"] is cw
    c.writable("w").zero_()
    assert torch.equal(d["w"], torch.full((4,), 2.0))
    c["b"] = t = torch.ones(2)                            # assigned tensors may be shared: cloned on write
    assert c.writable("b") is not t
    del c["b"]
    assert "b" not in c and "b" in a and len(c) == 1


def test_nbytes_counts_a_shared_storage_once():
    w = torch.zeros(8)
    assert Constants({"a": w, "b": w, "c": w[:4]}).nbytes() == 32


def test_graph_copy_gives_each_graph_its_own_tensors_on_write(captured):
    _, _, g = captured("mlp")
    h = g.copy()
    name = g.nodes(PARAM)[0].name
    before = raw_bytes(g.constants[name])
    h.writable_constant(name).fill_(3.0)
    assert torch.equal(raw_bytes(g.constants[name]), before)
    assert bool((h.constants[name] == 3.0).all())


# ---------------------------------------------------------------------------
# Capture copies parameters and buffers


@pytest.mark.parametrize("name", list(ZOO))
def test_captured_constants_share_no_storage_with_the_module(captured, name):
    module, _, graph = captured(name)
    user = list(module.state_dict().values())
    assert storages(graph.constants.values()).isdisjoint(storages(user))


def test_fx_capture_copies_too():
    z = ZOO["lenet"]
    module, inputs = z.build(), z.example_inputs(1)
    before = state_bytes(module)
    graph = load_model(module, example_inputs=inputs).capture(method="fx")
    assert storages(graph.constants.values()).isdisjoint(storages(module.state_dict().values()))
    for node in graph.nodes(PARAM):
        graph.constants[node.name].zero_()               # even a careless in-place write
    assert_same_bytes(before, state_bytes(module))


# ---------------------------------------------------------------------------
# Every pass on every zoo model leaves the user's module alone


@pytest.mark.parametrize("name", list(ZOO))
def test_every_pass_leaves_the_user_state_dict_byte_identical(captured, name):
    module, inputs, graph = captured(name)
    before = state_bytes(module)
    with torch.no_grad():
        eager = module(*inputs)
    passes = REGISTRY.names()
    assert {"cleanup", "fuse", "fuse-elementwise", "fold-batchnorm"} <= set(passes)
    for spec in passes:
        if graph.mode in REGISTRY.get(spec).cls.modes:     # training-only passes (remat) skip inference graphs
            run_pipeline(graph, spec)
    run_pipeline(graph, "-O3")
    assert_same_bytes(before, state_bytes(module))
    with torch.no_grad():
        assert torch.equal(module(*inputs), eager)


@pytest.mark.parametrize("through_graph", [True, False], ids=["writable_constant", "raw-in-place"])
def test_a_pass_writing_constants_in_place_never_reaches_the_user(captured, through_graph):
    if through_graph:     # the session's shared graph: copy-on-write must keep it intact (conftest checks)
        module, inputs, graph = captured("lenet")
    else:                 # a careless pass writes the graph's shared tensors: capture a graph of our own
        z = ZOO["lenet"]
        module, inputs = z.build(), z.example_inputs(2)
        graph = load_model(module, example_inputs=inputs).capture()
    before = state_bytes(module)
    graph_before = {n: raw_bytes(t) for n, t in graph.constants.items()}
    spec = f"halve-weights-in-place{{through_graph={'true' if through_graph else 'false'}}}"
    out, report = run_pipeline(graph, spec, registry=registry_with_halving())
    floats = sum(t.is_floating_point() for t in graph.constants.values())
    assert report.records[0].stats == {"constants_halved": floats} and floats > 0
    assert_same_bytes(before, state_bytes(module))
    if through_graph:                                     # copy-on-write: the input graph is untouched
        assert_same_bytes(graph_before, {n: raw_bytes(t) for n, t in graph.constants.items()})
        for n, t in out.constants.items():
            if t.is_floating_point():
                assert torch.equal(t, graph.constants[n] * 0.5), n


def test_compile_keeps_the_user_model_even_with_an_in_place_pass(captured):
    module, inputs, _ = captured("mlp")
    before = state_bytes(module)
    with torch.no_grad():
        eager = module(*inputs)
    art = mlcomp.compile(module, inputs, pipeline="cleanup,fuse", verify=True)
    assert torch.allclose(art(*inputs), eager, rtol=1e-4, atol=1e-5)
    assert_same_bytes(before, state_bytes(module))
    # the halving pass in a pipeline, then the cpu target: the artifact computes with halved
    # weights, the user's module keeps its own
    graph = load_model(module, example_inputs=inputs).capture()
    out, _ = run_pipeline(graph, "halve-weights-in-place,cleanup,fuse", registry=registry_with_halving())
    art = get_target("cpu").compile(out)
    halved = ZOO["mlp"].build()
    halved.load_state_dict({k: v * 0.5 for k, v in module.state_dict().items()})
    with torch.no_grad():
        assert torch.allclose(art(*inputs), halved(*inputs), rtol=1e-4, atol=1e-6)
        assert torch.equal(module(*inputs), eager)
    assert_same_bytes(before, state_bytes(module))
