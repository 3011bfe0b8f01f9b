"""Checking a compiled training step against eager PyTorch: gradients, N steps, a reloaded artifact.

::

    verify_gradients(art, model, F.cross_entropy, (x, y))["worst_rel"]     # one batch, nothing updated
    0.0
    cmp = compare_steps(art, copy.deepcopy(model), F.cross_entropy, (x, y), steps=5)
    cmp["worst"], cmp["worst_rel"]        # per tensor: max|compiled - eager| / max|eager|
    ('0.weight', 0.0)

An fp32 joint graph runs eager's own fused kernels (``mlcomp.frontend.joint``), so its
gradients are checked per parameter against eager autograd at 1e-5 (max-abs relative).

A mixed-precision joint graph cannot match anything bit for bit, and a forward-rounding
tolerance does not bound gradients (BatchNorm batch statistics over few values amplify
rounding).  It is held to the standard a user of eager autocast already accepts: three
gradient sets on one batch and seed, fp32 eager (the truth), eager autocast in the graph's
dtype (what the user would run otherwise) and the compiled step; per parameter, with
norm-wise relative errors ``err``::

    err(compiled, fp32) <= max(declared_tolerance, K_AUTOCAST * err(autocast, fp32))

``K_AUTOCAST`` = 1.25 sits above the largest ratio measured on the zoo and HF BERT/ViT
(``benchmarks/RESULTS.md``, mixed-precision training).

``err(compiled, autocast)`` is reported, not checked.  A loss-scaled artifact's autocast
reference scales and unscales with the same ``LossScaler`` (``torch.amp.GradScaler``'s recipe).
:func:`compare_steps` applies the rule to the state after N steps; :func:`check_step`
compares one step of a reloaded artifact with the step its original took.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mlcomp.analysis.ranges import Tolerance, declared_tolerance
from mlcomp.base.errors import VerificationError
from mlcomp.frontend.losses import model_output
from mlcomp.ir.dtypes import dtype_name
from mlcomp.pipeline.seeding import seeded

__all__ = ["GRAD_FLOOR", "K_AUTOCAST", "check_step", "compare_steps", "describe_gradients", "describe_steps",
           "eager_loss", "verify_gradients"]

GRAD_FLOOR = 1e-3   # see verify_gradients
SEED = 0            # both sides of a comparison draw their random numbers (dropout) from this seed: the
                    # joint graph keeps ``native_dropout``, which consumes the generator as eager's dropout does
K_AUTOCAST = 1.25   # a mixed-precision step may be this much further from fp32 than eager autocast (see below)
DECLARED, AUTOCAST = "declared", "autocast"   # which bound applied


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    diff = (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item() if a.numel() else 0.0
    scale = b.detach().double().abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _norm(t: torch.Tensor) -> float:
    return t.detach().double().norm().item() if t.numel() else 0.0


def _norm_rel(a: torch.Tensor, b: torch.Tensor, floor: float) -> float:
    """||a - b|| / max(||b||, floor), in float64."""
    diff = _norm(a.detach().double().cpu() - b.detach().double().cpu())
    scale = max(_norm(b), floor)
    return diff / scale if scale > 0 else diff


def eager_loss(model: torch.nn.Module, loss_fn: Any, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    if loss_fn is None:
        return model_output(model(*inputs))
    return loss_fn(model_output(model(*inputs[:-1])), inputs[-1])


def _reference_precision(art: Any) -> Any:
    """``torch.autocast`` in the dtype the artifact's graph computes in (a disabled one for fp32 graphs)."""
    low = declared_tolerance(art.graph) if getattr(art, "graph", None) is not None else None
    kind = torch.device(art.device).type
    return low, (torch.autocast(kind, dtype=low.dtype) if low is not None else torch.autocast(kind, enabled=False))


def _fp32(art: Any) -> Any:
    """A disabled autocast: fp32 eager even inside a caller's autocast region."""
    return torch.autocast(torch.device(art.device).type, enabled=False)


def _eager_gradients(art: Any, model: torch.nn.Module, loss_fn: Any, args: Sequence[torch.Tensor],
                     precision: Any, scaler: Any = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and parameter gradients of a fresh copy of ``model`` on ``args`` (seeded, under ``precision``).

    With ``scaler`` (the artifact's :class:`LossScaler`), the loss is multiplied by its current scale
    before backward and the gradients are unscaled by it in fp32, as the compiled step does."""
    ref = copy.deepcopy(model).train(True).to(art.device)
    with seeded(SEED):
        with precision:
            loss = eager_loss(ref, loss_fn, args)
        seed = loss * scaler.scale if scaler is not None and scaler.spec.active else loss
        seed.backward()
    named = [(n, p.grad) for n, p in ref.named_parameters() if p.grad is not None]
    grads = [g for _, g in named]
    if scaler is not None:
        grads, _ = scaler.unscale(grads)
    return loss.detach(), {n: g for (n, _), g in zip(named, grads)}


def verify_gradients(art: Any, model: torch.nn.Module, loss_fn: Any,
                     inputs: Sequence[torch.Tensor], tolerance: float = 1e-5) -> dict[str, Any]:
    """Check one batch's gradients of ``art`` against eager (nothing updated); raise or return the figures.

    fp32 graph: per parameter ``max|compiled - eager| / max(max|eager|, GRAD_FLOOR * G)`` with ``G``
    the largest gradient entry of the model, within ``tolerance`` (1e-5), and the loss likewise.

    Mixed-precision graph: see the module docstring.  ``err`` is norm-wise,
    ``||a - b|| / max(||b||, GRAD_FLOOR * N)`` with ``N`` the largest fp32 gradient norm of the
    model; the loss obeys the same rule.  A gradient that is mathematically zero (an attention
    key bias: softmax ignores a constant added to every score) is rounding noise on every side,
    so it is measured against the floor instead of against its own size.

    ``inputs`` end with the loss's target unless ``loss_fn`` is ``None``.  Raises
    :class:`~mlcomp.base.errors.VerificationError` naming the worst parameter.
    """
    args = [t.to(art.device) for t in inputs]
    with seeded(SEED):
        loss, grads = art.gradients(*args)
    low, precision = _reference_precision(art)
    if low is None:
        result = _exact(art, model, loss_fn, args, loss, grads, tolerance)
    else:
        result = _against_autocast(art, model, loss_fn, args, loss, grads, low, precision, tolerance)
    art.verification = result
    art.reference_inputs = tuple(t.detach() for t in args)
    if not result["passed"]:
        raise VerificationError(
            (f"the compiled training step of {art.name} disagrees with eager autograd: " if low is None else
             f"the compiled mixed-precision training step of {art.name} fails the gradient check: ")
            + describe_gradients(result),
            hint="run with --verify to find the first diverging node of the joint graph"
            + (", or raise --tolerance" if low is None else ", or keep the named module in fp32 "
               "(mixed-precision{deny=[…]})"))
    return result


def _exact(art: Any, model: torch.nn.Module, loss_fn: Any, args: Sequence[torch.Tensor], loss: torch.Tensor,
           grads: Mapping[str, torch.Tensor], tolerance: float) -> dict[str, Any]:
    """An fp32 graph against eager autograd: max-abs relative per parameter (the compiled step runs eager's
    fused kernels, so 1e-5 holds)."""
    expected, eager = _eager_gradients(art, model, loss_fn, args, _fp32(art), None)
    pairs = {n: (grads[n], g) for n, g in eager.items() if n in grads}
    floor = GRAD_FLOOR * max((b.detach().abs().max().item() for _, b in pairs.values() if b.numel()), default=0.0)
    rows = {}
    for name, (a, b) in pairs.items():
        diff = (a - b).abs().max().item() if a.numel() else 0.0
        scale = max(b.detach().abs().max().item() if b.numel() else 0.0, floor)
        rows[name] = {"max_abs": diff, "rel": diff / scale if scale > 0 else diff}
    worst = max(rows, key=lambda k: rows[k]["rel"]) if rows else None
    result = {"loss": loss.item(), "eager_loss": expected.item(), "loss_rel": _rel(loss, expected),
              "params": rows, "worst": worst, "worst_rel": rows[worst]["rel"] if worst else 0.0,
              "tolerance": tolerance, "reference": "fp32"}
    result["passed"] = result["worst_rel"] <= tolerance and result["loss_rel"] <= tolerance
    return result


def _bound(declared: float, autocast_err: float | None) -> tuple[float, str]:
    """``max(declared, K_AUTOCAST * autocast_err)`` and which one it is; autocast's gradient non-finite
    (its GradScaler would skip the step): the declared tolerance alone."""
    scaled = K_AUTOCAST * autocast_err if autocast_err is not None else 0.0
    return (scaled, AUTOCAST) if scaled > declared else (declared, DECLARED)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _nearest(err: float, bound: float) -> float:
    return err / bound if math.isfinite(err) else math.inf


def _against_autocast(art: Any, model: torch.nn.Module, loss_fn: Any, args: Sequence[torch.Tensor],
                      loss: torch.Tensor, grads: Mapping[str, torch.Tensor], low: Tolerance, precision: Any,
                      tolerance: float) -> dict[str, Any]:
    """A mixed-precision graph: compiled and eager autocast, each against fp32 eager (the module docstring)."""
    declared = max(tolerance, low.rtol)
    truth_loss, truth = _eager_gradients(art, model, loss_fn, args, _fp32(art))
    auto_loss, auto = _eager_gradients(art, model, loss_fn, args, precision, art.loss_scaler)
    names = [n for n in truth if n in grads and n in auto]
    floor = GRAD_FLOOR * max((_norm(truth[n]) for n in names), default=0.0)
    rows = {}
    for name in names:
        mine = _norm_rel(grads[name], truth[name], floor)
        theirs = _finite(_norm_rel(auto[name], truth[name], floor))
        bound, which = _bound(declared, theirs)
        rows[name] = {"rel": mine, "autocast_rel": theirs, "bound": bound, "bound_from": which,
                      "vs_autocast": _finite(_norm_rel(grads[name], auto[name], floor)),
                      "passed": math.isfinite(mine) and mine <= bound}
    # the worst parameter is the one nearest its bound (the first to fail; non-finite first of all)
    worst = max(rows, key=lambda k: _nearest(rows[k]["rel"], rows[k]["bound"])) if rows else None
    row = rows[worst] if worst else {"rel": 0.0, "autocast_rel": 0.0, "vs_autocast": 0.0, "bound": declared,
                                     "bound_from": DECLARED}
    loss_rel, auto_loss_rel = _norm_rel(loss, truth_loss, 0.0), _finite(_norm_rel(auto_loss, truth_loss, 0.0))
    loss_bound, loss_from = _bound(declared, auto_loss_rel)
    return {"loss": loss.item(), "eager_loss": truth_loss.item(), "autocast_loss": auto_loss.item(),
            "loss_rel": loss_rel, "loss_autocast_rel": auto_loss_rel,
            "loss_vs_autocast": _finite(_norm_rel(loss, auto_loss, 0.0)), "loss_bound": loss_bound,
            "loss_bound_from": loss_from, "params": rows, "worst": worst, "worst_rel": row["rel"],
            "worst_autocast_rel": row["autocast_rel"], "worst_vs_autocast": row["vs_autocast"],
            "bound": row["bound"], "bound_from": row["bound_from"], "tolerance": declared, "k": K_AUTOCAST,
            "reference": f"autocast-{dtype_name(low.dtype)}",
            "loss_scale": art.loss_scaler.scale if art.loss_scaler is not None and art.loss_scaler.spec.active
            else None,
            "passed": all(r["passed"] for r in rows.values()) and math.isfinite(loss_rel) and loss_rel <= loss_bound}


def _num(value: float | None) -> str:
    return f"{value:.2e}" if value is not None else "non-finite"


def _within(check: Mapping[str, Any], err: float, bound: float, which: str, autocast: float | None) -> str:
    """``within the bound 0.472 = 1.25 × autocast's 0.377 (from autocast)`` or ``beyond …``."""
    verdict = "within" if math.isfinite(err) and err <= bound else "beyond"
    if which == AUTOCAST:
        return f"{verdict} the bound {bound:.3g} = {check['k']:g} × autocast's {autocast:.3g} (from autocast)"
    return f"{verdict} the bound {bound:.3g}, the declared {check['reference'].split('-', 1)[1]} tolerance (declared)"


def describe_gradients(check: Mapping[str, Any]) -> str:
    """One sentence on a :func:`verify_gradients` result: the worst parameter and, for a mixed graph, the
    three errors and the bound that applied (``mlcomp compile --train`` prints it; so does the refusal)."""
    worst = check["worst"]
    if check.get("reference", "fp32") == "fp32":
        return (f"gradient of {worst} differs by {check['worst_rel']:.2e} relative (loss {check['loss_rel']:.2e}), "
                f"tolerance {check['tolerance']:.0e}")
    grad = _within(check, check["worst_rel"], check["bound"], check["bound_from"], check["worst_autocast_rel"])
    loss = _within(check, check["loss_rel"], check["loss_bound"], check["loss_bound_from"], check["loss_autocast_rel"])
    scaled = f", loss scale {check['loss_scale']:g} on both" if check.get("loss_scale") else ""
    return (f"against fp32 eager, the {check['reference'].split('-', 1)[1]} gradient of {worst} is "
            f"{_num(check['worst_rel'])} off and eager autocast's {_num(check['worst_autocast_rel'])} (compiled vs "
            f"autocast {_num(check['worst_vs_autocast'])}), {grad}; the loss is {_num(check['loss_rel'])} off "
            f"(autocast {_num(check['loss_autocast_rel'])}), {loss}{scaled}")


def describe_steps(cmp: Mapping[str, Any]) -> str:
    """One sentence on a mixed-precision :func:`compare_steps` result (three trajectories)."""
    def arc(losses: Sequence[float]) -> str:
        return f"{losses[0]:.4g} → {losses[-1]:.4g}"

    return (f"losses {arc(cmp['compiled_losses'])} compiled / {arc(cmp['eager_losses'])} autocast / "
            f"{arc(cmp['fp32_losses'])} fp32 ({_num(cmp['loss_rel'])} off); against fp32 eager, {cmp['worst']} is "
            f"{_num(cmp['worst_rel'])} off and eager autocast's {_num(cmp['worst_autocast_rel'])} (compiled vs "
            f"autocast {_num(cmp['worst_vs_autocast'])}), "
            f"{_within(cmp, cmp['worst_rel'], cmp['bound'], cmp['bound_from'], cmp['worst_autocast_rel'])}")


def compare_steps(art: Any, model: torch.nn.Module, loss_fn: Any,
                  inputs: Sequence[torch.Tensor], steps: int = 5) -> dict[str, Any]:
    """Run ``steps`` compiled steps and ``steps`` eager steps (same optimizer spec) on one batch.

    Returns the losses of both, the worst per-tensor error ``max|Δ| / max|eager|`` over
    every float parameter and buffer and its key (``worst``/``worst_rel``: the checked
    figure), and for information the norm-wise ``||compiled - eager|| / ||eager||`` of the
    whole state (``global_rel``); the artifact and ``model`` both advance (pass copies).
    A mixed-precision graph: :func:`_steps_against_autocast` (three trajectories, the
    gradient rule per tensor; ``worst_rel`` is then the compiled state's error from fp32's).
    """
    model.train(True).to(art.device)     # the caller's copy: eager steps run where the compiled ones do
    args = [t.to(art.device) for t in inputs]
    low, precision = _reference_precision(art)
    if low is not None:
        return _steps_against_autocast(art, model, loss_fn, args, steps, low, precision)
    opt = art.optimizer_spec.build(p for p in model.parameters() if p.requires_grad)
    compiled, eager = [], []
    for i in range(steps):      # step i of both sides draws from the same seed (dropout masks agree)
        with seeded(SEED + i):
            compiled.append(art.step(*args).item())
        opt.zero_grad(set_to_none=True)
        with seeded(SEED + i):
            with precision:
                loss = eager_loss(model, loss_fn, args)
            loss.backward()
        opt.step()
        eager.append(loss.item())
    mine, theirs = art.state_dict(), model.state_dict()
    keys = [k for k in theirs if theirs[k].is_floating_point()]
    errors = {k: _rel(mine[k], theirs[k]) for k in keys}
    worst = max(errors, key=errors.__getitem__) if errors else None
    diff = sum(float((mine[k].double().cpu() - theirs[k].double().cpu()).square().sum()) for k in keys)
    norm = sum(float(theirs[k].double().cpu().square().sum()) for k in keys)
    return {"compiled_losses": compiled, "eager_losses": eager, "worst": worst,
            "worst_rel": errors[worst] if worst else 0.0,
            "global_rel": (diff / norm) ** 0.5 if norm > 0 else diff ** 0.5, "tolerance": None,
            "loss_rel": _losses_rel(compiled, eager)}


def _losses_rel(mine: Sequence[float], theirs: Sequence[float]) -> float:
    """Relative to the first loss: a loss driven to ~0 has no meaningful relative error of its own."""
    return max(abs(a - b) for a, b in zip(mine, theirs)) / max(abs(theirs[0]), 1e-12)


def _train_eager(art: Any, model: torch.nn.Module, loss_fn: Any, args: Sequence[torch.Tensor], steps: int,
                 precision: Any, scaler: Any) -> list[float]:
    """``steps`` eager steps of ``model`` (it advances) with the artifact's optimizer spec; with ``scaler``
    (a copy of the artifact's) the loss is scaled, the gradients unscaled and a non-finite step skipped
    as the compiled step does.  Step ``i`` draws from ``SEED + i``, as the compiled step ``i``."""
    opt = art.optimizer_spec.build(p for p in model.parameters() if p.requires_grad)
    losses = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        with seeded(SEED + i):
            with precision:
                loss = eager_loss(model, loss_fn, args)
            (loss * scaler.scale if scaler is not None and scaler.spec.active else loss).backward()
        apply = True
        if scaler is not None:
            params = [p for p in model.parameters() if p.grad is not None]
            grads, finite = scaler.unscale([p.grad for p in params])
            apply = scaler.update(finite)
            for p, g in zip(params, grads):
                p.grad = g
        if apply:
            opt.step()
        losses.append(loss.item())
    return losses


def _steps_against_autocast(art: Any, model: torch.nn.Module, loss_fn: Any, args: Sequence[torch.Tensor],
                            steps: int, low: Tolerance, precision: Any) -> dict[str, Any]:
    """A mixed-precision graph after ``steps`` steps: the gradient rule (module docstring) per float
    parameter and buffer, norm-wise, with fp32 eager steps as the truth and eager autocast steps
    (``model`` advances along them) as the yardstick; ``tolerance`` is the worst tensor's bound."""
    truth = copy.deepcopy(model)
    scaler = copy.deepcopy(art.loss_scaler)
    fp32 = _train_eager(art, truth, loss_fn, args, steps, _fp32(art), None)
    auto = _train_eager(art, model, loss_fn, args, steps, precision, scaler)
    compiled = []
    for i in range(steps):
        with seeded(SEED + i):
            compiled.append(art.step(*args).item())
    mine, theirs, exact = art.state_dict(), model.state_dict(), truth.state_dict()
    rows = {}
    for key in (k for k in exact if exact[k].is_floating_point()):
        err, ref = _norm_rel(mine[key], exact[key], 0.0), _finite(_norm_rel(theirs[key], exact[key], 0.0))
        bound, which = _bound(low.rtol, ref)
        rows[key] = {"rel": err, "autocast_rel": ref, "vs_autocast": _finite(_norm_rel(mine[key], theirs[key], 0.0)),
                     "bound": bound, "bound_from": which}
    worst = max(rows, key=lambda k: _nearest(rows[k]["rel"], rows[k]["bound"])) if rows else None
    row = rows[worst] if worst else {"rel": 0.0, "autocast_rel": 0.0, "vs_autocast": 0.0, "bound": low.rtol,
                                     "bound_from": DECLARED}
    loss_rel = _losses_rel(compiled, fp32)
    return {"compiled_losses": compiled, "eager_losses": auto, "fp32_losses": fp32, "tensors": rows,
            "worst": worst, "worst_rel": row["rel"], "worst_autocast_rel": row["autocast_rel"],
            "worst_vs_autocast": row["vs_autocast"], "bound": row["bound"], "bound_from": row["bound_from"],
            "tolerance": row["bound"], "declared": low.rtol, "k": K_AUTOCAST,
            "reference": f"autocast-{dtype_name(low.dtype)}", "loss_rel": loss_rel,
            "loss_autocast_rel": _losses_rel(auto, fp32),
            "passed": all(math.isfinite(r["rel"]) and r["rel"] <= r["bound"] for r in rows.values())
            and loss_rel <= row["bound"]}


def check_step(art: Any, inputs: Sequence[torch.Tensor], expected_loss: torch.Tensor,
               expected: Mapping[str, torch.Tensor], tolerance: float = 1e-6) -> dict[str, Any]:
    """One step of a copy of ``art`` on ``inputs`` against a recorded loss and state (a reloaded artifact
    against the step its original took before saving); ``art`` itself does not move."""
    trial = copy.deepcopy(art)
    loss = trial.step(*inputs)
    mine = trial.state_dict()
    errors = {k: _rel(mine[k], v) for k, v in expected.items() if v.is_floating_point()}
    worst = max(errors, key=errors.__getitem__) if errors else None
    result = {"loss_rel": _rel(loss, expected_loss), "worst": worst,
              "worst_rel": errors[worst] if worst else 0.0, "tolerance": tolerance}
    result["passed"] = result["loss_rel"] <= tolerance and result["worst_rel"] <= tolerance
    if not result["passed"]:
        raise VerificationError(
            f"the reloaded training artifact of {art.name} does not repeat the saved step: {worst} differs by "
            f"{result['worst_rel']:.2e} relative (loss {result['loss_rel']:.2e}), tolerance {tolerance:.0e}",
            hint="the folder was changed after saving or written by another torch build: compile it again")
    return result
