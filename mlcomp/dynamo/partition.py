"""One ATen graph through mlcomp, region by region: what mlcomp's IR holds compiles, the rest runs in torch.

An FX node joins a compiled region when mlcomp's IR can represent it (an ATen, prims or
``torch.library`` op, ``getitem``, size arithmetic); anything else (a higher-order op such as
``torch.cond``, a Python callable) stays in the torch graph between regions.  Regions are
the largest acyclic groups of such nodes (torch's capability-based partitioner).  Each
region is captured from FX (:func:`mlcomp.frontend.capture.from_fx`), run through the
pipeline and the target, and verified against the region itself on the example inputs; a
region that fails any step runs in torch instead and the report says why.  Inside a region,
ops the target declines run in the target's own eager regions (``fallback="eager"``).

Tensors listed in ``constants`` (parameters, when inference freezes them) enter the IR as
``PARAM`` nodes, so passes may fold them; the compiled region takes the other inputs only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
import warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from mlcomp.api.compiler import compile_model, open_cache
from mlcomp.base.errors import MlcompError
from mlcomp.dynamo.options import BY_RULE, BackendOptions
from mlcomp.dynamo.report import TORCH, BackendReport, Partition
from mlcomp.dynamo.symbols import bind_examples, name_dimensions
from mlcomp.dynamo.target_rule import pick_target
from mlcomp.frontend.capture import from_fx
from mlcomp.frontend.provenance import first_line
from mlcomp.frontend.source import ModelSource
from mlcomp.ir.ops import Op
from mlcomp.targets.registry import get_target

__all__ = ["KEPT_IN_TORCH", "compile_regions", "direct_call", "outside_dynamo", "representable"]

# ops the IR could name but whose work is torch's: runtime asserts about sizes (no tensor, no meta)
KEPT_IN_TORCH = frozenset({torch.ops.aten._assert_scalar.default, torch.ops.aten._assert_async.msg})


def representable(node: torch.fx.Node) -> bool:
    """Whether mlcomp's IR holds this node's op (a call of an ATen/library op, ``getitem``, size arithmetic)."""
    if node.op != "call_function" or node.target in KEPT_IN_TORCH:
        return False
    try:
        Op.from_torch(node.target)
    except KeyError:
        return False
    return True


class _IRSupport(OperatorSupportBase):
    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        return representable(node)


class CompiledRegion(torch.nn.Module):
    """A region's artifact in place of its FX submodule: takes the region's inputs, drops its constants."""

    def __init__(self, artifact: Any, keep: Sequence[int], tuple_out: bool) -> None:
        super().__init__()
        self.artifact, self.keep, self.tuple_out = artifact, list(keep), tuple_out

    def forward(self, *args: Any) -> Any:
        out = self.artifact(*[args[i] for i in self.keep])
        if self.tuple_out:
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return out


def compile_regions(gm: torch.fx.GraphModule, inputs: Sequence[torch.Tensor], *, constants: Mapping[int, str],
                    opts: BackendOptions, report: BackendReport, graph_name: str) -> torch.fx.GraphModule:
    """``gm`` with each region that mlcomp compiled replaced by a :class:`CompiledRegion`.

    ``inputs``: real tensors, one per placeholder of ``gm``; ``constants``: placeholder
    index → module path of the inputs to freeze into the IR.
    """
    partitioner = CapabilityBasedPartitioner(gm, _IRSupport(), allows_single_node_partition=True)
    parts = partitioner.propose_partitions()
    fused = partitioner.fuse_partitions(parts, prefix="region_") if parts else gm
    skipped = [n for n in fused.graph.nodes if n.op == "call_function" and not representable(n)]
    for node in skipped:
        report.add(Partition(graph_name, node.name, TORCH, nodes=1,
                             reason=f"{getattr(node.target, '__name__', node.target)} is not an op of mlcomp's IR"))
    placeholders = [n.name for n in fused.graph.nodes if n.op == "placeholder"]
    frozen = {placeholders[i]: name for i, name in constants.items()}
    tensors = {placeholders[i]: inputs[i] for i in constants}
    seen = _region_inputs(fused, inputs)
    for name, args in seen.items():
        sub = getattr(fused, name)
        part = Partition(graph_name, name, TORCH, nodes=sum(1 for n in sub.graph.nodes
                                                           if n.op == "call_function"))
        start = time.perf_counter()
        try:
            with outside_dynamo():
                setattr(fused, name, _compile_one(sub, args, frozen, tensors, opts, part))
            part.ran_on = f"mlcomp:{part.ran_on}"
        except MlcompError as exc:
            part.ran_on, part.reason = TORCH, exc.message.split("\n")[0]
        except Exception as exc:  # noqa: BLE001 - a failure inside mlcomp costs this region, not the model
            part.ran_on, part.reason = TORCH, f"mlcomp failed: {type(exc).__name__}: {first_line(exc)[:200]}"
            warnings.warn(f"mlcomp backend: {graph_name} {name} runs in torch ({part.reason})", stacklevel=2)
        part.seconds = time.perf_counter() - start
        report.add(part)
    fused.recompile()
    return fused


def direct_call(fused: torch.fx.GraphModule) -> Callable[..., Any]:
    """``fused`` itself, or, when it is one compiled region taking every input in order, that region's artifact.

    The common case (mlcomp compiled the whole graph) then skips the FX interpreter's call
    and its ``getitem`` nodes; the result has the same outputs as ``fused``.
    """
    nodes = list(fused.graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    calls = [n for n in nodes if n.op == "call_module"]
    rest = [n for n in nodes if n.op not in ("placeholder", "call_module", "output")]
    if len(calls) != 1 or list(calls[0].args) != inputs or calls[0].kwargs:
        return fused
    region = getattr(fused, str(calls[0].target))
    out = nodes[-1].args[0]
    if not isinstance(region, CompiledRegion) or not isinstance(out, (tuple, list)):
        return fused
    if not region.tuple_out and list(out) == [calls[0]] and not rest:
        run_one = region.artifact
        return lambda *xs: (run_one(*[xs[i] for i in region.keep]),)
    picks = [n.args[1] if n.op == "call_function" and n.target is operator.getitem and n.args[0] is calls[0]
             else None for n in out]
    if region.tuple_out and picks == list(range(len(out))) and len(rest) == len(out):
        return lambda *xs: tuple(region(*xs))
    return fused


@contextlib.contextmanager
def outside_dynamo() -> Iterator[None]:
    """No tracing context and no fake mode while mlcomp compiles a region.

    A target that exports through ``torch.export`` (ONNX's fallback exporter) runs Dynamo
    itself; inside the outer compile it would add its guards to the outer graph's.
    """
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with tracing(None), unset_fake_temporarily():
        yield


def _region_inputs(fused: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]) -> dict[str, tuple[Any, ...]]:
    """The real arguments each region submodule receives on ``inputs`` (one run of the graph in torch)."""
    seen: dict[str, tuple[Any, ...]] = {}

    class Record(torch.fx.Interpreter):
        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            seen[str(target)] = tuple(args)
            return super().call_module(target, args, kwargs)

    with torch.no_grad():
        Record(fused).run(*inputs)
    return seen


def _compile_one(sub: torch.fx.GraphModule, args: tuple[Any, ...], frozen: Mapping[str, str],
                 tensors: Mapping[str, torch.Tensor], opts: BackendOptions, part: Partition) -> CompiledRegion:
    """Capture, pipeline, target and verification of one region; raises MlcompError if any step fails."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    constant_of = {p.name: frozen[p.name] for p in placeholders if p.name in frozen}
    keep = [i for i, p in enumerate(placeholders) if p.name not in constant_of]
    if any(not isinstance(args[i], torch.Tensor) for i in keep):
        raise MlcompError(f"region {part.name} takes a size, not only tensors", hint="it runs in torch")
    own = {constant_of[p.name]: tensors[p.name] for p in placeholders if p.name in constant_of}
    graph = from_fx(sub.graph, name=f"{part.graph}_{part.name}", training=False, constant_of=constant_of,
                    tensors=own)
    user_args = tuple(args[i] for i in keep)
    graph = name_dimensions(bind_examples(graph, user_args), opts.dynamic)
    source = ModelSource(graph.name, _bound(sub, args, keep), user_args)
    if opts.target == BY_RULE:
        chosen, part.picked = pick_target(graph, lambda name: get_target(name).available() is None)
        opts = dataclasses.replace(opts, target=chosen)
    result = compile_model(source, graph, pipeline=opts.pipeline_spec(), verify=opts.verify,
                           cache=open_cache(opts.cache), **opts.target_args(), **opts.compile_options)
    if result.check is not None and not result.check.passed:
        raise MlcompError(f"region {part.name} differs from torch on the example inputs: "
                          f"{result.check.summary()}", hint="it runs in torch")
    art = result.artifact
    part.ran_on = art.target
    part.cache = result.cache.status.value if result.cache is not None else None
    part.regions = list(art.manifest.get("fallback_regions") or [])
    part.pipeline = art.manifest.get("pipeline")
    part.sizes = dict(art.manifest.get("ranges") or {})
    part.picked = _auto_note(art.manifest.get("auto")) or part.picked
    outputs = [n for n in sub.graph.nodes if n.op == "output"][0].args[0]
    return CompiledRegion(art, keep, tuple_out=isinstance(outputs, (tuple, list)))


def _auto_note(auto: Any) -> str | None:
    """``auto: onnxruntime 0.455 ms, cpu 0.761, openvino 0.893``: the auto target's candidates, picked first."""
    if not auto:
        return None
    rows = sorted(auto.get("candidates", ()), key=lambda c: (not c.get("picked"), c.get("median_ms") is None,
                                                             c.get("median_ms") or 0.0))
    cells = [c["target"] + (f" {c['median_ms']:.3g}" if c.get("median_ms") is not None else
                            " (recorded pick)" if c.get("picked") else " (not timed)" if c.get("verified")
                            else " (declined)") for c in rows]
    return "auto: " + ", ".join(cells) + " ms"


def _bound(sub: torch.fx.GraphModule, args: tuple[Any, ...], keep: Sequence[int]) -> Callable[..., Any]:
    """The region in torch as a function of its kept inputs (frozen ones bound): the verification reference."""
    def run(*xs: Any) -> Any:
        full = list(args)
        for i, x in zip(keep, xs):
            full[i] = x
        return sub(*full)
    return run

