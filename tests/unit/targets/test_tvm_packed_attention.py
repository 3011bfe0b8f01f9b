"""Attention over the heads of one packed q/k/v projection runs eager's steps at two threads or more and torch's
flash kernel at one (``tvm.kernels.attention_from_packed``, policy row ``attention-gemms``), the projection's bias
added in the attention's split pass (``tvm.offload.views._bias_into_split``): which torch kernels the build
calls, numbers against eager."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from mlcomp.targets.tvm.kernels import GEMM_ATTENTION_THREADS, attention_from_packed, packed_qkv
from mlcomp.targets.tvm.offload.policy import rule


def _run(built, x, threads: int) -> tuple[torch.Tensor, set[str]]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), profile() as prof:
            out = built(x)[0]
    finally:
        torch.set_num_threads(before)
    return out, {e.key for e in prof.key_averages()}


@pytest.mark.tvm
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_heads_run_eager_steps_from_two_threads(encoder, threads):
    model, x, built = encoder
    out, ran = _run(built, x, threads)
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu" in ran
    eager_steps = {"aten::_transform_bias_rescale_qkv", "aten::baddbmm", "aten::bmm", "aten::_softmax"} <= ran
    assert (flash, eager_steps) == ((False, True) if threads >= GEMM_ATTENTION_THREADS else (True, False)), ran
    assert "aten::mm" in ran          # the in-projection without its bias (the out-projection and FFN keep theirs)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_only_the_heads_of_one_packed_projection_qualify():
    qkv = torch.randn(2, 5, 24)
    q, k, v = qkv.view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
    assert packed_qkv(q, k, v).data_ptr() == qkv.data_ptr()
    other = qkv.clone().view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
    assert packed_qkv(q, other[1], v) is None                    # k from another tensor
    assert packed_qkv(k, q, v) is None                           # order: q, k, v side by side
    assert packed_qkv(q.contiguous(), k, v) is None              # not a view of the rows
    assert packed_qkv(*(t.double() for t in (q, k, v))) is None
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(attention_from_packed(qkv, 2, 0.25), ref)


def test_at_batch_one_the_stride_of_the_batch_axis_is_not_read():
    """The build's views give a size-1 batch axis stride 0 (transformer@1): still the heads of the packed rows."""
    qkv = torch.randn(1, 5, 24)
    q, k, v = (qkv.as_strided((1, 2, 5, 4), (0, 4, 24, 1), 8 * i) for i in range(3))
    assert packed_qkv(q, k, v).data_ptr() == qkv.data_ptr()
    assert packed_qkv(q, k, v.as_strided((1, 2, 5, 4), (0, 4, 23, 1), 16)) is None   # a row stride still is
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(attention_from_packed(qkv, 2, 0.25), ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_attention_kernel_adds_a_given_bias_to_q_k_v(threads):
    from mlcomp.targets.tvm.kernels import KERNELS

    torch.manual_seed(0)
    qkv, bias = torch.randn(2, 5, 24), torch.randn(24)
    want = [t.clone() for t in (qkv + bias).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)]
    attend, before = KERNELS["mlcomp.torch.attention"].fn, torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for swap in (False, True):          # packed q/k/v, and views that are not (k and v swapped)
            q, k, v = qkv.clone().view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
            bq, bk, bv = bias.view(3, 8)
            got = attend(q, v, k, 0.5, torch.cat([bq, bv, bk])) if swap else attend(q, k, v, 0.5, bias)
            wq, wk, wv = want
            ref = torch.nn.functional.scaled_dot_product_attention(wq, wk, wv, scale=0.5)
            torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(
                wq, wv, wk, scale=0.5) if swap else ref)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_over_views_of_other_tensors_runs_flash_without_a_bias(threads):
    from mlcomp.targets.tvm.kernels import KERNELS

    q, k, v = torch.randn(3, 2, 2, 5, 4).unbind(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = KERNELS["mlcomp.torch.attention"].fn(q, k, v, 0.5)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5))


def test_the_policy_row_states_the_kernels_bound():
    assert rule("attention-gemms").min_size == GEMM_ATTENTION_THREADS == 2
