"""The ONNX emitter's rules for layers: matrix products, convolutions, pools, norms, embedding, GRU.

Each emits the one ONNX op ORT's optimiser and kernels are built around, so the model runs
as fast as a direct ``torch.onnx.export`` of the eager module::

    %permute = aten.permute.default(%fc.weight, [1, 0])
    %addmm = aten.addmm.default(%fc.bias, %x, %permute)       addmm = Gemm(x, fc.weight, fc.bias), transB=1
    %conv = aten.convolution.default(%x, %w, %b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
                                                              conv = Conv(x, w, b), pads=[1,1,1,1]
    %bn = aten._native_batch_norm_legit_no_training(%conv, …, 0.1, 1e-05)
                                                              bn = BatchNormalization(…), epsilon=1e-05
    %gru = aten.gru.input(%x, %h0, [%w_ih, %w_hh, %b_ih, %b_hh], True, 1, 0.0, False, False, True)
                                                              Y, Y_h = GRU(x', W, R, B, '', h0)

The permute of ``addmm``'s weight is folded (``transB=1``), the weight kept in torch's
``[N, K]`` layout; ORT folds the batch norm into the convolution before it.  GRU:
``linear_before_reset=1`` is torch's cell.  GRU gate blocks are reordered from torch's (r, z, n)
to ONNX's (z, r, h) once, as new initializers; a GRU whose weights are computed values is declined.

A bias that is a parameter of zeros (HF GPT-2/BERT/ViT initialise every linear bias to zero) is
left off ``Gemm``, ``Conv`` and ``ConvTranspose``, as onnxscript's optimizer does on torch.onnx's
path (``RemoveOptionalBiasFrom*``): ORT's ``Gemm`` otherwise broadcasts the bias into its output
before every product (GPT-2@2: 1.7 % of the call, the whole gap to plain ORT)::

    %addmm = aten.addmm.default(%c_attn.bias, %x, %c_attn.weight)      (c_attn.bias all zeros)
                                                              addmm = Gemm(x, c_attn.weight)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mlcomp.ir import Node, Ref
from mlcomp.ir.ops import aten
from mlcomp.targets.onnx.emit_quant import QUANT_RULES, dynamic_gemm, static_gemm
from mlcomp.targets.onnx.emit_ops import Decline, Rule, out_dtype

if TYPE_CHECKING:
    from mlcomp.targets.onnx.emit import Emitter

__all__ = ["NN_RULES"]

_PERMUTE = aten("permute")
_TRANSPOSES = (aten("t"), aten("transpose.int"))


def _transposed_2d(em: Emitter, value: Any) -> Ref | None:
    """``w`` when ``value`` is ``permute(w, [1, 0])`` (or ``t(w)``) of a 2-D ``w``, else ``None``."""
    if not isinstance(value, Ref):
        return None
    node = em.node_of(value)
    if node.op == _PERMUTE and [d % 2 for d in node.inputs[1]] == [1, 0]:
        return node.inputs[0]
    if node.op in _TRANSPOSES and len(em.meta(node.inputs[0]).shape) == 2:
        return node.inputs[0]
    return None


def _zero(em: Emitter, value: Any) -> bool:
    """Whether ``value`` is a parameter whose every element is zero (adding it changes nothing)."""
    tensor = em.constant(value) if isinstance(value, Ref) else None
    return tensor is not None and not bool(torch.count_nonzero(tensor))


def _gemm(em: Emitter, node: Node, a: dict[str, Any], bias: Any) -> None:
    dtype = out_dtype(node)
    mat1, mat2 = a["mat1"] if "mat1" in a else a["self"], a["mat2"]
    folded = _transposed_2d(em, mat2)
    beta, alpha = a.get("beta", 1), a.get("alpha", 1)
    if alpha == 1 and beta == 1 and (dynamic_gemm(em, node, mat1, folded, bias)
                                     or static_gemm(em, node, mat1, mat2, folded, bias)):
        return
    if bias is None and folded is None and alpha == 1:
        em.add("MatMul", [em.value(mat1, dtype), em.value(mat2, dtype)], out=node.name)
        return
    inputs = [em.value(mat1, dtype), em.value(folded if folded is not None else mat2, dtype)]
    # beta=0: ATen ignores the bias (even NaN in it); a bias of zeros adds nothing
    if bias is not None and beta != 0 and not _zero(em, bias):
        inputs.append(em.value(bias, dtype, hint=f"{node.name}/bias"))
    attrs = {"transB": 1} if folded is not None else {}
    if alpha != 1:
        attrs["alpha"] = float(alpha)
    if beta not in (0, 1) and len(inputs) == 3:
        attrs["beta"] = float(beta)
    em.add("Gemm", inputs, out=node.name, **attrs)


def _addmm(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    _gemm(em, node, a, a["self"])


def _mm(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    _gemm(em, node, a, None)


def _bmm(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    dtype = out_dtype(node)
    em.add("MatMul", [em.value(a["self"], dtype), em.value(a["mat2"], dtype)], out=node.name)


def _ints(value: Any, n: int) -> list[int]:
    values = [value] * n if isinstance(value, int) else list(value)
    return values * n if len(values) == 1 and n > 1 else values


def _convolution(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    weight = em.meta(a["weight"])
    spatial = len(weight.shape) - 2
    if spatial < 1 or len(em.meta(a["input"]).shape) != spatial + 2:
        raise Decline("an unbatched or 0-d convolution")
    pads = _ints(a["padding"], spatial)
    attrs = {"strides": _ints(a["stride"], spatial), "dilations": _ints(a["dilation"], spatial),
             "pads": pads + pads, "group": int(a["groups"]), "kernel_shape": list(weight.shape[2:])}
    dtype = out_dtype(node)
    inputs = [em.value(a["input"], dtype), em.value(a["weight"], dtype)]
    if a["bias"] is not None and not _zero(em, a["bias"]):
        inputs.append(em.value(a["bias"], dtype))
    if a["transposed"]:      # torch's [C_in, C_out/groups, k…] is ONNX ConvTranspose's layout
        attrs["output_padding"] = _ints(a["output_padding"], spatial)
        em.add("ConvTranspose", inputs, out=node.name, **attrs)
    else:
        if any(_ints(a["output_padding"], spatial)):
            raise Decline("output_padding on a forward convolution")
        em.add("Conv", inputs, out=node.name, **attrs)


def _ones_or(em: Emitter, value: Any, channels: int, fill: float, dtype: torch.dtype, hint: str) -> str:
    if value is not None:
        return em.value(value, dtype)
    return em.const(torch.full((channels,), fill), dtype, hint)


def _batch_norm(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    """Eval-mode batch norm; its saved statistics (elements 1, 2) are empty in ATen and not emitted."""
    if any((node.name, i) in em._items for i in (1, 2)):
        raise Decline("the saved statistics are read")
    shape = em.meta(a["input"]).shape
    if len(shape) < 2:
        raise Decline("an input without a channel axis")
    dtype, channels = out_dtype(node), shape[1]
    inputs = [em.value(a["input"], dtype),
              _ones_or(em, a["weight"], channels, 1.0, dtype, f"{node.name}/scale"),
              _ones_or(em, a["bias"], channels, 0.0, dtype, f"{node.name}/bias"),
              em.value(a["running_mean"], dtype), em.value(a["running_var"], dtype)]
    out = em.outs(node, 1)[0]
    em.add_multi("BatchNormalization", inputs, [out], epsilon=float(a["eps"]))


def _layer_norm(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    shape = em.meta(a["input"]).shape
    normalized = list(a["normalized_shape"])
    if not normalized or list(shape[len(shape) - len(normalized):]) != normalized:
        raise Decline(f"normalized_shape {normalized} is not the input's trailing shape")
    dtype = out_dtype(node)
    scale = a["weight"] if a["weight"] is not None else None
    inputs = [em.value(a["input"], dtype),
              em.value(scale, dtype) if scale is not None else
              em.const(torch.ones(normalized), dtype, f"{node.name}/scale")]
    if a["bias"] is not None:
        inputs.append(em.value(a["bias"], dtype))
    outs = em.outs(node, 3, optional=True)
    rows = _residual_rows(em, node, a["input"], inputs[0], shape, outs) if len(normalized) == 1 else None
    if rows is None:
        em.add_multi("LayerNormalization", inputs, outs, axis=-len(normalized), epsilon=float(a["eps"]))
        return
    normed = em.add("LayerNormalization", [rows, *inputs[1:]], hint=f"{node.name}/rows", axis=-1,
                    epsilon=float(a["eps"]))
    back = [-1, *shape[1:]] if isinstance(shape[0], str) else list(shape)
    em.add_multi("Reshape", [normed, em.ints(back, f"{node.name}/shape")], outs)


def _residual_rows(em: "Emitter", node: Node, x: Any, value: str, shape: tuple[Any, ...],
                   outs: list[str]) -> str | None:
    """The residual sum read by a layer norm, written again as a sum of ``[rows, width]`` matrices, or ``None``.

    ORT's ``SkipLayerNormFusion`` turns a 3-D ``Add`` whose only reader is a ``LayerNormalization``
    into ``SkipLayerNormalization``, whose float CPU kernel normalises each row in a scalar loop with a
    division per element: several times the ``Add`` and vectorised ``LayerNormalization`` it replaces.
    The fusion takes only 3-D operands, so the sum and the norm run on the rows (free ``Reshape`` views)
    and the norm's output takes the 3-D shape back::

        before: %add = Add(%a, %b)  [B, S, H];  %ln = LayerNormalization(%add)
        after:  %ln = Reshape(LayerNormalization(Add(Reshape(%a, [-1, H]), Reshape(%b, [-1, H]))), [B, S, H])
    """
    made = em.source_of(value, "Add") if isinstance(x, Ref) else None
    static = len(shape) == 3 and all(isinstance(d, int) for d in shape[1:])
    if made is None or not static or len(outs) != 1 or em.graph.num_users(x.name) != 1:
        return None
    operands = em.node_of(x).inputs[:2]
    if not all(isinstance(v, Ref) and tuple(em.meta(v).shape) == tuple(shape) for v in operands):
        return None
    flat = em.ints([-1, shape[-1]], f"{node.name}/rows_shape")
    parts = [em.add("Reshape", [v, flat], hint=f"{v}/rows") for v in made[0]]
    return em.add("Add", parts, hint=f"{x.name}/rows")


def _pool_attrs(a: dict[str, Any], spatial: int = 2) -> dict[str, Any]:
    kernel = _ints(a["kernel_size"], spatial)
    stride = _ints(a["stride"], spatial) if a["stride"] else kernel      # [] means the kernel size
    pads = _ints(a["padding"], spatial)
    if a["ceil_mode"]:
        raise Decline("ceil_mode=True (ONNX and ATen place the last window differently)")
    return {"kernel_shape": kernel, "strides": stride, "pads": pads + pads}


def _check_4d(em: Emitter, a: dict[str, Any]) -> None:
    if len(em.meta(a["self"]).shape) != 4:
        raise Decline("an unbatched (3-D) pooling input")


def _avg_pool(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    _check_4d(em, a)
    if a["divisor_override"] is not None:
        raise Decline("divisor_override")
    attrs = _pool_attrs(a)
    em.add("AveragePool", [em.value(a["self"])], out=node.name, count_include_pad=int(a["count_include_pad"]),
           **attrs)


def _max_pool(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    _check_4d(em, a)
    attrs = _pool_attrs(a)
    dilations = _ints(a["dilation"], 2)
    if any(d != 1 for d in dilations):
        attrs["dilations"] = dilations
    if isinstance(node.meta, tuple):              # max_pool2d_with_indices: the values only
        if (node.name, 1) in em._items:
            raise Decline("the indices are read")
        em.add_multi("MaxPool", [em.value(a["self"])], em.outs(node, 1), **attrs)
    else:
        em.add("MaxPool", [em.value(a["self"])], out=node.name, **attrs)


def _adaptive_avg_pool(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    _check_4d(em, a)
    size = em.meta(a["self"]).shape[2:]
    out = _ints(a["output_size"], 2)
    if out == [1, 1]:
        em.add("GlobalAveragePool", [em.value(a["self"])], out=node.name)
    elif all(s % o == 0 for s, o in zip(size, out)):   # equal windows: an ordinary average pool
        kernel = [s // o for s, o in zip(size, out)]
        em.add("AveragePool", [em.value(a["self"])], out=node.name, kernel_shape=kernel, strides=kernel)
    else:
        raise Decline(f"adaptive pooling {list(size)} → {out} has unequal windows")


def _embedding(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    em.add("Gather", [em.value(a["weight"]), em.value(a["indices"])], out=node.name, axis=0)


def _zrh(t: torch.Tensor) -> torch.Tensor:
    """torch's gate blocks (r, z, n) → ONNX's (z, r, h), along dim 0."""
    r, z, n = t.detach().chunk(3, dim=0)
    return torch.cat([z, r, n])


def _gru(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    """``aten.gru.input`` → one ONNX ``GRU`` per layer (``linear_before_reset=1`` is torch's cell)."""
    if a["train"] and a["dropout"]:
        raise Decline("dropout in training mode")
    x_meta = em.meta(a["input"])
    if len(x_meta.shape) != 3:
        raise Decline("an unbatched GRU input")
    layers, dirs, has_bias = int(a["num_layers"]), 2 if a["bidirectional"] else 1, bool(a["has_biases"])
    params = list(a["params"])
    per = 4 if has_bias else 2
    if len(params) != layers * dirs * per:
        raise Decline(f"{len(params)} weights for {layers} layer(s)")
    tensors = [em.constant(p) if isinstance(p, Ref) else None for p in params]
    if any(t is None for t in tensors):
        raise Decline("a weight is a computed value, not a parameter")
    dtype = out_dtype(node)
    hidden = tensors[1].shape[1]
    batch_first = bool(a["batch_first"])
    x = em.value(a["input"], dtype)
    if batch_first:
        x = em.add("Transpose", [x], hint=f"{node.name}/x", perm=[1, 0, 2])
    h0 = em.value(a["hx"], dtype)
    finals = []
    for layer in range(layers):
        group = [tensors[(layer * dirs + d) * per:(layer * dirs + d + 1) * per] for d in range(dirs)]
        w = em.const(torch.stack([_zrh(g[0]) for g in group]), dtype, f"{node.name}.W_l{layer}")
        r = em.const(torch.stack([_zrh(g[1]) for g in group]), dtype, f"{node.name}.R_l{layer}")
        b = em.const(torch.stack([torch.cat([_zrh(g[2]), _zrh(g[3])]) for g in group]), dtype,
                     f"{node.name}.B_l{layer}") if has_bias else ""
        h = h0 if layers == 1 else em.add(
            "Slice", [h0, em.ints([layer * dirs], f"{node.name}/h{layer}_start"),
                      em.ints([(layer + 1) * dirs], f"{node.name}/h{layer}_end"), em.ints([0], f"{node.name}/axis0")],
            hint=f"{node.name}/h0_l{layer}")
        y, y_h = em.fresh(f"{node.name}/Y_l{layer}"), em.fresh(f"{node.name}/Yh_l{layer}")
        em.add_multi("GRU", [x, w, r, b, "", h], [y, y_h], hidden_size=int(hidden),
                     direction="bidirectional" if dirs == 2 else "forward", linear_before_reset=1)
        finals.append(y_h)
        if dirs == 1:        # Y: [seq, dirs, batch, hidden] → [seq, batch, dirs * hidden]
            x = em.add("Squeeze", [y, em.ints([1], f"{node.name}/axis1")], hint=f"{node.name}/out_l{layer}")
        else:
            seq, batch = x_meta.shape[1 if batch_first else 0], x_meta.shape[0 if batch_first else 1]
            t = em.add("Transpose", [y], hint=f"{node.name}/t_l{layer}", perm=[0, 2, 1, 3])
            x = em.add("Reshape", [t, em.ints([seq, batch, dirs * hidden], f"{node.name}/shape")],
                       hint=f"{node.name}/out_l{layer}")
    output, h_n = em.outs(node, 2)
    if batch_first:
        em.add_multi("Transpose", [x], [output], perm=[1, 0, 2])
    else:
        em.add_multi("Identity", [x], [output])
    em.add_multi("Concat" if len(finals) > 1 else "Identity", finals, [h_n], **({"axis": 0} if len(finals) > 1 else {}))


NN_RULES: dict[Any, Rule] = {
    **QUANT_RULES,
    aten("addmm"): _addmm, aten("mm"): _mm, aten("bmm"): _bmm,
    aten("convolution"): _convolution,
    aten("_native_batch_norm_legit_no_training"): _batch_norm,
    aten("native_layer_norm"): _layer_norm,
    aten("avg_pool2d"): _avg_pool, aten("max_pool2d"): _max_pool, aten("max_pool2d_with_indices"): _max_pool,
    aten("_adaptive_avg_pool2d"): _adaptive_avg_pool,
    aten("embedding"): _embedding,
    aten("gru.input"): _gru,
}
