"""The output rule (:mod:`mlcomp.base.files`), run as a user runs each command that writes a path.

Every refusal goes through :func:`tests.corpus.harness.check`: exit 2, no traceback, one line, and the
user's folder byte for byte as it was.  The folder holds, besides the harness's files, one real file of
each kind a user has (written by torch, numpy, onnx, PIL, not by mlcomp):

    case                                              before                         after
    export mlp --format onnx -o thesis.txt            thesis.txt overwritten         refused: not written by mlcomp
    export model.pt2 --format pt2 -o model.pt2        the input model replaced       refused, even with --force
    export mlp --format torchscript -o new.onnx       TorchScript under .onnx        refused: name it new.pt
    models save mlp --format pt2 -o m.pt2 (again)     replaced silently              needs --force; then replaced
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mlcomp.base.files import written_by_mlcomp
from mlcomp.cli.main import main
from tests.corpus.harness import check, snapshot


def _user_onnx(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "user",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    onnx.save(helper.make_model(graph), str(path))


def _user_png(path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (4, 4), "red").save(path)


@pytest.fixture(scope="module")
def user_files(tmp_path_factory) -> Path:
    """One real file of each kind, written by the user's tools (no mlcomp marker)."""
    root = tmp_path_factory.mktemp("user-files")
    lin = torch.nn.Linear(4, 2).eval()
    x = torch.randn(1, 4)
    torch.jit.save(torch.jit.trace(lin, (x,)), str(root / "notes.pt"))
    torch.export.save(torch.export.export(lin, (x,)), str(root / "model.pt2"))
    _user_onnx(root / "users_model.onnx")
    np.savez(root / "results.npz", y=np.ones(3))
    (root / "data.json").write_text(json.dumps({"a": 1}))
    _user_png(root / "chart.png")
    (root / "table.csv").write_text("a,b\n1,2\n")
    (root / "graph.dot").write_text("digraph g { a -> b }\n")
    (root / "thesis.txt").write_text("chapter one\n")
    return root


@pytest.fixture
def folder(user_folder, user_files) -> Path:
    for f in user_files.iterdir():
        shutil.copy(f, user_folder / f.name)
    return user_folder


def _cli(folder: Path, args: list[str]):
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return CliRunner().invoke(main, args)
    finally:
        os.chdir(cwd)


# every command that writes a file -> (its arguments up to the path, the user's file of the same kind)
FILE_COMMANDS = {
    "export-onnx": (["export", "mlp", "--format", "onnx", "-o"], "users_model.onnx"),
    "export-torchscript": (["export", "mlp", "--format", "torchscript", "-o"], "notes.pt"),
    "export-pt2": (["export", "mlp", "--format", "pt2", "-o"], "model.pt2"),
    "models-save-torchscript": (["models", "save", "lenet", "--format", "torchscript", "-o"], "notes.pt"),
    "models-save-pt2": (["models", "save", "mlp", "--format", "pt2", "-o"], "model.pt2"),
    "run-npz": (["run", "{art}", "-o"], "results.npz"),
    "run-pt": (["run", "{art}", "-o"], "notes.pt"),
    "inspect-dot": (["inspect", "mlp", "--dot"], "graph.dot"),
    "bench-json": (["bench", "mlp", "--targets", "eager", "--json"], "data.json"),
    "bench-csv": (["bench", "mlp", "--targets", "eager", "--csv"], "table.csv"),
    "bench-plot": (["bench", "mlp", "--targets", "eager", "--plot"], "chart.png"),
    "study-json": (["study", "hybridize", "--quick", "--json"], "data.json"),
    "study-plot": (["study", "hybridize", "--quick", "--plot"], "chart.png"),
    "partition-plot": (["partition", "mlp", "--plot"], "chart.png"),
    "profile": (["profile", "mlp", "-o"], "data.json"),
}


def _args(cmd: str, artifact: Path, path: str) -> list[str]:
    head, _ = FILE_COMMANDS[cmd]
    return [a.replace("{art}", str(artifact)) for a in head] + [path]


@pytest.mark.parametrize("cmd", sorted(FILE_COMMANDS))
def test_a_user_file_of_the_same_kind_is_never_replaced(folder, artifact, cmd):
    target = FILE_COMMANDS[cmd][1]
    check(folder, _args(cmd, artifact, target) + ["--force"],
          expect=(f"{target} is an existing file that mlcomp did not write", "even with --force"))


@pytest.mark.parametrize("cmd", sorted(FILE_COMMANDS))
def test_a_text_file_is_never_replaced(folder, artifact, cmd):
    err = check(folder, _args(cmd, artifact, "thesis.txt"))
    assert "thesis.txt" in err and ("mlcomp did not write" in err or "must end in .npz or .pt" in err)


def test_a_csv_says_why_it_cannot_be_replaced(folder):
    check(folder, ["bench", "mlp", "--targets", "eager", "--csv", "table.csv", "--force"],
          expect=("a CSV file has no place for that marker",))


# ---------------------------------------------------------------------------
# the input is never an output

@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("fmt, model", [("pt2", "model.pt2"), ("torchscript", "notes.pt")])
def test_the_input_model_is_never_the_output(folder, fmt, model, force):
    check(folder, ["export", model, "--format", fmt, "-o", model, *force],
          expect=(f"the output {model} is the input", "never writes over its input, even with --force"))


def test_a_link_to_the_input_model_is_refused(folder):
    (folder / "link.pt2").symlink_to("model.pt2")
    check(folder, ["export", "link.pt2", "--format", "pt2", "-o", "model.pt2", "--force"],
          expect=("is the input",))
    check(folder, ["export", "model.pt2", "--format", "pt2", "-o", "link.pt2", "--force"],
          expect=("the output link.pt2 is the input",))


@pytest.mark.parametrize("cmd", [["compile"], ["report", "--targets", "eager"], ["export", "--format", "tvm"]])
def test_a_folder_holding_the_input_is_refused(folder, cmd):
    (folder / "models").mkdir()
    shutil.copy(folder / "model.pt2", folder / "models" / "m.pt2")
    (folder / "models" / ".mlcomp").write_text("{}\n")       # even a folder that looks like mlcomp's
    check(folder, [cmd[0], "models/m.pt2", *cmd[1:], "-o", "models", "--force"],
          expect=("the output folder models holds the input", "even with --force"))


def test_run_output_inside_the_artifact_is_refused(user_folder, artifact):
    before = snapshot(artifact)
    check(user_folder, ["run", str(artifact), "-o", str(artifact / "y.npz"), "--force"],
          expect=("is inside the input folder",))
    assert snapshot(artifact) == before


# ---------------------------------------------------------------------------
# a file's name ends in its format's suffix

@pytest.mark.parametrize("args, expect", [
    (["export", "mlp", "--format", "torchscript", "-o", "new.onnx"], ("a torchscript file", "name it new.pt")),
    (["export", "mlp", "--format", "onnx", "-o", "new.pt2"], ("must end in .onnx", "name it new.onnx")),
    (["models", "save", "mlp", "--format", "pt2", "-o", "m.pt"], ("must end in .pt2",)),
    (["bench", "mlp", "--targets", "eager", "--json", "out.txt"], ("must end in .json",)),
    (["bench", "mlp", "--targets", "eager", "--plot", "out.jpg"], ("must end in .png",)),
    (["inspect", "mlp", "--dot", "g.txt"], ("must end in .dot or .gv",)),
    (["profile", "mlp", "-o", "times.csv"], ("must end in .json",)),
])
def test_suffix_must_match_the_format(folder, args, expect):
    check(folder, args, expect=expect)


# ---------------------------------------------------------------------------
# links; an earlier mlcomp output is replaced only with --force, and then it is

def test_a_link_to_a_user_file_is_never_replaced(folder):
    (folder / "link.onnx").symlink_to("users_model.onnx")
    check(folder, ["export", "mlp", "--format", "onnx", "-o", "link.onnx", "--force"],
          expect=("link.onnx is a symbolic link", "never replaces a link"))


def _load_ts(p: Path) -> object:
    return torch.jit.load(str(p))(torch.randn(1, 512))


def _load_pt2(p: Path) -> object:
    return torch.export.load(str(p)).module()(torch.randn(1, 512))


def _load_onnx(p: Path) -> object:
    import onnxruntime as ort

    session = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: np.zeros((1, 512), np.float32)})


def _load_npz(p: Path) -> object:
    return dict(np.load(p))


def _load_dot(p: Path) -> object:
    assert p.read_text().startswith("digraph")
    return p.read_text()


EARLIER = {
    "models-save-pt2": (["models", "save", "mlp", "--format", "pt2", "-o", "m.pt2"], "m.pt2", _load_pt2),
    "models-save-torchscript": (["models", "save", "mlp", "--format", "torchscript", "-o", "m.pt"], "m.pt",
                                _load_ts),
    "export-onnx": (["export", "mlp", "--format", "onnx", "-o", "m.onnx"], "m.onnx", _load_onnx),
    "run-npz": (["run", "{art}", "-o", "y.npz"], "y.npz", _load_npz),
    "inspect-dot": (["inspect", "mlp", "--dot", "g.dot"], "g.dot", _load_dot),
}


@pytest.mark.parametrize("case", sorted(EARLIER))
def test_an_earlier_output_is_replaced_only_with_force(user_folder, artifact, case):
    args, name, load = EARLIER[case]
    args = [a.replace("{art}", str(artifact)) for a in args]
    first = _cli(user_folder, args)
    assert first.exit_code == 0, first.output
    path = user_folder / name
    assert written_by_mlcomp(path) and load(path) is not None
    inode = path.stat().st_ino
    check(user_folder, args, expect=(f"{name} is an earlier mlcomp output", "--force"))
    again = _cli(user_folder, args + ["--force"])
    assert again.exit_code == 0, again.output
    assert path.stat().st_ino != inode                             # a new file renamed into place
    assert written_by_mlcomp(path) and load(path) is not None
    assert sorted(p.name for p in user_folder.iterdir() if p.name.startswith(".")) == []   # no temporaries


# ---------------------------------------------------------------------------
# folders mlcomp extends (dumps, tuning database) follow the rule too

def test_dump_dir_and_tuning_db_refuse_a_user_folder(folder):
    check(folder, ["compile", "mlp", "--dump-after", "all", "--dump-dir", "userdir", "--force"],
          expect=("userdir is not empty and was not written by mlcomp",))
    check(folder, ["compile", "mlp", "--dump-after", "all", "--dump-dir", "hello.txt"],
          expect=("hello.txt", "is a file"))


@pytest.mark.tvm
def test_tuning_db_refuses_a_user_folder(folder):
    check(folder, ["tune", "mlp", "--trials", "1", "--db", "userdir"],
          expect=("userdir is not empty and was not written by mlcomp",))


def test_python_export_follows_the_rule(folder):
    import mlcomp
    from mlcomp.base.errors import OutputPathError

    before = snapshot(folder)
    with pytest.raises(OutputPathError, match="mlcomp did not write"):
        mlcomp.export("mlp", folder / "users_model.onnx", format="onnx", force=True)
    with pytest.raises(OutputPathError, match="is the input"):
        mlcomp.export(str(folder / "model.pt2"), folder / "model.pt2", format="pt2", force=True)
    with pytest.raises(OutputPathError, match="must end in .pt2"):
        mlcomp.export("mlp", folder / "new.onnx", format="pt2")
    assert snapshot(folder) == before


def test_an_older_tuning_db_is_recognised_by_its_ledger(tmp_path):
    from mlcomp.base.errors import OutputPathError
    from mlcomp.base.files import is_mlcomp_output
    from mlcomp.cli.tune import check_tuning_db

    db = tmp_path / "db"
    db.mkdir()
    (db / "mlcomp_ledger.json").write_text("{}")
    (db / "database_workload.json").write_text("")
    check_tuning_db(db, "--db", "mlp")
    assert is_mlcomp_output(db)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "database_workload.json").write_text("")      # MetaSchedule's files alone: not ours
    with pytest.raises(OutputPathError, match="not empty and was not written by mlcomp"):
        check_tuning_db(tmp_path / "user", "--db", "mlp")
