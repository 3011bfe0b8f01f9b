"""Weight arithmetic folded in numpy before TVM's ``FoldConstant`` (``targets.tvm.const_fold``): the same module
and the same bits as TVM's own folding, with nothing of the table left for TVM to compile."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm


def _batchnorm_weights(exp: bool = False):
    """A conv whose weight is scaled as FoldBatchnormToConv2D leaves it, then transposed (as ConvertLayout does)."""
    import tvm
    from tvm import relax

    rng = np.random.default_rng(0)
    c = lambda *shape: relax.const(rng.standard_normal(shape).astype("float32"))  # noqa: E731
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            var = relax.const((rng.random(4) + 0.5).astype("float32"))
            std = bb.emit(relax.op.sqrt(bb.emit(relax.op.add(var, relax.const(1e-5, "float32")))))
            scale = bb.emit(relax.op.divide(c(4), std))
            if exp:
                scale = bb.emit(relax.op.exp(scale))           # not in the table: TVM folds it
            w = bb.emit(relax.op.multiply(c(4, 3, 3, 3), bb.emit(relax.op.reshape(scale, (4, 1, 1, 1)))))
            w_ohwi = bb.emit(relax.op.permute_dims(w, [0, 2, 3, 1]))
            xt = bb.emit(relax.op.permute_dims(x, [0, 2, 3, 1]))
            y = bb.emit(relax.op.nn.conv2d(xt, w_ohwi, data_layout="NHWC", kernel_layout="OHWI"))
            out = bb.emit_output(relax.op.add(y, bb.emit(relax.op.negative(c(1, 1, 1, 4)))))
        bb.emit_func_output(out)
    return bb.get()


def _constant_calls(mod) -> list[str]:
    """The calls of table ops whose operands are all constants, or computed from constants only (what TVM
    would compile to fold them)."""
    import tvm
    from tvm import relax

    from mlcomp.targets.tvm.const_fold import FOLDERS

    const, found = set(), []
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, tvm.ir.expr.Constant):
                const.add(b.var)
            elif isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and all(
                    isinstance(a, (relax.ShapeExpr, tvm.ir.expr.Constant)) or a in const
                    or isinstance(getattr(a, "value", None), (int, float)) for a in v.args):
                found += [v.op.name] if v.op.name in FOLDERS else []
                const.add(b.var)
    return found


def test_numpy_folding_gives_tvms_module_bit_for_bit():
    from tvm import relax
    import tvm

    from mlcomp.targets.tvm.const_fold import fold_constants_module

    mod = _batchnorm_weights()
    assert sorted(_constant_calls(mod)) == ["relax.add", "relax.divide", "relax.multiply", "relax.negative",
                                            "relax.permute_dims", "relax.reshape", "relax.sqrt"]
    folded, count = fold_constants_module(mod)
    assert count == 7 and _constant_calls(folded) == []
    ours, theirs = relax.transform.FoldConstant()(folded), relax.transform.FoldConstant()(mod)
    tvm.ir.assert_structural_equal(ours, theirs)          # constants compared by content
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype("float32")
    run = lambda m: relax.VirtualMachine(tvm.compile(m, target="llvm"), tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()  # noqa: E731
    np.testing.assert_array_equal(run(ours), run(theirs))


def test_ops_outside_the_table_and_what_reads_them_are_left_to_tvm():
    from mlcomp.targets.tvm.const_fold import fold_constants_module

    folded, count = fold_constants_module(_batchnorm_weights(exp=True))
    # sqrt, add, divide and the negated bias fold; exp does not, so the reshape/multiply/permute after it wait for TVM
    assert count == 4
    assert _constant_calls(folded) == ["relax.reshape", "relax.multiply", "relax.permute_dims"]


def test_a_core_aten_reexport_is_imported_without_a_second_decomposition():
    """An mlcomp graph re-exported is core ATen (plus reshape): the importer's decomposition would give the
    same Relax module, so it is skipped; an op outside core ATen (an in-place add) keeps it."""
    import torch
    import tvm
    from torch import nn
    from tvm.relax.frontend.torch import from_exported_program

    from mlcomp.targets.tvm.lowering import core_aten_only

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(16, 2)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).reshape(1, 4, 36)[..., :16])

    x = torch.randn(1, 3, 8, 8)
    core = torch.export.export(Block().eval(), (x,)).run_decompositions()
    assert core_aten_only(core)
    tvm.ir.assert_structural_equal(from_exported_program(core, run_ep_decomposition=False),
                                   from_exported_program(core, run_ep_decomposition=True))

    class InPlace(nn.Module):
        def forward(self, x):
            return x.add_(1.0)

    assert not core_aten_only(torch.export.export(InPlace(), (torch.randn(2),)))


def test_a_folded_int64_constant_keeps_its_dtype_and_tvm_folds_what_reads_it():
    """BART's ``shift_tokens_right``: a start token broadcast to [2, 16] (int64) chosen by a where against the
    shifted ids.  The folded constant is int64 as the binding says (relax.const alone narrows it to int32, and
    TVM's FoldConstant then refuses the where: int32 against int64)."""
    import tvm
    from tvm import relax

    from mlcomp.targets.tvm.const_fold import fold_constants

    bb = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType((2, 16), "int64"))
    with bb.function("main", [ids]):
        with bb.dataflow():
            start = bb.emit(relax.op.broadcast_to(relax.const(2, "int64"), (2,)))
            full = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(start, [1])), (2, 16)))
            first = relax.const(np.arange(16).reshape(1, 16).repeat(2, 0) == 0)
            out = bb.emit_output(relax.op.where(first, full, ids))
        bb.emit_func_output(out)
    func, count = fold_constants(bb.get()["main"])
    assert count == 3
    consts = [b.value for b in func.body.blocks[0].bindings if hasattr(b.value, "value")
              and hasattr(b.value.value, "__dlpack__")]
    assert consts and all(np.from_dlpack(c.value).dtype == np.int64 for c in consts)
    mod = relax.transform.FoldConstant()(tvm.IRModule({"main": func}))       # raised a TypeError before
    ex = tvm.compile(mod, "llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(np.full((2, 16), 7, dtype="int64"))).numpy()
    expected = np.full((2, 16), 7, dtype="int64")
    expected[:, 0] = 2
    np.testing.assert_array_equal(got, expected)
