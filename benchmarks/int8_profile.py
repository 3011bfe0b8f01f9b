"""Where ONNX Runtime spends an int8 BERT's time: mlcomp's QDQ model against ``quantize_static``'s, op by op.

    .venv/bin/python benchmarks/int8_profile.py --batch 32 --layers 4      # BERT-base widths, 128 tokens

Both models of the same ``transformers`` ``BertModel`` (BERT-base widths, random weights, built as
``benchmarks/quantization.py``'s ``bert-base`` row) run in sessions with ORT's profiler on
(``SessionOptions.enable_profiling``, one intra-op thread, ORT's default optimizers, as a user's own
session of the saved file); per op type of the optimised graph: how
many nodes, milliseconds per run summed over them (the kernels' own time in the profile), the share
of the run.  The op counts need no clock; the times are this machine's, at its current load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter, defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402


def profile(path: str, feed: dict, runs: int, work: str) -> tuple[Counter, dict[str, float], float]:
    """Op-type counts of the optimised model, kernel ms per run by op type, and the whole run's ms."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    so.optimized_model_filepath = path + ".opt"
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(work, os.path.basename(path))
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    for _ in range(2 + runs):
        sess.run(None, feed)
    events = json.load(open(sess.end_profiling()))
    counts = Counter(n.op_type for n in onnx.load(path + ".opt", load_external_data=False).graph.node)
    by_op: dict[str, float] = defaultdict(float)
    runs_us = [e["dur"] for e in events if e.get("name") == "model_run"][2:]
    kernels = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    for e in kernels[len(kernels) * 2 // (2 + runs):]:
        by_op[e["args"]["op_name"]] += e["dur"] / 1e3 / runs
    return counts, dict(by_op), sum(runs_us) / len(runs_us) / 1e3


def main(argv=None) -> None:
    import quantization as Q
    import mlcomp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pipeline", default="fold-batchnorm,fold-constants,cleanup,quantize")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    module, inputs = Q.bert_base(args.batch, args.seq, args.layers)
    with tempfile.TemporaryDirectory() as work, torch.no_grad():
        art = mlcomp.compile(module, inputs, target="onnxruntime", pipeline=args.pipeline, threads=1)
        ours = os.path.join(work, "mlcomp.onnx")
        with open(ours, "wb") as f:
            f.write(art.runtime.model)
        Q.ort_static(module, inputs, work, 1)
        rows = {"mlcomp": (ours, {art.runtime.input_names[0]: inputs[0].numpy()}),
                "quantize_static": (os.path.join(work, "int8.onnx"), {"x0": inputs[0].numpy()})}
        got = {k: profile(p, feed, args.runs, work) for k, (p, feed) in rows.items()}
    ops = sorted(set().union(*(set(c) | set(t) for c, t, _ in got.values())),
                 key=lambda o: -max(t.get(o, 0.0) for _, t, _ in got.values()))
    print(f"bert-base widths, {args.layers} layers, batch {args.batch}, seq {args.seq}, 1 thread, {args.runs} runs")
    print(f"{'op':28}" + "".join(f"{k + ' n':>18}{'ms':>9}{'%':>6}" for k in got))
    for op in ops:
        print(f"{op:28}" + "".join(f"{c.get(op, 0):18d}{t.get(op, 0.0):9.1f}{100 * t.get(op, 0.0) / run:6.1f}"
                                   for c, t, run in got.values()))
    print(f"{'run (model_run)':28}" + "".join(f"{'':18}{run:9.1f}{'':6}" for _, _, run in got.values()))


if __name__ == "__main__":
    main()
