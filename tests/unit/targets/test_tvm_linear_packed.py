"""targets/tvm/offload/linear_packed.py: large linears on oneDNN with build-time packed weights, activation fused.

Relax before/after the pass (which calls moved, the policy's size bound, a host without the kernel), the kernels'
numbers against eager, the offload report and packed-weight keys, and one build saved and loaded (the loaded
module packs its weights again at its first call).
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

tvm_backend = pytest.importorskip("mlcomp.targets.tvm.build")
from mlcomp.targets.tvm.kernels import KERNELS, PACKED_WEIGHTS, packed_linear_available  # noqa: E402
from mlcomp.targets.tvm.module import TvmModule  # noqa: E402
from mlcomp.targets.tvm.offload.linear_packed import pack_linears  # noqa: E402
from mlcomp.targets.tvm.offload.policy import HostFacts, rule  # noqa: E402
from mlcomp.targets.tvm.offload.rewrite import OffloadReport  # noqa: E402

pytestmark = [pytest.mark.tvm, pytest.mark.skipif(not packed_linear_available(),
                                                  reason="torch without mkldnn._linear_pointwise")]
ROWS = 64     # 64 x 256 x 1024 multiply-adds: exactly the policy's bound


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"w1": g.standard_normal((1024, 256), dtype=np.float32) / 16, "b1": g.standard_normal(1024, dtype=np.float32),
            "w2": g.standard_normal((256, 1024), dtype=np.float32) / 32, "b2": g.standard_normal(256, dtype=np.float32),
            "w3": g.standard_normal((8, 256), dtype=np.float32), "b3": g.standard_normal(8, dtype=np.float32)}


def _module(rows: int):
    """``main(x) = linear(linear(linear_relu(x, w1, b1), w2, b2), w3, b3)`` as torch kernel calls in Relax."""
    from tvm import relax

    w = {k: relax.const(v) for k, v in _weights().items()}
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, 256), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            call = lambda name, a, i, n: bb.emit(relax.call_pure_packed(   # noqa: E731
                f"mlcomp.torch.{name}", a, w[f"w{i}"], w[f"b{i}"], ty_args=relax.TensorType((rows, n), "float32")))
            y = call("linear_relu", x, 1, 1024)
            y = call("linear", y, 2, 256)
            out = bb.emit_output(call("linear", y, 3, 8))
        bb.emit_func_output(out)
    return bb.get()


def _kernels(mod) -> list[str]:
    from tvm import relax

    found: list[str] = []
    relax.analysis.post_order_visit(mod["main"], lambda e: found.append(str(e.args[0].global_symbol)) if isinstance(
        e, relax.Call) and getattr(e.op, "name", "") == "relax.call_pure_packed" else None)
    return found


def test_ir_before_after_and_the_size_bound():
    report = OffloadReport()
    report.kernels.update({"mlcomp.torch.linear_relu": 1, "mlcomp.torch.linear": 2})
    assert rule("linear-packed").min_size == ROWS * 256 * 1024
    before = _module(ROWS)
    assert _kernels(before) == ["mlcomp.torch.linear_relu", "mlcomp.torch.linear", "mlcomp.torch.linear"]
    after, moved = pack_linears(before, HostFacts(), report)
    # the two GEMMs at the bound moved; the 64 x 256 x 8 classifier stayed F.linear
    assert _kernels(after) == ["mlcomp.torch.linear_packed_relu", "mlcomp.torch.linear_packed", "mlcomp.torch.linear"]
    assert moved == {"mlcomp.torch.linear": 1, "mlcomp.torch.linear_relu": 1}
    assert dict(report.kernels) == {"mlcomp.torch.linear": 1, "mlcomp.torch.linear_packed": 1,
                                    "mlcomp.torch.linear_packed_relu": 1}
    assert len(report.packed) == 2 and len(set(report.packed)) == 2
    from tvm import relax

    bindings = after["main"].body.blocks[0].bindings
    keys = [int(getattr(b.value.args[4].value, "value", b.value.args[4].value)) for b in bindings[:2]]
    assert keys == report.packed and all(isinstance(k, int) for k in keys)   # each moved call carries its key
    assert len(bindings[2].value.args) == 4 and isinstance(bindings[2].value.args[1], relax.Var)   # x, w, b
    # one row fewer: under the bound, nothing moves; a host without oneDNN's linear: nothing moves
    for mod, host in ((_module(ROWS - 1), HostFacts()), (_module(ROWS), HostFacts(packed_linear=False))):
        same, none = pack_linears(mod, host, OffloadReport())
        assert none == {} and _kernels(same) == _kernels(before)


@pytest.mark.parametrize("act", ["", "_relu", "_sigmoid", "_gelu", "_gelu_tanh"])
def test_packed_kernels_match_eager(act):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 32, 64), torch.randn(96, 64) / 8, torch.randn(96)
    eager = F.linear(x, w, b)
    eager = {"": eager, "_relu": eager.relu(), "_sigmoid": eager.sigmoid(), "_gelu": F.gelu(eager),
             "_gelu_tanh": F.gelu(eager, approximate="tanh")}[act]
    key = 7_000 + len(act)
    got = KERNELS[f"mlcomp.torch.linear_packed{act}"].fn(x, w, b, key)
    assert got.shape == eager.shape and torch.allclose(got, eager, atol=1e-4, rtol=1e-4)
    assert KERNELS[f"mlcomp.torch.linear_packed{act}"].fn(x, w, torch.empty(0), key).shape == eager.shape
    PACKED_WEIGHTS.release([key])


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.head = nn.Linear(256, 1024), nn.Linear(1024, 256), nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(x))))


@pytest.mark.slow       # a build (~25 s here); the pass and the kernels are covered above
def test_build_save_load_repacks(tmp_path):
    torch.manual_seed(0)
    model, x = _Mlp().eval(), torch.randn(2 * ROWS, 256)      # relu of 128 x 1024: fused (relu-after-linear)
    built = tvm_backend.build(model, (x,), tvm_backend.BuildConfig(deterministic=True, small_gemms=False))
    assert built.stats["linears_packed"] == {"mlcomp.torch.linear": 1, "mlcomp.torch.linear_relu": 1}
    ops = {o["kernel"]: o for o in built.stats["offload"]["ops"]}
    assert ops["linear_packed_relu"]["rule"] == "linear-packed" and ops["linear"]["rule"] == "linear"
    assert ops["linear_packed_relu"]["also"] == ["relu-after-linear"]
    keys = built.stats["packed_weight_keys"]
    assert len(keys) == 2
    with torch.no_grad():
        eager = model(x)
        assert torch.allclose(built(x)[0], eager, atol=1e-4, rtol=1e-4)
    built.save(str(tmp_path / "m"))
    del built
    gc.collect()
    assert all(k not in PACKED_WEIGHTS._packed for k in keys)       # nobody holds them: dropped
    loaded = TvmModule.load(str(tmp_path / "m"))
    assert torch.allclose(loaded(x)[0], eager, atol=1e-4, rtol=1e-4)
    assert all(k in PACKED_WEIGHTS._packed for k in keys)           # packed again at the first call
