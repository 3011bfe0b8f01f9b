"""Layout chains next to TVM's torch calls become strided views / one torch copy (issue 14, ``tvm_views``).

Three ways: the Relax IR before/after (golden text: which layout ops are gone, the views each call
reads, in order), numbers against eager PyTorch (1e-5: sequence-first and batch-first attention, HF
BERT with every layout copy moved), and the counts the build reports (``stats["kernels"]``).  The
layout algebra itself is checked against torch's own views, op by op.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.targets.tvm_layouts import Layout, LayoutError

# ---- the layout algebra against torch (no TVM) ----------------------------------------------------

def _apply(layout: Layout, t: torch.Tensor, op: str, *args):
    """One op on both: the layout and a torch view of ``arange`` (the reference)."""
    if op == "reshape":
        return layout.reshape(args[0]), t.reshape(args[0])
    if op == "permute":
        return layout.permute(args[0]), t.permute(args[0])
    if op == "expand_dims":
        return layout.expand_dims(args[0]), t.unsqueeze(args[0][0])
    if op == "squeeze":
        return layout.squeeze(args[0]), t.squeeze(args[0][0])
    if op == "select":
        return layout.select(*args), t.select(*args)
    if op == "narrow":
        return layout.narrow(*args), t.narrow(*args)
    return layout.broadcast(args[0]), t.expand(args[0])


_QKV_SPLIT = [("reshape", (5, 2, 3, 8)), ("expand_dims", (0,)), ("permute", (3, 1, 2, 0, 4)), ("squeeze", (3,)),
              ("select", 0, 1), ("reshape", (5, 4, 4)), ("permute", (1, 0, 2)), ("reshape", (2, 2, 5, 4))]


@pytest.mark.parametrize("chain", [
    _QKV_SPLIT,                                                            # MHA's q/k/v split, sequence-first
    [("reshape", (5, 2, 2, 12)), ("permute", (1, 2, 0, 3)), ("select", 3, -1)],   # batch-first head split
    [("select", 0, 1), ("expand_dims", (0,)), ("broadcast", (3, 2, 24))],   # broadcast: stride 0
    [("narrow", 2, 8, 8), ("reshape", (5, 2, 2, 4)), ("permute", (1, 2, 0, 3))],  # a piece of split (chunk)
])
def test_layout_matches_torch_views(chain):
    source = torch.arange(5 * 2 * 24)
    layout, ref = Layout.contiguous((5, 2, 24)), source.reshape(5, 2, 24)
    for op, *args in chain:
        layout, ref = _apply(layout, ref, op, *args)
        assert layout.shape == tuple(ref.shape)
    sizes, strides = layout.strided()
    assert torch.equal(source.as_strided(sizes, strides, layout.offset), ref)


def test_layout_gather_and_refusals():
    source = torch.arange(2 * 2 * 5 * 4)
    # attention's output merged back sequence-first: [B=4, L, D] -> [L*N, H*D], not one strided view
    layout = Layout.contiguous((4, 5, 4)).reshape((2, 2, 5, 4)).permute((2, 0, 1, 3)).reshape((10, 8))
    assert layout.strided() is None
    f, p, s = layout.gather(80)
    assert (f, p, s) == ((2, 2, 5, 4), (2, 0, 1, 3), (10, 8))
    assert torch.equal(source.reshape(f).permute(p).reshape(s),
                       source.reshape(4, 5, 4).reshape(2, 2, 5, 4).permute(2, 0, 1, 3).reshape(10, 8))
    assert Layout.contiguous((3, 4)).select(0, 1).gather(12) is None        # offset: not a rearrangement
    assert Layout.contiguous((3, 4)).select(0, 0).gather(12) is None        # a third of the source
    assert Layout.contiguous((3, 4)).permute((1, 0)).gather(12) == ((3, 4), (1, 0), (4, 3))
    with pytest.raises(LayoutError):
        Layout.contiguous((6, 4)).permute((1, 0)).reshape((3, 8))           # a mode of 4 split by 3


# ---- the Relax rewrite -------------------------------------------------------------------------------

class HeadsBatchFirst(nn.Module):
    """Attention written the HF way: batch-first head split/merge around SDPA, then an output linear."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        n, length, dim = x.shape
        q, k, v = (t.view(n, length, self.heads, dim // self.heads).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(n, length, dim))


def _arg(a) -> str:
    import tvm

    if isinstance(a, tvm.ir.expr.GenericConst):
        return "const[" + "x".join(str(int(d)) for d in a.ty.shape) + "]"
    if isinstance(a, tvm.ir.expr.Var):
        return a.name
    value = getattr(a.value, "value", a.value)
    return f"{value:.4g}" if isinstance(value, float) else str(int(value))


def _views_render(func) -> list[str]:
    """``_render`` with each ``*_views`` call's integer spec decoded: ``arg=var[sizes/strides+offset]``."""
    import tvm
    from tvm import relax

    from mlcomp.targets.tvm_views import _decode
    from tests.test_tvm_kernels import _render

    lines = _render(func)
    calls = [b for block in func.body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]
    out = []
    for line, b in zip(lines, calls):
        head = line.split("(", 1)[0]
        if "_views" not in line:
            out.append(line)
            continue
        views, gather, args = _decode(b.value)
        names = [_arg(a) for a in args]
        for pos, sizes, strides, off in views:
            names[pos] += f"[{'x'.join(map(str, sizes))}/{','.join(map(str, strides))}+{off}]"
        tail = f" -> reshape{list(gather[0])}.permute{list(gather[1])}.reshape{list(gather[2])}" if gather else ""
        out.append(f"{head}({b.value.args[0].global_symbol}: {', '.join(names)}){tail}")
    return out


def _build(module, x, **options):
    return pytest.importorskip("mlcomp.targets.tvm_backend").build(module, (x,), **options)

# TinyEncoder (tests/test_tvm_offload_fusions.py): nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
# whose MultiheadAttention runs sequence-first inside.  min_elements=0: every layout copy moves.
_ENCODER_AFTER = """\
lv = relax.call_pure_packed(mlcomp.torch.linear, x, const[24x8], const[24])
lv49 = relax.call_pure_packed(mlcomp.torch.attention_views: lv[2x2x5x4/120,4,24,1+0], lv[2x2x5x4/120,4,24,1+8], \
lv[2x2x5x4/120,4,24,1+16], 0.5) -> reshape[2, 2, 5, 4].permute[2, 0, 1, 3].reshape[10, 8]
lv52 = relax.call_pure_packed(mlcomp.torch.linear, lv49, const[8x8], const[8])
lv56 = relax.call_pure_packed(mlcomp.torch.add_layer_norm_views: x, lv52[2x5x8/8,16,1+0], const[8], const[8], 1e-05)
lv57 = relax.reshape(lv56, shape)"""

# the same attention written batch-first (HF style): q/k/v are pieces of a split (narrowed views, no copy)
# and the heads merge back batch-first
_HEADS_AFTER = """\
lv = relax.reshape(x, shape)
lv3 = relax.call_pure_packed(mlcomp.torch.linear, lv, const[24x8], const[24])
lv44 = relax.call_pure_packed(mlcomp.torch.attention_views: lv3[2x2x5x4/120,4,24,1+0], lv3[2x2x5x4/120,4,24,1+8], \
lv3[2x2x5x4/120,4,24,1+16], 0.5) -> reshape[2, 2, 5, 4].permute[0, 2, 1, 3].reshape[2, 5, 8]
gv = relax.call_pure_packed(mlcomp.torch.linear, lv44, const[8x8], const[8])"""


def _offloaded(cls, min_elements):
    pytest.importorskip("tvm")
    from mlcomp.targets.tvm_offload import offload
    from tests.test_tvm_offload_fusions import _model, _relax

    model, x = _model(cls, 2, 5, 8)
    module, mod = _relax(model, x)
    after, report = offload(mod, view_min_elements=min_elements)
    return model, x, module, mod, after, report


@pytest.fixture(scope="module")
def encoder():
    from tests.test_tvm_offload_fusions import TinyEncoder

    return _offloaded(TinyEncoder, 0)


@pytest.mark.tvm
def test_sequence_first_attention_golden_ir(encoder):
    """The in-projection runs on x as given (the permute before it commutes through the linear), q/k/v
    are views of its output (scale 0.707² into SDPA), the heads merge in torch, and the residual add
    reads the out-projection through a view: no permute, take or reshape copy is left for TVM."""
    from tests.test_tvm_kernels import _render

    _, _, _, before, after, _ = encoder
    text = "\n".join(_views_render(after["main"]))
    assert text.startswith(_ENCODER_AFTER)
    plain = "\n".join(_render(before["main"]))   # before: _ENCODER_BEFORE in tests/test_tvm_offload_fusions.py
    for op in ("permute_dims", "take", "squeeze", "expand_dims", "multiply", "broadcast_to"):
        assert f"relax.{op}(" in plain and f"relax.{op}(" not in text
    # a small layout copy stays in TVM by default (cheaper there than a torch call): only attention's views move
    from mlcomp.targets.tvm_offload import offload

    default = "\n".join(_views_render(offload(before)[0]["main"]))
    assert "attention_views" in default and "add_layer_norm_views" not in default
    assert "lv54 = relax.permute_dims(lv53)" in default


@pytest.mark.tvm
def test_batch_first_attention_golden_ir():
    _, _, _, _, after, _ = _offloaded(HeadsBatchFirst, 0)
    assert "\n".join(_views_render(after["main"])) == _HEADS_AFTER


@pytest.mark.tvm
def test_report_counts(encoder):
    *_, report = encoder
    counts = {name: v["count"] for name, v in report.to_json()["kernels"].items()}
    assert counts == {"mlcomp.torch.add_layer_norm": 1, "mlcomp.torch.add_layer_norm_views": 1,
                      "mlcomp.torch.attention_views": 1, "mlcomp.torch.linear": 4, "mlcomp.torch.linear_gelu": 1,
                      "mlcomp.torch.linear_sigmoid": 1}
    assert any(line.startswith("attention (views) ×1 → torch ") for line in report.lines())


@pytest.mark.tvm
def test_numbers_and_stats_against_eager(encoder):
    model, x, module, *_ = encoder
    built = _build(module, x, view_min_elements=0)
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
    kernels = {k: v["count"] for k, v in built.stats["kernels"]["kernels"].items()}
    assert kernels["mlcomp.torch.attention_views"] == 1 and kernels["mlcomp.torch.add_layer_norm_views"] == 1
    assert "mlcomp.torch.attention" not in kernels


@pytest.mark.tvm
def test_batch_first_numbers_against_eager():
    """The HF way (batch-first heads, as BERT/ViT write it; the benchmark verifies those two end to end)."""
    model, x, module, *_ = _offloaded(HeadsBatchFirst, 0)
    built = _build(module, x, view_min_elements=0)
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
    assert {k: v["count"] for k, v in built.stats["kernels"]["kernels"].items()} == {
        "mlcomp.torch.attention_views": 1, "mlcomp.torch.linear": 2}


def test_views_kernel_against_torch():
    """The ``*_views`` wrapper: ``encode``'s integers, read back by the kernel, are the views torch makes."""
    from mlcomp.targets.tvm_kernels import KERNELS
    from mlcomp.targets.tvm_views import encode

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 4, 6), torch.randn(5, 4), torch.randn(5)   # linear over x.permute(1, 0, 2)[..., :4]
    spec = encode([(0, (4, 3, 4), (6, 24, 1), 2)], ((4, 3, 5), (1, 0, 2), (3, 20)))
    got = KERNELS["mlcomp.torch.linear_views"].fn(*spec, x.flatten(), w, b)
    view = x.flatten()[2:].as_strided((4, 3, 4), (6, 24, 1))
    want = nn.functional.linear(view, w, b).permute(1, 0, 2).reshape(3, 20)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want)
