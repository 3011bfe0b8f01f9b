"""Packed vs split q/k/v projections (``split-projections``), per target and precision, timed interleaved.

For each model and batch, every target is built twice from the same pipeline, once with the packed
in-projection left as it is and once split into one linear per part (decision 43):

* ``<target>:fp32 packed|split``: ``-O2`` as it adapts to the target, without / with ``split-projections``
  after its first cleanup;
* ``<target>:int8 packed|split`` (onnxruntime, openvino): ``fold-batchnorm,fold-constants,cleanup`` then
  ``quantize{split_projections=false}`` / ``split-projections,cleanup,quantize``;
* ``eager`` (the reference) and, with ``--anchors ov:nncf``, NNCF on OpenVINO.

All variants of a row are sampled in one interleaved comparison (``mlcomp.measure.rounds.compare``), so the
packed/split ratio of a target comes from the same rounds.  Example (a few minutes)::

    python benchmarks/projections.py --models transformer --batches 32 --targets openvino,onnxruntime,cpu \\
        --budget 0.5
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mlcomp  # noqa: E402
from mlcomp.hardware.noise import LoadWatch  # noqa: E402
from mlcomp.measure.rounds import compare  # noqa: E402
from mlcomp.measure.samplers import local_samplers  # noqa: E402
from mlcomp.pipeline.presets import adapt_preset  # noqa: E402
from mlcomp.targets.registry import get_target  # noqa: E402
from quantization import _first, build, ov_nncf  # noqa: E402

INT8_BASE = "fold-batchnorm,fold-constants,cleanup"
SPLIT = "split-projections"


def pipelines(target: str) -> dict[str, str]:
    """Variant name → pipeline for ``target``: fp32 (and int8 where the target has int8 kernels), packed and split."""
    items = [i for i in adapt_preset("-O2", target, get_target(target).rewrites).text.split(",") if i != SPLIT]
    out = {f"{target}:fp32 packed": ",".join(items), f"{target}:fp32 split": ",".join([items[0], SPLIT, *items[1:]])}
    if target in ("openvino", "onnxruntime"):
        out[f"{target}:int8 packed"] = f"{INT8_BASE},quantize{{split_projections=false}}"
        out[f"{target}:int8 split"] = f"{INT8_BASE},{SPLIT},cleanup,quantize"
    return out


def row(name: str, batch: int, targets: list[str], anchors: list[str], budget: float, threads: int) -> None:
    module, inputs = build(name, batch)
    with torch.no_grad(), tempfile.TemporaryDirectory() as work:
        ref = _first(module(*inputs))
        fns = {"eager": lambda: module(*inputs)}
        for target in targets:
            for key, pipeline in pipelines(target).items():
                art = mlcomp.compile(module, inputs, target=target, pipeline=pipeline, threads=threads)
                fns[key] = (lambda a: (lambda: a(*inputs)))(art)
        if "ov:nncf" in anchors:
            fns["ov:nncf"] = ov_nncf(name, module, inputs, work, threads)[0]
        c = compare(local_samplers(fns, warmup=2, budget_s=budget).fns, "eager", budget_s=budget, min_rounds=5,
                    watch=LoadWatch())
        print(f"\n{name} batch {batch} ({c.rounds} rounds, stopped: {c.stopped})")
        print(f"  {'variant':26} {'median ms':>10} {'vs eager':>9} {'split/packed':>13} {'top-1':>6} {'max rel':>8}")
        for key, fn in fns.items():
            out = _first(fn()).reshape(ref.shape)
            agree = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
            err = float((out - ref).abs().max() / ref.abs().max())
            ms = c.timings[key].median * 1e3
            packed = key.replace(" split", " packed")
            ratio = f"{c.timings[packed].median / c.timings[key].median:12.3f}x" if key.endswith(" split") else ""
            shaky = " UNRELIABLE: " + "; ".join(c.reasons[key]) if c.reasons.get(key) else ""
            print(f"  {key:26} {ms:10.2f} {c.timings['eager'].median * 1e3 / ms:8.2f}x {ratio:>13} {agree:6.3f} "
                  f"{err:8.4f}{shaky}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="transformer")
    ap.add_argument("--batches", default="32")
    ap.add_argument("--targets", default="openvino,onnxruntime,cpu")
    ap.add_argument("--anchors", default="", help="ov:nncf to time NNCF's int8 beside")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timing per variant")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every variant")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    split = (lambda s: [x for x in s.split(",") if x])  # noqa: E731
    for name in split(args.models):
        for batch in (int(b) for b in split(args.batches)):
            row(name, batch, split(args.targets), split(args.anchors), args.budget, args.threads)


if __name__ == "__main__":
    main()
