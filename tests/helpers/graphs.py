"""Small hand-built graphs more than one test file uses."""
from __future__ import annotations

import torch

from mlcomp.ir import Graph
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.ops import aten


def linear_softmax_exp() -> Graph:
    """linear → softmax → exp (``tiny``): one op of each kind the precision tables disagree on."""
    b = GraphBuilder("tiny")
    x = b.input("x", (2, 8))
    w = b.param("fc.weight", torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
    bias = b.param("fc.bias", torch.randn(4, generator=torch.Generator().manual_seed(1)))
    mm = b.call(aten("addmm"), bias, x, b.call(aten("t"), w, origin="fc"), origin="fc")
    sm = b.call(aten("_softmax"), mm, -1, False, origin="act")
    return b.output(b.call(aten("exp"), sm, origin="act"))
