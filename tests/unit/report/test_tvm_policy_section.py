"""The report shows the TVM offload policy table when the tvm target is benchmarked (and only then)."""
from __future__ import annotations

import torch

from mlcomp.measure.bench import BenchConfig
from mlcomp.hardware.timing import TimingPolicy
from mlcomp.html_report import ReportConfig, build_report
from mlcomp.targets.tvm.offload.policy import RULES

FAST = TimingPolicy(warmup=1, budget_s=0.005, min_repeats=1, max_repeats=20)


def _options(name: str) -> dict:
    # the bench's compiler and availability are injected: a traced module stands in for the compiled target
    return {"compiler": lambda model, inputs, target, pipeline, options: torch.jit.trace(model, inputs),
            "availability": lambda: {name: None}}


def test_report_lists_the_tvm_policy_rows(tmp_path):
    cfg = ReportConfig(BenchConfig(targets=("tvm",), batches=(1,), policy=FAST, memory=False),
                       bench_options=_options("tvm"))
    build_report("mlp", tmp_path / "rep", cfg)
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "TVM: which ops run in torch's kernels" in page
    assert all(r.name in page for r in RULES)
    assert "conv2d-packed" in page and "scaled_dot_product_attention" in page

