"""Small GEMMs kept as TVM code, ViT patches as a GEMM, TVM's fast softmax/gelu (issue 14: tiny transformers).

Three ways: the Relax IR before/after (``keep_in_tvm``, ``patch_convs``, ``fast_math``), numbers against
eager PyTorch / numpy (the scheduled kernel, a GPT-2 build), and what the build reports
(``stats["small_gemms"]``, ``stats["fast_math"]``, ``stats["kernels"]``).  The keep/leave decision is
tested on fake measurements; the probe itself runs once, inside the GPT-2 build.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.tvm

tvm_backend = pytest.importorskip("mlcomp.targets.tvm.build")

from mlcomp.targets.tvm.offload import gemm as tvm_gemm
from mlcomp.targets.tvm.fast_math import fast_math
from mlcomp.targets.tvm.offload.gemm import (
    GemmCall,
    gemm_calls,
    keep_in_tvm,
    kept_calls,
    patch_convs,
)
from mlcomp.hardware.decide import decide
from tests.unit.targets.test_tvm_kernels import _render


def _func(build_body, *shapes):
    """A one-function Relax module ``main(*params)`` whose dataflow block ``build_body(bb, params)`` emits."""
    from tvm import relax

    bb = relax.BlockBuilder()
    params = [relax.Var(f"x{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(build_body(bb, params))
        bb.emit_func_output(out)
    return bb.get()


def _linear_call(bb, params):
    from tvm import relax

    w = relax.const(np.arange(32 * 16, dtype="float32").reshape(32, 16) / 512)        # [N, K], torch's layout
    b = relax.const(np.ones(32, dtype="float32"))
    y = bb.emit(relax.call_pure_packed("mlcomp.torch.linear", params[0], w, b,
                                       ty_args=relax.TensorType((4, 32), "float32")))
    return relax.call_pure_packed("mlcomp.torch.matmul", y, params[1], ty_args=relax.TensorType((4, 20), "float32"))


def _probe(tvm_s: float, torch_s: float):
    """The probe's decision for one call on fake samples (each sampler returns its fixed time)."""
    ticks = iter(range(10 ** 6))
    return decide("call", {"torch": lambda: torch_s, "tvm": lambda: tvm_s}, default="torch",
                  policy=tvm_gemm.PROBE_TIMING, clock=lambda: next(ticks) * 1e-4)


def test_kept_calls_are_those_tvm_ran_clearly_faster():
    a, b, c = GemmCall("linear", (64, 64), (64, 64)), GemmCall("matmul", (8, 32, 16), (8, 16, 32)), \
        GemmCall("linear_gelu", (64, 64), (64, 128))
    decisions = {a: _probe(8e-6, 18e-6), b: _probe(9.5e-6, 10e-6), c: _probe(30e-6, 20e-6)}   # tvm, torch
    assert kept_calls(decisions) == frozenset({a})                       # b within the noise margin
    assert decisions[b].verdict.value == "decided" and decisions[b].choice == "torch"
    assert kept_calls({}) == frozenset()
    assert (a.macs, b.macs, c.macs) == (64 ** 3, 8 * 32 * 16 * 32, 64 * 64 * 128)
    assert b.describe() == "matmul 8x32x16 @ 8x16x32"


def test_keep_in_tvm_ir_before_after():
    mod = _func(_linear_call, (4, 16), (32, 20))
    func = mod["main"]
    calls = gemm_calls(func, vector_lanes=8)
    # the matmul's N = 20: no multiple of the 8 vector lanes and wider than two vectors, not a candidate
    assert sorted(calls.values()) == [GemmCall("linear", (4, 16), (16, 32))]
    assert _render(func) == [
        "lv = relax.call_pure_packed(mlcomp.torch.linear, x0, const[32x16], const[32])",
        "gv = relax.call_pure_packed(mlcomp.torch.matmul, lv, x1)"]
    assert keep_in_tvm(func, calls, frozenset()).same_as(func)
    after = keep_in_tvm(func, calls, frozenset(calls.values()))
    assert _render(after) == [
        "lv = relax.matmul(x0, const[16x32])",              # the weight back in Relax's [K, N]; Normalize
        "lv = relax.add(lv, const[32])",                    # names the new binding lv too (a distinct var)
        "gv = relax.call_pure_packed(mlcomp.torch.matmul, lv, x1)"]


def test_layer_norm_call_back_to_relax():
    from tvm import relax

    g, b = relax.const(np.ones(16, dtype="float32")), relax.const(np.zeros(16, dtype="float32"))
    body = lambda bb, p: relax.call_pure_packed("mlcomp.torch.add_layer_norm_reuse", p[0], p[1], g, b,
                                                relax.prim_value(1e-5), ty_args=relax.TensorType((2, 16), "float32"))
    func = _func(body, (2, 16), (2, 16))["main"]
    calls = gemm_calls(func, vector_lanes=8)
    assert list(calls.values()) == [GemmCall("add_layer_norm", (2, 16), (16,), 1e-5)]
    assert _render(keep_in_tvm(func, calls, frozenset(calls.values()))) == [
        "lv = relax.add(x0, x1)", "gv = relax.nn.layer_norm(lv, const[16], const[16])"]


def test_patch_convs_ir_before_after():
    from tvm import relax

    w = relax.const(np.ones((8, 3, 4, 4), dtype="float32"))
    conv = lambda bb, p: relax.op.nn.conv2d(p[0], w, strides=[4, 4])
    func = _func(conv, (2, 3, 8, 8))["main"]
    assert _render(patch_convs(func)) == [
        "lv = relax.reshape(x0, shape)",
        "lv1 = relax.permute_dims(lv)",
        "lv2 = relax.reshape(lv1, shape)",
        "lv3 = relax.call_pure_packed(mlcomp.torch.linear, lv2, const[8x48], const[8])",
        "lv4 = relax.reshape(lv3, shape)",
        "gv = relax.permute_dims(lv4)"]
    padded = _func(lambda bb, p: relax.op.nn.conv2d(p[0], w, strides=[4, 4], padding=[1, 1]), (2, 3, 8, 8))["main"]
    assert _render(patch_convs(padded)) == ["gv = relax.nn.conv2d(x0, const[8x3x4x4])"]   # padded: a real conv


def _run(mod, *args):
    import tvm
    from tvm import relax

    target = tvm.target.Target(tvm_backend.host_llvm_target())
    stats: dict = {}
    lowered = tvm_backend.default_schedules(tvm_backend.lower_to_tir(mod, target), target, stats, parallel=False)
    vm = relax.VirtualMachine(tvm.compile(lowered, target=target), tvm.cpu())
    out = vm["main"](*args)
    return (out if isinstance(out, torch.Tensor) else torch.from_dlpack(out)), lowered, stats


def _column_tile(n: int, vector_bits: int) -> int:
    """SmallMatmul's columns per tile: two float32 vectors, one, or a narrow N whole."""
    lanes = vector_bits // 32
    return 2 * lanes if n % (2 * lanes) == 0 else lanes if n % lanes == 0 else n


# the schedule follows the probed vector width: two 8-lane AVX2 vectors (16 columns) or two 16-lane
# AVX-512 vectors (32); a width the host lacks still computes the same numbers (LLVM splits the vectors)
@pytest.mark.parametrize("machine", ["avx2", "avx512"])
def test_small_matmul_schedule_numbers_and_patches_against_torch(fake_hardware, machine):
    from tvm import relax, tirx

    from mlcomp.targets.tvm.kernels import register_kernels

    bits = fake_hardware(machine).vector_bits
    register_kernels()
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 6, 16, generator=g), torch.randn(16, 32, generator=g), torch.randn(32, generator=g)
    mod = _func(lambda bb, p: relax.op.add(relax.op.matmul(p[0], relax.const(w.numpy())), relax.const(b.numpy())),
                (2, 6, 16))
    got, lowered, stats = _run(mod, x)
    torch.testing.assert_close(got, x @ w + b, rtol=1e-5, atol=1e-5)
    assert stats["schedules"]["vector_bits"] == bits          # built for the probed width
    text = next(f.script() for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc))
    assert f"T.vectorized(T.int64({_column_tile(32, bits)}))" in text and "T.unroll(T.int64(3))" in text
    assert stats["schedules"]["unscheduled"] == 0
    # a narrow N the lanes do not divide (GRU-tagger's 10 tags): one odd-width vector
    w10 = torch.randn(16, 10, generator=g)
    got, lowered, _ = _run(_func(lambda bb, p: relax.op.matmul(p[0], relax.const(w10.numpy())), (2, 6, 16)), x)
    torch.testing.assert_close(got, x @ w10, rtol=1e-5, atol=1e-5)
    assert f"T.vectorized(T.int64({_column_tile(10, bits)}))" in next(f.script() for f in lowered.functions.values()
                                               if isinstance(f, tirx.PrimFunc))
    # ViT-style patches: the rewritten conv (patch copy + torch linear) against torch's conv2d
    img, wc = torch.randn(2, 3, 8, 8, generator=g), torch.randn(8, 3, 4, 4, generator=g)
    conv = _func(lambda bb, p: relax.op.nn.conv2d(p[0], relax.const(wc.numpy()), strides=[4, 4]), (2, 3, 8, 8))
    conv["main"] = patch_convs(conv["main"])
    got, _, _ = _run(conv, img)
    torch.testing.assert_close(got, torch.nn.functional.conv2d(img, wc, stride=4), rtol=1e-5, atol=1e-5)


def test_fast_math_ir_and_numbers():
    from tvm import relax

    def body(bb, p):
        s = bb.emit(relax.op.nn.softmax(p[0], axis=-1))
        t = bb.emit(relax.op.tanh(relax.op.power(s, relax.const(3.0, "float32"))))
        return relax.op.nn.gelu(t * relax.const(40.0, "float32") - relax.const(20.0, "float32"))

    mod = _func(body, (4, 64))
    fast, counts = fast_math(mod)
    assert counts == {"softmax": 1, "gelu": 1, "erf": 0, "tanh": 1, "power": 1}
    ops = [b.value.op.name for block in fast["main"].body.blocks for b in block.bindings]
    assert "relax.nn.softmax" not in ops and "relax.tanh" not in ops and "relax.power" not in ops
    assert ops.count("relax.call_tir") == 3                                  # fast_softmax, fast_tanh, fast_erf
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 4
    got, _, _ = _run(fast, x)
    ref = torch.nn.functional.gelu(torch.tanh(torch.softmax(x, -1) ** 3) * 40 - 20)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)


@pytest.fixture(scope="module")
def gpt2_build():
    pytest.importorskip("transformers")
    from mlcomp.models.third_party import build_third_party

    model, inputs = build_third_party("gpt2", batch=1)
    return model, inputs, tvm_backend.build(model, inputs, tvm_backend.BuildConfig(threads=1))


@pytest.mark.slow
def test_gpt2_build_numbers_and_stats(gpt2_build):
    model, inputs, built = gpt2_build
    with torch.no_grad():
        expected = model(*inputs)
    torch.testing.assert_close(built(*inputs)[0], expected, rtol=1e-4, atol=1e-5)
    small = built.stats["small_gemms"]
    rows = {r["call"]: r for r in small["probe"]}
    assert "linear 32x64 @ 64x192" in rows and "matmul 4x32x16 @ 4x16x32" in rows  # c_attn, attention scores
    assert "add_layer_norm 1x32x64" in rows and "layer_norm 1x32x64" in rows       # ln_2 after a residual, ln_1
    assert small["kept_in_tvm"] == sum(r["runs_in"] == "tvm" for r in rows.values())
    assert all(r["tvm_us"] > 0 and r["torch_us"] > 0 and r["why"] for r in rows.values())
    assert len(small["decisions"]) == len(rows)
    kept = {k["op"]: k["count"] for k in built.stats["kernels"]["kept_in_tvm"]}
    assert sum(kept.values()) >= small["kept_in_tvm"]                           # each kept kind, per call site
    assert built.stats["fast_math"]["tanh"] == 2 and built.stats["fast_math"]["power"] == 2   # gelu_new ×2 layers
    assert built.stats["fast_math"]["softmax"] == 2
    assert tvm_gemm.PROBE_MAX_MACS >= max(r["macs"] for r in rows.values())


def _matmul_loops(func) -> list[str]:
    """The loops around a PrimFunc's ``matmul`` block, as ``kind extent`` (names dropped), outermost first."""
    import re

    stack: list[tuple[int, str]] = []          # (indent, loop) of the loops enclosing the current line
    for line in func.script().splitlines():
        indent = len(line) - len(line.lstrip())
        stack = [(i, loop) for i, loop in stack if i < indent]
        if re.search(r'T\.sblock\("matmul(_update)?"\)', line):
            return [loop for _, loop in stack]
        found = re.match(r"\s*for [\w, ]+ in (T\.\w+|range)\((.*)\):", line)
        if found:
            stack.append((indent, f"{found.group(1)} {re.sub(r'T.int64|[()]', '', found.group(2)).split(',')[0]}"))
    raise AssertionError("no matmul block")


def test_batch1_product_is_small_matmul_not_column_reading_gemv(fake_hardware):
    """One row (batch 1): DLight's GEMV would read the [K, N] weight by columns (a K-long strided walk per output);
    SmallMatmul runs the columns as vectors, the reduction serial."""
    from tvm import relax, tirx

    bits = fake_hardware("avx512").vector_bits
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(1, 64, generator=g), torch.randn(64, 48, generator=g), torch.randn(48, generator=g)
    mod = _func(lambda bb, p: relax.op.nn.relu(relax.op.add(relax.op.matmul(p[0], relax.const(w.numpy())),
                                                            relax.const(b.numpy()))), (1, 64))
    got, lowered, _ = _run(mod, x)
    torch.testing.assert_close(got, torch.relu(x @ w + b), rtol=1e-5, atol=1e-5)
    func = next(f for f in lowered.functions.values() if isinstance(f, tirx.PrimFunc))
    assert _matmul_loops(func) == ["range 3", "range 64", f"T.vectorized {_column_tile(48, bits)}"]


@pytest.mark.slow
def test_the_probed_kernel_is_the_kernel_built(fake_hardware, monkeypatch):
    """A batch-1 MLP whose GEMMs the (faked) probe keeps as TVM code: the loop nest the probe timed is the
    one the build runs (same rule, same tiles, serial), the decision is recorded, and the numbers match."""
    import tvm
    from tvm import tirx

    from mlcomp.hardware.decide import Decision, Verdict

    fake_hardware("avx512")
    compiled = []
    real_compile = tvm.compile
    monkeypatch.setattr(tvm, "compile", lambda mod, **kw: compiled.append(mod) or real_compile(mod, **kw))
    monkeypatch.setattr(tvm_gemm, "_judge", lambda call, tvm_fn, torch_fn: Decision(
        f"tvm: {call.describe()}?", ("torch", "tvm"), "torch", "tvm", Verdict.DECIDED, "fake: tvm 0.3x",
        rounds=6, medians={"torch": 4e-5, "tvm": 1.2e-5}, ratios={"tvm": 0.3}, p_values={"tvm": 0.03}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).eval()
    x = torch.randn(1, 64)
    built = tvm_backend.build(model, (x,), tvm_backend.BuildConfig(threads=1))
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
    probe, final = compiled[0], compiled[-1]
    assert [gv.name_hint for gv in probe.functions if gv.name_hint.startswith("tvm_")] == ["tvm_0", "tvm_1"]
    prims = lambda mod: {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    timed = {tuple(_matmul_loops(f)) for f in prims(probe).values()}
    ran = {tuple(_matmul_loops(f)) for name, f in prims(final).items() if "matmul" in name}
    assert ran == timed == {("range 1", "range 64", "T.vectorized 32"), ("range 1", "range 32", "T.vectorized 16")}
    assert all("T.parallel" not in f.script() for f in (*prims(probe).values(), *prims(final).values()))
    small = built.stats["small_gemms"]
    assert small["kept_in_tvm"] == 2 and built.stats["kernels"]["kernels"] == {}
    assert [d["why"] for d in small["decisions"]] == ["fake: tvm 0.3x"] * 2
    load = small["probe_load"]         # what other processes did while the probe ran (None: no tick passed)
    assert load is None or set(load) == {"other_cores", "steal", "cores", "loadavg"}
    assert built.stats["schedules"]["parallel"] is False
