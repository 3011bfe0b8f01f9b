"""What ``--train`` does in ``mlcomp compile``, ``mlcomp inspect`` and ``mlcomp bench``.

    $ mlcomp compile mlp --train --loss cross_entropy --optimizer "adam{lr=1e-3}" -o out/mlp-train
    captured mlp for training: 55 nodes (forward 10, loss 3, backward 38) in 2.1s
    gradients vs eager autograd: worst 0.0e+00 relative (0.weight), loss 0.0e+00: passed
    5 steps compiled vs eager (adam): losses 0.69 → 0.13 / 0.69 → 0.13, parameters within 0.0e+00 (0.weight)
    saved out/mlp-train (joint.ir.txt, step.pt, state.pt, optimizer.pt, reference.pt, manifest.json)
    $ mlcomp compile mlp --batch 4 --train -p "mixed-precision{dtype=bf16}"   # compiled, autocast, fp32
    gradients vs eager autograd: against fp32 eager, the bf16 gradient of 2.bias is 1.76e-01 off and eager
    autocast's 1.75e-01 (compiled vs autocast 1.37e-03), within the bound 0.219 = 1.25 × autocast's 0.175
    (from autocast); the loss is 3.18e-04 off (autocast 3.18e-04), within the bound 0.02, …: passed
    $ mlcomp inspect resnet18 --train --batch 32      # FLOPs by phase, saved activations by module
    $ mlcomp bench resnet18 --train --batch 32
    $ mlcomp compile models.py:make --train           # make() returns (model, loss_fn): its loss is used
    $ mlcomp compile mlp --train --loss-scale "dynamic{init=65536 growth_interval=2000}"   # or 1024, none

The commands themselves live in :mod:`mlcomp.cli.compile`, :mod:`mlcomp.cli.main`
and :mod:`mlcomp.cli.bench`; they call these functions when ``--train`` is given.
Every check that can fail (target, optimizer spec, loss name, output folder, a
``--loss`` beside a factory's own loss) runs before the model is captured, and the
output folder is written atomically, so a failure writes nothing.  ``--verify``
(``-v``) checks every pass on the joint graph and names the first diverging node
with its phase and module path.
"""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import click
import torch

from mlcomp.base.errors import MlcompError, VerificationError

__all__ = ["bench_train", "check_train_flags", "compile_train", "inspect_train"]


def check_train_flags(target: str | None, loss: str, optimizer: str, loss_scale: str | None = None
                      ) -> tuple[Any, Any]:
    """Target capability, loss name, optimizer spec and ``--loss-scale``, checked before any capture."""
    from mlcomp.frontend.joint import LossKind
    from mlcomp.training.loss_scaling import LossScaleSpec
    from mlcomp.runtime.optim import OptimizerSpec
    from mlcomp.training.step import check_training_target

    if loss_scale is not None:
        LossScaleSpec.parse(loss_scale)
    spec = OptimizerSpec.parse(optimizer)
    kind = LossKind.parse(loss)
    check_training_target(target or "cpu")
    return spec, kind


def _given(option: str) -> bool:
    """Whether ``--option`` was typed (not its default): a factory's loss and ``--loss`` conflict."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    source = ctx.get_parameter_source(option)
    return source is not None and source is not click.core.ParameterSource.DEFAULT


def _load(model: str, input_shapes: tuple[str, ...], batch: int | None, trust_pickle: bool):
    from mlcomp.api import check_model_inputs
    from mlcomp.frontend.loading import load_model
    from mlcomp.frontend.programs import eval_mode_ops

    check_model_inputs(model, input_shapes, batch, "export")
    source = load_model(model, input_shapes=input_shapes, trust_pickle=trust_pickle, batch=batch)
    source.eager = source.trainable()   # a TorchScript archive: its trainable tensors as parameters
    if source.kind in ("exported", "torchscript") and eval_mode_ops(source.eager):
        click.echo(f"note: {model} holds a program captured in eval mode ({', '.join(eval_mode_ops(source.eager))}"
                   "): it trains as captured, BatchNorm on its running statistics, as its eager reference does")
    if not isinstance(source.eager, torch.nn.Module):
        raise MlcompError(f"{model} is not a Python nn.Module, so it has no parameters to train here",
                          hint="give a zoo name or a factory file.py:fn returning the module")
    return source


def _loss_of(source: Any, loss: str) -> Any:
    """``--loss`` (a LossKind value) or the factory's loss_fn; both given: refused."""
    from mlcomp.frontend.joint import LossKind, resolve_loss

    chosen = resolve_loss(source, loss if _given("loss") else None, option="--loss")
    return chosen.value if isinstance(chosen, LossKind) else (LossKind.parse(loss).value if chosen is None
                                                               else chosen)


def _capture(source: Any, loss: Any, dropout_off: bool = True):
    from mlcomp.analysis.training_graph import phase_counts
    from mlcomp.frontend.joint import capture_joint, example_target, without_dropout

    model = without_dropout(source.eager) if dropout_off else source.eager
    inputs = source.inputs()
    y = example_target(model, inputs, loss)
    reference = copy.deepcopy(model)
    t0 = time.perf_counter()
    graph = capture_joint(model, inputs, y, loss=loss, name=source.name)
    counts = phase_counts(graph)
    click.echo(f"captured {graph.name} for training: {len(graph)} nodes ("
               + ", ".join(f"{p.value} {n}" for p, n in counts.items()) + f") in {time.perf_counter() - t0:.1f}s")
    return reference, inputs, y, graph


def _loss_name(loss: Any) -> str:
    return loss if isinstance(loss, str) else getattr(loss, "__name__", type(loss).__name__)


def compile_train(model: str, input_shapes: tuple[str, ...], batch: int | None, trust_pickle: bool, *,
                  target: str | None, output: Path | None, loss: str, optimizer: str, steps: int,
                  tolerance: float | None, device: str | None, pipeline: str | None, instruments: Any,
                  force: bool, loss_scale: str | None = None, fused: bool = False, host_memory: str = "auto") -> None:
    """``mlcomp compile MODEL --train``: capture, compile, verify, compare N steps, save the artifact folder."""
    from mlcomp.base.files import Kind, check_destination
    from mlcomp.frontend.joint import loss_function
    from mlcomp.targets.base import CompileOptions
    from mlcomp.training.step import (
        FUSED_FILE,
        SAVED_FILES,
        compare_steps,
        compile_training,
        verify_gradients,
    )
    from mlcomp.training.check import describe_gradients, describe_steps
    from mlcomp.training.host_memory import before_capture

    spec, _ = check_train_flags(target, loss, optimizer, loss_scale)
    target = target or "cpu"
    if output is not None:
        check_destination(output, Kind.DIR, force=force, inputs=(model,))
    pipe, facts = None, None
    if pipeline:      # a dtype the target cannot build: refused before capture
        from mlcomp.pipeline import Pipeline, run_pipeline
        from mlcomp.targets import get_target

        pipe = Pipeline.coerce(pipeline)
        facts = get_target(target).facts(CompileOptions.make(device=device))
        pipe.check_target(target, facts=facts)
    source = _load(model, input_shapes, batch, trust_pickle)
    chosen = _loss_of(source, loss)
    before_capture(host_memory, pipe, fused=fused)
    reference, inputs, y, graph = _capture(source, chosen)
    loss_fn = loss_function(chosen)
    args = tuple(inputs) + ((y,) if loss_fn is not None else ())
    if pipe is not None:
        graph, report = run_pipeline(graph, pipe, example_inputs=args, instruments=instruments, target=facts,
                                     optimizer=spec)
        click.echo(report.format())
    output = check_destination(output or Path("mlcomp-out") / f"{graph.name}-{target}-train", Kind.DIR, force=force,
                               inputs=(model,))
    keys = list(reference.state_dict())
    options = CompileOptions.make(device=device, tolerance=tolerance)
    tol = tolerance or 1e-5
    memory = {"update_in_backward": fused, "host_memory": host_memory}
    art = compile_training(graph, target=target, optimizer=spec, options=options, state_keys=keys,
                           loss_scale=loss_scale, **memory)
    check = verify_gradients(art, reference, loss_fn, args, tolerance=tol)
    if check["reference"] == "fp32":
        click.echo(f"gradients vs eager autograd: worst {check['worst_rel']:.1e} relative ({check['worst']}), "
                   f"loss {check['loss_rel']:.1e}: passed")
    else:   # a mixed-precision graph: the three-way check (compiled, eager autocast, fp32) and its bound
        click.echo(f"gradients vs eager autograd: {describe_gradients(check)}: passed")
    cmp = compare_steps(compile_training(graph, target=target, optimizer=spec, options=options, state_keys=keys,
                                         loss_scale=loss_scale, **memory),
                        copy.deepcopy(reference), loss_fn, args, steps=steps)
    if art.loss_scaler is not None:
        click.echo(f"loss scaling: {art.loss_scaler.spec.text()}")
    if art.host_memory and art.host_memory["policy"] != "keep":
        click.echo(f"host memory: {art.host_memory['policy']} ({art.host_memory['effect']}; applied "
                   f"{art.host_memory['applied']})")
    mixed = cmp.get("reference") is not None   # a mixed-precision graph: compiled, eager autocast and fp32
    if mixed:
        click.echo(f"{steps} steps compiled vs eager ({spec.text()}): {describe_steps(cmp)}")
    else:
        click.echo(f"{steps} steps compiled vs eager ({spec.text()}): losses {cmp['compiled_losses'][0]:.4g} → "
                   f"{cmp['compiled_losses'][-1]:.4g} / {cmp['eager_losses'][0]:.4g} → {cmp['eager_losses'][-1]:.4g}, "
                   f"parameters within {cmp['worst_rel']:.1e} relative ({cmp['worst']})")
    tol = max(tol, cmp["tolerance"] or 0.0)    # a mixed-precision graph: the worst tensor's bound
    if cmp["worst_rel"] > tol or cmp["loss_rel"] > tol:
        raise VerificationError(f"{steps} compiled training steps of {graph.name} drift from eager: "
                                + (describe_steps(cmp) if mixed else f"{cmp['worst']} differs by "
                                   f"{cmp['worst_rel']:.2e} relative (losses {cmp['loss_rel']:.2e}), "
                                   f"tolerance {tol:.0e}"), hint="raise --tolerance, or run with --verify")
    art.verification = dict(check, loss_fn=_loss_name(chosen), steps=cmp)   # "loss" keeps the value
    art.save(output, force=True)
    files = [*SAVED_FILES, *([FUSED_FILE] if art.fused is not None else []), "manifest.json"]
    click.echo(f"saved {output} ({', '.join(files)})")


def inspect_train(model: str, input_shapes: tuple[str, ...], batch: int | None, trust_pickle: bool, *,
                  loss: str, as_json: bool, show_ir: bool, top: int) -> None:
    """``mlcomp inspect MODEL --train``: FLOPs by phase, saved activations by module, predicted peak."""
    from mlcomp.analysis.training_graph import phase_flops, predicted_peak, saved_activations
    from mlcomp.base.units import fmt_bytes
    from mlcomp.frontend.joint import LossKind
    from mlcomp.frontend.joint_origins import bytes_by_origin
    from mlcomp.ir.node import Phase

    LossKind.parse(loss)
    source = _load(model, input_shapes, batch, trust_pickle)
    _, _, _, graph = _capture(source, _loss_of(source, loss))
    flops = phase_flops(graph)
    saved = saved_activations(graph)
    by_module = bytes_by_origin(graph, saved)
    peak = predicted_peak(graph)
    fwd = flops[Phase.FORWARD] + flops[Phase.LOSS]
    report = {"flops": {p.value: n for p, n in flops.items()},
              "backward_over_forward": flops[Phase.BACKWARD] / max(fwd, 1),
              "saved_activation_bytes": sum(s.nbytes for s in saved), "saved_values": len(saved),
              "saved_bytes_by_module": by_module, "predicted_peak": {
                  "resident_bytes": peak.resident, "transient_bytes": peak.transient, "at": peak.at}}
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    if show_ir:
        click.echo(graph.format())
        click.echo()
    click.echo("FLOPs: " + ", ".join(f"{p.value} {n / 1e9:.4g} G" for p, n in flops.items())
               + f"; backward / forward = {report['backward_over_forward']:.2f}")
    click.echo(f"saved activations: {len(saved)} values, {fmt_bytes(report['saved_activation_bytes'])}, by module:")
    for module, nbytes in list(by_module.items())[:top]:
        click.echo(f"  {module:<32} {fmt_bytes(nbytes)}")
    click.echo(f"predicted peak (liveness): {fmt_bytes(peak.total)} = resident {fmt_bytes(peak.resident)} "
               f"(parameters, buffers, inputs) + transient {fmt_bytes(peak.transient)} (at %{peak.at})")


def bench_train(models: tuple[str, ...], batches: tuple[int, ...], *, targets: tuple[str, ...], policy: Any,
                loss: str, optimizer: str, json_out: str | None, loss_scale: str | None = None) -> str:
    """``mlcomp bench MODEL --train``: one table row per model and batch; returns the JSON text."""
    from mlcomp.frontend.loading import load_model
    from mlcomp.measure.training_bench import bench_training, format_rows

    compiled = [t for t in targets if t != "eager"] or ["cpu"]
    rows = []
    for target in compiled:
        check_train_flags(target, loss, optimizer, loss_scale)
        scaling = {"loss_scale": loss_scale} if loss_scale is not None else {}
        for model in models:
            for batch in batches:
                if ":" in model:   # a factory: its own loss (and inputs) if it returns them
                    source = load_model(model, batch=batch)
                    rows.append(bench_training(source.eager, inputs=source.inputs(), name=source.name,
                                               batch=batch, loss=_loss_of(source, loss), optimizer=optimizer,
                                               target=target, policy=policy, **scaling))
                else:
                    rows.append(bench_training(model, batch=batch, loss=loss, optimizer=optimizer, target=target,
                                               policy=policy, **scaling))
    if json_out != "-":
        click.echo(format_rows(rows))
    return json.dumps([r.to_json() for r in rows], indent=2)
