"""The bad-input corpus (issue 15): every case a new user hit, run as a user runs it.

Each case runs one command in a fresh temporary folder (the current directory
for the command) holding a user's files: ``userdir/important.txt``,
``hello.txt``, an earlier mlcomp output ``earlier/`` and an empty ``x.pt2``.
Every case asserts

* a non-zero exit (the expected code: 2 for user errors, 4 for verification,
  130 for an interrupt),
* no traceback, and stderr is one line: ``error: …`` (or ``interrupted``),
* nothing left behind: the folder holds exactly the files it held before,
  byte for byte (no artifact, no temporary sibling, no created parent folder).

The interruption cases (exit 130) are in ``tests/corpus/test_interrupts.py``, with the same check.

    case                                   before                          after
    compile mlp -o userdir                 userdir/important.txt deleted   error, userdir untouched
    export mlp --format tvm -o hello.txt   hello.txt became a folder       error, hello.txt untouched
    Ctrl-C during the target build         artifact saved / exit 3         "interrupted", exit 130
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.corpus.harness import check, readonly_dir as _readonly_dir, snapshot as _snapshot

REPO = Path(__file__).resolve().parents[2]

NAN_FACTORY = '''
import torch
from torch import nn


class Nan(nn.Module):
    def forward(self, x):
        return torch.log(x - 100.0)        # log of a negative number: NaN everywhere


def nan_model():
    return Nan(), (torch.randn(2, 4),)
'''


@pytest.fixture(scope="module")
def nan_factory(tmp_path_factory):
    """Outside the user folder: importing it writes __pycache__ next to it."""
    path = tmp_path_factory.mktemp("factories") / "nan_factory.py"
    path.write_text(NAN_FACTORY)
    return f"{path}:nan_model"


# ---------------------------------------------------------------------------
# 1. outputs are safe: refused before any work, nothing touched

FOLDER_OUTPUTS = {
    "compile": ["compile", "mlp"],
    "report": ["report", "mlp", "--targets", "eager"],
    "export-tvm": ["export", "mlp", "--format", "tvm"],
}


@pytest.mark.parametrize("cmd", sorted(FOLDER_OUTPUTS))
@pytest.mark.parametrize("force", [False, True])
def test_user_folder_is_never_replaced(user_folder, cmd, force):
    args = FOLDER_OUTPUTS[cmd] + ["-o", "userdir"] + (["--force"] if force else [])
    check(user_folder, args, expect=("userdir is not empty and was not written by mlcomp", "never deletes it"))


@pytest.mark.parametrize("cmd", sorted(FOLDER_OUTPUTS))
def test_file_is_never_replaced_by_a_folder(user_folder, cmd):
    check(user_folder, FOLDER_OUTPUTS[cmd] + ["-o", "hello.txt", "--force"],
          expect=("hello.txt is an existing file", "will not replace a file by a folder"))


@pytest.mark.parametrize("cmd", sorted(FOLDER_OUTPUTS))
def test_earlier_output_needs_force(user_folder, cmd):
    check(user_folder, FOLDER_OUTPUTS[cmd] + ["-o", "earlier"], expect=("holds an earlier mlcomp output", "--force"))


FILE_OUTPUTS = {
    "export-onnx": ["export", "mlp", "--format", "onnx", "-o"],
    "export-torchscript": ["export", "mlp", "--format", "torchscript", "-o"],
    "models-save": ["models", "save", "mlp", "--format", "torchscript", "-o"],
    "inspect-dot": ["inspect", "mlp", "--dot"],
    "bench-json": ["bench", "mlp", "--targets", "eager", "--json"],
    "bench-csv": ["bench", "mlp", "--targets", "eager", "--csv"],
    "bench-plot": ["bench", "mlp", "--targets", "eager", "--plot"],
    "study-json": ["study", "hybridize", "--quick", "--json"],
    "study-plot": ["study", "hybridize", "--quick", "--plot"],
}


@pytest.mark.parametrize("cmd", sorted(FILE_OUTPUTS))
def test_folder_is_never_replaced_by_a_file(user_folder, cmd):
    check(user_folder, FILE_OUTPUTS[cmd] + ["userdir"], expect=("userdir is an existing folder",))


ALL_OUTPUTS = {**{k: v + ["-o"] for k, v in FOLDER_OUTPUTS.items()}, **FILE_OUTPUTS}


@pytest.mark.parametrize("cmd", sorted(ALL_OUTPUTS))
def test_output_under_an_existing_file(user_folder, cmd):
    check(user_folder, ALL_OUTPUTS[cmd] + ["hello.txt/out"], expect=("hello.txt is a file, not a folder",))


@pytest.mark.parametrize("cmd", sorted(ALL_OUTPUTS))
def test_output_in_a_read_only_folder(user_folder, tmp_path, cmd):
    ro = _readonly_dir(tmp_path)
    check(user_folder, ALL_OUTPUTS[cmd] + [str(ro / "sub" / "out")], expect=("is not writable",))


def test_run_output_is_checked_before_running(user_folder, artifact, tmp_path):
    before = _snapshot(artifact)
    check(user_folder, ["run", str(artifact), "--output", "hello.txt/y.npz"], expect=("hello.txt is a file",))
    check(user_folder, ["run", str(artifact), "--output", "userdir"], expect=("must end in .npz or .pt",))
    check(user_folder, ["run", str(artifact), "--output", str(_readonly_dir(tmp_path) / "y.npz")],
          expect=("is not writable",))
    assert _snapshot(artifact) == before


def test_run_refuses_a_user_folder(user_folder):
    check(user_folder, ["run", "userdir"], expect=("not an artifact folder",))


def test_empty_paths(user_folder):
    check(user_folder, ["compile", ""], expect=("MODEL argument is empty",))
    check(user_folder, ["inspect", "mlp", "--dot", ""], expect=("is empty",))


# ---------------------------------------------------------------------------
# 2. interruption: see tests/corpus/test_interrupts.py; unexpected failures and the writers' own guard

@pytest.mark.parametrize("exc, expect", [
    (RuntimeError("kaput\nsecond line"), "failed unexpectedly: RuntimeError: kaput second line"),
    (OSError(28, "No space left on device"), "could not read or write a file"),
])
def test_unexpected_errors_are_one_paragraph(user_folder, monkeypatch, exc, expect):
    import mlcomp.frontend.loading as loading

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(loading, "load_model", fail)
    err = check(user_folder, ["inspect", "mlp"], code=3, expect=(expect,))
    assert "--traceback" in err or "disk space" in err


def test_writers_refuse_user_folders_themselves(user_folder):
    """The last guard: atomic_dir/atomic_path refuse what check_destination refuses, whoever calls them."""
    from mlcomp.base.errors import OutputPathError
    from mlcomp.base.files import atomic_dir, atomic_path

    before = _snapshot(user_folder)
    for path in (user_folder / "userdir", user_folder / "hello.txt"):
        with pytest.raises(OutputPathError):
            with atomic_dir(path) as tmp:
                (tmp / "x").write_text("x")
    with pytest.raises(OutputPathError, match="existing folder"):
        with atomic_path(user_folder / "userdir") as tmp:
            Path(tmp).write_text("x")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(user_folder / "new" / "deeper" / "f.txt") as tmp:
            Path(tmp).write_text("half")
            raise KeyboardInterrupt
    assert _snapshot(user_folder) == before


# ---------------------------------------------------------------------------
# 3. inputs checked up front

@pytest.mark.parametrize("args, expect", [
    (["compile", "mlp", "--batch", "0"], "'--batch': 0 is not in the range"),
    (["compile", "mlp", "--batch", "-1"], "'--batch': -1 is not in the range"),
    (["inspect", "resnet18", "--batch", "1000000000"], "more than this machine's"),
    (["compile", "NAN", "--input-shape", "0x8"], "every size must be a positive integer"),
    (["compile", "NAN", "--input-shape", "-1x8"], "every size must be a positive integer"),
    (["compile", "NAN", "--input-shape", "100000x100000x1000"], "GiB for one input"),
    (["inspect", "NAN", "--input-shape", "100000x100000:f64"], "GiB for one input"),
    (["compile", "x.pt2", "--input-shape", "1x8"], "carries its own input shapes"),
    (["compile", "mlp", "--tolerance", "nan"], "--tolerance nan is not a usable tolerance"),
    (["compile", "mlp", "--tolerance", "-1"], "--tolerance -1.0 is not a usable tolerance"),
    (["export", "mlp", "--format", "onnx", "-o", "m.onnx", "--tolerance", "inf"], "not a usable tolerance"),
    (["compile", "mlp", "--target", "cpu", "--tune-trials", "5"], "--tune-trials applies to the tvm target only"),
    (["compile", "mlp", "--target", "cpu", "--tf32"], "--tf32 applies to the cuda target only"),
    (["compile", "mlp", "--target", "ort", "--tuning-dir", "db"], "--tuning-dir applies to the tvm target only"),
    (["compile", "no/such/model.pt", "--target", "onnxruntim"], "did you mean 'onnxruntime'"),
    (["compile", "mlp", "--threads", "0"], "'--threads': 0 is not in the range"),
    (["inspect", "mlp", "--top", "-3"], "'--top': -3 is not in the range"),
    (["inspect", "mlp", "--top", "0"], "'--top': 0 is not in the range"),
    (["models", "save", "mlp", "--format", "pt2", "-o", "m.pt2", "--batch", "0"], "'--batch': 0"),
    (["bench", "mlp", "--batch", "0"], "give positive integers"),
    (["bench", "mlp", "--batch", "1,x"], "comma-separated list of integers"),
    (["report", "mlp", "-o", "rep", "--bench-batch", "-1"], "give positive integers"),
    (["run", "earlier", "--repeat", "0"], "'--repeat': 0 is not in the range"),
    (["compile", "mlp", "--capture", "bogus"], "'--capture'"),
    (["compile", "mlp", "--bogus"], "No such option"),
    (["compil", "mlp"], "No such command"),
    (["export", "mlp", "-o", "m.onnx"], "Missing option '-f' / '--format'"),
    (["inspect", "NAN", "--input-shape", "1by8"], "1by8"),
    (["compile", "x.pt2", "--capture", "fx"], "--capture fx does not apply"),
    (["bench", "mlp", "--budget", "-1"], "time budget"),
    (["bench", "PT2B2", "--targets", "eager"], "was exported for batch 2 (input 2x512); --batch 1 cannot run it"),
    (["bench", "PT2B2", "--targets", "eager", "--batch", "2,8"], "--batch 8 cannot run it"),
    (["compile", "PT2B2", "--input-shape", "2x512"], "carries its own input shapes"),
    (["inspect", "PT2B2", "--batch", "4"], "--batch 4 was given with"),
    (["bench", "resnet18", "--targets", "eager", "--batch", "1,2000000000"], "more than this machine's"),
    (["bench", "NAN", "--targets", "eager", "--input-shape", "0x4"], "every size must be a positive integer"),
    (["export", "PT2B2", "--format", "onnx", "-o", "m.onnx", "--batch", "2"], "its batch is fixed"),
    # issue 15, one consistent CLI: -O/-p on every pipeline command, --targets checked before any model is
    # loaded (no/such/model.pt proves it), report's --batch list (old --bench-batch), --output-names, --json
    (["bench", "no/such/model.pt", "--targets", "eager,onnxruntim"], "did you mean 'onnxruntime'"),
    (["report", "no/such/model.pt", "-o", "rep", "--targets", "eager,tvmm"], "did you mean 'tvm'"),
    (["compile", "no/such/model.pt", "--json", "--target", "tvmm"], "did you mean 'tvm'"),
    (["bench", "mlp", "-O", "5"], "'-O'"),
    (["report", "mlp", "-o", "rep", "-O", "9"], "'-O'"),
    (["export", "mlp", "--format", "onnx", "-o", "m.onnx", "-O2", "-p", "dce"], "both -p 'dce' and -O2"),
    (["bench", "mlp", "-O1", "-p", "dce"], "both -p 'dce' and -O1"),
    (["bench", "no/such/model.pt", "-p", "missing.toml"], "cannot read pipeline file missing.toml"),
    (["report", "no/such/model.pt", "-o", "rep", "-p", "missing.toml"], "cannot read pipeline file"),
    (["export", "no/such/model.pt", "--format", "onnx", "-o", "m.onnx", "-p", "missing.toml"],
     "cannot read pipeline file"),
    (["compile", "mlp", "--output-names", "logits,aux"], "--output-names gives 2 name(s) but mlp has 1 output(s)"),
    (["compile", "mlp", "--output-names", "two words"], "must be distinct identifiers"),
    (["report", "mlp", "-o", "rep", "--batch", "0"], "give positive integers"),
    (["report", "mlp", "-o", "rep", "--batch", "1,x"], "comma-separated list of integers"),
    (["report", "PT2B2", "-o", "rep", "--batch", "1,2"], "--batch 1 cannot run it"),
    (["report", "resnet18", "-o", "rep", "--batch", "1,2000000000"], "more than this machine's"),
    (["targets", "--jsn"], "No such option"),
    (["run", "userdir", "--json"], "not an artifact folder"),
    # issue 11 (pruning): sparsity outside [0, 1), 2:4 for a device without semi-structured kernels
    (["compile", "lenet", "-p", "prune{sparsity=1.0}", "-o", "out"], "must be in [0, 1), got 1.0"),
    (["compile", "lenet", "-p", "prune{method=2:4}", "-o", "out"], "target cpu cannot run them"),
    # issue 13 (placement and pipeline partition): too many stages, an impossible memory limit (the error
    # gives the least that works), a device this machine lacks, launch of a one-process artifact
    (["partition", "mlp", "--stages", "20"], "cannot cut mlp into 20 stages: it has only 8 compute node(s)"),
    (["partition", "mlp", "--stages", "2", "--memory-limit", "1KiB"], "the smallest limit any cut meets is"),
    (["partition", "mlp", "--memory-limit", "lots"], "memory_limit='lots' is not a size"),
    (["compile", "mlp", "-p", "place{devices=[cuda:7,cpu]}", "-o", "out"], "device cuda:7 does not exist"),
    (["compile", "mlp", "--target", "distributed", "-p", "cleanup", "-o", "out"], "has no pipeline stages"),
    (["launch", "CPUART"], "launch runs pipeline artifacts only"),
    # issue 14 (openvino target): a misspelt name, a device the OpenVINO CPU plugin cannot run on
    (["compile", "no/such/model.pt", "--target", "openvin"], "did you mean 'openvino'"),
    (["compile", "mlp", "--target", "openvino", "--device", "cuda", "-o", "out"],
     "device 'cuda' is not one target openvino runs on (cpu)"),
    # issue 14 parts 3 and 6 (--target auto, compile cache): --candidates without auto or naming auto, a
    # misspelt candidate (all before the model is loaded), cache info for a key no entry has
    (["compile", "no/such/model.pt", "--target", "cpu", "--candidates", "cpu"],
     "--candidates applies to --target auto only"),
    (["compile", "no/such/model.pt", "--target", "auto", "--candidates", "cpu,auto"],
     "must name one or more targets other than auto"),
    (["compile", "no/such/model.pt", "--target", "auto", "--candidates", "cpu,onnxruntim"],
     "did you mean 'onnxruntime'"),
    (["compile", "no/such/model.pt", "--target", "auto", "--candidates", "cpu,tvm{kernel=off}"],
     "target 'tvm' has no option 'kernel'; did you mean 'kernels'?"),
    (["cache", "info", "ffff", "--cache-dir", "cachedir"], "no cache entry in cachedir starts with 'ffff'"),
    # compile-cache size cap (no function-local cycle dodges + cache cap): a size that is not one, checked
    # before the model is loaded and before the cache folder is created
    (["compile", "no/such/model.pt", "--cache", "--cache-dir", "cachedir", "--cache-max-size", "lots"],
     "--cache-max-size 'lots' is not a size"),
    (["compile", "no/such/model.pt", "--cache-max-size", "-5MB"], "--cache-max-size '-5MB' is not a size"),
    (["cache", "prune", "--max-size", "5XB", "--cache-dir", "cachedir"],
     "--max-size '5XB' is not a size (unknown unit 'XB')"),
])
def test_inputs_checked_up_front(user_folder, nan_factory, pt2_batch2, artifact, args, expect):
    names = {"NAN": nan_factory, "PT2B2": pt2_batch2, "CPUART": str(artifact)}
    check(user_folder, [names.get(a, a) for a in args], expect=(expect,))


# ---------------------------------------------------------------------------
# 4. verification catches non-finite outputs

def test_nan_outputs_never_pass(user_folder, nan_factory):
    err = check(user_folder, ["compile", nan_factory, "--target", "cpu", "-o", "out"], code=4,
                expect=("is not finite", "eager PyTorch's output has 8 NaN element(s) of 8"))
    assert "passed" not in err


def test_verify_reports_which_output_and_how_many():
    from mlcomp.analysis.verify import compare

    good = torch.tensor([1.0, 2.0, 3.0])
    bad = torch.tensor([1.0, math.inf, math.nan])
    result = compare((good, good), (good, bad), names=["a", "b"])
    assert not result.passed
    assert result.summary() == "FAILED: output 1 (b): NaN/inf: the compiled output has 1 NaN and 1 inf element(s) of 3"
    both = compare(bad, bad.clone())
    assert not both.passed and "eager PyTorch's output has 1 NaN and 1 inf" in both.summary()
