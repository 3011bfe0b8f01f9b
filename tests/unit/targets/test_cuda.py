"""The cuda target.  Without a GPU only the availability checks run; the rest skips (marker ``cuda``)."""
from __future__ import annotations

import pytest
import torch
from mlcomp.targets import CompileOptions, get_target
from mlcomp.runtime.artifact import Artifact

from mlcomp.base.errors import TargetUnavailableError
from tests.helpers.targets import FP32_RTOL, compile_zoo


def test_availability_says_why():
    reason = get_target("cuda").available()
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert "no CUDA device" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_compile_without_gpu_is_a_clear_error(captured):
    _, _, graph = captured("mlp")
    with pytest.raises(TargetUnavailableError, match="no CUDA device"):
        get_target("cuda").compile(graph, CompileOptions())


@pytest.mark.cuda
def test_zoo_on_cuda_with_graph_replay(captured, tmp_path):
    built = compile_zoo("cuda", captured, tmp_path, names=["mlp", "resnet18", "transformer"])
    for name, b in built.items():
        assert b.max_rel <= FP32_RTOL, name
        assert b.artifact.runtime.graph is not None, name      # static shapes: one CUDA graph
        out = b.artifact(*b.inputs)
        assert out.device.type == "cuda"
        again = Artifact.load(b.directory)
        assert again.verify(record=False).passed, name


@pytest.mark.cuda
def test_outputs_survive_the_next_replay(captured):
    _, inputs, graph = captured("mlp")
    art = get_target("cuda").compile(graph, CompileOptions())
    first = art(*inputs)
    kept = first.clone()
    art(torch.randn_like(inputs[0]))
    assert torch.equal(first, kept)
