"""The bad-input corpus, options (issues 9-12, 15): pass options outside their range, a backend's real first
error, pruning, mixed precision, loss scaling, rematerialisation and training inputs, each run as a user runs
it, as in ``tests/corpus/test_bad_inputs.py`` (the same checks: the expected exit code, no traceback, a
one-line ``error: …``, nothing left behind in the user's folder).

    case                                                  error
    compile mlp -p fuse{max_group_size=-5}                bad pipeline spec at column …, must be at least 1
    compile histc_model --target onnxruntime              exporting histc_model to ONNX failed: … aten_histc
    compile mlp --train --optimizer "sgd{momentm=0.9}"    optimizer 'sgd' has no option 'momentm'
"""
from __future__ import annotations

import os

import pytest
import torch
from click.testing import CliRunner

from mlcomp.cli.main import main
from tests.corpus.harness import check, snapshot as _snapshot

HISTC_FACTORY = '''
import torch
from torch import nn


class Histogram(nn.Module):
    def forward(self, x):
        return torch.histc(x, bins=4)          # the ONNX exporter cannot translate histc with min == max


def histc_model():
    return Histogram(), (torch.randn(2, 8),)
'''


# ---------------------------------------------------------------------------
# pass options outside their declared range: refused at parse time, before capture.
# Spec errors give the column of the bad value, the spec and the text from there (one line).

@pytest.mark.parametrize("spec, expect", [
    ("fuse{max_group_size=-5}", "option 'max_group_size' of pass 'fuse' must be at least 1, got -5"),
    ("cleanup{max_iterations=0}", "option 'max_iterations' of pass 'cleanup' must be at least 1, got 0"),
    ("fuse{peak_slack=-0.1}", "option 'peak_slack' of pass 'fuse' must be at least 0"),
    # issue 10, mixed precision: a dtype it cannot lower to, an unknown policy
    ("mixed-precision{dtype=int8}", "option 'dtype' of pass 'mixed-precision' expects one of bf16|fp16|auto|fp32, "
                                    "got 'int8'"),
    ("mixed-precision{policy=fastest}", "option 'policy' of pass 'mixed-precision' expects one of "
                                        "default|compute-only"),
])
def test_pass_options_outside_their_range(user_folder, spec, expect):
    before = _snapshot(user_folder)
    cwd = os.getcwd()
    os.chdir(user_folder)
    try:
        res = CliRunner().invoke(main, ["compile", "mlp", "-p", spec, "-o", "out"])
    finally:
        os.chdir(cwd)
    err = res.stderr.strip()
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert err.startswith("error: bad pipeline spec at column") and expect in err, err
    assert len(err.splitlines()) == 1                       # one line: column, spec, what, what to do
    assert _snapshot(user_folder) == before                 # nothing written


# ---------------------------------------------------------------------------
# issue 15: a backend's real first error (op, node, module), and a hint that works when followed

@pytest.mark.ort
def test_onnx_export_failure_names_op_node_and_module(user_folder, tmp_path_factory):
    path = tmp_path_factory.mktemp("factories") / "histc_factory.py"
    path.write_text(HISTC_FACTORY)
    err = check(user_folder, ["compile", f"{path}:histc_model", "--target", "onnxruntime", "-o", "out"], code=3,
                expect=("exporting histc_model to ONNX failed: NotImplementedError: aten_histc",
                        "Where: node %histc (aten.histc.default), module <root> (Histogram)", "--target cpu"))
    assert "exporter log" not in err and "Next steps" not in err


# ---------------------------------------------------------------------------
# issue 11 (pruning): a scope that matches nothing stops the pipeline (a pass failure, exit 3)

def test_prune_scope_that_matches_nothing(user_folder):
    check(user_folder, ["compile", "lenet", "-p", "prune{scope=attention}", "-o", "out"], code=3,
          expect=("matches nothing in graph lenet: it has no head groups", "kinds conv, linear"))


# ---------------------------------------------------------------------------
# issue 10 (mixed precision on targets, loss scaling): a malformed loss scale is refused before capture;
# a low-precision op a target cannot run is refused before the build, listing the nodes

@pytest.mark.parametrize("scale, expect", [
    ("dynamic{init=-1}", "option 'init' of loss-scale mode 'dynamic' must be in (0, inf), got -1.0"),
    ("sometimes", "unknown loss-scale mode 'sometimes'"),
    ("dynamic{interval=ten}", "option 'interval' of loss-scale mode 'dynamic' expects int >= 1, got 'ten'"),
    (0, "a loss scale must be a positive finite number"),
])
def test_malformed_loss_scale(user_folder, scale, expect):
    import mlcomp
    from mlcomp.training.loss_scaling import LossScaleError

    before = _snapshot(user_folder)
    with pytest.raises(LossScaleError) as info:
        mlcomp.compile("mlp", mode="train", loss_scale=scale)
    message = str(info.value)
    assert expect in message and "\n" not in message and "dynamic{init=65536" in message
    assert _snapshot(user_folder) == before


@pytest.mark.tvm
def test_fp16_op_a_target_cannot_run_is_listed():
    from mlcomp.ir.builder import GraphBuilder
    from mlcomp.ir.ops import aten
    from mlcomp.targets import CompileOptions, get_target
    from mlcomp.targets.capabilities import CapabilityError

    b = GraphBuilder("halflinear")
    x = b.call(aten("_to_copy"), b.input("x", (2, 8)), dtype=torch.float16)
    y = b.call(aten("linear"), x, b.param("fc.weight", torch.randn(4, 8).half()),
               b.param("fc.bias", torch.randn(4).half()), origin="fc")
    graph = b.output(b.call(aten("_to_copy"), y, dtype=torch.float32))
    with pytest.raises(CapabilityError) as info:
        get_target("tvm").compile(graph, CompileOptions())
    message = str(info.value)
    assert "target tvm cannot compile halflinear: (1) dtype: target tvm cannot run aten.linear.default in f16" \
        in message and "(used by %linear)" in message and "\n" not in message


# ---------------------------------------------------------------------------
# issue 12 (rematerialisation): bad limits, remat on an inference graph (a saved cap below the minimum:
# tests/unit/passes/test_remat.py::test_saved_cap_below_the_minimum)

@pytest.mark.parametrize("args, code, expect", [
    (["compile", "mlp", "-p", "remat{budget=-1}", "-o", "out"], 2, "option 'budget' of pass 'remat' must be between 0 and 1"),
    (["compile", "mlp", "-p", "remat{saved=12XB}", "-o", "out"], 2, "unknown unit 'XB'"),
    (["compile", "mlp", "-p", "remat", "-o", "out"], 3, "pass 'remat' (pass 1 of 1) runs on training graphs only"),
])
def test_remat_bad_input(user_folder, args, code, expect):
    check(user_folder, args, code=code, expect=(expect,))


# issue 9 (training graphs): a loss that is not a scalar, no trainable parameters, an integer-only
# output, an optimizer spec with an unknown option, --train with onnxruntime, --loss beside a
# factory's own loss: each refused before anything is written
TRAIN_FACTORY = '''
import torch
import torch.nn.functional as F
from torch import nn


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


class ArgMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _net()

    def forward(self, x):
        return self.net(x).argmax(-1)


def per_sample_loss():
    return _net(), (torch.randn(2, 4),), lambda out, y: F.cross_entropy(out, y, reduction="none")


def frozen():
    return _net().requires_grad_(False), (torch.randn(2, 4),)


def integer_output():
    return ArgMax(), (torch.randn(2, 4),)
'''


@pytest.fixture(scope="module")
def train_factory(tmp_path_factory):
    path = tmp_path_factory.mktemp("factories") / "train_factory.py"
    path.write_text(TRAIN_FACTORY)
    return str(path)


@pytest.mark.parametrize("args,expect", [
    (["compile", "FAC:per_sample_loss", "--train", "-o", "out"], "the loss of per_sample_loss is not a scalar"),
    (["compile", "FAC:frozen", "--train", "-o", "out"], "has no parameters that require grad"),
    (["inspect", "FAC:integer_output", "--train"], "returns an integer tensor (torch.int64), which has no gradient"),
    (["compile", "mlp", "--train", "--optimizer", "sgd{lr=0.1 momentm=0.9}", "-o", "out"],
     "optimizer 'sgd' has no option 'momentm'; did you mean 'momentum'?"),
    (["compile", "mlp", "--train", "--optimizer", "adam{lr=0}", "-o", "out"], "must be greater than 0"),
    (["compile", "mlp", "--train", "--target", "onnxruntime", "-o", "out"],
     "target onnxruntime cannot compile training graphs"),
    (["bench", "mlp", "--train", "--targets", "onnxruntime"], "target onnxruntime cannot compile training graphs"),
    (["compile", "FAC:per_sample_loss", "--train", "--loss", "mse", "-o", "out"],
     "returns its own loss function (<lambda>) and --loss mse was given too"),
])
def test_training_bad_inputs(user_folder, train_factory, args, expect):
    check(user_folder, [a.replace("FAC", train_factory) for a in args], expect=(expect,))


# issue 11 (pruning): options and targets that cannot work are refused before the model is loaded;
# the model is the user folder's empty x.pt2, which fails to load if anything tries
@pytest.mark.parametrize("args, expect", [
    (["compile", "x.pt2", "-p", "prune{sparsity=1.0}", "-o", "out"],
     "option 'sparsity' of pass 'prune' must be in [0, 1), got 1.0"),
    (["compile", "x.pt2", "-p", "cleanup,prune{method=2:4}", "-o", "out"],
     "run only on CUDA GPUs of compute capability 8.0 or newer; target cpu cannot run them"),
    (["compile", "x.pt2", "-p", "prune{method=2:4 device=cuda}", "--target", "onnxruntime", "-o", "out"],
     "target onnxruntime cannot run them"),
])
def test_prune_refused_before_capture(user_folder, args, expect):
    err = check(user_folder, args, expect=(expect,))
    assert "x.pt2 is empty" not in err


def test_prune_target_refused_by_the_api_before_capture(user_folder):
    import mlcomp
    from mlcomp.base.errors import PipelineSpecError

    with pytest.raises(PipelineSpecError, match="target onnxruntime cannot run them"):
        mlcomp.compile(str(user_folder / "x.pt2"), target="onnxruntime", pipeline="prune{method=2:4}")


# ---------------------------------------------------------------------------
# issue 10 (mixed precision, finishing): --loss-scale is read by the pipeline grammar and refused before
# capture (compile and bench); a deny pattern that matches nothing compiles, with a warning naming it.
# (dtype=int8: test_pass_options_outside_their_range; fp16 a target cannot run:
# test_fp16_op_a_target_cannot_run_is_listed; fp16 on a CPU measured slow:
# tests/unit/passes/test_mixed_precision.py::test_fp16_on_a_slow_cpu_warns_from_the_probe)

@pytest.mark.parametrize("args, expect", [
    (["compile", "mlp", "--train", "--loss-scale", "dynamic{growth_intervall=5}", "-o", "out"],
     "loss-scale mode 'dynamic' has no option 'growth_intervall'; did you mean 'growth_interval'?"),
    (["bench", "mlp", "--train", "--loss-scale", "-1"], "a loss scale must be a positive finite number"),
])
def test_loss_scale_flag_refused_before_capture(user_folder, args, expect):
    check(user_folder, args, expect=(expect,))


def test_deny_pattern_matching_nothing_warns_by_name(user_folder):
    cwd = os.getcwd()
    os.chdir(user_folder)
    try:
        res = CliRunner().invoke(main, ["compile", "mlp", "-p", "mixed-precision{dtype=bf16 deny=[decoder.*]}",
                                        "-o", "out"])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert "deny pattern 'decoder.*' matched no node" in res.output
