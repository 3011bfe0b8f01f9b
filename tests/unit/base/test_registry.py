"""mlcomp.base.registry: one lazy name → implementation table, one did-you-mean, used everywhere."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mlcomp.base.errors import PipelineSpecError, TargetUnavailableError
from mlcomp.base.registry import LazyRegistry, did_you_mean, resolve_ref


def test_did_you_mean():
    assert did_you_mean("fuze", ["fuse", "cse", "dce"]) == "fuse"
    assert did_you_mean("quantize", ["fuse", "cse", "dce"]) is None
    assert did_you_mean("x", []) is None


def test_references_import_on_first_use_and_objects_are_kept():
    reg: LazyRegistry[object] = LazyRegistry("thing", {"join": "os.path:join", "mod": "json", "obj": len})
    import json
    import os.path

    assert reg.names() == ["join", "mod", "obj"] and "join" in reg and len(reg) == 3
    assert reg.ref("join") == "os.path:join"                   # no import needed to read the table
    assert reg.get("join") is os.path.join and reg.get("mod") is json and reg.get("obj") is len
    reg.register("join", "os.path:dirname", replace=True)      # replacing drops the cached object
    assert reg.get("join") is os.path.dirname
    with pytest.raises(ValueError, match="thing 'obj' is already registered"):
        reg.register("obj", abs)
    with pytest.raises(KeyError, match="unknown thing 'jion'; did you mean 'join'"):
        reg.get("jion")
    with pytest.raises(ValueError, match="not of the form"):
        resolve_ref("os.path:")


def test_callers_keep_their_own_error_types():
    reg = LazyRegistry("pass", {"fuse": "x:y"},
                       on_unknown=lambda name, close: PipelineSpecError(f"no {name} ({close})"))
    with pytest.raises(PipelineSpecError, match=r"no fuze \(fuse\)"):
        reg.get("fuze")


def test_every_table_is_a_lazy_registry():
    from mlcomp.cli.main import COMMANDS
    from mlcomp.pipeline.pass_base import REGISTRY
    from mlcomp.study import study_module
    from mlcomp.runtime.artifact import RUNTIMES, RuntimeKind
    from mlcomp.targets.base import TARGETS, get_target

    assert {"compile", "passes", "study"} <= set(COMMANDS.names())
    assert set(RUNTIMES.names()) == {k.value for k in RuntimeKind}
    assert RuntimeKind.EAGER.runtime_class().__name__ == "EagerRuntime"
    assert TARGETS.names() == ["cpu", "cuda", "distributed", "onnxruntime", "openvino", "tvm"] and get_target("ort").name == "onnxruntime"
    with pytest.raises(TargetUnavailableError, match="there is no target named 'onnxrt' \\(did you mean 'onnxruntime'"):
        get_target("onnxrt")
    with pytest.raises(PipelineSpecError, match="unknown pass 'fuse-elemntwise'; did you mean 'fuse-elementwise'"):
        REGISTRY.get("fuse-elemntwise")
    assert study_module("roofline").__name__ == "mlcomp.study.roofline"


def test_listing_commands_and_passes_imports_no_backend():
    code = ("import sys; from mlcomp.cli.main import main, COMMANDS; "
            "from mlcomp.pipeline import Pipeline; Pipeline.parse('-O2'); COMMANDS.names(); "
            "print(sorted(m for m in ('tvm', 'onnxruntime', 'mlcomp.targets.tvm.target', 'mlcomp.study.roofline') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_zoo_names_suggest_the_closest():
    from mlcomp.base.errors import ModelLoadError
    from mlcomp.frontend.loading import load_model
    from mlcomp.models import get

    with pytest.raises(ModelLoadError, match="no zoo model has that name \\(did you mean 'mlp'\\?\\)"):
        load_model("mlpp")
    with pytest.raises(ModelLoadError, match="there is no zoo model named 'resnet19' \\(did you mean 'resnet18'"):
        get("resnet19")
