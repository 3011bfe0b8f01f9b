"""Helpers shared by the target tests: compile the zoo, check artifacts in a fresh process.

    built = compile_zoo("cpu", captured, tmp_root)        # {name: Built}
    report = fresh_process_check(dirs, plain="torchscript")
    report[name]["plain_rel"], report[name]["mlcomp_rel"]

The fresh-process check runs ONE subprocess per target for all models: it first
loads every payload with the plain tool (``torch.jit.load`` / ``onnxruntime`` /
TVM's runtime) *before importing mlcomp* and compares with the stored eager
outputs, then loads every folder with ``mlcomp.load`` and verifies again.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from mlcomp.targets import CompileOptions, get_target

from mlcomp.analysis.verify import flatten_outputs

ZOO_NAMES = ["mlp", "lenet", "resnet18", "transformer", "gru"]
SPECTRAL = "tests/data/spectral.py:build"
FP32_RTOL = 1e-4
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Built:
    artifact: object
    module: torch.nn.Module
    inputs: tuple
    directory: Path
    max_rel: float


def compile_zoo(target: str, captured, root: Path, names=ZOO_NAMES, **options) -> dict[str, Built]:
    """Compile, verify against eager and save every model; one folder per model under ``root``."""
    out = {}
    for name in names:
        module, inputs, graph = captured(name)
        art = get_target(target).compile(graph, CompileOptions.make(**options))
        with torch.no_grad():
            art.set_reference(inputs, tuple(flatten_outputs(module(*inputs))))
        result = art.verify()
        art.save(root / name)
        out[name] = Built(art, module, inputs, root / name, result.max_rel)
    return out


class KthValueNet(nn.Module):
    """``kthvalue`` has a torch kernel but no ONNX or OpenVINO translation (and no decomposition)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = torch.relu(self.fc(x))
        return y - torch.kthvalue(y, 3, dim=-1, keepdim=True).values


_PLAIN = {
    "torchscript": """
def plain(d):
    m = torch.jit.load(d + "/model.pt")
    return lambda *xs: m(*xs)
""",
    "onnx": """
def plain(d):
    import onnxruntime
    s = onnxruntime.InferenceSession(d + "/model.onnx", providers=["CPUExecutionProvider"])
    names = [i.name for i in s.get_inputs()]
    return lambda *xs: [torch.from_numpy(o) for o in s.run(None, {n: x.numpy() for n, x in zip(names, xs)})]
""",
    "tvm": """
def plain(d):
    import os, runpy
    import tvm
    from tvm import relax
    if os.path.exists(d + "/kernels.py"):     # the vendor kernels the module calls, registered without mlcomp
        runpy.run_path(d + "/kernels.py")["register_kernels"]()
    vm = relax.VirtualMachine(tvm.runtime.load_module(d + "/model.so"), tvm.cpu())
    def run(*xs):
        out = vm["main"](*[tvm.runtime.tensor(x.numpy()) for x in xs])
        out = [out] if hasattr(out, "numpy") else list(out)
        return [torch.from_numpy(o.numpy()) for o in out]
    return run
""",
}

_SCRIPT = """
import json, sys, torch
{plain}
def rel(outs, expected):
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    return max(float((a - e).abs().max() / e.abs().max()) for a, e in zip(outs, expected))
report = {{}}
for d in sys.argv[1:]:
    ref = torch.load(d + "/reference.pt", weights_only=True)
    report[d] = {{"plain_rel": rel(plain(d)(*ref["inputs"]), ref["expected"])}}
report["mlcomp_imported_before"] = "mlcomp" in sys.modules
import mlcomp
for d in sys.argv[1:]:
    art = mlcomp.load(d)
    r = art.verify(record=False, raise_on_failure=False)
    report[d].update(mlcomp_rel=r.max_rel, passed=r.passed, target=art.target)
print("REPORT" + json.dumps(report))
"""


def fresh_process_check(dirs: list[Path], plain: str) -> dict:
    """Run the plain-tool and ``mlcomp.load`` checks on ``dirs`` in one new Python process."""
    script = _SCRIPT.format(plain=_PLAIN[plain])
    proc = subprocess.run([sys.executable, "-c", script, *map(str, dirs)], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT")][-1]
    report = json.loads(line[len("REPORT"):])
    assert report.pop("mlcomp_imported_before") is False
    return {Path(k).name: v for k, v in report.items()}
