"""Training memory under ``torch.compile(backend="mlcomp")``: a step's peak with and without ``remat``.

    .venv/bin/python benchmarks/torch_compile_remat.py                   # resnet18, transformer, bert at batch 32
    .venv/bin/python benchmarks/torch_compile_remat.py --models mlp --batch 64 --remat "remat{saved=0.6}"

Per model (dropout off, SGD with momentum, loss ``mean(out**2)``) and per pipeline (``-O2``, then
``-O2,<remat>`` for each ``--remat`` spec), a fresh Python process compiles the model with the
backend and measures one training step (zero_grad, forward, backward, optimizer step) after a
warm one, as ``benchmarks/remat.py`` does (:func:`mlcomp.measure.training_bench.step_peak`):

* allocator: the peak of torch's CPU allocator above the state before the step
  (``MemorySource.ALLOCATOR``: every tensor allocation and free);
* RSS: the resident set's high-water growth over the step, in another fresh process that
  built only that setting (glibc's allocator as it is: what a user sees);
* saved: what the joint graph's forward hands the backward (activations, parameters free)
  as the backend reports it (:class:`mlcomp.dynamo.report.JointRecord`), and the route each
  Dynamo graph took;
* grad err: the worst parameter's ``max|Δ| / max|ref|`` after the step against ``-O2`` (same batch).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

DEFAULT_REMAT = ("remat{budget=0}", "remat{saved=0.25}")

CHILD = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch
from mlcomp.hardware.peak_memory import MemorySource
from mlcomp.measure.training_bench import step_peak
from mlcomp.dynamo import backend as mb
sys.path.insert(0, sys.argv[5])
from torch_compile_remat import build
name, batch, pipeline, source = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
model, x = build(name, batch)
report = mb.BackendReport()
fast = torch.compile(model, backend="mlcomp", options={"report": report, "pipeline": pipeline, "target": "cpu"})
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
def step():
    opt.zero_grad(set_to_none=True)
    fast(x).pow(2).mean().backward()
    opt.step()
src = MemorySource.RSS if source == "rss" else MemorySource.ALLOCATOR
peak = step_peak(step, "cpu", src).growth          # a warm step, then the measured one
state = {k: v.detach().clone() for k, v in build(name, batch)[0].state_dict().items()}
model.load_state_dict(state)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
step()
joints = report.joints
print("RESULT", json.dumps({
    "peak": peak, "routes": sorted({p.ran_on for p in report.partitions}),
    "saved": sum(j.saved_bytes for j in joints), "saved_before": sum(j.saved_before_bytes for j in joints),
    "recomputed": sum(j.recomputed for j in joints)}))
torch.save({k: v for k, v in model.state_dict().items()}, sys.argv[6]) if len(sys.argv) > 6 else None
"""


def build(name: str, batch: int) -> tuple[Any, Any]:
    """The model in training mode (dropout off) and one batch, from seed 0."""
    import torch

    torch.manual_seed(0)
    if name != "bert":
        from mlcomp import models
        from mlcomp.frontend.losses import without_dropout

        z = models.get(name)
        return without_dropout(z.build()).train(), z.example_inputs(batch)[0]
    import transformers as tf

    cfg = tf.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                        vocab_size=1000, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = Logits(tf.BertForSequenceClassification(cfg).train())   # dropout 0 in the config
    return model, torch.randint(0, 1000, (batch, 128), generator=torch.Generator().manual_seed(1))


class Logits:
    """A ``transformers`` classifier's logits (built lazily so this module imports without torch)."""

    def __new__(cls, model: Any) -> Any:
        from torch import nn

        class _Logits(nn.Module):
            def __init__(self, inner: nn.Module) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, ids: Any) -> Any:
                return self.inner(ids).logits
        return _Logits(model)


def measure(name: str, batch: int, pipeline: str, source: str, state: str | None = None) -> dict[str, Any]:
    """One setting in a fresh process (``state``: a path where it saves the model's state after one step)."""
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-c", CHILD, name, str(batch), pipeline, source, here] + ([state] if state else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{name} {pipeline} ({source}) failed:\n{out.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def grad_error(reference: str, other: str) -> float:
    import torch

    a, b = torch.load(reference), torch.load(other)
    errs = [((b[k].double() - a[k].double()).abs().max() / a[k].double().abs().max().clamp_min(1e-12)).item()
            for k in a if a[k].is_floating_point()]
    return max(errs) if errs else 0.0


def mib(n: float) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet18,transformer,bert")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--remat", action="append", help=f"remat spec (repeatable; default {', '.join(DEFAULT_REMAT)})")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    rows = []
    print("| model | pipeline | route | saved (joint) | allocator peak | RSS growth | recomputed | grad err |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in opts.models.split(","):
            ref_state = f"{tmp}/{name}-ref.pt"
            for i, pipeline in enumerate(["-O2"] + [f"-O2,{r}" for r in (opts.remat or DEFAULT_REMAT)]):
                state = ref_state if i == 0 else f"{tmp}/{name}-{i}.pt"
                alloc = measure(name, opts.batch, pipeline, "allocator", state)
                rss = measure(name, opts.batch, pipeline, "rss")
                row = {"model": name, "batch": opts.batch, "pipeline": pipeline, **alloc, "rss": rss["peak"],
                       "grad_err": 0.0 if i == 0 else grad_error(ref_state, state)}
                rows.append(row)
                print(f"| {name} | `{pipeline}` | {', '.join(row['routes'])} | {mib(row['saved'])} "
                      f"(of {mib(row['saved_before'])}) | {mib(row['peak'])} | {mib(row['rss'])} | "
                      f"{row['recomputed']} | {row['grad_err']:.1e} |", flush=True)
    if opts.json:
        from mlcomp.base.files import write_text_atomic

        write_text_atomic(opts.json, json.dumps(rows, indent=1), fmt="json")


if __name__ == "__main__":
    main()
