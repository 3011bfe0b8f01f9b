"""Backward formulas the joint trace spells out where eager autograd calls one fused kernel.

Some derivative formulas depend on grad mode: eager ``loss.backward()`` runs them with
grad mode off and calls the fused kernel, while the joint trace runs them with grad
mode on (so the backward could itself be differentiated) and records the composite
form.  The two round differently, so the compiled gradients would drift from eager's
by fp32 noise.  :func:`restore_backward_kernels` rewrites each composite occurrence in
the traced fx graph back to the kernel eager calls, listed in :data:`COMPOSITES`:

======================  =====================================================  ======================
forward                 composite the trace records                            kernel eager calls
======================  =====================================================  ======================
``silu(x)``             ``g * (sigmoid(x) * (1 + x * (1 - sigmoid(x))))``       ``silu_backward(g, x)``
======================  =====================================================  ======================

A match needs the exact node shape: anything else is left as traced (still correct,
only not bit for bit eager's).

Other ops are decomposed before autograd sees them: ``torch._decomp`` registers Python
kernels for them at the ``Autograd`` (and ``CompositeImplicitAutograd``) dispatch keys, which
only the tracer's Python dispatcher runs, so the trace differentiates the decomposition
(gathers, weights, ``index_put`` accumulations) where eager calls the op's kernel and its
backward kernel.  :func:`eager_autograd` lifts those Python kernels for the ops of
:data:`EAGER_AUTOGRAD` while the joint graph is traced (restored after, whatever happens),
so the trace records the kernels eager calls:

==================================  ==========================================================
op                                  what the trace then records
==================================  ==========================================================
``upsample_bilinear2d.vec``         ``upsample_bilinear2d`` (torch's own size computation)
``upsample_bilinear2d.default``     itself, differentiated by ``upsample_bilinear2d_backward``
==================================  ==========================================================
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey

__all__ = ["COMPOSITES", "EAGER_AUTOGRAD", "eager_autograd", "restore_backward_kernels"]

# ops whose tracing-only Python kernels are lifted during the joint trace (module doc)
EAGER_AUTOGRAD = ("upsample_bilinear2d.vec", "upsample_bilinear2d.default")
_LIFTED_KEYS = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)

_aten = torch.ops.aten


def _is(node: Any, *targets: Any) -> bool:
    return getattr(node, "op", None) == "call_function" and node.target in targets


def _silu_backward(node: Any) -> tuple[Any, Any] | None:
    """``(g, x)`` when ``node`` is ``g * (sigmoid(x) * (1 + x * (1 - sigmoid(x))))`` (either operand order)."""
    if not _is(node, _aten.mul.Tensor):
        return None
    for grad, inner in (node.args, node.args[::-1]):
        if not _is(inner, _aten.mul.Tensor):
            continue
        for sig, plus in (inner.args, inner.args[::-1]):
            if not (_is(sig, _aten.sigmoid.default) and _is(plus, _aten.add.Scalar) and plus.args[1] == 1):
                continue
            x = sig.args[0]
            prod = plus.args[0]
            if _is(prod, _aten.mul.Tensor) and x in prod.args:
                rest = prod.args[1] if prod.args[0] is x else prod.args[0]
                if _is(rest, _aten.sub.Tensor) and rest.args[1] is sig and _one(rest.args[0]):
                    return grad, x
    return None


def _one(node: Any) -> bool:
    """``1`` or ``full_like(…, 1)`` (how ``1 - t`` is traced)."""
    return node == 1 or (_is(node, _aten.full_like.default) and node.args[1] == 1)


# matcher -> the fused kernel it stands for
COMPOSITES: dict[str, tuple[Callable[[Any], tuple[Any, ...] | None], Any]] = {
    "silu": (_silu_backward, _aten.silu_backward.default),
}


def restore_backward_kernels(gm: torch.fx.GraphModule) -> int:
    """Rewrite every match of :data:`COMPOSITES` in ``gm`` to its kernel; the count.  The composite's
    other nodes are left unread (the joint graph's conversion drops dead nodes)."""
    count = 0
    for node in list(gm.graph.nodes):
        for match, kernel in COMPOSITES.values():
            args = match(node)
            if args is None:
                continue
            with gm.graph.inserting_before(node):
                fused = gm.graph.call_function(kernel, args)
            fused.meta = dict(node.meta)
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            count += 1
            break
    if count:
        gm.recompile()
    return count


def _overload(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


@contextlib.contextmanager
def eager_autograd() -> Iterator[None]:
    """While inside, the ops of :data:`EAGER_AUTOGRAD` dispatch to their C++ kernels under the Python
    dispatcher too (their ``Autograd`` / ``CompositeImplicitAutograd`` Python kernels lifted)."""
    lifted: list[tuple[Any, DispatchKey, Any]] = []
    try:
        for name in EAGER_AUTOGRAD:
            op = _overload(name)
            lifted += [(op, key, op.py_kernels.pop(key)) for key in _LIFTED_KEYS if key in op.py_kernels]
            op._dispatch_cache.clear()
        yield
    finally:
        for op, key, kernel in lifted:
            op.py_kernels[key] = kernel
            op._dispatch_cache.clear()
