"""Torch kernels of a TVM build write into tensors the Relax VM plans and pools (``tvm.offload.destinations``):
which calls do, the storages the VM allocates for them, what torch still allocates, numbers against eager."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from mlcomp.targets.tvm.kernels import INTO_KERNELS, KERNELS, Activation


def _into(name: str, *args, shape):
    out = torch.full(shape, float("nan"))
    assert INTO_KERNELS[f"{name}_into"].fn(*args, out) is None
    return out


@pytest.mark.parametrize("act", [None, *Activation])
def test_a_linear_into_a_given_tensor_is_the_linear(act):
    torch.manual_seed(0)
    a, w, b = torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    name = "mlcomp.torch.linear" + ("" if act is None else f"_{act.value}")
    for bias in (b, torch.empty(0)):
        want = KERNELS[name].fn(a, w, bias)
        torch.testing.assert_close(_into(name, a, w, bias, shape=(2, 3, 5)), want)
    strided = torch.randn(3, 2, 8).transpose(0, 1)       # a *_views argument: copied before the GEMM
    torch.testing.assert_close(_into(name, strided, w, b, shape=(2, 3, 5)), KERNELS[name].fn(strided, w, b))


def test_a_mean_and_a_rearranged_views_result_land_in_the_given_tensor():
    x = torch.randn(2, 6, 4)
    torch.testing.assert_close(_into("mlcomp.torch.mean", x, 0, 1, shape=(2, 4)), x.mean(1))
    # attention over [1, 2, 3, 4] heads, the result's heads merged: [1, 3, 2, 4] -> [3, 8]
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    spec = [0, 12, 4, 1, 2, 3, 4, 0, 2, 1, 3, 2, 3, 8]
    want = KERNELS["mlcomp.torch.attention_views"].fn(*spec, q, k, v, 0.5)
    torch.testing.assert_close(_into("mlcomp.torch.attention_views", *spec, q, k, v, 0.5, shape=(3, 8)), want)
    torch.testing.assert_close(want, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5)
                               .permute(0, 2, 1, 3).reshape(3, 8))


def test_only_copy_free_kernels_get_a_destination_variant():
    assert {"mlcomp.torch.linear_into", "mlcomp.torch.linear_gelu_into", "mlcomp.torch.mean_into",
            "mlcomp.torch.attention_views_into"} <= set(INTO_KERNELS)
    # no out= that does not copy: SDPA, layer norm, convolutions (their *_views: only a rearranged result)
    assert not {"mlcomp.torch.attention_into", "mlcomp.torch.layer_norm_into", "mlcomp.torch.conv2d_into"} \
        & set(INTO_KERNELS)
    assert not KERNELS["mlcomp.torch.attention_views"].into and KERNELS["mlcomp.torch.linear_views"].into


@pytest.mark.tvm
def test_the_encoders_products_and_attention_write_into_planned_storage(encoder):
    model, x, built = encoder
    into = built.stats["kernels_into"]
    assert into.get("mlcomp.torch.attention_views") == 1 and sum(into.values()) >= 3, into
    text = built._ex.as_text()
    storages = text.count("vm.builtin.alloc_storage")
    assert sum(text.count(f"{name}_into in:") for name in into) == sum(into.values())
    assert storages <= 3, text       # planned: values that do not live at once share one storage
    with torch.no_grad(), profile(profile_memory=True) as prof:
        first = built(x)[0]
    gemms = [e for e in prof.key_averages() if e.key in ("aten::addmm", "aten::mm")]
    assert gemms and all(e.self_cpu_memory_usage == 0 for e in gemms), [(e.key, e.self_cpu_memory_usage) for e in gemms]
    with torch.no_grad():
        want, y = model(x), torch.randn_like(x)
        second = built(y)[0]            # the next call's buffers are not the results handed out before
        torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(second, model(y), rtol=1e-5, atol=1e-5)


@pytest.mark.tvm
def test_a_result_handed_out_is_not_the_next_calls_destination():
    """The model's output is a linear's, written into a tensor the VM allocated: each call hands out its own."""
    from mlcomp.targets.tvm.build import BuildConfig, build

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).eval()
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    built = build(model, (x,), BuildConfig(deterministic=True))
    assert built.stats["kernels_into"] == {"mlcomp.torch.linear": 2}
    with torch.no_grad():
        first, second = built(x)[0], built(y)[0]
        assert first.data_ptr() != second.data_ptr()
        torch.testing.assert_close(first, model(x))
        torch.testing.assert_close(second, model(y))
