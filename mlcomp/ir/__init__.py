"""The IR: a typed dataflow graph of frozen nodes (networkx stays inside ``mlcomp.ir``).

Submodules, bottom up: ``dtypes`` (the one dtype table), ``ops`` (operator
identities), ``opsets`` (operator properties), ``node`` (values, metadata,
annotations), ``constants`` (copy-on-write constant tensors), ``meta`` (shape
inference on meta tensors), ``order`` (the O(1) node order), ``verifier``
(is a graph sound), ``graph_tools`` (analyses and printing over the graph's
public API), ``graph``, ``builder`` (writing IR),
``composites`` (fused kernels), ``interpreter``.
"""
from mlcomp.ir.dtypes import dtype_name, parse_dtype
from mlcomp.ir.graph import Graph
from mlcomp.ir.graph_tools import graph_inputs_meta, outputs_meta, sequence_of
from mlcomp.ir.node import (Annotations, Dim, Mode, Node, Origin, Precision, Ref, TensorMeta, format_meta,
                            format_value, map_refs, refs_in, tensor_metas)

__all__ = ["Graph", "Node", "Ref", "TensorMeta", "Annotations", "Origin", "Precision", "Mode", "Dim",
           "map_refs", "refs_in", "tensor_metas", "format_meta", "format_value", "dtype_name", "parse_dtype",
           "graph_inputs_meta", "outputs_meta", "sequence_of"]
