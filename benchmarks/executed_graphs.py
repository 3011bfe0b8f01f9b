"""What OpenVINO and ONNX Runtime execute for mlcomp's artifact vs their own conversion, model by model.

    .venv/bin/python benchmarks/executed_graphs.py                                  # every row, f32
    .venv/bin/python benchmarks/executed_graphs.py --models bert,vit --runtimes openvino --hint bf16
    .venv/bin/python benchmarks/executed_graphs.py --pipeline cleanup --json graphs.json   # before the recompositions

No clock: the counts come from ``mlcomp.measure.executed`` (OpenVINO's runtime model, ORT's
optimised model), so they are the same on a busy machine.  Rows: the zoo (resnet18, transformer,
gru, mobilenet), ``transformers`` BERT, ViT, GPT-2 (tiny configs), and the held-out models
(2-layer GRU tagger, MLP-Mixer, small UNet).  A row that fails to build prints its error.
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

ROWS = ("resnet18@1", "transformer@1", "gru@1", "mobilenet@1", "bert@2", "vit@2", "gpt2@2", "gru-tagger@2",
        "gru-tagger-2l@2", "mlp-mixer@2", "unet@1")


def build(row: str):
    from mlcomp import models
    from mlcomp.models.held_out import HELD_OUT, build_held_out
    from mlcomp.models.third_party import THIRD_PARTY, build_third_party

    name, batch = row.split("@")
    if name in THIRD_PARTY:
        return build_third_party(name, int(batch))
    if name in HELD_OUT:
        return build_held_out(name, int(batch))
    zoo = models.get(name)
    return zoo.build().eval(), zoo.example_inputs(int(batch))


def main(argv: list[str] | None = None) -> int:
    from mlcomp.measure.executed import compare, format_diffs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ROWS), help="comma-separated NAME@BATCH rows")
    parser.add_argument("--runtimes", default="openvino,onnxruntime")
    parser.add_argument("--pipeline", default="-O2", help="mlcomp's pipeline")
    parser.add_argument("--hint", default="f32", help="OpenVINO INFERENCE_PRECISION_HINT for both sides")
    parser.add_argument("--json", default=None, help="write the counts here")
    args = parser.parse_args(argv)
    diffs, errors = [], []
    for row in [r if "@" in r else f"{r}@2" for r in args.models.split(",") if r]:
        module, inputs = build(row)
        for runtime in [r for r in args.runtimes.split(",") if r]:
            try:
                diffs.append(compare(row, module, inputs, runtime, pipeline=args.pipeline, hint=args.hint))
            except Exception as exc:  # noqa: BLE001 - a row says what failed and the others go on
                errors.append(f"{row} {runtime}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            print(f"done {row} {runtime}", file=sys.stderr, flush=True)
    print(format_diffs(diffs))
    for line in errors:
        print(f"- failed: {line}")
    if args.json:
        Path(args.json).write_text(json.dumps([d.to_json() for d in diffs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
