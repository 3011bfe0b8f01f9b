"""One vocabulary: what the help, the README, `run`, exported files and the API call things agree.

* every target list in help text comes from the registry (:func:`mlcomp.targets.registry.target_list`);
* the tuning folder is ``--tuning-dir`` for ``compile`` and ``tune`` (``tune --db``: a hidden old name);
* the README's zoo line is the zoo;
* an exported ONNX file's outputs carry the names ``mlcomp run`` prints;
* ``TrainingArtifact.step(*inputs, y)`` takes ``y`` positionally or by name.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from mlcomp.cli.main import main
from mlcomp.targets.registry import TargetName
from tests.corpus.harness import REPO, check


def _help(*args: str) -> str:
    res = CliRunner().invoke(main, [*args, "--help"])
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())


@pytest.mark.parametrize("command", [(), ("compile",)])
def test_help_lists_every_registered_target(command):
    text = _help(*command)
    for name in TargetName:
        assert name.value in text, (name, command)


def test_one_name_for_the_tuning_folder():
    assert "--tuning-dir" in _help("compile") and "--tuning-dir" in _help("tune")
    assert "--db" not in _help("tune")                                      # the old name is hidden


def test_tune_old_and_new_tuning_flags_disagreeing(user_folder):
    check(user_folder, ["tune", "mlp", "--trials", "1", "--db", "a", "--tuning-dir", "b"], code=2,
          expect=("--db a and --tuning-dir b name two tuning folders", "--tuning-dir only"))


def test_readme_zoo_line_is_the_zoo():
    from mlcomp.models import ZOO

    line = next(ln for ln in (REPO / "README.md").read_text().splitlines() if "# the zoo:" in ln)
    assert [n.strip() for n in line.split("# the zoo:")[1].split(",")] == list(ZOO)


def _invoke(folder, args):
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return CliRunner().invoke(main, args)
    finally:
        os.chdir(cwd)


def test_run_names_its_input_file(user_folder, artifact):
    torch.save(torch.randn(1, 512), user_folder / "x.pt")
    res = _invoke(user_folder, ["run", str(artifact), "--input", "x.pt"])
    assert res.exit_code == 0, res.output
    assert "ran on the inputs in x.pt: median" in res.output and "from x.pt" not in res.output


def test_exported_onnx_outputs_are_the_names_run_prints(user_folder, artifact):
    onnx = pytest.importorskip("onnx")
    res = _invoke(user_folder, ["export", "mlp", "--format", "onnx", "-o", "m.onnx"])
    assert res.exit_code == 0, res.output
    exported = [o.name for o in onnx.load(str(user_folder / "m.onnx")).graph.output]
    ran = _invoke(user_folder, ["run", str(artifact)])
    printed = re.findall(r"^  (\w+): \[", ran.output, flags=re.M)
    assert exported == printed == ["output"]


def test_onnx_output_renaming_frees_a_clashing_internal_name():
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from mlcomp.targets.export import name_onnx_outputs

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Relu", ["x"], ["output"]), helper.make_node("Neg", ["output"], ["neg_1"]),
             helper.make_node("Abs", ["x"], ["abs_2"])]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("neg_1", TensorProto.FLOAT, [2]),
                                               helper.make_tensor_value_info("abs_2", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    named = name_onnx_outputs(model.SerializeToString(), ["output", "output_1"])
    onnx.checker.check_model(onnx.load_from_string(named))
    session = ort.InferenceSession(named, providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["output", "output_1"]
    neg, absolute = session.run(None, {"x": torch.tensor([-1.0, 2.0]).numpy()})
    assert neg.tolist() == [-0.0, -2.0] and absolute.tolist() == [1.0, 2.0]


def test_training_step_takes_y_by_position_or_name():
    import mlcomp

    def fresh():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(4))
    arts = [mlcomp.compile(fresh(), (x,), mode="train", loss="cross_entropy", y=y, optimizer="sgd{lr=0.1}",
                           target="cpu") for _ in range(2)]
    by_position = [arts[0].step(x, y).item() for _ in range(3)]
    by_name = [arts[1].step(x, y=y).item() for _ in range(3)]
    assert by_position == by_name and by_position[-1] < by_position[0]
