"""place: heterogeneous placement by cost or memory, copies at boundaries, devices that do not exist."""
from __future__ import annotations

import pytest
import torch

from mlcomp.base.errors import PipelineSpecError
from mlcomp.hardware.spec import DEFAULT_CPU, HardwareSpec
from mlcomp.ir.ops import aten
from mlcomp.passes.placement.place import Device, Place, PlacementError, Policy, assign_devices, devices_here
from mlcomp.pipeline import run_pipeline
from mlcomp.pipeline.pass_base import PassContext
from mlcomp.runtime.codegen import to_fx
from tests.unit.passes.test_partition import residual_graph

FAST = HardwareSpec("fast", {"fp32": 100e12}, 2e12, 0.0)
SLOW = HardwareSpec("slow", {"fp32": 1e9}, 1e9, 0.0)


def test_cost_puts_work_on_the_fast_device_unless_it_cannot_run_it():
    tiny = residual_graph(2)
    fast, slow = Device("dev1", FAST, 1 << 40), Device("dev0", SLOW, 1 << 40)
    # 256 FLOPs per matmul: moving the input (10 us latency) costs more than computing where it is
    assert set(assign_devices(tiny, [slow, fast], Policy.COST).values()) == {"dev0"}
    g = residual_graph(2, width=256)
    fast, slow = Device("dev1", FAST, 1 << 40), Device("dev0", SLOW, 1 << 40)
    where = assign_devices(g, [slow, fast], Policy.COST)
    assert set(where.values()) == {"dev1"}
    picky = Device("dev1", FAST, 1 << 40, runs=lambda n: n.op != aten("relu"))
    where = assign_devices(g, [slow, picky], Policy.COST)
    assert where["relu0"] == where["relu1"] == "dev0"
    assert where["mm0"] == where["mm1"] == "dev1"


def test_memory_fills_devices_in_order():
    g = residual_graph(3)
    per_block = 8 * 8 * 4 + 3 * 2 * 8 * 4          # weight + three activations
    small = Device("dev0", DEFAULT_CPU, per_block)
    big = Device("dev1", DEFAULT_CPU, 1 << 40)
    where = assign_devices(g, [small, big], Policy.MEMORY)
    assert [where[n] for n in ("mm0", "relu0", "add0", "mm1", "add2")] == ["dev0", "dev0", "dev0", "dev1", "dev1"]


def test_pass_on_this_machine_golden_and_numbers():
    g = residual_graph(1)
    result = Place(devices=("cpu",)).run(g, PassContext())
    assert result.graph.format() == (
        "graph resmlp(%x: f32[2, 8]) {\n"
        "  %l0.weight: f32[8, 8] = param   # l0\n"
        "  %mm0: f32[2, 8] = aten.mm.default(%x, %l0.weight)   # {device=cpu}\n"
        "  %relu0: f32[2, 8] = aten.relu.default(%mm0)   # {device=cpu}\n"
        "  %add0: f32[2, 8] = aten.add.Tensor(%relu0, %x)   # {device=cpu}\n"
        "  return (%add0,)\n"
        "}")
    assert result.stats == {"nodes_per_device": {"cpu": 3}, "cross_device_reads": 0}
    x = torch.randn(2, 8)
    w = residual_graph(1).constants["l0.weight"]
    torch.testing.assert_close(to_fx(result.graph)(x)[0], torch.relu(x @ w) + x)
    again, report = run_pipeline(residual_graph(1), "place{devices=[cpu] policy=memory}", verify=True)
    assert report.verified and all(n.ann.device == "cpu" for n in again.call_nodes())


def test_devices_that_do_not_exist():
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(PlacementError, match=f"device {missing} does not exist on this machine"):
        devices_here([missing, "cpu"])
    with pytest.raises(PlacementError, match="not a device name"):
        devices_here(["gpu0"])
    with pytest.raises(PipelineSpecError, match="does not exist"):
        Place(devices=(missing,))


@pytest.mark.cuda
def test_cpu_and_gpu_numbers_equal_eager():
    g = residual_graph(3, width=256)
    placed, report = run_pipeline(g, "place{devices=[cuda:0,cpu]}", verify=True)
    assert report.verified
    assert {n.ann.device for n in placed.call_nodes()} <= {"cuda:0", "cpu"}
    x = torch.randn(2, 256)
    ref = to_fx(g)(x)[0]
    torch.testing.assert_close(to_fx(placed)(x)[0].cpu(), ref, rtol=1e-4, atol=1e-4)
