"""How a fused body becomes Python: in-place rewrites, cache tiles, a TorchScript loop.

:class:`KernelPlan` is what a :class:`~mlcomp.ir.composites.FusedKernel` runs.  It
generates two Python functions from the body (one overwriting dead intermediates
in place, one plain for autograd) and, for a large purely elementwise body, a
:class:`Tile` plan that runs the group tile by tile so each tile stays in cache::

    body: v0 = mul(a0, a1); v1 = add(v0, 1.0); v2 = relu(v1)
    plan = KernelPlan(body, "fused_mul_add_relu", Tiling())
    print(plan.source)
    def fused_mul_add_relu(a0, a1):
        v0 = _f0(a0, a1)                    # aten.mul.Tensor
        v1 = _f1(v0, 1.0)                   # aten.add_.Tensor: in place, v0 is dead
        v2 = _f2(v1)                        # aten.relu_.default
        return v2
    plan.tile                           # None below Tiling.min_elements outputs

Under ``torch.jit.trace`` a tiled body runs as a TorchScript loop (``_emit_script``)
so a frozen TorchScript module keeps the loop; under ``torch.export`` the plain
straight-line code is used.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mlcomp.ir import Graph, Ref, TensorMeta
from mlcomp.ir import opsets as P
from mlcomp.ir.ops import GETITEM, INPUT, Category, Op, category

__all__ = ["KernelPlan", "Tile", "Tiling"]


@dataclass(frozen=True)
class Tiling:
    """How an elementwise group is split into cache-sized tiles."""

    tile_elements: int = 1 << 16       # elements per tile (256 KiB of fp32)
    min_elements: int = 1 << 20        # only tile outputs at least this large


@dataclass(frozen=True)
class Tile:
    mode: str                             # "flat": 1-D tiles of the flattened tensors; "rows": dim 0
    shape: tuple[int, ...]                # every output's shape
    dtypes: tuple[torch.dtype, ...]       # every output's dtype
    full: tuple[bool, ...]                # per argument: sliced (True) or passed whole
    step: int
    arg_shapes: tuple[tuple[int, ...], ...]


class KernelPlan:
    def __init__(self, body: Graph, name: str, tiling: Tiling | None) -> None:
        self.body = body
        self.name = name
        self.outputs = [r.name for r in body.output_refs]
        self.single = len(self.outputs) == 1
        inplace = _inplace_choices(body) if body.mode.value == "inference" else {}
        self.source, self.fast = _emit_python(body, name, inplace)
        _, self.plain = _emit_python(body, name, {})
        self.tile = _tile_plan(body, tiling) if tiling is not None else None
        self._script: Any = None             # None: not tried; False: TorchScript refused the body

    def __call__(self, args: tuple[Any, ...]) -> Any:
        grad = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        fn = self.plain if grad else self.fast
        if self.tile is not None and not grad and self._tileable(args):
            if torch.jit.is_tracing():          # the trace records a call to a TorchScript loop
                scripted = self._scripted()
                if scripted is not None:
                    return scripted(*args)
            elif not torch.compiler.is_compiling():
                return self._run_tiles(fn, args)
        return fn(*args)

    def _tileable(self, args: tuple[Any, ...]) -> bool:
        tile = self.tile
        assert tile is not None
        with warnings.catch_warnings():         # traced sizes are compared once, at trace time
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            return self._fits(args, tile)

    @staticmethod
    def _fits(args: tuple[Any, ...], tile: "Tile") -> bool:
        for a, shape, full in zip(args, tile.arg_shapes, tile.full):
            if type(a) is not torch.Tensor or a.device.type != "cpu" or tuple(a.shape) != shape:
                return False
            if full and tile.mode == "flat" and not a.is_contiguous():
                return False
        return True

    def _run_tiles(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        tile = self.tile
        assert tile is not None
        outs = [torch.empty(tile.shape, dtype=dt, device=args[0].device) for dt in tile.dtypes]
        if tile.mode == "flat":
            parts = [a.reshape(-1) if full else (a.reshape(1) if a.dim() else a)
                     for a, full in zip(args, tile.full)]
            dest = [o.view(-1) for o in outs]
            n = math.prod(tile.shape)
        else:
            parts, dest, n = list(args), outs, tile.shape[0]
        for i in range(0, n, tile.step):
            m = min(tile.step, n - i)
            res = fn(*[p.narrow(0, i, m) if full else p for p, full in zip(parts, tile.full)])
            for d, r in zip(dest, (res,) if self.single else res):
                d.narrow(0, i, m).copy_(r)
        return outs[0] if self.single else tuple(outs)

    def _scripted(self) -> Any:
        if self._script is None:
            try:
                src = _emit_script(self.body, self.name, self.tile)
                self._script = getattr(torch.jit.CompilationUnit(src), "tiled")
            except Exception:  # noqa: BLE001 - TorchScript cannot type every body: run untiled
                self._script = False
        return self._script or None


def _tile_plan(body: Graph, tiling: Tiling) -> Tile | None:
    """Tiles for a purely elementwise body whose outputs share one large static shape."""
    if any(category(n.op) > Category.BROADCAST for n in body.call_nodes()):
        return None
    metas = [body.node(o).meta for o in (r.name for r in body.output_refs)]
    if not all(isinstance(m, TensorMeta) and not m.is_dynamic for m in metas):
        return None
    shape = tuple(metas[0].shape)
    if any(tuple(m.shape) != shape for m in metas) or math.prod(shape) < tiling.min_elements:
        return None
    ins = [n.meta for n in body.input_nodes]
    if not all(isinstance(m, TensorMeta) and not m.is_dynamic for m in ins):
        return None
    arg_shapes = tuple(tuple(m.shape) for m in ins)
    dtypes = tuple(m.dtype for m in metas)
    if all(s == shape or math.prod(s) == 1 for s in arg_shapes):
        full = tuple(s == shape for s in arg_shapes)
        return Tile("flat", shape, dtypes, full, tiling.tile_elements, arg_shapes)
    if len(shape) >= 2 and shape[0] >= 2:
        row = math.prod(shape[1:])
        full = tuple(len(s) == len(shape) and s[0] == shape[0] for s in arg_shapes)
        ok = all(f or len(s) < len(shape) or s[0] == 1 for s, f in zip(arg_shapes, full))
        step = max(1, tiling.tile_elements // max(row, 1))
        if ok and step < shape[0]:
            return Tile("rows", shape, dtypes, full, step, arg_shapes)
    return None


def _inplace_choices(body: Graph) -> dict[str, tuple[Op, int]]:
    """Node → (in-place op, index of the argument it overwrites) where that is safe.

    Safe: the argument has the result's shape and dtype and is a fresh
    intermediate of the body (or a reshape/permute of one) that nothing else
    reads: not an input, not a body output, not an overlapping view.
    """
    outputs = {r.name for r in body.output_refs}
    out: dict[str, tuple[Op, int]] = {}
    for node in body.call_nodes():
        variant = P.inplace_variant(node.op)
        if variant is None or not isinstance(node.meta, TensorMeta):
            continue
        positions = [0, 1] if node.op in P.COMMUTATIVE and "alpha" not in node.attrs else [0]
        for pos in positions:
            arg = node.inputs[pos] if pos < len(node.inputs) else None
            meta = body.node(arg.name).meta if isinstance(arg, Ref) else None
            if (isinstance(meta, TensorMeta) and meta.shape == node.meta.shape and meta.dtype == node.meta.dtype
                    and _writable(body, arg.name, outputs)):
                out[node.name] = (variant, pos)
                break
    return out


def _writable(body: Graph, name: str, outputs: set[str]) -> bool:
    aliases = P.SHAPE_OPS | P.PERMUTE_OPS | P.SQUEEZE_OPS | {P.UNSQUEEZE}
    while True:
        node = body.node(name)
        if node.op in (INPUT, GETITEM) or name in outputs or len(body.users(name)) != 1:
            return False
        if node.op not in aliases:
            return node.op not in P.VIEW_LIKE
        if not isinstance(node.inputs[0], Ref):
            return False
        name = node.inputs[0].name


def _emit_python(body: Graph, name: str, inplace: dict[str, tuple[Op, int]]) -> tuple[str, Callable[..., Any]]:
    env: dict[str, Any] = {"torch": torch}
    local: dict[str, str] = {}
    args = []
    for i, node in enumerate(body.input_nodes):
        local[node.name] = f"a{i}"
        args.append(f"a{i}")
    lines = [f"def {name}({', '.join(args)}):"]
    for node in body.call_nodes():
        var = local[node.name] = f"v{len(local) - len(args)}"
        rename = lambda r: _Name(local[r.name])  # noqa: E731
        if node.op == GETITEM:
            src, index = node.inputs
            lines.append(f"    {var} = {local[src.name]}[{index}]")
            continue
        op, inputs = node.op, list(node.inputs)
        if node.name in inplace:
            op, pos = inplace[node.name]
            if pos:
                inputs[0], inputs[pos] = inputs[pos], inputs[0]
        fname = f"_f{len(env)}"
        env[fname] = op.resolve()
        text = [_lit(_rename(v, rename), env) for v in inputs]
        text += [f"{k}={_lit(_rename(v, rename), env)}" for k, v in node.attrs.items()]
        lines.append(f"    {var} = {fname}({', '.join(text)})  # {op}")
    outs = [local[r.name] for r in body.output_refs]
    lines.append(f"    return {outs[0] if len(outs) == 1 else '(' + ', '.join(outs) + ',)'}")
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<mlcomp {name}>", "exec"), env)  # noqa: S102 - our own generated code
    return source, env[name]


def _emit_script(body: Graph, name: str, tile: Tile | None) -> str:
    """TorchScript source of the body and of a tiled driver ``tiled`` (ops unqualified)."""
    assert tile is not None
    local: dict[str, str] = {}
    args = []
    for i, node in enumerate(body.input_nodes):
        local[node.name] = f"a{i}"
        args.append(f"a{i}: Tensor")
    n_out = len(body.output_refs)
    ret = "Tensor" if n_out == 1 else "Tuple[" + ", ".join(["Tensor"] * n_out) + "]"
    lines = [f"def body({', '.join(args)}) -> {ret}:"]
    inplace = _inplace_choices(body)
    for node in body.call_nodes():
        var = local[node.name] = f"v{len(local) - len(args)}"
        op, inputs = node.op, list(node.inputs)
        if node.name in inplace:
            op, pos = inplace[node.name]
            if pos:
                inputs[0], inputs[pos] = inputs[pos], inputs[0]
        schema = {a.name: str(a.type) for a in op.resolve()._schema.arguments}
        order = list(schema)
        rename = lambda r: _Name(local[r.name])  # noqa: E731
        text = [_script_lit(_rename(v, rename), schema.get(order[i]) if i < len(order) else None)
                for i, v in enumerate(inputs)]
        text += [f"{k}={_script_lit(_rename(v, rename), schema.get(k))}" for k, v in node.attrs.items()]
        lines.append(f"    {var} = torch.ops.aten.{op.name}({', '.join(text)})")
    outs = [local[r.name] for r in body.output_refs]
    lines.append(f"    return {outs[0] if n_out == 1 else '(' + ', '.join(outs) + ')'}")
    names = [f"a{i}" for i in range(len(body.input_nodes))]
    shape = list(tile.shape)
    drv = [f"def tiled({', '.join(a + ': Tensor' for a in names)}) -> {ret}:"]
    for j, dt in enumerate(tile.dtypes):
        drv.append(f"    o{j} = torch.empty({shape}, dtype={dt}, device={names[0]}.device)")
    if tile.mode == "flat":                     # full arguments flattened, one-element ones as [1]
        for a, full, s in zip(names, tile.full, tile.arg_shapes):
            drv.append(f"    p_{a} = {a}.reshape([-1])" if full else
                       f"    p_{a} = {a}.reshape([1])" if s else f"    p_{a} = {a}")
        for j in range(n_out):
            drv.append(f"    d{j} = o{j}.view([-1])")
        drv.append(f"    n = {math.prod(tile.shape)}")
    else:
        drv += [f"    p_{a} = {a}" for a in names] + [f"    d{j} = o{j}" for j in range(n_out)]
        drv.append(f"    n = {tile.shape[0]}")
    drv.append(f"    for i in range(0, n, {tile.step}):")
    drv.append(f"        m = min({tile.step}, n - i)")
    call = ", ".join(f"p_{a}.narrow(0, i, m)" if full else f"p_{a}" for a, full in zip(names, tile.full))
    drv.append(f"        r = body({call})")
    for j in range(n_out):
        drv.append(f"        d{j}.narrow(0, i, m).copy_({'r' if n_out == 1 else f'r[{j}]'})")
    outs_text = "o0" if n_out == 1 else "(" + ", ".join(f"o{j}" for j in range(n_out)) + ")"
    drv.append(f"    return {outs_text}")
    return "\n".join(lines + [""] + drv) + "\n"


class _Name(str):
    """A variable name inside generated code (printed bare)."""


def _rename(value: Any, fn: Callable[[Ref], Any]) -> Any:
    if isinstance(value, Ref):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_rename(v, fn) for v in value)
    return value


def _lit(value: Any, env: dict[str, Any]) -> str:
    """Python source for a literal argument (objects without one become globals)."""
    if isinstance(value, _Name):
        return str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float('{value}')"
    if isinstance(value, list):
        return "[" + ", ".join(_lit(v, env) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + "".join(_lit(v, env) + ", " for v in value) + ")"
    key = f"_c{len(env)}"
    env[key] = value
    return key


def _script_lit(value: Any, schema_type: str | None) -> str:
    if isinstance(value, _Name):
        return str(value)
    if schema_type == "Tensor" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"torch.tensor({_script_lit(value, None)})"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"float('{value}')"
    if value is None or isinstance(value, (bool, int)):
        return repr(value)
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_script_lit(v, None) for v in value) + "]"
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, torch.device):
        return f"torch.device('{value}')"
    raise TypeError(f"no TorchScript literal for {value!r}")
