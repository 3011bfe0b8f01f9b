"""What a loaded model is: :class:`ModelSource` (a model ready for capture) and :class:`InputSpec`.

:mod:`mlcomp.frontend.loading` turns what the user names into a :class:`ModelSource`;
:meth:`ModelSource.capture` hands it to :mod:`mlcomp.frontend.capture`.  A TorchScript
module is traced at the dispatcher level, after checking that no branch reads a tensor's value.
"""
from __future__ import annotations

import contextlib
import gc
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from mlcomp.base.errors import CaptureError, InputSpecError
from mlcomp.base.quiet import quiet_torch
from mlcomp.frontend.cache_outputs import PlainCacheOutputs, flat_caches
from mlcomp.frontend.capture import CaptureMethod, capture_exported, capture_module, capture_traced
from mlcomp.frontend.dynamic import name_symbols, parse_dynamic
from mlcomp.frontend.programs import dynamic_batch_program, static_program, trainable_torchscript
from mlcomp.frontend.script_inputs import check_script_inputs
from mlcomp.ir import Graph, dtype_name, parse_dtype
from mlcomp.models import random_tensor

__all__ = ["INPUT_SPEC_FILE", "InputSpec", "ModelSource", "collector_paused", "graph_random_inputs"]

INPUT_SPEC_FILE = "mlcomp_inputs.json"   # stored inside TorchScript archives by `models save`


@dataclass(frozen=True)
class InputSpec:
    """Shape and dtype of one input, e.g. parsed from ``1x3x32x32:f32`` (any name ``parse_dtype`` knows)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @classmethod
    def parse(cls, text: str) -> "InputSpec":
        shape_text, _, dtype_text = text.strip().partition(":")
        if not re.fullmatch(r"\d+(x\d+)*", shape_text.strip()):
            raise InputSpecError(f"--input-shape {text!r} is not of the form 1x3x32x32[:f32]",
                                 hint="give sizes separated by 'x', optionally ':dtype'")
        try:
            dtype = parse_dtype(dtype_text) if dtype_text else torch.float32
        except ValueError as exc:
            raise InputSpecError(f"--input-shape {text!r}: {exc}") from None
        return cls(tuple(int(s) for s in shape_text.split("x")), dtype)

    @classmethod
    def of(cls, t: torch.Tensor) -> "InputSpec":
        return cls(tuple(t.shape), t.dtype)

    def random(self, generator: torch.Generator | None = None) -> torch.Tensor:
        return random_tensor(self.shape, self.dtype, generator)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "InputSpec":
        return cls(tuple(int(s) for s in d["shape"]), parse_dtype(d["dtype"]))

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + ":" + dtype_name(self.dtype)


@dataclass
class ModelSource:
    """A loaded model, ready for capture; ``eager`` is the reference for verification."""

    name: str
    eager: Any                                  # nn.Module, ScriptModule or ExportedProgram module
    example_inputs: tuple[torch.Tensor, ...] | None
    path: str | None = None
    exported: Any = None                        # torch.export.ExportedProgram when loaded from .pt2
    kind: str = "module"                        # module | torchscript | exported | zoo
    notes: list[str] = field(default_factory=list)
    loss_fn: Any = None                         # a factory's loss_fn(output, target), for --train

    def trainable(self) -> Any:
        """The module a training capture takes: ``eager``, or for TorchScript its tensors as parameters."""
        if self.kind == "torchscript":
            return trainable_torchscript(self.eager, self.inputs(), name=self.name, path=self.path)
        return self.eager

    def inputs(self) -> tuple[torch.Tensor, ...]:
        if self.example_inputs is None:
            raise InputSpecError(f"{self.name} carries no input shapes",
                                 where=self.path or self.name,
                                 hint="pass --input-shape, e.g. --input-shape 1x3x32x32 (repeat per input)")
        return self.example_inputs

    def capture(self, *, method: str = "export", dynamic: Any = None, dynamic_batch: bool = False,
                training: bool = False, decompositions: Mapping[Any, Callable[..., Any]] | None = None) -> Graph:
        """The IR; ``decompositions`` (op overload → function) go over torch's default table (export only).

        ``dynamic``: the sizes kept symbolic (:func:`~mlcomp.frontend.dynamic.parse_dynamic`);
        ``dynamic_batch`` is ``dynamic="batch"``.  Python's cyclic garbage collector pauses meanwhile
        (:func:`collector_paused`).
        """
        with collector_paused():
            return self._capture(method, parse_dynamic(dynamic or dynamic_batch), training, decompositions)

    def _capture(self, method: str, dims: Any, training: bool,
                 decompositions: Mapping[Any, Callable[..., Any]] | None) -> Graph:
        if self.kind == "exported" and self.exported is not None and method == "export":
            if dims:
                ep = dynamic_batch_program(self.exported, self.inputs(), name=self.name, path=self.path, dims=dims)
                if ep is not self.exported:     # the reference at other sizes: the re-exported program
                    self.eager = ep.module()
            else:
                ep = static_program(self.exported, self.inputs(), name=self.name, path=self.path)
            return name_symbols(capture_exported(ep, name=self.name, training=training,
                                                 decompositions=decompositions), dims)
        if self.kind == "torchscript":
            return _capture_torchscript(self)
        with flat_caches() as caches:   # transformers cache outputs: their tensors become outputs
            graph = capture_module(PlainCacheOutputs.unwrap(self.eager), self.inputs(),
                                   method=CaptureMethod(method), dynamic=dims,
                                   training=training, name=self.name, decompositions=decompositions)
        note = caches.note()
        if note is not None and not isinstance(self.eager, PlainCacheOutputs):
            self.eager = PlainCacheOutputs(self.eager)    # the reference returns the same flat outputs
            self.notes.append(note)
        return graph


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration, then as it was (reference counting goes on).

    A capture (and a compile's builds) allocates many objects that stay (the modules of torch's exporter)
    and many that go by reference counting (fake tensors, FX nodes, sympy expressions); with the collector
    on, the allocations set off hundreds of collections that walk them to free next to nothing (decision
    57 has the figures).  On exit the objects made meanwhile join the oldest generation unwalked
    (``gc.freeze`` then ``gc.unfreeze``, unless the process keeps frozen objects of its own): the first
    young collection after it would walk them all; the next full collection walks them once, as it would
    have anyway, and frees the cyclic garbage made meanwhile.

        >>> with collector_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def graph_random_inputs(graph: Graph, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeded random tensors fitting the graph's inputs (symbolic sizes at their example values)."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(random_tensor(n.tensor_meta.concrete_shape(graph.symbols), n.tensor_meta.dtype, gen)
                 for n in graph.input_nodes)


def _capture_torchscript(source: ModelSource) -> Graph:
    """Trace a TorchScript module at the dispatcher level (no Python from the file runs).

    TorchScript keeps ``if``/``for`` as ``prim::If``/``prim::Loop``.  Tracing follows
    the branch the example takes, which is only correct when no condition depends
    on tensor *values*; :func:`_data_dependent_branch` checks that first.
    """
    module = source.eager
    branch = _data_dependent_branch(module)
    if branch is not None:
        raise CaptureError(
            f"TorchScript model {source.name} branches on the value of a tensor "
            "(data-dependent control flow); tracing it would silently fix one branch",
            where=f"{source.path}: {branch}",
            hint="rewrite the branch with torch.cond or torch.where before scripting, or export the model "
                 "with torch.export.save (.pt2)")
    from torch._export.converter import TS2EPConverter

    check_script_inputs(module, source.inputs(), name=source.name, path=source.path)   # count, dtype, rank
    with quiet_torch():
        try:  # TorchScript → ExportedProgram, then re-exported with the example's static shapes
            ep = TS2EPConverter(module, source.inputs()).convert()
            return capture_module(ep.module(), source.inputs(), name=source.name)
        except Exception:  # noqa: BLE001 - converter gaps (control flow): trace at dispatch level
            pass
    names = {t.data_ptr(): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}
    try:
        return capture_traced(module, source.inputs(), name=source.name, constant_names=names)
    except CaptureError:
        # a wrong input spec fails here too: say so (which input, what the model does with it)
        check_script_inputs(module, source.inputs(), name=source.name, path=source.path, run=True)
        raise


_VALUE_TO_SCALAR = {"aten::Bool", "aten::Int", "aten::Float", "aten::item", "aten::is_nonzero",
                    "aten::ScalarImplicit", "aten::__is__"}


def _data_dependent_branch(module: Any) -> str | None:
    """The first prim::If/Loop whose condition reads a tensor's value, described, or ``None``."""
    graphs = [module.graph]
    for m in module.modules():
        for meth in ("forward",):
            fn = getattr(m, meth, None)
            if fn is not None and hasattr(fn, "graph"):
                graphs.append(fn.graph)
    for g in graphs:
        for node in g.findAllNodes("prim::If", True) + g.findAllNodes("prim::Loop", True):
            conds = list(node.inputs())[:1] if node.kind() == "prim::If" else list(node.inputs())[1:2]
            stack, seen = [v.node() for v in conds], set()
            while stack:
                prod = stack.pop()
                if id(prod) in seen:
                    continue
                seen.add(id(prod))
                if prod.kind() in _VALUE_TO_SCALAR and prod.kind() != "aten::__is__" and any(
                        i.type().kind() == "TensorType" for i in prod.inputs()):
                    rng = node.sourceRange().strip().splitlines()
                    return f"{node.kind()} at {rng[0] if rng else '?'}"
                stack.extend(i.node() for i in prod.inputs())
    return None
