"""``mlcomp export --format tvm``: a pure TVM build whose ``model.so`` plain TVM loads and runs with neither
torch nor mlcomp importable."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm

# torch and mlcomp blocked before anything imports them: `import torch` raises ImportError from here on
_PLAIN_TVM = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None
    sys.modules["mlcomp"] = None
    import numpy as np
    import tvm
    from tvm import relax
    folder, x_path, y_path = sys.argv[1:]
    vm = relax.VirtualMachine(tvm.runtime.load_module(folder + "/model.so"), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(np.load(x_path))).numpy()
    expected = np.load(y_path)
    assert sys.modules["torch"] is None and sys.modules["mlcomp"] is None
    print(out.shape == expected.shape, float(np.abs(out - expected).max()))
""")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def test_tvm_export_runs_on_plain_tvm_without_torch_or_mlcomp(tmp_path):
    from mlcomp.frontend.loading import load_model
    from mlcomp.targets.export import ExportFormat, export_graph

    torch.manual_seed(0)
    module = _Net().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = module(x)
    graph = load_model(module, example_inputs=(x,)).capture()
    path, result = export_graph(graph, ExportFormat.TVM, tmp_path / "net-tvm", (x,), expected)
    assert result.passed
    assert not (path / "kernels.py").exists()     # no torch kernel calls, nothing to register
    meta = json.loads((path / "meta.json").read_text())
    assert meta["needs"] == ["apache-tvm"]
    assert meta["stats"]["offload"]["in_torch"] == 0 and meta["stats"]["offload"]["host"]["kernels"] is False

    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "y.npy", expected.numpy())
    run = subprocess.run([sys.executable, "-c", _PLAIN_TVM, str(path), str(tmp_path / "x.npy"),
                          str(tmp_path / "y.npy")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    same_shape, max_abs = run.stdout.split()
    assert same_shape == "True" and float(max_abs) < 1e-4


def test_the_blocker_really_blocks_torch():
    """The subprocess's blocker makes ``import torch`` fail (so the export test above cannot pass by using it)."""
    run = subprocess.run([sys.executable, "-c", "import sys; sys.modules['torch'] = None; import torch"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "ModuleNotFoundError: import of torch halted" in run.stderr
