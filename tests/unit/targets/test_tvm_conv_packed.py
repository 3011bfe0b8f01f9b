"""targets/tvm/offload/conv_packed.py (issue 14): NHWC Relax around convs, prepacked oneDNN calls with fused epilogues.

Relax after the rewrite (which ops became which packed calls, in order), numbers against eager,
stats, a save/load round trip that repacks, the channels-last rule, and the tuned-vs-untuned pick
with a fake clock.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.tvm

tvm_backend = pytest.importorskip("mlcomp.targets.tvm.build")
from mlcomp.targets.tvm.offload import conv_packed as packed  # noqa: E402
from mlcomp.targets.tvm.kernels import KERNELS, PACKED_WEIGHTS, packed_conv_available  # noqa: E402
from mlcomp.targets.tvm.offload.rewrite import offload  # noqa: E402

needs_onednn = pytest.mark.skipif(not packed_conv_available(), reason="torch without mkldnn._convolution_pointwise")


class Block(nn.Module):
    """conv+BN+relu, conv+BN + residual + relu, 1×1 conv+BN+relu6 (small: unpacked), pool, linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64)
        self.c2, self.b2 = nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64)
        self.c3, self.b3 = nn.Conv2d(64, 64, 1, bias=False), nn.BatchNorm2d(64)
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)) + x)
        y = F.relu6(self.b3(self.c3(y)))
        return self.fc(y.mean((2, 3)))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Block()
    for bn in (m.b1, m.b2, m.b3):   # non-trivial folded shifts
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.data.uniform_(0.5, 1.5)
        bn.bias.data.uniform_(-0.5, 0.5)
    return m.eval(), (torch.randn(1, 64, 24, 24),)


@pytest.fixture(scope="module")
def built(model):
    return tvm_backend.build(*model, tvm_backend.BuildConfig(small_gemms=False))     # the classifier's linear stays a torch call


def _relax(m: nn.Module, inputs: tuple) -> object:
    from tvm.relax.frontend.torch import from_exported_program

    target = tvm_backend.make_target("cpu")
    ep = torch.export.export(m, inputs)
    return tvm_backend.prepare(from_exported_program(ep, keep_params_as_input=False,
                                                      unwrap_unit_return_tuple=True), target), target


def _calls(mod) -> list[str]:
    """The main function's bound calls in order: packed-function names, else Relax op names."""
    out = []
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            op = getattr(getattr(v, "op", None), "name", None)
            if op == "relax.call_pure_packed":
                out.append(str(v.args[0].global_symbol))
            elif op:
                out.append(op.removeprefix("relax."))
    return out


@needs_onednn
def test_relax_before_and_after(model):
    mod, target = _relax(*model)
    assert packed.channels_last_reason(mod) is None
    assert _calls(mod) == ["nn.conv2d", "add", "nn.relu", "nn.conv2d", "add", "add", "nn.relu", "nn.conv2d", "add",
                           "clip", "mean", "matmul", "add"]
    with target:
        nhwc = packed.to_channels_last(mod)
    assert _calls(nhwc) == ["permute_dims", "nn.conv2d", "add", "nn.relu", "nn.conv2d", "add", "add", "nn.relu",
                            "nn.conv2d", "add", "clip", "permute_dims", "mean", "matmul", "add"]
    convs = [b.value for b in nhwc["main"].body.blocks[0].bindings if _calls_one(b.value) == "nn.conv2d"]
    assert {(str(c.attrs.data_layout), str(c.attrs.kernel_layout)) for c in convs} == {("NHWC", "OHWI")}
    after, report = offload(nhwc)
    assert _calls(after) == ["permute_dims", "mlcomp.torch.conv2d_cl_relu", "mlcomp.torch.conv2d_cl_add_relu",
                             "mlcomp.torch.conv2d_cl_hardtanh", "permute_dims", "mean", "mlcomp.torch.linear"]
    calls = [b.value for b in after["main"].body.blocks[0].bindings]
    residual = calls[2]
    # the residual add reads the NHWC input itself; the 1×1 conv (2.4 M MACs) runs unpacked: key 0
    assert residual.args[4].same_as(after["main"].body.blocks[0].bindings[0].var)
    keys = [int(c.args[12].value) for c in calls[1:4]]
    assert keys[0] and keys[1] and keys[2] == 0 and sorted(report.packed) == sorted(keys[:2])
    assert [float(c.args[13].value) for c in calls[3:4]] + [float(calls[3].args[14].value)] == [0.0, 6.0]


def _calls_one(v) -> str | None:
    op = getattr(getattr(v, "op", None), "name", None)
    return op.removeprefix("relax.") if op else None


@needs_onednn
def test_numbers_and_stats_against_eager(model, built):
    m, inputs = model
    with torch.no_grad():
        ref = m(*inputs)
    out = built(*inputs)[0]
    assert float((out - ref).norm() / ref.norm()) <= 1e-5
    assert built.stats["conv_layout"]["layout"] == "NHWC"
    counts = {k: v["count"] for k, v in built.stats["kernels"]["kernels"].items()}
    assert counts == {"mlcomp.torch.conv2d_cl_relu": 1, "mlcomp.torch.conv2d_cl_add_relu": 1,
                      "mlcomp.torch.conv2d_cl_hardtanh": 1, "mlcomp.torch.linear": 1}
    assert built.stats["kernels"]["kept_in_tvm"] == []
    assert len(built.stats["packed_weight_keys"]) == 2
    assert all(k in PACKED_WEIGHTS._packed for k in built.stats["packed_weight_keys"])


@needs_onednn
def test_save_load_repacks_after_release(model, built, tmp_path):
    m, inputs = model
    with torch.no_grad():
        ref = m(*inputs)
    keys = list(built.stats["packed_weight_keys"])
    built.save(str(tmp_path / "art"))
    PACKED_WEIGHTS.release(keys * 8)   # as if no module held them: the loaded one must pack again
    assert not any(k in PACKED_WEIGHTS._packed for k in keys)
    loaded = tvm_backend.TvmModule.load(str(tmp_path / "art"))
    out = loaded(*inputs)[0]
    assert float((out - ref).norm() / ref.norm()) <= 1e-5
    assert all(k in PACKED_WEIGHTS._packed for k in keys) and all(PACKED_WEIGHTS._holders[k] == 1 for k in keys)
    del loaded
    import gc

    gc.collect()   # the last holder gone: its packed weights are dropped
    assert not any(k in PACKED_WEIGHTS._packed for k in keys)


def test_kernels_match_conv2d_packed_and_unpacked():
    torch.manual_seed(1)
    x, w, b, o = torch.randn(2, 9, 9, 8), torch.randn(16, 8, 3, 3), torch.randn(16), torch.randn(2, 9, 9, 16)
    ref = F.relu(F.conv2d(x.permute(0, 3, 1, 2), w, b, 1, 1) + o.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    fn = KERNELS["mlcomp.torch.conv2d_cl_add_relu"].fn
    args = (1, 1, 1, 1, 1, 1, 1)
    unpacked = fn(x, w, b, o, *args, 0)
    assert unpacked.is_contiguous() and torch.allclose(unpacked, ref, rtol=1e-4, atol=1e-5)
    if packed_conv_available():
        key = packed.weight_key(w.numpy(), [1, 1, 1, 1, 1, 1, 1], (2, 8, 9, 9))
        got = fn(x, w, b, o, *args, key)
        PACKED_WEIGHTS.release([key])
        assert got.is_contiguous() and torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    clip = KERNELS["mlcomp.torch.conv2d_cl_hardtanh"].fn(x, w, b, torch.zeros(0), *args, 0, 0.0, 6.0)
    assert torch.allclose(clip, F.relu6(F.conv2d(x.permute(0, 3, 1, 2), w, b, 1, 1)).permute(0, 2, 3, 1),
                          rtol=1e-4, atol=1e-5)


def test_channels_last_rule():
    small = nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.Sigmoid()).eval()
    mod, _ = _relax(small, (torch.randn(1, 1, 28, 28),))
    reason = packed.channels_last_reason(mod) if packed_conv_available() else "x"
    assert reason and ("multiply-adds" in reason or not packed_conv_available())
    mod, _ = _relax(nn.Sequential(nn.Linear(4, 4)).eval(), (torch.randn(1, 4),))
    assert packed.channels_last_reason(mod) == "no conv2d"
    assert packed.worth_packing((64, 64, 3, 3), (1, 2, 2, 64))
    assert not packed.worth_packing((64, 64, 1, 1), (1, 24, 24, 64))          # 2.4 M MACs
    assert packed.worth_packing((512, 256, 1, 1), (32, 8, 8, 512))            # 268 M MACs


class _FakeClock:
    """Time advances only when a runner runs: by its fixed cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def runner(self, cost: float):
        def run(*_):
            self.now += cost
        return run


# as fast is decided too: every ratio 1.0 lies above the 0.9 a tuned build must beat
@pytest.mark.parametrize("tuned_cost, winner, verdict", [(2.0, "untuned", "decided"), (0.5, "tuned", "decided"),
                                                          (1.0, "untuned", "decided")])
def test_tuned_build_is_kept_only_when_faster(tuned_cost, winner, verdict):
    clock = _FakeClock()
    best, times = tvm_backend.faster({"untuned": clock.runner(1.0), "tuned": clock.runner(tuned_cost)}, (),
                                     clock=clock)
    assert best == winner
    assert times["untuned_ms"] == 1000.0 and times["tuned_ms"] == tuned_cost * 1000 and times["rounds"] >= 6
    assert times["decision"]["verdict"] == verdict and times["decision"]["choice"] == winner


def test_deterministic_build_keeps_the_untuned_one_untimed():
    def never(*_) -> None:
        raise AssertionError("a deterministic build timed a candidate")
    best, times = tvm_backend.faster({"untuned": never, "tuned": never}, (), deterministic=True)
    assert best == "untuned" and times["rounds"] == 0 and times["decision"]["verdict"] == "fixed"


def test_tuning_space_without_parallel_loops_next_to_torch_kernels():
    from tvm.s_tir import meta_schedule as ms

    from mlcomp.targets.tvm.tuning import _space

    assert _space(True) == "post-order-apply"
    rules = [r for r in _space(False).sch_rules if isinstance(r, ms.schedule_rule.ParallelizeVectorizeUnroll)]
    assert len(rules) == 1 and int(rules[0].max_jobs_per_core) == -1 and int(rules[0].max_vectorize_extent) > 0
