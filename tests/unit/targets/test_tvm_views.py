"""Layout chains next to TVM's torch calls become strided views / one torch copy (issue 14, ``tvm.offload.views``).

Three ways: the Relax IR before/after (golden text: which layout ops are gone, the views each call
reads, in order), numbers against eager PyTorch (1e-5: sequence-first and batch-first attention, HF
BERT with every layout copy moved), and the counts the build reports (``stats["kernels"]``).  The
layout algebra itself is checked against torch's own views, op by op.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.targets.tvm.offload.layouts import Layout, LayoutError

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


def test_rows_widen_round_trip():
    """``rows`` then ``widen``: the rows a linear reads rearranged, as the rows of its output (``[L, N]`` order
    over ``[N, L]`` rows); permuting them back is the output itself, in order."""
    merged = Layout.contiguous((2, 5, 8)).permute((1, 0, 2)).reshape((10, 8))   # [N, L, 8] rows read as [L·N, 8]
    rows = merged.rows(8)
    assert rows == Layout.contiguous((2, 5)).permute((1, 0)).reshape((10,))
    assert rows.widen(8) == merged
    out = rows.widen(3).reshape((5, 2, 3)).permute((1, 0, 2))
    assert out.is_contiguous and not rows.widen(3).is_contiguous
    source = torch.arange(2 * 5 * 3)
    sizes, strides = rows.widen(3).reshape((5, 2, 3)).strided()
    assert torch.equal(source.as_strided(sizes, strides), source.reshape(2, 5, 3).permute(1, 0, 2))


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

    from mlcomp.targets.tvm.offload.chains import decode as _decode
    from tests.unit.targets.test_tvm_kernels import _render

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
    from mlcomp.targets.tvm.config import BuildConfig

    # every GEMM a torch call (no tvm_gemm probe): which calls the views rewrite sees stays deterministic
    return pytest.importorskip("mlcomp.targets.tvm.build").build(module, (x,), BuildConfig(small_gemms=False, **options))

# TinyEncoder (tests/unit/targets/test_tvm_offload_fusions.py): nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
# whose MultiheadAttention runs sequence-first inside.  min_elements=0: every layout copy moves.  The heads
# merge as SDPA left them ([b1, L, b2, D] in memory: permute [0, 2, 1, 3] is free), the out-projection runs
# on those rows, and the sequence-first reorder it would have needed cancels against the permute back to
# batch-first: the residual add reads the out-projection as it is, in place (``add_layer_norm_reuse``).
_ENCODER_AFTER = """\
lv = relax.call_pure_packed(mlcomp.torch.linear, x, const[24x8], const[24])
lv44 = relax.call_pure_packed(mlcomp.torch.attention_views: lv[2x2x5x4/120,4,24,1+0], lv[2x2x5x4/120,4,24,1+8], \
lv[2x2x5x4/120,4,24,1+16], 0.5) -> reshape[2, 2, 5, 4].permute[0, 2, 1, 3].reshape[10, 8]
lv = relax.call_pure_packed(mlcomp.torch.linear, lv44, const[8x8], const[8])
lv54 = relax.reshape(lv, shape)
lv56 = relax.call_pure_packed(mlcomp.torch.add_layer_norm_reuse, x, lv54, const[8], const[8], 1e-05)
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
    from mlcomp.targets.tvm.offload.rewrite import offload
    from tests.unit.targets.test_tvm_offload_fusions import _model, _relax

    model, x = _model(cls, 2, 5, 8)
    module, mod = _relax(model, x)
    after, report = offload(mod, view_min_elements=min_elements)
    return model, x, module, mod, after, report


@pytest.fixture(scope="module")
def encoder():
    from tests.unit.targets.test_tvm_offload_fusions import TinyEncoder

    return _offloaded(TinyEncoder, 0)


@pytest.fixture(scope="module")
def heads_batch_first():
    return _offloaded(HeadsBatchFirst, 0)


@pytest.mark.tvm
def test_sequence_first_attention_golden_ir(encoder):
    """The in-projection runs on x as given (the permute before it commutes through the linear), q/k/v
    are views of its output (scale 0.707² into SDPA), the out-projection reads the heads as SDPA left
    them and the residual add reads its result in place: no permute, take or reshape copy is left."""
    from tests.unit.targets.test_tvm_kernels import _render

    _, _, _, before, after, _ = encoder
    text = "\n".join(_views_render(after["main"]))
    assert text.startswith(_ENCODER_AFTER)
    plain = "\n".join(_render(before["main"]))   # before: _ENCODER_BEFORE in tests/unit/targets/test_tvm_offload_fusions.py
    for op in ("permute_dims", "take", "squeeze", "expand_dims", "multiply", "broadcast_to"):
        assert f"relax.{op}(" in plain and f"relax.{op}(" not in text
    # the default size rule changes nothing here: the merge commute copies nothing, whatever the size
    from mlcomp.targets.tvm.offload.rewrite import offload

    default = "\n".join(_views_render(offload(before)[0]["main"]))
    assert default.startswith(_ENCODER_AFTER) and "permute_dims" not in default


@pytest.mark.tvm
def test_batch_first_attention_golden_ir(heads_batch_first):
    _, _, _, _, after, _ = heads_batch_first
    assert "\n".join(_views_render(after["main"])) == _HEADS_AFTER


@pytest.mark.tvm
def test_report_counts(encoder):
    *_, report = encoder
    counts = {name: v["count"] for name, v in report.to_json()["kernels"].items()}
    assert counts == {"mlcomp.torch.add_layer_norm_reuse": 2, "mlcomp.torch.attention_views": 1,
                      "mlcomp.torch.linear": 4, "mlcomp.torch.linear_gelu": 1,
                      "mlcomp.torch.linear_sigmoid": 1}
    assert any(line.startswith("attention (views) ×1 → torch ") for line in report.lines())


@pytest.mark.tvm
def test_numbers_and_stats_against_eager(encoder):
    model, x, module, *_ = encoder
    built = _build(module, x, view_min_elements=0)
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
    kernels = {k: v["count"] for k, v in built.stats["kernels"]["kernels"].items()}
    assert kernels["mlcomp.torch.attention_views"] == 1 and kernels["mlcomp.torch.add_layer_norm_reuse"] == 2
    assert "mlcomp.torch.attention" not in kernels and "mlcomp.torch.add_layer_norm" not in kernels


@pytest.mark.tvm
def test_batch_first_numbers_against_eager(heads_batch_first):
    """The HF way (batch-first heads, as BERT/ViT write it; the benchmark verifies those two end to end)."""
    model, x, module, *_ = heads_batch_first
    built = _build(module, x, view_min_elements=0)
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
    assert {k: v["count"] for k, v in built.stats["kernels"]["kernels"].items()} == {
        "mlcomp.torch.attention_views": 1, "mlcomp.torch.linear": 2}


def test_views_kernel_against_torch():
    """The ``*_views`` wrapper: ``encode``'s integers, read back by the kernel, are the views torch makes."""
    from mlcomp.targets.tvm.offload.chains import encode
    from mlcomp.targets.tvm.kernels import KERNELS

    torch.manual_seed(0)
    x, w, b = torch.randn(3, 4, 6), torch.randn(5, 4), torch.randn(5)   # linear over x.permute(1, 0, 2)[..., :4]
    spec = encode([(0, (4, 3, 4), (6, 24, 1), 2)], ((4, 3, 5), (1, 0, 2), (3, 20)))
    got = KERNELS["mlcomp.torch.linear_views"].fn(*spec, x.flatten(), w, b)
    view = x.flatten()[2:].as_strided((4, 3, 4), (6, 24, 1))
    want = nn.functional.linear(view, w, b).permute(1, 0, 2).reshape(3, 20)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want)


# ---- issue 14, transformer@32: heads merged where SDPA left them, sums in place, a large mean in torch ----

class SequenceFirstMHA(nn.Module):
    """``nn.MultiheadAttention`` as it comes, sequence-first in and out: its output rows stay in ``[L, N]`` order."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class SharedResidual(nn.Module):
    """``h`` (a linear's result) is read three times: a sum written over it would corrupt the others;
    ``g`` is read once (written first, as BERT writes ``dense(x) + residual``)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin, self.dense, self.norm = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.LayerNorm(dim)

    def forward(self, x):
        h, g = self.lin(x), self.dense(x)
        return self.norm(x + h) + h + self.norm(h + x.relu()) + self.norm(g + x)


class Pool(nn.Module):
    """Two means over the sequence: of a linear's result (moves to torch when large), of a relu (stays)."""

    def __init__(self, dim: int = 256) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(dim, dim), nn.Linear(dim, 4)

    def forward(self, x):
        return self.head(self.lin(x).mean(dim=1)) + self.head(x.relu().mean(dim=1))


def _rewritten(cls, *shape):
    pytest.importorskip("tvm")
    from mlcomp.targets.tvm.offload.rewrite import offload
    from tests.unit.targets.test_tvm_offload_fusions import _model, _relax

    model, x = _model(cls, *shape)
    module, mod = _relax(model, x)
    after, report = offload(mod, view_min_elements=0)
    return model, x, module, "\n".join(_views_render(after["main"])), report


_MHA_AFTER = """\
lv48 = relax.call_pure_packed(mlcomp.torch.attention_views: lv3[2x2x5x4/24,4,48,1+0], lv3[2x2x5x4/24,4,48,1+8], \
lv3[2x2x5x4/24,4,48,1+16], 0.5) -> reshape[2, 2, 5, 4].permute[2, 0, 1, 3].reshape[10, 8]
lv51 = relax.call_pure_packed(mlcomp.torch.linear, lv48, const[8x8], const[8])
gv = relax.reshape(lv51, shape)"""


@pytest.mark.tvm
def test_merge_stays_where_the_row_order_is_needed():
    """Sequence-first output: moving the reorder past the out-projection would not cancel, so the heads
    merge in ``[L, N]`` order as before (one torch copy) and the out-projection reads them as they are."""
    *_, text, _ = _rewritten(SequenceFirstMHA, 5, 2, 8)
    assert text.endswith(_MHA_AFTER)


_SHARED_AFTER = """\
lv11 = relax.call_pure_packed(mlcomp.torch.add_layer_norm, x, lv4, const[8], const[8], 1e-05)
lv12 = relax.add(lv11, lv4)
lv13 = relax.nn.relu(x)
lv15 = relax.call_pure_packed(mlcomp.torch.add_layer_norm, lv4, lv13, const[8], const[8], 1e-05)
lv16 = relax.add(lv12, lv15)
lv18 = relax.call_pure_packed(mlcomp.torch.add_layer_norm_reuse, x, lv9, const[8], const[8], 1e-05)"""


@pytest.mark.tvm
def test_sum_in_place_only_over_a_private_kernel_result():
    """``h`` has other readers and ``relu(x)`` is TVM's: neither sum is written in place; ``g + x`` is, into
    ``g`` (the summands swapped).  Numbers as eager (an in-place sum over ``h`` would change them)."""
    model, x, module, text, report = _rewritten(SharedResidual, 2, 5, 8)
    assert _SHARED_AFTER in text
    assert report.kernels == {"mlcomp.torch.linear": 2, "mlcomp.torch.add_layer_norm": 2,
                              "mlcomp.torch.add_layer_norm_reuse": 1}
    built = _build(module, x, view_min_elements=0)
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)


_POOL_AFTER = """\
lv3 = relax.call_pure_packed(mlcomp.torch.linear, lv, const[256x256], const[256])
lv4 = relax.reshape(lv3, shape)
lv5 = relax.call_pure_packed(mlcomp.torch.mean, lv4, 0, 1)
lv8 = relax.call_pure_packed(mlcomp.torch.linear, lv5, const[4x256], const[4])
lv9 = relax.nn.relu(x)
lv10 = relax.mean(lv9)"""


@pytest.mark.tvm
def test_large_mean_after_a_kernel_runs_in_torch():
    """2×256×256 = MEAN_MIN_ELEMENTS: the mean of the linear goes to torch (keepdims 0, axis 1), the mean of
    TVM's relu stays (it fuses there); one row fewer (2×255×256) and both stay.  Numbers as eager."""
    from mlcomp.targets.tvm.offload.epilogues import MEAN_MIN_ELEMENTS

    assert 2 * 256 * 256 == MEAN_MIN_ELEMENTS
    model, x, module, text, report = _rewritten(Pool, 2, 256, 256)
    assert _POOL_AFTER in text and report.kernels == {"mlcomp.torch.linear": 3, "mlcomp.torch.mean": 1}
    *_, small, report = _rewritten(Pool, 2, 255, 256)
    assert "mlcomp.torch.mean" not in small and small.count("relax.mean(") == 2
    built = _build(module, x)
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
    assert built.stats["kernels"]["kernels"]["mlcomp.torch.mean"]["count"] == 1
