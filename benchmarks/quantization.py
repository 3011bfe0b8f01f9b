"""int8 per target: mlcomp fp32 vs mlcomp ``quantize`` on onnxruntime / openvino / cpu, and the anchors.

    .venv/bin/python benchmarks/quantization.py          # resnet18, transformer, bert, vit at batch 1 and 32
    .venv/bin/python benchmarks/quantization.py --models bert-base --batches 32,1   # BERT-base-sized, 4 layers
    .venv/bin/python benchmarks/quantization.py --models resnet18 --batches 1 --budget 0.05 --targets openvino

For each (model, batch), with the example inputs as the calibration data (zoo models from
``mlcomp.models.ZOO``; ``bert`` and ``vit`` are ``transformers`` models with random weights from
``mlcomp.models.third_party``; ``bert-base`` is ``transformers``' ``BertModel`` at BERT-base's widths,
hidden 768, 12 heads, intermediate 3072, vocabulary 30522, with ``--bert-layers`` layers (4) and
``--seq`` tokens (128), random weights from its config class, nothing downloaded):

* ``eager``: the module under ``torch.no_grad()`` (fp32): the reference for speedup, agreement and error;
* ``<target>:fp32``: ``mlcomp.compile(..., target=<target>)`` with its default pipeline (mlcomp's fp32 best);
* ``<target>:int8``: the same with the bench's int8 pipeline (``mlcomp.measure.variants``:
  ``fold-batchnorm,fold-constants,cleanup,quantize``); the note is the runtime's own account of which
  compute ops ran in int8 (``runtime.int8``: ORT's optimized graph, OpenVINO's runtime model); a target
  without an int8 lowering (cpu, tvm) prints its refusal;
* ``ort:quantize_static``: ``torch.onnx.export`` of the module, then ORT's ``quantize_static`` (QDQ,
  per-channel int8 weights, uint8 activations, min-max on the same inputs);
* ``ov:nncf``: ``openvino.convert_model`` of the module, then ``nncf.quantize`` (its defaults; transformer
  model type for bert, vit and the transformer) on the same inputs, compiled with an f32 hint
  (skipped with a line when ``nncf`` is not installed).

Timed interleaved in rotated rounds (:func:`mlcomp.measure.rounds.compare`; speedups over eager with
95% intervals; rounds when other processes kept the cores busy are set aside and figures taken under
load are marked).  Columns: median latency, speedup over eager, ratio to the same target's fp32,
top-1 agreement with eager (argmax of the last dim over every row), max relative error
(max |diff| / max |eager|), bytes on disk, note.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mlcomp  # noqa: E402
from mlcomp.base.errors import MlcompError  # noqa: E402
from mlcomp.hardware.noise import LoadWatch  # noqa: E402
from mlcomp.measure.rounds import compare  # noqa: E402
from mlcomp.measure.samplers import local_samplers  # noqa: E402
from mlcomp.measure.variants import Variant  # noqa: E402
from mlcomp.models import ZOO  # noqa: E402
from mlcomp.targets.int8 import Int8Record  # noqa: E402

THIRD_PARTY = ("bert", "vit")
TRANSFORMERS = frozenset({"transformer", "bert", "vit", "bert-base"})
BERT_BASE = {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522}
# name -> (callable, bytes on disk, note); a variant that could not be built is a printed line instead
Built = tuple[Callable[[], Any], int, str]


def bert_base(batch: int, seq: int, layers: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """``BertModel`` at BERT-base's widths with ``layers`` layers, random weights; token ids ``[batch, seq]``."""
    import transformers as tf
    from mlcomp.models.third_party import LastHidden
    torch.manual_seed(0)
    model = LastHidden(tf.BertModel(tf.BertConfig(num_hidden_layers=layers, **BERT_BASE))).eval()
    ids = torch.randint(0, BERT_BASE["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, (ids,)


def build(name: str, batch: int, seq: int = 128, layers: int = 4) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    if name == "bert-base":
        return bert_base(batch, seq, layers)
    if name in THIRD_PARTY:
        from mlcomp.models.third_party import build_third_party
        module, inputs = build_third_party(name, batch=batch)
        return module.eval(), tuple(inputs)
    z = ZOO[name]
    return z.build().eval(), tuple(z.example_inputs(batch))


def _ort_session(model: bytes | str, threads: int, optimized: str | None = None):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if optimized:
        so.optimized_model_filepath = optimized
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def ort_static(module, inputs, work: str, threads: int) -> Built:
    """ORT's own int8: torch.onnx export + quantize_static (QDQ, per-channel), calibrated on ``inputs``."""
    import onnx
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    fp32, int8, opt = (os.path.join(work, f) for f in ("fp32.onnx", "int8.onnx", "int8.opt.onnx"))
    names = [f"x{i}" for i in range(len(inputs))]
    torch.onnx.export(module, inputs, fp32, input_names=names, dynamo=False)
    feed = {n: t.numpy() for n, t in zip(names, inputs)}

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([feed])

        def get_next(self):
            return next(self.items, None)

    quantize_static(fp32, int8, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    sess = _ort_session(int8, threads, opt)
    ops = [n.op_type for n in onnx.load(opt).graph.node]
    ran = Int8Record.from_op_types({k: ops.count(k) for k in set(ops)})
    return (lambda: sess.run(None, feed)[0]), os.path.getsize(int8), ran.line()


def ov_config(threads: int) -> dict[str, Any]:
    """How the NNCF anchor is compiled for OpenVINO's CPU plugin: an f32 hint, latency, ``threads``, unpinned."""
    from mlcomp.targets.openvino.target import cpu_config

    return cpu_config("f32", threads)


def nncf_saved(name: str, module, inputs, path: str):
    """OpenVINO's own int8 of ``module``: convert_model + nncf.quantize (transformer model type for
    :data:`TRANSFORMERS`) calibrated on ``inputs``, saved as ``path`` (an ``.xml``); the quantized model."""
    import nncf
    import openvino as ov
    model = ov.convert_model(module, example_input=inputs if len(inputs) > 1 else inputs[0])
    data = nncf.Dataset([tuple(t.numpy() for t in inputs)] if len(inputs) > 1 else [inputs[0].numpy()])
    kind = {"model_type": nncf.ModelType.TRANSFORMER} if name in TRANSFORMERS else {}
    quantized = nncf.quantize(model, data, subset_size=1, **kind)
    ov.save_model(quantized, path, compress_to_fp16=False)
    return quantized


def ov_nncf(name: str, module, inputs, work: str, threads: int) -> Built:
    """OpenVINO's own int8 (:func:`nncf_saved`), compiled with an f32 hint."""
    import openvino as ov
    from mlcomp.targets.openvino.int8 import int8_layers
    path = os.path.join(work, "nncf.xml")
    quantized = nncf_saved(name, module, inputs, path)
    compiled = ov.Core().compile_model(quantized, "CPU", ov_config(threads))
    request = compiled.create_infer_request()
    arrays = [t.numpy() for t in inputs]
    size = os.path.getsize(path) + os.path.getsize(path[:-4] + ".bin")
    return (lambda: request.infer(arrays)[0]), size, int8_layers(compiled).line()


def mlcomp_saved(module, inputs, variant: Variant, work: str, threads: int) -> tuple[Any, Path] | str:
    """``module`` compiled by mlcomp for ``variant`` and saved under ``work``: the artifact and its folder;
    the refusal as a line when it cannot be."""
    try:
        art = mlcomp.compile(module, inputs, target=variant.target, pipeline=variant.pipeline(None), threads=threads)
    except MlcompError as err:
        return " ".join(err.message.split())[:160]
    return art, Path(art.save(os.path.join(work, variant.key.replace(" ", "-"))))


def mlcomp_variant(module, inputs, variant: Variant, work: str, threads: int) -> Built | str:
    """``module`` compiled by mlcomp for ``variant`` (:func:`mlcomp_saved`) as a timed variant."""
    got = mlcomp_saved(module, inputs, variant, work, threads)
    if isinstance(got, str):
        return got
    art, folder = got
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    ran = getattr(art.runtime, "int8", None)
    return (lambda: art(*inputs)), size, ran.line() if ran is not None else ""


def _first(value) -> torch.Tensor:
    while isinstance(value, (tuple, list)):
        value = value[0]
    if hasattr(value, "logits"):
        value = value.logits
    return torch.as_tensor(np.asarray(value)) if not isinstance(value, torch.Tensor) else value


def variants_for(name: str, module, inputs, targets: list[str], anchors: list[str], work: str,
                 threads: int) -> dict[str, Built]:
    built: dict[str, Built] = {"eager": ((lambda: module(*inputs)),
                                         sum(p.numel() * p.element_size() for p in module.parameters()), "")}
    for target in targets:
        for dtype in ("fp32", "int8"):
            got = mlcomp_variant(module, inputs, Variant(target, dtype), work, threads)
            if isinstance(got, str):
                print(f"  {target}:{dtype} not built: {got}")
            else:
                built[f"{target}:{dtype}"] = got
    makers = {"ort:quantize_static": lambda: ort_static(module, inputs, work, threads),
              "ov:nncf": lambda: ov_nncf(name, module, inputs, work, threads)}
    for anchor in anchors:
        try:
            built[anchor] = makers[anchor]()
        except Exception as exc:  # noqa: BLE001 - an anchor that fails is a line, not a crash
            print(f"  {anchor} skipped: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}")
    return built


def row(name: str, batch: int, targets: list[str], anchors: list[str], budget: float, threads: int,
        seq: int = 128, layers: int = 4) -> None:
    module, inputs = build(name, batch, seq, layers)
    with torch.no_grad():
        ref = _first(module(*inputs))
        with tempfile.TemporaryDirectory() as work:
            built = variants_for(name, module, inputs, targets, anchors, work, threads)
            samplers = local_samplers({k: v[0] for k, v in built.items()}, warmup=2, budget_s=budget)
            c = compare(samplers.fns, "eager", budget_s=budget, min_rounds=5, watch=LoadWatch())
            print(f"\n{name} batch {batch} ({c.rounds} rounds, stopped: {c.stopped})")
            print(f"  {'variant':22} {'median ms':>10} {'speedup vs eager':>26} {'vs fp32':>8} {'top-1':>6} "
                  f"{'max rel':>8} {'bytes':>10}  note")
            for key, (fn, size, note) in built.items():
                out = _first(fn()).reshape(ref.shape)
                agree = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
                err = float((out - ref).abs().max() / ref.abs().max())
                sp = c.speedups.get(key)
                fp32 = key.replace(":int8", ":fp32")
                vs = f"{c.timings[fp32].median / c.timings[key].median:7.2f}x" if key.endswith(":int8") \
                    and fp32 in c.timings else "—"
                shaky = " UNRELIABLE: " + "; ".join(c.reasons[key]) if c.reasons.get(key) else ""
                print(f"  {key:22} {c.timings[key].median * 1e3:10.2f} "
                      f"{sp.text() if sp and key != 'eager' else 'reference':>26} {vs:>8} {agree:6.3f} {err:8.4f} "
                      f"{size:10d}  {note}{shaky}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,transformer,bert,vit")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--targets", default="onnxruntime,openvino,cpu", help="mlcomp targets, each at fp32 and int8")
    ap.add_argument("--anchors", default="ort:quantize_static,ov:nncf")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per variant")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every variant")
    ap.add_argument("--seq", type=int, default=128, help="bert-base: tokens per sequence")
    ap.add_argument("--bert-layers", type=int, default=4, help="bert-base: encoder layers")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    split = (lambda s: [x for x in s.split(",") if x])  # noqa: E731
    for name in split(args.models):
        for batch in (int(b) for b in split(args.batches)):
            row(name, batch, split(args.targets), split(args.anchors), args.budget, args.threads, args.seq,
                args.bert_layers)


if __name__ == "__main__":
    main()
