"""The ``distributed`` target: pipeline stages run by ``torch.distributed.pipelining``.

The graph must carry stages (``partition{stages=N}`` writes ``ann.stage``).
:func:`mlcomp.ir.split.split_stages` cuts it; every stage becomes a torch module
generated from its IR (:func:`~mlcomp.runtime.codegen.to_fx`), traced with its
weights as ``nn.Parameter`` s and saved as TorchScript (``stage0.pt`` …, safe to
load).  Inside one process the artifact runs the stages one after another;
``mlcomp launch ARTIFACT --nproc N`` (a thin wrapper over ``torchrun``) runs one
rank per stage (or ``v`` stages per rank with the interleaved schedule), each
rank wrapping its modules in ``PipelineStage`` and driving a ``ScheduleGPipe``
/ ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``; gloo on CPU, NCCL on GPU::

    before: graph with {stage=0}/{stage=1}     after: out/mlp-pp/
                                                 manifest.json  (runtime "pipeline", stages, schedule)
                                                 stage0.pt  stage1.pt  reference.pt

    $ mlcomp launch out/mlp-pp --nproc 2 --check            # outputs vs the single-process run
    $ mlcomp launch out/mlp-pp --nproc 2 --train --check    # + gradients and updated weights
    $ mlcomp launch out/mlp-pp --nproc 2 --train --check --optimizer "adam{lr=1e-3}"
    $ torchrun --nnodes 2 --node-rank R --master-addr H --nproc-per-node 1 \\
          -m mlcomp.targets.distributed.launch out/mlp-pp

The graph's batch is one microbatch: a launched batch is ``M`` of them
(``--microbatches``, default one per stage), so traced shapes hold.
Training uses per-stage *forward* modules and lets the schedule run backward
through autograd (``PipelineStage`` owns the send/receive of activations and
their gradients); a joint forward+backward graph (``frontend/joint.py``) would
need the schedule's backward split by hand.  The loss (mean squared error
against a seeded target, on the last stage) is a mean per microbatch and the
schedule scales gradients by ``1/M``, so gradients equal the full-batch ones.
:func:`run_rank` is what each rank executes; it compares its outputs,
gradients and weights after one step of the optimizer (an
:class:`~mlcomp.runtime.optim.OptimizerSpec`, default ``sgd{lr=0.1}``) with a
single-process run of the same stage modules.  ``compile`` launches that check by default (2+ processes).
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from mlcomp.analysis.parallel.pipeline_schedule import Schedule
from mlcomp.base.errors import MlcompError, VerificationError
from mlcomp.base.files import write_text_atomic
from mlcomp.base.quiet import quiet_torch
from mlcomp.ir import Graph, Mode, Ref
from mlcomp.ir.split import Stage, split_stages
from mlcomp.runtime.artifact import Artifact, RuntimeKind
from mlcomp.runtime.manifest import read_manifest
from mlcomp.targets.base import CompileOptions, Target, example_inputs
from mlcomp.targets.capabilities import Capabilities, DeviceKind
from mlcomp.runtime.codegen import param_names, to_fx
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.targets.distributed.supervise import launch_plan

__all__ = ["DEFAULT_OPTIMIZER", "DistributedTarget", "PipelineRuntime", "run_rank", "torchrun_command", "launch_check"]


class NotDistributedError(MlcompError):
    """``launch`` was given an artifact of another target."""


def _trainable_module(stage: Stage) -> nn.Module:
    """The stage's generated module with its float constants as parameters (autograd can train them)."""
    gm = to_fx(stage.graph).eval()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):      # what is sent must be contiguous (gloo/NCCL send whole buffers)
        sent = tuple(gm.graph.call_method("contiguous", (v,)) for v in out.args[0])
    out.args = (sent,)
    gm.recompile()
    stats = _running_statistics(stage.graph)
    names = param_names(gm)
    for attr, buf in list(gm.named_buffers(recurse=False)):
        if buf.is_floating_point() and names.get(attr) not in stats:
            delattr(gm, attr)
            gm.register_parameter(attr, nn.Parameter(buf.detach().clone()))
    return gm


def _running_statistics(graph: Graph) -> set[str]:
    """Constants an op reads as running statistics (its schema calls the argument ``running_*``): buffers,
    not weights; autograd refuses to differentiate through them."""
    out: set[str] = set()
    for node in graph.call_nodes():
        schema = getattr(node.op.resolve(), "_schema", None) if node.op.namespace.value == "aten" else None
        if schema is None:
            continue
        for arg, value in zip(schema.arguments, node.inputs):
            if arg.name.startswith("running_") and isinstance(value, Ref):
                out.add(value.name)
    return out


class PipelineRuntime:
    """The stage modules (TorchScript); in one process they run one after another."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.PIPELINE

    def __init__(self, payloads: Sequence[bytes], info: dict[str, Any]) -> None:
        self.payloads = list(payloads)
        self.info = dict(info)
        self.modules = [torch.jit.load(io.BytesIO(p), map_location="cpu").eval() for p in self.payloads]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values: tuple[torch.Tensor, ...] = tuple(inputs)
        with torch.no_grad():
            for module in self.modules:
                values = tuple(module(*values))
        return values

    def save(self, directory: Path) -> dict[str, Any]:
        files = []
        for i, payload in enumerate(self.payloads):
            (directory / f"stage{i}.pt").write_bytes(payload)
            files.append(f"stage{i}.pt")
        return dict(self.info, files=files)

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "PipelineRuntime":
        return cls([(directory / f).read_bytes() for f in info["files"]], info)


class DistributedTarget(Target):
    name = "distributed"
    description = "pipeline stages on torch.distributed.pipelining (gloo on CPU, NCCL on GPU), run with torchrun"
    runs_composites_in_torch = True
    capabilities = Capabilities(devices=frozenset({DeviceKind.CPU, DeviceKind.CUDA}),
                                dynamic_shapes=False)

    def __init__(self, *, schedule: Schedule = Schedule.ONE_F_ONE_B, microbatches: int | None = None,
                 check_launch: bool = True) -> None:
        self.schedule = schedule
        self.microbatches = microbatches
        self.check_launch = check_launch

    def available(self) -> str | None:
        if not dist.is_available():
            return "this torch build has no torch.distributed"
        return None

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> PipelineRuntime:
        if graph.mode is Mode.TRAINING:
            raise MlcompError(f"target distributed compiles the forward graph of {graph.name}; training runs "
                              "through autograd at launch (`mlcomp launch ARTIFACT --train`)",
                              hint="capture without --training")
        if not any(n.ann.stage is not None for n in graph.call_nodes()):
            raise MlcompError(f"graph {graph.name} has no pipeline stages to distribute",
                              hint="run the partition pass first, e.g. --pipeline 'partition{stages=2}'")
        stages = split_stages(graph)
        payloads, values = [], tuple(inputs)
        with quiet_torch():
            for stage in stages:
                module = _trainable_module(stage)
                traced = torch.jit.trace(module, values, check_trace=False)
                buffer = io.BytesIO()
                torch.jit.save(traced, buffer)
                payloads.append(buffer.getvalue())
                with torch.no_grad():
                    values = tuple(module(*values))
        micro = self.microbatches or len(stages)      # the graph's batch is one microbatch
        info = {"stages": len(stages), "schedule": self.schedule.value, "microbatches": micro,
                "receives": [list(s.receives) for s in stages], "sends": [list(s.sends) for s in stages],
                "device": self.device(options)}
        return PipelineRuntime(payloads, info)

    def compile(self, graph: Graph, options: CompileOptions | None = None, *,
                inputs: Any = None) -> Artifact:
        art = super().compile(graph, options, inputs=inputs)
        if self.check_launch and art.runtime.info["stages"] > 1:
            with tempfile.TemporaryDirectory(prefix="mlcomp-pp-") as tmp:
                x = example_inputs(graph)
                with torch.no_grad():
                    art.set_reference(x, art.runtime(*x))
                folder = art.save(Path(tmp) / "artifact")
                result = launch_check(folder, nproc=art.runtime.info["stages"])
            art.manifest["distributed_verification"] = result
            if not result["passed"]:
                raise VerificationError(f"the {result['nproc']}-process pipeline of {graph.name} differs from the "
                                        f"single-process run: max error {result['max_error']:.3g}",
                                        hint="report it; compile with --target cpu meanwhile")
        return art


# ---------------------------------------------------------------------------
# Launching


def torchrun_command(directory: str | Path, nproc: int, *, extra: Sequence[str] = (), port: int | None = None
                     ) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N``
    ``-m mlcomp.targets.distributed.launch DIR …``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--standalone"] if port is None else ["--master-port", str(port)]
    return cmd + ["-m", "mlcomp.targets.distributed.launch", str(directory), *extra]


def launch_check(directory: str | Path, nproc: int, *, train: bool = False, schedule: str | None = None,
                 microbatches: int | None = None, repeat: int = 0, optimizer: OptimizerSpec | str | None = None,
                 timeout: float = 600.0) -> dict[str, Any]:
    """Run the artifact on ``nproc`` local processes with ``--check``; the JSON result of rank 0."""
    with tempfile.TemporaryDirectory(prefix="mlcomp-launch-") as tmp:
        out = Path(tmp) / "result.json"
        extra = ["--check", "--result", str(out)] + (["--train"] if train else [])
        extra += ["--optimizer", OptimizerSpec.parse(optimizer).text()] if optimizer is not None else []
        extra += ["--schedule", schedule] if schedule else []
        extra += ["--microbatches", str(microbatches)] if microbatches else []
        extra += ["--repeat", str(repeat)] if repeat else []
        proc = subprocess.run(torchrun_command(directory, nproc, extra=extra), capture_output=True, text=True,
                              timeout=timeout)
        if not out.exists():
            lines = (proc.stderr + proc.stdout).strip().splitlines()
            errors = [ln for ln in lines if "error: " in ln or ("[rank" in ln and "Error" in ln)]
            tail = "; ".join(dict.fromkeys(errors[:3])) if errors else "\n".join(lines[-6:])
            raise MlcompError(f"the {nproc}-process launch of {directory} failed (exit {proc.returncode}): {tail}",
                              hint="run `mlcomp launch` by hand to see the whole log")
        return json.loads(out.read_text())


def check_artifact(directory: Path) -> dict[str, Any]:
    """The manifest of a pipeline artifact; :class:`NotDistributedError` for any other."""
    manifest = read_manifest(directory)
    if manifest.get("runtime") != RuntimeKind.PIPELINE.value:
        raise NotDistributedError(
            f"the artifact at {directory} was compiled for target {manifest.get('target')}, which runs in one "
            "process; launch runs pipeline artifacts only",
            hint="compile with --target distributed and a partition pass, e.g. `mlcomp compile MODEL --target "
                 "distributed --pipeline 'partition{stages=2}' -o DIR`, or run this one with `mlcomp run`")
    return manifest


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    first = out[0] if isinstance(out, (tuple, list)) else out
    return torch.nn.functional.mse_loss(first, target)


DEFAULT_OPTIMIZER = "sgd{lr=0.1}"


def run_rank(directory: str | Path, *, schedule: str | None = None, microbatches: int | None = None,
             train: bool = False, optimizer: OptimizerSpec | str = DEFAULT_OPTIMIZER, check: bool = False,
             repeat: int = 0, result: str | Path | None = None) -> dict[str, Any]:
    """What one rank does (``torch.distributed`` already initialised by the caller from torchrun);
    with ``train`` and ``check`` every stage takes one step of ``optimizer`` (an :class:`OptimizerSpec`
    or its text, ``"adam{lr=1e-3}"``) and its weights are compared with a single-process run's."""
    directory = Path(directory)
    opt = OptimizerSpec.parse(optimizer)
    manifest = check_artifact(directory)
    art = Artifact.load(directory)
    info = art.runtime.info
    rank, world = dist.get_rank(), dist.get_world_size()
    n_stages, kind, micro = launch_plan(manifest, world, schedule=schedule, microbatches=microbatches)
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if torch.cuda.is_available() \
        and dist.get_backend() == "nccl" else torch.device("cpu")
    mine = list(range(rank, n_stages, world))
    modules = {s: torch.jit.load(str(directory / info["files"][s]), map_location=device) for s in mine}
    for m in modules.values():
        m.train(train)
    # the stage modules were traced at the graph's batch: that is one microbatch; a batch is M of them
    batches = [art.random_inputs(seed=i) for i in range(micro)]
    x = tuple(torch.cat([b[k] for b in batches]).to(device) for k in range(len(batches[0])))
    expected = tuple(torch.cat(parts) for parts in zip(*(art.runtime(*b) for b in batches)))
    gen = torch.Generator().manual_seed(7)
    target = torch.randn(expected[0].shape, generator=gen).to(device)
    pipe_stages = [PipelineStage(modules[s], s, n_stages, device) for s in mine]
    loss_fn = _loss if train else None
    if kind is Schedule.INTERLEAVED:
        sched = ScheduleInterleaved1F1B(pipe_stages, micro, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if kind is Schedule.GPIPE else Schedule1F1B
        sched = cls(pipe_stages[0], micro, loss_fn=loss_fn)

    def step() -> Any:
        first, last = 0 in mine, n_stages - 1 in mine
        kwargs = {"target": target} if train and last else {}
        if train:
            return sched.step(*(x if first else ()), **kwargs)
        with torch.no_grad():
            return sched.step(*(x if first else ()))

    out = step()
    report: dict[str, Any] = {"rank": rank, "stages": mine, "schedule": kind.value, "microbatches": micro}
    errors: list[float] = []
    if check and n_stages - 1 in mine and out is not None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        errors += [float((a.detach().cpu() - b).abs().max()) for a, b in zip(outs, expected)]
    if check and train:
        errors += _check_training(directory, info, mine, modules, x, target, opt, micro)
    if repeat:
        report.update(_time_steps(step, repeat))
    report["max_error"] = max(errors, default=0.0)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, report)
    summary = {"nproc": world, "backend": dist.get_backend(), "train": train, "ranks": gathered,
               "max_error": max(r["max_error"] for r in gathered)}
    if train:
        summary["optimizer"] = opt.text()
    tol = 1e-4 if train else float((manifest.get("options") or {}).get("tolerance") or 1e-5)
    summary["passed"] = summary["max_error"] <= tol
    if "seconds_per_batch" in report:
        summary["seconds_per_batch"] = max(r["seconds_per_batch"] for r in gathered)
        summary["cpu_seconds_per_batch"] = [r["cpu_seconds_per_batch"] for r in gathered]
    if rank == 0 and result is not None:
        write_text_atomic(result, json.dumps(summary, indent=1), "json")
    return dict(summary, this_rank=rank)


def _time_steps(step: Callable[[], Any], repeat: int) -> dict[str, float]:
    """Seconds (all ranks between two barriers) and this rank's CPU seconds per batch over ``repeat`` steps."""
    for _ in range(2):          # TorchScript's profiling executor optimises on the first calls
        step()
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        step()
    cpu = time.process_time() - cpu          # this rank's CPU (its gloo threads included), before the wait
    dist.barrier()
    return {"seconds_per_batch": (time.perf_counter() - start) / repeat, "cpu_seconds_per_batch": cpu / repeat}


def _check_training(directory: Path, info: dict[str, Any], mine: list[int], modules: dict[int, Any],
                    x: tuple[torch.Tensor, ...], target: torch.Tensor, optimizer: OptimizerSpec,
                    micro: int) -> list[float]:
    """Gradients and ``optimizer``-updated weights of this rank's stages against one process running all stages
    (microbatch by microbatch, each loss / M: the batch's mean loss, as the schedule scales it)."""
    device = x[0].device
    ref = [torch.jit.load(str(directory / f), map_location=device).train() for f in info["files"]]
    for *xs, tgt in zip(*(t.chunk(micro) for t in x), target.chunk(micro)):
        values: Any = tuple(xs)
        for m in ref:
            values = tuple(m(*values))
        (_loss(values, tgt) / micro).backward()
    errors = []
    for s in mine:
        got, want = dict(modules[s].named_parameters()), dict(ref[s].named_parameters())
        for name, p in want.items():
            g = got[name].grad
            errors.append(float((g - p.grad).abs().max()) if g is not None else float("inf"))
        if want:
            optimizer.build(modules[s].parameters()).step()
            optimizer.build(ref[s].parameters()).step()
        errors += [float((got[n].detach() - p.detach()).abs().max()) for n, p in want.items()]
    return errors
