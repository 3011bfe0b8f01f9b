"""The TVM offload policy table: which op goes where, and why, on fake hardware profiles (no TVM needed)."""
from __future__ import annotations

import pytest

from mlcomp.targets.tvm.offload import conv_packed, epilogues, gemm, views
from mlcomp.targets.tvm.offload.policy import (
    REWRITE_ORDER,
    RULES,
    Fusion,
    HostFacts,
    Runs,
    decide,
    rule,
    table_lines,
)
from mlcomp.targets.tvm import schedules

AVX2 = HostFacts(device="cpu", vector_bits=256, packed_conv=True, kernels=True)
NO_ONEDNN_FUSED = HostFacts(device="cpu", vector_bits=128, packed_conv=False, kernels=True)
PURE = HostFacts(device="cpu", vector_bits=512, packed_conv=True, kernels=False)
GPU = HostFacts(device="cuda", vector_bits=256, packed_conv=True, kernels=False)


@pytest.mark.parametrize("op, host, dtype, size, name, runs", [
    ("conv2d", AVX2, "float32", 1 << 24, "conv2d-packed", Runs.TORCH),
    ("conv2d", NO_ONEDNN_FUSED, "float32", 1 << 24, "conv2d", Runs.TORCH),     # no fused oneDNN conv: NCHW F.conv2d
    ("conv2d", PURE, "float32", 1 << 24, "pure-tvm", Runs.TVM),
    ("conv2d", GPU, "float32", 1 << 24, "pure-tvm", Runs.TVM),
    ("conv2d", HostFacts(device="cuda"), "float32", None, "cuda", Runs.TVM),
    ("conv2d", AVX2, "bfloat16", 1 << 24, "low-precision", Runs.TVM),
    ("conv2d_1x1", AVX2, "float32", 1 << 20, "conv2d-1x1-unpacked", Runs.TORCH),
    ("linear", AVX2, "float32", 1 << 24, "linear-packed", Runs.TORCH),
    ("linear", AVX2, "float32", (1 << 24) - 1, "linear", Runs.TORCH),                # small: the packed call's fixed cost
    ("linear", HostFacts(packed_linear=False), "float32", 1 << 24, "linear", Runs.TORCH),   # no oneDNN linear
    ("matmul", AVX2, "float16", None, "low-precision", Runs.TVM),
    ("attention", AVX2, "float32", None, "attention", Runs.TORCH),
    ("layer_norm", AVX2, "float32", None, "layer-norm", Runs.TORCH),
    ("relu", AVX2, "float32", 1 << 17, "relu-after-linear", Runs.TORCH),
    ("relu", AVX2, "float32", (1 << 17) - 1, "default", Runs.TVM),           # too small: TVM fuses it
    ("mean", AVX2, "float32", 1 << 17, "mean", Runs.TORCH),
    ("mean", AVX2, "float32", 1 << 10, "default", Runs.TVM),
    ("view", AVX2, "float32", 1 << 16, "default", Runs.TVM),
    ("max_pool2d", AVX2, "float32", None, "default", Runs.TVM),
])
def test_decide_on_fake_hosts(op, host, dtype, size, name, runs):
    chosen = decide(op, host, dtype, size)
    assert (chosen.name, chosen.runs) == (name, runs)
    assert chosen.reason


def test_every_op_has_a_rule_and_the_table_ends_in_the_default():
    assert RULES[-1].name == "default" and RULES[-1].op == "*" and RULES[-1].runs is Runs.TVM
    assert len({r.name for r in RULES}) == len(RULES)
    assert decide("anything", HostFacts(device="cuda", kernels=True), "int8").name == "cuda"


def test_host_facts_name_the_features_rules_need():
    assert AVX2.features == {"cpu", "kernels", "packed-conv", "packed-linear"}
    assert PURE.features == {"cpu", "no-kernels", "packed-conv", "packed-linear"}
    assert "packed-linear" not in HostFacts(packed_linear=False).features
    assert NO_ONEDNN_FUSED.lanes == 4 and AVX2.lanes == 8
    assert HostFacts(**AVX2.to_json()) == AVX2


def test_rewrites_read_their_thresholds_from_the_table():
    assert epilogues.MEAN_MIN_ELEMENTS == rule("mean").min_size
    assert epilogues.RELU_MIN_ELEMENTS == rule("relu-after-linear").min_size
    assert views.VIEW_MIN_ELEMENTS == rule("views").min_size
    assert conv_packed.MIN_MEAN_CONV_MACS == rule("conv2d-packed").min_size
    assert conv_packed.PACK_1X1_MIN_MACS == rule("conv2d-1x1-unpacked").max_size + 1
    assert gemm.PROBE_MAX_MACS == rule("small-gemm").max_size and gemm.KEEP_RATIO == rule("small-gemm").ratio
    assert schedules.PARALLEL_MIN == rule("parallel-loop").min_size
    # a 1x1 conv is packed exactly from the table's bound on
    assert not conv_packed.worth_packing((16, 32, 1, 1), (1, 32, 32, 16))                 # 0.5 M MACs
    assert conv_packed.worth_packing((16, 32, 1, 1), (32, 128, 128, 16))                  # 268 M MACs


def test_rewrite_order_names_every_fusion_once():
    fusion_steps = [s for s in REWRITE_ORDER if s not in ("conv1d", "conv2d", "conv2d_transpose", "linear", "matmul")]
    assert sorted(fusion_steps) == sorted(f.value for f in Fusion)
    assert REWRITE_ORDER.index("attention") < REWRITE_ORDER.index("matmul") < REWRITE_ORDER.index("views")
    # 1-d convs become conv2d after the packing and right before the plain conv2d rewrite takes them
    assert REWRITE_ORDER.index("packed_conv") < REWRITE_ORDER.index("conv1d") == REWRITE_ORDER.index("conv2d") - 1


def test_table_lines_show_each_row_with_its_bounds():
    lines = table_lines()
    assert len(lines) == len(RULES)
    mean = next(line for line in lines if line.startswith("mean "))
    assert ">= 131072 elements" in mean and "torch kernel" in mean


def test_probed_host_facts_follow_the_fake_profile(fake_hardware):
    fake_hardware("avx2")
    assert HostFacts.probe("cpu").vector_bits == 256 and HostFacts.probe("cpu").kernels is True
    fake_hardware("avx512")
    assert HostFacts.probe("cpu").lanes == 16
    assert HostFacts.probe("cuda").kernels is False                     # default: torch's kernels on CPU only
    assert decide("linear", HostFacts.probe("cpu", kernels=False)).name == "pure-tvm"
