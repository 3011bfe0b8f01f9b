"""``mlcomp bench --dtypes``: each target at fp32 / bf16 / int8 side by side, with a fake compiler."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from mlcomp.base.errors import PipelineSpecError
from mlcomp.hardware.timing import BenchConfigError, TimingPolicy
from mlcomp.measure.bench import BenchConfig, run_bench
from mlcomp.measure.bench_results import to_csv
from mlcomp.measure.variants import Variant, check_dtypes, variants
from mlcomp.targets.int8 import Int8Record

AVAIL = {"fake": None, "floaty": None}
POLICY = TimingPolicy(warmup=0, budget_s=0.002, min_repeats=1, max_repeats=3)


class _Art:
    """A compiled variant: int8 ones are 2 % off eager (beyond fp32's tolerance, within their declared one)."""

    def __init__(self, inner, int8: bool) -> None:
        self.inner, self.int8_variant = inner, int8
        self.manifest = {"declared_tolerance": 0.05} if int8 else {}
        self.runtime = type("R", (), {"int8": Int8Record("fake executed graph", {"Gemm8": 3}, {"Gemm": 1})
                                      if int8 else None})()

    def __call__(self, *xs):
        out = self.inner(*xs)
        return out * 1.02 if self.int8_variant else out


def _compiler(seen: list):
    def compile_fn(model, inputs, target, pipeline, options):
        seen.append((target, pipeline))
        if target == "floaty" and pipeline and "quantize" in pipeline:
            raise PipelineSpecError(f"target {target} would run the pairs as float arithmetic",
                                    hint="compile with --target fake")
        return _Art(getattr(model, "inner", model), bool(pipeline and "quantize" in pipeline))
    return compile_fn


def test_each_target_at_each_dtype_side_by_side():
    seen: list = []
    cfg = BenchConfig(targets=("fake", "floaty"), batches=(2,), policy=POLICY, memory=False, isolate=False,
                      dtypes=("fp32", "int8"))
    res = run_bench("mlp", cfg, compiler=_compiler(seen), availability=lambda: AVAIL, watch=None)
    assert [r.label for r in res.rows] == ["eager", "fake", "fake int8", "floaty", "floaty int8"]
    assert ("fake", None) in seen and ("fake", "fold-batchnorm,fold-constants,cleanup,quantize") in seen
    by = {r.label: r for r in res.rows}
    int8 = by["fake int8"]
    assert int8.dtype == "int8" and int8.status == "ok" and int8.verified is True   # its declared 5 %, not fp32's
    assert int8.max_rel_err == pytest.approx(0.02, rel=0.05) and int8.timing is not None
    assert int8.reason.startswith("int8: 3 of 4 compute ops")
    assert by["floaty int8"].status == "skipped" and "float arithmetic" in by["floaty int8"].reason
    assert by["fake"].verified is True and by["fake"].dtype == "fp32"
    rows = to_csv([res]).splitlines()
    assert rows[0].endswith(",dtype") and rows[3].endswith(",int8")
    assert res.to_json()["rows"][2]["dtype"] == "int8"
    assert "fake int8" in res.format()


def test_variant_pipelines_and_names():
    assert [v.key for v in variants(("eager", "cpu"), ("fp32", "bf16"))] == ["eager", "cpu", "cpu bf16"]
    assert Variant("cpu", "bf16").pipeline(None) == "mixed-precision{dtype=bf16}"
    assert Variant("cpu").pipeline("-O2") == "-O2"
    assert Variant.parse("cuda bf16") == Variant("cuda", "bf16")


def test_unknown_dtype_is_refused_naming_the_known_ones():
    with pytest.raises(BenchConfigError, match="int4") as err:
        BenchConfig(dtypes=("fp32", "int4"))
    assert "fp32, bf16, int8" in err.value.hint
    with pytest.raises(BenchConfigError, match="no compute precision"):
        check_dtypes(())
    from mlcomp.cli.main import main
    out = CliRunner().invoke(main, ["bench", "mlp", "--dtypes", "fp8", "--no-memory"])
    assert out.exit_code == 2 and "unknown compute precision 'fp8'" in out.output and "Traceback" not in out.output


def test_a_low_precision_row_says_what_its_runtime_ran():
    from mlcomp.measure.bench import _ran_in
    ov = type("R", (), {"int8": None, "precision": {"effective": "f32", "reason": "this CPU has no avx512_bf16"}})()
    assert _ran_in(ov, "bf16") == "ran f32: this CPU has no avx512_bf16"
    assert _ran_in(ov, "fp32") == "" and _ran_in(None, "bf16") == ""
