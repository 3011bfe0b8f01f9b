"""``torch.compile(backend="mlcomp")`` against ``torch.compile()`` (inductor) and eager, on this CPU.

    .venv/bin/python benchmarks/torch_compile.py                          # zoo + a small BERT, batches 1 and 32
    .venv/bin/python benchmarks/torch_compile.py --models mlp,bert --batches 1 --budget 0.5

Each model runs in a fresh Python process (Dynamo's caches and torch's thread pools start
empty).  Per model and batch, under ``torch.no_grad()``:

* compile s: wall time of the first call of each compiled model (Dynamo tracing and the
  backend's compile, verification against eager included for mlcomp); ``mlcomp.compile`` s
  is the same model through ``mlcomp.compile`` with the same pipeline and target (and, unless
  ``--dynamic auto``, ``dynamic=`` the swept size, so it too builds for the whole range), timed after
  the backend's compile (so it finds mlcomp's modules imported and the model's kernels warm); the
  ``first compile`` column times each of the two alone in a fresh process that has imported mlcomp
  and run the model once in eager: the fair comparison of a first compile;
* steady-state latency (``--threads``, default 1, for every variant): medians of samples interleaved round by round over eager, inductor
  and mlcomp (``mlcomp.hardware.timing.measure_interleaved``);
* recompiles: graphs compiled over a sweep of 20 batch sizes (1..20) or, for the BERT
  model, 20 sequence lengths (8..160) after the first call (``counters["stats"]["unique_graphs"]``).
  The first call's swept size is made symbolic the same way for inductor and mlcomp (``--dynamic``):
  ``mark`` (default) marks it with ``torch._dynamo.mark_dynamic`` (batch 1 still gets its own graph,
  and a convolution's batch gets a guard at 16, where torch's choice of convolution kernel changes);
  ``unbacked`` with ``torch._dynamo.decorators.mark_unbacked`` (no specialisation at all, but Dynamo
  breaks the zoo transformer's and BERT's graphs on it, and inductor fails on a convolution at batch 1);
  ``auto`` leaves it to Dynamo's automatic dynamic shapes;
* mlcomp's target: ``--target`` names one; by default the backend picks per graph (``ran on``);
* max error: the largest absolute difference from eager over the first call and the sweep.

``--generate N`` instead times greedy generation of N tokens after an 8-token prompt for the
decoders (``--models llama,gpt2,qwen2``, tiny random-weight configs) with
:func:`mlcomp.measure.generation_bench.bench_generation`: eager over the same static cache,
eager as ``model.generate`` runs it (``eager-dynamic``: transformers' DynamicCache),
``torch.compile()`` (inductor) of the static-cache steps and mlcomp's generators for each of
``--gen-targets``: decode tokens/s and time to first token, every variant's tokens compared with
eager's (one process per model)::

    .venv/bin/python benchmarks/torch_compile.py --generate 32 --budget 1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from torch._dynamo.utils import counters
from mlcomp.hardware.timing import TimingPolicy, measure_interleaved
from mlcomp.dynamo import backend as mb
from mlcomp.dynamo.report import size_ranges
import mlcomp
name, batch, budget, pipeline, target = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
threads, dynamic = int(sys.argv[6]), sys.argv[8]
torch.set_num_threads(threads)
torch.manual_seed(0)
if name == "bert":
    from transformers import BertConfig, BertModel
    cfg = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                     vocab_size=1000, max_position_embeddings=256)
    base = BertModel(cfg).eval()
    class Bert(torch.nn.Module):
        def __init__(self):
            super().__init__(); self.bert = base
        def forward(self, ids):
            return self.bert(input_ids=ids).last_hidden_state
    model = Bert().eval()
    make = lambda b, s=32: (torch.randint(0, 1000, (b, s)),)
    sweep = [make(batch, s) for s in range(8, 168, 8)]
    swept, spec = 1, "seq=1..256"                  # the sweep varies the sequence length (256 positions)
else:
    from mlcomp import models
    zoo = models.get(name); model = zoo.build().eval()
    make = lambda b: tuple(zoo.example_inputs(b))
    sweep = [make(b) for b in range(1, 21)]
    swept, spec = 0, "batch"                       # the sweep varies the batch
x = make(batch)
mb.register()
options = {"pipeline": pipeline, "threads": threads, **({"target": target} if target else {})}
# mlcomp.compile builds what the backend builds: an artifact for the swept size's whole range when it is marked
direct = {"pipeline": pipeline, "threads": threads, **({"dynamic": spec} if dynamic != "auto" else {})}


def first_call(fn):
    # the first call of a compiled model, its swept size marked as a user would (--dynamic)
    arg = x[0].clone()
    if dynamic == "unbacked":
        torch._dynamo.decorators.mark_unbacked(arg, swept, hint_override=arg.shape[swept])
    elif dynamic == "mark":
        torch._dynamo.mark_dynamic(arg, swept)
    return fn(arg, *x[1:])
mode = sys.argv[7]
if mode != "all":    # one first compile, in a process that has only imported and run the model in eager
    with torch.no_grad():
        model(*x)
        t0 = time.perf_counter()
        if mode == "backend":
            first_call(torch.compile(model, backend="mlcomp", options=options))
        else:
            mlcomp.compile(model, x, target=target, **direct)
    print("RESULT " + json.dumps({"first_" + mode: time.perf_counter() - t0}))
    sys.exit(0)
out = {"model": name, "batch": batch}
with torch.no_grad():
    expected = model(*x)
    fns = {"eager": model}
    report = mb.BackendReport()
    for label, fn in (("inductor", lambda: torch.compile(model)),
                      ("mlcomp", lambda: torch.compile(model, backend="mlcomp", options={**options, "report": report}))):
        torch._dynamo.reset(); counters.clear()
        compiled = fn()
        t0 = time.perf_counter(); y = first_call(compiled); out[label + "_compile"] = time.perf_counter() - t0
        err = (y - expected).abs().max().item()
        before = counters["stats"]["unique_graphs"]
        for args in sweep:
            err = max(err, (compiled(*args) - model(*args)).abs().max().item())
        out[label + "_recompiles"] = counters["stats"]["unique_graphs"] - before
        out[label + "_err"] = err
        fns[label] = compiled
    out["mlcomp_targets"] = sorted({p.ran_on for p in report.partitions})
    out["mlcomp_sizes"] = sorted({s for p in report.partitions for s in size_ranges(p.sizes)})
    print(report.table(), file=sys.stderr)
    torch._dynamo.reset()    # after the backend's compile, so both find the same modules imported
    target = target or out["mlcomp_targets"][0].split(":")[-1]     # the target the backend picked
    t0 = time.perf_counter(); mlcomp.compile(model, x, target=target, **direct)
    out["mlcomp.compile"] = time.perf_counter() - t0
    for k, f in list(fns.items()):
        fns[k] = (lambda f: lambda: f(*x))(f)
    times = measure_interleaved(fns, TimingPolicy(warmup=3, budget_s=budget, min_repeats=5))
    for k, t in times.items():
        out[k + "_ms"] = t.median * 1e3
print("RESULT " + json.dumps(out))
"""


GEN_CHILD = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
from mlcomp.hardware.timing import TimingPolicy
from mlcomp.measure.generation_bench import bench_generation
name, tokens, budget, pipeline, targets, threads = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], \
    tuple(sys.argv[5].split(",")), int(sys.argv[6])
torch.set_num_threads(threads)
res = bench_generation(name, tokens, targets=("eager", "eager-dynamic", "inductor", *targets), pipeline=pipeline,
                       threads=threads,
                       policy=TimingPolicy(warmup=2, budget_s=budget, min_repeats=5))
print("RESULT " + json.dumps(res.to_json()))
"""


def child(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=3600, env=dict(os.environ, PYTHONPATH=str(REPO)))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{' '.join(args[:2])} failed:\n{proc.stderr[-3000:]}")


def generation_table(models: list[str], tokens: int, budget: float, pipeline: str, targets: str, threads: int
                     ) -> None:
    """One row per decoder: tokens/s and time to first token of eager, inductor and each mlcomp target."""
    variants = ["eager", "eager-dynamic", "inductor", *targets.split(",")]
    columns = ["model", *(f"{v} tok/s" for v in variants), *(f"{v} TTFT ms" for v in variants),
               *(f"{v} build s" for v in variants[2:]), "tokens = eager"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for model in models:
        res = child(GEN_CHILD, model, str(tokens), str(budget), pipeline, targets, str(threads))
        rows = {r["variant"]: r for r in res["rows"]}

        def cell(v: str, key: str, fmt: str) -> str:
            value = rows.get(v, {}).get(key)
            return rows.get(v, {}).get("note") or "-" if value is None else format(value, fmt)
        equal = all(r["tokens_equal"] for r in res["rows"] if r["tokens_equal"] is not None)
        print("| " + " | ".join([model, *(cell(v, "tokens_per_s", ".1f") for v in variants),
                                 *(cell(v, "ttft_ms", ".2f") for v in variants),
                                 *(cell(v, "compile_s", ".1f") for v in variants[2:]),
                                 "yes" if equal else "NO"]) + " |", flush=True)


def run(model: str, batch: int, budget: float, pipeline: str, target: str, threads: int, dynamic: str) -> dict:
    """The timed row, then each first compile (backend, ``mlcomp.compile``) in a fresh process of its own.

    With no ``target`` the backend picks one per graph; ``mlcomp.compile`` compiles for the one it picked.
    """
    args = (model, str(batch), str(budget), pipeline, target, str(threads))
    out = child(CHILD, *args, "all", dynamic)
    out.update(child(CHILD, *args, "backend", dynamic))
    picked = target or out["mlcomp_targets"][0].split(":")[-1]
    out.update(child(CHILD, *args[:4], picked, args[5], "compile", dynamic))
    return out


def host() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical cores"


COLUMNS = ("model", "batch", "eager ms", "inductor ms", "mlcomp ms", "inductor compile s", "mlcomp compile s",
           "mlcomp.compile s", "first compile s, own process (backend / mlcomp.compile)", "recompiles (ind/mlc)",
           "max err (ind/mlc)", "mlcomp ran on", "sizes")


def row(r: dict) -> list[str]:
    return [r["model"], str(r["batch"]), f"{r['eager_ms']:.3f}", f"{r['inductor_ms']:.3f}", f"{r['mlcomp_ms']:.3f}",
            f"{r['inductor_compile']:.1f}", f"{r['mlcomp_compile']:.1f}", f"{r['mlcomp.compile']:.1f}",
            f"{r['first_backend']:.2f} / {r['first_compile']:.2f} ({r['first_backend'] / r['first_compile']:.2f}x)",
            f"{r['inductor_recompiles']}/{r['mlcomp_recompiles']}",
            f"{r['inductor_err']:.1e}/{r['mlcomp_err']:.1e}", ", ".join(r["mlcomp_targets"]),
            ", ".join(r["mlcomp_sizes"]) or "static"]


DEFAULT_MODELS = "mlp,lenet,resnet18,transformer,bert"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per variant")
    parser.add_argument("--pipeline", default="-O2")
    parser.add_argument("--target", default="", help="mlcomp's target (default: the backend's own choice)")
    parser.add_argument("--dynamic", choices=("mark", "unbacked", "auto"), default="mark",
                        help="how the first call's swept size is made symbolic, for inductor and mlcomp alike: "
                             "torch._dynamo.decorators.mark_unbacked, torch._dynamo.mark_dynamic, or nothing "
                             "(Dynamo's automatic dynamic shapes)")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads, every variant")
    parser.add_argument("--generate", type=int, default=None, metavar="N",
                        help="time greedy generation of N tokens instead (decoders: --models llama,gpt2,qwen2)")
    parser.add_argument("--gen-targets", default="cpu,onnxruntime,openvino", help="with --generate: mlcomp targets")
    args = parser.parse_args()
    if args.generate:
        models = args.models.split(",") if args.models != DEFAULT_MODELS else ["llama", "gpt2", "qwen2"]
        print(f"host: {host()}; greedy generation of {args.generate} tokens after an 8-token prompt; pipeline "
              f"{args.pipeline}, {args.threads} thread(s)\n")
        generation_table(models, args.generate, args.budget, args.pipeline, args.gen_targets, args.threads)
        return
    print(f"host: {host()}; pipeline {args.pipeline}, target {args.target or 'the backend default'}, "
          f"{args.threads} thread(s), sizes made dynamic by: {args.dynamic}\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            print("| " + " | ".join(row(run(model, batch, args.budget, args.pipeline, args.target, args.threads,
                                             args.dynamic))) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
