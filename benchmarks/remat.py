"""Training memory: the peak a user measures, mlcomp's remat/schedule/fused optimizer against torch's tools.

    .venv/bin/python benchmarks/remat.py             # resnet18, transformer, bert at batch 32
    .venv/bin/python benchmarks/remat.py --models resnet18 --repeats 3 --json out.json
    .venv/bin/python benchmarks/remat.py --models resnet18 --rss-policy return   # every RSS with freed memory returned

Per model (batch 32, dropout off, SGD with momentum) every setting's training step is built once,
then measured in the same process:

* ``none`` -- mlcomp's joint graph, the optimizer after the graph (the reference);
* ``fused`` -- the same step with the optimizer in the backward (``update_in_backward``);
* ``remat@B`` -- ``remat{budget=B fused=true optimizer="..."},schedule{fused=true}``, compiled fused: the
  cheapest plan whose predicted step peak is within ``lowest + B × (peak without remat − lowest)`` (0: the
  lowest the pool reaches; a tighter budget never a higher peak);
* ``mincut saved@0.25`` -- ``remat{saved=0.25 solver=mincut}``, unfused: at most a quarter of the saved
  activations kept;
* ``torch ckpt`` -- eager autograd with ``torch.utils.checkpoint`` around every block (each module of a
  ModuleList/Sequential of two or more repeated blocks), the same optimizer after ``backward``;
* ``torch@B`` -- ``aot_module`` with ``min_cut_rematerialization_partition`` under
  ``activation_memory_budget = B`` (fx modules, no inductor).

Columns: predicted peak of the whole step (:func:`mlcomp.analysis.step_peak.step_memory` with kernels'
scratch and the optimizer's), allocator peak of one step above the state before it
(:func:`mlcomp.measure.training_bench.step_peak`), the RSS high-water mark's growth over one step in a fresh
process that captured and built only that setting under its host allocator policy (``--rss-policy``;
``auto``: what ``compile_training`` applies -- ``return`` for the remat and fused settings, glibc's own
``keep`` for ``none`` and torch's anchors; :mod:`mlcomp.hardware.allocator`), median step time of
interleaved repeats and its overhead against ``none``, the FLOPs mlcomp's remat recomputes (its stats;
``torch.utils.checkpoint`` per block recomputes each block's forward), and the worst parameter's gradient
error against ``none`` on the same batch.
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time
from typing import Any

import torch
import torch._functorch.config as functorch_config
from functorch.compile import aot_module, make_boxed_func
from torch import nn
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import checkpoint

from mlcomp.analysis.step_peak import step_memory
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.base.table import Table
from mlcomp.base.units import fmt_bytes
from mlcomp.frontend.joint import loss_function, model_output
from mlcomp.hardware import allocator
from mlcomp.hardware.peak_memory import MemorySource
from mlcomp.hardware.timing import TimingPolicy, fmt_seconds, measure_interleaved
from mlcomp.measure.remat_sweep import grad_error
from mlcomp.measure.training_bench import TrainingCase, step_peak, training_case
from mlcomp.pipeline.manager import run_pipeline
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.training.host_memory import asks_for_memory
from mlcomp.training.step import compile_training

OPTIMIZER = "sgd{lr=0.01 momentum=0.9}"
SETTINGS = (("fused", "", True),
            *((f"remat@{b}", f'remat{{budget={b} fused=true optimizer="{OPTIMIZER}"}},schedule{{fused=true}}', True)
              for b in ("0.25", "0.1", "0")),
            ("mincut saved@0.25", f'remat{{saved=0.25 solver=mincut optimizer="{OPTIMIZER}"}}', False))
TORCH_BUDGETS = ("0.25",)


class Logits(nn.Module):
    """A ``transformers`` classifier's logits (its output is a ModelOutput)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def make_case(name: str, batch: int) -> TrainingCase:
    if name != "bert":
        return training_case(name, batch=batch)
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.BertConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512,
                        vocab_size=4000, num_labels=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 4000, (batch, 128), generator=torch.Generator().manual_seed(1))
    return training_case(Logits(tf.BertForSequenceClassification(cfg)).train(), inputs=(ids,), name="bert")


# ---------------------------------------------------------------------------
# torch: checkpoint per block, the min-cut partitioner


class Checkpointed(nn.Module):
    """``torch.utils.checkpoint`` around one block; other attributes read through to the block."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap every block of a ModuleList/Sequential holding two or more blocks of one class; the count."""
    wrapped = 0
    for parent in list(model.modules()):
        kids = list(parent.named_children())
        if not isinstance(parent, (nn.ModuleList, nn.Sequential)) or len(kids) < 2:
            continue
        kinds = {type(m) for _, m in kids}
        if len(kinds) == 1 and any(True for _ in kids[0][1].children()):
            for name, child in kids:
                setattr(parent, name, Checkpointed(child))
                wrapped += 1
    return wrapped


def _eager_step(module: nn.Module, args: tuple[torch.Tensor, ...], spec: OptimizerSpec) -> tuple[Any, dict]:
    params = dict(module.named_parameters())
    module(*args).backward()
    grads = {k.split("model.", 1)[1].replace("inner.", ""): p.grad.detach().clone() for k, p in params.items()
             if p.grad is not None}
    for p in params.values():
        p.grad = None
    opt = spec.build(params.values())

    def step() -> None:
        module(*args).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)      # like the mlcomp step: gradients die inside the measured step
    return step, grads


class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss: Any) -> None:
        super().__init__()
        self.model = model
        self.loss = loss_function(loss)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.loss is None:
            return model_output(self.model(*args))
        return self.loss(model_output(self.model(*args[:-1])), args[-1])


def _boxed(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
    return make_boxed_func(gm.forward)


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node`` uses (through view ops)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def torch_partitioned(case: TrainingCase, budget: float) -> tuple[nn.Module, dict[str, Any]]:
    """``(module, saved)``: the model under aot_module + min-cut partitioner at ``budget``, compiled by one
    call inside the config patch; ``saved`` counts the forward's extra outputs: all of them, and those that
    are neither inputs (parameters, the batch) nor views of inputs."""
    saved: dict[str, Any] = {}

    def partition(joint: torch.fx.GraphModule, inputs: Any, **kw: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="aten", **kw)
        extra = list(fw.graph.find_nodes(op="output")[0].args[0])[kw["num_fwd_outputs"]:]
        tensors = [(n, n.meta.get("val")) for n in extra]
        tensors = [(n, v) for n, v in tensors if isinstance(v, torch.Tensor)]
        size = lambda v: v.numel() * v.element_size()
        acts = [v for n, v in tensors if _base(n).op != "placeholder"]   # a view of a weight holds nothing new
        saved.update(tensors=len(acts), bytes=sum(size(v) for v in acts), all_tensors=len(tensors),
                     all_bytes=sum(size(v) for _, v in tensors))
        return fw, bw

    model = copy.deepcopy(case.model)
    for m in model.modules():
        # aot_module saves BatchNorm's running-stat buffers for the backward and then updates them in
        # place, which autograd refuses (version counter): torch's side normalises by batch statistics
        # without tracking running ones (the same gradients; it skips the tiny running-stat update)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    module = _WithLoss(model, case.loss).train()
    with functorch_config.patch(activation_memory_budget=budget):
        compiled = aot_module(module, fw_compiler=_boxed, bw_compiler=_boxed, partition_fn=partition)
        compiled(*case.args("cpu")).backward()          # traces and partitions now, under the budget
    for p in module.parameters():
        p.grad = None
    return compiled, saved



# ---------------------------------------------------------------------------
# one model


def mlcomp_setting(case: TrainingCase, spec: OptimizerSpec, label: str, text: str, fused: bool,
                   scratch: dict | None = None, host_memory: str = "keep") -> tuple[dict, Any, Any]:
    """(row, step, artifact) of one mlcomp setting; ``scratch``: measure the kernels' scratch (the predicted
    peak) with this cache, ``None``: no prediction; ``host_memory``: the allocator policy compile_training
    applies (the timing process keeps glibc's own, so that every setting is timed under one allocator)."""
    keys, args = list(case.model.state_dict()), case.args("cpu")
    t0 = time.perf_counter()
    graph, stats = case.graph, {}
    if text:
        graph, report = run_pipeline(case.graph, text, example_inputs=args)
        stats = next((r.stats for r in report.records if r.name == "remat"), {})
    art = compile_training(graph, optimizer=spec, state_keys=keys, update_in_backward=fused, host_memory=host_memory)
    row = {"variant": label, "spec": text + (" + update_in_backward" if fused else ""),
           "recompute_flops": stats.get("recompute_flops", 0), "host_memory": art.host_memory["policy"]}
    if scratch is not None:
        mem = step_memory(graph, workspace=op_workspaces(graph, cache=scratch), scratch=spec.scratch(), fused=fused)
        row.update(predicted=mem.peak_bytes, at=mem.at, by_kind=mem.by_kind())
    row["pass_s"] = time.perf_counter() - t0
    return row, (lambda: art.step(*args)), art


def mlcomp_settings(case: TrainingCase, spec: OptimizerSpec, log: Any) -> tuple[dict, dict, dict]:
    """(rows, steps, grads) of ``none`` and every mlcomp setting."""
    args, scratch = case.args("cpu"), {}
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Any] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for label, text, fused in (("none", "", False), *SETTINGS):
        rows[label], steps[label], art = mlcomp_setting(case, spec, label, text, fused, scratch)
        grads[label] = {k: v.detach().clone() for k, v in art.gradients(*args)[1].items()}
        log(f"  {label}: predicted {fmt_bytes(rows[label]['predicted'])} at {rows[label]['at']} "
            f"({rows[label]['pass_s']:.1f} s)")
    return rows, steps, grads


def torch_setting(case: TrainingCase, spec: OptimizerSpec, label: str) -> tuple[dict, Any, dict]:
    """(row, step, grads) of ``torch ckpt`` (checkpoint per block) or ``torch@B`` (the min-cut partitioner)."""
    args = case.args("cpu")
    if label == "torch ckpt":
        model = copy.deepcopy(case.model)
        blocks = checkpoint_blocks(model)
        step, grads = _eager_step(_WithLoss(model, case.loss).train(), args, spec)
        return {"variant": label, "spec": f"torch.utils.checkpoint on {blocks} blocks"}, step, grads
    budget = label.split("@", 1)[1]
    module, _ = torch_partitioned(case, float(budget))
    step, grads = _eager_step(module, args, spec)
    return {"variant": label, "spec": f"min_cut_rematerialization_partition, budget {budget}"}, step, grads


def torch_settings(case: TrainingCase, spec: OptimizerSpec, log: Any) -> tuple[dict, dict, dict]:
    """(rows, steps, grads) of checkpoint-per-block and the min-cut partitioner at each budget."""
    rows, steps, grads = {}, {}, {}
    for label in ("torch ckpt", *(f"torch@{b}" for b in TORCH_BUDGETS)):
        rows[label], steps[label], grads[label] = torch_setting(case, spec, label)
    log(f"  torch anchors built ({rows['torch ckpt']['spec']})")
    return rows, steps, grads


def setting_policy(label: str, choice: str) -> str:
    """The host allocator policy a setting runs under (``auto``: what ``compile_training`` applies)."""
    text, fused = next(((t, f) for lab, t, f in (("none", "", False), *SETTINGS) if lab == label), ("", False))
    return allocator.resolve(choice, wants_memory=asks_for_memory(text, fused=fused))


def rss_child(model: str, label: str, batch: int, choice: str) -> dict[str, Any]:
    """In this (fresh) process: the policy, then capture and build ``label`` alone, one step's RSS growth."""
    state = allocator.apply(setting_policy(label, choice), where="before capture")
    case, spec = make_case(model, batch), OptimizerSpec.parse(OPTIMIZER)
    known = {lab: (t, f) for lab, t, f in (("none", "", False), *SETTINGS)}
    if label in known:
        _, step, _ = mlcomp_setting(case, spec, label, *known[label], host_memory=state["policy"])
    else:
        _, step, _ = torch_setting(case, spec, label)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    rss = step_peak(step, "cpu", MemorySource.RSS).growth          # two steps: a warm one, the measured one
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) // 2
    return {"rss": rss, "host_memory": state["policy"], "faults_per_step": faults}


def fresh_rss(model: str, label: str, batch: int, choice: str, threads: int | None) -> dict[str, Any]:
    """:func:`rss_child` in a new interpreter (its heap holds nothing another setting freed)."""
    cmd = [sys.executable, __file__, "--child", f"{model}:{label}", "--batch", str(batch), "--rss-policy", choice]
    cmd += ["--threads", str(threads)] if threads else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_model(model: str, opts: argparse.Namespace, policy: TimingPolicy, log: Any) -> list[dict[str, Any]]:
    case = make_case(model, opts.batch)
    spec = OptimizerSpec.parse(OPTIMIZER)
    rows, steps, grads = mlcomp_settings(case, spec, log)
    more = torch_settings(case, spec, log)
    for have, add in zip((rows, steps, grads), more):
        have.update(add)
    ref = grads["none"]
    for label, step in steps.items():
        rows[label]["grad_rel"], _ = grad_error({k: grads[label][k] for k in ref}, ref)
        rows[label]["allocator"] = step_peak(step, "cpu").growth
        rows[label].update(fresh_rss(model, label, opts.batch, opts.rss_policy, opts.threads))
        log(f"  {label}: allocator {fmt_bytes(rows[label]['allocator'])}, RSS {fmt_bytes(rows[label]['rss'])} "
            f"in a fresh process ({rows[label]['host_memory']})")
    log(f"  timing {len(steps)} settings interleaved")
    for label, t in measure_interleaved(steps, policy).items():
        rows[label]["step"], rows[label]["step_samples"] = t.median, list(t.samples)
    return list(rows.values())


def table(model: str, batch: int, rows: list[dict[str, Any]]) -> Table:
    ref = next(r for r in rows if r["variant"] == "none")
    columns = ("setting", "predicted", "allocator", "pred/alloc", "RSS", "host memory", "faults/step", "vs none",
               "step", "overhead", "recomputed FLOPs", "grad err")
    cells = tuple((r["variant"], fmt_bytes(r["predicted"]) if r.get("predicted") else "—", fmt_bytes(r["allocator"]),
                   f"{r['predicted'] / r['allocator']:.3f}" if r.get("predicted") and r["allocator"] else "—",
                   fmt_bytes(r["rss"]), r["host_memory"], f"{r['faults_per_step']:,}",
                   f"{100 * (r['allocator'] / ref['allocator'] - 1):+.0f}%",
                   fmt_seconds(r["step"]), f"{100 * (r['step'] / ref['step'] - 1):+.0f}%",
                   f"{r['recompute_flops']:.3g}" if "recompute_flops" in r else "—", f"{r['grad_rel']:.1e}")
                  for r in rows)
    return Table(f"{model}, batch {batch}, cpu, {OPTIMIZER}", columns, cells, right=frozenset(range(1, 12)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,transformer,bert")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (median reported)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rss-policy", choices=allocator.CHOICES, default="auto",
                    help="host allocator policy of the fresh process measuring each setting's RSS")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)      # MODEL:SETTING, one RSS measurement
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        model, label = args.child.split(":", 1)
        print(json.dumps(rss_child(model, label, args.batch, args.rss_policy)))
        return 0
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    policy = TimingPolicy(warmup=1, budget_s=1e-3, min_repeats=args.repeats, max_repeats=args.repeats)
    out: dict[str, Any] = {}
    for model in [m for m in args.models.split(",") if m]:
        log(f"{model}:")
        out[model] = bench_model(model, args, policy, log)
        if args.json:
            from mlcomp.base.files import write_text_atomic

            write_text_atomic(args.json, json.dumps(out, indent=2, default=str), fmt="json")
        print(table(model, args.batch, out[model]).format() + "\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
