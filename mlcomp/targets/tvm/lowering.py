"""The steps of a TVM build that are not decisions: the LLVM/CUDA target, torch.export to Relax, clean-up,
lowering to TIR and the default schedules.

Flow (:func:`mlcomp.targets.tvm.build.build` runs them): ``torch.export.export`` ->
``tvm.relax.frontend.torch.from_exported_program`` (``keep_params_as_input=False``: weights become
Relax constants, so the exported ``model.so`` needs no torch model) -> :func:`prepare` (BatchNorm folded
into conv weights, ops decomposed, constants folded) -> the offload to torch's kernels (a decision of
:mod:`~mlcomp.targets.tvm.offload.policy`) -> :func:`lower_to_tir` (legalize + fuse) ->
:func:`default_schedules` for what MetaSchedule did not schedule.  Shapes are static.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from mlcomp.hardware.probe import vector_bits
from mlcomp.targets.tvm.row_reduction import as_reductions, row_reductions
from mlcomp.targets.tvm.schedules import default_rules, parallel_loops, schedule_counts

__all__ = ["IMPORTED_AS_IS", "convert_map_keys", "core_aten_only", "default_schedules", "host_llvm_target",
           "importer_ops", "lower_to_tir", "make_target", "prepare", "to_relax"]


def host_llvm_target(num_cores: int | None = None) -> dict:
    """LLVM target dict for this host: ``-mcpu`` from LLVM's host CPU name, cores from psutil."""
    import tvm

    mcpu = "x86-64"
    try:
        name = str(tvm.get_global_func("tvm.codegen.llvm.GetHostCPUName")())
        if name and name != "generic":
            mcpu = name
    except Exception:  # pragma: no cover - runtime without LLVM
        pass
    if num_cores is None:
        try:
            import psutil

            num_cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        except ImportError:  # pragma: no cover
            num_cores = os.cpu_count() or 1
    return {"kind": "llvm", "mcpu": mcpu, "num-cores": int(num_cores)}


def make_target(device: str):
    import tvm

    if device == "cpu":
        return tvm.target.Target(host_llvm_target())
    if device == "cuda":
        arch = tvm.cuda(0).compute_version.replace(".", "")
        return tvm.target.Target({"kind": "cuda", "arch": f"sm_{arch}"}, host=host_llvm_target())
    raise ValueError(f"unsupported device {device!r} (expected 'cpu' or 'cuda')")


def prepare(mod, target):
    """Graph clean-up on Relax: BatchNorm folded into conv weights, ops decomposed, constants folded
    (:mod:`~mlcomp.targets.tvm.const_fold` first: numpy, not an LLVM build per op), then
    the per-channel arithmetic left after a conv (a BatchNorm behind a conv's bias) folded into its weight
    (:func:`~mlcomp.targets.tvm.offload.affine.fold_affine`), and products over one term as multiplies
    (:mod:`~mlcomp.targets.tvm.unit_k`)."""
    import tvm
    from tvm import relax
    from tvm.relax.transform.fold_batch_norm_to_conv2d_for_inference import FoldBatchnormToConv2D

    from mlcomp.targets.tvm.const_fold import fold_constants_module
    from mlcomp.targets.tvm.offload.affine import fold_affine_module
    from mlcomp.targets.tvm.unit_k import unit_k_matmuls

    seq = [FoldBatchnormToConv2D(), relax.transform.DecomposeOpsForInference(),
           relax.transform.CanonicalizeBindings()]
    with target:
        mod, _ = fold_constants_module(tvm.transform.Sequential(seq)(mod))     # the weight arithmetic, in numpy
        return unit_k_matmuls(fold_affine_module(relax.transform.FoldConstant()(mod)))


def lower_to_tir(mod, target):
    """Legalize + fuse to TIR (what ``zero_pipeline`` does before tuning); on CPU the row reductions
    :mod:`~mlcomp.targets.tvm.row_reduction` schedules fuse with the elementwise ops before them
    (:func:`~mlcomp.targets.tvm.row_reduction.as_reductions`)."""
    import tvm
    from tvm import relax

    fuse = [relax.transform.FoldConstant(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    with target:
        mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()])(mod)
        if target.kind.name == "llvm":
            mod, _ = as_reductions(mod, vector_bits())
        return tvm.transform.Sequential(fuse)(mod)


def default_schedules(mod, target, stats: dict, *, parallel: bool = True):
    """Default schedules (DLight GEMV/Reduction, mlcomp's ParallelVector) for what is not yet scheduled.

    ``parallel=False``: no parallel loops (the module calls torch's kernels, which own the cores).
    """
    from tvm.s_tir import dlight as dl

    bits = vector_bits()
    with target:
        mod = dl.ApplyDefaultSchedule(*default_rules(target, bits, parallel=parallel))(mod)
    stats["schedules"] = dict(schedule_counts(mod), vector_bits=bits, parallel=parallel)
    if target.kind.name == "llvm":
        stats["schedules"].update(parallel_loops=parallel_loops(mod), row_reductions=row_reductions(mod))
    return mod


def to_relax(module, example_inputs, dynamic_shapes=None) -> tuple[Any, int]:
    """``module`` as an ExportedProgram (:func:`exported_program`) to Relax; (module, outputs).

    With ``dynamic_shapes`` (``torch.export`` Dims) each symbolic size is a ``tir.Var`` of the Relax
    function's signature (``R.Tensor((batch, seq, 8))``) and its arithmetic stays in the module.
    """
    from tvm.relax.frontend.torch import from_exported_program

    from mlcomp.targets.tvm.converters import CONVERTERS

    ep = exported_program(module, example_inputs, dynamic_shapes)
    skip_empty_cat_inputs(ep)
    n_out = len(ep.graph_signature.user_outputs)
    # a single output comes back as a bare tensor: saves unpacking a tvm-ffi Array per call
    return from_exported_program(ep, keep_params_as_input=False, unwrap_unit_return_tuple=n_out == 1,
                                 custom_convert_map=CONVERTERS, run_ep_decomposition=not core_aten_only(ep)), n_out


def exported_program(module, example_inputs, dynamic_shapes=None):
    """``module`` as a ``torch.export.ExportedProgram``: its own graph when it is one of core ATen calls on
    static shapes (:func:`program_of`, no trace), else ``torch.export.export`` in eval mode (its training
    flag restored)."""
    import torch

    if dynamic_shapes is None:
        ep = program_of(module, example_inputs)
        if ep is not None:
            return ep
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return torch.export.export(module, tuple(example_inputs), dynamic_shapes=dynamic_shapes)
    finally:
        module.train(was_training)


def program_of(module, example_inputs):
    """``module``'s graph as the ExportedProgram ``torch.export`` traces from it, or None.

    For a ``GraphModule`` in eval mode whose calls are all core ATen ops (or tuple picks) on its buffers,
    parameters and inputs, and which returns a tuple of them (mlcomp's generated modules), the trace
    would give the same calls: here each constant becomes a lifted input (``b_``/``p_`` placeholders,
    then the user inputs, named as export names them) and every value's ``meta["val"]`` a fake tensor
    propagated through the ops' meta kernels, as export's are.  O(nodes).
    """
    import operator

    import torch
    from torch import fx
    from torch._subclasses import fake_tensor as fake
    from torch.export.graph_signature import InputKind, InputSpec, TensorArgument
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    if not isinstance(module, fx.GraphModule) or module.training:
        return None
    lifted = {**{n: ("p_", InputKind.PARAMETER, t) for n, t in module.named_parameters()},
              **{n: ("b_", InputKind.BUFFER, t) for n, t in module.named_buffers()}}
    nodes = list(module.graph.nodes)
    calls = [n for n in nodes if n.op == "call_function"]
    out = nodes[-1].args[0] if nodes and nodes[-1].op == "output" else None
    if (any(n.op not in ("placeholder", "get_attr", "call_function", "output") for n in nodes)
            or any(n.op == "get_attr" and n.target not in lifted for n in nodes)
            or any(n.target is not operator.getitem and str(n.target) not in IMPORTED_AS_IS
                   and not _traced_as_is(n.target) for n in calls)
            or not isinstance(out, tuple) or not all(isinstance(o, fx.Node) for o in out)):
        return None
    graph, env, specs, state = fx.Graph(), {}, [], {}
    mode = fake.FakeTensorMode()
    values = []
    for target in dict.fromkeys(n.target for n in nodes if n.op == "get_attr"):
        prefix, kind, tensor = lifted[target]
        ph = graph.placeholder(prefix + target.replace(".", "_"))
        specs.append(InputSpec(kind, TensorArgument(ph.name), target=target, persistent=True if kind is
                               InputKind.BUFFER else None))
        state[target], env[target] = tensor, ph
        values.append(mode.from_tensor(tensor))
    inputs = [n for n in nodes if n.op == "placeholder"]
    for node, x in zip(inputs, example_inputs):
        env[node] = graph.placeholder(node.name)
        specs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(node.name), target=None))
        values.append(mode.from_tensor(x))
    for node in calls:
        env[node] = graph.node_copy(node, lambda a: env[a.target] if a.op == "get_attr" else env[a])
    graph.output(tuple(env[o.target] if o.op == "get_attr" else env[o] for o in out))
    traced = fx.GraphModule(torch.nn.Module(), graph)
    try:
        with mode:
            FakeTensorProp(traced, mode).propagate_dont_convert_inputs(*values)
    except (fake.UnsupportedOperatorException, fake.DataDependentOutputException,
            fake.DynamicOutputShapeException):
        return None        # a value its meta kernel cannot give: left to torch.export
    return _program(traced, specs, state, example_inputs)


def _program(traced, specs, state, example_inputs):
    """The ExportedProgram of ``traced`` (lifted inputs first, a tuple out) with these input specs."""
    import torch.utils._pytree as pytree
    from torch.export import ExportedProgram
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import ExportGraphSignature, OutputKind, OutputSpec, TensorArgument

    outs = list(traced.graph.output_node().args[0])
    signature = ExportGraphSignature(specs, [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name), target=None)
                                             for o in outs])
    call = ModuleCallSignature(inputs=[], outputs=[], in_spec=pytree.tree_flatten((tuple(example_inputs), {}))[1],
                               out_spec=pytree.tree_flatten(tuple(outs))[1])
    return ExportedProgram(root=traced, graph=traced.graph, graph_signature=signature, state_dict=state,
                           range_constraints={}, module_call_graph=[ModuleCallEntry("", call)], constants={})


def core_aten_only(ep) -> bool:
    """Whether every op of ``ep``'s graph is a core ATen op (tagged ``core``: functional, nothing to decompose).

    mlcomp's IR is core ATen already, so its re-export usually is: then the importer's own
    ``run_decompositions`` (a second trace of the whole program) would change nothing and is skipped.
    Ops of :data:`IMPORTED_AS_IS` count as core too; any other op (an in-place op, a size query of a
    dynamic shape) keeps the decomposition.
    """
    import operator

    for node in ep.graph_module.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or str(node.target) in IMPORTED_AS_IS:
            continue
        if not _core(node.target):
            return False
    return True


def _core(target) -> bool:
    import torch

    return isinstance(target, torch._ops.OpOverload) and torch.Tag.core in target.tags


def _traced_as_is(target) -> bool:
    """Whether ``torch.export`` records a call of ``target`` as that call: a core ATen op without a
    composite (traced-through) implementation."""
    import torch

    return _core(target) and not target.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


# non-core ops the importer converts directly to what their decomposition would give it (``reshape`` is
# ``view`` or a copy then ``view``: the same values, one ``relax.reshape`` either way)
IMPORTED_AS_IS = frozenset({"aten.reshape.default"})


def skip_empty_cat_inputs(ep) -> None:
    """Drop 1-D empty inputs of each ``aten.cat`` of ``ep``'s graph, in place (HF GPT-2's cache).

    ``torch.cat`` skips tensors of shape ``(0,)`` whatever the others' rank (HF's ``DynamicCache``
    starts each layer's keys/values as ``torch.tensor([])``); TVM's Relax importer concatenates them
    and rejects the rank mismatch ("Concat … ndim 1 and 4").  Without them the cat is the same value.
    """
    import torch

    for node in ep.graph_module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.cat.default:
            empty = [a for a in node.args[0] if getattr(getattr(a, "meta", {}).get("val"), "shape", None) == (0,)]
            if empty and len(empty) < len(node.args[0]):
                node.args = ([a for a in node.args[0] if a not in empty], *node.args[1:])


# where TVM's ExportedProgram importer lists the ops it converts
_IMPORTER_FILE = ("relax", "frontend", "torch", "exported_program_translator.py")
_IMPORTER_CLASS, _MAP_METHOD = "ExportedProgramImporter", "create_convert_map"


@lru_cache(maxsize=1)
def importer_ops() -> frozenset[str]:
    """The op keys (``"add.Tensor"``, ``"linear.default"``, …) TVM's ExportedProgram importer converts.

    Read from the installed importer's source (:func:`convert_map_keys`) without importing ``tvm``
    (most of a build's import time; a support check needs only the keys), so it is the installed
    version's table; when the source does not have the one form read, from the importer itself.
    """
    spec = importlib.util.find_spec("tvm")
    if spec is not None and spec.origin is not None:
        source = Path(spec.origin).parent.joinpath(*_IMPORTER_FILE)
        found = convert_map_keys(source.read_text()) if source.is_file() else None
        if found is not None:
            return found
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    return frozenset(ExportedProgramImporter().create_convert_map())


def convert_map_keys(source: str) -> frozenset[str] | None:
    """The keys of ``ExportedProgramImporter.create_convert_map`` in ``source``, when that method is
    imports and one ``return {...}`` of literal string keys (so the keys are all it can return); else None.

        >>> sorted(convert_map_keys("class ExportedProgramImporter:\\n def create_convert_map(self):\\n"
        ...                         "  import operator\\n  return {'relu.default': f, 'add.Tensor': g}"))
        ['add.Tensor', 'relu.default']
        >>> convert_map_keys("class ExportedProgramImporter:\\n def create_convert_map(self):\\n"
        ...                  "  m = {'relu.default': f}\\n  m.update(more)\\n  return m") is None
        True
    """
    methods = [f for c in ast.parse(source).body if isinstance(c, ast.ClassDef) and c.name == _IMPORTER_CLASS
               for f in c.body if isinstance(f, ast.FunctionDef) and f.name == _MAP_METHOD]
    if len(methods) != 1:
        return None
    *head, last = methods[0].body
    plain = all(isinstance(s, (ast.Import, ast.ImportFrom)) or (isinstance(s, ast.Expr) and isinstance(
        s.value, ast.Constant)) for s in head)
    if not plain or not isinstance(last, ast.Return) or not isinstance(last.value, ast.Dict):
        return None
    keys = last.value.keys
    if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in keys):
        return None             # a ** splat (key None) or a computed key
    return frozenset(k.value for k in keys)
