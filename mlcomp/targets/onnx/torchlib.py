"""Which ops torchlib translates, and a registry of only the ones a graph needs.

torch.onnx's ``ONNXRegistry.from_torchlib()`` parses the source of ~1000 torchlib
functions.  :func:`translatable` answers "does torchlib translate this op" from
the registries' qualified names alone (no function is parsed), and
:func:`graph_registry` builds an ``ONNXRegistry`` holding only a graph's ops, for
the direct export path (:mod:`mlcomp.targets.onnx.export`).

The private torch.onnx and onnxscript names both use are pinned in :data:`PINNED`;
:func:`missing_private_api` says which one this torch lacks, if any.
"""
from __future__ import annotations

import importlib
import operator
from functools import lru_cache
from typing import Any

import torch

from mlcomp.base.quiet import quiet_converter

__all__ = ["PINNED", "Translatable", "graph_registry", "missing_private_api", "pinned", "translatable"]

# every private torch.onnx name the direct path touches: (module, attribute)
PINNED = (
    ("torch.onnx._internal.exporter._core", "_exported_program_to_onnx_program"),
    ("torch.onnx._internal.exporter._fx_passes", "insert_type_promotion_nodes"),
    ("torch.onnx._internal.exporter._fx_passes", "remove_assertion_nodes"),
    ("torch.onnx._internal.exporter._registration", "ONNXRegistry"),
    ("torch.onnx._internal.exporter._registration", "OnnxDecompMeta"),
    ("torch.onnx._internal.exporter._registration", "_get_overload"),
    ("torch.onnx._internal.exporter._torchlib._torchlib_registry", "get_torchlib_ops"),
    ("torch.onnx._internal.exporter._constants", "TORCHLIB_OPSET"),
    ("torch.onnx._internal.exporter._decomp", "create_onnx_friendly_decomposition_table"),
    ("torch.onnx._internal._lazy_import", "onnxscript_apis"),
    ("onnxscript.function_libs.torch_lib.registration", "default_registry"),
    ("onnxscript.function_libs.torch_lib.ops", "__name__"),     # importing it fills the registry
)


def pinned(module: str, attr: str) -> Any:
    """``module.attr`` of a :data:`PINNED` private name (ImportError/AttributeError where it is gone)."""
    return getattr(importlib.import_module(module), attr)


def missing_private_api() -> str | None:
    """``None`` when every :data:`PINNED` name exists, else which one does not."""
    for module, attr in PINNED:
        try:
            pinned(module, attr)
        except (ImportError, AttributeError):
            return f"this torch/onnxscript has no {module}.{attr}"
    return None


def _key(qualified: str) -> str:
    """``aten::add.default`` and ``aten::add`` → ``aten::add`` (``OpOverload.name()``'s spelling)."""
    ns, _, rest = qualified.partition("::")
    op, _, overload = rest.partition(".")
    return f"{ns}::{op}" + (f".{overload}" if overload and overload != "default" else "")


def _target_key(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    module = "_operator" if getattr(operator, getattr(target, "__name__", ""), None) is target else \
        getattr(target, "__module__", "?")
    return f"{module}::{getattr(target, '__name__', target)}"


@lru_cache(maxsize=4)
def _registered_keys(opset: int) -> frozenset[str]:
    """Keys of every op torchlib translates at ``opset``: torch's own and onnxscript's, no function parsed."""
    with quiet_converter():
        importlib.import_module("onnxscript.function_libs.torch_lib.ops")   # fills the default registry
    onnxscript_reg = pinned("onnxscript.function_libs.torch_lib.registration", "default_registry")
    keys = {_key(name) for name, _ in onnxscript_reg.items() if not name.startswith("internal::")}
    keys |= {_target_key(m.fx_target) for m in _torch_metas() if m.opset_introduced <= opset}
    return frozenset(keys)


@lru_cache(maxsize=1)
def _torch_metas() -> tuple[Any, ...]:
    with quiet_converter():
        return tuple(pinned("torch.onnx._internal.exporter._torchlib._torchlib_registry", "get_torchlib_ops")())


def translatable(target: Any, opset: int | None = None) -> bool:
    """Whether torchlib translates ``target`` (what ``ONNXRegistry.from_torchlib().is_registered`` says)."""
    try:
        opset = opset or pinned("torch.onnx._internal.exporter._constants", "TORCHLIB_OPSET")
        keys = _registered_keys(opset)
    except (ImportError, AttributeError):   # registries moved: ask torch.onnx's own (slow) registry
        return _full_registry().is_registered(target)
    return _target_key(target) in keys


@lru_cache(maxsize=1)
def _full_registry() -> Any:
    with quiet_converter():
        return pinned("torch.onnx._internal.exporter._registration", "ONNXRegistry").from_torchlib()


def graph_registry(targets: set[Any], opset: int) -> Any:
    """An ``ONNXRegistry`` holding only ``targets``' torchlib functions (same order and opset rule as
    ``from_torchlib``), so only those functions are parsed."""
    reg_mod = "torch.onnx._internal.exporter._registration"
    registry = pinned(reg_mod, "ONNXRegistry")()
    registry._opset_version = opset
    wanted = {_target_key(t) for t in targets}
    for meta in _torch_metas():
        if _target_key(meta.fx_target) in wanted:
            registry._register(meta.fx_target, meta)
    decomp_meta, get_overload = pinned(reg_mod, "OnnxDecompMeta"), pinned(reg_mod, "_get_overload")
    onnxscript_reg = pinned("onnxscript.function_libs.torch_lib.registration", "default_registry")
    for name, funcs in onnxscript_reg.items():
        if name.startswith("internal::") or _key(name) not in wanted:
            continue
        target = get_overload(name)
        if target is None:
            continue
        for func, is_complex in [(f, False) for f in funcs.overloads] + [(f, True) for f in funcs.complex]:
            registry._register(target, decomp_meta(onnx_function=func, fx_target=target, signature=None,
                                                   is_custom=False, is_complex=is_complex))
    registry._cleanup_registry_based_on_opset_version()
    return registry


class Translatable:
    """The set of ops torchlib translates, as ``create_onnx_friendly_decomposition_table`` asks it."""

    def __init__(self, opset: int) -> None:
        self.opset = opset

    def __contains__(self, target: Any) -> bool:
        return translatable(target, self.opset)
