"""The sanity-bounds corpus: values that cannot mean what the user hopes are refused or said out loud.

* ``--tolerance`` above :data:`mlcomp.analysis.verify.MAX_TOLERANCE` is refused (at 1 an all-zero output
  "passes");
* ``--threads`` above the cores this process may run on: one warning, the core count is used and stored;
* a manifest grows linearly with the number of passes (a pass's position names at most its last
  siblings, not every earlier pass);
* ``mlcomp bench`` exits 4 when a target's outputs differ from eager, after writing every result;
  ``--keep-going`` exits 0.
"""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from click.testing import CliRunner

from mlcomp.analysis.verify import MAX_TOLERANCE, check_tolerance
from mlcomp.base.errors import OptionError
from mlcomp.cli.main import main
from tests.corpus.harness import check, snapshot


@pytest.mark.parametrize("args", [
    ["compile", "mlp", "--tolerance", "1e9"],
    ["compile", "mlp", "--tolerance", "1"],
    ["compile", "mlp", "--tolerance", "0.11", "-o", "out"],
    ["export", "mlp", "--format", "onnx", "-o", "m.onnx", "--tolerance", "1e9"],
    ["compile", "mlp", "--train", "--tolerance", "5"],
])
def test_tolerance_too_loose_to_verify(user_folder, args):
    check(user_folder, args, code=2, expect=("too loose to mean \"verified\"", "all-zero output passes",
                                             "the loosest accepted is 0.1"))


def test_tolerance_bound_is_inclusive_and_api_checked():
    assert check_tolerance(MAX_TOLERANCE) == MAX_TOLERANCE
    with pytest.raises(OptionError, match="too loose"):
        check_tolerance(MAX_TOLERANCE * 1.01)
    import mlcomp

    with pytest.raises(OptionError, match="too loose"):
        mlcomp.compile("mlp", target="cpu", tolerance=2.0)


def _compile(folder, args):
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return CliRunner().invoke(main, ["compile", "mlp", "--no-cache", *args])
    finally:
        os.chdir(cwd)


def test_threads_above_the_cores_warned_once_and_stored_clamped(user_folder, monkeypatch):
    import mlcomp.hardware.link as link

    monkeypatch.setattr(link, "available_cores", lambda: 3)           # a fake 3-core machine
    res = _compile(user_folder, ["--threads", "10000", "-o", "out"])
    assert res.exit_code == 0, res.output
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning: --threads")]
    assert warnings == ["warning: --threads 10000 is more than the 3 core(s) this process may run on; using 3"]
    manifest = json.loads((user_folder / "out" / "manifest.json").read_text())
    assert manifest["options"]["threads"] == 3


def test_threads_within_the_cores_stored_as_given(user_folder, monkeypatch):
    import mlcomp.hardware.link as link

    monkeypatch.setattr(link, "available_cores", lambda: 3)
    res = _compile(user_folder, ["--threads", "2", "-o", "out"])
    assert res.exit_code == 0 and "warning" not in res.stderr, res.output
    assert json.loads((user_folder / "out" / "manifest.json").read_text())["options"]["threads"] == 2


def test_manifest_grows_linearly_with_the_passes(user_folder):
    sizes = {}
    for n in (10, 20, 160):
        res = _compile(user_folder, ["-p", ",".join(["dce"] * n), "-o", f"out{n}", "--no-verify"])
        assert res.exit_code == 0, res.output
        sizes[n] = (user_folder / f"out{n}" / "manifest.json").stat().st_size
    early = (sizes[20] - sizes[10]) / 10            # bytes per pass among the first passes
    late = (sizes[160] - sizes[20]) / 140           # and among later ones: the same when growth is linear
    assert late <= early * 1.1, sizes               # each position naming every earlier pass made it ~9x
    assert late < 1024, sizes


def test_position_text_is_bounded():
    from mlcomp.pipeline.composite import Position

    first = Position("dce", 1, 3000, ())
    last = Position("dce", 3000, 3000, ("cleanup", "dce"))
    assert first.describe() == "pass 1 of 3000, the first"
    assert last.describe() == "pass 3000 of 3000, after …, cleanup, dce"
    assert Position("fuse", 3, 3, ("cleanup", "dce")).describe() == "pass 3 of 3, after cleanup, dce"


def _nan_compiler(model, inputs, target, pipeline, options):
    """The real compiled model, its outputs turned to NaN: what a broken target produces."""
    from mlcomp.measure.bench import default_compiler

    fn = default_compiler(model, inputs, target, pipeline, options)
    return lambda *xs: fn(*xs) * float("nan")


@pytest.fixture
def nan_target(monkeypatch):
    import mlcomp.measure.bench as bench

    monkeypatch.setattr(bench, "run_bench", functools.partial(bench.run_bench, compiler=_nan_compiler))


BENCH = ["bench", "mlp", "--targets", "eager,cpu", "--budget", "0.001", "--min-repeats", "1", "--warmup", "0",
         "--no-memory"]


def test_bench_exits_4_when_a_target_fails_verification(user_folder, nan_target):
    check(user_folder, BENCH, code=4, expect=("1 of 2 bench cells failed verification", "mlp on cpu at batch 1",
                                              "NaN", "--keep-going"))


def test_bench_writes_its_results_before_failing(user_folder, nan_target):
    before = snapshot(user_folder)
    cwd = os.getcwd()
    os.chdir(user_folder)
    try:
        res = CliRunner().invoke(main, [*BENCH, "--json", "b.json"])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 4, res.output
    rows = json.loads((user_folder / "b.json").read_text())[0]["rows"]
    assert [r["verified"] for r in rows if r["target"] == "cpu"] == [False]
    assert set(snapshot(user_folder)) - set(before) == {"b.json"}


def test_bench_keep_going_exits_0(user_folder, nan_target):
    cwd = os.getcwd()
    os.chdir(user_folder)
    try:
        res = CliRunner().invoke(main, [*BENCH, "--keep-going"])
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0, res.output
    assert "FAIL" in res.stdout or "failed" in res.stdout


def test_bench_of_targets_that_verify_exits_0(user_folder):
    cwd = os.getcwd()
    os.chdir(user_folder)
    try:
        res = CliRunner().invoke(main, BENCH)
    finally:
        os.chdir(cwd)
    assert res.exit_code == 0, res.output
