"""Docstrings' ``>>>`` examples run as doctests.

Every mlcomp module whose source holds a ``>>>`` example is found here and its examples are run
(``doctest.testmod``, ELLIPSIS and NORMALIZE_WHITESPACE, in an empty working folder).  A module
whose examples are sketches over objects they never build (``compare(eager(x), artifact(x))``) is
listed in :data:`SKETCHES` until its examples are made runnable (:func:`test_sketch_list_is_current`
fails when a listed module no longer has examples).
"""
from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mlcomp"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# modules whose examples are illustrations, not yet runnable doctests (they name objects the example
# never builds, or print timings of this machine); each entry is work left
SKETCHES = frozenset({
    "mlcomp", "mlcomp.analysis.cost", "mlcomp.analysis.inspect", "mlcomp.analysis.memory",
    "mlcomp.analysis.parallel.placement_cost", "mlcomp.analysis.precision_error", "mlcomp.analysis.ranges",
    "mlcomp.analysis.training", "mlcomp.analysis.workspace", "mlcomp.api", "mlcomp.api.auto.rank",
    "mlcomp.api.auto.search", "mlcomp.api.cache_key", "mlcomp.api.cache_size", "mlcomp.api.compiler",
    "mlcomp.api.inputs", "mlcomp.api.lowering", "mlcomp.base.files", "mlcomp.base.progress",
    "mlcomp.base.quiet", "mlcomp.base.registry", "mlcomp.base.spec", "mlcomp.base.spec_options",
    "mlcomp.frontend.joint", "mlcomp.frontend.losses", "mlcomp.frontend.provenance", "mlcomp.hardware.link",
    "mlcomp.hardware.memory", "mlcomp.hardware.probe", "mlcomp.hardware.timing", "mlcomp.ir.builder",
    "mlcomp.ir.composites", "mlcomp.ir.constants", "mlcomp.ir.graph_tools", "mlcomp.ir.interpreter",
    "mlcomp.ir.kernel_plan", "mlcomp.ir.node", "mlcomp.ir.opsets", "mlcomp.ir.split", "mlcomp.measure.bench",
    "mlcomp.measure.bench_results", "mlcomp.measure.remat_sweep", "mlcomp.measure.training_bench",
    "mlcomp.models.third_party", "mlcomp.passes.patterns", "mlcomp.passes.remat.problem",
    "mlcomp.passes.remat.solvers", "mlcomp.pipeline.manager", "mlcomp.pipeline.presets",
    "mlcomp.runtime.artifact", "mlcomp.runtime.codegen", "mlcomp.runtime.timing_worker", "mlcomp.study",
    "mlcomp.targets.backend_errors", "mlcomp.targets.base", "mlcomp.targets.capabilities",
    "mlcomp.targets.export", "mlcomp.targets.fallback", "mlcomp.targets.onnx.target",
    "mlcomp.targets.openvino.target", "mlcomp.targets.torch.cpu", "mlcomp.targets.torch.cuda",
    "mlcomp.targets.tvm.target", "mlcomp.training.check", "mlcomp.training.step",
})


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def _run(name: str) -> doctest.TestResults:
    module = importlib.import_module(name)
    return doctest.testmod(module, optionflags=FLAGS, report=False, verbose=False)


@pytest.mark.parametrize("name", [m for m in MODULES if m not in SKETCHES])
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # an example that saves writes here
    result = _run(name)
    assert result.attempted > 0, f"{name}: no example found by doctest (a '>>>' outside a docstring?)"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples fail (run " \
                               f"`python -m doctest -v {name.replace('.', '/')}.py` to see them)"


def test_sketch_list_is_current():
    assert SKETCHES <= set(MODULES), sorted(SKETCHES - set(MODULES))
