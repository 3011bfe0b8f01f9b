"""1-d convolutions in a TVM build run as height-1 conv2d in torch's kernel (``offload/conv1d.py``).

The IR before/after the rewrite, the build's numbers against eager for strides, padding, dilation, groups and
a fused bias + GELU, the build's report (every conv1d in a torch kernel, none left as TVM code), and a conv1d
that stays TVM code (bf16) with its reason.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.tvm

tvm_backend = pytest.importorskip("mlcomp.targets.tvm.build")

from mlcomp.targets.tvm.config import BuildConfig  # noqa: E402
from mlcomp.targets.tvm.offload.chains import static_shape  # noqa: E402
from mlcomp.targets.tvm.offload.conv1d import conv1d_reason, conv1ds  # noqa: E402


class Signal(nn.Module):
    """wav2vec2's pieces: a strided conv without bias + GELU, a dilated one, a grouped padded one + GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv1d(1, 8, 10, stride=5, bias=False)
        self.b = nn.Conv1d(8, 8, 3, stride=2, dilation=2)
        self.c = nn.Conv1d(8, 8, 16, padding=8, groups=2)

    def forward(self, x):
        y = self.b(nn.functional.gelu(self.a(x)))
        return nn.functional.gelu(self.c(y)) + y[..., :1]


def _relax(model: nn.Module, x: torch.Tensor):
    from tvm.relax.frontend.torch import from_exported_program

    return from_exported_program(torch.export.export(model, (x,)), keep_params_as_input=False)


def _ops(func) -> list[str]:
    from tvm import relax

    names: list[str] = []
    relax.analysis.post_order_visit(func, lambda e: names.append(e.op.name) if isinstance(e, relax.Call)
                                    and hasattr(e.op, "name") else None)
    return names


def test_each_conv1d_becomes_a_height_one_conv2d_between_reshapes():
    torch.manual_seed(0)
    mod = _relax(nn.Sequential(nn.Conv1d(4, 6, 5, stride=2, padding=3, dilation=2, groups=2)).eval(),
                 torch.randn(2, 4, 40))
    before = _ops(mod["main"])
    after_func = conv1ds(mod["main"])
    after = _ops(after_func)
    assert before.count("relax.nn.conv1d") == 1 and "relax.nn.conv2d" not in before
    assert "relax.nn.conv1d" not in after and after.count("relax.nn.conv2d") == 1
    assert after.count("relax.reshape") == before.count("relax.reshape") + 2
    from tvm import relax
    convs: list = []
    relax.analysis.post_order_visit(after_func, lambda e: convs.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", "") == "relax.nn.conv2d" else None)
    a = convs[0].attrs
    assert [int(s) for s in a.strides] == [1, 2] and [int(p) for p in a.padding] == [0, 3, 0, 3]
    assert [int(d) for d in a.dilation] == [1, 2] and int(a.groups) == 2
    assert static_shape(convs[0].args[1]) == (6, 2, 1, 5)      # the OIW weight as OIHW, H = 1


def test_the_build_runs_every_conv1d_in_torch_and_matches_eager():
    torch.manual_seed(0)
    model, x = Signal().eval(), torch.randn(2, 1, 400)
    built = tvm_backend.build(model, (x,), BuildConfig(deterministic=True))
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-4, atol=1e-5)
    offload = built.stats["offload"]
    convs = [o for o in offload["ops"] if o["op"].startswith("conv")]
    assert len(convs) == 3 and all(o["runs"] == "torch kernel" for o in convs), convs
    assert "conv1d" not in offload["other_ops"]
    assert any(o["kernel"].endswith("gelu") for o in convs)          # the activation rode into the conv's call


def test_a_bf16_conv1d_stays_tvm_code_and_says_why():
    torch.manual_seed(0)
    mod = _relax(nn.Conv1d(4, 4, 3, bias=False).eval().to(torch.bfloat16), torch.randn(1, 4, 16, dtype=torch.bfloat16))
    from tvm import relax
    calls: list = []
    relax.analysis.post_order_visit(mod["main"], lambda e: calls.append(e) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", "") == "relax.nn.conv1d" else None)
    assert conv1d_reason(calls[0]) == "dtype bfloat16/float32"      # TVM's importer: a float32 result
    assert _ops(conv1ds(mod["main"])).count("relax.nn.conv1d") == 1
