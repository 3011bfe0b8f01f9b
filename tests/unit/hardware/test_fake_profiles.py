"""Hardware-dependent decisions on each fake machine (AVX2, AVX-512, AVX-512 BF16, AMX, a GPU).

The profiles replace what the probe reads (``tests/unit/hardware/profiles.py``), so
these assertions hold on whatever CPU runs them.
"""
from __future__ import annotations

import pytest
import torch

from mlcomp.hardware import probe
from tests.unit.hardware.profiles import PROFILES

CPUS = ["avx2", "avx512", "avx512-bf16", "amx"]


@pytest.mark.parametrize("machine, bits, bf16", [("avx2", 256, False), ("avx512", 512, False),
                                                 ("avx512-bf16", 512, True), ("amx", 512, True),
                                                 ("gpu", 256, False)])
def test_the_probe_reports_the_profile(fake_hardware, machine, bits, bf16):
    profile = fake_hardware(machine)
    assert probe.vector_bits() == bits == profile.vector_bits
    assert probe.cpu_name() == profile.name and probe.cpu_info().flags == profile.flags
    assert bool({"avx512_bf16", "amx_bf16"} & set(probe.cpu_flags())) is bf16
    assert all(f.startswith(("avx512", "amx")) for f in probe.cpu_flags())
    speeds = probe.measure_precisions("cpu", ("bf16",))
    assert (speeds.ratio("bf16") < 1) is bf16 and speeds.cpu_flags == probe._precision_flags()


def test_the_profile_is_undone_with_the_test(fake_hardware):
    real = probe.cpu_info()
    fake_hardware("amx")
    assert probe.cpu_info() != real
    # a module imported after installing binds the fake; the fixture puts it back there too


@pytest.mark.parametrize("machine", CPUS)
def test_openvino_precision_hint_follows_the_probed_flags(fake_hardware, machine):
    from mlcomp.targets.openvino.target import precision_hint

    profile = fake_hardware(machine)
    hint, why = precision_hint(torch.bfloat16, probe.cpu_flags())
    assert hint == (torch.bfloat16 if profile.native_bf16 else torch.float32)
    assert ("and the CPU has" in why) is profile.native_bf16


def test_the_compile_cache_key_names_the_machine(fake_hardware):
    from mlcomp.api.cache_key import cache_key
    from mlcomp.ir.builder import GraphBuilder
    from mlcomp.ir.ops import aten
    from mlcomp.targets import CompileOptions

    b = GraphBuilder("g")
    graph = b.output(b.call(aten("relu"), b.input("x", (2, 3))))
    keys = {}
    for machine in ("avx2", "avx512-bf16", "gpu"):
        fake_hardware(machine)
        keys[machine] = cache_key(graph, pipeline="", target="cpu", options=CompileOptions()).digest
        keys[machine + "@cuda"] = cache_key(graph, pipeline="", target="cuda", options=CompileOptions(),
                                            device="cuda").digest
    assert keys["avx2"] != keys["avx512-bf16"]             # another CPU: another key
    assert keys["avx2"] != keys["gpu"]                      # same flags, another CPU name
    assert keys["gpu@cuda"] != keys["gpu"]


def test_a_gpu_profile_is_seen_by_the_probe_and_the_cuda_target(fake_hardware):
    from mlcomp.targets import get_target

    assert (get_target("cuda").available() is None) == torch.cuda.is_available()     # the real host
    profile = fake_hardware("gpu")
    assert f"GPU {profile.gpu}" in probe.machine_line()
    assert get_target("cuda").available() is None


def test_profiles_cover_the_machines_users_bring():
    assert set(PROFILES) == {"avx2", "avx512", "avx512-bf16", "amx", "gpu"}
    assert [PROFILES[k].native_bf16 for k in CPUS] == [False, False, True, True]
