"""The blame corpus: every error names the party at fault, and every hint works when followed.

Each case runs as a user runs it (:func:`tests.corpus.harness.check`: exit code, no traceback, one line,
the folder unchanged).  A case whose message suggests a command or a code change then follows it
(:func:`follow`): the suggested command must succeed, or fail with a different, more specific message.

    party        cases                                                     says
    model        None/int outputs, int argument, buffer/input updated,     "the model's forward (NAME) …",
                 keyword-only forward, eager rejects the inputs too          the file:line, what to change
    input        4-item factory, truncated .pt2, run on a file / report /   what the thing is, what to give
                 user folder / training artifact / another tool's manifest
    environment  tvm / openvino not importable (absent, or failing import)   "not available here", exit 2
    damaged      payload checksum, manifest lost or unparsable              "is damaged … compile it again"
    internal     a target's build raising                                   "bug in mlcomp", exit 3
"""
from __future__ import annotations

import builtins
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import mlcomp
from mlcomp.base.errors import BLAME, ModelFaultError, Party, TargetUnavailableError
from mlcomp.cli.main import main
from tests.corpus.harness import check

FACTORIES = '''
import torch
from torch import nn


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)


class RetNone(Lin):
    def forward(self, x):
        self.l(x)
        return None


class RetMixed(Lin):
    def forward(self, x):
        return self.l(x), None, 3


class IntArg(Lin):
    def forward(self, x, n):
        return self.l(x) * n


class Counter(Lin):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count += 1
        return self.l(x)


class MutIn(Lin):
    def forward(self, x):
        x.mul_(2)
        return self.l(x)


class Drop(Lin):
    def __init__(self):
        super().__init__()
        self.d = nn.Dropout(0.5)

    def forward(self, x):
        return self.d(self.l(x))


class KwOnly(Lin):
    def forward(self, *, x):
        return self.l(x)


class Kwargs(Lin):
    def forward(self, **kw):
        return self.l(kw["x"])


class KwFixed(Lin):                       # the hint followed: positional parameters
    def forward(self, x):
        return self.l(x)


def x():
    return torch.randn(2, 4)


def ret_none(): return RetNone(), (x(),)
def ret_mixed(): return RetMixed(), (x(),)
def int_arg(): return IntArg(), (x(), 3)
def int_arg_fixed(): return IntArg(), (x(), torch.tensor(3.0))      # the hint followed: a tensor
def counter(): return Counter(), (x(),)
def mut_in(): return MutIn(), (x(),)
def int64(): return nn.Linear(4, 4), (torch.ones(2, 4, dtype=torch.int64),)
def train_mode(): return Drop().train(), (x(),)
def kw_only(): return KwOnly()
def kwargs(): return Kwargs()
def kw_fixed(): return KwFixed()
def four(): return nn.Linear(4, 4), (x(),), nn.MSELoss(), "extra"
def three(): return nn.Linear(4, 4), (x(),), nn.MSELoss()              # the hint followed: the extra dropped
'''


def line(code: str, below: int = 0) -> str:
    """``models.py:N``: the first line of FACTORIES holding ``code``, ``below`` lines further down."""
    return f"models.py:{next(i for i, ln in enumerate(FACTORIES.splitlines(), 1) if code in ln) + below}"


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    """Outside the user folder: importing it writes __pycache__ next to it."""
    path = tmp_path_factory.mktemp("blame") / "models.py"
    path.write_text(FACTORIES)
    return str(path)


def follow(args: list[str], folder: Path, *, before: str | None = None) -> str:
    """Run a suggested command in ``folder``: it succeeds (returns stdout), or fails with another message."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        res = CliRunner().invoke(main, args)
    finally:
        os.chdir(cwd)
    assert "Traceback" not in res.output
    if res.exit_code == 0:
        return res.stdout
    assert before is not None, res.output
    err = res.stderr.strip()
    assert err.startswith("error: ") and err != before, (err, before)
    return err


# ---------------------------------------------------------------------------
# the model's fault: named, with the source line, and what to change

MODEL_CASES = {
    "returns-none": ("ret_none", [], ("forward (ret_none) returns values that are not tensors",
                                      "output 0 of 1 is None", f"{line('class RetNone', 1)} in RetNone.forward")),
    "returns-none-and-int": ("ret_mixed", [], ("output 1 of 3 is None", "output 2 of 3 is 3",
                                               "RetMixed.forward", "return tensors only")),
    "int-argument": ("int_arg", [], ("takes n (argument 1) as a Python int (3), not a tensor",
                                     "IntArg.forward", "self.n", "torch.tensor")),
    "buffer-updated": ("counter", [], ("updates buffer count in place", f"{line('self.count += 1')} (self.count += 1)",
                                       "module <root>")),
    "buffer-updated-O0": ("counter", ["-O0"], ("updates buffer count in place", "(self.count += 1)")),
    "buffer-updated-onnx": ("counter", ["-t", "onnxruntime"], ("updates buffer count in place",)),
    "input-updated": ("mut_in", [], ("updates input x in place", "(x.mul_(2))", "not x.mul_(2)")),
    "input-updated-fx": ("mut_in", ["--capture", "fx"], ("updates input x in place", "MutIn.forward")),
    "returns-none-fx": ("ret_none", ["--capture", "fx"], ("output 0 of 1 is None", "RetNone.forward")),
    "int64-into-float-linear": ("int64", [], ("fails in eager PyTorch too", "2x4:int64",
                                              "mat1 and mat2 must have the same dtype",
                                              "--input-shape 2x4:f32")),
    "keyword-only-forward": ("kw_only", ["--input-shape", "2x4"], ("takes its inputs by keyword only (x)",
                                                                   "KwOnly.forward", "def forward(self, x)")),
    "kwargs-forward": ("kwargs", ["--input-shape", "2x4"], ("takes its inputs by keyword only (**kw)",)),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_fault_is_the_models(user_folder, factories, case):
    fn, extra, expect = MODEL_CASES[case]
    err = check(user_folder, ["compile", f"{factories}:{fn}", *extra, "-o", "out"], expect=expect)
    assert err.startswith("error: the model's forward") and "bug in" not in err


# the model fault's hint, followed: the changed factory or the suggested option compiles
FOLLOWED = {
    "int-argument": (["compile", "{f}:int_arg_fixed", "-o", "{out}"]),
    "int64-into-float-linear": (["compile", "{f}:int64", "--input-shape", "2x4:f32", "-o", "{out}"]),
    "keyword-only-forward": (["compile", "{f}:kw_fixed", "--input-shape", "2x4", "-o", "{out}"]),
    "extra-factory-item": (["compile", "{f}:three", "-o", "{out}"]),
}


@pytest.mark.parametrize("case", sorted(FOLLOWED))
def test_model_fault_hint_followed_compiles(tmp_path, factories, case):
    args = [a.format(f=factories, out=tmp_path / "out") for a in FOLLOWED[case]]
    assert "verified against eager: passed" in follow(args, tmp_path)


def test_keyword_only_without_shapes_then_with(user_folder, factories, tmp_path):
    """'pass --input-shape' followed leads to the specific message about the keyword-only forward."""
    err = check(user_folder, ["compile", f"{factories}:kw_only", "-o", "out"], expect=("pass --input-shape",))
    again = follow(["compile", f"{factories}:kw_only", "--input-shape", "2x4", "-o", str(tmp_path / "o")],
                   tmp_path, before=err)
    assert "takes its inputs by keyword only" in again


@pytest.fixture(scope="module")
def models(factories):
    sys.path.insert(0, str(Path(factories).parent))
    try:
        import models
    finally:
        sys.path.pop(0)
    return models


def test_api_raises_a_model_fault(models):
    with pytest.raises(ModelFaultError) as err:
        mlcomp.compile(*models.counter())
    assert err.value.party is Party.MODEL and err.value.exit_code == 2


def test_api_warns_of_a_train_mode_model(models):
    with pytest.warns(UserWarning, match=r"is in train\(\) mode \(Dropout at d\)"):
        art = mlcomp.compile(*models.train_mode())
    assert art.verification["passed"]


def test_train_mode_model_is_compiled_in_eval_with_a_note(tmp_path, factories):
    res = CliRunner().invoke(main, ["compile", f"{factories}:train_mode", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    notes = [ln for ln in res.stderr.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and "train() mode (Dropout at d)" in notes[0] and "compiled in eval() mode" in notes[0]
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["verification"]["passed"]
    follow(["compile", f"{factories}:train_mode", "--train", "-o", str(tmp_path / "t")], tmp_path)   # hint followed


def test_eval_mode_factory_has_no_note(tmp_path, factories):
    res = CliRunner().invoke(main, ["compile", f"{factories}:int_arg_fixed", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0 and "note:" not in res.stderr


# ---------------------------------------------------------------------------
# the user's input: what the thing is, and what to give instead

def test_factory_returning_four_items(user_folder, factories, tmp_path):
    check(user_folder, ["compile", f"{factories}:four", "-o", "out"],
          expect=("returned 4 items", "drop the extra item(s) after the third (str)"))


def test_truncated_pt2_is_called_cut_short(user_folder, pt2_batch2, tmp_path):
    data = Path(pt2_batch2).read_bytes()
    (user_folder / "cut.pt2").write_bytes(data[:20000])
    err = check(user_folder, ["compile", "cut.pt2", "-o", "out"],
                expect=("cut.pt2 is cut short", "its end is missing (20000 bytes)", "copy it again in full"))
    assert "torch.export.save," not in err.split(". ")[-1]          # the hint does not say "save it with …"
    shutil.copy(pt2_batch2, tmp_path / "cut.pt2")                  # followed: the full copy compiles
    assert "verified against eager: passed" in follow(["compile", "cut.pt2", "-o", "o"], tmp_path)


@pytest.mark.ort
def test_dynamic_batch_at_batch_one_is_traced_at_two(tmp_path):
    out = follow(["compile", "mlp", "--dynamic-batch", "-t", "onnxruntime", "-o", str(tmp_path / "o")], tmp_path)
    assert "verified against eager: passed" in out


def test_dynamic_batch_at_batch_1_compiles_on_cpu(tmp_path):
    """The zoo's batch 1 with --dynamic-batch is captured at 2 and the cpu target builds a dynamic graph."""
    out = follow(["compile", "mlp", "--dynamic-batch", "-o", "o"], tmp_path)
    assert "verified against eager: passed" in out and "Constraints violated" not in out
    import mlcomp

    assert tuple(mlcomp.load(tmp_path / "o")(torch.randn(7, 512)).shape) == (7, 2)     # another batch, no recompile


NOT_ARTIFACTS = {
    "plain-file": ("hello.txt", ("hello.txt is a file, not an artifact folder",)),
    "report-folder": ("earlier", ("earlier is an mlcomp report (`mlcomp report`), not an artifact folder",)),
    "user-folder": ("userdir", ("userdir is a folder mlcomp did not write, not an artifact folder",)),
}


@pytest.mark.parametrize("case", sorted(NOT_ARTIFACTS))
def test_run_on_something_else_is_not_damage(user_folder, artifact, case):
    path, expect = NOT_ARTIFACTS[case]
    err = check(user_folder, ["run", path], expect=expect + ("compile one",))
    assert "damaged" not in err
    assert "output: [1, 2] float32" in follow(["run", str(artifact)], user_folder.parent)       # followed: a compiled folder runs


def test_run_on_another_tools_manifest(user_folder):
    (user_folder / "tool").mkdir()
    (user_folder / "tool" / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    err = check(user_folder, ["run", "tool"], expect=("is another tool's (format 'something-else'",))
    assert "damaged" not in err


@pytest.fixture(scope="module")
def training_artifact(tmp_path_factory, factories):
    out = tmp_path_factory.mktemp("train") / "step"
    res = CliRunner().invoke(main, ["compile", f"{factories}:three", "--train", "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_run_on_a_training_artifact(user_folder, training_artifact):
    shutil.copytree(training_artifact, user_folder / "step")
    err = check(user_folder, ["run", "step"], expect=("step is a training artifact", "mlcomp.load(DIR)",
                                                      ".step(x, y)"))
    assert "damaged" not in err
    art = mlcomp.load(user_folder / "step")                     # followed: it loads and steps
    loss = art.step(torch.randn(2, 4), torch.randn(2, 4))
    assert torch.isfinite(torch.as_tensor(loss)).all()


# ---------------------------------------------------------------------------
# the environment: a backend package that is absent or does not import

def _as_target(artifact: Path, folder: Path, target: str) -> Path:
    """The artifact with its manifest naming ``target`` (loading stops before reading any payload)."""
    copy = folder / f"{target}-art"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.update(target=target, runtime=target)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _break_import(monkeypatch, package: str) -> None:
    real = builtins.__import__
    broken = (package, *(("tvm_ffi",) if package == "tvm" else ()))

    def imp(name, *args, **kwargs):
        if any(name == p or name.startswith(p + ".") for p in broken):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", imp)


# a tvm artifact loads through tvm_ffi and TVM's runtime libraries (no ``import tvm``): broken, both fail to import
ENV_CASES = {
    "tvm-absent": ("tvm", "absent", "the apache-tvm package is not installed"),
    "tvm-import-fails": ("tvm", "broken", "importing its package failed (ImportError: No module named 'tvm"),
    "openvino-absent": ("openvino", "absent", "the openvino package is not installed"),
    "openvino-import-fails": ("openvino", "broken", "importing its package failed (ImportError"),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_missing_backend_is_the_environment(user_folder, artifact, monkeypatch, case):
    package, how, says = ENV_CASES[case]
    _as_target(artifact, user_folder, package)
    if how == "absent":
        monkeypatch.setitem(sys.modules, package, None)
    else:
        _break_import(monkeypatch, package)
    err = check(user_folder, ["run", f"{package}-art"], expect=(
        f"the artifact needs target {package}, which is not available here", says,
        "load it on a machine with that backend"))
    assert "damaged" not in err
    with pytest.raises(TargetUnavailableError) as exc:                   # the API says the same
        mlcomp.load(user_folder / f"{package}-art")
    assert exc.value.party is Party.ENVIRONMENT


# ---------------------------------------------------------------------------
# damaged: only a file mlcomp wrote that no longer matches

DAMAGE = {
    "payload-truncated": (lambda d: (d / "model.pt").write_bytes((d / "model.pt").read_bytes()[:100]),
                          "payload file model.pt does not match its checksum"),
    "manifest-lost": (lambda d: (d / "manifest.json").unlink(), "its manifest.json is missing"),
    "manifest-unparsable": (lambda d: (d / "manifest.json").write_text("{not json"), "is not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_only_when_mlcomp_files_are_wrong(user_folder, artifact, tmp_path, case):
    damage, says = DAMAGE[case]
    shutil.copytree(artifact, user_folder / "art")
    damage(user_folder / "art")
    err = check(user_folder, ["run", "art"], expect=("the artifact at art is damaged", says, "compile it again"))
    assert "bug in" not in err
    follow(["compile", "mlp", "--target", "cpu", "-o", "again"], tmp_path)      # followed: compile it again, run
    assert "output: [1, 2] float32" in follow(["run", "again"], tmp_path)


# ---------------------------------------------------------------------------
# internal: only a genuine failure inside mlcomp says "bug in mlcomp"

def test_internal_failure_is_a_bug_report(user_folder, monkeypatch):
    from mlcomp.targets.torch.cpu import CpuTarget

    def broken(self, graph, options, inputs):
        raise RuntimeError("lowering lost a node")
    monkeypatch.setattr(CpuTarget, "build", broken)
    check(user_folder, ["compile", "mlp", "-o", "out"], code=BLAME[Party.INTERNAL].exit_code,
          expect=("failed unexpectedly: RuntimeError: lowering lost a node", "bug in mlcomp", "--traceback"))
