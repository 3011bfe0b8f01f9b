"""targets/tvm_backend.py: untuned MLP numerics, save -> load in a fresh process, tuning-database reuse."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.tvm

tvm_backend = pytest.importorskip("mlcomp.targets.tvm_backend")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 2)).eval()


def test_host_target_is_a_dict():
    t = tvm_backend.host_llvm_target(num_cores=2)
    assert t["kind"] == "llvm" and t["num-cores"] == 2 and t["mcpu"]


def test_mlp_untuned_save_and_load_in_fresh_process(tmp_path):
    model, x = _mlp(), torch.randn(4, 512)
    with torch.inference_mode():
        ref = model(x)
    mod = tvm_backend.build(model, (x,))
    out = mod(x)
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-5)
    assert mod.stats["offload"]["requested"] and "tune_trials" in mod.stats

    files = mod.save(str(tmp_path / "art"))
    assert "model.so" in files and all((tmp_path / "art" / f).exists() for f in files)
    torch.save({"x": x, "ref": ref}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch
        from mlcomp.targets.tvm_backend import TvmModule
        io = torch.load({str(tmp_path / "io.pt")!r})
        out = TvmModule.load({str(tmp_path / "art")!r})(io["x"])
        torch.testing.assert_close(out[0], io["ref"], rtol=1e-4, atol=1e-5)
        print("LOAD_OK", len(out))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "LOAD_OK 1" in res.stdout, res.stderr[-2000:]


def test_tuning_database_is_reused(tmp_path):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 32), nn.ReLU()).eval(), torch.randn(2, 64)
    with torch.inference_mode():
        ref = model(x)
    work = str(tmp_path / "tune")
    first = tvm_backend.build(model, (x,), tune_trials=8, work_dir=work)
    assert first.stats["trials_run"] == 8 and not first.stats["db_reused"]
    assert first.stats["tasks"] >= 1 and all(n >= 1 for n in first.stats["records_per_task"].values())
    torch.testing.assert_close(first(x)[0], ref, rtol=1e-4, atol=1e-5)

    second = tvm_backend.build(model, (x,), tune_trials=8, work_dir=work)
    assert second.stats["db_reused"] and second.stats["trials_run"] == 0
    assert second.stats["trials_before"] == 8 and second.stats["tuning_seconds"] < 5
    torch.testing.assert_close(second(x)[0], ref, rtol=1e-4, atol=1e-5)
