"""OpenVINO on GRU models: mlcomp's unrolled cells, mlcomp's ``GRUSequence``, OpenVINO's own conversion.

Three builds of each row, timed interleaved in one process (median ms of one call, one thread)::

    .venv/bin/python benchmarks/ov_gru.py --rows gru-tagger@2,gru-tagger-2l@2 --rounds 200

* ``m:ov unrolled`` — mlcomp's ``-O2`` with the GRU left as its unrolled cells (``whole_rnns`` off);
* ``m:ov -O2`` — mlcomp's ``-O2``: the GRU goes over whole (``mlcomp.targets.openvino.gru``), ``RNNSeq``;
* ``ov module`` — ``ov.convert_model(module)`` (TorchScript inside), which keeps ``nn.GRU`` whole.

Each column also gives the executed graph's kernel count and ``RNNSeq`` layers.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def _builds(row: str, threads: int) -> dict:
    import openvino as ov

    import mlcomp
    from anchors_graphs import build_row
    from mlcomp.measure.executed import ov_executed
    from mlcomp.targets.openvino.target import cpu_config

    from mlcomp.targets.openvino import target

    module, inputs = build_row(row)
    out = {}
    whole = target.whole_rnns
    for name in ("m:ov unrolled", "m:ov -O2"):
        target.whole_rnns = whole if name == "m:ov -O2" else (lambda graph, inputs: (graph, None))
        art = mlcomp.compile(module, inputs, target="openvino", pipeline="-O2", threads=threads)
        out[name] = (art.runtime.compiled, ov_executed(art.runtime.compiled))
    target.whole_rnns = whole
    with torch.no_grad():
        own = ov.Core().compile_model(ov.convert_model(module, example_input=inputs), "CPU", cpu_config("f32", threads))
    out["ov module"] = (own, ov_executed(own))
    arrays = [x.numpy() for x in inputs]
    return {k: (compiled.create_infer_request(), counts, arrays) for k, (compiled, counts) in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="gru-tagger@2,gru-tagger-2l@2")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print("| row | build | median ms | kernels | RNNSeq |\n|---|---|--:|--:|--:|")
    for row in args.rows.split(","):
        builds = _builds(row, args.threads)
        samples: dict[str, list[float]] = {k: [] for k in builds}
        for _ in range(args.rounds):
            for name, (request, _, arrays) in builds.items():
                start = time.perf_counter()
                request.infer(arrays)
                samples[name].append(time.perf_counter() - start)
        for name, (_, counts, _) in builds.items():
            rnn = sum(n for k, n in counts.items() if k.startswith("RNNSeq"))
            print(f"| {row} | {name} | {statistics.median(samples[name]) * 1e3:.3f} | {sum(counts.values())} | {rnn} |")


if __name__ == "__main__":
    main()
