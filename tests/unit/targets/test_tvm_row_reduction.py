"""RowReduction (targets/tvm/row_reduction.py): which PrimFuncs it schedules, the TIR it leaves, the numbers.

Each case is a Relax op lowered and fused as a build does (``lower_to_tir``), scheduled by the
untuned rules (``default_rules``), both for the register width of a fake CPU (``fake_hardware``:
256-bit AVX2 or 512-bit AVX-512, so the assertions hold on any CPU), compiled for a generic LLVM
target and run against torch.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.tvm

tvm = pytest.importorskip("tvm")

from mlcomp.targets.tvm.row_reduction import row_reductions  # noqa: E402

PROFILE_OF_BITS = {256: "avx2", 512: "avx512"}      # tests/unit/hardware/profiles.py


def _gamma_beta(n: int):
    g = np.linspace(0.5, 1.5, n, dtype="float32")
    return g, np.linspace(-0.2, 0.2, n, dtype="float32")


# op -> (relax builder of y from x, torch reference of y from x)
OPS = {
    "layer_norm": (lambda r, x, n: r.op.nn.layer_norm(x, r.const(_gamma_beta(n)[0]), r.const(_gamma_beta(n)[1]),
                                                      axes=[-1], epsilon=1e-5),
                   lambda x: torch.nn.functional.layer_norm(x, x.shape[-1:], *map(torch.from_numpy,
                                                                                  _gamma_beta(x.shape[-1])))),
    "softmax": (lambda r, x, n: r.op.nn.softmax(x, axis=-1), lambda x: torch.softmax(x, -1)),
    "log_softmax": (lambda r, x, n: r.op.nn.log_softmax(x, axis=-1), lambda x: torch.log_softmax(x, -1)),
    "mean": (lambda r, x, n: r.op.mean(x, axis=[-1]), lambda x: x.mean(-1)),
    "variance": (lambda r, x, n: r.op.variance(x, axis=[-1]), lambda x: x.var(-1, unbiased=False)),
    "column_mean": (lambda r, x, n: r.op.mean(x, axis=[1]), lambda x: x.mean(1)),
}


@pytest.fixture
def scheduled(fake_hardware):
    """``scheduled(op, shape, vector_bits, …)``: :func:`_scheduled` on a fake CPU with registers of ``vector_bits``."""
    def run(op: str, shape: tuple[int, ...], vector_bits: int, parallel: bool = False, dtype: str = "float32"):
        fake_hardware(PROFILE_OF_BITS[vector_bits])
        return _scheduled(op, shape, parallel=parallel, dtype=dtype)
    return run


def _scheduled(op: str, shape: tuple[int, ...], parallel: bool = False, dtype: str = "float32"):
    """(the scheduled IRModule, its one reduction PrimFunc's TVMScript), for the probe's register width."""
    from tvm import relax
    from tvm.s_tir import dlight as dl

    from mlcomp.hardware.probe import vector_bits
    from mlcomp.targets.tvm.lowering import lower_to_tir
    from mlcomp.targets.tvm.schedules import default_rules

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(bb.emit(OPS[op][0](relax, x, shape[-1])))
        bb.emit_func_output(y)
    target = tvm.target.Target("llvm")
    mod = lower_to_tir(bb.get(), target)
    with target:
        mod = dl.ApplyDefaultSchedule(*default_rules(target, vector_bits(), parallel=parallel))(mod)
    texts = [f.script() for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(texts) == 1, texts
    return mod, texts[0]


def _check_numbers(mod, op: str, shape: tuple[int, ...]) -> None:
    from tvm import relax

    x = torch.randn(*shape) * 3
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    out = torch.from_numpy(vm["main"](tvm.runtime.tensor(x.numpy())).numpy())
    torch.testing.assert_close(out, OPS[op][1](x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["layer_norm", "softmax", "log_softmax", "mean", "variance"])
def test_row_reductions_reduce_a_vector_at_a_time(op, scheduled):
    """512-bit registers, rows of 64: every reduction gets 16 partials per row (a `_rf` buffer), filled by a
    16-lane vector loop over the row in 4 steps; no serial walk over the row is left."""
    mod, text = scheduled(op, (3, 5, 64), vector_bits=512)
    reductions = len(re.findall(r"_rf = T\.sblock_alloc_buffer\(\(T\.int64\(3\), T\.int64\(5\), .*T\.int64\(16\)\)\)\n",
                                text))
    assert reductions == {"layer_norm": 2, "variance": 2, "softmax": 2, "log_softmax": 2, "mean": 1}[op], text
    assert re.search(r"for \w+ in range\(T\.int64\(4\)\):\n\s+for \w+ in T\.vectorized\(T\.int64\(16\)\):", text), text
    assert len(re.findall(r'_rf_update"', text)) == reductions                     # each filled by a vector loop
    assert "T.parallel" not in text and "for ax0_ax1_fused in range(T.int64(15)):" in text   # one loop over rows
    assert "pragma_auto_unroll_max_step" not in text                                # DLight's scalar walk
    assert row_reductions(mod) == 1 and '"mlcomp.row_reduction": 16' in text
    _check_numbers(mod, op, (3, 5, 64))


@pytest.mark.parametrize(("row", "bits", "width"), [(100, 512, 4), (24, 256, 8), (48, 512, 16)])
def test_rows_the_registers_do_not_divide_take_the_widest_dividing_width(row, bits, width, scheduled):
    """A row of 100 on 16 lanes runs 4 lanes at a time: no vector crosses the end of a row."""
    mod, text = scheduled("softmax", (2, row), vector_bits=bits)
    assert f"T.vectorized(T.int64({width}))" in text and "_rf" in text, text
    assert "T.where" not in text                                                    # no lane needs a bound check
    _check_numbers(mod, "softmax", (2, row))


@pytest.mark.parametrize(("op", "shape"), [("softmax", (2, 65)), ("column_mean", (1, 32, 65))])
def test_odd_rows_and_columns_are_left_to_dlight(op, shape, scheduled):
    """No width ≥ 4 divides 65 (a row, or the columns of a mean over tokens): DLight's Reduction schedules both."""
    mod, text = scheduled(op, shape, vector_bits=512)
    assert "_rf" not in text and row_reductions(mod) == 0, text
    _check_numbers(mod, op, shape)


@pytest.mark.parametrize("shape", [(1, 128, 64), (3, 7, 24)])
def test_a_mean_down_the_columns_walks_a_vector_of_sums_down_them(shape, scheduled):
    """``x.mean(1)``: the sums of w columns in one register, one contiguous w-wide load per token."""
    mod, text = scheduled("column_mean", shape, vector_bits=512)
    w = 16 if shape[-1] % 16 == 0 else 8
    assert row_reductions(mod) == 1 and "_rf" not in text, text
    assert re.search(rf"for ax1 in range\(T\.int64\({shape[1]}\)\):\n\s+for \w+ in T\.vectorized\(T\.int64\({w}\)\):",
                     text), text
    _check_numbers(mod, "column_mean", shape)


def test_a_parallel_build_gives_the_rows_to_the_cores(scheduled):
    from mlcomp.targets.tvm.schedules import PARALLEL_MIN

    rows = PARALLEL_MIN // 64
    mod, text = scheduled("layer_norm", (rows, 64), vector_bits=256, parallel=True)
    assert f"for ax0 in T.parallel(T.int64({rows})):" in text and "_rf" in text, text
    _, small = scheduled("layer_norm", (4, 64), vector_bits=256, parallel=True)
    assert "T.parallel" not in small                                    # under PARALLEL_MIN: not worth the pool
    mmod, means = scheduled("column_mean", (4, PARALLEL_MIN // 1024, 256), vector_bits=256, parallel=True)
    assert "T.parallel(T.int64(128))" in means and row_reductions(mmod) == 1, means    # 4 x 256 / 8 column blocks
    _check_numbers(mod, "layer_norm", (rows, 64))


@pytest.mark.parametrize("op", ["softmax", "column_mean"])
def test_a_float16_reduction_is_left_to_dlight_by_both_plans(op, scheduled):
    """The rows and the columns plans take float32 only: the same shapes in float16 stay DLight's."""
    shape = (4, 64) if op == "softmax" else (2, 8, 64)
    mod, text = scheduled(op, shape, vector_bits=512, dtype="float16")
    assert row_reductions(mod) == 0 and "T.vectorized(T.int64(16))" not in text
    assert row_reductions(scheduled(op, shape, vector_bits=512)[0]) == 1     # float32: the rule's


def test_block_steps_name_every_block_kind_the_rule_schedules():
    from mlcomp.targets.tvm.row_reduction import BLOCK_STEPS, _kind, row_width

    assert {_kind("SSR", 2), _kind("SSS", 2), _kind("SS", 2), "columns"} == set(BLOCK_STEPS)
    assert _kind("SRR", 1) is None and _kind("SSRS", 2) is None        # two reduction axes, a reduction inside
    assert [row_width(n, 16) for n in (256, 100, 20, 8, 65, 6)] == [16, 4, 4, 8, None, None]


@pytest.mark.parametrize("profile", ["avx2", "avx512"])
def test_a_build_schedules_its_layer_norms_by_the_rule_and_says_so(profile, fake_hardware):
    """A pure TVM build (every op TVM code) of linear → layer norm → softmax: both row reductions are the
    rule's (``stats["schedules"]["row_reductions"]``), the numbers eager's."""
    from torch import nn

    from mlcomp.targets.tvm.build import BuildConfig, build

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.norm = nn.Linear(16, 32), nn.LayerNorm(32)

        def forward(self, x):
            return torch.softmax(self.norm(self.fc(x)), -1)

    bits = fake_hardware(profile).vector_bits
    torch.manual_seed(0)
    model, x = Head().eval(), torch.randn(2, 5, 16)
    built = build(model, (x,), BuildConfig(kernels=False, deterministic=True))
    assert built.stats["schedules"]["row_reductions"] == 2, built.stats["schedules"]
    assert built.stats["schedules"]["vector_bits"] == bits
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("profile", ["avx2", "avx512"])
def test_the_add_before_a_layer_norm_fuses_into_it_and_a_matmul_stays_a_fusion_root(profile, fake_hardware):
    """``as_reductions``: a layer norm is a plain reduction to FuseOps (the residual add folds into it, one
    PrimFunc); a matmul keeps its pattern (the add before it stays its own function)."""
    from tvm import relax

    from mlcomp.targets.tvm.lowering import lower_to_tir

    fake_hardware(profile)
    g, b = _gamma_beta(64)
    bb = relax.BlockBuilder()
    x, y = (relax.Var(n, relax.TensorType((8, 64), "float32")) for n in "xy")
    w = relax.const(np.ones((64, 64), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            s = bb.emit(relax.op.add(x, y))
            n = bb.emit(relax.op.nn.layer_norm(s, relax.const(g), relax.const(b), axes=[-1], epsilon=1e-5))
            out = bb.emit_output(bb.emit(relax.op.matmul(relax.op.add(n, x), w)))
        bb.emit_func_output(out)
    mod = lower_to_tir(bb.get(), tvm.target.Target("llvm"))
    names = sorted(gv.name_hint for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc))
    assert names == ["add", "fused_add_layer_norm", "matmul"], names
