"""Attention over the heads of one packed q/k/v projection runs eager's steps at two threads or more and torch's
flash kernel at one (``tvm.kernels.attention_from_packed``, policy row ``attention-gemms``): which torch kernels
the build calls, numbers against eager."""
from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from mlcomp.targets.tvm.kernels import GEMM_ATTENTION_THREADS, attention_from_packed, packed_qkv
from mlcomp.targets.tvm.offload.policy import rule


@pytest.fixture(scope="module")
def encoder():
    from tests.unit.targets.test_tvm_offload_fusions import TinyEncoder
    from tests.unit.targets.test_tvm_views import _build, _offloaded

    model, x, module, *_ = _offloaded(TinyEncoder, 0)
    return model, x, _build(module, x, view_min_elements=0)


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


def test_the_policy_row_states_the_kernels_bound():
    assert rule("attention-gemms").min_size == GEMM_ATTENTION_THREADS == 2
