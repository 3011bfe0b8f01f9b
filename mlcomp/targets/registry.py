"""Targets by name: the ``TARGETS`` table, ``TargetName``, ``get_target`` and ``available_targets``.

    >>> from mlcomp.targets.registry import get_target, target_name
    >>> target_name("ort")
    <TargetName.ONNXRUNTIME: 'onnxruntime'>
    >>> get_target("ort")                     # imports mlcomp.targets.onnx.target now
    <Target onnxruntime>
    >>> get_target("onnxruntme")
    Traceback (most recent call last):
    mlcomp.base.errors.TargetUnavailableError: there is no target named 'onnxruntme' (did you mean 'onnxruntime'?). ...

A target's own options follow its name in the one spec grammar (:mod:`mlcomp.base.spec`), read
into the target class's ``Options`` dataclass; ``spec`` is the canonical text::

    >>> t = get_target("tvm{kernels=off}")
    >>> t.name, t.spec, t.settings.kernels
    ('tvm', 'tvm{kernels=off}', 'off')
    >>> get_target("tvm{kernels=none}")
    Traceback (most recent call last):
    mlcomp.targets.options.OptionsError: bad target spec at column 13 of 'tvm{kernels=none}' (at 'none}'): ...

This module sits below both :mod:`mlcomp.targets.base` (what a target is) and
:mod:`mlcomp.runtime.artifact` (what a target builds), and imports neither at
run time: an artifact looks up the target its payload needs here when it is
loaded, and ``base`` builds artifacts, so keeping the table apart is what lets
both import it at module level without a cycle::

    artifact ──▶ registry ◀── base ──▶ artifact       (all at module level)

Each target class is imported on first use from its ``"module:Class"``
reference, so ``import mlcomp.targets`` never imports tvm or onnxruntime.
``mlcomp.targets.base`` re-exports every public name here, so
``from mlcomp.targets.base import get_target, TARGETS`` keeps working.
"""
from __future__ import annotations

import enum
from functools import lru_cache
from typing import TYPE_CHECKING

from mlcomp.base.errors import TargetUnavailableError
from mlcomp.base.registry import LazyRegistry
from mlcomp.base.spec import Grammar, SpecEntry, SpecItem
from mlcomp.targets.options import OptionsError

if TYPE_CHECKING:   # annotations only: nothing from base runs when this module is imported
    from mlcomp.targets.base import Target

__all__ = ["TargetName", "TARGETS", "TARGET_GRAMMAR", "target_list", "target_name", "get_target", "split_targets",
           "available_targets"]


class TargetName(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"
    ONNXRUNTIME = "onnxruntime"
    TVM = "tvm"
    DISTRIBUTED = "distributed"
    OPENVINO = "openvino"

    @property
    def implementation(self) -> str:
        return str(TARGETS.ref(self.value))


def _unknown_target(name: str, close: str | None) -> TargetUnavailableError:
    return TargetUnavailableError(
        f"there is no target named {name!r}" + (f" (did you mean {close!r}?)" if close else ""),
        hint=f"choose one of: {', '.join(t.value for t in TargetName)}")


# target name -> "module:Class"; the class is imported on first use
TARGETS: LazyRegistry[type[Target]] = LazyRegistry("target", {
    "cpu": "mlcomp.targets.torch.cpu:CpuTarget", "cuda": "mlcomp.targets.torch.cuda:CudaTarget",
    "onnxruntime": "mlcomp.targets.onnx.target:OnnxRuntimeTarget", "tvm": "mlcomp.targets.tvm.target:TvmTarget",
    "distributed": "mlcomp.targets.distributed.target:DistributedTarget",
    "openvino": "mlcomp.targets.openvino.target:OpenVinoTarget",
}, on_unknown=_unknown_target)

_ALIASES = {"ort": TargetName.ONNXRUNTIME, "onnx": TargetName.ONNXRUNTIME, "torchscript": TargetName.CPU}


def target_list() -> str:
    """Every target for help texts, aliases in parentheses: ``cpu (torchscript), cuda, onnxruntime (ort, onnx), …``."""
    aliases: dict[TargetName, list[str]] = {}
    for alias, name in _ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    return ", ".join(t.value + (f" ({', '.join(aliases[t])})" if t in aliases else "") for t in TargetName)


def target_name(name: str | TargetName) -> TargetName:
    """``name`` as a :class:`TargetName` (aliases ``ort``, ``onnx``, ``torchscript`` accepted)."""
    if isinstance(name, TargetName):
        return name
    key = str(name).strip().lower()
    if key in _ALIASES:
        return _ALIASES[key]
    TARGETS.ref(key)   # raises with did-you-mean if unknown
    return TargetName(key)


TARGET_GRAMMAR = Grammar("target", OptionsError, fold_case=True,
                         hint="write a target as its name, or name{key=value ...} for its own options, "
                              "e.g. tvm{kernels=off}")


def get_target(name: str | TargetName) -> Target:
    """The target called ``name`` (``cpu``, ``cuda``, ``onnxruntime``/``ort``, ``tvm``), or the target
    a spec with options names (``tvm{kernels=off}``): a separate instance carrying those options."""
    if isinstance(name, str) and "{" in name:
        item = TARGET_GRAMMAR.one(name, TARGET_GRAMMAR.parse(name.strip(), _spec_entry))
        return _configured(item) if item.options else _instance(TargetName(item.name))
    return _instance(target_name(name))


def split_targets(text: str) -> list[str]:
    """A comma-separated list of targets, each a name or a spec with options (commas inside braces kept)::

        >>> split_targets("cpu, tvm{kernels=off}, ort")
        ['cpu', 'tvm{kernels=off}', 'onnxruntime']
    """
    return [item.text for item in TARGET_GRAMMAR.parse(text.strip(), _spec_entry)]


def _spec_entry(name: str) -> SpecEntry:
    cls = TARGETS.get(target_name(name).value)
    return SpecEntry.of(cls.name, cls.Options, TARGET_GRAMMAR)


@lru_cache(maxsize=None)
def _configured(item: SpecItem) -> Target:
    target = TARGETS.get(item.name)()
    target.spec_item = item
    return target


@lru_cache(maxsize=None)
def _instance(name: TargetName) -> Target:
    return TARGETS.get(name.value)()


def available_targets() -> dict[str, str | None]:
    """Every target → ``None`` if usable here, else the reason it is not."""
    return {t.value: get_target(t).available() for t in TargetName}
