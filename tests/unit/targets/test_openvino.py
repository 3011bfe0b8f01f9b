"""The openvino target: zoo + HF BERT verify, save/reload, precision hint, op refusals, missing package."""
from __future__ import annotations

import re

import pytest
import torch
from mlcomp.targets import CompileOptions, Fallback, get_target
from mlcomp.targets.openvino.target import (OpenVinoTarget, precision_hint, requested_precision,
                                            without_legacy_empties)
from torch import nn

import mlcomp
from mlcomp.base.errors import InputSpecError, TargetUnavailableError, UnsupportedOpError
from mlcomp.frontend.loading import load_model
from mlcomp.hardware.probe import cpu_flags
from mlcomp.pipeline import run_pipeline
from tests.helpers.targets import FP32_RTOL, ZOO_NAMES, KthValueNet, compile_zoo

pytestmark = pytest.mark.openvino

BERT = "hf-bert"
# the zoo but its transformer (HF BERT covers attention): every model costs a conversion, and the
# whole file stays within its share of the suite's time
MODELS = [n for n in ZOO_NAMES if n != "transformer"] + [BERT]


@pytest.fixture(scope="module")
def built(captured, tmp_path_factory):
    from mlcomp.models.third_party import build_third_party

    pytest.importorskip("transformers")
    bert, ids = build_third_party("bert", batch=2)
    # -O2 for openvino is cleanup, which leaves aten.reshape: not in OpenVINO's table, lowered via make_fx
    graph, _ = run_pipeline(load_model(bert, example_inputs=ids).capture(), "cleanup")
    assert any(n.op.name == "reshape" for n in graph.call_nodes())

    def with_bert(name, batch=2):
        return (bert, ids, graph) if name == BERT else captured(name, batch)

    return compile_zoo("openvino", with_bert, tmp_path_factory.mktemp("ov"), names=MODELS, threads=2)


@pytest.mark.parametrize("name", MODELS)
def test_compiles_verifies_and_records_an_explicit_f32_hint(built, name):
    b = built[name]
    assert b.max_rel <= FP32_RTOL
    assert (b.directory / "model.xml").is_file() and (b.directory / "model.bin").is_file()
    manifest = b.artifact.manifest
    assert manifest["versions"]["openvino"] and manifest["runtime"] == "openvino"
    info = manifest["runtime_info"]
    assert info["precision"]["hint"] == "f32" and info["precision"]["effective"] == "f32"
    assert info["requested"] == "f32" and info["threads"] == 2
    compiled = b.artifact.runtime.compiled
    assert compiled.get_property("INFERENCE_NUM_THREADS") == 2


def test_reload_gives_the_same_numbers_and_plain_openvino_reads_the_payload(built):
    import openvino as ov

    for name, b in built.items():
        again = mlcomp.load(b.directory)
        assert again.target == "openvino" and again.verify(record=False).max_rel <= FP32_RTOL, name
        assert torch.equal(again(*b.inputs), b.artifact(*b.inputs)), name
    mlp = built["mlp"]
    plain = ov.Core().compile_model(str(mlp.directory / "model.xml"), "CPU",
                                    {"INFERENCE_PRECISION_HINT": "f32"})
    (x,) = mlp.inputs
    assert torch.equal(torch.from_numpy(plain([x.numpy()])[0]), mlp.artifact(x))


def test_outputs_are_kept_and_wrong_inputs_refused(built):
    b = built["mlp"]
    (x,) = b.inputs
    first = b.artifact(x)
    kept = first.clone()
    b.artifact(x + 1)
    assert torch.equal(first, kept)         # the infer request's buffers are not handed out
    for bad, what in ((x.double(), "has dtype f64"), (x[:1], "has shape [1, 512]")):
        with pytest.raises(InputSpecError, match=re.escape(what)):   # OpenVINO would convert f64 silently
            b.artifact(bad)


@pytest.mark.slow
def test_precision_follows_the_pipeline_and_never_goes_below_it(captured):
    assert precision_hint(torch.float32, ("avx512_bf16", "amx_bf16"))[0] == torch.float32
    assert precision_hint(torch.bfloat16, ("avx512_bf16",))[0] == torch.bfloat16
    hint, why = precision_hint(torch.bfloat16, ("avx512f",))
    assert hint == torch.float32 and "none of avx512_bf16, amx_bf16" in why

    module, inputs, graph = captured("mlp")
    low, _ = run_pipeline(graph, "mixed-precision{dtype=bf16}")
    assert requested_precision(low) == torch.bfloat16
    art = get_target("openvino").compile(low, CompileOptions())

    record = art.runtime.precision
    assert record["requested"] == "bf16"
    has_bf16 = bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))
    assert record["hint"] == ("bf16" if has_bf16 else "f32")
    with torch.no_grad():
        art.set_reference(inputs, (module(*inputs),))
    assert art.verify(record=False).passed        # against eager fp32, at the graph's declared tolerance



class EmptyCat(nn.Module):
    """torch's legacy cat rule skips a 1-D empty operand (a key/value cache's first layer); OpenVINO's Concat
    refuses ranks that differ, so the target leaves the operand out."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("past", torch.empty(0))

    def forward(self, x):
        return torch.cat([self.past, x * 2], dim=-2) + 1


@pytest.mark.slow
def test_unsupported_ops_are_explained_per_node_and_fall_back():
    module, x = KthValueNet().eval(), torch.randn(4, 16)
    graph = load_model(module, example_inputs=(x,)).capture()
    target = get_target("openvino")
    bad = target.unsupported(graph)
    assert len(bad) == 1 and "no translation for aten.kthvalue" in next(iter(bad.values()))
    with pytest.raises(UnsupportedOpError, match="kthvalue"):
        target.compile(graph, CompileOptions())
    art = target.compile(graph, CompileOptions(fallback=Fallback.EAGER))
    assert [r["runs_on"] for r in art.manifest["fallback_regions"]] == ["openvino", "torch (eager)", "openvino"]
    with torch.no_grad():
        assert torch.allclose(art(x), module(x), atol=1e-5)

    empty, y = EmptyCat().eval(), torch.randn(2, 3, 4)
    graph = load_model(empty, example_inputs=(y,)).capture()
    assert not target.unsupported(graph)
    assert [len(n.inputs[0]) for n in without_legacy_empties(graph).call_nodes() if n.op.name == "cat"] == [1]
    assert [len(n.inputs[0]) for n in graph.call_nodes() if n.op.name == "cat"] == [2]     # the graph kept
    art = target.compile(graph, CompileOptions())
    with torch.no_grad():
        assert torch.allclose(art(y), empty(y), atol=1e-6)


def test_missing_package_names_the_install_command(captured):
    class Missing(OpenVinoTarget):
        package = "openvino_not_installed_here"

    _, _, graph = captured("mlp")
    assert "pip install 'mlcomp[openvino]'" in Missing().available()
    with pytest.raises(TargetUnavailableError, match=r"target openvino is not available: the "
                                                     r"openvino_not_installed_here package is not installed"):
        Missing().compile(graph, CompileOptions())
    assert requested_precision(graph) == torch.float32
