"""Untuned TVM with vendor kernels (targets/tvm/offload, targets/tvm/kernels.py) and default schedules
(targets/tvm/schedules.py).

Three ways: the Relax IR before/after the offload (golden text), numbers against eager
(conv with BatchNorm, depthwise and asymmetric padding, linear, matmul), and the stats the
build reports (which op ran in which kernel, how many TIR functions were scheduled).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.tvm

tvm_backend = pytest.importorskip("mlcomp.targets.tvm.build")


class Tiny(nn.Module):
    """conv + BatchNorm + relu, depthwise conv, mean, linear, a matmul by a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4, bias=False)
        self.fc = nn.Linear(4, 5)
        self.register_buffer("proj", torch.randn(5, 2))

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        y = self.dw(y).mean((2, 3))
        return self.fc(y) @ self.proj


def _tiny():
    torch.manual_seed(0)
    model = Tiny().eval()
    with torch.no_grad():   # a BatchNorm with real statistics, so folding it is not a no-op
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    return model, torch.randn(2, 3, 8, 8)


def _render(func) -> list[str]:
    """The bindings of ``func``'s dataflow block, one line each: ``var = op(args)`` (constants by shape)."""
    import tvm
    from tvm import relax

    def arg(a):
        if isinstance(a, tvm.ir.expr.GenericConst):
            return "const[" + "x".join(str(int(d)) for d in a.ty.shape) + "]"
        if isinstance(a, relax.ExternFunc):
            return str(a.global_symbol)
        if isinstance(a, tvm.ir.expr.Var):
            return a.name
        if isinstance(a, relax.ShapeExpr):
            return "shape"
        value = getattr(a.value, "value", a.value)
        return f"{value:g}" if isinstance(value, float) else str(int(value))

    lines = []
    for block in func.body.blocks:
        for b in block.bindings:
            v = b.value
            if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op):
                lines.append(f"{b.var.name} = {v.op.name}({', '.join(arg(a) for a in v.args)})")
    return lines


@pytest.fixture(scope="module")
def relax_before_after():
    import tvm
    from tvm.relax.frontend.torch import from_exported_program

    from mlcomp.targets.tvm.offload.rewrite import offload

    model, x = _tiny()
    mod = from_exported_program(torch.export.export(model, (x,)), keep_params_as_input=False)
    mod = tvm_backend.prepare(mod, tvm.target.Target("llvm"))
    plain, report = offload(mod, frozenset())
    fused, _ = offload(mod)
    return _render(mod["main"]), _render(plain["main"]), report, _render(fused["main"])


_BEFORE = """\
lv = relax.nn.conv2d(x, const[4x3x3x3])
lv9 = relax.add(lv, const[1x4x1x1])
lv5 = relax.nn.relu(lv9)
lv6 = relax.nn.conv2d(lv5, const[4x1x3x3])
lv7 = relax.mean(lv6)
lv9 = relax.matmul(lv7, const[4x5])
lv10 = relax.add(const[5], lv9)
lv11 = relax.matmul(lv10, const[5x2])"""

# conv2d args: input, weight, bias (empty: none), strides h w, padding top left bottom right, dilation h w, groups
_AFTER = """\
lv = relax.call_pure_packed(mlcomp.torch.conv2d, x, const[4x3x3x3], const[0], 2, 2, 1, 1, 1, 1, 1, 1, 1)
lv9 = relax.add(lv, const[1x4x1x1])
lv5 = relax.nn.relu(lv9)
lv6 = relax.call_pure_packed(mlcomp.torch.conv2d, lv5, const[4x1x3x3], const[0], 1, 1, 1, 1, 1, 1, 1, 1, 4)
lv7 = relax.mean(lv6)
lv10 = relax.call_pure_packed(mlcomp.torch.linear, lv7, const[5x4], const[5])
lv11 = relax.call_pure_packed(mlcomp.torch.matmul, lv10, const[5x2])"""


def test_offload_golden_ir(relax_before_after):
    """conv2d (plain and depthwise), linear (matmul + bias add) and matmul go to the kernels; the
    conv's bias and BatchNorm, folded into its weight and one bias add, relu and mean stay in Relax for TVM to fuse."""
    before, after, _, fused = relax_before_after
    assert "\n".join(before) == _BEFORE
    assert "\n".join(after) == _AFTER
    assert "\n".join(fused) == _AFTER    # the fusions: no sigmoid/gelu after a kernel, no attention or norm


def test_offload_report_counts_each_op(relax_before_after):
    _, _, report, _ = relax_before_after
    assert report.to_json()["kernels"] == {
        "mlcomp.torch.conv2d": {"op": "conv2d", "count": 2, "runs_in": report.to_json()["kernels"][
            "mlcomp.torch.conv2d"]["runs_in"]},
        "mlcomp.torch.linear": {"op": "linear", "count": 1, "runs_in": report.to_json()["kernels"][
            "mlcomp.torch.linear"]["runs_in"]},
        "mlcomp.torch.matmul": {"op": "matmul", "count": 1, "runs_in": report.to_json()["kernels"][
            "mlcomp.torch.matmul"]["runs_in"]},
    }
    assert report.to_json()["kept_in_tvm"] == []
    assert report.lines()[0].startswith("conv2d ×2 → torch ") and "oneDNN" in report.lines()[0]


@pytest.fixture(scope="module")
def built_tiny():
    model, x = _tiny()
    return model, x, tvm_backend.build(model, (x,), tvm_backend.BuildConfig(small_gemms=False))   # every GEMM a torch call: counts fixed


def test_numbers_and_stats_against_eager(built_tiny):
    model, x, mod = built_tiny
    with torch.no_grad():
        torch.testing.assert_close(mod(x)[0], model(x), rtol=1e-5, atol=1e-5)
    kernels = mod.stats["kernels"]["kernels"]
    assert {k: v["count"] for k, v in kernels.items()} == {"mlcomp.torch.conv2d": 2, "mlcomp.torch.linear": 1,
                                                           "mlcomp.torch.matmul": 1}
    from mlcomp.hardware.probe import vector_bits

    # the module calls torch's kernels: TVM's own code is serial (torch's thread pool owns the cores)
    assert mod.stats["schedules"] == {"scheduled": mod.stats["schedules"]["scheduled"], "unscheduled": 0,
                                      "vector_bits": vector_bits(), "parallel": False, "parallel_loops": 0,
                                      "row_reductions": 0}
    assert mod.stats["schedules"]["scheduled"] >= 2


def test_asymmetric_padding_conv_kernel():
    """Relax pads top/left/bottom/right separately; the kernel pads the input when they differ."""
    from mlcomp.targets.tvm.kernels import KERNELS

    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    out = KERNELS["mlcomp.torch.conv2d"].fn(x, w, torch.zeros(0), 1, 1, 0, 1, 2, 0, 1, 1, 1)
    ref = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (1, 0, 0, 2)), w)
    torch.testing.assert_close(out, ref)


def test_parallel_vector_schedule_on_an_elementwise_func():
    """Before: a serial loop nest; after: one parallel outer loop and a vector loop at the host's width."""
    import tvm
    from tvm import te

    from mlcomp.hardware.probe import vector_bits
    from mlcomp.targets.tvm.schedules import default_rules, schedule_counts

    a = te.placeholder((64, 1024), name="a")
    b = te.compute(a.shape, lambda i, j: te.max(a[i, j] + 1.0, 0.0), name="b")
    mod = tvm.IRModule({"add_relu": te.create_prim_func([a, b]).with_attr("global_symbol", "add_relu")})
    target = tvm.target.Target("llvm")
    assert "T.parallel" not in mod.script() and schedule_counts(mod) == {"scheduled": 0, "unscheduled": 1}
    from tvm.s_tir import dlight as dl

    with target:
        after = dl.ApplyDefaultSchedule(*default_rules(target, vector_bits()))(mod)
    text = after.script()
    lanes = vector_bits() // 32
    assert "T.parallel" in text and f"T.vectorized({lanes})" in text, text
    assert schedule_counts(after) == {"scheduled": 1, "unscheduled": 0}
    f = tvm.compile(after, target=target)
    x = torch.randn(64, 1024)
    y = torch.empty_like(x)
    f["add_relu"](x, y)
    torch.testing.assert_close(y, torch.relu(x + 1))


def test_saved_module_carries_its_kernels_and_loads(built_tiny, tmp_path):
    model, x, mod = built_tiny
    files = mod.save(str(tmp_path / "art"))
    assert files == ["model.so", "meta.json", "kernels.py"]
    again = tvm_backend.TvmModule.load(str(tmp_path / "art"))
    with torch.no_grad():
        torch.testing.assert_close(again(x)[0], model(x), rtol=1e-5, atol=1e-5)
    # the copy imports only torch and tvm_ffi: a loader without mlcomp can register the kernels from it
    text = (tmp_path / "art" / "kernels.py").read_text()
    imports = [ln for ln in text.splitlines() if ln.startswith(("import ", "from "))]
    assert all("mlcomp" not in ln for ln in imports), imports


def test_tune_cli_refuses_a_file_as_database(tmp_path):
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    db = tmp_path / "db.json"
    db.write_text("{}")
    result = CliRunner().invoke(main, ["tune", "mlp", "--trials", "2", "--db", str(db)])
    assert result.exit_code != 0
    assert "'--db'" in result.output and "is a file" in result.output
    assert "Traceback" not in result.output


def _softmax_and_relu_mod():
    """Two PrimFuncs: a row softmax-like reduction (DLight Reduction: a row of 1023, which no vector width
    divides, so not RowReduction's) and an elementwise add+relu (ParallelVector)."""
    import tvm
    from tvm import te

    a, r = te.placeholder((64, 1024), name="a"), te.placeholder((64, 1023), name="a")
    k = te.reduce_axis((0, 1023), name="k")
    s = te.compute((64,), lambda i: te.sum(r[i, k], axis=k), name="s")
    norm = te.compute(r.shape, lambda i, j: r[i, j] / s[i], name="norm")
    relu = te.compute(a.shape, lambda i, j: te.max(a[i, j] + 1.0, 0.0), name="relu")
    return tvm.IRModule({"norm": te.create_prim_func([r, norm]).with_attr("global_symbol", "norm"),
                         "relu": te.create_prim_func([a, relu]).with_attr("global_symbol", "relu")})


@pytest.mark.parametrize("parallel", [True, False])
def test_serial_rules_keep_vector_loops_and_drop_parallel_ones(parallel):
    """parallel=False (a module calling torch's kernels): the same schedules minus every parallel loop."""
    import tvm
    from tvm.s_tir import dlight as dl

    from mlcomp.hardware.probe import vector_bits
    from mlcomp.targets.tvm.schedules import default_rules, parallel_loops, schedule_counts

    mod, target = _softmax_and_relu_mod(), tvm.target.Target("llvm")
    with target:
        after = dl.ApplyDefaultSchedule(*default_rules(target, vector_bits(), parallel=parallel))(mod)
    assert schedule_counts(after) == {"scheduled": 2, "unscheduled": 0}
    # one parallel loop per func (Reduction's spatial loop, ParallelVector's fused outer loop), or none
    assert parallel_loops(after) == (2 if parallel else 0)
    relu, norm = after["relu"].script(), after["norm"].script()
    assert f"T.vectorized({vector_bits() // 32})" in relu          # ParallelVector's lanes either way
    assert "T.vectorized(" in norm and "s[v0] = s[v0] + a[v0, v1]" in norm   # Reduction's body, still fused
    if not parallel:
        assert "for ax0 in range(64):" in norm, norm                  # the spatial loop Reduction parallelised
    f = tvm.compile(after, target=target)
    x, y = torch.randn(64, 1023), torch.empty(64, 1023)
    f["norm"](x, y)
    torch.testing.assert_close(y, x / x.sum(1, keepdim=True), rtol=1e-4, atol=1e-5)
    x, y = torch.randn(64, 1024), torch.empty(64, 1024)
    f["relu"](x, y)
    torch.testing.assert_close(y, torch.relu(x + 1))


def test_call_scopes_torch_threads_and_leaves_the_process_as_it_was(built_tiny):
    """threads=1: torch's kernels see 1 thread during the call; afterwards the count, the core affinity
    and the process's threads (TVM's pool never starts: no parallel loop) are what they were."""
    import os

    from mlcomp.targets.tvm.target import TvmRuntime

    model, x, mod = built_tiny
    seen = []

    class Recording:      # the real module, noting torch's thread count while it runs
        device, stats = mod.device, mod.stats

        def __call__(self, *inputs):
            seen.append(torch.get_num_threads())
            return mod(*inputs)

    before = torch.get_num_threads()
    want = 1 if before > 1 else 2
    runtime = TvmRuntime(Recording(), tuned=False, threads=want)
    runtime(x)                           # warm: torch's own pool may start on a first call
    tasks, affinity = len(os.listdir("/proc/self/task")), os.sched_getaffinity(0)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(runtime(x)[0], model(x), rtol=1e-5, atol=1e-5)
    assert seen == [want] * 4 and torch.get_num_threads() == before
    assert os.sched_getaffinity(0) == affinity and len(os.listdir("/proc/self/task")) == tasks
    assert any("run serially" in line for line in runtime.explain_lines())
