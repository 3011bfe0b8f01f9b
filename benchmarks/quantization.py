"""int8 on ONNX Runtime: mlcomp fp32 vs mlcomp ``quantize`` vs ORT's own ``quantize_static``.

    .venv/bin/python benchmarks/quantization.py                          # resnet18 + transformer, batch 1 and 32
    .venv/bin/python benchmarks/quantization.py --models resnet18 --batches 1 --budget 0.3

For each (zoo model, batch), with the example inputs as the calibration data:

* ``eager``: the module under ``torch.no_grad()`` (fp32), the reference for agreement and error;
* ``mlcomp:fp32``: ``mlcomp.compile(..., target="onnxruntime")`` with its default pipeline;
* ``mlcomp:int8``: the same with ``pipeline="-O2,quantize"`` (``--int8-pipeline``; Q/DQ pairs that ORT
  fuses into QLinearConv/QGemm/QLinearMatMul/QLinearAdd/QLinearSoftmax; the note lists the int8
  kernels in ORT's optimized graph);
* ``ort:int8``: ``torch.onnx.export`` of the module, then ORT's ``quantize_static`` (QDQ format,
  per-channel int8 weights, uint8 activations, min-max calibration on the same inputs).

Timed interleaved in rotated rounds (:func:`mlcomp.measure.rounds.compare`, speedups over
``mlcomp:fp32`` with 95% intervals; rounds when other processes kept the cores busy are set
aside and figures taken under load are marked).  Columns: median latency, speedup, top-1
agreement with eager (argmax of the last dim over every row), max relative error
(max |diff| / max |eager|), ONNX bytes, note.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mlcomp  # noqa: E402
from mlcomp.hardware.noise import LoadWatch  # noqa: E402
from mlcomp.measure.rounds import compare  # noqa: E402
from mlcomp.measure.samplers import local_samplers  # noqa: E402
from mlcomp.models import ZOO  # noqa: E402

INT8_KERNELS = ("QLinearConv", "QLinearMatMul", "QGemm", "MatMulInteger", "MatMulIntegerToFloat", "ConvInteger",
                "QLinearAdd", "QLinearMul", "QLinearSoftmax", "QLinearGlobalAveragePool")


def _session(model_bytes: bytes, opt_path: str):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.optimized_model_filepath = opt_path
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def _kernels(opt_path: str) -> str:
    import onnx
    ops = Counter(n.op_type for n in onnx.load(opt_path).graph.node)
    found = {k: v for k, v in ops.items() if k in INT8_KERNELS}
    return ", ".join(f"{k} x{v}" for k, v in sorted(found.items())) or "no int8 kernel"


def _ort_static(module, inputs, work: str):
    """ORT's own int8: torch.onnx export + quantize_static (QDQ, per-channel), calibrated on ``inputs``."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    fp32, int8 = os.path.join(work, "fp32.onnx"), os.path.join(work, "int8.onnx")
    torch.onnx.export(module, inputs, fp32, input_names=[f"x{i}" for i in range(len(inputs))], dynamo=False)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{f"x{i}": t.numpy() for i, t in enumerate(inputs)}])

        def get_next(self):
            return next(self.items, None)

    quantize_static(fp32, int8, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    opt = os.path.join(work, "int8.opt.onnx")
    sess = _session(open(int8, "rb").read(), opt)
    feed = {f"x{i}": t.numpy() for i, t in enumerate(inputs)}
    return (lambda: sess.run(None, feed)[0]), os.path.getsize(int8), _kernels(opt)


def _mlcomp(module, inputs, pipeline, work: str, tag: str):
    art = mlcomp.compile(module, inputs, target="onnxruntime", pipeline=pipeline)
    folder = art.save(os.path.join(work, tag))
    size = sum(p.stat().st_size for p in folder.rglob("*.onnx"))
    note = ""
    model_file = next(folder.rglob("*.onnx"), None)
    if model_file is not None:
        opt = os.path.join(work, f"{tag}.opt.onnx")
        _session(model_file.read_bytes(), opt)
        note = _kernels(opt)
    return (lambda: art(*inputs)), size, note


def _first(value):
    while isinstance(value, (tuple, list)):
        value = value[0]
    return torch.as_tensor(np.asarray(value)) if not isinstance(value, torch.Tensor) else value


def row(name: str, batch: int, budget: float, int8_pipeline: str = "-O2,quantize") -> None:
    z = ZOO[name]
    module, inputs = z.build(), z.example_inputs(batch)
    with torch.no_grad():
        ref = _first(module(*inputs))
    with tempfile.TemporaryDirectory() as work:
        variants = {"mlcomp:fp32": _mlcomp(module, inputs, None, work, "fp32"),
                    "mlcomp:int8": _mlcomp(module, inputs, int8_pipeline, work, "int8")}
        try:
            variants["ort:int8"] = _ort_static(module, inputs, work)
        except Exception as exc:  # noqa: BLE001 - an anchor that fails is a row note, not a crash
            print(f"  ort:int8 skipped: {type(exc).__name__}: {exc}")
        samplers = local_samplers({k: v[0] for k, v in variants.items()}, warmup=2, budget_s=budget)
        c = compare(samplers.fns, "mlcomp:fp32", budget_s=budget, min_rounds=5, watch=LoadWatch())
        print(f"\n{name} batch {batch} ({c.rounds} rounds, stopped: {c.stopped})")
        print(f"  {'variant':12} {'median ms':>10} {'speedup':>22} {'top-1':>6} {'max rel':>8} {'bytes':>10}  note")
        for key, (fn, size, note) in variants.items():
            out = _first(fn()).reshape(ref.shape)
            agree = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
            err = float((out - ref).abs().max() / ref.abs().max())
            sp = c.speedups.get(key)
            unreliable = " UNRELIABLE: " + "; ".join(c.reasons.get(key, ())) if c.reasons.get(key) else ""
            print(f"  {key:12} {c.timings[key].median * 1e3:10.2f} {sp.text() if sp else '1.00x (reference)':>22} "
                  f"{agree:6.3f} {err:8.4f} {size:10d}  {note}{unreliable}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,transformer")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per variant")
    ap.add_argument("--int8-pipeline", default="-O2,quantize", help="mlcomp's int8 pipeline")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            row(name, batch, args.budget, args.int8_pipeline)


if __name__ == "__main__":
    main()
