"""Bad input: each case gives a one-paragraph MlcompError, a non-zero exit, no traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from mlcomp.base.errors import CaptureError, InputSpecError, ModelLoadError, UnsafePickleError
from mlcomp.cli.main import main
from mlcomp.frontend.loading import load_model, save_torchscript

DATA = Path(__file__).resolve().parents[1] / "data"
FACTORIES = DATA / "factories.py"


def run_cli(*args: str):
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code != 0, res.output
    assert "Traceback" not in res.output
    assert res.output.startswith("error: ")
    assert "\n" not in res.output.strip()          # one paragraph
    return res.output


def test_missing_file():
    out = run_cli("inspect", "no/such/model.pt")
    assert "no/such/model.pt does not exist" in out and "zoo name" in out


def test_empty_file(tmp_path):
    f = tmp_path / "empty.pt"
    f.write_bytes(b"")
    assert "is empty" in run_cli("inspect", str(f))


def test_truncated_archive(tmp_path):
    good = tmp_path / "good.pt"
    save_torchscript(torch.nn.Linear(4, 2), (torch.randn(1, 4),), good)
    data = good.read_bytes()
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data[: len(data) // 2])
    out = run_cli("inspect", str(bad))
    assert "bad.pt" in out and ("corrupt" in out or "truncated" in out or "not a TorchScript" in out)


def test_pickle_refused_without_trust(tmp_path):
    f = tmp_path / "whole.pt"
    torch.save(torch.nn.Linear(4, 2), f)
    out = run_cli("inspect", str(f), "--input-shape", "1x4")
    assert "execute code" in out and "--trust-pickle" in out
    with pytest.raises(UnsafePickleError):
        load_model(str(f))
    res = CliRunner().invoke(main, ["inspect", str(f), "--input-shape", "1x4", "--trust-pickle"])
    assert res.exit_code == 0, res.output


def test_state_dict_is_explained(tmp_path):
    f = tmp_path / "weights.pt"
    torch.save(torch.nn.Linear(4, 2).state_dict(), f)
    assert "state dict" in run_cli("inspect", str(f))


def test_wrong_input_shape_syntax_and_value():
    out = run_cli("inspect", f"{FACTORIES}:small_mlp", "--input-shape", "1by8")
    assert "1by8" in out and "1x3x32x32" in out
    out = run_cli("inspect", f"{FACTORIES}:small_mlp", "--input-shape", "1x5")
    assert "--input-shape" in out
    with pytest.raises(InputSpecError):
        load_model(f"{FACTORIES}:small_mlp").inputs()


def test_missing_shapes_asks_for_input_shape():
    assert "--input-shape" in run_cli("inspect", f"{FACTORIES}:small_mlp")


def test_data_dependent_control_flow_names_the_line():
    out = run_cli("inspect", f"{FACTORIES}:branchy")
    assert "data-dependent control flow" in out and "torch.cond" in out
    assert "factories.py:10" in out
    with pytest.raises(CaptureError):
        load_model(f"{FACTORIES}:branchy").capture(method="fx")


def test_scripted_data_dependent_branch_refused(tmp_path):
    from tests.data.factories import Branchy

    f = tmp_path / "branchy.pt"
    torch.jit.save(torch.jit.script(Branchy()), str(f))
    out = run_cli("inspect", str(f), "--input-shape", "2x3")
    assert "data-dependent" in out and "prim::If" in out


def test_factory_errors():
    assert "does not exist" in run_cli("inspect", "missing_dir/model.py:build")
    assert "has no function nope" in run_cli("inspect", f"{FACTORIES}:nope")
    assert "not an nn.Module" in run_cli("inspect", f"{FACTORIES}:not_a_module")
    assert "cannot be imported" in run_cli("inspect", "no_such_package.models:build")
    with pytest.raises(ModelLoadError):
        load_model("no_such_package.models:build")


def test_factory_with_inputs_and_module_path():
    res = CliRunner().invoke(main, ["inspect", f"{FACTORIES}:small_mlp_with_inputs"])
    assert res.exit_code == 0, res.output
    assert "input: f32[3, 8]" in res.output    # nn.Sequential names its argument "input"


# a fresh process (~4 CPU-s): the fast suite checks a real ``python -m mlcomp`` user error (exit code 2, one
# paragraph, no traceback) in tests/integration/test_cli_targets.py::
# test_user_errors_exit_without_traceback_in_a_real_process, and the missing-file message in process above
@pytest.mark.slow
def test_real_process_exit_code_and_no_traceback(tmp_path):
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "mlcomp", "inspect", str(tmp_path / "nope.pt2")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------
# issue 15: a backend's real first error (op, node, module path), not its boilerplate

ONNX_FAILURE = (
    "Failed to convert the exported program to an ONNX model. \x1b[96mThis is step 3/3\x1b[0m of exporting the "
    "model to ONNX. Next steps:\n- If there is a missing ONNX function, implement it and register it to the "
    "registry.\n\n## Exception summary\n\n<class 'torch.onnx._internal.exporter._errors.DispatchError'>: No ONNX "
    "function found for <OpOverload(op='aten._convolution', overload='default')>. Failure message: No "
    "decompositions registered for the real-valued input\n⬆️\n<class 'torch.onnx._internal.exporter._errors."
    "ConversionError'>: Error when translating node %conv : [num_users=1] = call_function[target=torch.ops.aten."
    "_convolution.default](args = (%x,), kwargs = {}). See the stack trace for more information.\n\n(Refer to "
    "the full stack trace above for more information.)")

DYNAMO_FAILURE = (
    "Dynamic control flow is not supported at the moment. Please use functorch.experimental.control_flow.cond "
    "to explicitly capture the control flow.\n\nfrom user code:\n   File \"model.py\", line 3, in forward\n"
    "    if x.sum() > 0:\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace (please do this especially "
    "if you're reporting a bug to PyTorch). For even more developer context, set TORCH_LOGS=\"+dynamo\"\n\n"
    "Use tlparse to see full graph. (https://github.com/pytorch/tlparse?tab=readme-ov-file#tlparse-parse-structured-pt2-logs)")


def test_onnx_exporter_error_names_the_op_node_and_module():
    from mlcomp.ir import Origin
    from mlcomp.targets.backend_errors import first_error

    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3)))
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    node.name = "conv"
    node.meta["mlcomp_origin"] = Origin("features.0", "Conv2d")
    failure = first_error(RuntimeError(ONNX_FAILURE), gm)
    assert failure.message == ("DispatchError: No ONNX function found for aten._convolution.default. Failure "
                               "message: No decompositions registered for the real-valued input")
    assert failure.where() == "node %conv (aten._convolution.default), module features.0 (Conv2d)"


def test_tvm_and_dynamo_errors_skip_the_advice_lines():
    from mlcomp.targets.backend_errors import first_error

    failure = first_error(RuntimeError(DYNAMO_FAILURE))
    assert failure.message.startswith("RuntimeError: Dynamic control flow is not supported")
    assert "tlparse" not in failure.message and failure.where() is None
    native = RuntimeError("Traceback (most recent call last):\n  0: tvm::relax::Foo\n  1: bar\n"
                          "  File \"/src/tvm/x.cc\", line 3\nInternalError: Check failed: (ndim == 4) is false: "
                          "conv2d expects 4-d input for aten.convolution.default")
    failure = first_error(native)
    assert failure.message.startswith("InternalError: Check failed: (ndim == 4)")
    assert failure.op == "aten.convolution.default"
