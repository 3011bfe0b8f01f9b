"""Export an ``nn.Module`` straight to core ATen: one trace instead of two.

``torch.export.export`` traces the module at the pre-dispatch level (the
training IR: ``linear``, ``conv2d``, ``batch_norm`` ...), and
``ep.run_decompositions(table)`` then traces that program a second time, at
the post-dispatch level under the decomposition table.  For inference capture
the first program is only a stepping stone, so :func:`export_core_aten` runs
export's own non-strict post-dispatch path once, with the table handed to the
tracer, the way ``run_decompositions`` hands it to its retrace:

* ops the table decomposes that are CompositeImplicitAutograd (``linear`` ...)
  get the table's function as their CIA kernel for the duration of the trace;
* every other entry is the tracer's decomposition table (:func:`lowering_split`).

The program has the same signature (placeholders ``p_fc_weight``, ``x``),
module paths (``nn_module_stack``) and source lines (``stack_trace``) as the
two-trace one, and its graph prints the same::

    two traces: export → run_decompositions(table) → %addmm(%p_fc_bias, %x, %permute)
    one trace:  export_core_aten(module, inputs, None) → the same graph

It uses torch's private export helpers (``torch.export._trace``); a caller
keeps the two-trace path as its fallback when this raises.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import torch

from mlcomp.base.quiet import quiet_torch
from mlcomp.frontend.extra_decomps import extra_decompositions

ONE_TRACE = "one trace"


def one_trace_program(module: torch.nn.Module, inputs: tuple[Any, ...], dynamic_shapes: Any,
                      decompositions: Mapping[Any, Callable[..., Any]] | None = None
                      ) -> tuple["torch.export.ExportedProgram | None", str]:
    """``(program at core ATen, ONE_TRACE)``, or ``(None, why)`` when the two-trace path must run instead.

    That path is needed when the single trace fails (a decomposition that fails, which
    :func:`mlcomp.frontend.decompose.decompose` then locates op by op; a model export cannot
    trace, whose error that path explains) and when the program updates a buffer or an input in
    place: the pre-dispatch program still holds the in-place op, so the error names its source line.
    """
    why = _two_trace_reason(module)
    if why:
        return None, why
    with quiet_torch():
        try:
            ep = export_core_aten(module, inputs, dynamic_shapes, decompositions)
        except Exception as exc:  # noqa: BLE001 - any failure sends capture down the two-trace path
            lines = str(exc).strip().splitlines()
            return None, f"two traces: the one-trace export failed: {type(exc).__name__}: {lines[0] if lines else ''}"
    sig = ep.graph_signature
    if getattr(sig, "buffers_to_mutate", None) or getattr(sig, "user_inputs_to_mutate", None):
        return None, "two traces: the program updates a buffer or an input in place"
    if any(spec.kind.name == "CONSTANT_TENSOR" for spec in sig.input_specs):
        return None, "two traces: forward creates a tensor constant (one trace keeps lift_fresh_copy, not clone)"
    return ep, ONE_TRACE


# Module packages whose programs differ between the two paths (equal values, other graphs): their code
# reshapes values whose strides differ between eager's kernels (what the pre-dispatch trace sees) and the
# decompositions (what one trace sees), so a reshape is a view in one graph and a copy in the other.
TWO_TRACE_PACKAGES = {"transformers": "transformers modules reshape by strides, which differ in one trace"}


def _two_trace_reason(module: torch.nn.Module) -> str:
    """Why ``module`` must take the two-trace path ("" when one trace gives the same program)."""
    for sub in module.modules():
        package = type(sub).__module__.partition(".")[0]
        if package in TWO_TRACE_PACKAGES:
            return f"two traces: {TWO_TRACE_PACKAGES[package]}"
    tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    if len({id(t) for _, t in tensors}) < len(tensors):
        return "two traces: tied tensors (one trace names each use by its own path)"
    return ""


def export_core_aten(module: torch.nn.Module, inputs: tuple[Any, ...], dynamic_shapes: Any,
                     decompositions: Mapping[Any, Callable[..., Any]] | None = None) -> "torch.export.ExportedProgram":
    """Non-strict ``torch.export`` of ``module`` at core ATen under the lowering table (:func:`lowering_split`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.export.exported_program import _override_composite_implicit_decomp

    cia, python = lowering_split(decompositions)
    with unset_fake_temporarily(), _override_composite_implicit_decomp(cia):
        return _export_post_dispatch(module, inputs, dynamic_shapes, python)


def lowering_split(extra: Mapping[Any, Callable[..., Any]] | None = None
                   ) -> tuple[dict[Any, Callable[..., Any]], dict[Any, Callable[..., Any]]]:
    """``(cia, python)``: the lowering table (torch's core ATen, mlcomp's, then ``extra``) split as export
    splits it for its tracer, in one pass over the op namespaces.

    ``cia``: the CompositeImplicitAutograd (CIA) ops export may keep, each with the kernel the trace gives
    it (its own, the table's function, or one that keeps it); ``python``: every other entry.  The same
    two dicts as ``_split_decomp_table_to_cia_and_python_decomp(dict(table))`` of torch's table, which
    walks every op namespace three times (building, materialising, splitting) where this walks the
    non-ATen ones once (decision 57)::

        torch.export.default_decompositions() + mlcomp's + extra → materialise → split
        lowering_split(extra) → the same cia (525 ops) and python (434 ops)
    """
    from torch._decomp import _core_aten_decompositions_post_autograd
    from torch._export.utils import (_collect_all_valid_cia_ops_for_aten_namespace, _get_decomp_for_cia,
                                     _is_preservable_cia_op, _special_op_to_preserve_cia)
    from torch.export.decomp_utils import PRESERVED_ATEN_CIA_OPS

    aten, custom = _collect_all_valid_cia_ops_for_aten_namespace(), _custom_cia_ops()
    table = dict(_core_aten_decompositions_post_autograd())
    for op in aten:
        if op not in PRESERVED_ATEN_CIA_OPS and op not in table:
            table[op] = _get_decomp_for_cia(op)
    table.update(extra_decompositions())
    table.update(dict(extra or {}))
    for op in custom:
        if op not in table:
            table[op] = _get_decomp_for_cia(op)
    cia: dict[Any, Callable[..., Any]] = {}
    python: dict[Any, Callable[..., Any]] = {}
    for op, fn in table.items():
        (cia if op in aten or op in custom or _is_preservable_cia_op(op) else python)[op] = fn
    for op in (aten | custom) - table.keys():
        cia[op] = _special_op_to_preserve_cia
    return cia, python


def _custom_cia_ops() -> set[Any]:
    """The CIA ops export may keep outside the ``aten`` namespace (their C++ registrations resolved once)."""
    from torch._export.utils import _is_preservable_cia_op, _materialize_cpp_cia_ops

    _materialize_cpp_cia_ops()
    found: set[Any] = set()
    for name in list(torch.ops._dir):
        namespace = getattr(torch.ops, name) if name != "aten" else None
        if isinstance(namespace, torch._ops._OpNamespace):
            for packet in list(namespace):
                found.update(op for op in getattr(namespace, packet).op_overloads() if _is_preservable_cia_op(op))
    return found


def _export_post_dispatch(mod: torch.nn.Module, args: tuple[Any, ...], dynamic_shapes: Any,
                          python: dict[Any, Callable[..., Any]]) -> "torch.export.ExportedProgram":
    """torch's non-strict, post-dispatch export (``_export(strict=False, pre_dispatch=False)``) with the
    tracer given ``python`` as its decomposition table."""
    from torch._export.utils import remove_proxy_from_state_dict
    from torch._export.verifier import Verifier
    from torch.export import _trace as tr
    from torch.export.exported_program import ExportedProgram

    tr._EXPORT_MODULE_HIERARCHY = tr._get_module_hierarchy(mod)
    args, kwargs, in_spec, dynamic_shapes, verify_more = tr._process_export_inputs(mod, args, None, dynamic_shapes)
    state = tr._get_original_state_dict(mod)
    artifact = tr._non_strict_export(
        mod=mod, args=args, kwargs=kwargs, dynamic_shapes=dynamic_shapes, preserve_module_call_signature=(),
        orig_in_spec=in_spec, prefer_deferred_runtime_asserts_over_guards=False,
        _to_aten_func=functools.partial(tr._export_to_aten_ir, pre_dispatch=False, decomp_table=python))
    signature = artifact.aten.sig
    names = tr._get_forward_arg_names(mod, args, kwargs)
    artifact.aten.gm.meta["inline_constraints"] = tr._get_inline_constraints(artifact.fake_mode)
    ranges = tr._get_range_constraints(mod, artifact, args, kwargs, dynamic_shapes)
    gm, call_graph = tr._get_module_call_graph(artifact, (), False, names)
    tr._verify_nn_module_stack(gm)
    tr._verify_stack_trace(gm)
    tr._verify_placeholder_names(gm, signature)
    remove_proxy_from_state_dict(state, in_place=True)
    tr._update_gm_meta_if_possible(gm, mod)
    ep = ExportedProgram(root=gm, graph=gm.graph, graph_signature=signature, state_dict=state,
                         range_constraints=ranges, module_call_graph=call_graph, example_inputs=(args, kwargs),
                         constants=artifact.aten.constants, verifiers=[Verifier])
    verify_more(ep)
    return ep


__all__ = ["ONE_TRACE", "export_core_aten", "lowering_split", "one_trace_program"]
