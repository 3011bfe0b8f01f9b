"""Builds shared by the TVM target's tests (each built once per session)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def encoder():
    """One encoder layer whose in-projection (4·64 rows × 128 → 384: 12.6 M multiply-adds) is above the
    small-GEMM probe's bound, so its bias moves into the attention."""
    from mlcomp.targets.tvm.config import BuildConfig

    build = pytest.importorskip("mlcomp.targets.tvm.build").build
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True).eval()
    with torch.no_grad():
        model.self_attn.in_proj_bias.normal_()          # a bias that matters
    x = torch.randn(4, 64, 128)
    return model, x, build(model, (x,), BuildConfig(deterministic=True))
