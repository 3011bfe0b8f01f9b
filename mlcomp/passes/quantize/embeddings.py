"""Embedding tables in int8: the lookup reads int8 rows and their scales, then scales them.

A model's embedding tables are most of its file when its layers are few (BERT-base's
30522 × 768 word table: 94 MB in float of a 4-layer model's 124 MB).  Each table
becomes an int8 constant with one symmetric scale per row (per token: each row keeps
the precision of its own largest element, so a row of small values is not rounded on
the grid of the largest column); the lookup reads the int8 rows, and the same indices
look up their scales in a ``[rows, 1]`` float table; the rows are converted and scaled
(zero point 0: a cast and a multiply, which every target runs: ONNX Runtime ``Gather`` on
the int8 initializer and on the scales, ``Cast``, ``Mul``; OpenVINO the same ``Gather``,
``Convert``, ``Multiply``), so the table never exists in float::

    %embedding = embedding(%word_embeddings.weight, %ids)                # f32[30522, 768]
                 ↓ quantize_embeddings
    %embedding_q = embedding(%word_embeddings.weight.int8, %ids)         # i8[30522, 768]
    %embedding_s = embedding(%word_embeddings.weight.scale, %ids)        # f32[30522, 1]: one per row
    %embedding_f = _to_copy(%embedding_q, dtype=torch.float32)
    %embedding = mul(%embedding_f, %embedding_s)

Tables smaller than :data:`SMALLEST` elements stay float (a token-type table: two rows,
nothing to gain).  The rounding is at most half a step of each row's ``max |w| / 127``
(a scale per column, over all 30522 rows, makes BERT's output error 6 % larger: its
steps are those of the column's largest element); the pass's measured metric includes it.
O(tables).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from mlcomp.ir import Graph, Ref, TensorMeta
from mlcomp.ir.builder import new_node, remove_dead
from mlcomp.ir.graph_tools import producer
from mlcomp.ir.ops import PARAM, aten
from mlcomp.passes.quantize.observe import int8_weight
from mlcomp.passes.quantize.selection import excluded_by

__all__ = ["quantize_embeddings", "SMALLEST"]

SMALLEST = 4096          # elements: smaller tables keep float
_EMBEDDING = aten("embedding")


def quantize_embeddings(graph: Graph, exclude: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Rewrite each large float table an ``embedding`` reads (not named by ``exclude``) to int8, in place;
    one record per table."""
    records = []
    for node in [n for n in graph.call_nodes() if n.op == _EMBEDDING]:
        table = producer(graph, node.inputs[0])
        if table is None or table.op != PARAM or excluded_by(node, exclude) is not None \
                or not isinstance(node.meta, TensorMeta) or len(graph.users(table.name)) != 1:
            continue
        w = graph.constants[table.name]
        if w.dim() != 2 or not w.is_floating_point() or w.numel() < SMALLEST:
            continue
        scales, q = int8_weight(w, 0)
        scales = scales.to(w.dtype).reshape(-1, 1)
        q_ref = Ref(graph.add_constant(graph.fresh_name(f"{table.name}.int8"), q, origin=table.origin).name)
        s = Ref(graph.add_constant(graph.fresh_name(f"{table.name}.scale"), scales).name)
        looked = new_node(graph, _EMBEDDING, (q_ref, *node.inputs[1:]), dict(node.attrs),
                          name=f"{node.name}_q", origin=node.origin, before=node.name)
        row_scales = new_node(graph, _EMBEDDING, (s, *node.inputs[1:]), dict(node.attrs),
                              name=f"{node.name}_s", origin=node.origin, before=node.name)
        cast = new_node(graph, aten("_to_copy"), (Ref(looked.name),), {"dtype": w.dtype},
                        name=f"{node.name}_f", origin=node.origin, before=node.name)
        dq = new_node(graph, aten("mul.Tensor"), (Ref(cast.name), Ref(row_scales.name)), name=f"{node.name}_dq",
                      origin=node.origin, before=node.name)
        graph.replace_all_uses(node.name, Ref(dq.name))
        remove_dead(graph, [node.name, table.name])
        records.append({"node": node.name, "table": table.name, "module": node.origin.module_path,
                        "shape": list(w.shape), "scale_min": float(scales.min()), "scale_max": float(scales.max())})
    return records
